"""Elastic recovery (issue 6, test 3): `horovodrun --min-np/--max-np --host-discovery-script`
with `ringfeed train --elastic`, on two host names for this machine (`localhost:N`,
`127.0.0.1:1`, as Horovod's own elastic tests do). The discovery script prints a file that the
test rewrites. torch runs 3 -> 2 -> 3 workers; TensorFlow, slower to start and to step on two
cores, 2 -> 1 -> 2.

The worker on 127.0.0.1 is SIGKILLed at a step between two commits and its host disappears from
discovery: the others roll back to the last commit and go on without it. Then the host is
listed again: a new worker starts, receives the state by broadcast, and the job finishes at the
full size. samples.jsonl (the sample ids of every committed step, all ranks) must hold every
sample of every epoch once; the loss must not jump at the resets."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from fault_util import losses, read_jsonl, samples_by_epoch, wait_for, worker_processes
from helpers import BIN, test_env
from train_util import finish, start, toy_config, write_config, write_toy_shards

pytestmark = pytest.mark.system  # each test starts processes (tests/conftest.py)

N_TRAIN, BATCH = 480, 4
COMMIT = 5
# The victim dies as step 43 starts: steps 41-42 are redone from the commit at 40. Late enough
# that the loss is well below a fresh model's: a reset to fresh weights would show.
KILL_STEP = 43
# Enough data that steps are left to grow back to full size even when the smaller job runs
# fast for the few seconds before the host comes back (up to ~270 torch steps at 2 ranks, ~330
# TF steps at 1 rank).
EPOCHS = {"torch": 7, "tensorflow": 5}


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> Path:
    return write_toy_shards(tmp_path_factory.mktemp("toy") / "shards", n_train=N_TRAIN)


def elastic_job(tmp_path: Path, shards: Path, framework: str, full: int):
    hosts = tmp_path / "hosts"
    hosts.write_text(f"localhost:{full - 1}\n127.0.0.1:1\n")
    script = tmp_path / "discover.sh"
    script.write_text(f"#!/bin/sh\ncat {hosts}\n")
    script.chmod(0o755)
    run_dir = tmp_path / "elastic"
    cfg = write_config(tmp_path / "elastic.yaml", **toy_config(
        shards, run_dir, framework,
        # torch: a DataLoader worker per rank, rebuilt at every reset; TF reads in threads
        data={"batch_size": BATCH, "val_split": None,
              "num_workers": 1 if framework == "torch" else 0},
        train={"epochs": EPOCHS[framework], "log_every": 1},
        # lr 0.02 per rank: at the toy config's 0.05 (x3 ranks, momentum 0.9) single steps spike
        # to 2.5x the starting loss and 10-step means reach 0.8 of it with no reset at all
        optim={"lr": 0.02},
        checkpoint={"every_steps": 100, "keep": 2},
        elastic={"commit_every_steps": COMMIT},
        output={"dir": str(run_dir), "tensorboard": False, "sample_log": True}))
    cmd = [BIN / "horovodrun", "-np", str(full), "--min-np", str(full - 1), "--max-np", str(full),
           "--host-discovery-script", script, "--network-interface", "lo",
           "--blacklist-cooldown-range", "1", "1", "--gloo",  # the failed host may return
           BIN / "ringfeed", "train", cfg, "--elastic"]
    # A survivor blocked on a message from another survivor (which saw the failure first) only
    # gives up after Gloo's timeout (30 s by default); it must still exceed the time a joining
    # worker takes to start.
    env = test_env(RINGFEED_FAULT=f"kill-at-step:{KILL_STEP}:host=127.0.0.1",
                   HOROVOD_GLOO_TIMEOUT_SECONDS="15")
    return start(cmd, env), hosts, run_dir


def reset_events(run_dir: Path) -> list[dict]:
    try:
        return [r for r in read_jsonl(run_dir / "metrics.jsonl")
                if r.get("event") == "elastic_reset"]
    except (FileNotFoundError, json.JSONDecodeError):
        return []


@pytest.mark.parametrize("framework, full", [("torch", 3), ("tensorflow", 2)])
def test_elastic_worker_killed_then_host_back(tmp_path, shards, framework, full):
    job, hosts, run_dir = elastic_job(tmp_path, shards, framework, full)
    try:
        # shrink: the worker on 127.0.0.1 kills itself at KILL_STEP; its host goes away
        assert wait_for(lambda: worker_processes(job.pid, HOROVOD_HOSTNAME="127.0.0.1"), 120)
        (victim,) = worker_processes(job.pid, HOROVOD_HOSTNAME="127.0.0.1")
        assert wait_for(lambda: not victim.is_running() or victim.status() == "zombie", 240)
        hosts.write_text(f"localhost:{full - 1}\n")
        # training goes on without it for a while ...
        assert wait_for(lambda: any(e["size"] == full - 1 for e in reset_events(run_dir)), 240)
        at = reset_events(run_dir)[0]["step"]
        assert wait_for(lambda: max(losses(run_dir), default=0) >= at + 2 * COMMIT, 120)
        # grow: the host is back; a new worker joins
        hosts.write_text(f"localhost:{full - 1}\n127.0.0.1:1\n")
    finally:
        code, output = finish(job, timeout=300)
    assert code == 0, output[-6000:]

    events = reset_events(run_dir)
    assert [e["size"] for e in events] == [full - 1, full], events
    shrink, grow = events
    # rolled back to the commit before the kill; steps since then redone (the victim may take
    # the last step's messages with it: then one step less was complete)
    assert shrink["step"] == COMMIT * ((KILL_STEP - 1) // COMMIT)
    assert 1 <= shrink["steps_redone"] <= KILL_STEP - 1 - shrink["step"], shrink
    assert grow["steps_redone"] == 0 and grow["step"] % COMMIT == 0  # a clean commit point
    assert "rolled back" in output and f"elastic: {full} rank(s) from step" in output

    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "finished" and summary["world_size"] == full
    recovery = summary["recovery"]
    assert recovery["elastic_resets"] == 2 and recovery["rollbacks"] == 1
    assert recovery["steps_redone"] == shrink["steps_redone"]
    assert f"2 elastic reset(s), 1 rollback(s) ({shrink['steps_redone']} step(s) redone)" \
        in output

    # Every sample of every epoch trained on once by the committed steps, at full, then one
    # less, then full size. The pipeline's guarantee across world sizes (pipeline/README.md): at
    # most once; exactly once but for the drop tail of the epoch's last segment, under N*b
    # samples (N, b of that segment). 480 divides by 1, 2 and 3 x 4: an epoch at one size drops
    # none.
    epochs = samples_by_epoch(run_dir)
    records = read_jsonl(run_dir / "samples.jsonl")
    assert sorted(epochs) == list(range(EPOCHS[framework]))
    for epoch, ids in epochs.items():
        assert len(ids) == len(set(ids)), f"epoch {epoch}: a sample trained twice"
        assert set(ids) <= set(range(N_TRAIN))
        sizes = [len(r["ids"]) for r in records if r["epoch"] == epoch]
        missing = N_TRAIN - len(ids)
        assert missing < sizes[-1] * BATCH, (epoch, missing)
        if len(set(sizes)) == 1:
            assert missing == 0, (epoch, missing)
    sizes = [len(r["ids"]) for r in records]
    runs = [sizes[0]] + [b for a, b in zip(sizes, sizes[1:], strict=False) if a != b]
    assert runs == [full, full - 1, full], runs
    assert sizes.index(full - 1) == shrink["step"]
    assert sizes.index(full, shrink["step"]) == grow["step"]

    # The loss curve: no jump at either reset beyond the rollback. Over 10 steps the loss
    # after a reset stays near the loss before it, and below what a model restarted from fresh
    # weights shows over its first 10 steps. Measured on this model and data with plain torch,
    # 6 seeds: 10-step means after step 35 at most 0.30 (3 ranks) / 0.43 (2 ranks) of the
    # starting loss; a fresh model's first 10 steps 0.90-1.07 of it.
    loss = losses(run_dir)
    start_loss = sum(loss[s] for s in range(1, 4)) / 3
    for event in events:
        s = event["step"]
        before = sum(loss[i] for i in range(s - 9, s + 1)) / 10
        after = sum(loss[i] for i in range(s + 1, s + 11)) / 10
        assert after < before + 0.25 * start_loss and after < 0.6 * start_loss, \
            (event, start_loss, before, after)
    last = sorted(loss)[-50:]  # and it learned (measured: 0.08-0.12 of the starting loss)
    assert sum(loss[s] for s in last) / len(last) < 0.4 * start_loss

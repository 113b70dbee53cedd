"""Elastic recovery (issue 6, test 3): `horovodrun --min-np/--max-np --host-discovery-script`
with `ringfeed train --elastic`, on two host names for this machine (`localhost:N`,
`127.0.0.1:1`, as Horovod's own elastic tests do). The discovery script prints a file that the
test rewrites. torch runs 3 -> 2 -> 3 workers; TensorFlow, slower to start and to step on two
cores, 2 -> 1 -> 2.

The worker on 127.0.0.1 is SIGKILLed at a step between two commits and its host disappears from
discovery: the others roll back to the last commit and go on without it. Then the host is
listed again: a new worker starts, receives the state by broadcast, and the job finishes at the
full size. samples.jsonl (the sample ids of every committed step, all ranks) must hold every
sample of every epoch once; the loss must not jump at the resets.

samples.jsonl is the trainer's own account, rewound by the trainer at a rollback: a rollback
that left the abandoned steps' updates in the weights would still pass it. So the model is a
user model that logs every training forward, outside the trainer (tests/train_util.py,
recording_mlp: the rows and a digest of the weights it trains from). From that log alone the
committed steps are found (a rolled-back step is one whose weights nobody trained on after the
rollback), and they must feed every sample once per epoch; replayed in this process from the
first weights (torch / Keras SGD, lr x world size of each step), they must give the job's
final weights and every committed step's logged loss within REPLAY_TOLERANCE."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from fault_util import losses, read_jsonl, samples_by_epoch, wait_for, worker_processes
from helpers import BIN, REPO, test_env
from train_util import (
    AUDIT_ENV,
    audited_rows,
    checkpoint_arrays,
    committed_steps,
    finish,
    first_weights,
    max_difference,
    replay,
    start,
    toy_arrays,
    toy_config,
    toy_row_ids,
    write_config,
    write_toy_shards,
)

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
LR, MOMENTUM = 0.02, 0.9
CHECKPOINT_EVERY = 100  # to disk, for restarts of the whole job
# The replay of the audited committed steps in one process against the job: the largest
# differences measured (3 runs per framework, CPU fp32) were 9.5e-7 in the final weights and
# 1.3e-6 in a step's loss (absolute), from the allreduce's reduction order over some 300 steps;
# one TensorFlow run of a full suite (2026-11-26) gave 1.06e-5 in the final weights. Asserted:
# 5e-5. The test also shows that one committed step left out of the replay ends more than 10x
# that far from the job (the smallest error the audit is there to catch).
REPLAY_TOLERANCE = 5e-5


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
    audit = tmp_path / "audit"
    audit.mkdir()
    cfg = write_config(tmp_path / "elastic.yaml", **toy_config(
        shards, run_dir, framework,
        # logs every training forward outside the trainer (tests/train_util.py)
        model={"name": "train_util:recording_mlp", "args": {"num_classes": 3, "hidden": [16]}},
        # torch: a DataLoader worker per rank, rebuilt at every reset; TF reads in threads
        data={"batch_size": BATCH, "val_split": None,
              "num_workers": 1 if framework == "torch" else 0},
        train={"epochs": EPOCHS[framework], "log_every": 1},
        # lr 0.02 per rank: at the toy config's 0.05 (x3 ranks, momentum 0.9) single steps spike
        # to 2.5x the starting loss and 10-step means reach 0.8 of it with no reset at all
        optim={"lr": LR, "momentum": MOMENTUM},
        checkpoint={"every_steps": CHECKPOINT_EVERY, "keep": 2},
        elastic={"commit_every_steps": COMMIT},
        output={"dir": str(run_dir), "tensorboard": False, "sample_log": True}))
    cmd = [BIN / "horovodrun", "-np", str(full), "--min-np", str(full - 1), "--max-np", str(full),
           "--host-discovery-script", script, "--network-interface", "lo",
           "--blacklist-cooldown-range", "1", "1", "--gloo",  # the failed host may return
           BIN / "ringfeed", "train", cfg, "--elastic"]
    # A survivor blocked on a message from another survivor (which saw the failure first) only
    # gives up after Gloo's timeout; it must still exceed the time a joining worker takes to
    # start: over 15 s for a TensorFlow worker while another test runs beside this one.
    env = test_env(RINGFEED_FAULT=f"kill-at-step:{KILL_STEP}:host=127.0.0.1",
                   HOROVOD_GLOO_TIMEOUT_SECONDS="30", PYTHONPATH=f"{REPO}:{REPO / 'tests'}",
                   **{AUDIT_ENV: str(audit)})
    return start(cmd, env), hosts, run_dir, audit


def reset_events(run_dir: Path) -> list[dict]:
    try:
        return [r for r in read_jsonl(run_dir / "metrics.jsonl")
                if r.get("event") == "elastic_reset"]
    except (FileNotFoundError, json.JSONDecodeError):
        return []


@pytest.mark.parametrize("framework, full", [("torch", 3), ("tensorflow", 2)])
def test_elastic_worker_killed_then_host_back(tmp_path, shards, framework, full):
    """Promise: Elastic training (Horovod Elastic) (train/RECOVERY.md)."""
    job, hosts, run_dir, audit = elastic_job(tmp_path, shards, framework, full)
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

    # The audit at the model's input, independent of samples.jsonl: the committed steps (found
    # from the weights each forward trained from) are the job's steps at full, one less, then
    # full size, and feed every sample once per epoch.
    steps = committed_steps(audit)
    assert len(steps) == summary["step"], (len(steps), summary["step"])
    assert all(len(st.rows) % BATCH == 0 for st in steps)
    sizes = [len(st.rows) // BATCH for st in steps]
    runs = [sizes[0]] + [b for a, b in zip(sizes, sizes[1:], strict=False) if a != b]
    assert runs == [full, full - 1, full], runs
    assert sizes.index(full - 1) == shrink["step"]
    assert sizes.index(full, shrink["step"]) == grow["step"]
    ids = toy_row_ids(N_TRAIN)
    per_epoch: list[list[int]] = [[]]
    last_size: list[int] = [sizes[0]]
    for st, size in zip(steps, sizes, strict=True):
        rows = [ids[h] for h in st.rows]
        if set(rows) & set(per_epoch[-1]):  # a sample again: the next epoch has begun
            per_epoch.append([])
        per_epoch[-1].extend(rows)
        last_size[len(per_epoch) - 1:] = [size]
    assert len(per_epoch) == EPOCHS[framework], [len(e) for e in per_epoch]
    for epoch, rows in enumerate(per_epoch):
        assert len(rows) == len(set(rows)), f"epoch {epoch}: a sample trained twice"
        assert N_TRAIN - len(rows) < last_size[epoch] * BATCH, (epoch, len(rows))
    # what the rolled-back steps fed is in the audit, not in the committed steps: the commit's
    # steps the victim took before it died (all ranks), and the survivors' one more (the step
    # whose collective failed)
    abandoned = len(audited_rows(audit)) - sum(len(st.rows) for st in steps)
    lost = KILL_STEP - 1 - shrink["step"]
    assert abandoned == BATCH * (full * lost + (full - 1) * (shrink["steps_redone"] + 1 - lost)), \
        (abandoned, shrink)

    # The lr follows the world size (optim.lr x ranks, constant schedule), and metrics.jsonl
    # was rewound at the rollback: each committed step logged once, in order.
    records = [r for r in read_jsonl(run_dir / "metrics.jsonl") if "loss" in r]
    assert [r["step"] for r in records] == list(range(1, summary["step"] + 1))
    for r, size in zip(records, sizes, strict=True):
        assert r["lr"] == pytest.approx(LR * size, rel=1e-12), (r, size)
    # Disk checkpoints went on every checkpoint.every_steps through the resets (keep: 2)
    final_step = summary["step"]
    kept = sorted({*range(CHECKPOINT_EVERY, final_step + 1, CHECKPOINT_EVERY), final_step})[-2:]
    assert sorted(p.name for p in (run_dir / "checkpoints").glob("ckpt-*")) == \
        [f"ckpt-{s:09d}" for s in kept]

    # The weights: the committed steps replayed in one process (no rollback, no resize: the
    # run without the fault that trains on the same global batches) give the job's final
    # weights, and each step's loss as the job logged it.
    x, y = toy_arrays(N_TRAIN)
    batches = [(x[r], y[r]) for r in ([ids[h] for h in st.rows] for st in steps)]
    initial, lrs = first_weights(audit, steps[0].weights), [LR * size for size in sizes]
    reference = replay(framework, initial, batches, lrs, MOMENTUM)
    final, _ = checkpoint_arrays(framework,
                                 run_dir / "checkpoints" / f"ckpt-{summary['step']:09d}")
    differences = {"final weights": max_difference(reference.weights, final),
                   "losses": max(abs(loss[s] - value)
                                 for s, value in enumerate(reference.losses, start=1))}
    # the tolerance against the error it guards against: the replay without one committed step
    # (the first at the smaller size, after the rollback) ends far from the job
    gap = shrink["step"]
    missing_one = replay(framework, initial, batches[:gap] + batches[gap + 1:],
                         lrs[:gap] + lrs[gap + 1:], MOMENTUM)
    differences["one step missing"] = max_difference(missing_one.weights, final)
    print(f"{framework} elastic: replay differences {differences}")
    assert differences["one step missing"] > 10 * REPLAY_TOLERANCE, differences
    assert max(differences["final weights"], differences["losses"]) < REPLAY_TOLERANCE, \
        differences


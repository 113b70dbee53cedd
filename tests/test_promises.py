"""Promises the docs make, each checked through real runs (issue 25): SIGUSR1 saves at one step
on every rank and training carries on to the weights of an undisturbed run; `ringfeed run`
passes SIGTERM and SIGINT to its job and exits with the job's status; validation metrics are
exact whatever the world size, on a split whose size leaves padding."""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path

import numpy as np
import pytest
from helpers import BIN, REPO, horovodrun, ringfeed, test_env
from train_util import (
    AUDIT_ENV,
    audited_rows,
    finish,
    rank_process,
    start,
    toy_config,
    toy_row_ids,
    train_steps,
    wait_for_step,
    write_config,
    write_toy_shards,
)

pytestmark = pytest.mark.system  # each test starts processes (tests/conftest.py)

RINGFEED = BIN / "ringfeed"
HOROVODRUN = BIN / "horovodrun"


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> Path:
    return write_toy_shards(tmp_path_factory.mktemp("toy") / "shards")


def config(tmp_path: Path, shards: Path, name: str, **overrides) -> Path:
    return write_config(tmp_path / f"{name}.yaml", **toy_config(shards, tmp_path / name,
                                                                **overrides))


def summary(run_dir: Path) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


# -- a restart at another world size -------------------------------------------------------------
@pytest.mark.parametrize("before, after, workers", [(3, 2, 2), (2, 3, 0)])
@pytest.mark.timeout(600)
def test_a_restart_at_another_world_size_feeds_every_remaining_sample_once(
        tmp_path, shards, before, after, workers):
    """A job stopped (SIGTERM, checkpoint) on `before` ranks and relaunched with --resume auto on
    `after` (a requeue onto another node count): audited at the model's input, outside the
    trainer, every sample of the epoch reaches the model once - the first run's consumed ones,
    then exactly the rest (less the < after x batch tail the drop policy leaves) - and the step
    count continues."""
    b, total = 2, 480
    cfg = config(tmp_path, shards, "run", model={"name": "train_util:recording_mlp",
                                                "args": {"num_classes": 3, "hidden": [16]}},
                 data={"batch_size": b, "num_workers": workers},
                 train={"epochs": 1, "log_every": 1}, checkpoint={"every_steps": None})
    audit = {}
    for part in ("first", "second"):
        audit[part] = tmp_path / f"audit-{part}"
        audit[part].mkdir()

    def env(part: str) -> dict[str, str]:
        return test_env(**{AUDIT_ENV: str(audit[part]),
                           "PYTHONPATH": f"{REPO}:{REPO / 'tests'}"})

    job = start([HOROVODRUN, "-np", str(before), "-H", f"localhost:{before}", "--gloo", RINGFEED,
                 "train", cfg], env=env("first"))
    try:
        assert wait_for_step(tmp_path / "run" / "metrics.jsonl", 8, job, timeout=240)
        rank0 = rank_process(job, 0)
        assert rank0 is not None
        rank0.send_signal(signal.SIGTERM)
    finally:
        code, output = finish(job, timeout=240)
    assert code != 0 and "Exit code: 143" in output, output[-4000:]
    stopped = summary(tmp_path / "run")
    s = stopped["step"]
    assert stopped["status"] == "stopped by SIGTERM" and s >= 8, stopped

    res = horovodrun(after, [RINGFEED, "train", cfg, "--resume", "auto"], timeout=400,
                     env=env("second"))
    assert res.returncode == 0, res.output[-4000:]
    assert f"at step {s}" in res.output, res.output[-3000:]
    left = total - before * b * s
    done = summary(tmp_path / "run")
    assert done["world_size"] == after and done["step"] == s + left // (after * b), done
    steps = train_steps(tmp_path / "run" / "metrics.jsonl")
    assert steps == list(range(1, done["step"] + 1)), steps  # continued, not restarted

    ids = toy_row_ids(total)
    first = [ids[h] for h in audited_rows(audit["first"])]
    second = [ids[h] for h in audited_rows(audit["second"])]
    assert len(first) == before * b * s  # what the checkpoint counts as consumed, no more
    assert len(set(first)) == len(first) and not set(first) & set(second)
    assert len(set(second)) == len(second) == left - left % (after * b)
    missing = set(range(total)) - set(first) - set(second)
    assert len(missing) == left % (after * b) < after * b


# -- SIGUSR1: save and carry on ----------------------------------------------------------------
@pytest.mark.timeout(600)
def test_sigusr1_to_one_rank_saves_at_one_step_and_the_run_ends_as_undisturbed(tmp_path, shards):
    import torch

    common = {"data": {"batch_size": 2}, "train": {"epochs": 1, "log_every": 5},
              "checkpoint": {"every_steps": None, "keep": 5}}
    plain = config(tmp_path, shards, "plain", **common)
    res = horovodrun(2, [RINGFEED, "train", plain], timeout=300)
    assert res.returncode == 0, res.output[-4000:]
    steps = summary(tmp_path / "plain")["step"]

    signalled = config(tmp_path, shards, "signalled", **common)
    job = start([HOROVODRUN, "-np", "2", "-H", "localhost:2", "--gloo", RINGFEED, "train",
                 signalled], env=test_env())
    try:
        assert wait_for_step(tmp_path / "signalled" / "metrics.jsonl", 10, job, timeout=240)
        rank1 = rank_process(job, 1)
        assert rank1 is not None
        rank1.send_signal(signal.SIGUSR1)  # one rank only: the save must still be agreed
    finally:
        code, output = finish(job, timeout=300)
    assert code == 0, output[-4000:]
    done = summary(tmp_path / "signalled")
    assert done["status"] == "finished" and done["step"] == steps, done
    saved = sorted((tmp_path / "signalled" / "checkpoints").glob("ckpt-*"))
    assert len(saved) == 2, saved  # the signal's and the end's
    at_signal = saved[0]
    meta = json.loads((at_signal / "meta.json").read_text())
    assert meta["reason"] == "signal" and 10 <= meta["step"] < steps, meta
    assert output.count("(signal)") == 1, output[-4000:]
    # one collective save: every rank's RNG state is in it, at that one step
    state = torch.load(at_signal / "state.pt", map_location="cpu", weights_only=True)
    assert len(state["rng"]) == 2
    consumed = [seg["batches_consumed"] for seg in meta["pipeline"]["segments"]]
    assert consumed == [meta["step"]], meta["pipeline"]

    def final(run: str) -> dict:
        path = tmp_path / run / "checkpoints" / f"ckpt-{steps:09d}" / "state.pt"
        return torch.load(path, map_location="cpu", weights_only=True)

    a, b = final("plain"), final("signalled")
    for name, tensor in a["model"].items():
        assert torch.equal(tensor, b["model"][name]), name


# -- ringfeed run: signals reach the job, its status comes back ---------------------------------
@pytest.mark.parametrize("sig, job_status", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
@pytest.mark.timeout(300)
def test_ringfeed_run_passes_the_signal_to_its_job_and_exits_with_its_status(
        tmp_path, shards, sig, job_status):
    cfg = config(tmp_path, shards, "run", data={"batch_size": 2},
                 train={"epochs": 3, "log_every": 5}, checkpoint={"every_steps": None})
    supervisor = start([RINGFEED, "run", "--backoff", "0", "--", RINGFEED, "train", cfg],
                       env=test_env())
    try:
        assert wait_for_step(tmp_path / "run" / "metrics.jsonl", 10, supervisor, timeout=240)
        supervisor.send_signal(sig)  # the supervisor only: it must pass the signal on
    finally:
        code, output = finish(supervisor, timeout=240)
    assert code == job_status, output[-4000:]
    assert f"ringfeed run: stopped by signal; job exited {job_status}" in output, output[-3000:]
    assert "restart 1/" not in output  # a signal ends supervision, it is no crash
    if sig == signal.SIGTERM:  # the trainer saved before it stopped
        stopped = summary(tmp_path / "run")
        assert stopped["status"] == "stopped by SIGTERM", stopped
        assert (tmp_path / "run" / "checkpoints" / f"ckpt-{stopped['step']:09d}").is_dir()


# -- exact validation at any world size ----------------------------------------------------------
@pytest.mark.parametrize("framework", ["torch", "tensorflow"])
@pytest.mark.timeout(900)
def test_validation_metrics_are_the_same_on_1_2_and_3_ranks_with_padding(tmp_path, shards,
                                                                         framework):
    """96 val samples in batches of 5: padded to 100 on 1 rank, 2 x 50 on 2, 3 x 35 on 3. One
    step at a learning rate too small to move any float32 weight, so every world size scores
    the initial model; padding must not count."""
    val_samples = 96
    results = {}
    for ranks in (1, 2, 3):
        cfg = config(tmp_path, shards, f"r{ranks}", framework=framework,
                     data={"batch_size": 5}, train={"max_steps": 1, "epochs": None},
                     optim={"lr": 1e-30, "momentum": 0.0}, checkpoint={"every_steps": None})
        cmd = [RINGFEED, "train", cfg]
        res = (ringfeed(*cmd[1:], timeout=300) if ranks == 1
               else horovodrun(ranks, cmd, timeout=600))
        assert res.returncode == 0, res.output[-4000:]
        done = summary(tmp_path / f"r{ranks}")
        assert done["world_size"] == ranks and done["step"] == 1, done
        results[ranks] = done["val"]
        padded = -(-val_samples // ranks // 5) * 5 * ranks - val_samples
        assert padded > 0  # (the point of the test: every world size pads)
    assert set(results[1]) >= {"loss", "accuracy"}, results[1]
    for ranks in (2, 3):
        for name, value in results[1].items():
            assert np.isclose(results[ranks][name], value, rtol=1e-6, atol=0), (ranks, name,
                                                                               results)
    # accuracy is a count over 96: equal, not merely close
    assert len({round(r["accuracy"] * val_samples, 6) for r in results.values()}) == 1, results


# -- signals before the first step ---------------------------------------------------------------
@pytest.mark.timeout(300)
def test_sigterm_before_the_first_step_stops_at_once_with_143(tmp_path, shards):
    """While `ringfeed train` is still starting (here: its shards' server accepts connections
    and never answers), SIGTERM ends it within seconds with the status a scheduler's requeue and
    `ringfeed run` expect."""
    import socket

    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)  # accepts, never answers
    url = f"http://127.0.0.1:{silent.getsockname()[1]}/shards"
    try:
        cfg = config(tmp_path, shards, "hang", data={"train": url, "batch_size": 2})
        job = start([RINGFEED, "train", cfg], env=test_env())
        time.sleep(8)  # imports done; waiting on the server
        assert job.poll() is None, "it should still be waiting for its shards"
        job.send_signal(signal.SIGTERM)
        sent = time.monotonic()
        code, output = finish(job, timeout=60)
        took = time.monotonic() - sent
    finally:
        silent.close()
    assert code == 143, output[-3000:]
    assert took < 5, took
    assert "SIGTERM before the first step: stopping (exit 143" in output
    assert "Traceback" not in output


@pytest.mark.timeout(300)
def test_sigusr1_before_the_first_step_saves_at_the_first_step(tmp_path, shards):
    cfg = config(tmp_path, shards, "early", data={"batch_size": 2},
                 train={"max_steps": 6, "epochs": None, "log_every": 1},
                 checkpoint={"every_steps": None})
    job = start([RINGFEED, "train", cfg], env=test_env())
    time.sleep(1.0)  # still importing
    job.send_signal(signal.SIGUSR1)
    code, output = finish(job, timeout=240)
    assert code == 0, output[-3000:]
    saved = sorted(p.name for p in (tmp_path / "early" / "checkpoints").glob("ckpt-*"))
    assert saved == ["ckpt-000000001", "ckpt-000000006"], saved  # the first step's, the end's
    meta = json.loads((tmp_path / "early" / "checkpoints" / saved[0] / "meta.json").read_text())
    assert meta["reason"] == "signal"


@pytest.mark.timeout(120)
def test_ringfeed_run_reports_a_job_killed_by_a_signal_as_a_shell_would():
    res = ringfeed("run", "--max-restarts", "0", "--", "sh", "-c", "kill -KILL $$", timeout=60)
    assert res.returncode == 137, res.output  # 128 + SIGKILL, not Popen's -9 (= 247)
    assert "job failed (exit 137); giving up after 0 restart(s)" in res.output

"""Fault recovery under real failures, non-elastic (issue 6): a worker SIGKILLed at a random
step and the job resumed (directly and through `ringfeed run`), rank 0 SIGKILLed inside a
checkpoint write (20 repetitions), SIGTERM to the whole job (loader workers included), a rank
that raises ending the whole job, and a full or unwritable checkpoint directory.

Every run is bounded by a timeout; "the same" means bit-identical torch fp32 weights and
optimizer state, and the same samples.jsonl (the sample ids of every step)."""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
from pathlib import Path

import numpy as np
import pytest
from fault_util import (
    assert_same_torch_state,
    corrupt_one_sample,
    logged_step,
    mounted_tmpfs,
    read_jsonl,
    ringfeed_forked,
    samples_by_epoch,
    tf_final,
    torch_final,
    wait_for,
    worker_processes,
)
from helpers import BIN, horovodrun, run, test_env
from train_util import finish, start, toy_config, write_config, write_toy_shards

from ringfeed.train.checkpoint.files import META, find_resume_point, list_checkpoints, verify

pytestmark = pytest.mark.system  # each test starts processes (tests/conftest.py)

FAULT = "RINGFEED_FAULT"
RINGFEED = BIN / "ringfeed"
HVD2 = [BIN / "horovodrun", "-np", "2", "-H", "localhost:2", "--gloo"]
STEPS = 60  # 480 samples / (2 ranks x 4) per epoch, one epoch
EVERY = 3  # checkpoint every 3 steps: a kill loses at most 2


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> Path:
    return write_toy_shards(tmp_path_factory.mktemp("toy") / "shards")


def small_config(tmp_path: Path, shards: Path, name: str, **overrides) -> Path:
    """One process, 6 steps, a checkpoint every 2: what the forked runs train."""
    sections = {"data": {"batch_size": 4, "val_split": None},
                "train": {"max_steps": 6, "log_every": 1},
                "checkpoint": {"every_steps": 2, "keep": 10},
                "output": {"dir": str(tmp_path / name), "tensorboard": False,
                           "sample_log": True}}
    for section, values in overrides.items():
        sections[section] = {**sections.get(section, {}), **values}
    return write_config(tmp_path / f"{name}.yaml", **toy_config(shards, tmp_path / name,
                                                                **sections))


# -- 2. SIGKILL inside the checkpoint write, 20 times --------------------------------------
def test_sigkill_inside_checkpoint_write_20_times_previous_checkpoint_loads(tmp_path, shards):
    """Promise: Checkpoints that survive being killed (train/RECOVERY.md)."""
    ref_cfg = small_config(tmp_path, shards, "ref")
    ref = ringfeed_forked(["train", ref_cfg], tmp_path / "ref.log")
    assert ref.code == 0, ref.output[-3000:]
    payload = (tmp_path / "ref" / "checkpoints" / "ckpt-000000004" / "state.pt").stat().st_size
    # Kill points: through the payload (torch.save's writes), inside meta.json, and after all
    # files are written and fsynced but before the rename that publishes the checkpoint.
    budgets = [payload * i // 17 for i in range(18)] + [payload + 10, 10**9]
    assert len(budgets) == 20
    finals = []
    for i, budget in enumerate(budgets):
        cfg = small_config(tmp_path, shards, f"rep{i}")
        ckpts = tmp_path / f"rep{i}" / "checkpoints"
        killed = ringfeed_forked(["train", cfg], tmp_path / f"rep{i}.log",
                                 env={FAULT: f"kill-in-checkpoint-write:4:{budget}"})
        assert killed.code == -9, (i, killed.code, killed.output[-2000:])
        assert not (ckpts / "ckpt-000000004").exists()
        (partial,) = ckpts.glob(".ckpt-000000004.tmp-*")  # killed inside the write
        state_size = (partial / "state.pt").stat().st_size
        assert state_size == min(budget, payload), (i, budget, state_size)
        meta = partial / META
        if budget <= payload:
            assert not meta.exists()
        elif budget == payload + 10:
            assert meta.stat().st_size == 10
        else:
            assert '"files"' in meta.read_text()  # complete, never renamed into place
        hit = find_resume_point("auto", ckpts, print)  # checks every sha256
        assert hit is not None and hit.path.name == "ckpt-000000002"

        resumed = ringfeed_forked(["train", cfg, "--resume", "auto"], tmp_path / f"res{i}.log")
        assert resumed.code == 0, resumed.output[-3000:]
        assert f"resumed from {ckpts / 'ckpt-000000002'} at step 2" in resumed.output
        assert not partial.exists()  # the half-written one was cleared away
        finals.append(i)
    reference = torch_final(tmp_path / "ref", 6)
    ref_samples = samples_by_epoch(tmp_path / "ref")
    for i in finals:
        assert_same_torch_state(reference, torch_final(tmp_path / f"rep{i}", 6))
        assert samples_by_epoch(tmp_path / f"rep{i}") == ref_samples


# -- 1. SIGKILL one worker at a random step, resume: the same weights -----------------------
def job_config(tmp_path: Path, shards: Path, name: str, framework: str = "torch",
               **overrides) -> Path:
    """2 ranks, one epoch of 60 steps, a checkpoint every 3, one loader worker per rank."""
    sections = {"data": {"batch_size": 4, "num_workers": 1, "val_split": None},
                "train": {"epochs": 1, "log_every": 1},
                "checkpoint": {"every_steps": EVERY, "keep": 3},
                "output": {"dir": str(tmp_path / name), "tensorboard": False,
                           "sample_log": True}}
    for section, values in overrides.items():
        sections[section] = {**sections.get(section, {}), **values}
    return write_config(tmp_path / f"{name}.yaml",
                        **toy_config(shards, tmp_path / name, framework, **sections))


def uninterrupted(tmp_path: Path, shards: Path, framework: str) -> Path:
    cfg = job_config(tmp_path, shards, "reference", framework)
    res = horovodrun(2, [RINGFEED, "train", cfg], timeout=300)
    assert res.returncode == 0, res.output[-4000:]
    return tmp_path / "reference"


@pytest.fixture(scope="module")
def torch_reference(tmp_path_factory, shards) -> Path:
    return uninterrupted(tmp_path_factory.mktemp("torch_ref"), shards, "torch")


def resume_and_compare(cfg: Path, run_dir: Path, reference: Path, resumed_at: int) -> str:
    res = horovodrun(2, [RINGFEED, "train", cfg, "--resume", "auto"], timeout=300)
    assert res.returncode == 0, res.output[-4000:]
    ckpt = run_dir / "checkpoints" / f"ckpt-{resumed_at:09d}"
    assert f"resumed from {ckpt} at step {resumed_at}" in res.output, res.output[-4000:]
    assert json.loads((run_dir / "summary.json").read_text())["step"] == STEPS
    # Nothing trained twice or skipped: every step saw the samples of the uninterrupted run.
    assert samples_by_epoch(run_dir) == samples_by_epoch(reference)
    return res.output


def test_sigkill_at_a_random_step_then_resume_auto_is_bit_identical(tmp_path, shards,
                                                                   torch_reference):
    """Promise: What is lost on a crash (train/RECOVERY.md)."""
    rng = random.Random(1)
    step, rank = rng.randint(4, STEPS - 5), rng.randint(0, 1)  # at the start of that step
    resumed_at = EVERY * ((step - 1) // EVERY)
    cfg = job_config(tmp_path, shards, "cut")
    killed = horovodrun(2, [RINGFEED, "train", cfg], timeout=240,
                        env=test_env(**{FAULT: f"kill-at-step:{step}:{rank}"}))
    # horovodrun ends the job: the surviving rank does not hang in its allreduce
    assert not killed.timed_out and killed.returncode != 0, killed.output[-4000:]
    assert "137" in killed.output, killed.output[-4000:]  # 128 + SIGKILL
    # the survivor's collective fails: one line (if horovodrun lets it finish), no traceback
    assert "HorovodInternalError: Horovod has been shut down" not in killed.output, \
        killed.output[-4000:]
    run_dir = tmp_path / "cut"
    assert not (run_dir / "summary.json").exists()
    assert list_checkpoints(run_dir / "checkpoints")[-1].name == f"ckpt-{resumed_at:09d}"
    resume_and_compare(cfg, run_dir, torch_reference, resumed_at)
    assert_same_torch_state(torch_final(torch_reference, STEPS), torch_final(run_dir, STEPS))


def test_sigkill_under_ringfeed_run_restarts_from_the_checkpoint(tmp_path, shards,
                                                                 torch_reference):
    """Promise: Restarting a job: `ringfeed run` (train/RECOVERY.md)."""
    rng = random.Random(4)
    step, rank = rng.randint(10, 30), rng.randint(0, 1)
    cfg = job_config(tmp_path, shards, "supervised")
    run_dir = tmp_path / "supervised"
    job = start([RINGFEED, "run", "--max-restarts", "2", "--backoff", "0.2", "--", *HVD2,
                 RINGFEED, "train", cfg], env=test_env())
    try:
        assert wait_for(lambda: logged_step(run_dir) >= step, timeout=240), "never got there"
        (victim,) = worker_processes(job.pid, HOROVOD_RANK=str(rank))
        victim.send_signal(signal.SIGKILL)  # from outside, whenever it lands
        reached = logged_step(run_dir)  # (the killed attempt may log a step more)
    finally:
        code, output = finish(job, timeout=400)
    assert code == 0, output[-5000:]
    # the killed rank's own status (its peer, which only lost it, exits after it)
    assert "ringfeed run: job failed (exit 137); restart 1/2" in output, output[-5000:]
    assert "--resume auto" in output and "restart 1 by `ringfeed run`" in output
    assert "recovery           1 restart(s)" in output
    # the steps the killed attempt had logged past the checkpoint it resumed from: redone
    resumed_at = int(re.search(r"resumed from \S+ at step (\d+)", output).group(1))
    redone = json.loads((run_dir / "summary.json").read_text())["recovery"]["steps_redone"]
    assert reached - resumed_at <= redone <= reached + 1 - resumed_at, \
        (reached, resumed_at, redone)
    assert f"({redone} step(s) redone)" in output
    # no traceback from any rank or horovodrun: the launcher's is one line, the survivor's too
    assert "Traceback" not in output, output[-5000:]
    assert "ringfeed run: horovodrun ended the job: rank" in output
    assert "ringfeed run: job finished after 1 restart(s)" in output
    assert samples_by_epoch(run_dir) == samples_by_epoch(torch_reference)
    assert_same_torch_state(torch_final(torch_reference, STEPS), torch_final(run_dir, STEPS))


def test_tensorflow_sigkill_then_resume_is_bit_identical(tmp_path, shards):
    """Promise: What is lost on a crash (train/RECOVERY.md)."""
    reference = uninterrupted(tmp_path, shards, "tensorflow")
    step = random.Random(5).randint(4, STEPS - 5)
    cfg = job_config(tmp_path, shards, "cut", "tensorflow")
    killed = horovodrun(2, [RINGFEED, "train", cfg], timeout=240,
                        env=test_env(**{FAULT: f"kill-at-step:{step}:1"}))
    assert not killed.timed_out and killed.returncode != 0, killed.output[-4000:]
    resume_and_compare(cfg, tmp_path / "cut", reference, EVERY * ((step - 1) // EVERY))
    a, b = tf_final(reference, STEPS), tf_final(tmp_path / "cut", STEPS)
    assert a.keys() == b.keys() and len(a) >= 4
    # TF's stated tolerance on CPU fp32: none; the resumed run is bit-identical (measured).
    for name in a:
        np.testing.assert_array_equal(a[name], b[name], err_msg=name)


# -- 4. SIGTERM to the whole job: saved, then resumed ---------------------------------------
def test_sigterm_to_every_process_of_the_job_saves_then_resumes(tmp_path, shards,
                                                                torch_reference):
    """Promise: Signals (train/RECOVERY.md)."""
    step = random.Random(6).randint(10, 40)
    cfg = job_config(tmp_path, shards, "stopped")
    run_dir = tmp_path / "stopped"
    job = start([*HVD2, RINGFEED, "train", cfg], env=test_env())
    try:
        assert wait_for(lambda: logged_step(run_dir) >= step, timeout=240), "never got there"
        ranks = worker_processes(job.pid)
        assert len(ranks) == 2
        # What a scheduler does: every process of the job, DataLoader workers included (they
        # share their rank's process group), and the launcher.
        for rank in ranks:
            os.killpg(os.getpgid(rank.pid), signal.SIGTERM)
        os.killpg(job.pid, signal.SIGTERM)
    finally:
        code, output = finish(job, timeout=240)
    # (horovodrun reports the first process to end: a rank's `sh -c` wrapper, killed by the
    # same SIGTERM, or a rank that saved and exited 143)
    assert code != 0 and "ringfeed train: stopped by SIGTERM at step" in output, output[-4000:]
    stopped = json.loads((run_dir / "summary.json").read_text())
    assert stopped["status"] == "stopped by SIGTERM" and step <= stopped["step"] < STEPS
    assert f"ckpt-{stopped['step']:09d} (signal)" in output
    assert "DataLoader worker" not in output  # the loader workers outlived the signal
    verify(run_dir / "checkpoints" / f"ckpt-{stopped['step']:09d}")
    resume_and_compare(cfg, run_dir, torch_reference, stopped["step"])
    assert_same_torch_state(torch_final(torch_reference, STEPS), torch_final(run_dir, STEPS))


# -- 5. A rank that raises ends the whole job -----------------------------------------------
def test_corrupt_data_under_fail_policy_ends_the_job_and_is_not_restarted(tmp_path):
    """Promises: Errors a restart cannot fix; Restarting a job: `ringfeed run`
    (train/RECOVERY.md)."""
    shards = write_toy_shards(tmp_path / "bad_shards")
    bad_key = corrupt_one_sample(shards, "train-000004.tar", 17)
    cfg = job_config(tmp_path, shards, "corrupt", data={"on_error": "fail", "num_workers": 0})
    res = run([RINGFEED, "run", "--max-restarts", "3", "--backoff", "0.1", "--", *HVD2,
               RINGFEED, "train", cfg], timeout=240)
    assert not res.timed_out, res.output[-4000:]  # no rank hung in allreduce
    # the failing rank's status, not its peer's "lost rank" (1), which exits after it
    assert res.returncode == 2, res.output[-4000:]
    out = res.output
    assert "Traceback" not in out, out[-4000:]
    # the one error line (stderr) is also what stops `ringfeed run`
    line = next(x for x in out.splitlines() if "ringfeed: error:" in x)
    assert "train-000004.tar" in line and bad_key in line and "cannot decode" in line, line
    assert "not restartable" not in out  # the message is not printed a second time
    assert "ringfeed run: job failed with an error a restart cannot fix" in out
    assert "restart 1/" not in out  # launched once


# -- 6. A full or unwritable checkpoint directory -------------------------------------------
def big_model_config(tmp_path: Path, shards: Path, name: str, ckpt_dir: Path,
                     on_error: str = "fail") -> Path:
    """~200 KB checkpoints (an MLP with 2048 hidden units, SGD momentum)."""
    return small_config(tmp_path, shards, name,
                        model={"name": "mlp", "args": {"num_classes": 3, "hidden": [2048]}},
                        checkpoint={"dir": str(ckpt_dir), "on_error": on_error})


@pytest.fixture
def small_tmpfs(tmp_path):
    """A real 256 KiB tmpfs: room for one checkpoint, not two."""
    yield from mounted_tmpfs(tmp_path, "256k")


def test_disk_full_stops_with_a_clear_error_and_keeps_the_last_checkpoint(tmp_path, shards,
                                                                          small_tmpfs):
    """Promise: Errors a restart cannot fix (train/RECOVERY.md)."""
    cfg = big_model_config(tmp_path, shards, "full", small_tmpfs / "ckpts")
    res = ringfeed_forked(["train", cfg], tmp_path / "full.log")
    assert res.code == 4, res.output[-3000:]
    error = [x for x in res.output.splitlines() if x.startswith("ringfeed: error: ")]
    assert len(error) == 1 and "at step 4: cannot write checkpoint" in error[0], res.output
    assert "No space left on device" in error[0] and "checkpoint.on_error: warn" in error[0]
    assert res.output.count("cannot write checkpoint") == 1  # printed once
    # training did not go on without checkpoints; the last good one is intact, no debris
    assert max(r["step"] for r in read_jsonl(tmp_path / "full" / "metrics.jsonl")) == 4
    assert not (tmp_path / "full" / "summary.json").exists()
    assert [p.name for p in (small_tmpfs / "ckpts").iterdir()] == ["ckpt-000000002"]
    verify(small_tmpfs / "ckpts" / "ckpt-000000002")


def test_disk_full_with_on_error_warn_trains_on_and_says_so(tmp_path, shards, small_tmpfs):
    """Promise: Errors a restart cannot fix (train/RECOVERY.md)."""
    cfg = big_model_config(tmp_path, shards, "warn", small_tmpfs / "ckpts", on_error="warn")
    res = ringfeed_forked(["train", cfg], tmp_path / "warn.log")
    assert res.code == 0, res.output[-3000:]
    assert "warning: checkpoint at step 4 NOT saved: cannot write checkpoint" in res.output
    summary = json.loads((tmp_path / "warn" / "summary.json").read_text())
    assert summary["step"] == 6 and summary["recovery"]["failed_checkpoints"] == 2
    assert "2 checkpoint(s) NOT written" in res.output


def test_unwritable_checkpoint_dir_fails_before_training(tmp_path, shards):
    """Promise: Errors a restart cannot fix (train/RECOVERY.md)."""
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    cfg = big_model_config(tmp_path, shards, "nodir", blocker / "ckpts")
    res = ringfeed_forked(["train", cfg], tmp_path / "nodir.log")
    assert res.code == 4, res.output[-3000:]
    error = [x for x in res.output.splitlines() if x.startswith("ringfeed: error: ")]
    assert len(error) == 1 and f"cannot write checkpoint {blocker / 'ckpts'}: Not a directory" \
        in error[0], res.output  # one line, printed once
    assert "step 1/" not in res.output  # stopped before the first step


def test_read_only_checkpoint_dir_fails_before_training(tmp_path, shards, small_tmpfs):
    """Promise: Errors a restart cannot fix (train/RECOVERY.md)."""
    (small_tmpfs / "ckpts").mkdir()
    res = subprocess.run(["mount", "-o", "remount,ro", str(small_tmpfs)], capture_output=True,
                         text=True)
    if res.returncode:
        pytest.skip(f"cannot remount read-only: {res.stderr.strip()}")
    cfg = big_model_config(tmp_path, shards, "ro", small_tmpfs / "ckpts")
    out = ringfeed_forked(["train", cfg], tmp_path / "ro.log")
    assert out.code == 4 and "Read-only file system" in out.output, out.output[-3000:]
    assert "step 1/" not in out.output


# -- loader workers and SIGTERM ---------------------------------------------------------------
EXIT_WITH_OPEN_LOADER = """
import os, signal, sys, time
from ringfeed.pipeline import ShardPipeline
from ringfeed.pipeline.torch import make_loader

pipe = ShardPipeline(sys.argv[1], batch_size=4, num_workers=2, rank=0, world_size=1)
loader = make_loader(pipe)
next(iter(loader))
cycle = {"loader": loader}
cycle["cycle"] = cycle  # not freed before exit: the exit handler must stop the workers
pids = [w.pid for w in loader.loader._iterator._workers]
for pid in pids:
    os.kill(pid, signal.SIGTERM)
time.sleep(0.5)
print("workers alive after SIGTERM:", all(os.path.exists(f"/proc/{p}") for p in pids))
"""


def test_loader_workers_outlive_sigterm_and_do_not_block_exit(shards):
    """Promise: Signals (train/RECOVERY.md)."""
    res = run([BIN / "python", "-c", EXIT_WITH_OPEN_LOADER, shards], timeout=90)
    assert not res.timed_out, "the process hung at exit"
    assert res.returncode == 0 and "workers alive after SIGTERM: True" in res.stdout, res.output

"""Promises the docs make, each checked through real runs (issue 25): a job restarted at other
world sizes (3 -> 2 -> 3, torch and TensorFlow) feeds every sample once, continues its step
count and lr schedule, carries its optimizer state and ends with the weights of one
uninterrupted run of the same batches (audited at the model's input, replayed in this
process); SIGUSR1 saves at one step on every rank and training carries on to the weights of an
undisturbed run; `ringfeed run` passes SIGTERM and SIGINT to its job and exits with the job's
status; validation metrics are exact whatever the world size, on a split whose size leaves
padding."""

from __future__ import annotations

import json
import math
import shutil
import signal
import time
from pathlib import Path

import numpy as np
import pytest
from fault_util import assert_same_torch_state, read_jsonl, ringfeed_forked, torch_final
from helpers import BIN, REPO, horovodrun, ringfeed, run, test_env
from train_util import (
    AUDIT_ENV,
    AUDIT_PACE_ENV,
    audited_rows,
    checkpoint_arrays,
    committed_steps,
    finish,
    first_weights,
    max_difference,
    rank_process,
    replay,
    start,
    toy_arrays,
    toy_config,
    toy_row_ids,
    wait_for_handler,
    wait_for_step,
    weights_digest,
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
BASE_LR, MOMENTUM, WARMUP, MIN_LR_RATIO = 0.02, 0.9, 20, 0.1
# The replay (one process, the audited global batches, the framework's own SGD) against the
# trainer, CPU fp32: the largest differences measured (3 jobs per framework) were 1.5e-7 in
# weights, 2.4e-7 in momentum (absolute) and 2.4e-7 in a step's loss, from the allreduce's
# reduction order (a mean of per-rank means against one mean). Asserted: 1e-6. Dropping the
# optimizer state at a resume moves the final weights by 0.1 or more.
REPLAY_TOLERANCE = 1e-6


def promised_lr(step: int, ranks: int, planned_steps: int) -> float:
    """The lr schedule's promise (train/schedule.py, written out here as the specification):
    a pure function of the step, which counts on across a restart. The peak is optim.lr x
    ranks (x accumulate, here 1) for the world size of the run the step belongs to; linear
    warmup over the first WARMUP steps, then cosine down to MIN_LR_RATIO x peak at
    `planned_steps`: what that run counts at start-up from the pipeline's position (steps
    done + what the rest of the data gives at its world size). So after a resize the cosine
    is stretched over the new step count (its progress is steps, not samples). `step` counts
    from 1 (its lr is the schedule at step - 1)."""
    peak, i = BASE_LR * ranks, step - 1
    if i < WARMUP:
        return peak * (i + 1) / WARMUP
    progress = min(1.0, (i - WARMUP) / max(1, planned_steps - WARMUP))
    floor = peak * MIN_LR_RATIO
    return floor + (peak - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


# (ranks, loader workers) of each launch of one job: the first two are stopped by SIGTERM,
# the last one runs to the end of the epoch. 3 -> 1 -> 2: both directions, a world size that
# does not divide the others, and a resize of an epoch already resized (the pipeline stacks
# segments). torch changes its DataLoader worker count as well; TensorFlow reads in the
# pipeline's threads, no worker processes.
LAUNCHES = {"torch": [(3, 2), (1, 0), (2, 2)], "tensorflow": [(3, 0), (1, 0), (2, 0)]}


@pytest.mark.parametrize("framework", ["torch", "tensorflow"])
@pytest.mark.timeout(900)
def test_restarts_at_other_world_sizes_continue_the_run_exactly(tmp_path, shards, framework):
    """A job stopped (SIGTERM, checkpoint) and relaunched with --resume auto at another world
    size, twice (a requeue onto another node count), audited outside the trainer by a user
    model that logs every training forward (tests/train_util.py, recording_mlp):

    - data: every sample of the epoch reaches the model once - each launch exactly what its
      checkpoint counts as consumed, the last one exactly the rest (less the < ranks x batch
      tail the drop policy leaves);
    - the step counter continues, and the lr logged at every step is promised_lr();
    - weights: each resumed launch starts from its checkpoint's weights bit for bit; the
      optimizer state is carried, and the whole job equals one uninterrupted run of the same
      global batches within REPLAY_TOLERANCE, at every stop and at the end.

    That reference is a replay in this process: an uninterrupted run at any one world size
    trains on other global batches after a resize (the rest of the epoch is dealt over the
    new ranks), so its weights are not the ones to compare with. The replay trains the
    audited global batches, step by step, from the first forward's weights, with the promised
    lr (torch.optim.SGD / keras.optimizers.SGD, no ringfeed code).

    Promises: What is lost on a crash; Signals (train/RECOVERY.md)."""
    b, total = 4, 480
    run_dir = tmp_path / "run"
    cfg = config(tmp_path, shards, "run", framework=framework,
                 model={"name": "train_util:recording_mlp",
                        "args": {"num_classes": 3, "hidden": [16]}},
                 data={"batch_size": b},
                 optim={"lr": BASE_LR, "momentum": MOMENTUM, "warmup_steps": WARMUP,
                        "schedule": "cosine", "min_lr_ratio": MIN_LR_RATIO},
                 train={"epochs": 1, "log_every": 1}, checkpoint={"every_steps": None})
    launches = LAUNCHES[framework]
    audits, stops, planned = [], [0], []  # per launch: audit dir, step it ended at, steps planned
    lr_logged: dict[int, float] = {}
    for n, (ranks, workers) in enumerate(launches):
        audits.append(tmp_path / f"audit-{n}")
        audits[-1].mkdir()
        env = test_env(**{AUDIT_ENV: str(audits[-1]), "PYTHONPATH": f"{REPO}:{REPO / 'tests'}"})
        argv = [RINGFEED, "train", cfg, "--set", f"data.num_workers={workers}"]
        if n:
            argv += ["--resume", "auto"]
        left = total - sum(launches[i][0] * b * (stops[i + 1] - stops[i]) for i in range(n))
        planned.append(stops[-1] + left // (ranks * b))
        if n < len(launches) - 1:  # paced: still running when the SIGTERM comes
            job = start([HOROVODRUN, "-np", str(ranks), "-H", f"localhost:{ranks}", "--gloo",
                         *argv], env={**env, AUDIT_PACE_ENV: "0.1"})
            try:
                assert wait_for_step(run_dir / "metrics.jsonl", stops[-1] + 6, job, timeout=300)
                rank0 = rank_process(job, 0)
                assert rank0 is not None
                rank0.send_signal(signal.SIGTERM)
            finally:
                code, output = finish(job, timeout=240)
            assert code != 0 and "Exit code: 143" in output, output[-4000:]
            status = "stopped by SIGTERM"
        else:
            res = horovodrun(ranks, argv, timeout=400, env=env)
            assert res.returncode == 0, res.output[-4000:]
            output, status = res.output, "finished"
        if n:
            assert f"at step {stops[-1]}" in output, output[-3000:]
        done = summary(run_dir)
        assert done["status"] == status and done["world_size"] == ranks, done
        if n == len(launches) - 1:
            assert done["step"] == planned[-1], (done, planned)
        stops.append(done["step"])
        records = [r for r in read_jsonl(run_dir / "metrics.jsonl") if "loss" in r]
        assert [r["step"] for r in records] == list(range(1, stops[-1] + 1))  # continued
        for r in records:  # earlier launches' records are kept as they were
            assert lr_logged.setdefault(r["step"], r["lr"]) == r["lr"]
    last = len(launches) - 1

    def launch_of(step: int) -> int:
        return next(n for n in range(len(launches)) if step <= stops[n + 1])

    # the learning rate: warmup and cosine go on from each stop; the peak and the planned
    # steps are those of the launch's world size
    for step, lr in lr_logged.items():
        n = launch_of(step)
        assert lr == pytest.approx(promised_lr(step, launches[n][0], planned[n]), rel=1e-12), \
            (step, lr, stops, planned)

    # the data, at the model's input
    ids = toy_row_ids(total)
    fed = [[ids[h] for h in audited_rows(audit)] for audit in audits]
    for n, rows in enumerate(fed):  # what each checkpoint counts as consumed, no more
        assert len(rows) == launches[n][0] * b * (stops[n + 1] - stops[n]), n
    everything = [i for rows in fed for i in rows]
    assert len(set(everything)) == len(everything)
    missing = set(range(total)) - set(everything)
    assert len(missing) == (total - sum(len(rows) for rows in fed[:last])) % (
        launches[last][0] * b) < launches[last][0] * b

    # the weights: restored exactly at each resume, and trained as one uninterrupted run
    steps = [committed_steps(audit) for audit in audits]
    x, y = toy_arrays(total)
    batches, lrs = [], []
    for n, part in enumerate(steps):
        assert len(part) == stops[n + 1] - stops[n]
        assert {len(st.rows) for st in part} == {launches[n][0] * b}
        for st in part:
            rows = [ids[h] for h in st.rows]
            batches.append((x[rows], y[rows]))
            lrs.append(promised_lr(len(batches), launches[n][0], planned[n]))
    initial = first_weights(audits[0], steps[0][0].weights)
    differences = {}
    for n, stop in enumerate(stops[1:]):
        weights, momentum = checkpoint_arrays(framework, run_dir / "checkpoints" /
                                              f"ckpt-{stop:09d}")
        if n < last:  # the next launch trained from exactly these weights
            resumed = steps[n + 1][0].weights
            assert resumed == weights_digest(weights), n
            for a, c in zip(first_weights(audits[n + 1], resumed), weights, strict=True):
                assert np.array_equal(a, c), n
        reference = replay(framework, initial, batches[:stop], lrs[:stop], MOMENTUM)
        differences[f"weights at {stop}"] = max_difference(reference.weights, weights)
        differences[f"momentum at {stop}"] = max_difference(reference.optimizer, momentum)
    differences["losses"] = max(abs(lr_loss - loss) for lr_loss, loss in zip(
        [r["loss"] for r in records], reference.losses, strict=True))
    print(f"{framework}: stops {stops}, replay differences {differences}")
    assert max(differences.values()) < REPLAY_TOLERANCE, differences
    # the check sees a resume that loses the optimizer state (momentum restarted there)
    final_weights = weights
    for stop in stops[1:-1]:
        dropped = replay(framework, initial, batches, lrs, MOMENTUM, drop_optimizer_state_at=stop)
        moved = max_difference(dropped.weights, final_weights)
        assert moved > 100 * REPLAY_TOLERANCE, (stop, moved)


# -- SIGUSR1: save and carry on ----------------------------------------------------------------
@pytest.mark.timeout(600)
def test_sigusr1_to_one_rank_saves_at_one_step_and_the_run_ends_as_undisturbed(tmp_path, shards):
    """Promises: What is lost on a crash; Signals (train/RECOVERY.md)."""
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
    """Promise: Signals (train/RECOVERY.md)."""
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
def test_validation_metrics_are_the_same_on_1_and_3_ranks_with_padding(tmp_path, shards,
                                                                       framework):
    """96 val samples in batches of 5: padded to 100 on 1 rank, to 3 x 35 on 3 (2 ranks would
    pad to 2 x 50, the same 4 as one rank: not run, a launch is ~7 CPU-s of imports). One step
    at a learning rate too small to move any float32 weight, so every world size scores the
    initial model; padding must not count."""
    val_samples = 96
    results = {}
    for ranks in (1, 3):
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
    for name, value in results[1].items():
        assert np.isclose(results[3][name], value, rtol=1e-6, atol=0), (name, results)
    # accuracy is a count over 96: equal, not merely close
    assert len({round(r["accuracy"] * val_samples, 6) for r in results.values()}) == 1, results


# -- signals before the first step ---------------------------------------------------------------
@pytest.mark.timeout(300)
def test_sigterm_before_the_first_step_stops_at_once_with_143(tmp_path, shards):
    """While `ringfeed train` is still starting (here: its shards' server accepts connections
    and never answers), SIGTERM ends it within seconds with the status a scheduler's requeue and
    `ringfeed run` expect.

    Promise: Signals (train/RECOVERY.md)."""
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
    """Promise: Signals (train/RECOVERY.md)."""
    cfg = config(tmp_path, shards, "early", data={"batch_size": 2},
                 train={"max_steps": 6, "epochs": None, "log_every": 1},
                 checkpoint={"every_steps": None})
    job = start([RINGFEED, "train", cfg], env=test_env())
    # as soon as `ringfeed train` catches it (a tenth of a second in): it is still importing
    assert wait_for_handler(job, signal.SIGUSR1, timeout=60)
    job.send_signal(signal.SIGUSR1)
    code, output = finish(job, timeout=240)
    assert code == 0, output[-3000:]
    saved = sorted(p.name for p in (tmp_path / "early" / "checkpoints").glob("ckpt-*"))
    assert saved == ["ckpt-000000001", "ckpt-000000006"], saved  # the first step's, the end's
    meta = json.loads((tmp_path / "early" / "checkpoints" / saved[0] / "meta.json").read_text())
    assert meta["reason"] == "signal"


@pytest.mark.timeout(120)
def test_ringfeed_run_reports_a_job_killed_by_a_signal_as_a_shell_would():
    """Promise: Signals (train/RECOVERY.md)."""
    res = ringfeed("run", "--max-restarts", "0", "--", "sh", "-c", "kill -KILL $$", timeout=60)
    assert res.returncode == 137, res.output  # 128 + SIGKILL, not Popen's -9 (= 247)
    assert "job failed (exit 137); giving up after 0 restart(s)" in res.output


@pytest.mark.timeout(120)
def test_ringfeed_run_relaunches_with_resume_auto_and_doubles_its_backoff():
    """A job that keeps failing (exit 1: restartable): relaunched with its --resume replaced by
    --resume auto and RINGFEED_RESTART_COUNT set, after waits that double up to --backoff-max,
    until --max-restarts; then the job's status.

    Promise: Restarting a job: `ringfeed run` (train/RECOVERY.md)."""
    job = ["sh", "-c", 'echo "attempt $RINGFEED_RESTART_COUNT: $*"; exit 1', "ringfeed",
           "train", "cfg.yaml", "--resume", "/old/ckpt-000000010"]
    res = ringfeed("run", "--max-restarts", "3", "--backoff", "1", "--backoff-max", "2", "--",
                   *job, timeout=60)
    assert res.returncode == 1, res.output
    attempts = [line for line in res.output.splitlines() if line.startswith("attempt ")]
    assert attempts == ["attempt 0: train cfg.yaml --resume /old/ckpt-000000010",
                        *(f"attempt {n}: train cfg.yaml --resume auto" for n in (1, 2, 3))]
    waits = [line.split(" in ")[1] for line in res.output.splitlines() if "; restart " in line]
    assert waits == ["1s with --resume auto", "2s with --resume auto",
                     "2s with --resume auto"], res.output
    assert "job failed (exit 1); giving up after 3 restart(s)" in res.output


@pytest.mark.timeout(120)
def test_global_batch_size_is_refused_with_elastic(tmp_path, shards):
    """Elastic runs keep the per-rank batch (the global batch and the lr follow the world
    size): a fixed global batch is a config error before anything starts.

    Promise: Elastic training (Horovod Elastic) (train/RECOVERY.md)."""
    cfg = config(tmp_path, shards, "elastic", data={"global_batch_size": 8})
    res = ringfeed("train", str(cfg), "--elastic", timeout=90)
    assert res.returncode == 2, res.output[-3000:]
    assert res.stderr.count("\n") == 1 and res.stderr.startswith("ringfeed: error: ")
    assert "data.global_batch_size: elastic runs keep the per-rank batch" in res.stderr


@pytest.mark.timeout(300)
def test_the_fp16_loss_scale_is_carried_by_a_checkpoint(tmp_path, shards):
    """A checkpoint holds the fp16 loss scaler: a run resumed from step 4 - after overflows
    have lowered the scale - ends with the scale, weights and momentum of the uninterrupted
    run (one process, bit for bit). A resume with a fresh scaler would start again at 65536.

    Promise: What is lost on a crash (train/RECOVERY.md)."""
    def cfg(name: str) -> Path:
        return config(tmp_path, shards, name, data={"batch_size": 4, "val_split": None},
                      train={"max_steps": 8, "epochs": None, "log_every": 1, "precision": "fp16",
                             "loss": "train_util:overflow_when_first_is_class_0"},
                      checkpoint={"every_steps": 4, "keep": 5})

    env = {"PYTHONPATH": f"{REPO}:{REPO / 'tests'}"}
    full = ringfeed_forked(["train", cfg("full")], tmp_path / "full.log", env=env)
    assert full.code == 0, full.output[-3000:]
    at_4 = torch_final(tmp_path / "full", 4)["scaler"]
    assert at_4["scale"] < 65536.0, at_4  # overflows came before the checkpoint

    again = cfg("again")
    shutil.copytree(tmp_path / "full" / "checkpoints" / "ckpt-000000004",
                    tmp_path / "again" / "checkpoints" / "ckpt-000000004")
    res = ringfeed_forked(["train", again, "--resume", "auto"], tmp_path / "again.log", env=env)
    assert res.code == 0, res.output[-3000:]
    assert "at step 4" in res.output
    a, b = torch_final(tmp_path / "full", 8), torch_final(tmp_path / "again", 8)
    assert a["scaler"] == b["scaler"], (a["scaler"], b["scaler"])
    assert_same_torch_state(a, b)
    step_5 = next(r for r in read_jsonl(tmp_path / "again" / "metrics.jsonl")
                  if r["step"] == 5 and "loss" in r)
    assert step_5["loss_scale"] == at_4["scale"], step_5  # it ran at the restored scale


LOADER_THEN_SIGKILL = """
import os, signal, sys
from ringfeed.pipeline import ShardPipeline
from ringfeed.pipeline.torch import make_loader

loader = make_loader(ShardPipeline(sys.argv[1], batch_size=4, num_workers=2, rank=0,
                                   world_size=1))
next(iter(loader))
print(*[w.pid for w in loader.loader._iterator._workers], flush=True)
os.kill(os.getpid(), signal.SIGKILL)  # no exit handler, no close(): the workers are orphaned
"""


@pytest.mark.timeout(120)
def test_loader_workers_stop_when_their_training_process_is_killed(shards):
    """DataLoader workers ignore SIGTERM/SIGUSR1 (they must outlive a save), so nothing but
    their parent's death stops them when the training process is SIGKILLed: they must go
    (DataLoader's watchdog), not linger holding memory and shard files.

    Promise: Signals (train/RECOVERY.md)."""
    import psutil

    res = run([BIN / "python", "-c", LOADER_THEN_SIGKILL, shards], timeout=90)
    assert res.returncode == -signal.SIGKILL, res.output[-3000:]
    workers = [int(p) for p in res.stdout.split()]
    assert len(workers) == 2, res.output

    def alive(pid: int) -> bool:
        try:
            return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False

    deadline = time.monotonic() + 60  # the watchdog looks every 5 s
    while any(alive(p) for p in workers) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(alive(p) for p in workers), workers

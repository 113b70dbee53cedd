"""The sbatch scripts under docker/slurm/ on a real Slurm (issue 22): Debian's slurmctld, slurmd
and munged, started as root from a private config (tests/slurm_util.py), not the machine's.

1. docker/slurm/horovodrun.sbatch, 2 tasks on 1 node, with a real time limit and warning signal
   (`--time=2 --signal=B:USR1@30`): the ranks checkpoint on the signal, the script requeues the
   job, the second run (SLURM_RESTART_COUNT=1) resumes from that checkpoint with
   `--resume auto` and finishes, and its final weights and optimizer state equal an
   uninterrupted run's bit for bit (the same samples in the same steps too).
2. docker/slurm/srun_mpi.sbatch, the same with `--signal=B:USR1@60`: srun starts the 2 ranks
   through Slurm's PMIx plugin, Horovod runs on MPI (needs Horovod built with MPI: `mpicxx` at
   `make setup` time), the script's SIGTERM goes to the ranks through `scancel --signal=TERM`.

Measured here (2 cores): Slurm checks time limits every 30 s (slurmctld's PERIODIC_TIMEOUT), so
the signal asked for @N seconds before the limit comes between N and N + 30 s before it; with
`--time=2 --signal=B:USR1@30` between 60 and 90 s after the job starts. A requeued job then waits
about 2 minutes in PENDING (Reason=BeginTime); the test starts it at once with `scontrol update
JobId=N StartTime=now`. Skipped, with the reason, without root or Debian's packages
(`apt-get install slurmctld slurmd slurm-client munge`: .ci/run installs them).
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from fault_util import assert_same_torch_state, samples_by_epoch, torch_final
from helpers import BIN, REPO, horovodrun, test_env
from slurm_util import (
    PACE,
    Cluster,
    Node,
    missing_prerequisite,
    slurm_mpi_plugins,
    start_cluster,
    stop_cluster,
)
from train_util import toy_config, write_config, write_toy_shards

pytestmark = pytest.mark.system  # each test starts processes (tests/conftest.py)

TESTS = Path(__file__).resolve().parent
HOROVODRUN_SBATCH = REPO / "docker" / "slurm" / "horovodrun.sbatch"
SRUN_MPI_SBATCH = REPO / "docker" / "slurm" / "srun_mpi.sbatch"
EPOCHS = 5
STEPS = EPOCHS * 60  # 480 samples / (2 ranks x 4) per epoch
PACE_S = 0.35  # per step in a job's first run: ~105 s of training, past the signal at 60-90 s
ONE_NODE = ["--nodes=1", "--ntasks-per-node=2", "--gpus-per-node=0", "--cpus-per-task=1"]


def _timed(label: str, started: float) -> None:
    print(f"[test_slurm] {label} after {time.monotonic() - started:.1f} s", flush=True)


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    reason = missing_prerequisite()
    if reason:
        pytest.skip(reason)
    started = time.monotonic()
    c = start_cluster([Node(socket.gethostname().split(".")[0], "127.0.0.1")])
    _timed("one-node cluster up", started)
    try:
        yield c
    finally:
        stop_cluster(c)


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> Path:
    return write_toy_shards(tmp_path_factory.mktemp("toy") / "shards")


def job_config(directory: Path, shards: Path, name: str) -> Path:
    """2 ranks x 4 samples, 5 epochs (300 steps), a checkpoint every 20 steps, the samples of
    every step logged; the loss paced by RINGFEED_TEST_PACE_S (slurm_util)."""
    run_dir = directory / name
    return write_config(directory / f"{name}.yaml", **toy_config(
        shards, run_dir,
        data={"batch_size": 4, "num_workers": 1, "val_split": None},
        train={"epochs": EPOCHS, "log_every": 10, "loss": "slurm_util:paced_cross_entropy"},
        checkpoint={"every_steps": 20, "keep": 3},
        output={"dir": str(run_dir), "tensorboard": False, "sample_log": True}))


def job_env(**extra: str) -> dict[str, str]:
    """The submitter's environment, which the job inherits: the venv first on PATH, the
    repository (RINGFEED_REPO: where the scripts find requeue.sh) and tests/ (the paced loss)
    importable."""
    return test_env(PYTHONPATH=os.pathsep.join([str(REPO), str(TESTS),
                                                os.environ.get("PYTHONPATH", "")]),
                    RINGFEED_REPO=str(REPO), **extra)


@pytest.fixture(scope="module")
def reference(tmp_path_factory, shards) -> Path:
    """The same config trained uninterrupted: horovodrun -np 2 on this machine, no Slurm."""
    directory = tmp_path_factory.mktemp("reference")
    cfg = job_config(directory, shards, "run")
    res = horovodrun(2, [BIN / "ringfeed", "train", cfg], timeout=240, env=job_env())
    assert res.returncode == 0 and not res.timed_out, res.output[-4000:]
    return directory / "run"


def assert_same_as_reference(run_dir: Path, reference: Path) -> None:
    assert json.loads((run_dir / "summary.json").read_text())["step"] == STEPS
    # Nothing trained twice or skipped, and the same weights and momentum, bit for bit.
    assert samples_by_epoch(run_dir) == samples_by_epoch(reference)
    assert_same_torch_state(torch_final(reference, STEPS), torch_final(run_dir, STEPS))


def job_output(path: Path) -> str:
    return path.read_text(errors="replace") if path.exists() else "(no job output)"


# -- 1. time limit -> checkpoint -> requeue -> resume, one node --------------------------------
def test_time_limit_checkpoints_requeues_and_resumes_bit_identical(cluster, shards, reference,
                                                                   tmp_path):
    cfg = job_config(tmp_path, shards, "job")
    run_dir, out = tmp_path / "job", tmp_path / "job.out"
    started = time.monotonic()
    job = cluster.sbatch([*ONE_NODE, "--time=2", "--signal=B:USR1@30", f"--output={out}",
                          str(HOROVODRUN_SBATCH), str(cfg)],
                         env=job_env(**{PACE: str(PACE_S)}), cwd=tmp_path)
    # The signal, the ranks' checkpoint, `scontrol requeue` from the script.
    requeued = cluster.wait_job(
        job, lambda i: i.get("Restarts") == "1" and i.get("JobState") == "PENDING",
        timeout=150, what="the requeue")
    _timed(f"job {job} requeued ({requeued['JobState']}, Reason={requeued['Reason']})", started)
    output = job_output(out)
    assert f"ringfeed: job {job} on 1 node(s), restart 0: horovodrun -np 2" in output, output
    assert f"ringfeed: time limit near: ranks checkpoint, then job {job} is requeued" in output
    assert f"ringfeed: requeueing job {job}; it resumes from the newest checkpoint" in output
    stop = re.search(r"ringfeed train: stopped by SIGTERM at step (\d+)", output)
    assert stop, output[-4000:]
    stopped_at = int(stop.group(1))
    assert 0 < stopped_at < STEPS  # mid-run
    assert f"ckpt-{stopped_at:09d} (signal)" in output, output[-4000:]
    # Requeued jobs wait ~2 min (BeginTime) before they may start again; start it now.
    assert requeued["Reason"] == "BeginTime", requeued
    cluster.release(job)
    done = cluster.wait_job(job, lambda i: i.get("JobState") == "COMPLETED", timeout=150,
                            what="the second run to complete")
    _timed(f"job {job} completed", started)
    assert done["Restarts"] == "1" and done["ExitCode"] == "0:0", done
    output = job_output(out)
    second = output.split("restart 1: horovodrun", 1)
    assert len(second) == 2, output[-4000:]  # SLURM_RESTART_COUNT=1 in the second run
    ckpt = run_dir / "checkpoints" / f"ckpt-{stopped_at:09d}"
    assert f"resumed from {ckpt} at step {stopped_at}" in second[1], second[1][-4000:]
    assert f"ringfeed train: finished at step {STEPS}" in second[1], second[1][-4000:]
    assert "time limit near" not in second[1]
    assert_same_as_reference(run_dir, reference)


# -- 2. srun + PMIx + Horovod on MPI, with the same time-limit requeue ------------------------
def _srun_mpi_missing(cluster: Cluster) -> str | None:
    """Why srun_mpi.sbatch cannot run here (None when it can)."""
    probe = subprocess.run([str(BIN / "python"), "-c",
                            "import horovod.torch as h; print(h.mpi_built())"],
                           capture_output=True, text=True, timeout=120, env=test_env())
    if probe.stdout.strip() != "True":
        return ("Horovod is built without MPI (no `mpicxx` at `make setup` time: apt-get "
                "install openmpi-bin libopenmpi-dev, then make setup again)")
    plugins = slurm_mpi_plugins(cluster.env)
    if "pmix" not in plugins:
        return f"this Slurm has no PMIx plugin (srun --mpi=list: {plugins})"
    return None


def test_srun_mpi_time_limit_requeue_and_resume_bit_identical(cluster, shards, reference,
                                                              tmp_path):
    reason = _srun_mpi_missing(cluster)
    if reason:
        pytest.skip(reason)
    cfg = job_config(tmp_path, shards, "job")
    run_dir, out = tmp_path / "job", tmp_path / "job.out"
    started = time.monotonic()
    # The ranks are srun's tasks (PMIx wires up MPI); on the signal the script sends them
    # SIGTERM with `scancel --signal=TERM` (its "steps" mode). horovod.controller=mpi makes
    # the trainer fail unless Horovod really runs MPI.
    job = cluster.sbatch([*ONE_NODE, "--time=2", "--signal=B:USR1@60", f"--output={out}",
                          str(SRUN_MPI_SBATCH), str(cfg), "--set", "horovod.controller=mpi"],
                         env=job_env(**{PACE: str(PACE_S)}), cwd=tmp_path)
    cluster.wait_job(
        job, lambda i: i.get("Restarts") == "1" and i.get("JobState") == "PENDING",
        timeout=120, what="the requeue")
    _timed(f"job {job} requeued", started)
    output = job_output(out)
    assert f"restart 0: srun --mpi=pmix --kill-on-bad-exit=1 ringfeed train {cfg}" in output
    stop = re.search(r"ringfeed train: stopped by SIGTERM at step (\d+)", output)
    assert stop, output[-4000:]
    stopped_at = int(stop.group(1))
    assert 0 < stopped_at < STEPS and f"ckpt-{stopped_at:09d} (signal)" in output, output[-4000:]
    cluster.release(job)
    done = cluster.wait_job(job, lambda i: i.get("JobState") == "COMPLETED", timeout=120,
                            what="the second run to complete")
    _timed(f"job {job} completed", started)
    assert done["Restarts"] == "1" and done["ExitCode"] == "0:0", done
    second = job_output(out).split("restart 1: srun --mpi=pmix", 1)
    assert len(second) == 2
    ckpt = run_dir / "checkpoints" / f"ckpt-{stopped_at:09d}"
    assert f"resumed from {ckpt} at step {stopped_at}" in second[1], second[1][-4000:]
    assert f"ringfeed train: finished at step {STEPS}" in second[1], second[1][-4000:]
    assert_same_as_reference(run_dir, reference)

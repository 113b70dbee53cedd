"""The sbatch scripts under docker/slurm/ on a real Slurm (issue 22): Debian's slurmctld, slurmd
and munged, started as root from a private config (tests/slurm_util.py), not the machine's.

1. docker/slurm/horovodrun.sbatch, 2 tasks on 1 node, with a real time limit and warning signal
   (`--time=2 --signal=B:USR1@60`): the ranks checkpoint on the signal, the script requeues the
   job, the second run (SLURM_RESTART_COUNT=1) resumes from that checkpoint with
   `--resume auto` and finishes, and its final weights and optimizer state equal an
   uninterrupted run's bit for bit (the same samples in the same steps too).
2. docker/slurm/srun_mpi.sbatch, the same: srun starts the 2 ranks through Slurm's PMIx plugin,
   Horovod runs on MPI (needs Horovod built with MPI: `mpicxx` at `make setup` time), and the
   script's SIGTERM reaches the ranks through `scancel --signal=TERM`.
3. Both scripts on two Slurm nodes, one task each: a slurmd in each of two network-namespace
   hosts (benchmarks/netns_hosts.py, as tests/test_multinode.py makes them), sshd in each for
   horovodrun's ssh; each node's PMIx client directories kept apart (slurm_util).

Measured here (2 cores): Slurm checks time limits every 30 s (slurmctld's PERIODIC_TIMEOUT), so
the signal asked for @N seconds before the limit comes between N and N + 30 s before it: with
`--time=2 --signal=B:USR1@60` 30 to 60 s after the job starts, when the ranks have been training
for a while (they log their first steps 6 to 22 s after the start, with the machine busy). The
toy model's steps are paced in the first run only (slurm_util.paced_cross_entropy) so that it
is still training then. A requeued job waits about 2 minutes in PENDING (Reason=BeginTime);
the test starts it at once with `scontrol update JobId=N StartTime=now`. Skipped, with the
reason, without root or Debian's packages (`apt-get install slurmctld slurmd slurm-client
munge`: .ci/run installs them).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from fault_util import assert_same_torch_state, samples_by_epoch, torch_final
from helpers import BIN, REPO, test_env
from netns_sshd import SSH_PORT, SSHD, root_sshd
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

sys.path.insert(0, str(REPO / "benchmarks"))
import netns_hosts  # noqa: E402  (shared with tests/test_multinode.py)

pytestmark = pytest.mark.system  # each test starts processes (tests/conftest.py)

TESTS = Path(__file__).resolve().parent
HOROVODRUN_SBATCH = REPO / "docker" / "slurm" / "horovodrun.sbatch"
SRUN_MPI_SBATCH = REPO / "docker" / "slurm" / "srun_mpi.sbatch"
EPOCHS = 5
STEPS = EPOCHS * 60  # 480 samples / (2 ranks x 4) per epoch
PACE_S = 0.35  # per step in a job's first run: ~105 s of training, past the signal at 30-60 s
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


class Reference:
    """The same config trained uninterrupted: horovodrun -np 2 on this machine, no Slurm. Runs
    in the background from start() (while a paced job mostly sleeps), once per module."""

    def __init__(self, directory: Path, shards: Path):
        self.run_dir = directory / "run"
        self.cfg = job_config(directory, shards, "run")
        self.proc: subprocess.Popen | None = None
        self.log = directory / "horovodrun.log"

    def start(self) -> None:
        if self.proc is None:
            with open(self.log, "w") as log:
                self.proc = subprocess.Popen(
                    [str(BIN / "horovodrun"), "-np", "2", "-H", "localhost:2", "--gloo",
                     str(BIN / "ringfeed"), "train", str(self.cfg)],
                    env=job_env(), stdout=log, stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL, start_new_session=True)

    def wait(self) -> Path:
        self.start()
        try:
            code = self.proc.wait(timeout=240)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            code = self.proc.wait()
        assert code == 0, self.log.read_text()[-4000:]
        return self.run_dir


@pytest.fixture(scope="module")
def reference(tmp_path_factory, shards) -> Iterator[Reference]:
    ref = Reference(tmp_path_factory.mktemp("reference"), shards)
    yield ref
    if ref.proc is not None and ref.proc.poll() is None:
        os.killpg(ref.proc.pid, signal.SIGKILL)
        ref.proc.wait()


def assert_same_as_reference(run_dir: Path, ref: Reference) -> None:
    reference = ref.wait()
    assert json.loads((run_dir / "summary.json").read_text())["step"] == STEPS
    # Nothing trained twice or skipped, and the same weights and momentum, bit for bit.
    assert samples_by_epoch(run_dir) == samples_by_epoch(reference)
    assert_same_torch_state(torch_final(reference, STEPS), torch_final(run_dir, STEPS))


def job_output(path: Path) -> str:
    return path.read_text(errors="replace") if path.exists() else "(no job output)"


def through_the_time_limit(cluster: Cluster, reference: Reference, shards: Path, tmp_path: Path,
                           script: Path, *args: str) -> str:
    """sbatch SCRIPT CONFIG ARGS with `--time=2 --signal=B:USR1@60`, paced: the signal comes
    mid-run, the ranks checkpoint, the script requeues the job; the test starts the requeued
    job, which resumes and finishes (SLURM_RESTART_COUNT=1) with the weights of an
    uninterrupted run. Returns the job's output."""
    cfg = job_config(tmp_path, shards, "job")
    run_dir, out = tmp_path / "job", tmp_path / "job.out"
    started = time.monotonic()
    job = cluster.sbatch([*ONE_NODE, "--time=2", "--signal=B:USR1@60", f"--output={out}",
                          str(script), str(cfg), *args],
                         env=job_env(**{PACE: str(PACE_S)}), cwd=tmp_path)
    reference.start()  # alongside the paced first run, which mostly sleeps
    deadline, began = time.monotonic() + 120, None
    while time.monotonic() < deadline:
        if (run_dir / "metrics.jsonl").exists():
            began = round(time.monotonic() - started, 1)
            _timed(f"job {job}: first steps logged", started)
            break
        if cluster.job(job).get("JobState") not in ("PENDING", "CONFIGURING", "RUNNING"):
            break
        time.sleep(0.2)
    # The signal, the ranks' checkpoint, `scontrol requeue` from the script.
    requeued = cluster.wait_job(
        job, lambda i: i.get("Restarts") == "1" and i.get("JobState") == "PENDING",
        timeout=150, what="the requeue")
    output = job_output(out)
    assert f"ringfeed: job {job} on 1 node(s), restart 0: " in output, output[-4000:]
    assert f"ringfeed: time limit near: ranks checkpoint, then job {job} is requeued" in output
    assert f"ringfeed: requeueing job {job}; it resumes from the newest checkpoint" in output
    stop = re.search(r"ringfeed train: stopped by SIGTERM at step (\d+)", output)
    assert stop, (f"no checkpoint on the signal (first steps logged after {began} s; Slurm "
                  f"signals 30-60 s after the start):\n{output[-4000:]}")
    stopped_at = int(stop.group(1))
    _timed(f"job {job}: signalled, stopped at step {stopped_at}, requeued", started)
    assert 0 < stopped_at < STEPS  # mid-run
    assert f"ckpt-{stopped_at:09d} (signal)" in output, output[-4000:]
    # A requeued job may start again only ~2 min later (Reason=BeginTime, once the scheduler
    # has looked at it; None just before): start it now.
    _timed(f"job {job}: PENDING, Reason={requeued.get('Reason')}, "
           f"StartTime={requeued.get('StartTime')}", started)
    cluster.release(job)
    done = cluster.wait_job(job, lambda i: i.get("JobState") == "COMPLETED", timeout=150,
                            what="the second run to complete")
    _timed(f"job {job}: completed", started)
    assert done["Restarts"] == "1" and done["ExitCode"] == "0:0", done
    output = job_output(out)
    # The second run: SLURM_RESTART_COUNT=1, resumed from the signal's checkpoint, finished.
    second = output.split(f"ringfeed: job {job} on 1 node(s), restart 1: ", 1)
    assert len(second) == 2, output[-4000:]
    ckpt = run_dir / "checkpoints" / f"ckpt-{stopped_at:09d}"
    assert f"resumed from {ckpt} at step {stopped_at}" in second[1], second[1][-4000:]
    assert f"ringfeed train: finished at step {STEPS}" in second[1], second[1][-4000:]
    assert "time limit near" not in second[1]
    assert_same_as_reference(run_dir, reference)
    return output


# -- 1. time limit -> checkpoint -> requeue -> resume, one node --------------------------------
def test_time_limit_checkpoints_requeues_and_resumes_bit_identical(cluster, shards, reference,
                                                                   tmp_path):
    """Promise: Restarting a job: `ringfeed run` (train/RECOVERY.md)."""
    output = through_the_time_limit(cluster, reference, shards, tmp_path, HOROVODRUN_SBATCH)
    # The script's own launch line: 2 ranks on this node (SIGTERM to horovodrun on the signal).
    hostname = socket.gethostname().split(".")[0]
    assert f"restart 0: horovodrun -np 2 -H {hostname}:2 --gloo -p 22 ringfeed train" in output


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
    """Promise: Restarting a job: `ringfeed run` (train/RECOVERY.md)."""
    reason = _srun_mpi_missing(cluster)
    if reason:
        pytest.skip(reason)
    # The ranks are srun's tasks (PMIx wires up MPI); on the signal the script sends them
    # SIGTERM with `scancel --signal=TERM` (its "steps" mode). horovod.controller=mpi makes
    # the trainer fail unless Horovod really runs MPI.
    output = through_the_time_limit(cluster, reference, shards, tmp_path, SRUN_MPI_SBATCH,
                                    "--set", "horovod.controller=mpi")
    for run in (0, 1):
        assert f"restart {run}: srun --mpi=pmix --kill-on-bad-exit=1 ringfeed train" in output


# -- 3. two Slurm nodes: network-namespace hosts, horovodrun over ssh ------------------------
NS_PREFIX = "rfsl"
ADDRESSES = ("192.168.78.1", "192.168.78.2")
NODE_NAMES = ("rfnode1", "rfnode2")


@dataclass
class TwoNodes:
    cluster: Cluster
    ssh_path: Path  # put first on the job's PATH: an `ssh` with the test's client config
    sshd_logs: tuple[Path, Path]


@pytest.fixture
def two_nodes(tmp_path) -> Iterator[TwoNodes]:
    """Hosts rfnode1 (slurmctld, a slurmd, sshd) and rfnode2 (a slurmd, sshd): network
    namespaces joined by a veth link, each resolving both names (netns_hosts); horovodrun
    runs plain `ssh`, hence the wrapper with the test's client config."""
    reason = missing_prerequisite() or netns_hosts.missing_prerequisite(
        NS_PREFIX, ("ip", "ssh", "ssh-keygen"))
    if reason:
        pytest.skip(reason)
    if not os.access(SSHD, os.X_OK):
        pytest.skip(f"{SSHD} not found (Debian: apt-get install openssh-server)")
    for tool in ("nsenter", "unshare"):  # how slurm_util enters a namespace host
        if shutil.which(tool) is None:
            pytest.skip(f"`{tool}` not found (Debian: util-linux)")
    started = time.monotonic()
    ssh_dir = tmp_path / "ssh"
    cluster = None
    with netns_hosts.two_hosts(NS_PREFIX, ADDRESSES, names=NODE_NAMES) as namespaces, \
            root_sshd(namespaces, ADDRESSES, ssh_dir) as wrapper_dir:
        try:
            nodes = [Node(name, address, ns) for name, address, ns
                     in zip(NODE_NAMES, ADDRESSES, namespaces, strict=True)]
            cluster = start_cluster(nodes, ctld_netns=namespaces[0], ctld_address=ADDRESSES[0])
            # sshd is up on both hosts: rfnode1 reaches rfnode2 by name.
            deadline = time.monotonic() + 30
            while True:
                probe = cluster.run([wrapper_dir / "ssh", NODE_NAMES[1], "true"], timeout=20)
                if probe.returncode == 0:
                    break
                assert time.monotonic() < deadline, f"no ssh to {NODE_NAMES[1]}: {probe.output}"
                time.sleep(0.5)
            _timed("two-node cluster up (namespaces, sshd, slurmctld, 2 slurmd)", started)
            yield TwoNodes(cluster, wrapper_dir,
                           tuple(ssh_dir / f"sshd-{ns}.log" for ns in namespaces))
        finally:
            if cluster is not None:
                stop_cluster(cluster)


def _two_node_job(two_nodes: TwoNodes, shards: Path, tmp_path: Path, script: Path,
                  *args: str, **env: str) -> tuple[str, str, Path]:
    """sbatch SCRIPT on both nodes, one task each, unpaced, to completion: (job, output,
    run dir)."""
    cluster = two_nodes.cluster
    cfg = job_config(tmp_path, shards, "job")
    run_dir, out = tmp_path / "job", tmp_path / "job.out"
    started = time.monotonic()
    job_environ = job_env(**env)
    job_environ["PATH"] = f"{two_nodes.ssh_path}{os.pathsep}{job_environ['PATH']}"
    job = cluster.sbatch(["--nodes=2", "--ntasks-per-node=1", "--gpus-per-node=0",
                          "--cpus-per-task=1", "--time=5", f"--output={out}",
                          str(script), str(cfg), *args], env=job_environ, cwd=tmp_path)
    done = cluster.wait_job(job, lambda i: i.get("JobState") == "COMPLETED", timeout=240,
                            what="completion")
    _timed(f"2-node job {job} ({script.name}) completed", started)
    output = job_output(out)
    assert done["ExitCode"] == "0:0" and done["NodeList"] == "rfnode[1-2]", done
    assert f"ringfeed: job {job} on 2 node(s), restart 0: " in output, output[-4000:]
    assert "2 rank(s)" in output and f"finished at step {STEPS}" in output, output[-4000:]
    return job, output, run_dir


def test_horovodrun_sbatch_on_two_slurm_nodes(two_nodes, shards, reference, tmp_path):
    job, output, run_dir = _two_node_job(two_nodes, shards, tmp_path, HOROVODRUN_SBATCH,
                                         RINGFEED_SSH_PORT=str(SSH_PORT), RINGFEED_NIC="eth0")
    hosts = f"{NODE_NAMES[0]}:1,{NODE_NAMES[1]}:1"
    assert f"horovodrun -np 2 -H {hosts} --gloo -p {SSH_PORT} --network-interface eth0" \
        in output, output[-4000:]
    # Rank 1 ran on rfnode2, started over ssh from rfnode1 (where the batch script ran) ...
    assert f"Accepted publickey for root from {ADDRESSES[0]}" in two_nodes.sshd_logs[1].read_text()
    # ... and the two trained as one job, over the veth link: the reference's weights.
    assert_same_as_reference(run_dir, reference)


def test_srun_mpi_sbatch_on_two_slurm_nodes(two_nodes, shards, reference, tmp_path):
    reason = _srun_mpi_missing(two_nodes.cluster)
    if reason:
        pytest.skip(reason)
    job, output, run_dir = _two_node_job(two_nodes, shards, tmp_path, SRUN_MPI_SBATCH,
                                         "--set", "horovod.controller=mpi")
    assert "srun --mpi=pmix --kill-on-bad-exit=1 ringfeed train" in output, output[-4000:]
    # slurmd on rfnode2 started rank 1 (no ssh), and MPI between the hosts trained as one job.
    for node in NODE_NAMES:
        log = (two_nodes.cluster.root / "log" / f"slurmd-{node}.log").read_text()
        assert f"launch task StepId={job}.0 request" in log, log[-3000:]
    assert_same_as_reference(run_dir, reference)

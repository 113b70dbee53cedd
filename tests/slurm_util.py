"""A private Slurm cluster for tests/test_slurm.py: Debian's munged, slurmctld and slurmd, run as
root from a config of their own (private ports, state, spool, pid and log files, all under one
directory), and its clients (sbatch, squeue, scontrol, ...) pointed at it through SLURM_CONF.
Nothing of the machine's own Slurm or munge (/etc/slurm, /etc/munge, /run/munge) is used.

One node: every daemon in this machine's network. Two nodes: two network-namespace hosts
(benchmarks/netns_hosts.py), slurmctld and one slurmd in host A, another slurmd in host B; the
clients then run in host A too (`ip netns exec`).

Also the training loss the time-limit test runs: `paced_cross_entropy`.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil
from helpers import Result, run

DAEMONS = ("munged", "slurmctld", "slurmd")
CLIENTS = ("sbatch", "squeue", "scontrol", "scancel", "sinfo", "srun")
PACKAGES = "slurmctld slurmd slurm-client munge"
MARKER = "RINGFEED_SLURM_TEST_CLUSTER"  # in the env of every process the cluster starts
PACE = "RINGFEED_TEST_PACE_S"  # paced_cross_entropy's sleep per training step


def missing_prerequisite() -> str | None:
    """Why a private Slurm cluster cannot run here (None when it can)."""
    if os.geteuid() != 0:
        return "needs root (slurmd runs the jobs' processes as their user; munged, its own key)"
    for tool in (*DAEMONS, *CLIENTS):
        if shutil.which(tool) is None and not Path("/usr/sbin", tool).exists():
            return f"`{tool}` not found (Debian: apt-get install {PACKAGES})"
    return None


def _binary(name: str) -> str:
    return shutil.which(name) or str(Path("/usr/sbin", name))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def slurm_mpi_plugins(env: dict[str, str]) -> list[str]:
    """`srun --mpi=list`: the MPI plugin types this Slurm offers (pmix, pmi2, none, ...)."""
    out = subprocess.run(["srun", "--mpi=list"], capture_output=True, text=True, env=env,
                         timeout=30)
    text = out.stdout + out.stderr
    return [line.strip() for line in text.splitlines()
            if line.startswith(("\t", " ")) and line.strip()]


@dataclass
class Node:
    name: str
    address: str
    netns: str | None = None  # the network namespace its slurmd runs in (None: this one)


@dataclass
class Cluster:
    """A running private cluster. `env`: what a client needs (SLURM_CONF) on top of os.environ;
    jobs get the submitter's environment (sbatch's default --export=ALL)."""

    root: Path
    nodes: list[Node]
    conf: Path
    ctld_netns: str | None
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)

    @property
    def env(self) -> dict[str, str]:
        return {**os.environ, "SLURM_CONF": str(self.conf), MARKER: str(self.root)}

    def wrap(self, cmd: list[str]) -> list[str]:
        """`cmd` run where the controller is reachable (its namespace, if any)."""
        return ["ip", "netns", "exec", self.ctld_netns, *cmd] if self.ctld_netns else cmd

    def run(self, cmd: list[str], timeout: float = 30, env: dict[str, str] | None = None,
            cwd: Path | str | None = None) -> Result:
        return run(self.wrap([str(c) for c in cmd]), timeout=timeout,
                   env={**(env or self.env), "SLURM_CONF": str(self.conf), MARKER: str(self.root)},
                   cwd=cwd)

    def check(self, cmd: list[str], timeout: float = 30) -> str:
        res = self.run(cmd, timeout=timeout)
        if res.returncode != 0:
            raise AssertionError(f"{' '.join(map(str, cmd))} failed:\n{res.output}\n{self.logs()}")
        return res.stdout

    def sbatch(self, args: list[str], env: dict[str, str], cwd: Path) -> str:
        """Submits; returns the job id."""
        res = self.run(["sbatch", "--parsable", *args], env=env, cwd=cwd)
        if res.returncode != 0:
            raise AssertionError(f"sbatch failed:\n{res.output}\n{self.logs()}")
        return res.stdout.strip().split(";")[0]

    def job(self, job_id: str) -> dict[str, str]:
        """`scontrol show job -o JOB` as a dict (JobState, Reason, Restarts, ExitCode, ...)."""
        text = self.check(["scontrol", "show", "job", "-o", job_id])
        return dict(re.findall(r"(\S+?)=(\S*)", text))

    def wait_job(self, job_id: str, done, timeout: float, what: str) -> dict[str, str]:
        """Polls the job until done(info); returns that info. Fails with the logs after
        `timeout`, or when the job ended some other way."""
        deadline = time.monotonic() + timeout
        while True:
            info = self.job(job_id)
            if done(info):
                return info
            if info.get("JobState") in ("FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL",
                                        "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE") \
                    or time.monotonic() > deadline:
                raise AssertionError(f"job {job_id}: waited for {what}, got {info}\n"
                                     f"{self.logs()}")
            time.sleep(0.5)

    def release(self, job_id: str, timeout: float = 60) -> None:
        """A requeued job waits about 2 minutes (PENDING, Reason=BeginTime): start it now, once
        the previous run's step daemons have ended and the second of its requeue has passed.
        Slurm itself does not wait for the daemons: a
        `slurmstepd: [J.0]` may still be cleaning up when the job starts again, and with
        `srun --mpi=pmix` the new step J.0 then fails to launch (its PMIx socket
        SlurmdSpoolDir/stepd.slurm.pmix.J.0 is still bound: "Address already in use")."""
        deadline = time.monotonic() + timeout
        while self.step_daemons(job_id):
            if time.monotonic() > deadline:
                raise AssertionError(f"job {job_id}'s step daemons still run after "
                                     f"{timeout:.0f} s\n{self.logs()}")
            time.sleep(0.2)
        # Requeueing revoked the job's launch credential; slurmd rejects a new one created in
        # the same second ("Killing non-startable batch JobId=N: Job credential revoked", seen
        # once under load) - Slurm's own ~2 min BeginTime is that margin. One second of it:
        time.sleep(1.5)
        self.check(["scontrol", "update", f"JobId={job_id}", "StartTime=now"])

    def step_daemons(self, job_id: str) -> list[str]:
        """The titles of this cluster's live `slurmstepd: [JOB.STEP]` processes of the job."""
        found = []
        for proc in psutil.process_iter(["cmdline"]):
            try:
                title = " ".join(proc.info["cmdline"] or []).split()  # padded with blanks
                if len(title) == 2 and title[0] == "slurmstepd:" \
                        and title[1].startswith(f"[{job_id}.") and started_by(proc.pid, self.root):
                    found.append(title[1])
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue
        return found

    def logs(self, lines: int = 40) -> str:
        parts = []
        for path in sorted((self.root / "log").glob("*")):
            text = path.read_text(errors="replace").splitlines()[-lines:]
            parts.append(f"--- {path.name} ---\n" + "\n".join(text))
        return "\n".join(parts)


def started_by(pid: int, root: Path) -> bool:
    """Whether the process has MARKER=root in its environment: started by that cluster's
    daemons or jobs. Read raw (slurmstepd writes its title over the start of that area, which
    psutil's environ() then misreads)."""
    try:
        return f"\0{MARKER}={root}\0".encode() in b"\0" + Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return False


def write_config(root: Path, nodes: list[Node], ctld_host: str, ctld_address: str,
                 cpus: int) -> Path:
    ports = {"SlurmctldPort": free_port(), "SlurmdPort": free_port()}
    lines = [
        "# A private one-off cluster for tests/test_slurm.py",
        "ClusterName=ringfeedtest",
        f"SlurmctldHost={ctld_host}({ctld_address})",
        *(f"{k}={v}" for k, v in ports.items()),
        "SlurmUser=root",
        "SlurmdUser=root",
        "AuthType=auth/munge",
        "CredType=cred/munge",
        f"AuthInfo=socket={root / 'munge' / 'munge.socket'}",
        f"StateSaveLocation={root / 'state'}",
        f"SlurmdSpoolDir={root / 'spool' / '%n'}",
        f"SlurmctldPidFile={root / 'run' / 'slurmctld.pid'}",
        f"SlurmdPidFile={root / 'run' / 'slurmd-%n.pid'}",
        f"SlurmctldLogFile={root / 'log' / 'slurmctld.log'}",
        f"SlurmdLogFile={root / 'log' / 'slurmd-%n.log'}",
        "SlurmctldDebug=info",
        "SlurmdDebug=info",
        # No cgroups (none to delegate in a container): processes tracked by parent pid.
        "ProctrackType=proctrack/linuxproc",
        "TaskPlugin=task/none",
        "SelectType=select/cons_tres",
        "SelectTypeParameters=CR_CPU",
        "JobAcctGatherType=jobacct_gather/none",
        "AccountingStorageType=accounting_storage/none",
        "MpiDefault=none",
        "ReturnToService=2",
        "MinJobAge=600",  # finished jobs stay visible to scontrol show job
        "KillWait=5",
        *(f"NodeName={n.name} NodeAddr={n.address} CPUs={cpus} State=UNKNOWN" for n in nodes),
        "PartitionName=test Nodes=ALL Default=YES MaxTime=INFINITE State=UP",
    ]
    conf = root / "slurm.conf"
    conf.write_text("\n".join(lines) + "\n")
    # srun --mpi=pmix: where a node's slurmstepd makes its PMIx client directories (start_cluster
    # mounts a directory of the node's own there).
    (root / "mpi.conf").write_text(f"PMIxCliTmpDirBase={root / 'pmix' / 'node'}\n")
    return conf


def start_cluster(nodes: list[Node], ctld_netns: str | None = None,
                  ctld_address: str = "127.0.0.1", timeout: float = 60) -> Cluster:
    """munged, slurmctld (in `ctld_netns`, reachable at `ctld_address`) and one slurmd per
    node; returns once every node is idle. Stop it with stop_cluster()."""
    # munged wants every directory above its socket searchable by all, and its key private.
    root = Path(tempfile.mkdtemp(prefix="ringfeed-slurm-"))
    root.chmod(0o711)
    for sub in ("munge", "state", "spool", "run", "log", "pmix/node"):
        (root / sub).mkdir(parents=True)
    (root / "munge").chmod(0o711)
    key = root / "munge" / "munge.key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o600)
    conf = write_config(root, nodes, socket.gethostname().split(".")[0], ctld_address,
                        os.cpu_count() or 1)
    cluster = Cluster(root, nodes, conf, ctld_netns)
    env = {**cluster.env}

    def daemon(name: str, cmd: list[str], netns: str | None) -> None:
        log = open(root / "log" / f"{name}.out", "w")
        full = in_netns(netns, cmd) if netns else cmd
        cluster.procs[name] = subprocess.Popen(full, stdout=log, stderr=subprocess.STDOUT,
                                               stdin=subprocess.DEVNULL, env=env,
                                               start_new_session=True)
        log.close()

    try:
        munge_dir = root / "munge"
        daemon("munged", [_binary("munged"), "--foreground", f"--key-file={key}",
                          f"--socket={munge_dir / 'munge.socket'}",
                          f"--pid-file={munge_dir / 'munged.pid'}",
                          f"--seed-file={munge_dir / 'munged.seed'}"], None)
        _wait(lambda: (munge_dir / "munge.socket").exists(), 20, "munged's socket", cluster)
        daemon("slurmctld", [_binary("slurmctld"), "-D", "-f", str(conf)], ctld_netns)
        for node in nodes:
            # Each node's PMIx client directories (TMPDIR/spmix_appdir_UID_JOB.STEP) in a
            # directory of its own: nodes on one machine would share them.
            own = root / "pmix" / node.name
            own.mkdir(parents=True)
            daemon(f"slurmd-{node.name}", with_bind(own, root / "pmix" / "node", [
                _binary("slurmd"), "-D", "-f", str(conf), "-N", node.name]), node.netns)

        def all_idle() -> bool:
            res = cluster.run(["sinfo", "-h", "-N", "-o", "%N %T"], timeout=15)
            states = dict(line.split() for line in res.stdout.splitlines() if line.strip())
            return res.returncode == 0 and all(states.get(n.name) == "idle" for n in nodes)

        _wait(all_idle, timeout, "every node idle (sinfo)", cluster)
    except BaseException:
        stop_cluster(cluster)
        raise
    return cluster


def in_netns(netns: str, cmd: list[str]) -> list[str]:
    """`cmd` in network namespace `netns` with that namespace's /etc/hosts (/etc/netns/NS/hosts,
    when there is one) in a mount namespace of its own. Not `ip netns exec`, which also mounts
    a fresh /sys without /sys/fs/cgroup: slurmd 22.05 then stops even with proctrack/linuxproc
    and task/none ("No filesystem mounted on /sys/fs/cgroup", "Unable to initialize cgroup
    plugin", "slurmd initialization failed")."""
    script = 'if [ -f "$1" ]; then mount --bind "$1" /etc/hosts; fi; shift; exec "$@"'
    return ["nsenter", f"--net=/run/netns/{netns}", "unshare", "--mount", "--propagation",
            "private", "sh", "-c", script, "sh", f"/etc/netns/{netns}/hosts", *cmd]


def with_bind(source: Path, target: Path, cmd: list[str]) -> list[str]:
    """`cmd` with `source` bind-mounted on `target`, in a mount namespace of its own."""
    return ["unshare", "--mount", "--propagation", "private", "sh", "-c",
            'mount --bind "$1" "$2"; shift 2; exec "$@"', "sh", str(source), str(target), *cmd]


def _wait(predicate, timeout: float, what: str, cluster: Cluster) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        for name, proc in cluster.procs.items():
            if proc.poll() is not None:
                raise AssertionError(f"{name} exited ({proc.returncode}) while waiting for "
                                     f"{what}\n{cluster.logs()}")
        if time.monotonic() > deadline:
            raise AssertionError(f"no {what} after {timeout:.0f} s\n{cluster.logs()}")
        time.sleep(0.3)


def stop_cluster(cluster: Cluster) -> None:
    """Cancel the jobs, stop the daemons, end what is left (slurmstepd and the jobs' processes
    carry MARKER in their environment), remove the directory."""
    if cluster.procs.get("slurmctld") and cluster.procs["slurmctld"].poll() is None:
        jobs = cluster.run(["squeue", "-h", "-o", "%i"], timeout=15).stdout.split()
        if jobs:
            cluster.run(["scancel", *jobs], timeout=15)
            deadline = time.monotonic() + 15
            while time.monotonic() < deadline and cluster.run(
                    ["squeue", "-h", "-o", "%i"], timeout=15).stdout.split():
                time.sleep(0.5)
    for name in ("slurmd", "slurmctld", "munged"):  # slurmds first, munged last
        for key, proc in cluster.procs.items():
            if key.startswith(name) and proc.poll() is None:
                proc.terminate()
        for key, proc in cluster.procs.items():
            if key.startswith(name):
                try:
                    proc.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait(timeout=10)
    # Then whatever outlived them (slurmctld's slurmscriptd is its child: killed before it,
    # slurmctld hangs in its shutdown).
    for proc in psutil.process_iter():
        if proc.pid != os.getpid() and started_by(proc.pid, cluster.root):
            try:
                proc.kill()
            except psutil.NoSuchProcess:
                continue
    shutil.rmtree(cluster.root, ignore_errors=True)


# -- the time-limit test's loss ------------------------------------------------------------
def paced_cross_entropy(logits, targets):
    """Cross entropy per sample, as the built-in classifier's; in a job's first run (no
    SLURM_RESTART_COUNT yet) each training step first sleeps RINGFEED_TEST_PACE_S seconds, so
    that a toy model is still training when Slurm's time-limit signal comes, without burning
    the machine's CPUs; the resumed run and the reference run go at full speed. Sleeping
    changes no number: the weights stay bit-identical to an unpaced run's."""
    import torch.nn.functional as F

    pace = float(os.environ.get(PACE, "0") or 0)
    if pace and logits.requires_grad and os.environ.get("SLURM_RESTART_COUNT", "0") == "0":
        time.sleep(pace)
    return F.cross_entropy(logits.float(), targets, reduction="none")

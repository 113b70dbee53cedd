"""Multi-node without containers: two network-namespace "hosts" on this machine, sshd in each,
and `horovodrun -np 2 -H 192.168.77.1:1,192.168.77.2:1` (Gloo over ssh) across them.

Host A and host B are network namespaces joined by one veth pair whose ends are both named eth0
(Horovod needs one interface name on all hosts), with 192.168.77.1/.2 inside the namespaces only;
the machine's own network is never touched. sshd (Debian's openssh-server) runs in each namespace
on port 2222 with keys the test makes, configured by docker/entrypoint.sh (the images' entry
point). horovodrun starts in A: rank 0 runs there, rank 1 is started in B over ssh.

1. The recipe as root: sshd and horovodrun run as root with a test client config.
2. The images' path: docker/entrypoint.sh with RINGFEED_SSHD=1 as an unprivileged user, as in
   docker-compose.yml (job key made at start in a shared directory, sshd without root, the
   user's ~/.ssh/config, waiting for the peer's sshd), then horovodrun as that user.
Needs root, `ip netns`, sshd (and util-linux's unshare/setpriv for 2); skipped otherwise.
"""

from __future__ import annotations

import json
import os
import pwd
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import helpers
import pytest
from helpers import BIN, REPO, run
from netns_sshd import ENTRYPOINT, SSH_PORT, SSHD, root_sshd

sys.path.insert(0, str(REPO / "benchmarks"))
import netns_hosts  # noqa: E402  (shared with benchmarks/local_sgd_bench.py)

WORKER = Path(__file__).resolve().parent / "multinode_worker.py"
ADDRESSES = ("192.168.77.1", "192.168.77.2")
NS_PREFIX = "rfmn"
HOROVODRUN_ACROSS = ["-np", "2", "-H", f"{ADDRESSES[0]}:1,{ADDRESSES[1]}:1", "-p", str(SSH_PORT),
                     "--gloo", "--network-interface", "eth0", "--disable-cache",
                     "--start-timeout", "60"]


def training_command(out: Path) -> list[str]:
    """A real Horovod training loop that reports where each rank ran and what it computed, so
    the assertions can prove the allreduce crossed hosts (test_ringfeed_train_... runs the
    product's own `ringfeed train` across the same hosts)."""
    return [str(BIN / "python"), str(WORKER), str(out), "--steps", "5"]


# ---- prerequisites and the two namespaces ------------------------------------------------------

def _missing_prerequisite() -> str | None:
    reason = netns_hosts.missing_prerequisite(NS_PREFIX, ("ip", "ssh", "ssh-keygen"))
    if reason:
        return reason
    if not os.access(SSHD, os.X_OK):
        return f"{SSHD} not found (Debian: apt-get install openssh-server)"
    if not (BIN / "horovodrun").exists():
        return f"{BIN / 'horovodrun'} not found: Horovod is not installed (make setup)"
    return None


@pytest.fixture
def namespaces() -> Iterator[tuple[str, str]]:
    """Hosts A and B: eth0 with 192.168.77.1 and .2, one veth link between them, lo up."""
    reason = _missing_prerequisite()
    if reason:
        pytest.skip(reason)
    with netns_hosts.two_hosts(NS_PREFIX, ADDRESSES) as pair:
        yield pair


def _assert_trained_across_hosts(out: Path) -> None:
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    assert [r["size"] for r in ranks] == [2, 2]
    # One rank per host: different namespaces, each on its own address ...
    assert {r["address"] for r in ranks} == set(ADDRESSES)
    assert ranks[0]["netns"] != ranks[1]["netns"]
    # ... and each learned the other's from an allgather, i.e. over the veth link.
    for r in ranks:
        assert sorted((e["rank"], e["address"], e["netns"]) for e in r["everyone"]) == sorted(
            (q["rank"], q["address"], q["netns"]) for q in ranks)
    # Broadcast: rank 1 started from other weights and took rank 0's.
    assert ranks[1]["initial_local"] != ranks[0]["initial_local"]
    assert ranks[1]["initial"] == ranks[0]["initial"] == ranks[0]["initial_local"]
    # Allreduce: both replicas end identical, moved from the start, and equal to one process
    # doing the same SGD on the full batches (what averaging the two halves' gradients means).
    assert ranks[0]["final"] == ranks[1]["final"] == ranks[0]["all_final"][1]
    assert ranks[0]["final"] != ranks[0]["initial"]
    assert ranks[0]["final"] == pytest.approx(ranks[0]["reference_final"], rel=1e-9, abs=1e-12)
    # The halves really differed (each rank saw its own data).
    assert ranks[0]["local_losses"] != ranks[1]["local_losses"]


# ---- 1. the recipe, as root ----------------------------------------------------------------------

@dataclass
class RootHosts:
    namespaces: tuple[str, str]
    env: dict[str, str]  # PATH leads to an `ssh` that uses the test's client config


def _wait_for_ssh(env: dict[str, str], namespace: str, address: str, deadline_s: float) -> None:
    deadline = time.monotonic() + deadline_s
    while True:
        probe = run(["ip", "netns", "exec", namespace, "ssh", address, "true"], timeout=15, env=env)
        if probe.returncode == 0:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"no ssh to {address} from {namespace}: {probe.output}")
        time.sleep(0.5)


@pytest.fixture
def root_hosts(namespaces: tuple[str, str], tmp_path: Path) -> Iterator[RootHosts]:
    ssh_dir = tmp_path / "ssh"  # keys, configs, logs: removed at the end, pass or fail
    try:
        with root_sshd(namespaces, ADDRESSES, ssh_dir) as wrapper_dir:
            env = helpers.test_env(
                PATH=f"{wrapper_dir}{os.pathsep}{BIN}{os.pathsep}{os.environ['PATH']}")
            for ns in namespaces:
                for address in ADDRESSES:
                    _wait_for_ssh(env, ns, address, deadline_s=30)
            yield RootHosts(namespaces, env)
    finally:
        shutil.rmtree(ssh_dir, ignore_errors=True)


@pytest.mark.system
def test_horovodrun_trains_across_two_netns_hosts(root_hosts: RootHosts, tmp_path: Path) -> None:
    out = tmp_path / "out"
    launcher = ["ip", "netns", "exec", root_hosts.namespaces[0], str(BIN / "horovodrun"),
                *HOROVODRUN_ACROSS]
    result = run([*launcher, *training_command(out)], timeout=240, cwd=REPO, env=root_hosts.env)
    assert result.returncode == 0 and not result.timed_out, result.output[-4000:]
    _assert_trained_across_hosts(out)


@pytest.mark.system
def test_ringfeed_train_across_two_netns_hosts(root_hosts: RootHosts, tmp_path: Path) -> None:
    from train_util import toy_config, write_config, write_toy_shards

    shards = write_toy_shards(tmp_path / "shards", n_train=160, n_val=32, per_shard=40)
    run_dir = tmp_path / "run"
    config = write_config(tmp_path / "cfg.yaml", **toy_config(
        shards, run_dir, train={"max_steps": 12, "log_every": 2},
        checkpoint={"every_steps": 6, "keep": 3}))
    launcher = ["ip", "netns", "exec", root_hosts.namespaces[0], str(BIN / "horovodrun"),
                *HOROVODRUN_ACROSS]
    result = run([*launcher, str(BIN / "ringfeed"), "train", str(config)], timeout=240, cwd=REPO,
                 env=root_hosts.env)
    assert result.returncode == 0 and not result.timed_out, result.output[-4000:]
    assert "2 rank(s)" in result.output
    steps = [json.loads(line).get("step") for line in
             (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert max(s for s in steps if s is not None) == 12
    from ringfeed.train.checkpoint.files import checkpoint_path
    assert (checkpoint_path(run_dir / "checkpoints", 12) / "meta.json").is_file()


# ---- 2. the images' entry point, as an unprivileged user ---------------------------------------

USER = "rfjob"


def _free_uid() -> int:
    uid = 54321
    while True:
        try:
            pwd.getpwuid(uid)
            uid += 1
        except KeyError:
            return uid


def _user_view(sandbox: Path, uid: int, needed: list[Path]) -> str:
    """Shell lines, run in a private mount namespace, that give the job user a passwd entry
    (home: SANDBOX/home) and a way to every path in `needed`: a directory the user cannot
    traverse (e.g. /root holding the venv's interpreter) is covered, in that namespace only, by
    a tmpfs holding just the needed children, bind-mounted back."""
    lines = ["set -eu"]
    for name, entry in (("passwd", f"{USER}:x:{uid}:{uid}::{sandbox}/home:/bin/bash"),
                        ("group", f"{USER}:x:{uid}:")):
        (sandbox / name).write_text(Path(f"/etc/{name}").read_text() + entry + "\n")
        lines.append(f"mount --bind {sandbox}/{name} /etc/{name}")
    blocked: dict[Path, set[str]] = {}
    for path in needed:
        for parent in reversed(path.parents):
            if not parent.stat().st_mode & stat.S_IXOTH:
                blocked.setdefault(parent, set()).add(path.relative_to(parent).parts[0])
    for i, (directory, children) in enumerate(sorted(blocked.items())):
        staged = sandbox / "exposed" / str(i)
        lines += [f"mkdir -p {staged / c}" for c in children]
        lines += [f"mount --bind {directory / c} {staged / c}" for c in children]
        lines.append(f"mount -t tmpfs -o mode=755 tmpfs {directory}")
        for c in children:
            lines += [f"mkdir {directory / c}", f"mount --bind {staged / c} {directory / c}"]
    lines.append(f'exec setpriv --reuid={uid} --regid={uid} --clear-groups env -i "$@"')
    return "\n".join(lines)


@pytest.mark.system
def test_image_entrypoint_as_unprivileged_user_across_two_netns_hosts(
        namespaces: tuple[str, str]) -> None:
    for tool in ("unshare", "setpriv"):
        if shutil.which(tool) is None:
            pytest.skip(f"`{tool}` not found (Debian: util-linux)")
    # Not under pytest's tmp_path: its parent is private to root.
    sandbox = Path(tempfile.mkdtemp(prefix="ringfeed-job-"))
    host_b = None
    try:
        sandbox.chmod(0o755)
        uid = _free_uid()
        home, out = sandbox / "home", sandbox / "home" / "out"
        home.mkdir()
        os.chown(home, uid, uid)
        view = _user_view(sandbox, uid, [Path(os.path.realpath(BIN / "python")), REPO, sandbox])
        # What docker-compose.yml gives each node: the image's env and RINGFEED_SSHD=1. The job's
        # key directory sits under the home (the image uses /var/lib/ringfeed/ssh), because
        # sshd's StrictModes rejects the world-writable /tmp above it.
        env = [f"HOME={home}", f"PATH={BIN}:/usr/bin:/bin", "OMP_NUM_THREADS=1",
               "PYTHONUNBUFFERED=1", "TF_CPP_MIN_LOG_LEVEL=2", "CUDA_VISIBLE_DEVICES=",
               "RINGFEED_SSHD=1", f"RINGFEED_SSH_DIR={home}/ssh-job",
               f"RINGFEED_SSH_PORT={SSH_PORT}"]

        def on_host(ns: str, *command: str, extra_env: tuple[str, ...] = ()) -> list[str]:
            return ["ip", "netns", "exec", ns, "unshare", "--mount", "--propagation", "private",
                    "bash", "-c", view, "view", *env, *extra_env, "bash", str(ENTRYPOINT),
                    *command]

        # Both "hosts" share this one home, so B goes first and has made the host key and
        # started sshd before A starts (separate containers each have their own home).
        sshd_log = home / ".ringfeed-sshd" / "sshd.log"
        host_b = subprocess.Popen(on_host(namespaces[1], "sleep", "600"), cwd=home,
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                  start_new_session=True)
        deadline = time.monotonic() + 60
        while not (sshd_log.exists() and "Server listening" in sshd_log.read_text()):
            assert host_b.poll() is None, f"host B's entry point exited with {host_b.returncode}"
            assert time.monotonic() < deadline, "host B's sshd did not start within 60 s"
            time.sleep(0.3)

        result = run(on_host(namespaces[0], "horovodrun", *HOROVODRUN_ACROSS,
                             *training_command(out),
                             extra_env=(f"RINGFEED_WAIT_FOR_SSH={ADDRESSES[1]}", "RINGFEED_WAIT_S=30")),
                     timeout=240, cwd=home)
        log = sshd_log.read_text() if sshd_log.exists() else "(no sshd log)"
        assert result.returncode == 0 and not result.timed_out, result.output[-4000:] + log
        assert f"Accepted publickey for {USER}" in log  # rank 1 really came in over ssh
        _assert_trained_across_hosts(out)
    finally:
        if host_b is not None and host_b.poll() is None:
            os.killpg(host_b.pid, signal.SIGKILL)
            host_b.wait(timeout=10)
        shutil.rmtree(sandbox, ignore_errors=True)

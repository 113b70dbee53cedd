"""Multi-node without containers: two network-namespace "hosts" on this machine, sshd in each,
and `horovodrun -np 2 -H 192.168.77.1:1,192.168.77.2:1` (Gloo over ssh) across them.

Host A and host B are network namespaces joined by one veth pair whose ends are both named eth0
(Horovod needs one interface name on all hosts), with 192.168.77.1/.2 inside the namespaces only;
the machine's own network is never touched. sshd (Debian's openssh-server) runs in each namespace
on port 2222, configured by docker/entrypoint.sh, the same script the images use, with a client
key and host keys the test makes in a temporary directory. horovodrun starts in A: rank 0 runs
there, rank 1 is started in B over ssh. Needs root, `ip netns` and sshd; skipped otherwise.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import helpers
import pytest
from helpers import BIN, REPO, Result, run

ENTRYPOINT = REPO / "docker" / "entrypoint.sh"
WORKER = Path(__file__).resolve().parent / "multinode_worker.py"
SSHD = "/usr/sbin/sshd"  # sshd refuses to start from a relative path
SSH_PORT = 2222
ADDRESSES = ("192.168.77.1", "192.168.77.2")
NS_PREFIX = "rfmn"


@dataclass
class TwoHosts:
    namespaces: tuple[str, str]
    env: dict[str, str]  # PATH leads to an `ssh` that uses the test's client config


def _missing_prerequisite() -> str | None:
    if os.geteuid() != 0:
        return "needs root to create network namespaces (ip netns add) and run sshd"
    for tool in ("ip", "ssh", "ssh-keygen"):
        if shutil.which(tool) is None:
            return f"`{tool}` not found (Debian: apt-get install iproute2 openssh-client)"
    if not os.access(SSHD, os.X_OK):
        return f"{SSHD} not found (Debian: apt-get install openssh-server)"
    if not (BIN / "horovodrun").exists():
        return f"{BIN / 'horovodrun'} not found: Horovod is not installed (make setup)"
    probe = f"{NS_PREFIX}probe{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"`ip netns add` failed here: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=30)


def _remove_stale_namespaces() -> None:
    """Namespaces left by an earlier run of this test that was killed before its cleanup."""
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    for name in (line.split()[0] for line in listed.splitlines() if line.strip()):
        owner = name[len(NS_PREFIX):-1]
        if name.startswith(NS_PREFIX) and owner.isdigit() and not Path(f"/proc/{owner}").exists():
            _teardown_namespace(name)


def _teardown_namespace(name: str) -> None:
    # Everything still running in the namespace (sshd, its sessions, a stuck rank) was started
    # by this test; kill it, then the namespace (which takes its veth end with it).
    pids = subprocess.run(["ip", "netns", "pids", name], capture_output=True, text=True).stdout
    for pid in pids.split():
        try:
            os.kill(int(pid), signal.SIGKILL)
        except ProcessLookupError:
            pass
    subprocess.run(["ip", "netns", "del", name], capture_output=True)


def _entrypoint(*args: str) -> str:
    return subprocess.run(["bash", str(ENTRYPOINT), *args], check=True, capture_output=True,
                          text=True, timeout=60).stdout


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
def two_hosts(tmp_path: Path) -> Iterator[TwoHosts]:
    reason = _missing_prerequisite()
    if reason:
        pytest.skip(reason)
    _remove_stale_namespaces()
    namespaces = (f"{NS_PREFIX}{os.getpid()}a", f"{NS_PREFIX}{os.getpid()}b")
    ssh_dir = tmp_path / "ssh"  # keys, configs, logs: removed at the end, pass or fail
    keys = ssh_dir / "keys"
    sshd_procs: list[subprocess.Popen] = []
    try:
        for ns in namespaces:
            _ip("netns", "add", ns)
        _ip("link", "add", "eth0", "netns", namespaces[0], "type", "veth",
            "peer", "name", "eth0", "netns", namespaces[1])
        for ns, address in zip(namespaces, ADDRESSES, strict=True):
            _ip("-n", ns, "addr", "add", f"{address}/24", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")
            _ip("-n", ns, "link", "set", "lo", "up")

        _entrypoint("keygen", str(keys))
        # sshd as root needs its privilege-separation directory (the package's service makes it).
        os.makedirs("/run/sshd", mode=0o755, exist_ok=True)
        for ns, address in zip(namespaces, ADDRESSES, strict=True):
            config = _entrypoint("sshd-config", str(ssh_dir / f"sshd-{ns}"), str(SSH_PORT),
                                 str(keys / "authorized_keys")).strip()
            log = open(ssh_dir / f"sshd-{ns}.log", "w")  # the child keeps its own descriptor
            # The images' config is for an unprivileged user; the test runs as root, whose keys
            # live in a temporary (world-writable-parent) directory.
            sshd_procs.append(subprocess.Popen(
                ["ip", "netns", "exec", ns, SSHD, "-D", "-e", "-f", config,
                 "-o", f"ListenAddress={address}", "-o", "PermitRootLogin=prohibit-password",
                 "-o", "StrictModes=no"],
                stdout=log, stderr=subprocess.STDOUT, start_new_session=True))
            log.close()

        # ssh reads ~/.ssh of the passwd entry, not $HOME: a wrapper first on PATH hands it the
        # test's config (horovodrun runs plain `ssh`, and forwards PATH to the remote rank).
        client_config = ssh_dir / "ssh_config"
        client_config.write_text(_entrypoint("ssh-config", str(keys / "id_ed25519"),
                                             str(SSH_PORT), str(ssh_dir / "known_hosts")))
        wrapper_dir = ssh_dir / "bin"
        wrapper_dir.mkdir()
        (wrapper_dir / "ssh").write_text(f'#!/bin/sh\nexec /usr/bin/ssh -F "{client_config}" "$@"\n')
        (wrapper_dir / "ssh").chmod(0o755)
        env = helpers.test_env(PATH=f"{wrapper_dir}{os.pathsep}{BIN}{os.pathsep}{os.environ['PATH']}")

        for ns in namespaces:
            for address in ADDRESSES:
                _wait_for_ssh(env, ns, address, deadline_s=30)
        yield TwoHosts(namespaces, env)
    finally:
        for proc in sshd_procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
        for ns in namespaces:
            _teardown_namespace(ns)
        shutil.rmtree(ssh_dir, ignore_errors=True)


def _horovodrun_across(hosts: TwoHosts, command: list[str], timeout: float) -> Result:
    launcher = ["ip", "netns", "exec", hosts.namespaces[0], str(BIN / "horovodrun"),
                "-np", "2", "-H", f"{ADDRESSES[0]}:1,{ADDRESSES[1]}:1", "-p", str(SSH_PORT),
                "--gloo", "--network-interface", "eth0", "--disable-cache",
                "--start-timeout", "60"]
    return run([*launcher, *command], timeout=timeout, cwd=REPO, env=hosts.env)


@pytest.mark.slow
def test_horovodrun_trains_across_two_netns_hosts(two_hosts: TwoHosts, tmp_path: Path) -> None:
    out = tmp_path / "out"
    # TODO(issue 5): once `ringfeed train` lands, this is the line to swap for
    # [str(BIN / "ringfeed"), "train", CONFIG, "--set", ...] (and assert on its metrics.jsonl).
    training = [str(BIN / "python"), str(WORKER), str(out), "--steps", "5"]
    result = _horovodrun_across(two_hosts, training, timeout=240)
    assert result.returncode == 0 and not result.timed_out, result.output[-4000:]

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

"""Two "hosts" on one machine: network namespaces A and B joined by one veth pair.

Both ends are named eth0 (Horovod needs one interface name on every host) and carry the given
addresses inside the namespaces only: the machine's own network is never touched. Used by
tests/test_multinode.py (sshd in each host), benchmarks/local_sgd_bench.py (a rate-limited
link) and tests/test_slurm.py (a slurmd in each host, which needs host names: `names` gives
each namespace an /etc/hosts of its own, which `ip netns exec` mounts over /etc/hosts for what
it starts). Needs root and iproute2.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

NETNS_ETC = Path("/etc/netns")  # `ip netns exec NS` bind-mounts /etc/netns/NS/* over /etc/*


def missing_prerequisite(prefix: str, tools: tuple[str, ...] = ("ip",)) -> str | None:
    """Why namespaces cannot be made here (None when they can): root, the tools, a probe."""
    if os.geteuid() != 0:
        return "needs root to create network namespaces (ip netns add)"
    for tool in tools:
        if shutil.which(tool) is None:
            return f"`{tool}` not found (Debian: apt-get install iproute2)"
    probe = f"{prefix}probe{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"`ip netns add` failed here: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=30)


def teardown(namespace: str) -> None:
    """Kill what still runs in the namespace (sshd, its sessions, a stuck rank: all started by
    the caller), then delete it, which takes its veth end with it."""
    pids = subprocess.run(["ip", "netns", "pids", namespace], capture_output=True,
                          text=True).stdout
    for pid in pids.split():
        try:
            os.kill(int(pid), signal.SIGKILL)
        except ProcessLookupError:
            pass
    subprocess.run(["ip", "netns", "del", namespace], capture_output=True)
    shutil.rmtree(NETNS_ETC / namespace, ignore_errors=True)


def write_hosts_file(namespace: str, entries: dict[str, str]) -> None:
    """/etc/hosts as seen by what `ip netns exec NAMESPACE` starts: the machine's own, then
    `address name` for each entry (removed with the namespace by teardown)."""
    own = Path("/etc/hosts").read_text() if Path("/etc/hosts").exists() else ""
    lines = [f"{address} {name}" for name, address in entries.items()]
    (NETNS_ETC / namespace).mkdir(parents=True, exist_ok=True)
    (NETNS_ETC / namespace / "hosts").write_text(own.rstrip("\n") + "\n" + "\n".join(lines) + "\n")


def remove_stale(prefix: str) -> None:
    """Namespaces left by an earlier run (named PREFIX<pid>a|b) whose process is gone: it was
    killed before its cleanup."""
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    for name in (line.split()[0] for line in listed.splitlines() if line.strip()):
        owner = name[len(prefix):-1]
        if name.startswith(prefix) and owner.isdigit() and not Path(f"/proc/{owner}").exists():
            teardown(name)


@contextmanager
def two_hosts(prefix: str, addresses: tuple[str, str],
              names: tuple[str, str] | None = None) -> Iterator[tuple[str, str]]:
    """Namespaces (A, B): eth0 with addresses[0] / [1] (/24), one veth link, lo up. Removed,
    with everything still running in them, on exit. `names`: host names for the two addresses,
    resolvable inside both namespaces (write_hosts_file)."""
    remove_stale(prefix)
    pair = (f"{prefix}{os.getpid()}a", f"{prefix}{os.getpid()}b")
    try:
        for ns in pair:
            ip("netns", "add", ns)
        ip("link", "add", "eth0", "netns", pair[0], "type", "veth",
           "peer", "name", "eth0", "netns", pair[1])
        for ns, address in zip(pair, addresses, strict=True):
            ip("-n", ns, "addr", "add", f"{address}/24", "dev", "eth0")
            ip("-n", ns, "link", "set", "eth0", "up")
            ip("-n", ns, "link", "set", "lo", "up")
        if names is not None:
            for ns in pair:
                write_hosts_file(ns, dict(zip(names, addresses, strict=True)))
        yield pair
    finally:
        for ns in pair:
            teardown(ns)

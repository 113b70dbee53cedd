"""sshd as root in network-namespace hosts, for the tests that launch over ssh between them
(tests/test_multinode.py, tests/test_slurm.py): keys and configs come from the images' own
docker/entrypoint.sh, so the recipe is what is tested."""

from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from helpers import REPO

ENTRYPOINT = REPO / "docker" / "entrypoint.sh"
SSHD = "/usr/sbin/sshd"  # sshd refuses to start from a relative path
SSH_PORT = 2222


def entrypoint(*args: str) -> str:
    """docker/entrypoint.sh's subcommand `args` (keygen, sshd-config, ssh-config); its stdout."""
    return subprocess.run(["bash", str(ENTRYPOINT), *args], check=True, capture_output=True,
                          text=True, timeout=60).stdout


@contextmanager
def root_sshd(namespaces: Sequence[str], addresses: Sequence[str], ssh_dir: Path
              ) -> Iterator[Path]:
    """sshd on SSH_PORT in each namespace, listening on its address, root logging in with a
    fresh key; yields a directory holding an `ssh` that uses the test's client config (ssh reads
    ~/.ssh of the passwd entry, not $HOME, and horovodrun runs plain `ssh` and forwards PATH to
    the remote rank: put this directory first on PATH). The sshds are killed on exit."""
    keys = ssh_dir / "keys"
    procs: list[subprocess.Popen] = []
    try:
        entrypoint("keygen", str(keys))
        # sshd as root needs its privilege-separation directory (the package's service makes it).
        os.makedirs("/run/sshd", mode=0o755, exist_ok=True)
        for ns, address in zip(namespaces, addresses, strict=True):
            config = entrypoint("sshd-config", str(ssh_dir / f"sshd-{ns}"), str(SSH_PORT),
                                str(keys / "authorized_keys")).strip()
            log = open(ssh_dir / f"sshd-{ns}.log", "w")  # the child keeps its own descriptor
            # The images' config is for an unprivileged user; here root logs in, with keys in a
            # temporary directory whose parents are world-writable.
            procs.append(subprocess.Popen(
                ["ip", "netns", "exec", ns, SSHD, "-D", "-e", "-f", config,
                 "-o", f"ListenAddress={address}", "-o", "PermitRootLogin=prohibit-password",
                 "-o", "StrictModes=no"],
                stdout=log, stderr=subprocess.STDOUT, start_new_session=True))
            log.close()
        client_config = ssh_dir / "ssh_config"
        client_config.write_text(entrypoint("ssh-config", str(keys / "id_ed25519"),
                                            str(SSH_PORT), str(ssh_dir / "known_hosts")))
        wrapper_dir = ssh_dir / "bin"
        wrapper_dir.mkdir()
        (wrapper_dir / "ssh").write_text(f'#!/bin/sh\nexec /usr/bin/ssh -F "{client_config}" "$@"\n')
        (wrapper_dir / "ssh").chmod(0o755)
        yield wrapper_dir
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)

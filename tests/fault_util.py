"""Helpers for the fault-recovery tests: `ringfeed` commands run in forked children of the test
process (no interpreter/torch/Horovod start-up per run, so 20 repetitions stay cheap; still the
real CLI, trainer and checkpoint code, and real SIGKILLs), finding Horovod worker processes,
and reading what a run leaves behind (final weights, samples.jsonl, metrics.jsonl)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import traceback
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import pytest

REPO = Path(__file__).resolve().parent.parent


@dataclass
class Forked:
    code: int  # exit code, or -N when killed by signal N
    output: str
    timed_out: bool = False


def preload_torch_trainer() -> None:
    """Import once, in the parent, what every forked torch run needs (torch's optimizers load
    torch._dynamo lazily: 2 s each time otherwise)."""
    import torch._dynamo  # noqa: F401
    import webdataset  # noqa: F401

    import ringfeed.train.backends.torch  # noqa: F401
    import ringfeed.train.cli  # noqa: F401
    import ringfeed.train.loop  # noqa: F401


def ringfeed_forked(argv: list[str], log: Path, timeout: float = 120,
                    env: dict[str, str] | None = None) -> Forked:
    """`ringfeed ARGV` in a forked child of this process: stdout and stderr go to `log`.
    The parent must not have initialised Horovod (each child does, as a size-1 job)."""
    preload_torch_trainer()
    for name in ("horovod.torch", "horovod.tensorflow"):  # a fork would wait on its threads
        hvd = sys.modules.get(name)
        if hvd is not None and hvd.is_initialized():
            raise AssertionError(f"{name} was initialised in this test process (an in-process "
                                 "`ringfeed train` in an earlier test?): forked children hang")
    pid = os.fork()
    if pid == 0:  # the child: never returns
        code = 70
        try:
            fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.dup2(fd, 1)
            os.dup2(fd, 2)
            sys.stdout = os.fdopen(1, "w", buffering=1)
            sys.stderr = os.fdopen(2, "w", buffering=1)
            os.environ.update(env or {})
            if "torch" in sys.modules:  # imported by the parent: set the threads here
                sys.modules["torch"].set_num_threads(1)
            from ringfeed.train.cli import main

            code = main([str(a) for a in argv])
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else 1
        except BaseException:  # noqa: BLE001 - reported in the log, exit code 70
            traceback.print_exc()
        finally:
            with contextlib.suppress(Exception):
                sys.stdout.flush()
                sys.stderr.flush()
            os._exit(code)
    deadline = time.monotonic() + timeout
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return Forked(os.waitstatus_to_exitcode(status), log.read_text())
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            return Forked(-9, log.read_text(), timed_out=True)
        time.sleep(0.02)


def worker_processes(launcher_pid: int, **env: str) -> list[psutil.Process]:
    """The `ringfeed train` rank processes under a launcher whose environment has all of
    `env` (not their DataLoader workers, which share their command line)."""
    found = {}
    for child in psutil.Process(launcher_pid).children(recursive=True):
        try:
            cmdline = child.cmdline()
            if any(part.endswith("ringfeed") for part in cmdline) and "train" in cmdline \
                    and all(child.environ().get(k) == v for k, v in env.items()):
                found[child.pid] = child
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    ranks = []
    for child in found.values():
        try:
            if child.ppid() not in found:
                ranks.append(child)
        except psutil.NoSuchProcess:
            continue
    return ranks


def wait_for(predicate, timeout: float, poll: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(poll)
    return False


def logged_step(run_dir: Path) -> int:
    """The newest training step in a run's metrics.jsonl (0 if none yet)."""
    path = run_dir / "metrics.jsonl"
    try:
        steps = [r["step"] for r in read_jsonl(path) if "loss" in r]
    except (FileNotFoundError, json.JSONDecodeError):  # not yet written, or mid-line
        return 0
    return max(steps, default=0)


def torch_final(run_dir: Path, step: int) -> dict[str, Any]:
    """The torch payload of ckpt-<step> of a run."""
    import torch

    path = run_dir / "checkpoints" / f"ckpt-{step:09d}" / "state.pt"
    return torch.load(path, map_location="cpu", weights_only=True)


def assert_same_torch_state(a: dict[str, Any], b: dict[str, Any]) -> None:
    """Bit-identical model weights and optimizer state (momentum buffers)."""
    import torch

    assert a["model"].keys() == b["model"].keys()
    for name, tensor in a["model"].items():
        assert torch.equal(tensor, b["model"][name]), f"weights differ: {name}"
    assert a["optimizer"]["state"].keys() == b["optimizer"]["state"].keys()
    for key, state in a["optimizer"]["state"].items():
        for field, value in state.items():
            if isinstance(value, torch.Tensor):
                assert torch.equal(value, b["optimizer"]["state"][key][field]), (key, field)


def tf_final(run_dir: Path, step: int) -> dict[str, np.ndarray]:
    import tensorflow as tf

    prefix = run_dir / "checkpoints" / f"ckpt-{step:09d}" / "tf_checkpoint"
    reader = tf.train.load_checkpoint(str(prefix))
    return {k: reader.get_tensor(k) for k in reader.get_variable_to_shape_map()
            if k.startswith(("model/", "optimizer/")) and "OPTIMIZER_SLOT" not in k}


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def samples_by_epoch(run_dir: Path) -> dict[int, list[int]]:
    """samples.jsonl: every sample id trained on, per epoch (all ranks, in step order)."""
    records = read_jsonl(run_dir / "samples.jsonl")
    steps = [r["step"] for r in records]
    assert steps == list(range(1, len(steps) + 1)), f"steps not 1..N in order: {steps}"
    epochs: dict[int, list[int]] = defaultdict(list)
    for r in records:
        for ids in r["ids"]:
            epochs[r["epoch"]].extend(ids)
    return dict(epochs)


def losses(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_jsonl(run_dir / "metrics.jsonl") if "loss" in r}


def corrupt_one_sample(shards: Path, shard_name: str, sample_index: int) -> str:
    """Rewrite one shard with one sample's x.npy replaced by bytes that are not a .npy file
    (and its manifest entry updated, so only decoding can notice). Returns that sample's key."""
    import webdataset as wds

    from ringfeed.formats.manifest import Manifest
    from ringfeed.fsutil import sha256_file

    path = shards / shard_name
    samples = list(wds.WebDataset(str(path), shardshuffle=False))
    bad_key = samples[sample_index]["__key__"]
    samples[sample_index]["x.npy"] = b"this is not a numpy file"
    tmp = path.with_suffix(".tmp")
    with wds.TarWriter(str(tmp)) as sink:
        for sample in samples:
            sink.write({k: v for k, v in sample.items() if k in ("__key__", "x.npy", "y.npy")})
    tmp.replace(path)
    manifest = Manifest.load(shards)
    for split in manifest.splits.values():
        for info in split.shards:
            if info.name == shard_name:
                info.bytes, info.sha256 = path.stat().st_size, sha256_file(path)
    manifest.save(shards)
    return bad_key


def mounted_tmpfs(directory: Path, size: str) -> Iterator[Path]:
    """A real tmpfs of `size` (mount's size=, e.g. "48k") mounted at `directory`/tmpfs for the
    time of a fixture (root only: the test is skipped otherwise)."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    mount = directory / "tmpfs"
    mount.mkdir()
    res = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mount)],
                         capture_output=True, text=True)
    if res.returncode:
        pytest.skip(f"cannot mount a tmpfs here: {res.stderr.strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


@contextlib.contextmanager
def alongside(cmd: list[Any], log: Path, env: dict[str, str]) -> Iterator[subprocess.Popen]:
    """`cmd` started now in its own process group, its output to `log` (a pipe nobody reads
    until the end can fill and stop it), killed on the way out if still running. For a
    reference run that can use the CPU while the test's faulted run waits on its fault."""
    with open(log, "w") as out:
        proc = subprocess.Popen([str(c) for c in cmd], env=env, text=True, stdout=out,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True)
    try:
        yield proc
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def waited(proc: subprocess.Popen, log: Path, timeout: float) -> str:
    """Wait for a process from `alongside`; its output, asserting it ended with status 0."""
    try:
        code = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        code = None
    output = log.read_text(errors="replace")
    assert code == 0, f"{proc.args[:3]}: {'timed out' if code is None else code}\n{output[-3000:]}"
    return output

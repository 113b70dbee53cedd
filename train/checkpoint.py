"""Checkpoint files and policy: atomic directories, newest-complete lookup with corruption
fallback, keep-last-K.

A checkpoint is a directory `ckpt-<step>` holding the framework's payload (torch: `state.pt`,
read back with `torch.load(weights_only=True)`; TensorFlow: a `tf.train.Checkpoint`) and
`meta.json` (step, epoch, pipeline resume state, config, sha256 of every payload file). It is
written under a temporary name, fsynced and renamed into place, and `meta.json` is written last,
so a `ckpt-*` directory with a meta.json whose hashes match is complete; anything else is
reported and skipped in favour of the previous one. A process killed anywhere in the write
leaves only a `.ckpt-*.tmp-<pid>` directory, removed by the next run.

A write that fails (disk full, read-only or missing directory) raises CheckpointWriteError
(exit 4) after removing its temporary directory; older checkpoints are untouched.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from ringfeed.errors import UserError
from ringfeed.fsutil import fsync_path, sha256_file
from ringfeed.train import faults

PREFIX = "ckpt-"
META = "meta.json"
FORMAT = "ringfeed-checkpoint"
VERSION = 1


class CheckpointError(Exception):
    """A checkpoint directory that cannot be used (the message says why)."""


class CheckpointWriteError(UserError):
    """A checkpoint could not be written (no space, no permission, not a directory)."""

    exit_code = 4


@dataclass(frozen=True)
class Found:
    path: Path
    meta: dict[str, Any]


def checkpoint_path(directory: Path, step: int) -> Path:
    return Path(directory) / f"{PREFIX}{step:09d}"


def list_checkpoints(directory: Path) -> list[Path]:
    """`ckpt-<step>` directories, oldest first (temporary ones are not listed)."""
    if not Path(directory).is_dir():
        return []
    found = [p for p in Path(directory).iterdir()
             if p.is_dir() and p.name.startswith(PREFIX) and p.name[len(PREFIX):].isdigit()]
    return sorted(found, key=lambda p: int(p.name[len(PREFIX):]))


def refuse_earlier_run(resume: str, directory: Path) -> None:
    """A run that does not resume (`resume: none`) must not write into a checkpoint.dir that
    holds checkpoints of an earlier run: UserError."""
    if resume == "none" and list_checkpoints(directory):
        raise UserError(
            f"checkpoint.dir {directory} already holds checkpoints of an earlier run; continue "
            "it with --resume auto, or choose another output.dir / checkpoint.dir")


def write_checkpoint(directory: Path, step: int, meta: dict[str, Any],
                     write_payload: Callable[[Path], None], keep: int) -> Path:
    """Write `ckpt-<step>` atomically, then delete all but the newest `keep`.
    CheckpointWriteError if the file system refuses (nothing half-written is left behind)."""
    directory = Path(directory)
    final = checkpoint_path(directory, step)
    tmp = directory / f".{final.name}.tmp-{os.getpid()}"
    try:
        directory.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        with faults.checkpoint_write(step):
            write_payload(tmp)
            files = {p.name: sha256_file(p) for p in sorted(tmp.iterdir()) if p.is_file()}
            full = {"format": FORMAT, "version": VERSION, "step": step, "time": time.time(),
                    **meta, "files": files}
            with open_for_write(tmp / META) as f:
                f.write((json.dumps(full, indent=1) + "\n").encode())
            _fsync_tree(tmp)
        if final.exists():  # the same step saved twice (e.g. a signal on the last step)
            shutil.rmtree(final)
        os.replace(tmp, final)
        fsync_path(directory)
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointWriteError(describe_write_error(final, e)) from e
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    for old in list_checkpoints(directory)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


class _CheckpointFile:
    """A binary file being written into a checkpoint. Keeps the OSError that a framework may
    wrap in its own exception (torch.save reports a full disk as an opaque RuntimeError), and
    passes every write through the fault-injection hook."""

    def __init__(self, file: IO[bytes]):
        self._file = file
        self.error: OSError | None = None

    def write(self, data: Any) -> int:
        try:
            return faults.write(self._file, data)
        except OSError as e:
            self.error = e
            raise

    def __getattr__(self, name: str) -> Any:
        return getattr(self._file, name)


@contextmanager
def open_for_write(path: Path) -> Iterator[_CheckpointFile]:
    """Open a checkpoint file for writing; an I/O failure inside comes out as its OSError."""
    with open(path, "wb") as f:
        tracked = _CheckpointFile(f)
        try:
            yield tracked
        except Exception as e:
            if tracked.error is not None and tracked.error is not e:
                raise tracked.error from e
            raise


def describe_write_error(path: Path, error: BaseException) -> str:
    """One line: what could not be written, why, and what to do."""
    reason = getattr(error, "strerror", None) or str(error).strip().splitlines()[0]
    return (f"cannot write checkpoint {path}: {reason} (free space or fix permissions, choose "
            "another checkpoint.dir, or set checkpoint.on_error: warn to train on without "
            "checkpoints)")


def probe_writable(directory: Path) -> None:
    """Fail early, before any training, when `directory` cannot hold files."""
    directory = Path(directory)
    probe = directory / f".write-probe-{os.getpid()}"
    try:
        directory.mkdir(parents=True, exist_ok=True)
        with open(probe, "wb") as f:
            f.write(b"ringfeed")
            f.flush()
            os.fsync(f.fileno())
        probe.unlink()
    except OSError as e:
        with suppress(OSError):
            probe.unlink(missing_ok=True)
        raise CheckpointWriteError(describe_write_error(directory, e)) from e


def _fsync_tree(directory: Path) -> None:
    """Payload files and their directory reach the disk before the rename publishes them."""
    for p in directory.rglob("*"):
        if p.is_file():
            fsync_path(p)
    fsync_path(directory)


def remove_stale_temporaries(directory: Path) -> None:
    """Half-written checkpoints of a killed run (never renamed into place)."""
    if Path(directory).is_dir():
        for p in Path(directory).glob(f".{PREFIX}*.tmp-*"):
            shutil.rmtree(p, ignore_errors=True)


def verify(path: Path) -> dict[str, Any]:
    """The meta of a complete checkpoint; CheckpointError if anything is missing or altered."""
    meta_path = Path(path) / META
    try:
        meta = json.loads(meta_path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{path}: no {META} (incomplete)") from None
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: unreadable {META} ({e})") from None
    if meta.get("format") != FORMAT or not isinstance(meta.get("files"), dict):
        raise CheckpointError(f"{path}: {META} is not a ringfeed checkpoint")
    for name, digest in meta["files"].items():
        file = Path(path) / name
        if not file.is_file():
            raise CheckpointError(f"{path}: {name} is missing")
        if sha256_file(file) != digest:
            raise CheckpointError(f"{path}: {name} is corrupt or truncated (sha256 mismatch)")
    return meta


def find_resume_point(resume: str, directory: Path, log: Callable[[str], None]) -> Found | None:
    """`resume` is "none", "auto" (newest complete checkpoint in `directory`), a checkpoint
    directory, or a directory of checkpoints. Corrupt ones are reported and passed over."""
    if resume == "none":
        return None
    target = Path(directory if resume == "auto" else resume)
    if (target / META).exists():  # one specific checkpoint: it must be good
        try:
            return Found(target, verify(target))
        except CheckpointError as e:
            raise UserError(f"checkpoint.resume: {e}") from None
    candidates = list_checkpoints(target)
    for path in reversed(candidates):
        try:
            return Found(path, verify(path))
        except CheckpointError as e:
            log(f"warning: skipping checkpoint {e}; trying the previous one")
    if resume != "auto":
        raise UserError(f"checkpoint.resume: no usable checkpoint in {target}")
    if candidates:
        log(f"warning: no usable checkpoint in {target}; starting from scratch")
    return None

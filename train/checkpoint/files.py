"""Checkpoint files and policy: atomic publication, newest-complete lookup with corruption
fallback, keep-last-K, in a local directory or object storage (train/checkpoint/store.py).

A checkpoint `ckpt-<step>` holds the framework's payload (torch: `state.pt`, read back with
`torch.load(weights_only=True)`; TensorFlow: a `tf.train.Checkpoint`) and `meta.json` (step,
epoch, pipeline resume state, config, sha256 of every payload file). It is staged in a local
directory and published by the store: locally a rename of the fsynced directory, in object
storage the upload of `meta.json` after every payload object. So a `ckpt-*` with a meta.json
whose hashes match is complete; anything else is reported and skipped in favour of the previous
one. A process killed anywhere in the write leaves a temporary directory (local) or objects
without a meta.json (remote), removed by the next run.

A write that fails (disk full, read-only or missing directory, access denied) raises
CheckpointWriteError (exit 4) after removing what it wrote; older checkpoints are untouched.
Storage that stays unavailable past the retry budget raises StorageUnavailable (exit 75).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from ringfeed.errors import EXIT_WRITE, UserError
from ringfeed.fsutil import sha256_file
from ringfeed.remote import StorageUnavailable
from ringfeed.train.checkpoint.store import (
    META,
    PREFIX,
    CheckpointStore,
    checkpoint_name,
    open_store,
    parent_and_name,
)
from ringfeed.train.resilience.faults import NO_FAULTS, FaultPlan, WriteBudget, armed_budget

__all__ = ["META", "PREFIX", "CheckpointError", "CheckpointWriteError", "Found",
           "checkpoint_path", "describe_write_error", "find_resume_point", "list_checkpoints",
           "open_for_write", "probe_writable", "refuse_earlier_run", "remove_stale_temporaries",
           "verify", "write_checkpoint"]

FORMAT = "ringfeed-checkpoint"
VERSION = 1

Location = str | Path | CheckpointStore


class CheckpointError(Exception):
    """A checkpoint that cannot be used (the message says why)."""


class CheckpointWriteError(UserError):
    """A checkpoint could not be written (no space, no permission, not a directory)."""

    exit_code = EXIT_WRITE


@dataclass(frozen=True)
class Found:
    """A complete, verified checkpoint: its path or URL, its meta.json, and `path`, a local
    directory holding its files (the checkpoint itself when local, a download when remote:
    `store.release(path)` after loading it)."""

    location: str
    meta: dict[str, Any]
    path: Path
    store: CheckpointStore


def as_store(location: Location) -> CheckpointStore:
    return location if isinstance(location, CheckpointStore) else open_store(location)


def checkpoint_path(directory: Path, step: int) -> Path:
    """The local directory of ckpt-<step> in `directory`."""
    return Path(directory) / checkpoint_name(step)


def list_checkpoints(directory: Path) -> list[Path]:
    """Local `ckpt-<step>` directories, oldest first (temporary ones are not listed)."""
    store = open_store(directory)
    return [Path(store.location(n)) for n in store.names()]


def refuse_earlier_run(resume: str, directory: Location) -> None:
    """A run that does not resume (`resume: none`) must not write into a checkpoint.dir that
    holds checkpoints of an earlier run: UserError."""
    store = as_store(directory)
    if resume == "none" and store.names():
        raise UserError(
            f"checkpoint.dir {store.url} already holds checkpoints of an earlier run; continue "
            "it with --resume auto, or choose another output.dir / checkpoint.dir")


def write_checkpoint(directory: Location, step: int, meta: dict[str, Any],
                     write_payload: Callable[[Path], None], keep: int,
                     faults: FaultPlan = NO_FAULTS) -> str:
    """Write `ckpt-<step>` (staged, payload before meta.json, published last), then delete all
    but the newest `keep`; returns its path or URL. CheckpointWriteError if the store refuses
    (nothing half-written is left behind). `faults`: the test-only fault plan
    (train/resilience/faults.py)."""
    store = as_store(directory)
    name = checkpoint_name(step)
    try:
        with store.staging(name) as tmp:
            with faults.checkpoint_write(step) as budget:
                write_payload(tmp)
                files = {p.name: sha256_file(p) for p in sorted(tmp.iterdir()) if p.is_file()}
                full = {"format": FORMAT, "version": VERSION, "step": step, "time": time.time(),
                        **meta, "files": files}
                with open_for_write(tmp / META) as f:
                    f.write((json.dumps(full, indent=1) + "\n").encode())
                store.upload(name, tmp, budget.uploaded if budget is not None else None)
            store.commit(name, tmp)
    except OSError as e:
        store.discard(name)
        raise CheckpointWriteError(describe_write_error(store.location(name), e)) from e
    except BaseException:
        store.discard(name)
        raise
    for old in store.names()[:-keep]:
        try:
            store.delete(old)
        except (OSError, StorageUnavailable):  # left for the next save's pass
            pass
    return store.location(name)


class _CheckpointFile:
    """A binary file being written into a checkpoint. Keeps the OSError that a framework may
    wrap in its own exception (torch.save reports a full disk as an opaque RuntimeError), and
    passes every write through the fault plan's byte budget when a checkpoint write armed one."""

    def __init__(self, file: IO[bytes], budget: WriteBudget | None):
        self._file = file
        self._budget = budget
        self.error: OSError | None = None

    def write(self, data: Any) -> int:
        try:
            if self._budget is not None:
                return self._budget.write(self._file, data)
            return self._file.write(data)
        except OSError as e:
            self.error = e
            raise

    def __getattr__(self, name: str) -> Any:
        return getattr(self._file, name)


@contextmanager
def open_for_write(path: Path) -> Iterator[_CheckpointFile]:
    """Open a checkpoint file for writing; an I/O failure inside comes out as its OSError."""
    with open(path, "wb") as f:
        tracked = _CheckpointFile(f, armed_budget())
        try:
            yield tracked
        except Exception as e:
            if tracked.error is not None and tracked.error is not e:
                raise tracked.error from e
            raise


def describe_write_error(path: str | Path, error: BaseException) -> str:
    """One line: what could not be written, why, and what to do."""
    text = str(error).strip()
    reason = getattr(error, "strerror", None) or (text.splitlines()[0] if text
                                                   else type(error).__name__)
    return (f"cannot write checkpoint {path}: {reason} (free space or fix permissions, choose "
            "another checkpoint.dir, or set checkpoint.on_error: warn to train on without "
            "checkpoints)")


def probe_writable(directory: Location) -> None:
    """Fail early, before any training, when the checkpoint directory cannot hold files."""
    store = as_store(directory)
    try:
        store.probe()
    except OSError as e:
        raise CheckpointWriteError(describe_write_error(store.url, e)) from e


def remove_stale_temporaries(directory: Location) -> list[str]:
    """What killed writes and deletes left; the names of incomplete checkpoints removed."""
    return as_store(directory).remove_leftovers()


def parse_meta(data: bytes, where: str) -> dict[str, Any]:
    """meta.json's content; CheckpointError if it is not a ringfeed checkpoint's."""
    try:
        meta = json.loads(data)
    except (ValueError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{where}: unreadable {META} ({e})") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT \
            or not isinstance(meta.get("files"), dict):
        raise CheckpointError(f"{where}: {META} is not a ringfeed checkpoint")
    # what a resume reads from it, where present, of its type: a damaged value (a flipped
    # digit into a letter, a truncated object) passes the checkpoint over like a damaged file
    for key, kind in META_TYPES.items():
        value = meta.get(key)
        if key in meta and (not isinstance(value, kind) or isinstance(value, bool)):
            raise CheckpointError(f"{where}: {META} is damaged ({key}: {value!r})")
    return meta


META_TYPES: dict[str, type | tuple[type, ...]] = {
    "step": int, "epoch": int, "world_size": int, "framework": str, "reason": str,
    "pipeline": dict, "config": dict}


def check_files(where: str, directory: Path, meta: dict[str, Any]) -> None:
    """CheckpointError unless every file of `meta` is in `directory` with its sha256."""
    for name, digest in meta["files"].items():
        file = Path(directory) / name
        if not file.is_file():
            raise CheckpointError(f"{where}: {name} is missing")
        if sha256_file(file) != digest:
            raise CheckpointError(f"{where}: {name} is corrupt or truncated (sha256 mismatch)")


def verify(path: Path) -> dict[str, Any]:
    """The meta of a complete local checkpoint; CheckpointError if anything is missing or
    altered."""
    try:
        data = (Path(path) / META).read_bytes()
    except FileNotFoundError:
        raise CheckpointError(f"{path}: no {META} (incomplete)") from None
    except OSError as e:
        raise CheckpointError(f"{path}: unreadable {META} ({e})") from None
    meta = parse_meta(data, str(path))
    check_files(str(path), Path(path), meta)
    return meta


def load_verified(store: CheckpointStore, name: str) -> Found:
    """Checkpoint `name` of `store`, its files local and checked; CheckpointError if it is
    incomplete or damaged (a storage error is raised as it is)."""
    where = store.location(name)
    try:
        meta = parse_meta(store.read_meta(name), where)
    except FileNotFoundError:
        raise CheckpointError(f"{where}: no {META} (incomplete)") from None
    local = store.fetch(name, list(meta["files"]))
    try:
        check_files(where, local, meta)
    except BaseException:
        store.release(local)
        raise
    return Found(where, meta, local, store)


def find_resume_point(resume: str, directory: Location, log: Callable[[str], None],
                      open_location: Callable[[str], CheckpointStore] | None = None
                      ) -> Found | None:
    """`resume` is "none", "auto" (newest complete checkpoint in `directory`), a checkpoint
    (path or URL), or a directory of checkpoints; `open_location` opens the store of a path or
    URL given as `resume` (default: without storage options). Damaged ones are reported and
    passed over."""
    if resume == "none":
        return None
    opener = open_location or open_store
    if resume == "auto":
        store = as_store(directory)
    else:
        parent, name = parent_and_name(resume)
        one = opener(parent)
        try:
            one.read_meta(name)
            named = True
        except (FileNotFoundError, NotADirectoryError):
            named = False
        if named:  # one specific checkpoint: it must be good
            try:
                return load_verified(one, name)
            except CheckpointError as e:
                raise UserError(f"checkpoint.resume: {e}") from None
        store = opener(resume)
    candidates = store.names()
    for name in reversed(candidates):
        try:
            return load_verified(store, name)
        except CheckpointError as e:
            log(f"warning: skipping checkpoint {e}; trying the previous one")
    if resume != "auto":
        raise UserError(f"checkpoint.resume: no usable checkpoint in {store.url}")
    if candidates:
        log(f"warning: no usable checkpoint in {store.url}; starting from scratch")
    return None


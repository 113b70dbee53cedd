"""Checkpoint files and policy: atomic directories, newest-complete lookup with corruption
fallback, keep-last-K.

A checkpoint is a directory `ckpt-<step>` holding the framework's payload (torch: `state.pt`,
read back with `torch.load(weights_only=True)`; TensorFlow: a `tf.train.Checkpoint`) and
`meta.json` (step, epoch, pipeline resume state, config, sha256 of every payload file). It is
written under a temporary name and renamed into place, and `meta.json` is written last, so a
`ckpt-*` directory with a meta.json whose hashes match is complete; anything else is reported and
skipped in favour of the previous one.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shards.errors import UserError
from shards.fsutil import atomic_write_text, sha256_file

PREFIX = "ckpt-"
META = "meta.json"
FORMAT = "ringfeed-checkpoint"
VERSION = 1


class CheckpointError(Exception):
    """A checkpoint directory that cannot be used (the message says why)."""


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


def write_checkpoint(directory: Path, step: int, meta: dict[str, Any],
                     write_payload: Callable[[Path], None], keep: int) -> Path:
    """Write `ckpt-<step>` atomically, then delete all but the newest `keep`."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    final = checkpoint_path(directory, step)
    tmp = directory / f".{final.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        write_payload(tmp)
        files = {p.name: sha256_file(p) for p in sorted(tmp.iterdir()) if p.is_file()}
        full = {"format": FORMAT, "version": VERSION, "step": step, "time": time.time(),
                **meta, "files": files}
        atomic_write_text(tmp / META, json.dumps(full, indent=1) + "\n")
        if final.exists():  # the same step saved twice (e.g. a signal on the last step)
            shutil.rmtree(final)
        os.replace(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    for old in list_checkpoints(directory)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


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

"""What every input format provides to the planner and the shard writers.

A source is scanned once, up front (every bad input is reported before anything is written), into
parts: a split the source already has (`train`, `val`, ...) or the whole dataset (`train`). A part
knows each sample's key and the exact bytes its members take in a tar, so shards can be planned
before any is written; `sample(part, i)` then produces the members, in any process.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from abc import ABC, abstractmethod
from collections import Counter
from collections.abc import Sequence
from contextlib import suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ringfeed.errors import UserError
from ringfeed.shards.options import ShardOptions

# Source-provided split names (file or folder stems) -> the split name used in shard names.
SPLIT_NAMES = {"train": "train", "training": "train", "val": "val", "valid": "val",
               "validation": "val", "dev": "val", "test": "test"}
WORK_DIR = ".ringfeed-work"  # a scan's scratch files under OUT (check_out_dir tolerates it)
SCAN_PREFIX = ".ringfeed-scan-"  # + a scan's key: the scan parts of one OUT share (SharedScan)
SCAN_VERSION = 1  # bumped when what a shared scan holds changes: older ones are not read
FACTS = "facts.json"


@dataclass
class Part:
    """One split's samples in source order."""

    keys: Sequence[str]
    sizes: np.ndarray                 # int64: tar bytes of each sample's members
    labels: np.ndarray | None = None  # class index per sample, for a stratified val split

    def __len__(self) -> int:
        return len(self.keys)


class Source(ABC):
    """A scanned input dataset. Subclasses fill the fields in `__init__` and define `sample`."""

    format = ""  # a subclass serving one format names it; others take --format's

    def __init__(self, opts: ShardOptions):
        self.path = opts.src
        self.format = self.format or opts.format
        self.parts: dict[str, Part] = {}
        self.fields: dict[str, str] = {}  # member ext -> kind
        self.options: dict[str, Any] = {}  # format options, recorded in the manifest
        self.class_names: list[str] | None = None
        self.text: dict[str, Any] | None = None
        self.skipped: list[dict[str, str]] = []
        self.inputs: list[tuple[str, int, int]] = []  # (file, size, mtime_ns): the plan's identity
        self.val_drawn = False  # the source drew --val-fraction itself (text: whole documents)
        self.classes: dict[str, Any] | None = None  # class ids seen in `cls` (manifest.classes)
        self.shared: Path | None = None  # the SharedScan folder this scan published or read

    @abstractmethod
    def sample(self, part: str, index: int) -> dict[str, Any]:
        """The sample's members as bytes, plus `__key__`."""

    def close(self) -> None:
        """Release files and work space the scan created (none by default)."""
        return None

    def column_stats(self, train: list[tuple[str, np.ndarray]]) -> dict[str, Any] | None:
        """The manifest's `features` (tables: what each member holds, per-feature mean/std),
        given the train split as (part, positions) pairs; None for sources without columns."""
        return None

    def record_input(self, path: str | Path, st: os.stat_result | None = None) -> None:
        st = st or os.stat(path)
        self.inputs.append((str(path), st.st_size, st.st_mtime_ns))

    def describe(self) -> dict[str, Any]:
        return {"format": self.format, "path": str(self.path), "options": self.options}

    def scan_key(self, inputs: list[tuple[str, int, int]] | None = None,
                 extra: dict[str, Any] | None = None) -> str:
        """What a scan's result depends on: the format, its options and the inputs (each
        file's path, size and mtime: `inputs`, else those recorded), and what else the
        format's scan depends on (`extra`); another key is another scan."""
        more = {} if extra is None else {"extra": extra}
        return hashlib.sha256(json.dumps(
            {"scan": SCAN_VERSION, **self.describe(), "inputs": self.inputs if inputs is None
             else inputs, **more}, sort_keys=True).encode()).hexdigest()[:32]


class WorkDir:
    """A scan's scratch files in OUT/.ringfeed-work, so shard writers in other processes read
    them instead of redoing the scan. remove() deletes them, and OUT when the scan created it
    and nothing else is in it (a failed scan leaves no OUT behind)."""

    def __init__(self, out: Path, name: str = WORK_DIR):
        self.out = out
        self.path = out / name
        self._made_out = not out.exists()

    def make(self) -> Path:
        self.path.mkdir(parents=True, exist_ok=True)
        return self.path

    def remove(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)
        for parent in self.path.relative_to(self.out).parents[:-1]:  # a part's: its folder
            with suppress(OSError):  # removed only while empty (other parts may use it)
                (self.out / parent).rmdir()
        if self._made_out:
            with suppress(OSError):  # removed only while empty
                self.out.rmdir()


class SharedScan:
    """A scan the parts of one OUT share: `OUT/.ringfeed-scan-<key>/` (a bucket's is copied to
    and from each part's staging folder: shards/remote_build.py), a scan's work
    folder (its files) with `facts.json` (what else the scan learned) added, published by a
    rename, so it is there whole or not at all. The first part to finish its scan publishes
    it; a part that finds the one of its key reads it instead of scanning. Inputs changed
    since: another key, so a stale scan is never read. Removed with the parts' markers."""

    def __init__(self, out: Path, key: str):
        self.key = key
        self.path = out / f"{SCAN_PREFIX}{key}"

    def facts(self) -> dict[str, Any] | None:
        """The published facts, or None (no scan of this key, or not ours)."""
        try:
            facts = json.loads((self.path / FACTS).read_bytes())
        except (OSError, ValueError):
            return None
        return facts if isinstance(facts, dict) and facts.get("key") == self.key else None

    def publish(self, work: Path, facts: dict[str, Any]) -> bool:
        """Make the work folder `work` (holding the scan's files) this shared scan, with
        `facts`; False when it cannot (another part published first, facts not JSON)."""
        try:
            data = json.dumps({**facts, "key": self.key}).encode()
        except (TypeError, ValueError):  # a value JSON cannot hold (a Parquet date vocabulary)
            return False
        try:
            (work / FACTS).write_bytes(data)
            os.rename(work, self.path)  # a folder's rename: atomic; fails if one is there
        except OSError:
            (work / FACTS).unlink(missing_ok=True)
            return False
        return True


def class_record(counts: Counter, num_classes: int | None = None) -> dict[str, Any] | None:
    """The manifest's `classes` from counts of the ids in `cls` members: the ids seen, their
    counts and num_classes (given, e.g. the number of class names, else largest id + 1)."""
    if not counts:
        return None
    ids = sorted(counts)
    return {"field": "cls", "ids": ids, "counts": [counts[i] for i in ids],
            "num_classes": num_classes if num_classes is not None else ids[-1] + 1}


def visible(path: Path) -> list[Path]:
    """Entries of a folder, sorted, without hidden ones (.DS_Store, .git, ...)."""
    return sorted(p for p in path.iterdir() if not p.name.startswith("."))


def split_name(path: Path) -> str | None:
    return SPLIT_NAMES.get(path.name.split(".", 1)[0].lower())


def source_splits(src: Path) -> dict[str, Path] | None:
    """{split: path} when every visible entry of folder `src` is named like a split."""
    if not src.is_dir():
        return None
    entries = visible(src)
    named: dict[str, Path] = {}
    for entry in entries:
        split = split_name(entry)
        if split is None:
            return None
        if split in named:
            raise UserError(f"{named[split]} and {entry} are both split {split!r} (keep one)")
        named[split] = entry
    return named if "train" in named else None


def require_exists(src: Path) -> None:
    if not src.exists():
        raise UserError(f"{src}: no such file or folder")


def int_sizes(values: Any) -> np.ndarray:
    return np.asarray(values, dtype=np.int64)

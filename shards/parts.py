"""`ringfeed shard --part I/N`: one of N processes (on any machines) writes its share of the
plan's shards; the manifest is written once every part is done.

- Which part: `--part I/N`, else the launcher's rank and size (mpirun, horovodrun, srun, a Slurm
  array): `part_from`. A launcher of size 1 is no part run (the whole dataset, as before).
- Which shards: every part scans the source and computes the same plan (packing.py, the one
  `--workers K` follows), then takes the shards `assign` gives it: largest first to the part with
  the fewest bytes so far, so the parts' bytes (and the writing CPU, which follows the bytes)
  are even. The bytes of every shard are the plan's, so they do not depend on N.
- Resuming: each part journals its shards in its own journal (`.ringfeed-journal-part-I-of-N.jsonl`
  beside the shards), as a whole run does.
- Done: a part that has written all its shards writes its marker `.ringfeed-part-I-of-N.json`
  (atomically: a rename, or one PUT) holding its shards' descriptions and the manifest's other
  fields, then lists the markers. The one that finds all N (of its plan) writes the manifest;
  two that both find them write the same bytes (the manifest is built from the markers alone,
  in the plan's order), each atomically, so either may win. Then the markers and part journals
  are removed. No part waits for another: the last to finish, or `ringfeed shard --merge OUT`,
  completes the set.
"""

from __future__ import annotations

import heapq
import json
import re
import shutil
from collections.abc import Mapping
from contextlib import suppress
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Protocol

from ringfeed.errors import UserError
from ringfeed.formats.manifest import MANIFEST_NAME, Manifest, ShardInfo, Split
from ringfeed.fsutil import atomic_write_bytes
from ringfeed.shards.packing import PlannedShard, split_key

MARKER = re.compile(r"^\.ringfeed-part-(\d+)-of-(\d+)\.json$")
PART_JOURNAL = re.compile(r"^\.ringfeed-journal-part-(\d+)-of-(\d+)\.jsonl$")
# sources/base.py's SharedScan folder (in a bucket: its objects, `.ringfeed-scan-KEY/NAME`)
SHARED_SCAN = re.compile(r"^\.ringfeed-scan-[0-9a-f]+(/[^/]+)?$")
PART_SPEC = re.compile(r"^\s*(\d+)\s*/\s*(\d+)\s*$")

# (launcher, rank variable, size variable), in the order they are looked for: mpirun and
# horovodrun before srun, since both may run inside a Slurm job whose SLURM_* they inherit.
# srun's size is the step's task count: a batch script itself has SLURM_PROCID=0 and the job's
# SLURM_NTASKS but no step, and must not take itself for part 0 of N.
LAUNCHERS = (("mpirun", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"),
             ("mpirun", "PMI_RANK", "PMI_SIZE"),
             ("horovodrun", "HOROVOD_RANK", "HOROVOD_SIZE"),
             ("srun", "SLURM_PROCID", "SLURM_STEP_NUM_TASKS"))


def marker_name(part: tuple[int, int]) -> str:
    return f".ringfeed-part-{part[0]}-of-{part[1]}.json"


def journal_name(part: tuple[int, int] | None) -> str:
    """The journal of a whole run, or of one part (parts share OUT, so each has its own)."""
    return ".ringfeed-journal.jsonl" if part is None else (
        f".ringfeed-journal-part-{part[0]}-of-{part[1]}.jsonl")


def is_part_file(name: str) -> bool:
    return bool(MARKER.match(name) or PART_JOURNAL.match(name) or SHARED_SCAN.match(name))


def parse_part(spec: str, where: str = "--part") -> tuple[int, int]:
    match = PART_SPEC.match(spec)
    if not match or not 0 <= int(match.group(1)) < int(match.group(2)):
        raise UserError(f"{where} {spec!r}: expected I/N with 0 <= I < N, e.g. --part 0/4")
    return int(match.group(1)), int(match.group(2))


def part_from(arg: str | None, env: Mapping[str, str]) -> tuple[tuple[int, int] | None, str]:
    """(part, where it came from): an explicit --part wins, then the first launcher whose size
    is more than 1, then a Slurm array of more than one task; (None, '') for a whole run."""
    if arg is not None:
        return parse_part(arg), "--part"
    for launcher, rank, size in LAUNCHERS:
        if rank in env and size in env and _int(env[size], size) > 1:
            spec = f"{_int(env[rank], rank)}/{_int(env[size], size)}"
            return parse_part(spec, f"{rank}/{size}"), f"{launcher}'s {rank}/{size}"
    if "SLURM_ARRAY_TASK_ID" in env and _int(env.get("SLURM_ARRAY_TASK_COUNT", "1"),
                                              "SLURM_ARRAY_TASK_COUNT") > 1:
        first = _int(env.get("SLURM_ARRAY_TASK_MIN", "0"), "SLURM_ARRAY_TASK_MIN")
        index = _int(env["SLURM_ARRAY_TASK_ID"], "SLURM_ARRAY_TASK_ID") - first
        spec = f"{index}/{env['SLURM_ARRAY_TASK_COUNT']}"
        where = "SLURM_ARRAY_TASK_ID - SLURM_ARRAY_TASK_MIN / SLURM_ARRAY_TASK_COUNT"
        return parse_part(spec, f"{where} (an array with a step is not supported)"), \
            f"the Slurm array's {where}"
    return None, ""


def _int(value: str, name: str) -> int:
    try:
        return int(value)
    except ValueError:
        raise UserError(f"${name}={value!r}: not a number; unset it or pass --part I/N") from None


def assign(shards: list[PlannedShard], parts: int) -> list[int]:
    """The part of each planned shard: largest first to the part with the fewest bytes so far
    (ties: the lower part), so every part gets about total/N bytes; a function of the plan and
    N alone, so every part computes the same assignment."""
    order = sorted(range(len(shards)), key=lambda k: (-shards[k].bytes, k))
    heap = [(0, p) for p in range(parts)]
    owner = [0] * len(shards)
    for k in order:
        load, p = heapq.heappop(heap)
        owner[k] = p
        heapq.heappush(heap, (load + shards[k].bytes, p))
    return owner


def part_shards(shards: list[PlannedShard], part: tuple[int, int] | None) -> list[PlannedShard]:
    if part is None:
        return shards
    owner = assign(shards, part[1])
    return [s for s, p in zip(shards, owner, strict=True) if p == part[0]]


class Files(Protocol):
    """The folder or bucket prefix beside the shards, where markers and journals live."""

    def where(self, name: str) -> str: ...
    def names(self) -> list[str]: ...
    def read(self, name: str) -> bytes | None: ...
    def write(self, name: str, data: bytes) -> None: ...
    def remove(self, names: list[str]) -> None: ...


class LocalFiles:
    def __init__(self, out: Path):
        self.out = out

    def where(self, name: str) -> str:
        return str(self.out / name)

    def names(self) -> list[str]:
        return [p.name for p in self.out.iterdir()] if self.out.is_dir() else []

    def read(self, name: str) -> bytes | None:
        try:
            return (self.out / name).read_bytes()
        except FileNotFoundError:
            return None

    def write(self, name: str, data: bytes) -> None:
        atomic_write_bytes(self.out / name, data)

    def remove(self, names: list[str]) -> None:
        for name in names:
            if (self.out / name).is_dir():  # a shared scan
                shutil.rmtree(self.out / name, ignore_errors=True)
            (self.out / name).unlink(missing_ok=True)


@dataclass
class Marker:
    """What a finished part leaves: its shards (with their objects' versions in a bucket) and
    the manifest's fields other than the shards, the same in every part of one plan."""

    plan: str
    part: int
    parts: int
    planned: int  # shards in the whole plan
    shards: list[dict[str, Any]]  # ShardInfo's fields + split (+ version, index_version)
    manifest: dict[str, Any]  # the manifest with no splits

    def to_bytes(self) -> bytes:
        return json.dumps(asdict(self)).encode()  # key order kept: the manifest's

    @classmethod
    def parse(cls, data: bytes) -> Marker | None:
        try:
            return cls(**json.loads(data))
        except (ValueError, TypeError):
            return None  # not ours, or torn: as if the part had not finished


def make_marker(plan: str, part: tuple[int, int], planned: int, meta: Manifest,
                shards: list[tuple[str, ShardInfo, dict[str, Any]]]) -> Marker:
    """`shards`: (split, info, extra fields such as object versions) of this part's shards."""
    entries = [{"split": split, **asdict(info), **extra} for split, info, extra in shards]
    meta_dict = asdict(meta)
    meta_dict["splits"] = {}
    return Marker(plan, part[0], part[1], planned, entries, meta_dict)


def read_markers(files: Files) -> dict[tuple[int, int], Marker]:
    """{(part, parts): marker} of every readable marker."""
    found = {}
    for name in files.names():
        match = MARKER.match(name)
        data = files.read(name) if match else None
        marker = Marker.parse(data) if data is not None else None
        if match and marker is not None:
            found[int(match.group(1)), int(match.group(2))] = marker
    return found


def all_done(files: Files, plan: str, parts: int) -> list[Marker] | None:
    """The N markers of `plan`, or None while some part of it has not finished."""
    mine = {p: m for (p, n), m in read_markers(files).items() if n == parts and m.plan == plan}
    return [mine[p] for p in range(parts)] if len(mine) == parts else None


def assemble(markers: list[Marker]) -> tuple[Manifest, dict[str, dict[str, Any]]]:
    """The manifest from the parts' markers (shards in the plan's order: split, then index),
    and each shard's extra fields (object versions)."""
    entries = sorted((e for m in markers for e in m.shards),
                     key=lambda e: (split_key(e["split"]), len(e["name"]), e["name"]))
    if len(entries) != markers[0].planned:
        raise UserError(f"the parts' markers name {len(entries)} shards, the plan "
                        f"{markers[0].planned}: run the parts again")
    manifest = Manifest.from_dict(markers[0].manifest, origin=marker_name((0, len(markers))))
    fields = {f for f in ShardInfo.__dataclass_fields__}
    splits: dict[str, Split] = {}
    extra = {}
    for e in entries:
        splits.setdefault(e["split"], Split()).shards.append(
            ShardInfo(**{k: v for k, v in e.items() if k in fields}))
        extra[e["name"]] = {k: v for k, v in e.items() if k not in fields and k != "split"}
    manifest.splits = splits
    return manifest, extra


def cleanup(files: Files) -> None:
    """After the manifest: the parts' markers and journals are no longer needed."""
    with suppress(FileNotFoundError):
        files.remove(sorted(n for n in files.names() if is_part_file(n)))


def missing_parts(files: Files) -> list[Marker] | None:
    """`--merge`: the markers of every part; None when the manifest is there (the last part
    wrote it: a merge step after the parts has nothing to do); else one line naming the parts
    that did not finish (and whether they began: their journal is there)."""
    names = files.names()
    if MANIFEST_NAME in names:
        return None
    markers = read_markers(files)
    if not markers:
        raise UserError(f"{files.where('')}: no part has finished (no .ringfeed-part-I-of-N.json);"
                        " run the parts first (ringfeed shard SRC OUT ... --part I/N)")
    runs = {(n, m.plan) for (_, n), m in markers.items()}
    if len(runs) > 1:
        listed = ", ".join(f"{p}/{n}" for p, n in sorted(markers))
        raise UserError(f"{files.where('')}: markers of runs with other part counts or input "
                        f"({listed}): rerun every part with one command (or --overwrite)")
    (n, _), = runs
    absent = [p for p in range(n) if (p, n) not in markers]
    if absent:
        began = [p for p in absent if journal_name((p, n)) in names]
        first = absent[0]
        state = "began but did not finish" if first in began else "never ran"
        raise UserError(f"{files.where('')}: part {first}/{n} {state} ({len(absent)} of {n} "
                        f"part(s) missing: {', '.join(map(str, absent))}); run it with the "
                        f"same command and --part {first}/{n}, then --merge again")
    return [markers[p, n] for p in range(n)]

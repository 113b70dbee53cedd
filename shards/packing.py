"""Which sample goes to which shard, decided before any shard is written.

The plan depends only on the scanned source and the options that shape the output (limits,
val fraction, seed): never on --workers. K writers then produce the same bytes as one, and an
interrupted run can tell which finished shards still belong to the plan.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

import numpy as np

from ringfeed.errors import UserError
from ringfeed.formats.tarblocks import END, RECORD, tar_file_bytes
from ringfeed.shards.keys import NumberedKeys
from ringfeed.shards.options import ShardOptions
from ringfeed.shards.sources import Source
from ringfeed.shards.split import draw_val

SPLIT_ORDER = ("train", "val", "test")
PLAN_VERSION = 1


@dataclass
class PlannedShard:
    split: str
    name: str
    part: str           # the source part its samples come from
    indices: np.ndarray  # int64 positions in that part, in tar order
    bytes: int          # size of the finished tar

    @property
    def num_samples(self) -> int:
        return len(self.indices)


def split_key(split: str) -> tuple[int, str]:
    """Splits in the plan's (and manifest's) order: train, val, test, then others by name."""
    return SPLIT_ORDER.index(split) if split in SPLIT_ORDER else 9, split


def shard_name(split: str, index: int) -> str:
    return f"{split}-{index:06d}.tar"


def plan_shards(source: Source, opts: ShardOptions) -> list[PlannedShard]:
    max_size, max_count = opts.limits()
    seed = opts.shuffle_seed if opts.shuffle_seed is not None else 0
    splits = assign_splits(source, opts.val_fraction, seed)
    order = sorted(splits, key=split_key)
    shards = []
    for number, split in enumerate(order):
        part, indices = splits[split]
        if opts.shuffle_seed is not None:
            indices = np.random.default_rng([opts.shuffle_seed, 1, number]).permutation(indices)
        sizes = source.parts[part].sizes[indices]
        for k, (a, b) in enumerate(pack(sizes, max_size, max_count)):
            shards.append(PlannedShard(split, shard_name(split, k), part, indices[a:b],
                                       tar_file_bytes(int(sizes[a:b].sum()))))
    return shards


def assign_splits(source: Source, val_fraction: float, seed: int) -> dict[str, tuple[str, np.ndarray]]:
    """{split: (part, positions in the part)}; a val split is drawn from `train` when asked."""
    splits = {name: (name, np.arange(len(part))) for name, part in source.parts.items()}
    if not val_fraction or source.val_drawn:
        return splits
    if "val" in source.parts:
        raise UserError(f"{source.path} already has a val split; drop --val-fraction")
    train = source.parts["train"]
    is_val = draw_val(len(train), train.labels, val_fraction, seed)
    splits["train"] = ("train", np.flatnonzero(~is_val))
    splits["val"] = ("train", np.flatnonzero(is_val))
    return splits


def pack(sizes: np.ndarray, max_size: int | None, max_count: int | None) -> list[tuple[int, int]]:
    """Consecutive [start, end) ranges: at most max_count samples, and a finished tar of at most
    max_size bytes (a single larger sample gets a shard of its own)."""
    n = len(sizes)
    csum = np.concatenate([[0], np.cumsum(sizes, dtype=np.int64)])
    budget = (max_size // RECORD) * RECORD - END if max_size else None
    ranges, start = [], 0
    while start < n:
        end = n if not max_count else min(n, start + max_count)
        if budget is not None:
            fit = int(np.searchsorted(csum, csum[start] + budget, side="right")) - 1
            end = min(end, max(fit, start + 1))
        ranges.append((start, end))
        start = end
    return ranges


def fingerprint(source: Source, opts: ShardOptions, shards: list[PlannedShard]) -> str:
    """Identity of a plan: the inputs (paths, sizes, mtimes), the options and the assignment."""
    h = hashlib.sha256()
    h.update(json.dumps({"plan": PLAN_VERSION, "source": source.describe(),
                         "options": opts.plan_options(), "fields": source.fields,
                         "inputs": source.inputs}, sort_keys=True).encode())
    for s in shards:
        h.update(f"\n{s.name} {s.part} {s.bytes} ".encode())
        h.update(s.indices.astype(np.int64).tobytes())
    for name, part in source.parts.items():
        h.update(f"\n{name}:".encode())
        if isinstance(part.keys, NumberedKeys):  # its count makes every key: not each hashed
            h.update(f"numbered {len(part.keys)}".encode())  # (~0.3 s a part at 200k keys)
            continue
        for start in range(0, len(part.keys), 100_000):
            h.update("\0".join(part.keys[start:start + 100_000]).encode() + b"\0")
    return h.hexdigest()

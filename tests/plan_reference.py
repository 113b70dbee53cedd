"""The planner as it was before issue 17, kept as the executable specification of the plan.

A test oracle, not part of the installed package (the pipeline never uses it): imported as
`plan_reference` with tests/ on sys.path. `ringfeed.pipeline.plan` computes the same batches from shard-level prefix
sums, materialising only one rank's ids; this version materialises the whole epoch order on
every rank and replays every old (rank, worker) stream on a resume at another world size. The
tests compare the two sample for sample (tests/test_plan_scale.py), and
benchmarks/plan_bench.py measures both where this one is still feasible.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

# Nothing is imported from the planner this checks: the arithmetic below is written out again,
# the plain way. It reads only the sample counts of a layout and the settings of a segment
# (config: world_size, streams, batch_size, shuffle_buffer, shuffle_initial, balance;
# batches_consumed).


def batches_for(n: int, world_size: int, batch_size: int, balance: str) -> int:
    """drop: whole batches of the floor share; pad: batches covering the ceiling share."""
    if balance == "drop":
        return (n // world_size) // batch_size
    per_rank = n // world_size + (1 if n % world_size else 0)
    return per_rank // batch_size + (1 if per_rank % batch_size else 0)


def worker_batches(total: int, streams: int, w: int) -> int:
    """The rank's batches go round-robin: batch t to worker t % streams."""
    return len(range(w, total, streams))


def consumed_by_worker(t: int, streams: int, w: int) -> int:
    """Of the rank's first t batches, those worker w made."""
    return len(range(w, t, streams))


@dataclass(frozen=True)
class ReferenceWorkerPlan:
    ids: np.ndarray
    valid: np.ndarray
    order: np.ndarray
    num_batches: int
    batch_size: int


def epoch_order(layout: Any, seed: int, epoch: int, shuffle: bool) -> np.ndarray:
    """L: every global id of the epoch, shards in (shuffled) order, tar order within a shard."""
    counts = [int(c) for c in layout.counts]
    starts = [sum(counts[:s]) for s in range(len(counts))]
    n_shards = len(counts)
    order = (np.random.default_rng([seed, epoch]).permutation(n_shards) if shuffle
             else np.arange(n_shards))
    if n_shards == 0:
        return np.zeros(0, dtype=np.int64)
    return np.concatenate([np.arange(starts[s], starts[s] + counts[s], dtype=np.int64)
                           for s in order])


def shuffle_order(n: int, buffer: int, rng: np.random.Generator | None,
                  limit: int | None = None, initial: int | None = None) -> np.ndarray:
    """Emission order of n slots through a shuffle buffer (one Python step per slot): it emits
    first once it holds `initial` slots (buffer // 10, at least 1), then after every second
    slot until it holds buffer + 1 at an emission, then after every slot; the rest drain."""
    limit = n if limit is None else min(limit, n)
    if rng is None or buffer <= 0 or n <= 1:
        return np.arange(limit, dtype=np.int64)
    first = max(1, buffer // 10) if initial is None else initial
    first = min(max(1, first), buffer + 1)
    draws = rng.random(n)
    out = np.empty(limit, dtype=np.int64)
    resident: list[int] = []
    emitted = 0

    def emit() -> None:
        nonlocal emitted
        j = int(draws[emitted] * len(resident))
        out[emitted] = resident[j]
        resident[j] = resident[-1]
        resident.pop()
        emitted += 1

    for i in range(n):
        if emitted >= limit:
            return out
        resident.append(i)
        due = min(first + 2 * emitted, buffer + 1 + emitted)  # slots in by the next emission
        if i + 1 == due:
            emit()
    while emitted < limit:
        emit()
    return out


@dataclass(frozen=True)
class ReferenceSegmentPlan:
    index: int
    config: Any  # the segment's settings
    remaining: np.ndarray  # L_k, materialised
    batches: int
    seed: int
    epoch: int

    def rank_slots(self, rank: int) -> tuple[np.ndarray, np.ndarray]:
        c, n = self.config, len(self.remaining)
        per_rank = self.batches * c.batch_size
        if c.balance == "drop":
            ids = self.remaining[rank * per_rank:(rank + 1) * per_rank]
            return ids, np.ones(len(ids), dtype=bool)
        q, r = divmod(n, c.world_size)
        start = rank * q + min(rank, r)
        own = self.remaining[start:start + q + (1 if rank < r else 0)]
        short = per_rank - len(own)
        source = own if len(own) else self.remaining
        if short <= 0 or len(source) == 0:
            return own, np.ones(len(own), dtype=bool)
        pad = np.resize(source, short)  # repeats cyclically
        return (np.concatenate([own, pad]),
                np.concatenate([np.ones(len(own), dtype=bool), np.zeros(short, dtype=bool)]))

    def worker(self, rank: int, w: int, limit: int | None = None) -> ReferenceWorkerPlan:
        c = self.config
        ids, valid = self.rank_slots(rank)
        first = sum(worker_batches(self.batches, c.streams, v) for v in range(w))
        count = worker_batches(self.batches, c.streams, w)
        lo, hi = first * c.batch_size, (first + count) * c.batch_size
        ids, valid = ids[lo:hi], valid[lo:hi]
        rng = (np.random.default_rng([self.seed, self.epoch, self.index, rank, w])
               if c.shuffle_buffer > 0 else None)
        order = shuffle_order(len(ids), c.shuffle_buffer, rng, limit, c.shuffle_initial)
        return ReferenceWorkerPlan(ids, valid, order, count, c.batch_size)

    def consumed_ids(self, batches_consumed: int) -> np.ndarray:
        """Valid ids every rank together consumed in this segment's first batches."""
        c = self.config
        parts = []
        for rank in range(c.world_size):
            for w in range(c.streams):
                k = consumed_by_worker(batches_consumed, c.streams, w) * c.batch_size
                if k == 0:
                    continue
                plan = self.worker(rank, w, limit=k)
                slots = plan.order[:k]
                parts.append(plan.ids[slots][plan.valid[slots]])
        return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)


def plan_segments(layout: Any, seed: int, epoch: int, shuffle: bool,
                  segments: list[Any]) -> list[ReferenceSegmentPlan]:
    """Replay the epoch's segments: each one partitions what the previous ones left."""
    remaining = epoch_order(layout, seed, epoch, shuffle)
    plans = []
    for k, seg in enumerate(segments):
        c = seg.config
        plan = ReferenceSegmentPlan(k, c, remaining, batches_for(len(remaining), c.world_size,
                                                                 c.batch_size, c.balance),
                                    seed, epoch)
        plans.append(plan)
        if k + 1 < len(segments) and seg.batches_consumed:
            consumed = plan.consumed_ids(seg.batches_consumed)
            remaining = remaining[~np.isin(remaining, consumed)]
    return plans

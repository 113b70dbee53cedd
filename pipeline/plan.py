"""Who reads which sample when: pure index arithmetic on the manifest's sample counts.

A sample's global id is `offset[shard] + position`, shards in the split's manifest order and
positions in tar order. Nothing here reads data, so every rank and loader worker derives the
same plan independently, and a resumed run can replay what an earlier run consumed.

Epoch `e`:
  1. Shard order: a permutation drawn from rng(seed, e) (identity without shuffle); the epoch
     list L holds the samples of those shards in that order.
  2. A *segment* is a stretch of the epoch run at one configuration (world size N, loader
     workers W, batch size b, shuffle buffer K, balance). Segment 0 partitions L; a resize
     mid-epoch starts segment k+1 on L_{k+1} = L_k minus what segment k consumed (order kept).
  3. Ranks: L_k is cut into N contiguous ranges so every rank gets the same batch count B:
     `drop`: B = floor(floor(n/N) / b); L_k is truncated to N*B*b and cut into equal ranges
     (the tail of L_k, < N*b samples, is dropped; it is a different tail every epoch).
     `pad`: B = ceil(ceil(n/N) / b); ranges differ by <= 1 sample, and each rank tops its range
     up to B*b by repeating its own first samples, flagged invalid.
  4. Workers: the rank's B batches are dealt as B_w = B//W + (w < B%W) batches to worker w,
     each worker taking a contiguous slice of the rank's slots. Global batch t of the rank comes
     from worker t % W (torch's DataLoader round-robin), local batch t // W.
  5. Within a worker a shuffle buffer of K slots, driven by rng(seed, e, k, rank, w), picks the
     emission order from slot positions alone, never from content.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

BALANCE_POLICIES = ("drop", "pad")


@dataclass(frozen=True)
class SegmentConfig:
    """The settings a segment runs at; a change mid-epoch starts a new segment."""

    world_size: int
    num_workers: int  # 0 = in the consumer's process; plans like 1 worker
    batch_size: int
    shuffle_buffer: int
    balance: str

    @property
    def streams(self) -> int:
        return max(1, self.num_workers)


@dataclass
class Segment:
    config: SegmentConfig
    batches_consumed: int = 0

    def to_dict(self) -> dict:
        c = self.config
        return {"world_size": c.world_size, "num_workers": c.num_workers,
                "batch_size": c.batch_size, "shuffle_buffer": c.shuffle_buffer,
                "balance": c.balance, "batches_consumed": self.batches_consumed}

    @classmethod
    def from_dict(cls, d: dict, defaults: dict) -> Segment:
        merged = {**defaults, **d}
        config = SegmentConfig(int(merged["world_size"]), int(merged["num_workers"]),
                               int(merged["batch_size"]), int(merged["shuffle_buffer"]),
                               str(merged["balance"]))
        return cls(config, int(merged["batches_consumed"]))


@dataclass(frozen=True)
class Layout:
    """Sample counts per shard, in manifest order."""

    counts: np.ndarray  # int64 [num_shards]
    offsets: np.ndarray = field(init=False)  # int64 [num_shards + 1]

    def __post_init__(self) -> None:
        counts = np.asarray(self.counts, dtype=np.int64)
        object.__setattr__(self, "counts", counts)
        object.__setattr__(self, "offsets", np.concatenate([[0], np.cumsum(counts)]))

    @property
    def num_samples(self) -> int:
        return int(self.offsets[-1])

    def locate(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Global ids -> (shard index, position in shard)."""
        shard = np.searchsorted(self.offsets, ids, side="right") - 1
        return shard, ids - self.offsets[shard]


def batches_for(n: int, world_size: int, batch_size: int, balance: str) -> int:
    """The batch count every rank yields when `n` samples are split over `world_size` ranks."""
    if balance == "drop":
        return (n // world_size) // batch_size
    per_rank = -(-n // world_size)
    return -(-per_rank // batch_size)


def worker_batches(total: int, streams: int, w: int) -> int:
    return total // streams + (1 if w < total % streams else 0)


def consumed_by_worker(t: int, streams: int, w: int) -> int:
    """Batches of worker `w` among the rank's first `t` batches (batch t' comes from t' % W)."""
    return max(0, (t - w + streams - 1) // streams)


def epoch_order(layout: Layout, seed: int, epoch: int, shuffle: bool) -> np.ndarray:
    """L: every global id of the epoch, shards in (shuffled) order, tar order within a shard."""
    n_shards = len(layout.counts)
    order = (np.random.default_rng([seed, epoch]).permutation(n_shards) if shuffle
             else np.arange(n_shards))
    if n_shards == 0:
        return np.zeros(0, dtype=np.int64)
    return np.concatenate([np.arange(layout.offsets[s], layout.offsets[s + 1]) for s in order])


def shuffle_order(n: int, buffer: int, rng: np.random.Generator | None,
                  limit: int | None = None) -> np.ndarray:
    """Emission order of n slots through a shuffle buffer holding `buffer` slots.

    Slots enter in order; once the buffer overflows, a uniformly drawn resident leaves; at the
    end the rest drain in random order. Decisions use positions only, so the order is a pure
    function of (n, buffer, rng). `limit` stops after that many emissions (for replay).
    """
    limit = n if limit is None else min(limit, n)
    if rng is None or buffer <= 0 or n <= 1:
        return np.arange(limit, dtype=np.int64)
    draws = rng.random(n)
    out = np.empty(limit, dtype=np.int64)
    resident: list[int] = []
    emitted = 0
    for i in range(n):
        if emitted >= limit:
            return out
        resident.append(i)
        if len(resident) > buffer:
            j = int(draws[emitted] * len(resident))
            out[emitted] = resident[j]
            resident[j] = resident[-1]
            resident.pop()
            emitted += 1
    while emitted < limit:
        j = int(draws[emitted] * len(resident))
        out[emitted] = resident[j]
        resident[j] = resident[-1]
        resident.pop()
        emitted += 1
    return out


@dataclass(frozen=True)
class WorkerPlan:
    """What one worker stream emits: slots (global id, valid) and their emission order."""

    ids: np.ndarray  # int64 [B_w * b] global ids of the slots, in read order
    valid: np.ndarray  # bool [B_w * b]; False for pad repeats
    order: np.ndarray  # int64 emission order (slot indices); may be a prefix when limited
    num_batches: int
    batch_size: int


@dataclass(frozen=True)
class SegmentPlan:
    index: int
    config: SegmentConfig
    remaining: np.ndarray  # L_k: ids still to consume at the segment's start
    batches: int  # B: identical on every rank
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

    def worker(self, rank: int, w: int, limit: int | None = None) -> WorkerPlan:
        c = self.config
        ids, valid = self.rank_slots(rank)
        first = sum(worker_batches(self.batches, c.streams, v) for v in range(w))
        count = worker_batches(self.batches, c.streams, w)
        lo, hi = first * c.batch_size, (first + count) * c.batch_size
        ids, valid = ids[lo:hi], valid[lo:hi]
        rng = (np.random.default_rng([self.seed, self.epoch, self.index, rank, w])
               if c.shuffle_buffer > 0 else None)
        order = shuffle_order(len(ids), c.shuffle_buffer, rng, limit)
        return WorkerPlan(ids, valid, order, count, c.batch_size)

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


def plan_segments(layout: Layout, seed: int, epoch: int, shuffle: bool,
                  segments: list[Segment]) -> list[SegmentPlan]:
    """Replay the epoch's segments: each one partitions what the previous ones left."""
    remaining = epoch_order(layout, seed, epoch, shuffle)
    plans = []
    for k, seg in enumerate(segments):
        c = seg.config
        plan = SegmentPlan(k, c, remaining, batches_for(len(remaining), c.world_size,
                                                        c.batch_size, c.balance), seed, epoch)
        plans.append(plan)
        if k + 1 < len(segments) and seg.batches_consumed:
            consumed = plan.consumed_ids(seg.batches_consumed)
            remaining = remaining[~np.isin(remaining, consumed)]
    return plans


class Planner:
    """`plan_segments` for one dataset and seed, remembering the last epoch it planned."""

    def __init__(self, layout: Layout, seed: int, shuffle: bool) -> None:
        self.layout, self.seed, self.shuffle = layout, seed, shuffle
        self._key: tuple | None = None
        self._plans: list[SegmentPlan] = []

    def plans(self, epoch: int, segments: list[Segment]) -> list[SegmentPlan]:
        # Replay depends only on what earlier segments consumed, not on the last one's count.
        key = (epoch, tuple((s.config, s.batches_consumed) for s in segments[:-1]),
               segments[-1].config)
        if key != self._key:
            self._plans = plan_segments(self.layout, self.seed, epoch, self.shuffle, segments)
            self._key = key
        return self._plans

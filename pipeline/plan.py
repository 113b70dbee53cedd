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
     emission order from slot positions alone, never from content. It starts emitting once it
     holds I slots (`shuffle_initial`, K // 10 by default) and grows to K as it emits
     (`shuffle_order`).

Cost per rank (issue 17): no list is materialised beyond the rank's own slots. L is never built:
a position of L maps to its id through prefix sums of the shard counts in epoch order
(`EpochOrder`, O(shards)). L_{k+1} is never built either (`Carried`): what each old
(rank, worker) stream consumed is a count known from arithmetic, so a position of L_{k+1}
maps to the one old stream range it falls in, and only the shuffle buffers of the old streams
the rank's positions fall in are re-simulated (to learn which of their slots are still
resident). `tests/plan_reference.py` is the earlier whole-epoch implementation (a test oracle); both give the
same batches (tests/test_plan_scale.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Protocol

import numpy as np

BALANCE_POLICIES = ("drop", "pad")
IntOrArray = int | np.ndarray  # what the stream helpers take and give


@dataclass(frozen=True)
class SegmentConfig:
    """The settings a segment runs at; a change mid-epoch starts a new segment."""

    world_size: int
    num_workers: int  # 0 = in the consumer's process; plans like 1 worker
    batch_size: int
    shuffle_buffer: int
    balance: str
    # slots held at the buffer's first emission; None: default_initial(shuffle_buffer).
    # shuffle_buffer + 1 is the order of states saved before it existed (full before emitting)
    shuffle_initial: int | None = None

    def __post_init__(self) -> None:
        if self.shuffle_initial is None:
            object.__setattr__(self, "shuffle_initial", default_initial(self.shuffle_buffer))

    @property
    def streams(self) -> int:
        return max(1, self.num_workers)

    @property
    def initial(self) -> int:
        return int(self.shuffle_initial or 1)

    def same_but_initial(self, other: SegmentConfig) -> bool:
        """The same settings but perhaps the initial fill: a state saved before the fill was
        recorded finishes its epoch in its own order, as one segment."""
        return replace(self, shuffle_initial=other.shuffle_initial) == other


@dataclass
class Segment:
    config: SegmentConfig
    batches_consumed: int = 0

    def to_dict(self) -> dict:
        c = self.config
        return {"world_size": c.world_size, "num_workers": c.num_workers,
                "batch_size": c.batch_size, "shuffle_buffer": c.shuffle_buffer,
                "balance": c.balance, "shuffle_initial": c.initial,
                "batches_consumed": self.batches_consumed}

    @classmethod
    def from_dict(cls, d: dict, defaults: dict) -> Segment:
        """A segment a state recorded; without `shuffle_initial` (saved before it existed) its
        buffer emitted only once full, so the resumed epoch keeps that order."""
        merged = {**defaults, **d}
        buffer = int(merged["shuffle_buffer"])
        config = SegmentConfig(int(merged["world_size"]), int(merged["num_workers"]),
                               int(merged["batch_size"]), buffer, str(merged["balance"]),
                               int(merged.get("shuffle_initial", buffer + 1)))
        return cls(config, int(merged["batches_consumed"]))


@dataclass(frozen=True)
class Layout:
    """Sample counts per shard, in manifest order."""

    counts: np.ndarray  # int64 [num_shards] (may be a read-only memmap of the manifest index)
    offsets: np.ndarray = field(init=False)  # int64 [num_shards + 1]

    def __post_init__(self) -> None:
        counts = np.asarray(self.counts, dtype=np.int64)
        object.__setattr__(self, "counts", counts)
        object.__setattr__(self, "offsets", _prefix_sums(counts))

    @property
    def num_samples(self) -> int:
        return int(self.offsets[-1])

    def locate(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Global ids -> (shard index, position in shard)."""
        shard = np.searchsorted(self.offsets, ids, side="right") - 1
        return shard, ids - self.offsets[shard]


def _prefix_sums(counts: np.ndarray) -> np.ndarray:
    out = np.zeros(len(counts) + 1, dtype=np.int64)
    np.cumsum(counts, out=out[1:])
    return out


def batches_for(n: int, world_size: int, batch_size: int, balance: str,
                leave_out: int = 0) -> int:
    """The batch count every rank yields when `n` samples are split over `world_size` ranks;
    `leave_out` (drop): samples a skip list may take out of one rank's range (canonical.py)."""
    if balance == "drop":
        return max(0, (n // world_size) // batch_size * batch_size - leave_out) // batch_size
    per_rank = -(-n // world_size)
    return -(-per_rank // batch_size)


# The three helpers below take an int or an int array `w` (Carried applies them to every
# old stream at once); an int in gives an int out.
def worker_batches(total: int, streams: int, w: IntOrArray) -> IntOrArray:
    """Batches of the rank's `total` dealt to worker `w`."""
    return total // streams + (w < total % streams) * 1


def first_worker_batch(total: int, streams: int, w: IntOrArray) -> IntOrArray:
    """Index, among the rank's batches in slot order, of worker `w`'s first batch."""
    return _as_int(w * (total // streams) + np.minimum(w, total % streams))


def consumed_by_worker(t: int, streams: int, w: IntOrArray) -> IntOrArray:
    """Batches of worker `w` among the rank's first `t` batches (batch t' comes from t' % W)."""
    return _as_int(np.maximum(0, (t - w + streams - 1) // streams))


def _as_int(x: IntOrArray) -> IntOrArray:
    return int(x) if np.ndim(x) == 0 else x


class Positions(Protocol):
    """A list of global ids, addressed by position, that is not materialised: L or L_k."""

    def __len__(self) -> int: ...

    def ids(self, positions: np.ndarray) -> np.ndarray: ...


class EpochOrder:
    """L of one epoch: shards in (seeded) order, tar order within a shard. O(shards) memory:
    a position maps to its id through the prefix sums of the counts in epoch order."""

    def __init__(self, layout: Layout, seed: int, epoch: int, shuffle: bool,
                 key: tuple[int, ...] = ()) -> None:
        """`key` sets apart the shard orders of other uses of the same (seed, epoch) (a
        mixture's sources, mixture.py)."""
        n_shards = len(layout.counts)
        self.layout = layout
        self.order = (np.random.default_rng([seed, *key, epoch]).permutation(n_shards)
                      if shuffle else None)  # None: manifest order
        self.starts = (layout.offsets if self.order is None
                       else _prefix_sums(layout.counts[self.order]))

    def __len__(self) -> int:
        return int(self.starts[-1])

    def ids(self, positions: np.ndarray) -> np.ndarray:
        j = np.searchsorted(self.starts, positions, side="right") - 1  # empty shards skipped
        shard = j if self.order is None else self.order[j]
        return self.layout.offsets[shard] + (positions - self.starts[j])


def default_initial(buffer: int) -> int:
    """Slots a buffer of `buffer` holds at its first emission: a tenth (webdataset's
    shuffle(1000, initial=100)), so a worker's first batch waits for ~K/10 + 2b slots, not K + b."""
    return max(1, buffer // 10)


def shuffle_order(n: int, buffer: int, rng: np.random.Generator | None,
                  limit: int | None = None, initial: int | None = None) -> np.ndarray:
    """Emission order of n slots through a shuffle buffer of `buffer` slots that starts
    emitting once it holds `initial` (default_initial(buffer); clipped to 1..buffer + 1).

    Slots enter in order. Emission j takes a uniformly drawn resident once slots
    0..E(j)-1 have entered, E(j) = min(n, I + 2j, K + 1 + j): the buffer grows by one slot per
    emission from I to K + 1 residents (webdataset's shuffle(bufsize, initial)), then one slot
    enters per emission, and at the end the rest drain. So emission j comes from the first
    E(j) slots (the first from the first I): less mixing early in the stream, the price of a
    first batch after ~I + 2b slots. I = K + 1 is the buffer that emits only once full.
    Decisions use positions only, so the order is a pure function of (n, K, I, rng). `limit`
    stops after that many emissions (for replay); emission j uses draw j, so a replay costs
    O(limit + K). Vectorised while one slot enters per emission (`_fill_phase`); the growth
    and the drain (<= K + 1 emissions each) are Python loops. Same order, draw for draw, as
    tests/plan_reference.py:shuffle_order.
    """
    limit = n if limit is None else max(0, min(limit, n))
    if rng is None or buffer <= 0 or n <= 1:
        return np.arange(limit, dtype=np.int64)
    first = min(max(1, default_initial(buffer) if initial is None else initial), buffer + 1)
    draws = rng.random(limit)  # emission j uses draw j (a prefix of rng.random(n))
    out = np.empty(limit, dtype=np.int64)
    steps = _Steps(n, buffer, first, draws, out)
    grown = min(limit, buffer + 2 - first)  # from here on one slot enters per emission
    steps.run(0, grown)
    fill = min(limit, n - buffer)  # emissions j with K + 1 + j <= n
    if fill > grown:
        steps.resident = _fill_phase(draws[grown:fill], np.array(steps.resident, np.int64),
                                     buffer + grown, out[grown:fill]).tolist()
        steps.entered = buffer + fill
    steps.run(max(grown, fill), limit)
    return out


@dataclass
class _Steps:
    """shuffle_order's emissions one at a time: slots enter up to E(j), a drawn one leaves."""

    n: int
    buffer: int
    initial: int
    draws: np.ndarray
    out: np.ndarray
    resident: list[int] = field(default_factory=list)
    entered: int = 0

    def run(self, lo: int, hi: int) -> None:
        res, n, k, first = self.resident, self.n, self.buffer, self.initial
        for j, d in enumerate(self.draws[lo:hi].tolist(), lo):
            target = min(n, first + 2 * j, k + 1 + j)
            res.extend(range(self.entered, target))
            self.entered = max(self.entered, target)
            i = int(d * len(res))
            self.out[j] = res[i]
            res[i] = res[-1]
            res.pop()


def entered_after(emitted: IntOrArray, slots: IntOrArray, buffer: int, initial: int
                  ) -> IntOrArray:
    """Slots that entered a shuffled stream's buffer by its `emitted`-th emission (0 before
    the first): E(emitted - 1) of `shuffle_order`."""
    last = np.maximum(emitted - 1, 0)
    entered = np.minimum(slots, np.minimum(initial + 2 * last, buffer + 1 + last))
    return _as_int(np.where(np.asarray(emitted) > 0, entered, 0))


def _fill_phase(draws: np.ndarray, resident: np.ndarray, first: int, out: np.ndarray
                ) -> np.ndarray:
    """Emissions while one slot enters per emission, written to out[:F] (F = len(draws));
    returns the buffer afterwards. `resident`: the K slots it holds before, `first`: the
    first slot to enter.

    Emission s happens when slot first+s enters the K residents: pick p = floor(d_s (K+1));
    p == K sends the entering slot straight out, else the resident at p leaves and the entering
    slot takes its place. So emission s is the value last written at p before step s: first+s'
    for the previous step s' that picked p, or resident[p]. A stable sort by p finds every
    previous step at once.
    """
    k, steps = len(resident), len(draws)
    pick = (draws * (k + 1)).astype(np.int64)
    out[:steps] = np.arange(first, first + steps)
    stays = np.flatnonzero(pick < k)
    # (positions fit 16 bits for the usual buffers: numpy's stable sort is then a radix sort)
    by_pos = np.argsort(pick[stays].astype(np.int16 if k < 2**15 else np.int64), kind="stable")
    pos, step = pick[stays][by_pos], stays[by_pos]
    is_first = np.ones(len(pos), dtype=bool)
    is_first[1:] = pos[1:] != pos[:-1]
    left = np.where(is_first, resident[pos], 0)
    left[~is_first] = first + step[np.flatnonzero(~is_first) - 1]
    out[step] = left
    after = resident.copy()
    last = np.ones(len(pos), dtype=bool)
    last[:-1] = pos[:-1] != pos[1:]
    after[pos[last]] = first + step[last]
    return after


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
    remaining: Positions  # L_k: ids still to consume at the segment's start
    batches: int  # B: identical on every rank
    seed: int
    epoch: int

    def rank_ranges(self, ranks: IntOrArray) -> tuple[IntOrArray, IntOrArray]:
        """(first position in L_k, own sample count) of rank(s) `ranks` (an int or array)."""
        c, n = self.config, len(self.remaining)
        if c.balance == "drop":  # (the range before a skip list's leave_out)
            per_rank = (n // c.world_size) // c.batch_size * c.batch_size
            return ranks * per_rank, ranks * 0 + per_rank
        q, r = divmod(n, c.world_size)
        return ranks * q + np.minimum(ranks, r), q + (ranks < r) * 1

    def slot_positions(self, rank: int, lo: int, hi: int) -> tuple[np.ndarray, np.ndarray]:
        """Positions in L_k of the rank's slots lo..hi-1, and whether each is valid (pad
        repeats the rank's own first samples cyclically, or L_k's when it has none)."""
        start, own = (int(x) for x in self.rank_ranges(rank))
        slots = np.arange(lo, hi, dtype=np.int64)
        valid = slots < own
        if valid.all():
            return start + slots, valid
        extra = slots[~valid] - own
        positions = start + slots
        positions[~valid] = start + extra % own if own else extra % len(self.remaining)
        return positions, valid

    def rank_slots(self, rank: int) -> tuple[np.ndarray, np.ndarray]:
        """Global ids (and validity) of all the rank's slots, in slot order."""
        positions, valid = self.slot_positions(rank, 0, self.batches * self.config.batch_size)
        return self.remaining.ids(positions), valid

    def worker(self, rank: int, w: int, limit: int | None = None) -> WorkerPlan:
        c = self.config
        first = first_worker_batch(self.batches, c.streams, w)
        count = worker_batches(self.batches, c.streams, w)
        positions, valid = self.slot_positions(rank, first * c.batch_size,
                                               (first + count) * c.batch_size)
        order = self.stream_order(rank, w, len(positions), limit)
        return WorkerPlan(self.remaining.ids(positions), valid, order, count, c.batch_size)

    def stream_order(self, rank: int, w: int, n: int, limit: int | None = None) -> np.ndarray:
        """Emission order of stream (rank, w)'s n slots (shuffle_order at this segment's
        buffer)."""
        c = self.config
        return shuffle_order(n, c.shuffle_buffer, self.stream_rng(rank, w), limit, c.initial)

    def stream_rng(self, rank: int, w: int) -> np.random.Generator | None:
        if self.config.shuffle_buffer <= 0:
            return None
        return np.random.default_rng([self.seed, self.epoch, self.index, rank, w])


class Carried:
    """L_{k+1}: L_k minus what segment k consumed in its first `t` batches, order kept.

    Segment k cut L_k into stream ranges, one per old (rank, worker), plus (drop) the unused
    tail. Stream i's range starts at a_i, holds v_i valid slots and emitted k_i slots; its
    emissions lie within its first e_i slots (e_i = `entered_after`(k_i)), so
    what it left of its range, in order, is: the h_i slots of its first e_i still resident in
    its buffer ("holes"), then slots e_i..v_i-1 untouched. Counts come from arithmetic; the
    holes of a stream are found by re-simulating its buffer, only when a position asked for
    falls among them. (Pad repeats are never consumed: where a stream's emissions may include
    them, its consumed count comes from simulation too.)
    """

    def __init__(self, parent: Positions, plan: SegmentPlan, batches_consumed: int) -> None:
        self.parent, self.plan = parent, plan
        c = plan.config
        b, streams, buffer = c.batch_size, c.streams, c.shuffle_buffer
        # one range per old (rank, worker), and a last one: the tail of L_k that segment k
        # never assigned (drop), kept whole (rank -1, no slots)
        ranks = np.repeat(np.arange(c.world_size, dtype=np.int64), streams)
        ws = np.tile(np.arange(streams, dtype=np.int64), c.world_size)
        first = first_worker_batch(plan.batches, streams, ws)
        slots = worker_batches(plan.batches, streams, ws) * b
        rank_start, own = plan.rank_ranges(ranks)
        tail = plan.batches * b * c.world_size if c.balance == "drop" else len(parent)
        valid = np.append(np.clip(own - first * b, 0, slots), len(parent) - tail)
        self.ranks, self.ws = np.append(ranks, -1), np.append(ws, -1)
        self.slots = np.append(slots, 0)
        self.start = np.append(rank_start + first * b, tail)
        self.emitted = np.minimum(consumed_by_worker(batches_consumed, streams, self.ws) * b,
                                  self.slots)
        shuffled = (buffer > 0) & (self.slots > 1)
        entered = np.where(shuffled,
                           entered_after(self.emitted, self.slots, buffer, c.initial),
                           self.emitted)
        self._sims: dict[int, np.ndarray] = {}  # stream -> its emitted slot indices
        consumed = self.emitted.copy()
        for i in np.flatnonzero(entered > valid).tolist():  # may have emitted pad repeats
            consumed[i] = int(np.count_nonzero(self._emitted(i) < valid[i]))
        self.entered = np.minimum(valid, entered)
        self.holes = self.entered - consumed
        self.kept_starts = _prefix_sums(valid - consumed)

    def __len__(self) -> int:
        return int(self.kept_starts[-1])

    def ids(self, positions: np.ndarray) -> np.ndarray:
        return self.parent.ids(self.parent_positions(positions))

    def parent_positions(self, positions: np.ndarray) -> np.ndarray:
        """Positions in L_{k+1} -> positions in L_k (increasing, like the ids' order)."""
        positions = np.asarray(positions, dtype=np.int64)
        i = np.searchsorted(self.kept_starts, positions, side="right") - 1  # empty ones skipped
        local = positions - self.kept_starts[i]
        out = self.start[i] + self.entered[i] + (local - self.holes[i])
        in_holes = np.flatnonzero(local < self.holes[i])
        if len(in_holes):
            streams, inverse = np.unique(i[in_holes], return_inverse=True)
            for u, stream in enumerate(streams.tolist()):
                sel = in_holes[inverse == u]
                out[sel] = self._hole_positions(stream)[local[sel]]
        return out

    def _hole_positions(self, i: int) -> np.ndarray:
        """Positions in L_k of stream i's slots that entered its buffer and are still there."""
        emitted = self._emitted(i)
        resident = np.ones(int(self.entered[i]), dtype=bool)
        resident[emitted[emitted < len(resident)]] = False
        holes = np.flatnonzero(resident)
        assert len(holes) == self.holes[i], "plan arithmetic disagrees with the replay"
        return self.start[i] + holes

    def _emitted(self, i: int) -> np.ndarray:
        """Slot indices stream i emitted, from a replay of its buffer (remembered)."""
        if i not in self._sims:
            rank, w = int(self.ranks[i]), int(self.ws[i])
            self._sims[i] = self.plan.stream_order(rank, w, int(self.slots[i]),
                                                   int(self.emitted[i]))
        return self._sims[i]


class Mixed(Protocol):
    """A weighted mixture's epoch orders (mixture.py `Mixture`)."""

    epoch_samples: int

    def order(self, seed: int, epoch: int, shuffle: bool) -> Positions: ...

    def describe(self) -> dict: ...


def plan_segments(layout: Layout, seed: int, epoch: int, shuffle: bool,
                  segments: list[Segment], mixture: Mixed | None = None,
                  leave_out: int = 0) -> list[SegmentPlan]:
    """Replay the epoch's segments: each one partitions what the previous ones left. With a
    `mixture`, L is its interleaved order (over `layout`, the sources' shards end to end).
    `leave_out`: see batches_for (a skip list, order: global, which has one segment config)."""
    remaining: Positions = (EpochOrder(layout, seed, epoch, shuffle) if mixture is None
                            else mixture.order(seed, epoch, shuffle))
    plans = []
    for k, seg in enumerate(segments):
        c = seg.config
        plan = SegmentPlan(k, c, remaining, batches_for(len(remaining), c.world_size,
                                                        c.batch_size, c.balance, leave_out),
                           seed, epoch)
        plans.append(plan)
        if k + 1 < len(segments) and seg.batches_consumed:
            remaining = Carried(remaining, plan, seg.batches_consumed)
    return plans


class Planner:
    """`plan_segments` for one dataset and seed, remembering the last epoch it planned."""

    def __init__(self, layout: Layout, seed: int, shuffle: bool,
                 mixture: Mixed | None = None, leave_out: int = 0) -> None:
        self.layout, self.seed, self.shuffle, self.mixture = layout, seed, shuffle, mixture
        self.leave_out = leave_out
        self._key: tuple | None = None
        self._plans: list[SegmentPlan] = []

    def plans(self, epoch: int, segments: list[Segment]) -> list[SegmentPlan]:
        # Replay depends only on what earlier segments consumed, not on the last one's count.
        key = (epoch, tuple((s.config, s.batches_consumed) for s in segments[:-1]),
               segments[-1].config)
        if key != self._key:
            self._plans = plan_segments(self.layout, self.seed, epoch, self.shuffle, segments,
                                        self.mixture, self.leave_out)
            self._key = key
        return self._plans

    def fresh(self) -> Planner:
        """A planner of the same epochs with nothing remembered (for a worker process)."""
        return Planner(self.layout, self.seed, self.shuffle, self.mixture, self.leave_out)

    @property
    def epoch_samples(self) -> int:
        """Samples in an epoch's list L: the layout's, or the mixture's epoch size."""
        return self.layout.num_samples if self.mixture is None else self.mixture.epoch_samples

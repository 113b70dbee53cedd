"""`order: global`: global batches that depend on the seed, the epoch and the data alone.

The epoch list L (plan.py) is dealt into C = `canonical_streams` contiguous, equal ranges (the
rank order's plan at world size C, batch size g = G / C, no loader workers, balance drop), each
emitted through its own seeded shuffle buffer keyed by (seed, epoch, stream). Global batch t is
the t-th g-sample chunk of every stream, in stream order. Nothing here depends on the world size
N or the loader workers W:
  - rank r of N owns streams [r C/N, (r+1) C/N) (a contiguous block: the same stretch of L as
    the rank order's range, so shard locality and the caches work as there), and its batch t
    is its streams' chunks t, concatenated in stream order (G / N samples);
  - loader stream w of W makes the rank's batches t = w, w + W, ... from all the rank's
    streams, so W changes who reads a chunk, never what it holds;
  - a resume at any N or W continues at "global batches consumed" (one segment, whose config is
    the canonical one).
A skip list takes its ids out of each stream's emission sequence, which is then cut to
`batches_for(..., leave_out)` chunks (the most any stream can lose): a prefix of a stream's
sequence keeps its chunks when ids emitted after it are added to the list, so a rerun from a
checkpoint with more ids skipped resumes exactly. (The rank order keeps its plan and replaces
a listed id's row in its batch instead: stream.py's `stand_ins`.)
"""

from __future__ import annotations

import json
import os
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ringfeed.pipeline.config import PipelineConfig, canonical_rule_error, resolved_streams
from ringfeed.pipeline.errors import PipelineError
from ringfeed.pipeline.plan import SegmentConfig, SegmentPlan, WorkerPlan
from ringfeed.pipeline.stream import Booked, StreamContext, WorkerStream


def canonical_config(c: PipelineConfig, world_size: int) -> SegmentConfig:
    """The segment config a global-order pipeline plans with, after its rules are checked: one
    PipelineError line naming the option."""
    G = c.global_batch_size
    if G is None:
        raise PipelineError("order: global needs global_batch_size (samples per batch over all "
                            "ranks)")
    if c.balance != "drop":
        raise PipelineError("order: global drops the epoch's tail; balance='pad' is for the "
                            "rank order (evaluation)")
    problem = canonical_rule_error(G, c.canonical_streams, world_size)
    if problem:
        raise PipelineError(problem)
    C = resolved_streams(c.canonical_streams, G)
    return SegmentConfig(C, 0, G // C, c.shuffle_buffer if c.shuffle else 0, "drop")


def load_skip(skip: list[int] | str | None, num_samples: int) -> np.ndarray:
    """The skip list's ids that exist in the split, sorted and unique. A file holds ids
    separated by whitespace or commas, or JSON lines with an "ids" list (nested per rank, as
    samples.jsonl writes them): one PipelineError line naming the file otherwise."""
    if skip is None:
        return np.zeros(0, dtype=np.int64)
    if isinstance(skip, list):
        ids = np.asarray(skip, dtype=np.int64)
    else:
        ids = np.asarray(_read_ids(Path(os.path.expanduser(skip))), dtype=np.int64)
    ids = np.unique(ids)
    return ids[ids < num_samples]


def _read_ids(path: Path) -> list[int]:
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise PipelineError(f"skip: cannot read {path} ({e.strerror or e})") from None
    ids: list[int] = []
    for number, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line:
            continue
        try:
            if line.startswith("{"):
                ids.extend(_flat(json.loads(line)["ids"]))
            else:
                ids.extend(int(x) for x in line.replace(",", " ").split())
        except (ValueError, KeyError, TypeError):
            raise PipelineError(f"skip: {path}:{number}: expected sample ids (numbers) or a "
                                "samples.jsonl line with \"ids\"") from None
    if any(i < 0 for i in ids):
        raise PipelineError(f"skip: {path}: sample ids are >= 0")
    return ids


def _flat(value: Any) -> list[int]:
    if isinstance(value, list):
        return [i for v in value for i in _flat(v)]
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(value)
    return [value]


def leave_out_for(ids: np.ndarray, mixture: Any | None) -> int:
    """The most samples `ids` can take out of one stream: one each, or for a weighted mixture
    each id's most repeats in an epoch (ceil(its source's share / its source's size))."""
    if mixture is None or not len(ids):
        return len(ids)
    source = np.searchsorted(mixture.starts, ids, side="right") - 1
    sizes = np.diff(mixture.starts)
    repeats = -(-mixture.per_epoch // np.maximum(sizes, 1))
    return int(repeats[source].sum())


@dataclass(frozen=True)
class RankStreams:
    """Which loader streams a rank runs and what each makes (picklable: torch's workers get
    it). The rank order: WorkerStream w of the segment plan; the global order: GlobalStream."""

    rank: int
    world_size: int
    num_workers: int
    order: str = "rank"
    skip: np.ndarray | None = None  # the skip list's ids (sorted)

    @property
    def count(self) -> int:
        return max(1, self.num_workers)

    def batch_size(self, plan_config: SegmentConfig) -> int:
        if self.order == "global":
            return plan_config.batch_size * plan_config.world_size // self.world_size
        return plan_config.batch_size

    def open(self, context: StreamContext, plan: SegmentPlan, w: int, t0: int
             ) -> Iterator[Booked]:
        """Loader stream `w`'s batches of `plan` after the rank's first `t0`."""
        if self.order == "global":
            return iter(GlobalStream(context, plan, self, w, t0))
        return iter(WorkerStream.resuming(context, plan, self.rank, w, t0, self.skip))


class GlobalStream:
    """Loader stream w of a rank in the global order: the rank's batches t >= t0 with
    t % W == w, each its canonical streams' chunks t concatenated in stream order."""

    def __init__(self, context: StreamContext, plan: SegmentPlan, streams: RankStreams, w: int,
                 t0: int) -> None:
        self.context, self.plan, self.w = context, plan, w
        W, C = streams.count, plan.config.world_size
        first = t0 + (w - t0) % W
        self.batches = np.arange(first, plan.batches, W, dtype=np.int64)
        per_rank = C // streams.world_size
        self.canonical = range(streams.rank * per_rank, (streams.rank + 1) * per_rank)
        self.skip = streams.skip if streams.skip is not None else np.zeros(0, dtype=np.int64)

    def sub_plan(self, c: int) -> WorkerPlan:
        """Canonical stream c's slots (its range of L), emitting only this stream's chunks."""
        plan, g = self.plan, self.plan.config.batch_size
        span = (len(plan.remaining) // plan.config.world_size) // g * g
        positions, valid = plan.slot_positions(c, 0, span)
        ids = plan.remaining.ids(positions)
        emitted = plan.stream_order(c, 0, span)
        if len(self.skip):
            emitted = emitted[~np.isin(ids[emitted], self.skip)]
        chunks = emitted[:plan.batches * g].reshape(plan.batches, g)
        return WorkerPlan(ids, valid, chunks[self.batches].ravel(), len(self.batches), g)

    def __iter__(self) -> Iterator[Booked]:
        if not len(self.batches):
            return
        plan = self.plan
        parts = [iter(WorkerStream(self.context, self.sub_plan(c), 0, plan.epoch, plan.index,
                                   1, 0)) for c in self.canonical]
        try:
            for t in self.batches.tolist():
                chunks = [next(part) for part in parts]
                yield Booked(_concat([b.batch for b in chunks]), (plan.epoch, plan.index, t),
                             _sum_stats([b.stats for b in chunks]))
        finally:
            for part in parts:
                part.close()


def _concat(batches: list[dict[str, Any]]) -> dict[str, Any]:
    """One batch of the parts' samples, in order: arrays concatenated, lists joined."""
    if len(batches) == 1:
        return batches[0]
    out: dict[str, Any] = {}
    for name, first in batches[0].items():
        values = [b[name] for b in batches]
        if all(isinstance(v, np.ndarray) and v.shape[1:] == first.shape[1:]
               and v.dtype == first.dtype for v in values):
            out[name] = np.concatenate(values)
        else:  # (as collate: values that do not stack stay a list)
            out[name] = [x for v in values for x in v]
    return out


def _sum_stats(parts: list[dict[str, Any]]) -> dict[str, Any]:
    counts: Counter = Counter()
    by_shard: Counter = Counter()
    for p in parts:
        counts.update(p.get("counts", {}))
        by_shard.update(p.get("skipped_by_shard", {}))
    return {"counts": dict(counts), "skipped_by_shard": dict(by_shard)}

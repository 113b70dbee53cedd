"""One worker stream: the planned slots of a worker, read, decoded, batched, as a chain of
stages composed in `WorkerStream.__iter__`:

    plan (readplan.py: slots -> shards, positions, runs; once per stream)
    -> open (opener.py: shards in read order, prefetched; decoded-cache entries looked up,
       or filled as an indexed shard opens; while a shard downloads, ahead.py decodes samples
       of the open shards that later batches need)
    -> read + decode + batch (routes.py: a decoded-cache gather, or an indexed read decoded
       field by field, or sample by sample, where bad data is handled)
    -> book (the batch's keys, ids, validity, tag and counters).

The emission order is fixed by the plan (`WorkerPlan.order`), so reading just follows it, a
batch of slots at a time. Resuming skips the consumed batches: shards none of whose remaining
slots are needed are never opened, and consumed samples are neither read nor decoded.

Bad data never changes the batch count (ranks must agree on it): under `skip` a bad sample, or
the rest of a corrupt shard, is replaced by a repeat of the stream's latest good sample
(flagged `__valid__ = False`), counted, and warned about once per shard; under `fail` it raises
PipelineDataError naming the shard URL and the sample key.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

from ringfeed.pipeline import malloc
from ringfeed.pipeline.ahead import DecodeAhead
from ringfeed.pipeline.cache import ShardCache
from ringfeed.pipeline.decode import Decoder
from ringfeed.pipeline.decoded_cache import DecodedStore
from ringfeed.pipeline.opener import ShardOpener
from ringfeed.pipeline.plan import Layout, SegmentPlan, WorkerPlan, consumed_by_worker
from ringfeed.pipeline.readplan import Chunk, ReadPlan
from ringfeed.pipeline.routes import (
    Assembled,
    ColumnBatches,
    DecodedBatches,
    Fallback,
    GoodSamples,
    SampleBatches,
)
from ringfeed.pipeline.shardread import IndexStore
from ringfeed.pipeline.source import ShardRef
from ringfeed.pipeline.stats import StreamCounters


@dataclass
class StreamContext:
    """Everything a worker stream needs; picklable, so DataLoader workers can get it."""

    refs: Sequence[ShardRef]  # a list, or source.ShardRefs (made on access from the index)
    layout: Layout
    decoder: Decoder
    cache: ShardCache
    on_error: str
    prefetch: int
    indexes: IndexStore | None = None  # None: read every shard with the tar iterator
    decoded: DecodedStore | None = None  # None: no decoded-sample cache


class Booked(NamedTuple):
    """A batch beside the pipeline's bookkeeping for it, which the consumer's
    `ShardPipeline.received` / `mark_consumed` take off: never keys in the user's batch. A
    NamedTuple of plain values, so torch's DataLoader converts, pins and ships it from worker
    processes as it is (and tf.data takes the tag as a second element)."""

    batch: dict[str, Any]
    tag: tuple[int, int, int]  # (epoch, segment, rank batch index t): what mark_consumed takes
    stats: dict[str, Any]  # counter increments since the stream's previous batch


class WorkerStream:
    """Iterating yields the worker's batches from local batch `skip` on, each as a `Booked`:
    the batch beside its tag (epoch, segment, rank batch index) and counter increments."""

    def __init__(self, context: StreamContext, plan: WorkerPlan, skip: int, epoch: int,
                 segment: int, streams: int, w: int, listed: np.ndarray | None = None) -> None:
        self.context, self.plan, self.skip = context, plan, skip
        self.epoch, self.segment = int(epoch), int(segment)  # the first two of every tag
        self.streams, self.w = streams, w
        self.listed = listed  # a skip list's ids (sorted): their rows get stand-ins
        self.counters = StreamCounters()

    @classmethod
    def resuming(cls, context: StreamContext, plan: SegmentPlan, rank: int, w: int, t0: int,
                 listed: np.ndarray | None = None) -> WorkerStream:
        """Worker stream `w` of `rank`, after the rank's first `t0` batches of the segment."""
        streams = plan.config.streams
        return cls(context, plan.worker(rank, w), consumed_by_worker(t0, streams, w), plan.epoch,
                   plan.index, streams, w, listed)

    def __iter__(self) -> Iterator[Booked]:
        """The stages, composed: plan -> open shards -> (decoded gather | read + decode columns
        | sample by sample, where bad data is handled) -> book."""
        malloc.tune()  # (in whichever process runs the stream: threads' or loader workers')
        context, counters = self.context, self.counters
        needed = self.plan.order[self.skip * self.plan.batch_size:]
        if not len(needed):
            return
        reads = ReadPlan(self.plan, needed, context.layout)
        shards = ShardOpener(context, reads, counters)
        good = GoodSamples()
        decoder = context.decoder
        ahead = (DecodeAhead(decoder, reads, self.epoch) if context.indexes is not None
                 and ColumnBatches.decodes(decoder) else None)
        # (the epoch, with each sample's key and the seed, decides its augmentation)
        whole_batch_routes = (DecodedBatches(decoder, reads, good, counters, self.epoch),
                              ColumnBatches(decoder, reads, good, counters, self.epoch, ahead))
        samples = SampleBatches(context.decoder, reads, good, counters, context.on_error,
                                f"worker stream {self.w} of this rank", self.epoch)
        local_batch = self.skip
        try:
            for chunk in reads.chunks():
                if ahead is not None:
                    ahead.position = chunk.first
                sources = shards.open_through(chunk.used[-1],
                                              ahead.step if ahead is not None else None)
                for assembled in self._assemble(chunk, sources, whole_batch_routes, samples):
                    yield self._booked(assembled, local_batch)
                    local_batch += 1
                if ahead is not None:
                    ahead.take(chunk.slots)  # (what another route read itself)
                shards.close_finished(chunk.first + len(chunk.slots) - 1)
            samples.finish()
        finally:
            shards.close()

    @staticmethod
    def _assemble(chunk: Chunk, sources: dict[int, Any],
                  whole_batch_routes: tuple[DecodedBatches, ColumnBatches],
                  samples: SampleBatches) -> Iterator[Assembled]:
        """The first whole-batch route that applies (none while samples are held back), else
        sample by sample."""
        if samples.idle:
            route = next((r for r in whole_batch_routes if r.applies(chunk, sources)), None)
            if route is not None:
                try:
                    yield route.read(chunk, sources)
                    return
                except Fallback:
                    pass
        yield from samples.add(chunk, sources)

    def _booked(self, assembled: Assembled, local_batch: int) -> Booked:
        if self.listed is not None:
            assembled = stand_ins(assembled, self.listed)
        batch = assembled.fields
        batch["__key__"] = assembled.keys
        batch["__index__"] = np.asarray(assembled.ids, dtype=np.int64)
        batch["__valid__"] = np.asarray(assembled.valid, dtype=bool)
        return Booked(batch, (self.epoch, self.segment, local_batch * self.streams + self.w),
                      self.counters.take())


def stand_ins(assembled: Assembled, listed: np.ndarray) -> Assembled:
    """The batch with each row whose id is listed (a skip list, the rank order) replaced by a
    copy of the nearest earlier unlisted row of the batch (or the nearest later one), flagged
    invalid, as a bad sample's is. The plan does not change, so batch counts, resume and
    resume at another world size keep the rank order's rules, and a list extended before a
    resume changes only the rows it names. A batch of listed ids only is left as read,
    flagged invalid (it has no row to copy)."""
    rows = np.isin(assembled.ids, listed)
    if not rows.any():
        return assembled
    kept = np.flatnonzero(~rows)
    if not len(kept):
        return assembled._replace(valid=np.zeros(len(rows), dtype=bool))
    at = np.flatnonzero(rows)
    earlier = np.searchsorted(kept, at) - 1
    source = kept[np.where(earlier >= 0, earlier, 0)]
    fields = {name: _rows_copied(values, at, source) for name, values in assembled.fields.items()}
    keys = list(assembled.keys)
    ids, valid = assembled.ids.copy(), np.asarray(assembled.valid, dtype=bool).copy()
    for i, j in zip(at.tolist(), source.tolist(), strict=True):
        keys[i] = keys[j]
    ids[at], valid[at] = ids[source], False
    return Assembled(fields, keys, ids, valid)


def _rows_copied(values: Any, at: np.ndarray, source: np.ndarray) -> Any:
    if isinstance(values, np.ndarray):
        values = values.copy()
        values[at] = values[source]
        return values
    values = list(values)
    for i, j in zip(at.tolist(), source.tolist(), strict=True):
        values[i] = values[j]
    return values

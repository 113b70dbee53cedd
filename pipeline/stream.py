"""One worker stream: the planned slots of a worker, read, decoded, batched.

The emission order is fixed by the plan (`WorkerPlan.order`), so reading just follows it, a
batch of slots at a time. Shards are opened in the order their slots are first needed
(prefetched through the cache) and closed after their last slot. A batch whose shards all have
a decoded-cache entry is gathered from those arrays in one step; any other batch is assembled
sample by sample: raw sample by indexed read (shardread.py), decode, finish. Resuming skips the
consumed batches: shards none of whose remaining slots are needed are never opened, and
consumed samples are neither read nor decoded.

Bad data never changes the batch count (ranks must agree on it): under `skip` a bad sample, or
the rest of a corrupt shard, is replaced by a repeat of the stream's latest good sample
(flagged `__valid__ = False`), counted, and warned about once per shard; under `fail` it raises
PipelineDataError naming the shard URL and the sample key.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

from ringfeed.pipeline import malloc
from ringfeed.pipeline.batch import collate, gather, stack
from ringfeed.pipeline.cache import Prefetcher, ShardCache
from ringfeed.pipeline.decode import Decoder
from ringfeed.pipeline.decoded_cache import CachedShard, DecodedStore, Uncacheable
from ringfeed.pipeline.errors import PipelineDataError
from ringfeed.pipeline.plan import Layout, SegmentPlan, WorkerPlan, consumed_by_worker
from ringfeed.pipeline.shardread import (
    BadSample,
    IndexedSamples,
    IndexStore,
    ShardSamples,
    open_samples,
    shard_identity,
)
from ringfeed.pipeline.source import ShardRef
from ringfeed.pipeline.stats import StreamCounters

log = logging.getLogger("ringfeed.pipeline")

FILL_ROWS = 256  # samples decoded and written per step while filling a decoded-cache entry


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

    def __init__(self, context: StreamContext, plan: WorkerPlan, skip: int, epoch: int, segment: int,
                 streams: int, w: int) -> None:
        self.context, self.plan, self.skip = context, plan, skip
        self.epoch, self.segment = int(epoch), int(segment)  # the first two of every tag
        self.streams, self.w = streams, w
        self.counters = StreamCounters()
        self._warned: set[str] = set()  # shards already warned about
        # the latest good sample and its key (what a bad one is replaced by), and the fields
        # every sample must have (the first good sample's)
        self._last_good: tuple[dict[str, Any], str] | None = None
        self._reference: set[str] | None = None

    @classmethod
    def resuming(cls, context: StreamContext, plan: SegmentPlan, rank: int, w: int, t0: int
                 ) -> WorkerStream:
        """Worker stream `w` of `rank`, after the rank's first `t0` batches of the segment."""
        streams = plan.config.streams
        return cls(context, plan.worker(rank, w), consumed_by_worker(t0, streams, w), plan.epoch,
                   plan.index, streams, w)

    def __iter__(self) -> Iterator[Booked]:
        malloc.tune()  # (in whichever process runs the stream: threads' or loader workers')
        plan, b = self.plan, self.plan.batch_size
        needed = plan.order[self.skip * b:]
        if not len(needed):
            return
        shard_of, pos_of = self.context.layout.locate(plan.ids)
        shards = _OpenShards(self.context, needed, shard_of, pos_of, self.counters)
        items: list[tuple[Any, int, bool, str]] = []  # (sample, id, valid, key) not yet batched
        pending: list[int] = []  # items waiting for the stream's first good sample
        self._last_good, self._reference = None, None
        local_batch = self.skip
        try:
            for first in range(0, len(needed), b):
                chunk = needed[first:first + b]
                sources = shards.open_through(int(shards.run_of[chunk].max()))
                booked = None
                if not items and not pending:
                    booked = (self._gathered(chunk, shards, sources, local_batch)
                              or self._columns(chunk, shards, sources, local_batch))
                if booked is not None:
                    yield booked
                    local_batch += 1
                else:
                    for slot in chunk.tolist():
                        self._add(slot, sources[shards.run_of[slot]], pos_of, items, pending)
                        while not pending and len(items) >= b:
                            yield self._batch(items[:b], local_batch)
                            local_batch += 1
                            del items[:b]
                shards.close_finished(first + len(chunk) - 1)
            if pending:
                raise PipelineDataError(
                    f"no decodable sample in worker stream {self.w} of this rank "
                    f"({', '.join(sorted(self._warned))}): nothing to repeat in place of bad ones")
        finally:
            shards.close()

    # -- one sample at a time -----------------------------------------------------------
    def _add(self, slot: int, source: ShardSamples | CachedShard, pos_of: np.ndarray,
             items: list, pending: list[int]) -> None:
        plan = self.plan
        sample, key, bad = self._sample(source, int(pos_of[slot]))
        sample_id, valid = int(plan.ids[slot]), bool(plan.valid[slot])
        if not valid:
            self.counters.counts["padded"] += 1
        if bad is not None:
            self._bad(bad)
            if self._last_good is None:
                pending.append(len(items))
                items.append((None, sample_id, False, ""))
            else:
                items.append((self._last_good[0], sample_id, False, self._last_good[1]))
            return
        if self._last_good is None:
            self._reference = set(sample)
            for i in pending:
                items[i] = (sample, items[i][1], False, key)
            pending.clear()
        self._last_good = (sample, key)
        items.append((sample, sample_id, valid, key))

    def _sample(self, source: ShardSamples | CachedShard, position: int
                ) -> tuple[dict[str, Any] | None, str, BadSample | None]:
        decoder = self.context.decoder
        if isinstance(source, CachedShard):
            key = source.keys[position]
            self.counters.counts["cached_samples"] += 1
            try:
                sample = decoder.finish(source.sample(position))
            except Exception as e:  # the user's transform failed
                return None, key, BadSample(source.url, position, key, f"cannot decode ({e})")
        else:
            raw = source.get(position)
            if isinstance(raw, BadSample):
                return None, "", raw
            self.counters.counts["samples_read"] += 1
            key = raw["__key__"]
            try:
                sample = decoder.finish(decoder.base(raw))
            except Exception as e:  # undecodable content, or the user's decode/transform
                return None, key, BadSample(source.url, position, key, f"cannot decode ({e})")
        reference = self._reference
        if reference is not None and set(sample) != reference:
            return None, key, BadSample(source.url, position, key,
                                        f"has fields {sorted(sample)}, expected {sorted(reference)}")
        return sample, key, None

    def _bad(self, bad: BadSample) -> None:
        if self.context.on_error == "fail":
            raise PipelineDataError(bad.describe())
        self.counters.counts["skipped"] += 1
        self.counters.skipped_by_shard[bad.url] += 1
        if bad.url not in self._warned:
            self._warned.add(bad.url)
            log.warning("skipping bad data (on_error='skip'; repeats a good sample in its "
                        "place, __valid__=False): %s", bad.describe())

    def _batch(self, items: list[tuple[Any, int, bool, str]], local_batch: int) -> Booked:
        batch = self.context.decoder.finish_batch(collate([s for s, _, _, _ in items]))
        return self._booked(batch, [k for _, _, _, k in items],
                            np.array([i for _, i, _, _ in items], dtype=np.int64),
                            np.array([v for _, _, v, _ in items], dtype=bool), local_batch)

    # -- a whole batch from the decoded cache -------------------------------------------
    def _gathered(self, chunk: np.ndarray, shards: _OpenShards, sources: dict[int, Any],
                  local_batch: int) -> Booked | None:
        """The batch of `chunk` gathered from decoded-cache entries, or None when one of its
        shards has none (or a transform must see every sample)."""
        if len(chunk) < self.plan.batch_size or self.context.decoder.transform is not None:
            return None
        runs = shards.run_of[chunk]
        used = np.unique(runs).tolist()
        entries = [sources[r] for r in used]
        if not all(isinstance(e, CachedShard) for e in entries):
            return None
        layout = entries[0].layout
        if any(e.layout != layout for e in entries) or (
                self._reference is not None and set(layout) != self._reference):
            return None
        positions = shards.pos_of[chunk]
        arrays, keys = gather(entries, positions, np.searchsorted(used, runs))
        valid = self.plan.valid[chunk]
        self.counters.counts["padded"] += int(len(valid) - valid.sum())
        self.counters.counts["cached_samples"] += len(chunk)
        if self._reference is None:
            self._reference = set(layout)
        last = entries[used.index(int(runs[-1]))]
        self._last_good = (self.context.decoder.finish(last.sample(int(positions[-1]))), keys[-1])
        batch = self.context.decoder.finish_batch(arrays)
        return self._booked(batch, keys, self.plan.ids[chunk], valid, local_batch)

    # -- a whole batch of indexed reads, field by field ------------------------------------
    def _columns(self, chunk: np.ndarray, shards: _OpenShards, sources: dict[int, Any],
                 local_batch: int) -> Booked | None:
        """The batch of `chunk` read from indexed shards and decoded one field at a time, with
        no per-sample dict past the read; None (the caller goes sample by sample, which
        handles bad data) when a sample is unreadable, undecodable or has other fields, or a
        transform or the user's decode must see every sample."""
        decoder = self.context.decoder
        if len(chunk) < self.plan.batch_size or decoder.transform is not None \
                or decoder.decode is not None:
            return None
        runs, positions = shards.run_of[chunk].tolist(), shards.pos_of[chunk].tolist()
        raws: list[Any] = []
        i = 0
        while i < len(runs):  # stretches of the batch from one shard: read together
            j = i + 1
            while j < len(runs) and runs[j] == runs[i]:
                j += 1
            source = sources[runs[i]]
            if type(source) is not IndexedSamples:
                return None
            raws.extend(source.get_many(positions[i:j]))
            i = j
        if any(type(raw) is BadSample for raw in raws):
            return None
        try:
            columns = decoder.columns(raws)
        except Exception:  # the sample-by-sample path names the bad sample
            return None
        if columns is None or (self._reference is not None
                               and set(columns) != self._reference):
            return None
        self._reference = set(columns)
        keys = [raw["__key__"] for raw in raws]
        self._last_good = ({name: values[-1] for name, values in columns.items()}, keys[-1])
        self.counters.counts["samples_read"] += len(raws)
        valid = self.plan.valid[chunk]
        self.counters.counts["padded"] += int(len(valid) - valid.sum())
        batch = decoder.finish_batch({name: stack(values) for name, values in columns.items()})
        return self._booked(batch, keys, self.plan.ids[chunk], valid, local_batch)

    def _booked(self, batch: dict[str, Any], keys: list[str], index: np.ndarray,
                valid: np.ndarray, local_batch: int) -> Booked:
        batch["__key__"] = keys
        batch["__index__"] = np.asarray(index, dtype=np.int64)
        batch["__valid__"] = np.asarray(valid, dtype=bool)
        return Booked(batch, (self.epoch, self.segment, local_batch * self.streams + self.w),
                      self.counters.take())


class _OpenShards:
    """The shards one stream reads, opened in order of first need and closed after last use.

    Slots are grouped in *runs*: maximal stretches of needed slots in one shard, in read order
    (a shard may appear in more than one run after a resume reordered the epoch)."""

    def __init__(self, context: StreamContext, needed: np.ndarray, shard_of: np.ndarray,
                 pos_of: np.ndarray, counters: StreamCounters) -> None:
        self.context, self.counters, self.pos_of = context, counters, pos_of
        self.run_shard, self.run_of, self._slots, self._bounds = _runs(needed, shard_of, pos_of)
        # the emission index (within `needed`) of each run's last slot
        self.last_use = np.full(len(self.run_shard), -1, dtype=np.int64)
        np.maximum.at(self.last_use, self.run_of[needed], np.arange(len(needed)))
        # Whether a run's decoded-cache entry exists is looked up when the read reaches it
        # (by the prefetcher, ahead, or by the stream), not for every run up front: a rank's
        # share of a 10^6-shard epoch on few ranks is 10^5+ runs (a stat and a hash each).
        self.entry_paths: dict[int, Any] = {}
        self.cached = np.zeros(len(self.run_shard), dtype=bool)
        self._decided = 0
        self._decide_lock = threading.Lock()
        refs = context.refs
        all_local = getattr(refs, "all_local", None)
        if all_local is None:  # a list of ShardRefs (made from URLs): they exist already
            all_local = all(refs[int(s)].is_local for s in np.unique(self.run_shard))
        self.prefetcher = Prefetcher(context.cache, self._to_fetch(), context.prefetch,
                                     remote=not all_local)
        self._handles = iter(self.prefetcher)
        self.open: dict[int, Any] = {}
        self._next = 0

    def _decide_through(self, run: int) -> None:
        """Look up the entries of every run up to `run`, in order (from the stream's thread or
        the prefetcher's: the first to get there does it)."""
        with self._decide_lock:
            decoded, refs = self.context.decoded, self.context.refs
            while self._decided <= run:
                r = self._decided
                path = None
                if decoded is not None:
                    ref = refs[int(self.run_shard[r])]
                    identity = shard_identity(ref)
                    path = decoded.path(identity, ref.url) if identity else None
                self.entry_paths[r] = path
                # a run whose entry exists is not fetched ahead (a remote one not downloaded)
                self.cached[r] = path is not None and path.exists()
                self._decided += 1

    def _to_fetch(self) -> Iterator[ShardRef]:
        """The shards of the runs without a decoded entry, in read order (the prefetcher's
        input: handles come back in this order, one per such run)."""
        for r in range(len(self.run_shard)):
            self._decide_through(r)
            if not self.cached[r]:
                yield self.context.refs[int(self.run_shard[r])]

    def open_through(self, run: int) -> dict[int, Any]:
        """Open every run up to `run` (in order: the prefetcher hands shards out in order)."""
        while self._next <= run:
            self.open[self._next] = self._open(self._next)
            self._next += 1
        return self.open

    def close_finished(self, emitted: int) -> None:
        for r in [r for r in self.open if self.last_use[r] <= emitted]:
            self._close(self.open.pop(r))

    def close(self) -> None:
        for source in self.open.values():
            self._close(source)
        self.open.clear()
        self.prefetcher.close()

    def _close(self, source: Any) -> None:
        if not isinstance(source, CachedShard):
            self.counters.counts["bytes_read"] += source.bytes_read
        source.close()

    def _open(self, r: int) -> ShardSamples | CachedShard:
        context, counts = self.context, self.counters.counts
        self._decide_through(r)
        slots = self._slots[self._bounds[r]:self._bounds[r + 1]]
        ref, path = context.refs[int(self.run_shard[r])], self.entry_paths.pop(r)
        counts["shards_opened"] += 1
        if self.cached[r]:
            entry = context.decoded.open(path)
            if entry is not None and entry.num_samples == ref.num_samples:
                entry.url = ref.url
                counts["decoded_hits"] += 1
                return entry
            if entry is not None:
                entry.close()
            handle = context.cache.open(ref)  # evicted meanwhile: read the shard
        else:
            handle = next(self._handles)
        if not ref.is_local:
            counts["cache_hits" if handle.cache_hit else "cache_misses"] += 1
            counts["bytes_downloaded"] += handle.downloaded
        samples = open_samples(handle, context.indexes, set(self.pos_of[slots].tolist()))
        if path is not None and isinstance(samples, IndexedSamples):
            entry = self._fill(path, samples, ref)
            if entry is not None:
                counts["bytes_read"] += samples.bytes_read
                samples.handle.close()
                entry.url = ref.url
                return entry
        return samples

    def _fill(self, path: Any, samples: IndexedSamples, ref: ShardRef) -> CachedShard | None:
        """Decode the whole shard into a new decoded-cache entry (None: another process is
        writing it, or the shard cannot be cached: then it is read as it is)."""
        writer = self.context.decoded.writer(path, ref.num_samples)
        if writer is None:
            return None
        decoder = self.context.decoder
        try:
            for lo in range(0, ref.num_samples, FILL_ROWS):
                raws = samples.get_many(list(range(lo, min(lo + FILL_ROWS, ref.num_samples))))
                bad = next((r for r in raws if type(r) is BadSample), None)
                if bad is not None:
                    raise Uncacheable(bad.reason)
                columns = decoder.columns(raws)
                if columns is None:  # (mixed image formats) sample by sample
                    decoded = [decoder.base(raw) for raw in raws]
                    columns = {name: [d.get(name) for d in decoded] for name in decoded[0]}
                writer.add([raw["__key__"] for raw in raws], columns)
        except Exception:  # Uncacheable, undecodable data: read the shard as it is
            writer.abort()
            return None
        self.counters.counts["decoded_writes"] += 1
        return writer.finish()


def _runs(needed: np.ndarray, shard_of: np.ndarray, pos_of: np.ndarray
          ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Maximal stretches of slots in one shard with rising positions that hold at least one
    needed slot, in read order: (each run's shard, each slot's run or -1 where not needed,
    the needed slots in slot order, bounds: run r's needed slots are slots[bounds[r]:
    bounds[r + 1]]). Vectorised: a rank's share of an epoch may be 10^5+ runs."""
    n = len(shard_of)
    is_new = np.ones(n, dtype=bool)
    is_new[1:] = (shard_of[1:] != shard_of[:-1]) | (pos_of[1:] <= pos_of[:-1])
    stretch = np.cumsum(is_new) - 1
    slots = np.sort(needed)
    used = np.zeros(int(stretch[-1]) + 1 if n else 0, dtype=bool)
    used[stretch[slots]] = True
    run_of_stretch = np.cumsum(used) - 1
    run_shard = shard_of[np.flatnonzero(is_new)[used]].astype(np.int64)
    run_of = np.full(n, -1, dtype=np.int64)
    run_of[slots] = run_of_stretch[stretch[slots]]
    bounds = np.searchsorted(run_of[slots], np.arange(len(run_shard) + 1))
    return run_shard, run_of, slots, bounds

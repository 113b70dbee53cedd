"""The open stage of a worker stream: the shards of its read plan's runs, opened in read order
(prefetched through the shard cache; a compressed shard as its plain copy there, when shards are
read indexed) and closed after their last use. A run whose shard has a
decoded-cache entry opens that entry instead of the shard; an indexed shard without one is
decoded whole into a new entry as it opens (`fill_decoded`), so later passes gather from it.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from ringfeed.pipeline.cache import Prefetcher
from ringfeed.pipeline.decode import Decoder
from ringfeed.pipeline.decoded_cache import CachedShard, DamagedEntry, DecodedStore, Uncacheable
from ringfeed.pipeline.readplan import ReadPlan
from ringfeed.pipeline.shardread import (
    BadSample,
    IndexedSamples,
    ShardSamples,
    open_samples,
    shard_identity,
)
from ringfeed.pipeline.source import ShardRef
from ringfeed.pipeline.stats import StreamCounters

log = logging.getLogger("ringfeed.pipeline")

FILL_ROWS = 256  # samples decoded and written per step while filling a decoded-cache entry

Source = ShardSamples | CachedShard  # what a run opens as


class DecodedLookup:
    """Each run's decoded-cache entry path and whether it exists, looked up when the read
    reaches the run (by the prefetcher, ahead, or by the stream: the first to get there does
    it), not for every run up front: a rank's share of a 10^6-shard epoch on few ranks is 10^5+
    runs, a stat and a hash each."""

    def __init__(self, store: DecodedStore | None, refs: Any, run_shard: np.ndarray) -> None:
        self.store, self.refs, self.run_shard = store, refs, run_shard
        self.paths: dict[int, Path | None] = {}
        self.cached = np.zeros(len(run_shard), dtype=bool)
        self._decided = 0
        self._lock = threading.Lock()

    def decide_through(self, run: int) -> None:
        with self._lock:
            while self._decided <= run:
                r = self._decided
                path = None
                if self.store is not None:
                    ref = self.refs[int(self.run_shard[r])]
                    identity = shard_identity(ref)
                    path = self.store.path(identity, ref.url) if identity else None
                self.paths[r] = path
                # a run whose entry exists is not fetched ahead (a remote one not downloaded)
                self.cached[r] = path is not None and path.exists()
                self._decided += 1


class ShardOpener:
    """`open_through(run)` opens every run up to `run`, in order; `close_finished(i)` closes
    the runs whose last slot was emission index `i` or before."""

    def __init__(self, context: Any, reads: ReadPlan, counters: StreamCounters) -> None:
        self.context, self.reads, self.counters = context, reads, counters
        self.lookup = DecodedLookup(context.decoded, context.refs, reads.run_shard)
        refs = context.refs
        all_local = getattr(refs, "all_local", None)
        if all_local is None:  # a list of ShardRefs (made from URLs): they exist already
            all_local = all(refs[int(s)].is_local for s in np.unique(reads.run_shard))
        indexes = context.indexes
        self.prefetcher = Prefetcher(context.cache, self._to_fetch(), context.prefetch,
                                     remote=not all_local, plain=indexes is not None,
                                     also=indexes.fetch_sidecar if indexes is not None else None)
        self._handles = iter(self.prefetcher)
        self.open: dict[int, Source] = {}
        self._next = 0

    def _to_fetch(self) -> Iterator[ShardRef]:
        """The shards of the runs without a decoded entry, in read order (the prefetcher's
        input: handles come back in this order, one per such run)."""
        for r in range(len(self.reads.run_shard)):
            self.lookup.decide_through(r)
            if not self.lookup.cached[r]:
                yield self.context.refs[int(self.reads.run_shard[r])]

    def open_through(self, run: int, while_waiting: Callable[[dict[int, Source], int], bool]
                     | None = None) -> dict[int, Source]:
        """`while_waiting(open, next run)`: called while the next run's shard is still
        downloading, until it returns False (nothing more to do) or the shard is here."""
        while self._next <= run:
            if while_waiting is not None:
                while not self._ready(self._next) and while_waiting(self.open, self._next):
                    pass
            self.open[self._next] = self._open(self._next)
            self._next += 1
        return self.open

    def _ready(self, run: int) -> bool:
        self.lookup.decide_through(run)
        return bool(self.lookup.cached[run]) or self.prefetcher.ready()

    def close_finished(self, emitted: int) -> None:
        last_use = self.reads.last_use
        for r in [r for r in self.open if last_use[r] <= emitted]:
            self._close(self.open.pop(r))

    def close(self) -> None:
        for source in self.open.values():
            self._close(source)
        self.open.clear()
        self.prefetcher.close()

    def _close(self, source: Source) -> None:
        if not isinstance(source, CachedShard):
            self.counters.counts["bytes_read"] += source.bytes_read
        source.close()

    def _open(self, r: int) -> Source:
        context, counts, lookup = self.context, self.counters.counts, self.lookup
        lookup.decide_through(r)
        ref, path = context.refs[int(self.reads.run_shard[r])], lookup.paths.pop(r)
        counts["shards_opened"] += 1
        if lookup.cached[r]:
            try:
                entry = context.decoded.open(path)
            except DamagedEntry as e:  # removed: read the shard and write the entry again
                entry = None
                counts["decoded_damaged"] += 1
                log.warning("decoded cache: %s; removed, reading %s and caching it again", e,
                            ref.url)
            if entry is not None and entry.num_samples == ref.num_samples:
                entry.url = ref.url
                counts["decoded_hits"] += 1
                return entry
            if entry is not None:
                entry.close()
            # evicted meanwhile or damaged: read the shard
            handle = context.cache.open(ref, plain=context.indexes is not None)
        else:
            handle = next(self._handles)
        if not ref.is_local:
            counts["cache_hits" if handle.cache_hit else "cache_misses"] += 1
            counts["bytes_downloaded"] += handle.downloaded
            if handle.storage is not None:
                counts.update(handle.storage.as_counts())
        samples = open_samples(handle, context.indexes, self.reads.run_positions(r))
        if path is not None and isinstance(samples, IndexedSamples):
            entry = fill_decoded(context.decoded, path, samples, ref, context.decoder,
                                 self.counters)
            if entry is not None:
                counts["bytes_read"] += samples.bytes_read
                samples.handle.close()
                entry.url = ref.url
                return entry
        return samples


def fill_decoded(store: DecodedStore, path: Path, samples: IndexedSamples, ref: ShardRef,
                 decoder: Decoder, counters: StreamCounters) -> CachedShard | None:
    """Decode the whole shard into a new decoded-cache entry (None: another process is writing
    it, or the shard cannot be cached: then it is read as it is)."""
    writer = store.writer(path, ref.num_samples)
    if writer is None:
        return None
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
    counters.counts["decoded_writes"] += 1
    return writer.finish()

"""One worker stream: read the planned slots of a worker, shuffle, decode, batch.

The emission order is fixed by the plan (`WorkerPlan.order`), so reading just follows it:
shards are opened in slot order (prefetched through the cache), raw samples are held until
their turn (at most the shuffle buffer's worth) and decoded as they are emitted. Resuming
skips the first batches: shards none of whose remaining slots are needed are never opened,
and samples that were already consumed are read past but not decoded.

Bad data never changes the batch count (ranks must agree on it): under `skip` a bad sample, or
the rest of a corrupt shard, is replaced by a repeat of the stream's latest good sample
(flagged `__valid__ = False`), counted, and warned about once per shard; under `fail` it raises
PipelineDataError naming the shard URL and the sample key.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from pipeline.cache import Prefetcher, ShardCache
from pipeline.decode import Decoder
from pipeline.errors import PipelineDataError
from pipeline.plan import Layout, SegmentPlan, WorkerPlan, consumed_by_worker
from pipeline.reader import BadSample, read_positions
from pipeline.source import ShardRef
from pipeline.stats import StreamCounters

log = logging.getLogger("ringfeed.pipeline")

ON_ERROR_POLICIES = ("skip", "fail")


@dataclass
class StreamSpec:
    """Everything a worker stream needs; picklable, so DataLoader workers can get it."""

    refs: list[ShardRef]
    layout: Layout
    decoder: Decoder
    cache: ShardCache
    on_error: str
    prefetch: int


def collate(samples: list[dict[str, Any]]) -> dict[str, Any]:
    """Field -> stacked array when every value is an array of one shape/dtype or a number;
    otherwise a list (strings, dicts, bytes, ragged arrays)."""
    out: dict[str, Any] = {}
    for name in samples[0]:
        values = [s[name] for s in samples]
        out[name] = stack(values)
    return out


def stack(values: list[Any]) -> Any:
    first = values[0]
    if isinstance(first, np.ndarray):
        if all(isinstance(v, np.ndarray) and v.shape == first.shape and v.dtype == first.dtype
               for v in values):
            return np.stack(values)
        return values
    if isinstance(first, (bool, np.bool_)):
        if all(isinstance(v, (bool, np.bool_)) for v in values):
            return np.array(values, dtype=bool)
    elif isinstance(first, (int, np.integer)):
        if all(isinstance(v, (int, np.integer)) and not isinstance(v, bool) for v in values):
            return np.array(values, dtype=np.int64)
    elif isinstance(first, (float, np.floating)):
        if all(isinstance(v, (float, int, np.number)) and not isinstance(v, bool)
               for v in values):
            return np.array(values)
    return values


class WorkerStream:
    """Iterating yields the worker's batches from local batch `skip` on; each batch carries
    `__batch__` = [epoch, segment, rank batch index] and `__stats__` (counter increments)."""

    def __init__(self, spec: StreamSpec, plan: WorkerPlan, skip: int, epoch: int, segment: int,
                 streams: int, w: int) -> None:
        self.spec, self.plan, self.skip = spec, plan, skip
        self.tag = (epoch, segment)
        self.streams, self.w = streams, w
        self.counters = StreamCounters()
        self._warned: set[str] = set()

    @classmethod
    def resuming(cls, spec: StreamSpec, plan: SegmentPlan, rank: int, w: int, t0: int
                 ) -> WorkerStream:
        """Worker stream `w` of `rank`, after the rank's first `t0` batches of the segment."""
        streams = plan.config.streams
        return cls(spec, plan.worker(rank, w), consumed_by_worker(t0, streams, w), plan.epoch,
                   plan.index, streams, w)

    def __iter__(self) -> Iterator[dict[str, Any]]:
        plan, b = self.plan, self.plan.batch_size
        start = self.skip * b
        order = plan.order
        if start >= len(order):
            return
        shard_of, pos_of = self.spec.layout.locate(plan.ids)
        reader = self._read(self._runs(order[start:], shard_of, pos_of))
        held: dict[int, Any] = {}
        items: list[tuple[Any, int, bool, str]] = []  # (sample, id, valid, key) not yet batched
        pending: list[int] = []  # items waiting for the stream's first good sample
        last_good: tuple[dict, str] | None = None
        reference_fields: set[str] | None = None
        local_batch = self.skip
        try:
            for t in range(start, len(order)):
                slot = int(order[t])
                while slot not in held:
                    got_slot, raw = next(reader)
                    held[got_slot] = raw
                raw = held.pop(slot)
                url = self.spec.refs[int(shard_of[slot])].url
                sample, bad = self._decode(raw, url, int(pos_of[slot]), reference_fields)
                sample_id, valid = int(plan.ids[slot]), bool(plan.valid[slot])
                if not valid:
                    self.counters.counts["padded"] += 1
                if bad is not None:
                    self._bad(bad)
                    if last_good is None:
                        pending.append(len(items))
                        items.append((None, sample_id, False, ""))
                    else:
                        items.append((last_good[0], sample_id, False, last_good[1]))
                else:
                    key = raw["__key__"]
                    if last_good is None:
                        reference_fields = set(sample)
                        for i in pending:
                            items[i] = (sample, items[i][1], False, key)
                        pending.clear()
                    last_good = (sample, key)
                    items.append((sample, sample_id, valid, key))
                while not pending and len(items) >= b:
                    yield self._batch(items[:b], local_batch)
                    local_batch += 1
                    del items[:b]
            if pending:
                raise PipelineDataError(
                    f"no decodable sample in worker stream {self.w} of this rank "
                    f"({', '.join(sorted(self._warned))}): nothing to repeat in place of bad ones")
        finally:
            reader.close()

    # -- reading ------------------------------------------------------------------------
    def _runs(self, needed_order: np.ndarray, shard_of: np.ndarray, pos_of: np.ndarray
              ) -> list[tuple[int, dict[int, int]]]:
        """Maximal stretches of slots in one shard with rising positions, that hold at least
        one needed slot: (shard index, {position: slot}) in read order."""
        needed = np.zeros(len(shard_of), dtype=bool)
        needed[needed_order] = True
        breaks = np.flatnonzero((shard_of[1:] != shard_of[:-1]) | (pos_of[1:] <= pos_of[:-1])) + 1
        bounds = [0, *breaks.tolist(), len(shard_of)]
        runs: list[tuple[int, dict[int, int]]] = []
        for lo, hi in zip(bounds[:-1], bounds[1:], strict=True):
            idx = np.flatnonzero(needed[lo:hi]) + lo
            if len(idx):
                runs.append((int(shard_of[lo]), dict(zip(pos_of[idx].tolist(), idx.tolist(), strict=True))))
        return runs

    def _read(self, runs: list[tuple[int, dict[int, int]]]):
        spec = self.spec
        prefetcher = Prefetcher(spec.cache, [spec.refs[s] for s, _ in runs], spec.prefetch)
        counts = self.counters.counts
        try:
            for (_, wanted), handle in zip(runs, prefetcher, strict=True):
                try:
                    counts["shards_opened"] += 1
                    if not handle.ref.is_local:
                        counts["cache_hits" if handle.cache_hit else "cache_misses"] += 1
                        counts["bytes_downloaded"] += handle.downloaded
                    for item in read_positions(handle, wanted):
                        counts["samples_read"] += 1
                        yield item
                    counts["bytes_read"] += handle.file.tell()
                finally:
                    handle.close()
        finally:
            prefetcher.close()

    # -- decoding and bad data ----------------------------------------------------------
    def _decode(self, raw: Any, url: str, position: int, reference: set[str] | None
                ) -> tuple[dict[str, Any] | None, BadSample | None]:
        if isinstance(raw, BadSample):
            return None, raw
        key = raw.get("__key__")
        try:
            sample = self.spec.decoder(raw)
        except Exception as e:  # undecodable content, or the user's decode/transform failed
            return None, BadSample(url, position, key, f"cannot decode ({e})")
        if reference is not None and set(sample) != reference:
            return None, BadSample(url, position, key,
                                   f"has fields {sorted(sample)}, expected {sorted(reference)}")
        return sample, None

    def _bad(self, bad: BadSample) -> None:
        if self.spec.on_error == "fail":
            raise PipelineDataError(bad.describe())
        self.counters.counts["skipped"] += 1
        self.counters.skipped_by_shard[bad.url] += 1
        if bad.url not in self._warned:
            self._warned.add(bad.url)
            log.warning("skipping bad data (on_error='skip'; repeats a good sample in its "
                        "place, __valid__=False): %s", bad.describe())

    def _batch(self, items: list[tuple[Any, int, bool, str]], local_batch: int) -> dict[str, Any]:
        batch = collate([s for s, _, _, _ in items])
        batch["__key__"] = [k for _, _, _, k in items]
        batch["__index__"] = np.array([i for _, i, _, _ in items], dtype=np.int64)
        batch["__valid__"] = np.array([v for _, _, v, _ in items], dtype=bool)
        batch["__batch__"] = np.array([*self.tag, local_batch * self.streams + self.w],
                                      dtype=np.int64)
        batch["__stats__"] = self.counters.take()
        return batch

"""The read -> decode -> batch stages of a worker stream: three routes from a batch's slots (and
the shards the open stage has open for them) to an assembled batch.

- `DecodedBatches`: every shard of the batch has a decoded-cache entry: one gather from the
  memory-mapped arrays (replaces read and decode);
- `ColumnBatches`: indexed shards, no user hook: the batch read together and decoded one field
  at a time, with no per-sample dict;
- `SampleBatches`: anything else, and the bad-data stage: one sample at a time; a bad sample is
  handled by the `on_error` policy (`skip`: a repeat of the latest good sample in its place,
  `__valid__` False; `fail`: PipelineDataError naming the shard and key).

A route `applies` by looking only at the slots and the open sources; `ColumnBatches.read` can
still meet bad data, and then raises `Fallback` so the batch goes sample by sample (which names
the bad sample). The routes share one `GoodSamples`: the fields every sample must have and the
latest good sample.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any, NamedTuple

import numpy as np

from ringfeed.pipeline.ahead import DecodeAhead
from ringfeed.pipeline.batch import collate, gather, stack
from ringfeed.pipeline.decode import Decoder, UserCodeError
from ringfeed.pipeline.decoded_cache import CachedShard
from ringfeed.pipeline.errors import PipelineDataError
from ringfeed.pipeline.readplan import Chunk, ReadPlan
from ringfeed.pipeline.shardread import BadSample, IndexedSamples
from ringfeed.pipeline.stats import StreamCounters

log = logging.getLogger("ringfeed.pipeline")

Sources = dict[int, Any]  # run -> its open ShardSamples or CachedShard


class Assembled(NamedTuple):
    """A batch before its bookkeeping: the fields (images normalised), and per sample its key,
    global id and validity."""

    fields: dict[str, Any]
    keys: list[str]
    ids: np.ndarray
    valid: np.ndarray


class Fallback(Exception):  # noqa: N818 - a signal between routes, not an error
    """This batch cannot take a whole-batch route after all: read it sample by sample."""


class GoodSamples:
    """The stream's memory of good data: the fields every sample must have (the first good
    sample's) and the latest good sample with its key (what stands in for a bad one)."""

    def __init__(self) -> None:
        self.fields: set[str] | None = None
        self.last: tuple[dict[str, Any], str] | None = None

    def matches(self, fields: Any) -> bool:
        return self.fields is None or set(fields) == self.fields

    def accept(self, sample: dict[str, Any], key: str) -> None:
        if self.fields is None:
            self.fields = set(sample)
        self.last = (sample, key)


class DecodedBatches:
    def __init__(self, decoder: Decoder, reads: ReadPlan, good: GoodSamples,
                 counters: StreamCounters, epoch: int = 0) -> None:
        self.decoder, self.reads, self.good, self.counters = decoder, reads, good, counters
        self.epoch = epoch

    def applies(self, chunk: Chunk, sources: Sources) -> bool:
        """A full batch, no transform (it must see every sample), and all its shards decoded
        entries of one layout that has the stream's fields."""
        if len(chunk.slots) < self.reads.batch_size or self.decoder.transform is not None:
            return False
        entries = [sources[r] for r in chunk.used]
        if not all(isinstance(e, CachedShard) for e in entries):
            return False
        layout = entries[0].layout
        return all(e.layout == layout for e in entries) and self.good.matches(layout)

    def read(self, chunk: Chunk, sources: Sources) -> Assembled:
        reads, counts, used, runs = self.reads, self.counters.counts, chunk.used, chunk.runs
        entries = [sources[r] for r in used]
        positions = reads.pos_of[chunk.slots]
        arrays, keys = gather(entries, positions, np.searchsorted(used, runs))
        decoder = self.decoder
        arrays = decoder.realize_columns(arrays, keys, self.epoch)  # (random augment)
        valid = reads.valid[chunk.slots]
        counts["padded"] += int(len(valid) - valid.sum())
        counts["cached_samples"] += len(chunk.slots)
        last = entries[used.index(int(runs[-1]))]
        sample = decoder.realize(last.sample(int(positions[-1])), keys[-1], self.epoch)
        self.good.accept(decoder.finish(sample), keys[-1])
        return Assembled(decoder.finish_batch(arrays, keys), keys, reads.ids[chunk.slots], valid)


class ColumnBatches:
    @staticmethod
    def decodes(decoder: Decoder) -> bool:
        """Whether `decoder` lets samples be decoded a column at a time: no user decode or
        transform (they must see every sample). DecodeAhead works under the same rule."""
        return decoder.transform is None and decoder.decode is None

    def __init__(self, decoder: Decoder, reads: ReadPlan, good: GoodSamples,
                 counters: StreamCounters, epoch: int = 0, ahead: DecodeAhead | None = None
                 ) -> None:
        self.decoder, self.reads, self.good, self.counters = decoder, reads, good, counters
        self.epoch, self.ahead = epoch, ahead

    def applies(self, chunk: Chunk, sources: Sources) -> bool:
        """A full batch from indexed shards, and `decodes(decoder)`."""
        if len(chunk.slots) < self.reads.batch_size or not self.decodes(self.decoder):
            return False
        return all(type(sources[r]) is IndexedSamples for r in chunk.used)

    def read(self, chunk: Chunk, sources: Sources) -> Assembled:
        """The samples decoded ahead, and the rest read and decoded now. Raises Fallback when
        a sample is unreadable, undecodable or has other fields."""
        reads = self.reads
        early = self.ahead.take(chunk.slots) if self.ahead is not None else {}
        rest = [i for i, slot in enumerate(chunk.slots.tolist()) if slot not in early]
        runs = chunk.runs[rest].tolist()
        positions = reads.pos_of[chunk.slots[rest]].tolist()
        raws: list[Any] = []
        i = 0
        while i < len(runs):  # stretches of the batch from one shard: read together
            j = i + 1
            while j < len(runs) and runs[j] == runs[i]:
                j += 1
            raws.extend(sources[runs[i]].get_many(positions[i:j]))
            i = j
        if any(type(raw) is BadSample for raw in raws):
            raise Fallback
        try:
            columns = self.decoder.columns(raws, self.epoch) if raws else {}
        except Exception:  # the sample-by-sample route names the bad sample
            raise Fallback from None
        if columns is None:
            raise Fallback
        keys = [raw["__key__"] for raw in raws]
        if early:
            columns, keys = _merged(chunk, early, rest, columns, keys)
            self.counters.counts["decoded_ahead"] += len(early)
        if not self.good.matches(columns):
            raise Fallback
        self.good.accept({name: values[-1] for name, values in columns.items()}, keys[-1])
        self.counters.counts["samples_read"] += len(chunk.slots)
        valid = reads.valid[chunk.slots]
        self.counters.counts["padded"] += int(len(valid) - valid.sum())
        fields = self.decoder.finish_batch({name: stack(v) for name, v in columns.items()},
                                           keys)
        return Assembled(fields, keys, reads.ids[chunk.slots], valid)


def _merged(chunk: Chunk, early: dict[int, tuple[str, dict[str, Any]]], rest: list[int],
            columns: dict[str, list[Any]], keys: list[str]
            ) -> tuple[dict[str, list[Any]], list[str]]:
    """A batch's columns and keys in slot order, from the samples decoded ahead (`early`) and
    those decoded now (rows `rest` of the batch); Fallback when their fields differ."""
    names = set(next(iter(early.values()))[1])
    if (rest and set(columns) != names) or any(set(f) != names for _, f in early.values()):
        raise Fallback
    n = len(chunk.slots)
    merged: dict[str, list[Any]] = {name: [None] * n for name in names}
    all_keys = [""] * n
    for i, slot in enumerate(chunk.slots.tolist()):
        if slot in early:
            all_keys[i], fields = early[slot]
            for name in names:
                merged[name][i] = fields[name]
    for k, i in enumerate(rest):
        all_keys[i] = keys[k]
        for name in names:
            merged[name][i] = columns[name][k]
    return merged, all_keys


class SampleBatches:
    """Samples read, decoded and checked one at a time, batched as they come. Until the stream
    has its first good sample, slots whose sample was bad wait (`pending`) for a good one to
    stand in for them; so batches come out of `add` in the plan's order but not necessarily one
    per chunk."""

    def __init__(self, decoder: Decoder, reads: ReadPlan, good: GoodSamples,
                 counters: StreamCounters, on_error: str, stream_name: str,
                 epoch: int = 0) -> None:
        self.decoder, self.reads, self.good, self.counters = decoder, reads, good, counters
        self.on_error, self.stream_name, self.epoch = on_error, stream_name, epoch
        self.items: list[tuple[Any, int, bool, str]] = []  # (sample, id, valid, key) unbatched
        self.pending: list[int] = []  # items waiting for the stream's first good sample
        self.warned: set[str] = set()  # shards already warned about

    @property
    def idle(self) -> bool:
        """Nothing held back: the next batch may take another route."""
        return not self.items and not self.pending

    def add(self, chunk: Chunk, sources: Sources) -> Iterator[Assembled]:
        """Read `chunk`'s samples, yielding each batch as it completes."""
        b = self.reads.batch_size
        for slot, run in zip(chunk.slots.tolist(), chunk.runs.tolist(), strict=True):
            self._add(slot, sources[run])
            while not self.pending and len(self.items) >= b:
                yield self._assemble(self.items[:b])
                del self.items[:b]

    def finish(self) -> None:
        """The stream's end: slots still pending never got a good sample to repeat."""
        if self.pending:
            raise PipelineDataError(
                f"no decodable sample in {self.stream_name} "
                f"({', '.join(sorted(self.warned))}): nothing to repeat in place of bad ones")

    def _add(self, slot: int, source: Any) -> None:
        reads, items = self.reads, self.items
        sample, key, bad = self._sample(source, int(reads.pos_of[slot]))
        sample_id, valid = int(reads.ids[slot]), bool(reads.valid[slot])
        if not valid:
            self.counters.counts["padded"] += 1
        if bad is not None:
            self._bad(bad)
            if self.good.last is None:
                self.pending.append(len(items))
                items.append((None, sample_id, False, ""))
            else:
                items.append((self.good.last[0], sample_id, False, self.good.last[1]))
            return
        if self.good.last is None:
            for i in self.pending:
                items[i] = (sample, items[i][1], False, key)
            self.pending.clear()
        self.good.accept(sample, key)
        items.append((sample, sample_id, valid, key))

    def _sample(self, source: Any, position: int
                ) -> tuple[dict[str, Any] | None, str, BadSample | None]:
        decoder = self.decoder
        if isinstance(source, CachedShard):
            key = source.keys[position]
            self.counters.counts["cached_samples"] += 1
            try:
                sample = decoder.finish(decoder.realize(source.sample(position), key,
                                                        self.epoch))
            except UserCodeError as e:  # the user's transform: their error, not bad data
                raise e.error from None
        else:
            raw = source.get(position)
            if isinstance(raw, BadSample):
                return None, "", raw
            self.counters.counts["samples_read"] += 1
            key = raw["__key__"]
            try:
                sample = decoder.finish(decoder.base(raw, self.epoch))
            except UserCodeError as e:  # the user's decode/transform: not bad data
                raise e.error from None
            except Exception as e:  # undecodable content
                return None, key, BadSample(source.url, position, key, f"cannot decode ({e})")
        if not self.good.matches(sample):
            return None, key, BadSample(source.url, position, key, f"has fields {sorted(sample)}, "
                                        f"expected {sorted(self.good.fields or ())}")
        return sample, key, None

    def _bad(self, bad: BadSample) -> None:
        if self.on_error == "fail":
            raise PipelineDataError(bad.describe())
        self.counters.counts["skipped"] += 1
        self.counters.skipped_by_shard[bad.url] += 1
        if bad.url not in self.warned:
            self.warned.add(bad.url)
            log.warning("skipping bad data (on_error='skip'; repeats a good sample in its "
                        "place, __valid__=False): %s", bad.describe())

    def _assemble(self, items: list[tuple[Any, int, bool, str]]) -> Assembled:
        keys = [k for _, _, _, k in items]
        fields = self.decoder.finish_batch(collate([s for s, _, _, _ in items]), keys)
        return Assembled(fields, keys,
                         np.array([i for _, i, _, _ in items], dtype=np.int64),
                         np.array([v for _, _, v, _ in items], dtype=bool))

"""`ShardPipeline`: shards -> cache -> balanced, shuffled, decoded, resumable batches.

See pipeline/README.md for the guarantees (balance, determinism, exact and cross-world-size
resume) and plan.py for the arithmetic behind them.
"""

from __future__ import annotations

import os
import shutil
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from ringfeed.formats.manifest import Manifest
from ringfeed.pipeline.augment import eval_resize, parse_augment
from ringfeed.pipeline.background import BackgroundIterator
from ringfeed.pipeline.batch import collate
from ringfeed.pipeline.cache import ShardCache
from ringfeed.pipeline.canonical import RankStreams, canonical_config, leave_out_for, load_skip
from ringfeed.pipeline.config import PipelineConfig, pipeline_config
from ringfeed.pipeline.decode import Decoder, UserCodeError, as_pair
from ringfeed.pipeline.decoded_cache import DecodedStore, layout_of
from ringfeed.pipeline.errors import PipelineDataError, PipelineError
from ringfeed.pipeline.mixture import (
    ConcatRefs,
    Mixture,
    WeightedSource,
    as_mixture,
    check_weights,
    mixture_of,
    source_names,
)
from ringfeed.pipeline.plan import Layout, SegmentConfig, SegmentPlan
from ringfeed.pipeline.shardread import (
    COMPRESSED_SUFFIXES,
    BadSample,
    IndexStore,
    iter_samples,
    open_samples,
)
from ringfeed.pipeline.source import (
    ShardRef,
    check_pipe_allowed,
    expand_urls,
    is_shard_list,
    manifest_refs,
    sample_counts,
    windowed,
)
from ringfeed.pipeline.state import PipelineState
from ringfeed.pipeline.stats import PipelineStats
from ringfeed.pipeline.stream import Booked, StreamContext
from ringfeed.remote import RetryPolicy
from ringfeed.userhooks import load_callable

# decoded_cache="auto" turns the cache on when the split's decoded samples fit cache_limit,
# or, with no limit, this share of the free space where the cache lives (also the decoded
# cache's bound when there is no cache_limit)
AUTO_FREE_SHARE = 0.5
_HOROVOD_MODULES = ("horovod.torch", "horovod.tensorflow", "horovod.tensorflow.keras",
                    "horovod.keras")


def horovod_rank_and_size() -> tuple[int, int]:
    """(rank, size) from an initialized Horovod already imported by the caller, else (0, 1).
    Never imports Horovod (or torch/TF) itself."""
    for name in _HOROVOD_MODULES:
        hvd = sys.modules.get(name)
        if hvd is None:
            continue
        try:
            if hvd.is_initialized():
                return int(hvd.rank()), int(hvd.size())
        except (AttributeError, ValueError, RuntimeError):
            continue
    return 0, 1


def resolve_rank(rank: int | None, world_size: int | None) -> tuple[int, int]:
    """(rank, world_size) as given, the missing ones Horovod's (if initialised) or 0 of 1."""
    if rank is None or world_size is None:
        hvd_rank, hvd_size = horovod_rank_and_size()
        rank = hvd_rank if rank is None else rank
        world_size = hvd_size if world_size is None else world_size
    if not 0 <= rank < world_size:
        raise PipelineError(f"rank {rank} is not in [0, world_size={world_size})")
    return int(rank), int(world_size)


def check_decode_device(device: str) -> None:
    """decode_device="cuda" needs nvJPEG through torch: one PipelineError line if it is not
    there."""
    if device != "cuda":
        return
    from ringfeed.pipeline.gpu_decode import check_available

    try:
        check_available(device)
    except (ValueError, ImportError, RuntimeError) as e:
        raise PipelineError(str(e)) from None


def make_decoder(c: PipelineConfig, kinds: dict[str, str]) -> Decoder:
    """The decoder `c` describes, over the sources' field `kinds` (c.fields over them)."""
    kinds = {**kinds, **(c.fields or {})}
    hooks = {name: load_callable(fn, name) if isinstance(fn, str) else fn
             for name, fn in (("decode", c.decode), ("transform", c.transform))}
    size = as_pair(c.image_size)
    augment = parse_augment(c.augment, size, normalize=c.normalize)
    # one rule: colour whenever augmenting (photos: ImageNet's grey, CMYK and PNG files too)
    channels = c.channels or (3 if augment is not None else None)
    source_side = c.cache_short_side or (eval_resize(size) if size is not None else None)
    return Decoder(kinds, size, c.normalize, hooks["decode"], hooks["transform"],
                   decode_images=c.decode_device == "cpu", threads=c.decode_threads,
                   augment=augment, seed=c.seed, channels=channels, source_side=source_side)


def position_of(c: PipelineConfig, layout: Layout, mixture: Mixture | None, rank: int,
                world_size: int) -> tuple[PipelineState, RankStreams]:
    """The plan's state (epoch, segments, what each rank consumed) and this rank's loader
    streams, in the order `c.order` says: rank (the plan's segments at this world size and
    worker count) or global (the canonical streams dealt over the ranks); either way a skip
    list's ids left out (canonical.py says how)."""
    skip = load_skip(c.skip, layout.num_samples)
    if c.order == "global":
        config = canonical_config(c, world_size)
        return (PipelineState(layout, c.seed, c.shuffle, config, mixture, "global",
                              leave_out_for(skip, mixture)),
                RankStreams(rank, world_size, c.num_workers, "global", skip))
    config = SegmentConfig(world_size, c.num_workers, c.batch_size,
                           c.shuffle_buffer if c.shuffle else 0, c.balance)
    return (PipelineState(layout, c.seed, c.shuffle, config, mixture),
            RankStreams(rank, world_size, c.num_workers, skip=skip if len(skip) else None))


class ShardPipeline:
    """Batches for this rank. `iter(pipe)` yields dicts: one stacked array (or list) per field,
    plus `__key__` (list of str), `__index__` (int64 global sample ids) and `__valid__` (bool;
    False for `pad` repeats and for repeats standing in for skipped bad samples).

    Composed of small stages: the source (`resolve_sources`: shard refs and counts, a value),
    the position (`position_of`: state.py over plan.py), the reader of one shard (shardread.py: indexed reads),
    the decoded-sample cache (decoded_cache.py, chosen by `prepare`), the decoder (decode.py),
    the worker streams that batch (stream.py) and the background threads that run them
    (StreamReader over background.py)."""

    def __init__(self, source: str | os.PathLike | Sequence[str] | Sequence[WeightedSource],
                 config: PipelineConfig | None = None, *, rank: int | None = None,
                 world_size: int | None = None, **options: Any) -> None:
        """Batches of `source` (a shard dir/URL with manifest.json, or shard URLs / a brace
        pattern, or a weighted mixture: a list of {path, weight} / WeightedSource) for `rank`
        of `world_size` (default: Horovod's, if initialised, else 0 of 1), read as `config`
        says; keyword `options` (PipelineConfig's fields) fill or override it.

        Builds only: the sources resolved (manifests read; shards without one counted), the
        plan's state and the decoder. Sample data is read here only for a mixture, whose
        sources' first samples must agree; the decoded-cache decision waits for `prepare`."""
        self.config = c = pipeline_config(config, options)
        self.rank, self.world_size = resolve_rank(rank, world_size)
        check_decode_device(c.decode_device)
        self.cache = ShardCache(c.cache_dir, c.cache_limit, c.storage_options, retries=c.retries,
                                policy=RetryPolicy(budget_s=c.retry_budget_s))
        self.indexes = (IndexStore(self.cache.cache_dir, c.storage_options, self.cache.policy)
                        if c.indexed else None)
        self.sources = resolve_sources(source, c, self.cache, self.indexes)
        self.progress, self.streams = position_of(c, self.layout, self.mixture, self.rank,
                                                  self.world_size)
        if self.batches_per_epoch == 0:
            raise PipelineError(
                f"{self.layout.num_samples} samples over {self.world_size} ranks give no full "
                f"batch of {self.batch_size} with balance='drop' (use balance='pad' or a smaller "
                "batch_size)")
        self.decoder = make_decoder(c, self.sources.field_kinds())
        if self.mixture is not None:
            check_mixture_fields(self.sources, self.decoder, self.cache, self.indexes)
        self._context: StreamContext | None = None  # made by prepare()
        self._stats = PipelineStats()
        self._passes = PassReaders(self)

    @property
    def skip_listed(self) -> int:
        """Ids of the skip list found in this split: each is left out of every epoch."""
        return 0 if self.streams.skip is None else len(self.streams.skip)

    # -- the sources (resolve_sources' value) ---------------------------------------------
    @property
    def refs(self) -> Sequence[ShardRef]:
        return self.sources.refs

    @property
    def manifest(self) -> Manifest | None:
        return self.sources.manifest

    @property
    def mixture(self) -> Mixture | None:
        return self.sources.mixture

    @property
    def source_names(self) -> list[str]:
        return list(self.sources.names)

    @property
    def layout(self) -> Layout:
        return self.sources.layout

    @property
    def context(self) -> StreamContext:
        """What the worker streams read with (made by `prepare` on first use)."""
        return self.prepare()

    def prepare(self) -> StreamContext:
        """The one step after construction that may read data: decide the decoded-sample cache
        (decoded_cache="auto" decodes the first sample, downloading its shard when remote) and
        make the streams' context. The first pass calls it (so does `context`); once."""
        if self._context is None:
            c = self.config
            store = decoded_store(  # (a window's tokens depend on the epoch: not cached)
                c.decoded_cache if c.seq_len is None else False, c.cache_limit, Path(self.cache.cache_dir), self.decoder,
                self.layout.num_samples, lambda: first_raw(self.refs, self.cache, self.indexes))
            decoder = self.decoder
            if store is not None and decoder.augments_per_epoch:
                decoder = replace(decoder, via_source=True)  # (Decoder.via_source)
            self._context = StreamContext(self.refs, self.layout, decoder, self.cache,
                                          c.on_error, c.prefetch, self.indexes, store)
        return self._context

    # -- sizes --------------------------------------------------------------------------
    @property
    def batches_per_epoch(self) -> int:
        """Batches every rank yields in a full epoch at this configuration."""
        return self.progress.batches_per_epoch

    @property
    def batches_remaining(self) -> int:
        """Batches left in the current epoch (after a resume: what this run will still yield)."""
        return self.progress.batches_remaining

    @property
    def epoch(self) -> int:
        return self.progress.epoch

    @property
    def segments(self) -> list:
        return self.progress.segments

    @property
    def batch_size(self) -> int:
        """Samples per batch of this rank (order: global: global_batch_size / world_size)."""
        return self.streams.batch_size(self.progress.config)

    @property
    def decoded_cache(self) -> bool:
        """Whether decoded samples are cached (decoded_cache=True/path, or "auto" chose it)."""
        return self.context.decoded is not None

    def __len__(self) -> int:
        return self.batches_per_epoch

    def source_of(self, ids: Any) -> tuple[np.ndarray, np.ndarray]:
        """Global sample ids (`__index__`) -> (source index, id within that source); a single
        source is source 0."""
        if self.mixture is None:
            ids = np.asarray(ids, dtype=np.int64)
            return np.zeros(len(ids), dtype=np.int64), ids
        return self.mixture.source_of(ids)

    # -- epochs and state ---------------------------------------------------------------
    def expect_next_epoch(self, expected: bool) -> None:
        """Whether the consumer will take the epoch after the current one: with read_ahead on,
        its reading starts as the last batch of this one goes out only if it will."""
        self._passes.next_epoch_expected = bool(expected)

    def read_in_workers(self) -> None:
        """Worker processes (a torch DataLoader's) read the passes from now on, not this
        process's threads: nothing is read ahead here."""
        self._passes.reads_here = False

    def set_epoch(self, epoch: int) -> None:
        """Start `epoch` afresh; the current epoch keeps its progress (so a resumed run may
        call set_epoch with the epoch it resumed into)."""
        self.progress.set_epoch(epoch)

    def state_dict(self) -> dict[str, Any]:
        """JSON-serialisable position: the epoch and, per segment of it (one per world size /
        worker count it ran at), the batches each rank consumed."""
        return self.progress.state_dict(len(self.refs))

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from `state`, taken at any world size / worker count. The same
        configuration continues the segment exactly; another one starts a new segment over the
        samples not yet consumed."""
        self.progress.load_state_dict(state, len(self.refs))

    def stats(self) -> dict[str, Any]:
        """samples/s, bytes/s, cache hits/misses/hit rate, skipped and padded samples, and
        data_wait_s: time the consumer spent waiting for batches."""
        return {**self._stats.as_dict(), "skip_listed": self.skip_listed}

    # -- iteration ----------------------------------------------------------------------
    def __iter__(self) -> Iterator[dict[str, Any]]:
        batches = self.iterate(count=True)
        try:
            for booked in batches:
                yield booked.batch
        finally:  # stop the reader threads now, not when the generator is collected
            batches.close()

    def iterate(self, count: bool = True, convert: Convert | None = None) -> Iterator[Booked]:
        """Batches in the order torch's DataLoader with `num_workers` workers yields them, each
        beside its bookkeeping (`Booked`; its counters already booked here). `count`: mark a
        batch consumed when it is handed out, else the caller passes `booked.tag` to
        `mark_consumed` when the batch reaches the training loop. `convert(batch)`: applied to
        every batch where it is read (the reader thread, when there is one), so the consumer
        takes it ready (the adapters make it framework tensors there); the next epoch's read-
        ahead applies the same function."""
        plan, t0, key = self.begin()
        source, reader = self._passes.open(plan, t0, key, convert)
        try:
            while True:
                started = time.perf_counter()
                try:
                    booked = next(source)
                except StopIteration:
                    return
                yield self.received(booked, time.perf_counter() - started, count)
        finally:
            source.close()
            if reader is not None:
                reader.close()

    def begin(self) -> tuple[SegmentPlan, int, tuple]:
        """The segment to iterate, the batches of it already consumed and the pass's key;
        moves to the next epoch first when the current one is complete (adapters call this
        once per pass)."""
        return self.progress.begin()

    def received(self, booked: Booked, waited_s: float, count: bool = True) -> Booked:
        """Book a batch arriving from a worker stream: its counters, the consumer's wait, and
        (`count`) its consumption. Every read path ends here or in `mark_consumed`."""
        self._stats.waited(waited_s)
        self._stats.add(booked.stats)
        if count:
            self.mark_consumed(booked.tag, len(booked.batch["__index__"]), strict=True)
        return booked

    def mark_consumed(self, tag: Sequence[int], samples: int, strict: bool = False) -> bool:
        """A batch tagged [epoch, segment, t] reached the training loop. Returns False (or
        raises, `strict`) when the tag belongs to a state replaced meanwhile."""
        current, last_of_pass = self.progress.mark_consumed(tag)
        if not current:
            if strict:
                raise PipelineError("set_epoch/load_state_dict was called during iteration; "
                                    "start a new iteration")
            return False
        self._stats.consumed(samples)
        if last_of_pass and self.config.read_ahead:
            self._passes.read_ahead()
        return True

    def peek_sample(self) -> dict[str, Any]:
        """The first decodable sample (in manifest order): what batches will look like."""
        return self.peek_samples(1)[0]

    def peek_samples(self, limit: int) -> list[dict[str, Any]]:
        """The first `limit` decodable samples in manifest order (fewer when the split holds
        fewer): what a property of the whole split is guessed from."""
        return first_decoded(self.refs, self.cache, self.indexes, self.decoder, limit)

    def example_batch(self) -> dict[str, Any]:
        """A batch shaped like the real ones (the first decodable sample, repeated)."""
        batch = collate([self.peek_sample()] * self.batch_size)
        batch["__key__"] = [""] * self.batch_size
        batch["__index__"] = np.zeros(self.batch_size, dtype=np.int64)
        batch["__valid__"] = np.ones(self.batch_size, dtype=bool)
        return batch

    def close(self) -> None:
        """Stop reading ahead (threads reading the next epoch before it is asked for)."""
        self._passes.close()

    @property
    def _ahead(self) -> tuple[tuple, StreamReader] | None:
        """The threads already reading the pass expected next, with that pass's key."""
        return self._passes.ahead


class PassReaders:
    """Where a pipeline's passes are read: in the consumer's thread, or in a `StreamReader`'s
    threads, one of them possibly started ahead for the next epoch (read_ahead)."""

    def __init__(self, pipe: ShardPipeline) -> None:
        self.pipe = pipe
        self.ahead: tuple[tuple, StreamReader] | None = None  # (pass key, its reader)
        self.convert: Convert | None = None  # the last pass's `convert` (iterate)
        # whether the consumer will take the epoch after this one (a trainer says no for its
        # last epoch: nothing reads past the end of the run)
        self.next_epoch_expected = True
        # whether this process's threads read the passes; False once a torch DataLoader's
        # worker processes do (a read-ahead here would decode an epoch nobody takes)
        self.reads_here = True

    @property
    def threaded(self) -> bool:
        """Whether passes are read in threads; else in the consumer's (nothing read ahead)."""
        return self.pipe.config.num_workers > 0 or self.pipe.config.prefetch > 0

    def open(self, plan: SegmentPlan, t0: int, key: tuple, convert: Convert | None
             ) -> tuple[Iterator[Booked], StreamReader | None]:
        """A pass's batches from t0 on and the reader threads making them (None: read in the
        consumer's thread): the ones started ahead when this is the pass they expected."""
        context = self.pipe.prepare()
        self.convert = convert
        if not self.threaded:
            return converted(self.pipe.streams.open(context, plan, 0, t0), convert), None
        ahead, self.ahead = self.ahead, None
        if ahead is not None:
            if ahead[0] == key and ahead[1].convert == convert:
                return ahead[1].batches(), ahead[1]
            ahead[1].close()
        reader = self.start(plan, t0)
        return reader.batches(), reader

    def start(self, plan: SegmentPlan, t0: int) -> StreamReader:
        streams = [self.pipe.streams.open(self.pipe.prepare(), plan, w, t0)
                   for w in range(self.pipe.streams.count)]
        return StreamReader(streams, t0, plan.batches, max(1, self.pipe.config.prefetch),
                            self.convert)

    def read_ahead(self) -> None:
        """The last batch of a pass went out: start reading the next epoch now (its first
        batch waits for the shuffle buffer to fill), so the consumer's next pass finds it under
        way while it finishes the step, validates, checkpoints. Only where this process's
        threads read the passes and the consumer will take that epoch."""
        if not (self.next_epoch_expected and self.reads_here and self.threaded):
            return
        plan, key = self.pipe.progress.next_epoch_pass()
        reader = self.start(plan, 0)
        old, self.ahead = self.ahead, (key, reader)
        if old is not None:
            old[1].close()

    def close(self) -> None:
        ahead, self.ahead = self.ahead, None
        if ahead is not None:
            ahead[1].close()


# -- resolving the sources (what the constructor builds from) ---------------------------------
@dataclass(frozen=True)
class ResolvedSources:
    """A pipeline's sources, resolved once (`resolve_sources`): the shards laid end to end
    with their sample counts, each source's manifest (None: shard URLs, counted) and name, and
    for a weighted mixture the Mixture that plans its epochs."""

    refs: Sequence[ShardRef]
    manifests: tuple[Manifest | None, ...]
    names: tuple[str, ...]
    layout: Layout
    mixture: Mixture | None = None

    @property
    def manifest(self) -> Manifest | None:
        return self.manifests[0]

    @property
    def parts(self) -> list[Sequence[ShardRef]]:
        """Each source's shards."""
        return list(self.refs.parts) if isinstance(self.refs, ConcatRefs) else [self.refs]

    def field_kinds(self) -> dict[str, str]:
        """The manifests' field kinds; sources of a mixture must not disagree on one."""
        kinds: dict[str, str] = {}
        for name, manifest in zip(self.names, self.manifests, strict=True):
            for field, kind in (dict(manifest.fields) if manifest else {}).items():
                if kinds.setdefault(field, kind) != kind:
                    raise PipelineError(
                        f"mixture source {name!r}: field {field!r} is {kind!r} there but "
                        f"{kinds[field]!r} in {self.names[0]!r} (shard the sources "
                        "alike, or set `fields` to one kind)")
        return kinds


def resolve_sources(source: Any, config: PipelineConfig, cache: ShardCache,
                    indexes: IndexStore | None) -> ResolvedSources:
    """`source` (one source, or a weighted mixture) resolved: manifests read, shards without
    one counted through `cache` (so remote ones are fetched once). No other data is read."""
    mixed = as_mixture(source)
    if mixed is None:
        if config.epoch_samples is not None:
            raise PipelineError("epoch_samples: only a weighted mixture of sources has it")
        manifest, refs = resolve_one(source, config, cache, indexes)
        return ResolvedSources(refs, (manifest,), (str(source),), Layout(sample_counts(refs)))
    check_weights(mixed)
    names = source_names(mixed)
    manifests, parts = [], []
    for name, entry in zip(names, mixed, strict=True):
        try:
            manifest, refs = resolve_one(entry.path, config, cache, indexes)
        except PipelineError as e:
            raise PipelineError(f"mixture source {name!r}: {e}") from None
        manifests.append(manifest)
        parts.append(refs)
    mixture = mixture_of(mixed, [Layout(sample_counts(p)) for p in parts], config.epoch_samples)
    refs = ConcatRefs(parts)
    return ResolvedSources(refs, tuple(manifests), tuple(names), Layout(sample_counts(refs)),
                           mixture)


def resolve_one(source: Any, config: PipelineConfig, cache: ShardCache,
                indexes: IndexStore | None) -> tuple[Manifest | None, Sequence[ShardRef]]:
    """One source's manifest (None for shard URLs) and shards, `pipe:` URLs checked."""
    split, allow_pipe = config.split, config.allow_pipe
    if is_shard_list(source):
        urls = expand_urls(source if isinstance(source, str) else [str(s) for s in source])
        check_pipe_allowed(urls, allow_pipe)
        manifest, refs = None, [counted(url, cache, indexes) for url in urls]
    else:
        location = os.fspath(source)
        check_pipe_allowed([location], allow_pipe)
        manifest, refs = manifest_refs(location, split, config.storage_options, cache.policy,
                                       Path(cache.cache_dir) / "manifests")
        check_pipe_allowed(refs.urls_starting_with("pipe:"), allow_pipe)
    refs = windowed(manifest, refs, split, config.seq_len, config.random_windows, str(source))
    if not len(refs) or not sample_counts(refs).any():
        raise PipelineError(f"{source}: no samples (split {split!r})")
    return manifest, refs


def counted(url: str, cache: ShardCache, indexes: IndexStore | None) -> ShardRef:
    """Without a manifest, count a shard's samples by reading it (through the cache; a
    compressed one is indexed through its plain copy, which the epochs then read)."""
    handle = cache.open(ShardRef(url, 0), plain=indexes is not None)
    try:
        if indexes is not None and (handle.plain_of or not url.endswith(COMPRESSED_SUFFIXES)):
            index, _, reason = indexes.index_for(handle)
            if reason is not None:
                raise PipelineDataError(f"{url}: cannot count samples ({reason})")
            return ShardRef(url, index.num_samples)
        return ShardRef(url, sum(1 for _ in iter_samples(handle)))
    except PipelineDataError:
        raise
    except Exception as e:
        raise PipelineDataError(f"{url}: cannot count samples ({e})") from e
    finally:
        handle.close()


# -- reading first samples (checks and decisions that look at data) ----------------------------
def first_raw(refs: Sequence[ShardRef], cache: ShardCache,
              indexes: IndexStore | None) -> dict[str, Any]:
    """The first readable raw sample of `refs` (each shard's sample 0, in order)."""
    for ref in refs:
        samples = open_samples(cache.open(ref), indexes)
        try:
            raw = samples.get(0)
        finally:
            samples.close()
        if not isinstance(raw, BadSample):
            return raw
    raise PipelineDataError("no readable sample in any shard")


def first_decoded(refs: Sequence[ShardRef], cache: ShardCache, indexes: IndexStore | None,
                  decoder: Decoder, limit: int = 1) -> list[dict[str, Any]]:
    """The first `limit` samples of `refs` that read and decode (in manifest order). When none
    does, the first decode error says why; one raised by the user's own code (data.decode,
    data.transform) is raised as it is, so the CLI shows its traceback and names the hook."""
    first_error: Exception | None = None
    found: list[dict[str, Any]] = []
    for ref in refs:
        try:
            samples = open_samples(cache.open(ref), indexes)
        except Exception:
            continue
        try:
            for position in range(max(ref.num_samples, 1)):
                raw = samples.get(position)
                if isinstance(raw, BadSample):
                    break
                try:
                    found.append(decoder(raw))
                except UserCodeError as e:  # the user's decode/transform: theirs to see
                    raise e.error from None
                except Exception as e:
                    first_error = first_error or e
                    continue
                if len(found) == limit:
                    return found
        finally:
            samples.close()
    if found:
        return found
    why = f" (the first: {type(first_error).__name__}: {first_error})" if first_error else ""
    raise PipelineDataError(f"no decodable sample in any shard{why}")


def check_mixture_fields(sources: ResolvedSources, decoder: Decoder, cache: ShardCache,
                         indexes: IndexStore | None) -> None:
    """Batches mix the sources' samples, so every source must give the same fields with
    the same shapes: checked on each source's first sample, one line naming the odd one."""
    first = sources.names[0]
    seen: dict[str, tuple] | None = None
    for name, refs in zip(sources.names, sources.parts, strict=True):
        try:
            sample = decoder(first_raw(refs, cache, indexes))
        except UserCodeError as e:
            raise e.error from None
        except PipelineDataError as e:
            raise PipelineError(f"mixture source {name!r}: {e}") from None
        except Exception as e:  # an undecodable first sample: the reader will say more
            raise PipelineError(f"mixture source {name!r}: first sample does not "
                                f"decode ({e})") from None
        fields = {k: _shape_of(v) for k, v in sample.items() if not k.startswith("__")}
        if seen is None:
            seen = fields
            continue
        for field in sorted(set(seen) ^ set(fields)):
            where, other = (name, first) if field in seen else (first, name)
            raise PipelineError(
                f"mixture source {where!r} has no field {field!r} that {other!r} has "
                "(the sources of a mixture must carry the same fields)")
        for field, shape in fields.items():
            if shape != seen[field]:
                raise PipelineError(
                    f"mixture source {name!r}: field {field!r} is {shape} there but "
                    f"{seen[field]} in {first!r} (the sources must agree; for images "
                    "set image_size)")


def decoded_store(setting: bool | str | os.PathLike, limit: int | None, cache_dir: Path,
                  decoder: Decoder, num_samples: int,
                  read_first: Callable[[], dict[str, Any]]) -> DecodedStore | None:
    """The decoded-sample cache to use, if any: True or a directory turn it on; "auto"
    when the split's decoded samples are cacheable and fit (see AUTO_FREE_SHARE), judged on
    the first sample (`read_first()`, called only then)."""
    if setting is False or setting is None or decoder.decode is not None \
            or not decoder.decode_images:
        return None  # a user decode() cannot be keyed; GPU decoding keeps the bytes
    auto = setting == "auto"
    directory = cache_dir / "decoded" if setting is True or auto else Path(setting)
    # with no cache_limit the decoded cache still has a bound: a share of the free space
    room = limit if limit is not None else int(AUTO_FREE_SHARE * _free_bytes(directory))
    if auto:
        try:
            per_sample = layout_of(decoder.base(read_first()))
        except Exception:  # Uncacheable, unreadable or undecodable first sample
            return None
        if per_sample * num_samples > room:
            return None
    return DecodedStore(directory, room, decoder.settings())


def _shape_of(value: Any) -> tuple:
    """(shape, dtype) of an array field; the Python type of anything else."""
    if isinstance(value, np.ndarray):
        return (value.shape, str(value.dtype))
    return (type(value).__name__,)


def _free_bytes(directory: Path) -> int:
    """Free space on the filesystem that holds (or will hold) `directory`."""
    probe = directory
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    try:
        return shutil.disk_usage(probe).free
    except OSError:
        return 0


Convert = Callable[[dict[str, Any]], dict[str, Any]]


def converted(booked: Iterator[Booked], convert: Convert | None) -> Iterator[Booked]:
    """`booked` with `convert` applied to each batch; closing this closes `booked` (a worker
    stream's shards close with it)."""
    if convert is None:
        yield from booked
        return
    try:
        for item in booked:
            yield item._replace(batch=convert(item.batch))
    finally:
        booked.close()


class StreamReader:
    """A pass's worker streams, each running in a thread `depth` batches ahead of the consumer
    from the moment this is made. `batches()` yields batches t0..total-1, batch t from stream
    t % W (DataLoader's order); `close()` stops the threads."""

    def __init__(self, streams: list[Iterator[Booked]], t0: int, total: int, depth: int,
                 convert: Convert | None = None) -> None:
        self.t0, self.total, self.convert = t0, total, convert
        self._streams = [BackgroundIterator(converted(iter(s), convert), depth,
                                            f"ringfeed-stream-{i}")
                         for i, s in enumerate(streams)]

    def batches(self) -> Iterator[Booked]:
        streams = len(self._streams)
        for t in range(self.t0, self.total):
            w = t % streams
            try:
                yield next(self._streams[w])
            except StopIteration:
                raise RuntimeError(f"worker stream {w} ended early at batch {t} of "
                                   f"{self.total}") from None

    def close(self) -> None:
        for stream in self._streams:
            stream.close()

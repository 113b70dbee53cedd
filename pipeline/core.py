"""`ShardPipeline`: shards -> cache -> balanced, shuffled, decoded, resumable batches.

See pipeline/README.md for the guarantees (balance, determinism, exact and cross-world-size
resume) and plan.py for the arithmetic behind them.
"""

from __future__ import annotations

import json
import os
import queue
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from pipeline.cache import ShardCache
from pipeline.decode import Decoder, SampleFn, as_pair
from pipeline.errors import PipelineDataError, PipelineError
from pipeline.plan import (
    BALANCE_POLICIES,
    Layout,
    Planner,
    Segment,
    SegmentConfig,
    SegmentPlan,
    batches_for,
)
from pipeline.reader import count_samples, iter_samples
from pipeline.source import (
    ShardRef,
    check_pipe_allowed,
    expand_urls,
    is_shard_list,
    read_manifest,
    refs_from_manifest,
)
from pipeline.stats import PipelineStats
from pipeline.stream import ON_ERROR_POLICIES, StreamSpec, WorkerStream, collate
from shards.fsutil import parse_size
from shards.manifest import Manifest

STATE_VERSION = 1
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


class ShardPipeline:
    """Batches for this rank. `iter(pipe)` yields dicts: one stacked array (or list) per field,
    plus `__key__` (list of str), `__index__` (int64 global sample ids) and `__valid__` (bool;
    False for `pad` repeats and for repeats standing in for skipped bad samples)."""

    def __init__(
        self,
        source: str | os.PathLike | Sequence[str],
        split: str = "train",
        batch_size: int = 32,
        seed: int = 0,
        shuffle: bool = True,
        shuffle_buffer: int = 1000,
        rank: int | None = None,
        world_size: int | None = None,
        num_workers: int = 0,
        balance: str = "drop",
        decode: SampleFn | None = None,
        transform: SampleFn | None = None,
        image_size: int | tuple[int, int] | None = None,
        normalize: tuple[Any, Any] | None = None,
        on_error: str = "skip",
        cache_dir: str | os.PathLike | None = None,
        cache_limit: int | str | None = None,
        prefetch: int = 2,
        allow_pipe: bool = False,
        storage_options: dict[str, Any] | None = None,
        fields: dict[str, str] | None = None,
        retries: int = 3,
        read_ahead: bool = False,
    ) -> None:
        if batch_size < 1:
            raise PipelineError(f"batch_size must be >= 1 (got {batch_size})")
        if balance not in BALANCE_POLICIES:
            raise PipelineError(f"balance must be one of {BALANCE_POLICIES} (got {balance!r})")
        if on_error not in ON_ERROR_POLICIES:
            raise PipelineError(f"on_error must be one of {ON_ERROR_POLICIES} (got {on_error!r})")
        if num_workers < 0 or shuffle_buffer < 0 or prefetch < 0:
            raise PipelineError("num_workers, shuffle_buffer and prefetch must be >= 0")
        if rank is None or world_size is None:
            hvd_rank, hvd_size = horovod_rank_and_size()
            rank = hvd_rank if rank is None else rank
            world_size = hvd_size if world_size is None else world_size
        if not 0 <= rank < world_size:
            raise PipelineError(f"rank {rank} is not in [0, world_size={world_size})")
        self.rank, self.world_size = int(rank), int(world_size)
        self.batch_size, self.seed, self.shuffle = int(batch_size), int(seed), bool(shuffle)
        self.shuffle_buffer = int(shuffle_buffer) if shuffle else 0
        self.num_workers, self.balance, self.prefetch = int(num_workers), balance, int(prefetch)
        self.storage_options = dict(storage_options or {})
        self.cache = ShardCache(str(cache_dir) if cache_dir is not None else None,
                                parse_size(cache_limit) if cache_limit is not None else None,
                                self.storage_options, retries=retries)
        self.manifest, refs = self._resolve(source, split, allow_pipe)
        self.refs = refs
        self.layout = Layout(np.array([r.num_samples for r in refs], dtype=np.int64))
        self.config = SegmentConfig(self.world_size, self.num_workers, self.batch_size,
                                    self.shuffle_buffer, balance)
        if self.batches_per_epoch == 0:
            raise PipelineError(
                f"{self.layout.num_samples} samples over {self.world_size} ranks give no full "
                f"batch of {self.batch_size} with balance='drop' (use balance='pad' or a smaller "
                "batch_size)")
        kinds = dict(self.manifest.fields) if self.manifest else {}
        kinds.update(fields or {})
        decoder = Decoder(kinds, as_pair(image_size), normalize, decode, transform)
        self.spec = StreamSpec(refs, self.layout, decoder, self.cache, on_error, self.prefetch)
        self._planner = Planner(self.layout, self.seed, self.shuffle)
        self._lock = threading.Lock()
        self._stats = PipelineStats()
        self.epoch = 0
        self.segments = [Segment(self.config)]
        # threads already reading the pass expected next, and what triggers that read-ahead
        self._ahead: tuple[tuple, StreamReader] | None = None
        self._last_batch_of_pass: tuple[int, int, int] | None = None
        # a trainer turns this off for its last epoch: nothing reads past the end of the run
        self.read_ahead = bool(read_ahead)

    # -- sizes --------------------------------------------------------------------------
    @property
    def batches_per_epoch(self) -> int:
        """Batches every rank yields in a full epoch at this configuration."""
        return batches_for(self.layout.num_samples, self.world_size, self.batch_size,
                           self.balance)

    @property
    def batches_remaining(self) -> int:
        """Batches left in the current epoch (after a resume: what this run will still yield)."""
        with self._lock:
            return max(0, self._plans()[-1].batches - self.segments[-1].batches_consumed)

    def __len__(self) -> int:
        return self.batches_per_epoch

    # -- epochs and state ---------------------------------------------------------------
    def set_epoch(self, epoch: int) -> None:
        """Start `epoch` afresh; the current epoch keeps its progress (so a resumed run may
        call set_epoch with the epoch it resumed into)."""
        with self._lock:
            if epoch != self.epoch:
                self._start_epoch(epoch)

    def state_dict(self) -> dict[str, Any]:
        """JSON-serialisable position: the epoch and, per segment of it (one per world size /
        worker count it ran at), the batches each rank consumed."""
        with self._lock:
            return {
                "version": STATE_VERSION,
                "epoch": self.epoch,
                "seed": self.seed,
                "batch_size": self.batch_size,
                "shuffle": self.shuffle,
                "num_samples": self.layout.num_samples,
                "num_shards": len(self.refs),
                "segments": [s.to_dict() for s in self.segments],
            }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from `state`, taken at any world size / worker count. The same
        configuration continues the segment exactly; another one starts a new segment over the
        samples not yet consumed."""
        for name, mine in (("version", STATE_VERSION), ("seed", self.seed),
                           ("shuffle", self.shuffle), ("num_samples", self.layout.num_samples),
                           ("num_shards", len(self.refs))):
            if name in state and state[name] != mine:
                raise PipelineError(f"pipeline state has {name}={state[name]!r}, this pipeline "
                                    f"{mine!r}: it belongs to another dataset or setup")
        defaults = {"batch_size": state.get("batch_size", self.batch_size),
                    "shuffle_buffer": self.shuffle_buffer, "balance": self.balance}
        try:
            segments = [Segment.from_dict(d, defaults) for d in state["segments"]]
            epoch = int(state["epoch"])
        except (KeyError, TypeError, ValueError) as e:
            raise PipelineError(f"malformed pipeline state ({e!r})") from None
        if not segments:
            raise PipelineError("malformed pipeline state (no segments)")
        with self._lock:
            self.epoch, self.segments = epoch, segments
            if segments[-1].config != self.config and not self._epoch_complete():
                # a segment that consumed nothing changes nothing: replace it, don't stack it
                while len(self.segments) > 1 and self.segments[-1].batches_consumed == 0:
                    self.segments.pop()
                if self.segments[-1].batches_consumed == 0:
                    self.segments = [Segment(self.config)]
                elif self.segments[-1].config != self.config:
                    self.segments.append(Segment(self.config))

    def stats(self) -> dict[str, Any]:
        """samples/s, bytes/s, cache hits/misses/hit rate, skipped and padded samples, and
        data_wait_s: time the consumer spent waiting for batches."""
        return self._stats.as_dict()

    # -- iteration ----------------------------------------------------------------------
    def __iter__(self) -> Iterator[dict[str, Any]]:
        return self.iterate(count=True)

    def iterate(self, count: bool = True) -> Iterator[dict[str, Any]]:
        """Batches in the order torch's DataLoader with `num_workers` workers yields them.
        `count`: mark a batch consumed when it is handed out (else the caller marks it)."""
        plan, t0 = self.begin()
        reader = self._reader(plan, t0)
        source = reader.batches() if reader is not None else iter(
            WorkerStream.resuming(self.spec, plan, self.rank, 0, t0))
        try:
            while True:
                started = time.perf_counter()
                try:
                    batch = next(source)
                except StopIteration:
                    return
                yield self.received(batch, time.perf_counter() - started, count)
        finally:
            source.close()
            if reader is not None:
                reader.close()

    def received(self, batch: dict[str, Any], waited_s: float, count: bool = True
                 ) -> dict[str, Any]:
        """Book a batch arriving from a worker stream: its counters, the consumer's wait, and
        (`count`) its consumption. Returns the batch without its bookkeeping fields."""
        self._stats.waited(waited_s)
        self._stats.add(batch.pop("__stats__"))
        if count:
            tag = batch.pop("__batch__")
            self.mark_consumed(tag.tolist(), len(batch["__index__"]), strict=True)
        return batch

    def mark_consumed(self, tag: Sequence[int], samples: int, strict: bool = False) -> bool:
        """A batch tagged [epoch, segment, t] reached the training loop. Returns False (or
        raises, `strict`) when the tag belongs to a state replaced meanwhile."""
        epoch, segment, t = (int(x) for x in tag)
        with self._lock:
            current = epoch == self.epoch and segment == len(self.segments) - 1
            if current:
                seg = self.segments[-1]
                seg.batches_consumed = max(seg.batches_consumed, t + 1)
            read_ahead = (self.read_ahead and current
                          and (epoch, segment, t) == self._last_batch_of_pass)
        if not current:
            if strict:
                raise PipelineError("set_epoch/load_state_dict was called during iteration; "
                                    "start a new iteration")
            return False
        self._stats.consumed(samples)
        if read_ahead:
            self._read_ahead(epoch + 1)
        return True

    def peek_sample(self) -> dict[str, Any]:
        """The first decodable sample (in manifest order): what batches will look like."""
        for ref in self.refs:
            handle = self.cache.open(ref)
            try:
                for raw in iter_samples(handle):
                    try:
                        return self.spec.decoder(raw)
                    except Exception:
                        continue
            except Exception:
                continue
            finally:
                handle.close()
        raise PipelineDataError("no decodable sample in any shard")

    def example_batch(self) -> dict[str, Any]:
        """A batch shaped like the real ones (the first decodable sample, repeated)."""
        batch = collate([self.peek_sample()] * self.batch_size)
        batch["__key__"] = [""] * self.batch_size
        batch["__index__"] = np.zeros(self.batch_size, dtype=np.int64)
        batch["__valid__"] = np.ones(self.batch_size, dtype=bool)
        return batch

    # -- internals ----------------------------------------------------------------------
    def begin(self) -> tuple[SegmentPlan, int]:
        """The segment to iterate and the batches of it already consumed; moves to the next
        epoch first when the current one is complete (adapters call this once per pass)."""
        with self._lock:
            if self._epoch_complete():
                self._start_epoch(self.epoch + 1)
            return self._plans()[-1], self.segments[-1].batches_consumed

    def _reader(self, plan: SegmentPlan, t0: int) -> StreamReader | None:
        """The threads that read this pass (None: read in the consumer's thread): the ones
        started ahead for it when it is the pass that was expected, else new ones."""
        if self.num_workers == 0 and self.prefetch == 0:
            return None
        with self._lock:
            key = _pass_key(self.epoch, self.segments)
            ahead, self._ahead = self._ahead, None
            self._last_batch_of_pass = (plan.epoch, plan.index, plan.batches - 1)
        if ahead is not None:
            if ahead[0] == key:
                return ahead[1]
            ahead[1].close()
        return self._start_reader(plan, t0)

    def _start_reader(self, plan: SegmentPlan, t0: int) -> StreamReader:
        streams = [WorkerStream.resuming(self.spec, plan, self.rank, w, t0)
                   for w in range(plan.config.streams)]
        return StreamReader(streams, t0, plan.batches, max(1, self.prefetch))

    def _read_ahead(self, epoch: int) -> None:
        """The last batch of a pass went out: start reading epoch `epoch` now (its first batch
        waits for the shuffle buffer to fill), so the consumer's next pass finds it under way
        while it finishes the step, validates, checkpoints."""
        segments = [Segment(self.config)]
        reader = self._start_reader(self._planner.plans(epoch, segments)[-1], 0)
        with self._lock:
            old, self._ahead = self._ahead, (_pass_key(epoch, segments), reader)
        if old is not None:
            old[1].close()

    def close(self) -> None:
        """Stop reading ahead (threads reading the next epoch before it is asked for)."""
        with self._lock:
            ahead, self._ahead = self._ahead, None
        if ahead is not None:
            ahead[1].close()

    def _plans(self) -> list[SegmentPlan]:
        return self._planner.plans(self.epoch, self.segments)

    def _epoch_complete(self) -> bool:
        return self.segments[-1].batches_consumed >= self._plans()[-1].batches

    def _start_epoch(self, epoch: int) -> None:
        self.epoch, self.segments = int(epoch), [Segment(self.config)]

    def _resolve(self, source: Any, split: str, allow_pipe: bool
                 ) -> tuple[Manifest | None, list[ShardRef]]:
        if is_shard_list(source):
            urls = expand_urls(source if isinstance(source, str) else [str(s) for s in source])
            check_pipe_allowed(urls, allow_pipe)
            manifest, refs = None, [self._counted(url) for url in urls]
        else:
            location = os.fspath(source)
            check_pipe_allowed([location], allow_pipe)
            manifest, base = read_manifest(location, self.storage_options)
            refs = refs_from_manifest(manifest, base, split)
            check_pipe_allowed([r.url for r in refs], allow_pipe)
        if not refs or sum(r.num_samples for r in refs) == 0:
            raise PipelineError(f"{source}: no samples (split {split!r})")
        return manifest, refs

    def _counted(self, url: str) -> ShardRef:
        """Without a manifest, count a shard's samples by reading it (through the cache)."""
        handle = self.cache.open(ShardRef(url, 0))
        try:
            return ShardRef(url, count_samples(handle))
        except Exception as e:
            raise PipelineDataError(f"{url}: cannot count samples ({e})") from e
        finally:
            handle.close()


_END = object()


def _pass_key(epoch: int, segments: list[Segment]) -> tuple:
    """What decides a pass's batches: the epoch and its segments (with their consumed counts)."""
    return epoch, tuple(json.dumps(seg.to_dict(), sort_keys=True) for seg in segments)


class StreamReader:
    """A pass's worker streams, each running in a thread `depth` batches ahead of the consumer
    from the moment this is made. `batches()` yields batches t0..total-1, batch t from stream
    t % W (DataLoader's order); `close()` stops the threads."""

    def __init__(self, streams: list[WorkerStream], t0: int, total: int, depth: int) -> None:
        self.t0, self.total = t0, total
        self._stop = threading.Event()
        self._queues: list[queue.Queue] = [queue.Queue(maxsize=depth) for _ in streams]
        self._threads = [threading.Thread(target=self._produce, args=(s, q), daemon=True,
                                          name=f"ringfeed-stream-{i}")
                         for i, (s, q) in enumerate(zip(streams, self._queues, strict=True))]
        for th in self._threads:
            th.start()

    def _put(self, q: queue.Queue, item: Any) -> bool:
        while not self._stop.is_set():
            try:
                q.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def _produce(self, stream: WorkerStream, q: queue.Queue) -> None:
        items = iter(stream)
        try:
            for item in items:
                if not self._put(q, item):
                    return
            self._put(q, _END)
        except BaseException as e:  # handed to the consumer, raised there
            self._put(q, e)
        finally:
            items.close()

    def batches(self) -> Iterator[dict[str, Any]]:
        streams = len(self._queues)
        for t in range(self.t0, self.total):
            w = t % streams
            while True:
                try:
                    item = self._queues[w].get(timeout=1.0)
                    break
                except queue.Empty:
                    if not self._threads[w].is_alive() and self._queues[w].empty():
                        raise RuntimeError(f"worker stream {w} stopped without a result") from None
            if isinstance(item, BaseException):
                raise item
            if item is _END:
                raise RuntimeError(f"worker stream {w} ended early at batch {t} of {self.total}")
            yield item

    def close(self) -> None:
        self._stop.set()
        for q in self._queues:  # unblock producers waiting on a full queue
            while not q.empty():
                q.get_nowait()
        for th in self._threads:  # they stop at their next put; don't wait out a download
            th.join(timeout=0.5)

"""PyTorch adapter: a DataLoader over the pipeline's worker streams.

`make_loader(pipe)` returns an iterable of batches (numpy arrays become tensors, lists stay
lists) in exactly the order of `iter(pipe)`: DataLoader worker i runs worker stream
(i + t0) % W, where t0 is the rank's batch count already consumed, so the DataLoader's
round-robin picks up where the consumed batches stopped. Each batch handed to the caller
advances the pipeline's consumed counter (so `pipe.state_dict()` is exact).

With num_workers=0 batches come from the pipeline's own threads (`ShardPipeline.iterate`), which
also read the next epoch ahead, and only their arrays become tensors: as DataLoader's
`default_convert` would, in the reader thread, without a DataLoader around it where nothing
needs one (no CUDA to pin for, no DataLoader options), since its iterator cost ~0.6 ms a batch
on the 2-core box (median next() 0.9 ms against 0.3 ms), ~1% of the demo's step.

Persistent workers keep their copy of the dataset, so the iteration to run (epoch, segments,
t0) reaches them through a small shared-memory buffer written before each pass.

Loader workers ignore SIGTERM and SIGUSR1: a scheduler that signals the whole process group
(Slurm, `kill -TERM -PGID`) must not kill them while the training process is saving the
checkpoint those signals ask for. They stop when told (`close()`, or DataLoader's own shutdown
when the loader is dropped) or when the process that made the loader is gone (DataLoader's
watchdog sees their parent go; a watch of ours, the owner, where their parent is a forkserver).
Since multiprocessing's exit handler stops leftover children with SIGTERM and then waits for
them, loaders still open at interpreter exit are closed by an exit handler of this module first.

Workers start the way DataLoader's `multiprocessing_context` says (fork by default).
`forkserver_context()` is the way for a process whose native threads call into Python, where a
fork() can leave the child stuck in os.fork() for ever: such a thread makes a Python thread state
holding the interpreter's thread-list lock without the GIL, and CPython before 3.10.15 / 3.11.10
(gh-112275) takes that lock in the child before resetting it. Horovod's background thread does
it after every collective (torch hands it the tensors' Python objects to release), so `ringfeed
train` starts its workers from the server: a process of its own, started by exec, that preloads
this module (a worker is a fork of it, torch already imported) and starts, with its workers,
with SIGTERM and SIGUSR1 blocked.
"""

from __future__ import annotations

import atexit
import json
import multiprocessing
import multiprocessing.forkserver
import multiprocessing.util
import os
import signal
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from dataclasses import replace
from typing import Any, NamedTuple

import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset, default_convert, get_worker_info
from torch.utils.data._utils import MP_STATUS_CHECK_INTERVAL

from ringfeed.pipeline.canonical import RankStreams
from ringfeed.pipeline.core import ShardPipeline
from ringfeed.pipeline.decode import Decoder
from ringfeed.pipeline.errors import PipelineDataError
from ringfeed.pipeline.plan import Planner, Segment
from ringfeed.pipeline.stream import Booked, StreamContext
from ringfeed.remote import StorageUnavailable, forget_inherited_storage_sessions
from ringfeed.userhooks import ProcessError

_STATE_BYTES = 1 << 16
# per-sample arrays small enough to travel from worker processes as lists (see _StreamDataset)
# the scheduler's stop and save signals, which loader workers must outlive (module docstring)
_SCHEDULER_SIGNALS = frozenset({signal.SIGTERM, signal.SIGUSR1})
_SMALL_FIELDS = {"__index__": torch.int64, "__valid__": torch.bool}
# A numeric field under this many bytes leaves a loader worker pickled in the message itself:
# a tensor's shared-memory segment (created, its descriptor sent, mapped, unmapped) costs more
# than copying that much through the pipe (token windows: 8 x 129 int64 = 8 KB a batch).
_INLINE_BYTES = 1 << 20


class _Inline:
    """An array that default_convert leaves alone (it recurses into tuples, not into other
    objects), so it travels pickled, not in shared memory."""

    __slots__ = ("array",)

    def __init__(self, array: np.ndarray) -> None:
        self.array = array


class _WorkerError(NamedTuple):
    """An error in a loader worker process, sent in place of its next batch and raised in the
    training process: a data or storage error as the same one-line error (PipelineDataError,
    StorageUnavailable), any other (the user's decode or transform, at any step) as a
    ProcessError that carries its traceback and frames, so the CLI names the user's code."""

    error: type[Exception]
    args: tuple[Any, ...]

    @classmethod
    def of(cls, exc: Exception) -> _WorkerError:
        if isinstance(exc, (PipelineDataError, StorageUnavailable)):
            return cls(type(exc), (str(exc),))
        carried = ProcessError.of(exc)
        return cls(ProcessError, (carried.type_name, carried.message, carried.text,
                                  carried.frames))


class _PassState:
    """The pass to run, as JSON in shared memory made with the workers' start method
    (`context`: a buffer of another one cannot reach them)."""

    def __init__(self, context: multiprocessing.context.BaseContext) -> None:
        self._buffer = context.Array("c", _STATE_BYTES)

    def write(self, state: dict[str, Any]) -> None:
        data = json.dumps(state).encode()
        if len(data) >= _STATE_BYTES:
            raise ValueError(f"pipeline pass state too large ({len(data)} bytes)")
        with self._buffer.get_lock():
            self._buffer.value = data

    def read(self) -> dict[str, Any]:
        with self._buffer.get_lock():
            return json.loads(self._buffer.value.decode())


class _StreamDataset(IterableDataset):
    """What each DataLoader worker process runs: its worker stream of the pass in `state`."""

    def __init__(self, context: StreamContext, planner: Planner, streams: RankStreams,
                 state: _PassState) -> None:
        self.context, self.planner, self.streams, self.state = context, planner, streams, state

    def __iter__(self) -> Iterator[Booked | _WorkerError]:
        info = get_worker_info()
        state = self.state.read()
        segments = [Segment.from_dict(d, {}) for d in state["segments"]]
        plan = self.planner.plans(state["epoch"], segments)[-1]
        t0 = state["t0"]
        w = (info.id + t0) % self.streams.count
        stream = self.streams.open(self.context, plan, w, t0)
        try:
            for booked in stream:
                # small arrays travel as lists: a tensor each would cost a shared-memory
                # segment per batch (the tag and counters are plain values already)
                for name in _SMALL_FIELDS:
                    booked.batch[name] = booked.batch[name].tolist()
                for name, value in booked.batch.items():
                    if isinstance(value, np.ndarray) and value.dtype.kind in "biuf" \
                            and value.nbytes < _INLINE_BYTES:
                        booked.batch[name] = _Inline(value)
                yield booked
        except Exception as e:  # (torch's own re-raise would hide where it came from)
            yield _WorkerError.of(e)


class _PassDataset(IterableDataset):
    """num_workers=0: the pipeline's own pass, read in its threads (ahead of the training
    loop, so decoding overlaps the step and its allreduce waits), consumption not counted."""

    def __init__(self, pipe: ShardPipeline) -> None:
        self.pipe = pipe

    def __iter__(self) -> Iterator[Booked]:
        return self.pipe.iterate(count=False)


class _WorkerInit:
    """DataLoader worker_init_fn: ignore the scheduler's stop/save signals, leave when the
    loader's process (`owner`) is gone, then run the caller's own worker_init_fn, if any (a
    class, so workers started by spawn or a forkserver can unpickle it)."""

    def __init__(self, owner: int, then: Callable[[int], None] | None = None) -> None:
        self.owner, self.then = owner, then

    def __call__(self, worker_id: int) -> None:
        for sig in _SCHEDULER_SIGNALS:
            signal.signal(sig, signal.SIG_IGN)
        forget_inherited_storage_sessions()
        if os.getppid() != self.owner:  # a forkserver's child: DataLoader watches the server
            threading.Thread(target=_exit_without, args=(self.owner,), daemon=True,
                             name="ringfeed-owner-watch").start()
        if self.then is not None:
            self.then(worker_id)


def _exit_without(owner: int) -> None:
    """End this worker once process `owner` is gone (as often as DataLoader checks a parent):
    the forkserver it was forked by lives on while its workers do."""
    while True:
        time.sleep(MP_STATUS_CHECK_INTERVAL)
        try:
            os.kill(owner, 0)
        except ProcessLookupError:
            os._exit(0)


def forkserver_context() -> multiprocessing.context.BaseContext:
    """The start method for loader workers of a process where fork() is unsafe (module
    docstring), its server running: started now, preloading this module, with the scheduler's
    signals blocked, which stays so through its exec and in every worker it forks. Sets this
    process's forkserver preload list (a multiprocessing setting)."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload([__name__])
    # blocked in this thread only: a signal for the process goes to another thread meanwhile,
    # or waits here until the mask is restored
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, _SCHEDULER_SIGNALS)
    try:
        multiprocessing.forkserver.ensure_running()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
    return context


_open_loaders: weakref.WeakSet[TorchLoader] = weakref.WeakSet()


def _close_open_loaders() -> None:
    for loader in list(_open_loaders):
        loader.close()


def _stop_workers_at_exit() -> None:
    """Workers ignore SIGTERM, and multiprocessing's exit handler stops leftover children with
    SIGTERM and then joins them: any worker still alive then (a loader dropped without close(),
    or one whose shutdown torch skipped because its own exit flag was already set) would hang
    the exit forever. SIGKILL the loader workers left."""
    if not any(proc.is_alive() for proc in list(_worker_processes)):
        return
    # DataLoader's SIGCHLD handler raises in this thread when a worker dies by a signal: that
    # would abort this loop and leave the remaining workers to hang the join
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    for proc in list(_worker_processes):
        if proc.is_alive():
            proc.kill()
            proc.join(timeout=5)


# Every worker process a TorchLoader started (the Process objects forget their target).
_worker_processes: weakref.WeakSet = weakref.WeakSet()


# Runs in multiprocessing's exit handler before it terminates and joins children.
multiprocessing.util.Finalize(None, _stop_workers_at_exit, exitpriority=100)


def _as_tensor(value: Any) -> Any:
    """A batch field as DataLoader's default_convert leaves it: numeric arrays as tensors
    sharing their memory, string and object arrays as they are, lists element by element."""
    if isinstance(value, np.ndarray):
        return torch.as_tensor(value) if value.dtype.kind in "biufc" else value
    return default_convert(value)


def _as_tensors(batch: dict[str, Any]) -> dict[str, Any]:
    """The batch as DataLoader would hand it over (run in the pipeline's reader thread)."""
    return {name: _as_tensor(value) for name, value in batch.items()}


def _worker_context(context: StreamContext, loader_kwargs: dict[str, Any]) -> StreamContext:
    """What loader workers read with: images left uint8 when the pipeline normalizes them and
    no transform needs them normalized first, so a batch crosses to the training process in a
    quarter of the bytes (128 x 224 x 224 x 3 floats: 77 MB per batch copied into a fresh
    shared-memory segment by the worker, then faulted in by the trainer) and is normalized
    there (`_normalize_images`), bit for bit as in the worker. Not when batches are pinned for
    CUDA: the float batch then leaves for the GPU as it is."""
    decoder = context.decoder
    pinned = loader_kwargs.get("pin_memory", torch.cuda.is_available())
    if decoder.normalize is None or decoder.transform is not None or not decoder.decode_images \
            or pinned:
        return context
    return replace(context, decoder=replace(decoder, normalize_later=True))


def _normalized(pixels: torch.Tensor, decoder: Decoder) -> torch.Tensor:
    """uint8 pixels as x * scale - shift in float32 on their device: Decoder.normalized's
    floats, bit for bit."""
    scale = torch.as_tensor(decoder.pixel_scale, device=pixels.device)
    shift = torch.as_tensor(decoder.pixel_shift, device=pixels.device)
    return pixels.float().mul_(scale).sub_(shift)


def _normalize_images(batch: dict[str, Any], decoder: Decoder) -> None:
    """The uint8 image fields of a batch from a worker that left them so, normalized in place
    of them."""
    for name in decoder.image_fields(batch):
        value = batch[name]
        if isinstance(value, torch.Tensor) and value.dtype == torch.uint8:
            batch[name] = _normalized(value, decoder)
        elif isinstance(value, list):
            batch[name] = [decoder.normalized(np.asarray(v)) for v in value]


class TorchLoader:
    """Iterate for one pass over the rest of the current epoch (the next epoch once this one
    is complete); `len()` is the full epoch's batch count."""

    def __init__(self, pipe: ShardPipeline, **loader_kwargs: Any) -> None:
        self.pipe = pipe
        workers = pipe.config.num_workers
        dataset: _PassDataset | _StreamDataset = _PassDataset(pipe)
        if workers > 0:  # worker processes learn each pass from shared memory
            pipe.read_in_workers()  # and read the next epoch when it is asked for
            start = loader_kwargs.get("multiprocessing_context")
            self._state = _PassState(start if isinstance(start, multiprocessing.context.BaseContext)
                                     else multiprocessing.get_context(start))
            context = _worker_context(pipe.context, loader_kwargs)
            dataset = _StreamDataset(context, pipe.progress.planner.fresh(), pipe.streams,
                                     self._state)
        self.normalize_here = isinstance(dataset, _StreamDataset) and \
            dataset.context.decoder.normalize_later  # (_worker_context)
        options: dict[str, Any] = {
            "batch_size": None,  # the streams batch themselves
            "num_workers": workers,
            "pin_memory": torch.cuda.is_available(),
            "persistent_workers": workers > 0,
        }
        if workers > 0:
            options["prefetch_factor"] = max(1, pipe.config.prefetch)
        options.update(loader_kwargs)
        # no DataLoader between the pipeline's threads and the caller unless it has work to do
        self.direct = workers == 0 and not options["pin_memory"] and not loader_kwargs
        if workers > 0:
            options["worker_init_fn"] = _WorkerInit(os.getpid(), options.get("worker_init_fn"))
            if not _open_loaders:
                # atexit runs last-registered first: registered again now, the close runs before
                # torch's exit hook sets the flag that turns DataLoader's worker shutdown into a
                # no-op, and before multiprocessing terminates and joins the children
                atexit.unregister(_close_open_loaders)
                atexit.register(_close_open_loaders)
            _open_loaders.add(self)
        self.loader = None if self.direct else DataLoader(dataset, **options)

    def __len__(self) -> int:
        return self.pipe.batches_per_epoch

    def close(self) -> None:
        """Stop the worker processes now (iterating again starts new ones)."""
        if self.loader is None:
            return
        iterator, self.loader._iterator = self.loader._iterator, None  # the persistent one
        shutdown = getattr(iterator, "_shutdown_workers", None)
        if shutdown is not None:
            shutdown()

    def __iter__(self) -> Iterator[dict[str, Any]]:
        batches = self._batches()
        if self.pipe.config.decode_device == "cuda":
            device = self._decode_device()
            return (self._decoded_on_gpu(batch, epoch, device) for epoch, batch in batches)
        return (batch for _, batch in batches)

    @staticmethod
    def _decode_device() -> torch.device:
        """decode_device="cuda": the current CUDA device."""
        return torch.device("cuda", torch.cuda.current_device())

    def _decoded_on_gpu(self, batch: dict[str, Any], epoch: int, device: torch.device
                        ) -> dict[str, Any]:
        """decode_device="cuda": the image fields arrive as encoded bytes and are decoded here
        with nvJPEG, a batch at a time, into uint8 NHWC tensors on the GPU (then normalized
        there when the pipeline normalizes); with `augment`, cropped, resized, flipped and
        jittered there too, each sample as (seed, `epoch`, its key) decides on the CPU path
        (gpu_augment.py)."""
        from ringfeed.pipeline.gpu_augment import decode_augment_batch
        from ringfeed.pipeline.gpu_decode import decode_jpeg_batch

        decoder = self.pipe.context.decoder
        for name in decoder.image_fields_encoded(batch):
            if decoder.augment is not None:
                batch[name] = decode_augment_batch(
                    list(batch[name]), batch["__key__"], decoder.augment, decoder.seed, epoch,
                    device, channels=decoder.channels, scale=decoder.pixel_scale,
                    shift=decoder.pixel_shift)
                continue
            pixels = decode_jpeg_batch(list(batch[name]), decoder.image_size, device,
                                       decoder.channels)
            batch[name] = pixels if decoder.normalize is None else _normalized(pixels, decoder)
        return batch

    def _batches(self) -> Iterator[tuple[int, dict[str, Any]]]:
        """(epoch, batch) pairs, the counters booked."""
        pipe = self.pipe
        if pipe.config.num_workers == 0:
            # the pipeline's own pass, made tensors in its reader thread (direct) or by the
            # DataLoader (pinned with CUDA); counters booked
            for booked in (pipe.iterate(count=False, convert=_as_tensors) if self.direct
                           else self.loader):
                pipe.mark_consumed(booked.tag, len(booked.batch["__index__"]), strict=True)
                yield booked.tag[0], booked.batch
            return
        plan, t0, _ = pipe.begin()
        self._state.write({"epoch": plan.epoch, "segments": pipe.progress.segment_dicts(),
                           "t0": t0})
        batches = iter(self.loader)
        _worker_processes.update(getattr(batches, "_workers", ()))
        while True:
            started = time.perf_counter()
            try:
                booked = next(batches)
            except StopIteration:
                return
            if isinstance(booked, _WorkerError):
                # Stop the workers now: left to the garbage collector, torch's shutdown of an
                # iterator whose pass failed waited out its join timeouts (20 s for two).
                self.close()
                raise booked.error(*booked.args)
            batch = booked.batch
            for name, dtype in _SMALL_FIELDS.items():
                if isinstance(batch[name], list):
                    batch[name] = torch.tensor(batch[name], dtype=dtype)
            for name, value in batch.items():
                if isinstance(value, _Inline):
                    tensor = torch.from_numpy(value.array)
                    batch[name] = tensor.pin_memory() if self.loader.pin_memory else tensor
            if self.normalize_here:
                _normalize_images(batch, pipe.context.decoder)
            yield booked.tag[0], pipe.received(booked, time.perf_counter() - started).batch


def make_loader(pipe: ShardPipeline, **loader_kwargs: Any) -> TorchLoader:
    """A DataLoader-backed iterable with `pipe.config.num_workers` workers, pin_memory when CUDA is
    available and persistent workers; extra keyword arguments go to DataLoader (timeout,
    multiprocessing_context: forkserver_context() in a process whose native threads call into
    Python, ...). Yields dict[str, torch.Tensor | list]."""
    if "num_workers" in loader_kwargs or "batch_size" in loader_kwargs:
        raise ValueError("set num_workers and batch_size on the ShardPipeline (they shape the "
                         "plan), not on the loader")
    return TorchLoader(pipe, **loader_kwargs)

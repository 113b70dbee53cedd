"""What the shared loop needs from a framework layer, and the pieces both layers share.

A backend owns the model, the optimizer, the loss scaler and Horovod for one framework. The
loop (train/loop.py) never touches tensors; it calls these methods with pipeline batches and
plain Python numbers. `Backend` is the union of one small protocol per concern: StepBackend
(the model and its train/eval steps), CheckpointBackend (payload and resume), Collectives
(plain values across ranks), ReplicaSync (local SGD and allreduce traffic) and ElasticBackend
(Horovod Elastic).
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from ringfeed.errors import UserError
from ringfeed.train.backends.horovod_env import apply_horovod_env, check_controller
from ringfeed.train.backends.reduce_op import check_reduce_op
from ringfeed.train.data import REGRESS, DataSpec, TrainPipeline
from ringfeed.train.losses import regression_fns
from ringfeed.train.mixing import MixAt, check_mixing
from ringfeed.train.observe.profiler import no_span
from ringfeed.train.resilience.watchdog import hang_timeout_s
from ringfeed.userhooks import load_callable

# Per-step agreement vector, allreduced with op=Average on every step. Any rank's request
# makes the average > 0 on all ranks, so every rank takes the same decision at the same step.
# Both backends hand it to Horovod together with the step's gradients (torch: submitted before
# the last micro-batch's backward pass; TensorFlow: in the same tf.function), so it costs no
# negotiation cycle of its own.
STATS_LOSS, STATS_SAVE, STATS_STOP = 0, 1, 2
STATS_METRICS = 3  # the step's training metrics follow (StepResult.metrics)

Span = Callable[[str], AbstractContextManager]  # a named range of a profiler trace


@dataclass(frozen=True)
class Dist:
    rank: int
    size: int
    local_rank: int

    @property
    def is_root(self) -> bool:
        return self.rank == 0


class StepResult:
    """What one optimizer step reports to the loop.

    `loss` and the save/stop requests come from the step's agreement allreduce, already Python
    numbers: the loop decides on them every step. `applied`, `grad_norm` and `loss_scale` may be
    handed over as framework scalars (a device tensor, a 0-d array): they are turned into Python
    numbers only when read, which the loop does on log steps, so an ordinary step pays no host
    synchronisation for them. `collective_s` is what this rank measured itself: the seconds it
    was blocked in the step's collectives (the per-rank figures take its own work as the step
    time less this, train/observe/ranks.py). `metrics`: the built-in metrics of the step's
    training outputs (accuracy, top-k; mse, mae), averaged over ranks and micro-batches by the
    agreement allreduce itself."""

    __slots__ = ("loss", "save_requested", "stop_requested", "collective_s", "metrics",
                 "_applied", "_grad_norm", "_loss_scale")

    def __init__(self, loss: float, applied: Any = True, save_requested: bool = False,
                 stop_requested: bool = False, grad_norm: Any = None, loss_scale: Any = None,
                 collective_s: float = 0.0, metrics: dict[str, float] | None = None):
        self.loss = loss  # mean over all ranks and micro-batches of this step
        self.metrics = metrics or {}
        self.save_requested = save_requested
        self.stop_requested = stop_requested
        # torch: the wait for the gradient and agreement allreduces; TensorFlow: the whole
        # step, one compiled function around its collectives
        self.collective_s = collective_s
        # False: the update was skipped (fp16 overflow, or a non-finite loss)
        self._applied = applied
        self._grad_norm = grad_norm
        self._loss_scale = loss_scale

    @classmethod
    def from_stats(cls, stats: list[float], applied: Any, metric_names: tuple[str, ...] = (),
                   **extra: Any) -> StepResult:
        """From the agreement vector: [loss, save, stop, *the metrics `metric_names`, ...]."""
        metrics = dict(zip(metric_names, stats[STATS_METRICS:], strict=False))
        return cls(loss=stats[STATS_LOSS], applied=applied, save_requested=stats[STATS_SAVE] > 0,
                   stop_requested=stats[STATS_STOP] > 0, metrics=metrics, **extra)

    @property
    def applied(self) -> bool:
        if not isinstance(self._applied, bool):
            self._applied = bool(self._applied)
        return self._applied

    @property
    def grad_norm(self) -> float | None:
        if self._grad_norm is not None and not isinstance(self._grad_norm, float):
            self._grad_norm = float(self._grad_norm)
        return self._grad_norm

    @property
    def loss_scale(self) -> float | None:
        if self._loss_scale is not None and not isinstance(self._loss_scale, float):
            self._loss_scale = float(self._loss_scale)
        return self._loss_scale

    @property
    def finite(self) -> bool:
        return math.isfinite(self.loss)


class StepBackend(Protocol):
    """The model and its steps: build it, feed it, train and evaluate it."""

    name: str
    dist: Dist
    cpu_threads: int | None  # the intra-op threads it computes with (None: the framework's own)

    def build(self, spec: DataSpec, accumulate: int | None = None) -> None:
        """Create model, optimizer, loss scaler for steps of `accumulate` micro-batches (None:
        train.accumulate); nothing collective."""

    def loader(self, pipe: TrainPipeline) -> Any:
        """An iterable over `pipe`'s batches as framework tensors; iter() once per epoch."""

    def train_step(self, micro_batches: list[dict[str, Any]], lr: float,
                   requests: tuple[float, float] = (0.0, 0.0), span: Span = no_span,
                   at: MixAt = None) -> StepResult:
        """One optimizer step over the `accumulate` micro-batches given to build() (asserted),
        one gradient allreduce. `requests` = (save, stop) flags of this rank, agreed across ranks;
        `span(name)`: a named range of the profiler's trace (torch: forward, backward,
        allreduce, optimizer_step; TensorFlow names them inside its graph instead); `at`:
        (epoch, steps done), what MixUp/CutMix draw from (required when they are on)."""

    def eval_batch(self, batch: dict[str, Any], groups: Groups | None = None
                   ) -> dict[str, float]:
        """Sums over the batch's valid samples: "count", "loss" and each metric; with `groups`
        (a group per sample, and how many there are) also per group, as "{g}/{name}"."""

    def weights(self) -> list[Any]:
        """The model's parameters as numpy arrays (tests, equivalence checks)."""


class CheckpointBackend(Protocol):
    """Checkpoints (train/checkpoint/files.py writes the directory, the backend its payload)."""

    def rng_states(self) -> Any:
        """Collective: every rank's RNG state, gathered on rank 0 (None elsewhere)."""

    def payload(self, rng_states: Any, copy: bool) -> Callable[[Path], None]:
        """Rank 0: the function that writes model, optimizer, scaler (and `rng_states`) into a
        directory. Without `copy` it writes the live objects, so it must run before the next
        step; with `copy` it writes a host-memory copy taken now (device -> host), so training
        may go on while another thread writes it."""

    def read_payload(self, directory: Path) -> None:
        """Rank 0: load what payload() wrote into the live objects."""

    def sync_from_root(self, resumed: bool) -> None:
        """Collective: all ranks take rank 0's state (weights; after a resume also optimizer,
        scaler and, at the same world size, each rank's own RNG state)."""


class Collectives(Protocol):
    """Plain Python values across ranks: the loop's agreements, metrics and sample log."""

    def allreduce_sum(self, values: dict[str, float]) -> dict[str, float]:
        """Element-wise sum across ranks (same keys on every rank)."""

    def broadcast_object(self, obj: Any) -> Any:
        """Collective: rank 0's `obj` on every rank."""

    def gather_object(self, obj: Any) -> list[Any]:
        """Collective: every rank's `obj`, in rank order, on every rank."""


class ReplicaSync(Protocol):
    """How the replicas stay one model (a gradient allreduce every step, or local SGD's
    averaging every train.sync_every steps) and what that costs."""

    def sync_replicas(self) -> None:
        """Collective: average the replicas now if local SGD steps were taken since the last
        sync (no-op for sync_every: 1, or right after a sync), and the BatchNorm running
        statistics if steps changed them since (train.average_bn_stats). Call before
        validation, every checkpoint and the end of training, so they see one model, not rank
        0's own: every rank validates with the statistics a checkpoint holds."""

    def comm_stats(self) -> dict[str, float]:
        """This rank's gradient/parameter allreduce payload so far: CommStats.as_dict()."""


class ElasticBackend(Protocol):
    """Horovod Elastic for the framework (train/resilience/elastic.py)."""

    def refresh_dist(self) -> Dist:
        """Rank and size again, after Horovod was re-initialised at another world size."""

    def elastic_state(self, **values: Any) -> Any:
        """A Horovod elastic State over model, optimizer (and loss scaler), plus plain values."""

    def elastic_run(self, fn: Any) -> Any:
        """The framework's `hvd.elastic.run(fn)`."""

    def after_rollback(self) -> None:
        """Drop what a step cut short by a failure left behind (partial gradients)."""


class Backend(StepBackend, CheckpointBackend, Collectives, ReplicaSync, ElasticBackend,
              Protocol):
    """Everything the loop needs from one framework (backends/torch.py, backends/tf.py)."""


class HorovodBackend:
    """The set-up and bookkeeping both framework backends share (backends/torch.py,
    backends/tf.py subclass it): Horovod started with the config's knobs, the GPU choice's
    gather, k micro-batches per step, the sync period and allreduce counts, the task's loss and
    metrics (or the user's), the per-rank seed, Horovod's plain-object collectives.

    Rules: `start()` runs first in the subclass's __init__ and `setup_steps()` first in its
    build(); after an applied step the subclass calls `_count_step()`."""

    name: str  # "torch" | "tensorflow"
    hvd: Any  # horovod.torch | horovod.tensorflow
    sep: str  # in Horovod op names: "." (torch) or "_" (TensorFlow's names allow no dots)
    cfg: Any  # RunConfig
    dist: Dist
    spec: DataSpec
    accumulate: int  # k micro-batches per optimizer step (asserted by train_step)
    sync_every: int
    comm: CommStats
    loss_fn: Callable
    metrics_fn: Callable
    _local_steps: int  # optimizer steps taken; a sync follows every sync_every-th
    _unsynced: int  # local steps since the last sync
    _grad_bytes: int  # one gradient allreduce's payload

    def start(self, cfg: Any) -> None:
        """hvd.init() with the config's knobs."""
        self.dist = start_horovod(self.hvd, cfg)
        self.cfg = cfg

    def gpu_gather(self) -> Callable[[GpuView], list[GpuView]] | None:
        """The gather choose_gpu() needs: every rank's view (None in elastic runs)."""
        if self.cfg.elastic.enabled:
            return None
        return lambda view: self.hvd.allgather_object(view, name="ringfeed.gpus")

    def setup_steps(self, spec: DataSpec, accumulate: int | None,
                    default_fns: tuple[Callable, Callable]) -> None:
        """What a step needs besides the model: `accumulate` (None: train.accumulate), the
        sync period and its counters, the loss and metrics (train.loss/metrics, else MSE for
        float targets, else `default_fns`). The built-in metrics are also taken on every
        training step (StepResult.metrics); a user's train.metrics only in validation."""
        t = self.cfg.train
        self.spec = spec
        self.accumulate = t.accumulate if accumulate is None else accumulate
        self.sync_every = t.sync_every
        self.comm = CommStats(t.sync_every)
        self._local_steps = 0
        self._unsynced = 0
        loss_fn, metrics_fn = (regression_fns(self.name, spec) if spec.task == REGRESS
                               else default_fns)
        self.loss_fn = load_callable(t.loss, "train.loss") if t.loss else loss_fn
        self.metrics_fn = load_callable(t.metrics, "train.metrics") if t.metrics else metrics_fn
        check_mixing(t, spec.task, len(spec.input_shape) == 3)

    def rank_seed(self) -> int:
        """This rank's own random stream (dropout masks differ across replicas, as in DDP)."""
        return self.cfg.train.seed * 1000 + self.dist.rank + 1

    def check_accumulate(self, micro_batches: list[Any]) -> int:
        """k, asserted to be the number of micro-batches given."""
        k = self.accumulate
        assert len(micro_batches) == k, f"{len(micro_batches)} micro-batches, accumulate={k}"
        return k

    def train_metrics_fn(self) -> Callable | None:
        """The metrics each training step takes from its outputs: the built-in ones (None
        under a user's train.metrics, which may be costly or made for validation)."""
        return None if self.cfg.train.metrics else self.metrics_fn

    def sync_replicas(self) -> None:
        raise NotImplementedError

    def _count_step(self, samples: int) -> None:
        """After an applied step: count the gradient allreduce's bytes (synchronous), or the
        local step and, every sync_every-th one, the replicas' averaging (local SGD)."""
        self._local_steps += 1
        self.comm.step(samples)
        if self.sync_every == 1:
            self.comm.sync(self._grad_bytes)
            return
        self._unsynced += 1
        if self._local_steps % self.sync_every == 0:
            self.sync_replicas()

    # (ReplicaSync, Collectives and ElasticBackend methods both frameworks share)
    def comm_stats(self) -> dict[str, float]:
        return self.comm.as_dict()

    def broadcast_object(self, obj: Any) -> Any:
        return self.hvd.broadcast_object(obj, root_rank=0, name=f"ringfeed{self.sep}object")

    def gather_object(self, obj: Any) -> list[Any]:
        return self.hvd.allgather_object(obj, name=f"ringfeed{self.sep}gather")

    def refresh_dist(self) -> Dist:
        hvd = self.hvd
        self.dist = Dist(hvd.rank(), hvd.size(), hvd.local_rank())
        return self.dist


GpuView = tuple[int, Any, int]  # (host, the identity of the devices a rank sees, their count)


class CommStats:
    """What one rank hands to gradient and parameter allreduces (payload bytes, after fp16
    compression; a ring allreduce puts 2(n-1)/n times that on each link) and the samples it
    trained on, for summary.json's "allreduce bytes per sample". The per-step agreement vector
    (12 bytes) is not counted."""

    def __init__(self, sync_every: int):
        self.sync_every = sync_every
        self.bytes = 0
        self.samples = 0
        self.steps = 0
        self.syncs = 0  # gradient allreduces (sync_every 1) or parameter averagings

    def step(self, samples: int) -> None:
        self.steps += 1
        self.samples += samples

    def sync(self, nbytes: int) -> None:
        self.syncs += 1
        self.bytes += nbytes

    def as_dict(self) -> dict[str, float]:
        return {"allreduce_bytes_per_sample": self.bytes / self.samples if self.samples else 0.0,
                "allreduce_bytes": float(self.bytes), "samples": float(self.samples),
                "steps": float(self.steps), "syncs": float(self.syncs),
                "sync_every": float(self.sync_every)}


def start_horovod(hvd: Any, cfg: Any) -> Dist:
    """hvd.init() (horovod.torch or horovod.tensorflow) with the config's `horovod:` knobs,
    checked against what the launch gave; this rank's place in the job."""
    # Horovod reads its knobs in init() only
    apply_horovod_env(cfg.horovod, hang_timeout_s=hang_timeout_s(cfg))
    hvd.init()
    check_controller(cfg.horovod, hvd.mpi_enabled(), hvd.gloo_enabled())
    check_reduce_op(cfg.horovod, hvd.size(), hvd.mpi_enabled())
    return Dist(hvd.rank(), hvd.size(), hvd.local_rank())


def cpu_threads_per_rank(local_size: int) -> int | None:
    """The intra-op threads one of `local_size` ranks on this host should use: its usable cores
    split between them, as torchrun sets OMP_NUM_THREADS for several processes per node.
    torch's default (every core, per rank) oversubscribes them, and its OpenMP threads spin:
    the demo's 2 torch ranks on the 2-core box took 53 s without OMP_NUM_THREADS and 12.5 s
    with 1 thread each. None: leave torch's default (the user set OMP_NUM_THREADS, one rank
    per host, or the launcher bound this rank to fewer cores than the host has)."""
    if "OMP_NUM_THREADS" in os.environ or local_size <= 1:
        return None
    usable = len(os.sched_getaffinity(0))
    if usable < (os.cpu_count() or usable):  # bound by mpirun/srun: torch follows the binding
        return None
    return max(1, usable // local_size)


def gpu_for_rank(rank: int, views: list[GpuView], share: bool) -> int | None:
    """Which of its visible GPUs rank `rank` trains on (None: it has none, train on the CPU).

    `views[r]` is rank r's (host, devices, GPUs it sees): Horovod's cross_rank names the host,
    the devices are their UUIDs (torch) or CUDA_VISIBLE_DEVICES (TensorFlow). Ranks of one host
    that see the same devices split them in rank order: horovodrun's default (every rank sees
    every GPU) gives local rank i GPU i, and a launcher that binds GPUs per rank (Slurm
    --gpus-per-task) gives each rank its own GPU 0. More ranks than GPUs is an error on every
    rank alike (two replicas on one GPU halve its speed and can run it out of memory) unless
    `share` asks for it."""
    groups: dict[GpuView, list[int]] = {}
    for r, view in enumerate(views):
        groups.setdefault(view, []).append(r)
    for (_, visible, count), ranks in groups.items():
        if count and len(ranks) > count and not share:
            shown = (f"CUDA_VISIBLE_DEVICES={visible}" if isinstance(visible, str)
                     else "the same devices")
            raise UserError(
                f"{len(ranks)} ranks on one host share {count} visible GPU(s) ({shown}): start "
                f"at most {count} rank(s) per host (horovodrun -H host:{count}), or set "
                "train.share_gpus: true to put several ranks on one GPU")
    count = views[rank][2]
    return groups[views[rank]].index(rank) % count if count else None


def choose_gpu(view: GpuView, rank: int, local_rank: int, local_size: int, share: bool,
               gather: Callable[[GpuView], list[GpuView]] | None) -> int | None:
    """gpu_for_rank over every rank's view, gathered with `gather` (the framework's
    allgather_object). Elastic runs pass None: a worker joining a running job must meet
    Horovod's sync before any collective, so there each rank assumes the ranks of its host see
    what it sees (horovodrun's default)."""
    if gather is None:
        return gpu_for_rank(local_rank, [view] * local_size, share)
    return gpu_for_rank(rank, gather(view), share)


# (a group index per sample, the number of groups): e.g. a mixture's source of each sample
Groups = tuple[np.ndarray, int]


def metric_sums(per_sample: dict[str, Any], valid: Any | None, to_float,
                groups: Groups | None = None, as_vector=None) -> dict[str, float]:
    """{"count", name: sum of per-sample values over valid samples} with `to_float(x)` turning a
    framework vector into a Python float sum; the padding of `balance: pad` is excluded. With
    `groups`, the same sums per group g as "{g}/count", "{g}/{name}" (`as_vector` turns a numpy
    0/1 mask into the framework's vector)."""
    first = next(iter(per_sample.values()))
    sums = {"count": float(len(first)) if valid is None else to_float(valid)}
    for name, values in per_sample.items():
        sums[name] = to_float(values if valid is None else values * valid)
    if groups is not None:
        labels, count = groups
        for g in range(count):
            mask = as_vector((np.asarray(labels) == g).astype(np.float64))
            if valid is not None:
                mask = mask * valid
            sums[f"{g}/count"] = to_float(mask)
            for name, values in per_sample.items():
                sums[f"{g}/{name}"] = to_float(values * mask)
    return sums

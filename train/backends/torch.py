"""PyTorch + Horovod: DistributedOptimizer with backward_passes_per_step for accumulation,
autocast (bf16/fp16) and GradScaler (fp16), checkpoints loadable with weights_only=True.

Local SGD (train.sync_every: H > 1) uses the plain torch optimizer instead (no allreduce hooks
on the gradients: a DistributedOptimizer's hooks fire on every k-th backward pass, so skipping
them would need every handle cancelled) and averages the parameters, and with
sync_optimizer_state the per-parameter moments, in one allreduce every H steps.

The fp16 step follows Horovod's recipe so that the overflow check sees the *allreduced*
gradients, which are identical on every rank: synchronize() -> unscale_() -> clip ->
step() under skip_synchronize(). An inf on one rank becomes an inf on all ranks after the
average, so GradScaler skips the step on all of them together.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import horovod.torch as hvd
import torch
import torch.nn.functional as F
from horovod.torch.elastic.state import StateHandler, get_handler_registry, set_handler_registry

from ringfeed.errors import UserError, model_mismatch, optimizer_mismatch, state_dict_differences
from ringfeed.formats.tokens import DOC_IDS
from ringfeed.train.backends.base import (
    Dist,
    Groups,
    HorovodBackend,
    Span,
    StepResult,
    choose_gpu,
    cpu_threads_per_rank,
    metric_sums,
)
from ringfeed.train.backends.init_weights import load_torch
from ringfeed.train.backends.reduce_op import (
    adasum,
    drop_adasum_step,
    torch_optimizer_args,
)
from ringfeed.train.backends.sync_bn import convert_sync_batchnorm
from ringfeed.train.checkpoint.files import open_for_write
from ringfeed.train.data import LM, DataSpec, TrainPipeline, split_batch
from ringfeed.train.mixing import MixAt, mixed_loss, mixed_torch_inputs
from ringfeed.train.models import build_model, channels_first
from ringfeed.train.models.outputs import on_logits
from ringfeed.train.observe.profiler import no_span
from ringfeed.train.observe.throughput import FlopCount, count_torch_flops

STATE_FILE = "state.pt"
AMP_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor,
                  label_smoothing: float = 0.0) -> torch.Tensor:
    """Per-sample cross entropy (against targets smoothed by `label_smoothing`, as
    CrossEntropyLoss's); for sequences (B, T, V) the mean over the T positions."""
    logits = logits.float()
    if logits.dim() == 3:
        b, t, v = logits.shape
        return F.cross_entropy(logits.reshape(b * t, v), targets.reshape(b * t),
                               reduction="none", label_smoothing=label_smoothing).view(b, t).mean(1)
    return F.cross_entropy(logits, targets, reduction="none", label_smoothing=label_smoothing)


def accuracy(logits: torch.Tensor, targets: torch.Tensor,
             topk: int | None = None) -> dict[str, torch.Tensor]:
    """Per-sample accuracy and, with more than `topk` classes, top-k accuracy ("top5"): the
    target is in the top k when fewer than k classes score higher (ties count in, as
    tf.math.in_top_k); for sequences the mean over the positions."""
    metrics = {"accuracy": (logits.argmax(-1) == targets).float()}
    if topk is not None and logits.shape[-1] > topk:
        target_logit = logits.gather(-1, targets.long().unsqueeze(-1))
        metrics[f"top{topk}"] = ((logits > target_logit).sum(-1) < topk).float()
    return {name: v.mean(1) if v.dim() == 2 else v for name, v in metrics.items()}


def document_inputs(model: torch.nn.Module, batch: dict[str, Any], device: torch.device
                    ) -> dict[str, torch.Tensor]:
    """What a model takes beside its inputs: one with `document_mask` set (the built-in gpt's
    option) gets the batch's DOC_IDS as `doc_ids`, sliced as split_batch slices the tokens into
    inputs; any other, nothing. UserError (exit 2) when the batches carry none."""
    if not getattr(model, "document_mask", False):
        return {}
    ids = batch.get(DOC_IDS)
    if ids is None:
        raise UserError(f"model.args.document_mask: the batches have no {DOC_IDS} field (the "
                        "shards do not record documents: shard the text again with `ringfeed "
                        "shard --format text`, or leave document_mask false)")
    return {"doc_ids": torch.as_tensor(ids)[:, :-1].to(device, non_blocking=True)}


def make_optimizer(optim, params) -> torch.optim.Optimizer:
    if optim.name == "sgd":
        return torch.optim.SGD(params, lr=optim.lr, momentum=optim.momentum,
                               weight_decay=optim.weight_decay)
    cls = torch.optim.Adam if optim.name == "adam" else torch.optim.AdamW
    return cls(params, lr=optim.lr, betas=optim.betas, weight_decay=optim.weight_decay)


class DenseLayout:
    """Horovod compression wrapper: Horovod reduces only contiguous tensors, and the gradient of
    a channels_last (or otherwise strided) weight has the weight's strides. Such a gradient goes
    to the allreduce as a contiguous copy and comes back in its own strides; contiguous ones
    pass through untouched."""

    def __init__(self, inner: type[hvd.Compression.none]):
        self.inner = inner

    def compress(self, tensor: torch.Tensor) -> tuple[torch.Tensor, Any]:
        out, ctx = self.inner.compress(tensor)
        if out.is_contiguous():
            return out, (ctx, None)
        return out.contiguous(), (ctx, tensor.stride())

    def decompress(self, tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
        inner_ctx, stride = ctx
        out = self.inner.decompress(tensor, inner_ctx)
        if stride is None:
            return out
        return torch.empty_strided(out.shape, stride, dtype=out.dtype,
                                   device=out.device).copy_(out)


def broadcast_tensors(tensors: dict[str, torch.Tensor], root_rank: int = 0) -> None:
    """hvd.broadcast_parameters for tensors of any memory format: a non-contiguous one (a
    channels_last weight) is broadcast through a contiguous buffer and copied back in place."""
    pending = []
    for name, tensor in sorted(tensors.items()):
        buffer = tensor if tensor.is_contiguous() else tensor.contiguous()
        pending.append((tensor, buffer, hvd.broadcast_async_(buffer, root_rank, name=name)))
    for tensor, buffer, handle in pending:
        hvd.synchronize(handle)
        if buffer is not tensor:
            tensor.copy_(buffer)


def average_tensors(tensors: list[torch.Tensor], name: str) -> int:
    """Average `tensors` across ranks in place, one flat allreduce per dtype (one Horovod
    negotiation; strided tensors such as channels_last weights are copied back in their own
    layout). Returns the bytes handed to Horovod."""
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in tensors:
        by_dtype.setdefault(t.dtype, []).append(t)
    total = 0
    for dtype, group in sorted(by_dtype.items(), key=lambda item: str(item[0])):
        flat = torch.cat([t.reshape(-1) for t in group])
        hvd.allreduce_(flat, op=hvd.Average, name=f"{name}.{str(dtype).removeprefix('torch.')}")
        offset = 0
        for t in group:
            t.copy_(flat[offset:offset + t.numel()].view(t.shape))
            offset += t.numel()
        total += flat.numel() * flat.element_size()
    return total


class HostCopy:
    """Copies of a state dict's tensors in host memory, for a checkpoint written while
    training goes on. The buffers are kept and refilled by the next copy (no allocation, no
    page faults after the first): the checkpointer writes one copy at a time and takes the
    next only once the previous is written. On a GPU they are pinned, so the device-to-host
    copies run at full speed. Tensors that share storage (tied weights) share their copy."""

    def __init__(self) -> None:
        self._buffers: dict[tuple, torch.Tensor] = {}

    def take(self, obj: Any) -> Any:
        """`obj` (nested dicts, lists, tuples) with every tensor copied to host memory."""
        buffers, self._buffers = self._buffers, {}
        return self._copy(obj, (), buffers, {})

    def _copy(self, obj: Any, path: tuple, old: dict[tuple, torch.Tensor],
              shared: dict[tuple, torch.Tensor]) -> Any:
        if isinstance(obj, torch.Tensor):
            storage = (obj.device, obj.data_ptr(), obj.dtype, tuple(obj.shape), obj.stride())
            if obj.numel() and storage in shared:
                return shared[storage]
            key = (path, obj.dtype, tuple(obj.shape))
            buffer = old.get(key)
            if buffer is None:
                buffer = torch.empty(obj.shape, dtype=obj.dtype, device="cpu",
                                     pin_memory=obj.device.type == "cuda")
            buffer.copy_(obj.detach())
            self._buffers[key] = shared[storage] = buffer
            return buffer
        if isinstance(obj, dict):
            return {k: self._copy(v, (*path, k), old, shared) for k, v in obj.items()}
        if isinstance(obj, (list, tuple)):
            return type(obj)(self._copy(v, (*path, i), old, shared) for i, v in enumerate(obj))
        return copy.deepcopy(obj)


class TorchCheckpoints:
    """The checkpoint payload of TorchBackend (CheckpointBackend, train/backends/base.py): model,
    optimizer, GradScaler and every rank's RNG state in one `state.pt`, loadable with
    weights_only=True; a resume gives every rank rank 0's state."""

    dist: Dist
    device: torch.device
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scaler: torch.amp.GradScaler
    sync_every: int
    _local_steps: int
    _unsynced: int
    _moments_everywhere: bool
    _loaded_rng: list[dict[str, torch.Tensor]] | None
    _host_copy: HostCopy
    broadcast_object: Callable[[Any], Any]
    _has_moments: Callable[[], bool]

    def rng_states(self) -> list[dict[str, torch.Tensor]] | None:
        state = {"torch": torch.get_rng_state()}
        if self.device.type == "cuda":
            state["cuda"] = torch.cuda.get_rng_state(self.device)
        gathered = hvd.allgather_object(state, name="ringfeed.rng")
        return gathered if self.dist.is_root else None

    def payload(self, rng_states: Any, copy: bool) -> Callable[[Path], None]:
        payload = {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(),
                   "scaler": self.scaler.state_dict(), "rng": rng_states}
        if self.sync_every > 1:  # where the sync period stands, for an exact resume
            payload["local_sgd_steps"] = self._local_steps
        if copy:
            payload = self._host_copy.take(payload)

        def write(directory: Path) -> None:
            with open_for_write(Path(directory) / STATE_FILE) as f:
                torch.save(payload, f)

        return write

    def read_payload(self, directory: Path) -> None:
        # weights_only: tensors and plain containers only, no arbitrary pickle.
        state = torch.load(Path(directory) / STATE_FILE, map_location="cpu", weights_only=True)
        differences = state_dict_differences(
            {k: tuple(v.shape) for k, v in state["model"].items()},
            {k: tuple(v.shape) for k, v in self.model.state_dict().items()})
        if differences:
            raise model_mismatch(directory, differences)
        self.model.load_state_dict(state["model"])
        try:  # torch names only the groups' sizes
            self.optimizer.load_state_dict(state["optimizer"])
        except ValueError as e:
            raise optimizer_mismatch(directory, e) from None
        self.scaler.load_state_dict(state["scaler"])
        self._loaded_rng = state["rng"]
        self._local_steps = int(state.get("local_sgd_steps", 0))

    def sync_from_root(self, resumed: bool) -> None:
        broadcast_tensors(self.model.state_dict())
        if not resumed:
            # Fresh optimizers are empty and identical on every rank. (Horovod's
            # broadcast_optimizer_state would run a zero-gradient step to create the state,
            # which applies weight decay and advances Adam's step count once.)
            return
        root = self.dist.is_root
        opt_state, scaler_state, rng, self._local_steps = self.broadcast_object(
            (self.optimizer.state_dict(), self.scaler.state_dict(), self._loaded_rng,
             self._local_steps) if root else None)
        if not root:
            self.optimizer.load_state_dict(opt_state)
            self.scaler.load_state_dict(scaler_state)
        self._unsynced = 0  # every rank holds rank 0's state now
        self._moments_everywhere = self._has_moments()
        if rng and len(rng) == self.dist.size:  # same world size: each rank its own stream
            torch.set_rng_state(rng[self.dist.rank]["torch"])
            if "cuda" in rng[self.dist.rank] and self.device.type == "cuda":
                torch.cuda.set_rng_state(rng[self.dist.rank]["cuda"], self.device)


class TorchElastic:
    """Horovod Elastic for TorchBackend (ElasticBackend, train/backends/base.py): the model,
    optimizer and GradScaler in Horovod's TorchState, each synced by a handler below."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scaler: torch.amp.GradScaler

    def elastic_state(self, **values: Any) -> hvd.elastic.TorchState:
        """Horovod's TorchState over the model, the optimizer and the GradScaler, plus plain
        `values`."""
        ours = {torch.nn.Module: _ModelHandler, torch.amp.GradScaler: _StateDictHandler,
                torch.optim.Optimizer: _StateDictHandler}
        set_handler_registry(list(ours.items()) +
                             [(t, h) for t, h in get_handler_registry() if t not in ours])
        return hvd.elastic.TorchState(model=self.model, optimizer=self.optimizer,
                                      scaler=self.scaler, **values)

    def elastic_run(self, fn: Callable) -> Callable:
        return hvd.elastic.run(fn)

    def after_rollback(self) -> None:
        # A step cut short by the failure leaves partial gradients behind (restoring the
        # optimizer already dropped Horovod's pending allreduce handles).
        for p in self.model.parameters():
            p.grad = None


class TorchReplicas:
    """What ranks average outside the gradient allreduce: Local SGD's replicas (the
    parameters and, with sync_optimizer_state, their optimizer tensors) and BatchNorm's
    running statistics (train.average_bn_stats), before each validation and checkpoint.
    Part of TorchBackend, which sets model, optimizer, cfg, dist, comm and the counters."""

    def _has_moments(self) -> bool:
        state = self.optimizer.state
        return all(len(state.get(p, ())) > 0 for p in self.model.parameters())

    def _replica_tensors(self) -> list[torch.Tensor]:
        """What a sync averages, in the same order on every rank: the parameters, then (with
        sync_optimizer_state, once every rank's optimizer has them) each parameter's
        optimizer tensors of its shape - SGD's momentum buffer, Adam's exp_avg and
        exp_avg_sq - but not Adam's step count, the same on every rank."""
        params = list(self.model.parameters())
        tensors = [p.data for p in params]
        if self.cfg.train.sync_optimizer_state and self._moments_everywhere:
            for p in params:
                tensors += [v for v in self.optimizer.state[p].values()
                            if isinstance(v, torch.Tensor) and v.shape == p.shape
                            and v.is_floating_point()]
        return tensors

    @torch.no_grad()
    def sync_replicas(self) -> None:
        if self._bn_stale and self.cfg.train.average_bn_stats and self.dist.size > 1:
            # timm's rule: the buffers named running_mean / running_var
            stats = [b for name, b in self.model.named_buffers()
                     if name.endswith(("running_mean", "running_var"))]
            if stats:
                average_tensors(stats, "ringfeed.bn_stats")
        self._bn_stale = False
        if self._unsynced == 0:
            return
        self.comm.sync(average_tensors(self._replica_tensors(), "ringfeed.local_sgd"))
        self._unsynced = 0


class TorchBackend(TorchCheckpoints, TorchElastic, TorchReplicas, HorovodBackend):
    name, hvd, sep = "torch", hvd, "."

    def __init__(self, cfg):
        self.start(cfg)
        threads = cpu_threads_per_rank(hvd.local_size())
        if threads is not None:
            torch.set_num_threads(threads)
        self.cpu_threads = torch.get_num_threads()
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        devices = tuple(str(torch.cuda.get_device_properties(i).uuid) for i in range(count))
        gpu = choose_gpu((hvd.cross_rank(), devices, count), self.dist.rank,
                         self.dist.local_rank, hvd.local_size(), cfg.train.share_gpus,
                         self.gpu_gather())
        if gpu is None:
            self.device = torch.device("cpu")
        else:
            torch.cuda.set_device(gpu)
            self.device = torch.device("cuda", gpu)
        self.amp_dtype = AMP_DTYPES.get(cfg.train.precision)
        self._loaded_rng: list[dict[str, torch.Tensor]] | None = None
        self._host_copy = HostCopy()

    # -- setup --------------------------------------------------------------------------------
    def build(self, spec: DataSpec, accumulate: int | None = None) -> None:
        cfg, t = self.cfg, self.cfg.train
        self.setup_steps(spec, accumulate, (
            functools.partial(cross_entropy, label_smoothing=t.label_smoothing),
            functools.partial(accuracy, topk=t.topk)))
        self._bn_stale = False  # BatchNorm statistics changed since they were last averaged
        torch.manual_seed(t.seed)
        self.model = build_model("torch", cfg.model.name, dict(cfg.model.args), spec)
        if cfg.model.init_from:
            load_torch(self.model, cfg.model.init_from)
        if cfg.model.sync_batchnorm:
            self.model = convert_sync_batchnorm(self.model, self.device)
        # image batches as (N, C, H, W), the layout torch models take (model.input_layout)
        self.nchw = channels_first("torch", cfg.model.input_layout, spec)
        if not t.loss:
            self.loss_fn = on_logits(self.loss_fn, torch.is_tensor, cfg.model.name)
        if not t.metrics:
            self.metrics_fn = on_logits(self.metrics_fn, torch.is_tensor, cfg.model.name)
        self.model.to(self.device)
        if t.channels_last:
            self.model.to(memory_format=torch.channels_last)
        # the compiled callable shares the module's parameters: the optimizer, Horovod's
        # gradient hooks, broadcasts and checkpoints all see the plain module
        self.forward = torch.compile(self.model) if t.compile else self.model
        self._moments_everywhere = False  # agreed: every rank's optimizer has its moments
        # a model's own param_groups(weight_decay) (the built-in gpt: decay on matrices only)
        groups = getattr(self.model, "param_groups", None)
        self.optimizer = make_optimizer(cfg.optim, groups(cfg.optim.weight_decay)
                                        if callable(groups) else self.model.parameters())
        if self.sync_every == 1:
            self.optimizer = hvd.DistributedOptimizer(
                self.optimizer,
                named_parameters=self.model.named_parameters(),
                compression=DenseLayout(hvd.Compression.fp16 if t.fp16_allreduce
                                        else hvd.Compression.none),
                backward_passes_per_step=self.accumulate,
                **torch_optimizer_args(cfg.horovod, hvd),
            )
        # what one step's gradient allreduce hands to Horovod (fp16 compression halves it)
        self._grad_bytes = sum(p.numel() * (2 if t.fp16_allreduce else p.element_size())
                               for p in self.model.parameters() if p.requires_grad)
        self.scaler = torch.amp.GradScaler(self.device.type, enabled=t.precision == "fp16")
        torch.manual_seed(self.rank_seed())

    def loader(self, pipe: TrainPipeline) -> Any:
        from ringfeed.pipeline.torch import forkserver_context, make_loader

        if pipe.config.num_workers == 0:
            return make_loader(pipe)
        # Workers come from a forkserver, never fork()ed from here: Horovod's background thread
        # makes a Python thread state whenever it releases a collective's tensors, and a fork at
        # that moment left a worker stuck in os.fork() and the job waiting for its batches for
        # ever (CPython < 3.10.15 / 3.11.10, gh-112275; pipeline/torch.py).
        return make_loader(pipe, multiprocessing_context=forkserver_context())

    # -- steps --------------------------------------------------------------------------------
    def _autocast(self):
        return torch.autocast(self.device.type, dtype=self.amp_dtype,
                              enabled=self.amp_dtype is not None)

    def _inputs(self, x: Any) -> torch.Tensor:
        x = torch.as_tensor(x).to(self.device, non_blocking=True)
        if x.dtype == torch.uint8:
            x = x.float().div_(255.0)
        elif x.is_floating_point():
            x = x.float()
        # NHWC -> (N, C, H, W) as a view: its memory stays NHWC, i.e. torch.channels_last
        return x.permute(0, 3, 1, 2) if self.nchw else x

    def _prepare(self, batch: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor, Any]:
        x, y, valid = split_batch(batch, self.spec)
        y = torch.as_tensor(y).to(self.device, non_blocking=True)
        if valid is not None:
            valid = torch.as_tensor(valid).to(self.device).float()
        return self._inputs(x), y, valid

    def _submit_stats(self, mean_loss: torch.Tensor, requests: tuple[float, float],
                      extra: tuple[float, ...] = (), metrics: tuple[torch.Tensor, ...] = ()):
        """Start the step's agreement allreduce of [loss, save, stop, *metrics, *extra] on the
        gradients' device (filled from Python numbers and the metrics' device scalars: no
        host-to-device copy, no synchronisation).
        Submitted just before the last backward pass, it is negotiated with the gradient
        allreduces that pass starts (or done while it runs), instead of in a Horovod cycle of
        its own after them."""
        stats = torch.stack([mean_loss, *(mean_loss.new_full((), v) for v in requests),
                             *metrics, *(mean_loss.new_full((), v) for v in extra)])
        return hvd.allreduce_async_(stats, op=hvd.Average, name="ringfeed.step_stats")

    def train_step(self, micro_batches: list[dict[str, Any]], lr: float,
                   requests: tuple[float, float] = (0.0, 0.0), span: Span = no_span,
                   at: MixAt = None) -> StepResult:
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        local = self.sync_every > 1
        # Local SGD: the agreement vector also says whether this rank's optimizer holds its
        # moments yet (an fp16 overflow skipping a rank's first steps leaves them uncreated),
        # so every rank averages the same list of tensors.
        extra = (float(self._has_moments()),) if local else ()
        self._bn_stale = True
        stats, samples = self._accumulate(micro_batches, requests, extra, span, at)
        synced = time.perf_counter()
        with span("ringfeed.allreduce"):
            if not local:
                self.optimizer.synchronize()
            # The one host synchronisation of a step: every rank decides on the same numbers.
            stats = hvd.synchronize(stats).tolist()
        # blocked here: the allreduce's own time and the wait for the slowest rank
        collective_s = time.perf_counter() - synced
        if not math.isfinite(stats[0]):
            # Nothing is applied: the loop stops the run on every rank (exit 3).
            drop_adasum_step(self.optimizer, hvd)  # (any other optimizer: nothing to drop)
            self.optimizer.zero_grad()
            return StepResult.from_stats(stats, applied=False, metric_names=self._metric_names,
                                         collective_s=collective_s)
        if local:
            self._moments_everywhere = stats[-1] == 1.0
        self.scaler.unscale_(self.optimizer)
        grad_norm = None
        if self.cfg.train.grad_clip:  # a tensor, read on log steps only
            grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(),
                                                       self.cfg.train.grad_clip)
        scale = applied = None
        if self.scaler.is_enabled():
            # (GradScaler.step reads its overflow flag on the host right after this anyway)
            scale = self.scaler.get_scale()
        # Local SGD: each rank's GradScaler decides on its own gradients (a rank may skip a
        # step the others apply); the sync below averages the replicas again. (Horovod's
        # Adasum optimizer has no skip_synchronize: its step() only adds the reduced updates)
        with span("ringfeed.optimizer_step"), \
                contextlib.nullcontext() if local or adasum(self.cfg.horovod, self.dist.size) \
                else self.optimizer.skip_synchronize():
            self.scaler.step(self.optimizer)
        self.scaler.update()
        if scale is not None:
            applied = self._applied(scale)
        self.optimizer.zero_grad()
        self._count_step(samples)
        return StepResult.from_stats(stats, applied=True if applied is None else applied,
                                     metric_names=self._metric_names,
                                     grad_norm=grad_norm, loss_scale=scale,
                                     collective_s=collective_s)

    def _accumulate(self, micro_batches: list[dict[str, Any]], requests: tuple[float, float],
                    extra: tuple[float, ...], span: Span, at: MixAt) -> tuple[Any, int]:
        """Forward and backward over the k micro-batches, their gradients summed in .grad
        (and allreduced by Horovod's hooks as the last backward pass runs); the agreement
        allreduce submitted just before that pass, with the mean of each training metric
        (named in self._metric_names). (its handle, the samples trained on)"""
        k = self.check_accumulate(micro_batches)
        loss_sum = stats = None
        samples = 0
        metrics_fn, totals = self.train_metrics_fn(), {}
        for i, batch in enumerate(micro_batches):
            x, y, _ = split_batch(batch, self.spec)  # (the valid mask only matters to eval)
            x, y = self._inputs(x), torch.as_tensor(y).to(self.device, non_blocking=True)
            x, mix = mixed_torch_inputs(x, self.cfg.train, at, i, self.dist.rank, self.nchw)
            samples += len(y)
            with span("ringfeed.forward"), self._autocast():
                out = self.forward(x, **document_inputs(self.model, batch, self.device))
                loss = mixed_loss(self.loss_fn, out, y, mix).float().mean()
            if metrics_fn is not None:
                with torch.no_grad():  # (from the outputs the step has: no second forward)
                    for name, values in metrics_fn(out, y).items():
                        totals[name] = totals.get(name, 0.0) + values.float().mean()
            loss_sum = loss.detach() if loss_sum is None else loss_sum + loss.detach()
            if i == k - 1:
                self._metric_names = tuple(totals)
                stats = self._submit_stats(loss_sum / k, requests, extra,
                                           tuple(v / k for v in totals.values()))
            # The k-th backward triggers Horovod's allreduce (backward_passes_per_step=k);
            # dividing by k makes the accumulated gradient the mean over k micro-batches.
            # (Local SGD: plain accumulation in .grad, no allreduce.)
            with span("ringfeed.backward"):
                self.scaler.scale(loss / k).backward()
        return stats, samples

    def _applied(self, scale: Any) -> Any:
        """Whether the fp16 step just taken was applied: update() lowers the loss scale exactly
        when it skipped the step for an inf/NaN gradient (compared on the device; read only
        when the result is looked at)."""
        current = getattr(self.scaler, "_scale", None)
        if isinstance(current, torch.Tensor):
            return (current >= scale).squeeze()
        return self.scaler.get_scale() >= scale

    # -- throughput accounting (train/observe/throughput.py) ---------------------------------------
    def count_flops(self, batch: dict[str, Any]) -> FlopCount:
        """Training FLOPs per sample of the model at this batch's shape (meta device: no
        compute, no gradient on the real parameters, RNG states kept)."""
        x = torch.as_tensor(split_batch(batch, self.spec)[0])
        dtype = torch.float32 if x.is_floating_point() else x.dtype  # as _inputs() feeds it
        shape = tuple(x.permute(0, 3, 1, 2).shape if self.nchw else x.shape)
        return count_torch_flops(self.model, shape, dtype, self.device, self.spec.task == LM)

    def accounting_device(self) -> tuple[str | None, str]:
        """(this rank's GPU name, or None on CPU; the dtype its matmuls run in): fp32 counts
        as tf32 when torch lets matmuls use TF32 (torch.set_float32_matmul_precision)."""
        precision = self.cfg.train.precision
        if precision == "fp32" and torch.get_float32_matmul_precision() != "highest":
            precision = "tf32"
        name = torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else None
        return name, precision

    @torch.no_grad()
    def eval_batch(self, batch: dict[str, Any], groups: Groups | None = None
                   ) -> dict[str, float]:
        self.model.eval()
        try:
            x, y, valid = self._prepare(batch)
            with self._autocast():
                out = self.forward(x, **document_inputs(self.model, batch, self.device))
            per_sample = {"loss": self.loss_fn(out, y), **self.metrics_fn(out, y)}
        finally:
            self.model.train()
        per_sample = {k: v.float().expand(len(y)) if v.dim() == 0 else v.float()
                      for k, v in per_sample.items()}
        return metric_sums(per_sample, valid, lambda v: float(v.sum()), groups,
                           lambda m: torch.from_numpy(m).to(self.device).float())

    def allreduce_sum(self, values: dict[str, float]) -> dict[str, float]:
        summed = hvd.allreduce(torch.tensor(list(values.values()), dtype=torch.float64),
                               op=hvd.Sum, name="ringfeed.sums")
        return dict(zip(values, summed.tolist(), strict=True))

    def weights(self) -> list[Any]:
        return [v.detach().cpu().numpy().copy() for v in self.model.state_dict().values()]


class _StateDictHandler(StateHandler):
    """Elastic state of an object with state_dict()/load_state_dict(), synced by broadcasting
    rank 0's state dict: the optimizer (Horovod's own handler syncs it with
    broadcast_optimizer_state, which gives an optimizer without state - a joining worker's - one
    zero-gradient step, applying weight decay to weights already synced) and the GradScaler."""

    def __init__(self, value: Any):
        super().__init__(value)
        self.save()

    def save(self) -> None:
        self._saved = copy.deepcopy(self.value.state_dict())

    def restore(self) -> None:
        # (the optimizer's load_state_dict also drops Horovod's pending allreduce handles)
        self.value.load_state_dict(self._saved)

    def sync(self) -> None:
        state = hvd.broadcast_object(self.value.state_dict(), root_rank=0,
                                     name=f"ringfeed.elastic.{type(self.value).__name__}")
        self.value.load_state_dict(state)


class _ModelHandler(_StateDictHandler):
    """Elastic state of the model: Horovod's own handler broadcasts with broadcast_parameters,
    which rejects channels_last weights."""

    def sync(self) -> None:
        broadcast_tensors(self.value.state_dict())

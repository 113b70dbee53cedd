"""model.sync_batchnorm: BatchNorm layers normalised with the statistics of every rank's batch.

On a GPU the layers become Horovod's `hvd.SyncBatchNorm` (CUDA kernels: batch_norm_stats,
batch_norm_gather_stats_with_counts). Horovod 0.28.1's refuses CPU tensors ("SyncBatchNorm
expected input tensor to be on GPU"), and torch has no CPU kernels for the functions it calls
(aten::batch_norm_stats has none), so on a CPU they become `CpuSyncBatchNorm` below: one
allreduce of each channel's [sum, sum of squares] and the sample count, through
hvd.allreduce, whose gradient is the allreduce of the gradient - so autograd gives the
backward pass of a batch norm over the global batch, as torch's SyncBatchNorm computes it.

Both train on the global batch's statistics and update the running statistics with them
(unbiased variance over the global count, as nn.BatchNorm on one big batch), identically on
every rank; evaluation uses the running statistics and no collective. With one rank both are
a plain BatchNorm.
"""

from __future__ import annotations

import horovod.torch as hvd
import torch
from torch.nn.modules.batchnorm import _BatchNorm


class _SumOverRanks(torch.autograd.Function):
    """hvd.allreduce(op=Sum) whose backward pass is the same allreduce of the gradient, both
    named: Horovod pairs the ranks' tensors by name (hvd.allreduce's own backward is unnamed
    and would be numbered per process)."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor, name: str) -> torch.Tensor:  # type: ignore[override]
        ctx.name = name
        return hvd.allreduce(tensor, op=hvd.Sum, name=name)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        return hvd.allreduce(grad.contiguous(), op=hvd.Sum, name=f"{ctx.name}.grad"), None


class CpuSyncBatchNorm(_BatchNorm):
    """BatchNorm over the batches of all ranks, for CPU tensors (any N, C, ... input).
    `sync_name` names its allreduce, the same on every rank (the layer's path in the model)."""

    sync_name = "ringfeed.sync_bn"

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {input.dim()}D input)")

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        self._check_input_dim(input)
        if not self.training or hvd.size() == 1:
            return super().forward(input)
        factor = self._momentum_factor()
        channels = input.shape[1]
        dims = [0, *range(2, input.dim())]
        x = input.float()
        count = torch.tensor([x.numel() / channels], dtype=x.dtype, device=x.device)
        # one allreduce per layer and forward pass (and one of its gradient in backward)
        totals = _SumOverRanks.apply(torch.cat([x.sum(dims), (x * x).sum(dims), count]),
                                     self.sync_name)
        n = totals[-1]
        mean = totals[:channels] / n
        var = (totals[channels:2 * channels] / n - mean * mean).clamp_min(0.0)
        if self.track_running_stats and self.running_mean is not None:
            with torch.no_grad():
                self.running_mean.lerp_(mean.detach().to(self.running_mean.dtype), factor)
                unbiased = var.detach() * (n / (n - 1)).clamp_min(0.0)
                self.running_var.lerp_(unbiased.to(self.running_var.dtype), factor)
        shape = [1, channels] + [1] * (input.dim() - 2)
        out = (x - mean.view(shape)) * torch.rsqrt(var.view(shape) + self.eps)
        if self.affine:
            out = out * self.weight.view(shape) + self.bias.view(shape)
        return out.to(input.dtype)

    def _momentum_factor(self) -> float:
        """The running statistics' update factor for this step, as _BatchNorm.forward's
        (momentum None: a cumulative average over the batches seen)."""
        if not self.track_running_stats or self.num_batches_tracked is None:
            return 0.0
        self.num_batches_tracked.add_(1)
        if self.momentum is None:
            return 1.0 / float(self.num_batches_tracked)
        return self.momentum


def convert_sync_batchnorm(module: torch.nn.Module, device: torch.device,
                           path: str = "ringfeed.sync_bn") -> torch.nn.Module:
    """`module` with every BatchNorm layer replaced by a synchronised one on `device`'s kind
    (weights, running statistics and training mode kept; the state_dict keys are the same, so
    checkpoints load either way); as torch's SyncBatchNorm.convert_sync_batchnorm. `path`:
    the module's place in the model, which names a layer's allreduce."""
    if isinstance(module, _BatchNorm) and not isinstance(module, (CpuSyncBatchNorm,
                                                                   hvd.SyncBatchNorm)):
        cls = hvd.SyncBatchNorm if device.type == "cuda" else CpuSyncBatchNorm
        converted = cls(module.num_features, module.eps, module.momentum, module.affine,
                        module.track_running_stats)
        if module.affine:
            with torch.no_grad():
                converted.weight = module.weight
                converted.bias = module.bias
        converted.running_mean = module.running_mean
        converted.running_var = module.running_var
        converted.num_batches_tracked = module.num_batches_tracked
        converted.train(module.training)
        if isinstance(converted, CpuSyncBatchNorm):
            converted.sync_name = path
        return converted
    for name, child in module.named_children():
        module.add_module(name, convert_sync_batchnorm(child, device, f"{path}.{name}"))
    return module

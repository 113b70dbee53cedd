"""Learning rate as a pure function of the optimizer step: world-size scaling, linear warmup,
constant or cosine decay. Pure, so a resumed run gets the same rate at the same step."""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class LRSchedule:
    peak: float  # after scaling
    total_steps: int
    warmup_steps: int = 0
    kind: str = "constant"  # constant | cosine
    min_lr_ratio: float = 0.0

    def __call__(self, step: int) -> float:
        """The rate for optimizer step `step` (0-based)."""
        if step < self.warmup_steps:
            # Linear from peak/warmup to peak (nanoGPT/torchtitan): large-batch runs start
            # gently while the replicas' momentum and statistics settle.
            return self.peak * (step + 1) / self.warmup_steps
        if self.kind == "constant":
            return self.peak
        decay_steps = max(1, self.total_steps - self.warmup_steps)
        progress = min(1.0, (step - self.warmup_steps) / decay_steps)
        floor = self.peak * self.min_lr_ratio
        return floor + (self.peak - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


def scaled_peak_lr(lr: float, world_size: int, accumulate: int, scale: bool) -> float:
    """Horovod's linear scaling rule: the peak rate grows with the global batch
    (ranks x micro-batches per step), as in Horovod's pytorch_imagenet_resnet50.py."""
    return lr * world_size * accumulate if scale else lr


def make_schedule(optim, world_size: int, accumulate: int, total_steps: int) -> LRSchedule:
    """From the config's `optim` section."""
    peak = scaled_peak_lr(optim.lr, world_size, accumulate, optim.scale_lr_with_world_size)
    return LRSchedule(peak=peak, total_steps=total_steps, warmup_steps=optim.warmup_steps,
                      kind=optim.schedule, min_lr_ratio=optim.min_lr_ratio)

"""Learning rate as a pure function of the optimizer step: world-size scaling, linear warmup,
then constant, cosine or multistep decay. Pure, so a resumed run gets the same rate at the same
step.

One rule for epochs and steps: every boundary is a step. A quantity in epochs (optim.warmup_epochs,
optim.milestones) becomes the step at which the run reaches that epoch, `epoch_zero + epochs x
steps_per_epoch` (make_schedule), so the schedule itself only counts steps."""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass


@dataclass(frozen=True)
class LRSchedule:
    peak: float  # after scaling
    total_steps: int
    warmup_steps: float = 0  # (an epoch count converted to steps may be fractional)
    kind: str = "constant"  # constant | cosine | multistep
    min_lr_ratio: float = 0.0
    warmup_start: float = 0.0  # the rate the warmup ramps up from
    milestones: tuple[float, ...] = ()  # multistep: the steps from which the rate is x gamma more
    gamma: float = 0.1

    def __call__(self, step: int) -> float:
        """The rate for optimizer step `step` (0-based)."""
        if step < self.warmup_steps:
            # Linear from warmup_start to the peak, reached after the last warmup step:
            # step i trains at start + (peak - start) x (i + 1) / warmup_steps. From 0 that is
            # nanoGPT's and torchtitan's ramp; from the peak / world size, Horovod's examples'
            # (Goyal et al. 2017). Large-batch runs start gently while momentum settles.
            done = min(1.0, (step + 1) / self.warmup_steps)
            return self.warmup_start + (self.peak - self.warmup_start) * done
        if self.kind == "constant":
            return self.peak
        if self.kind == "multistep":  # torch's MultiStepLR: x gamma at every milestone passed
            return self.peak * self.gamma ** bisect.bisect_right(self.milestones, step)
        decay_steps = max(1, self.total_steps - self.warmup_steps)
        progress = min(1.0, (step - self.warmup_steps) / decay_steps)
        floor = self.peak * self.min_lr_ratio
        return floor + (self.peak - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


def scaled_peak_lr(lr: float, world_size: int, accumulate: int, scale: bool) -> float:
    """Horovod's linear scaling rule: the peak rate grows with the global batch
    (ranks x micro-batches per step), as in Horovod's pytorch_imagenet_resnet50.py."""
    return lr * world_size * accumulate if scale else lr


def make_schedule(optim, world_size: int, accumulate: int, total_steps: int,
                  steps_per_epoch: int, epoch_zero: int = 0) -> LRSchedule:
    """From the config's `optim` section. Epochs become steps at `steps_per_epoch` (this world
    size's) counted from `epoch_zero`, the step at which epoch 0 began as these steps per epoch
    count: 0, unless the run trained at another world size before (feed.plan_steps: the step
    that puts the pipeline's next epoch boundary where the pipeline has it)."""

    def step_of(epochs: float) -> float:
        return epoch_zero + epochs * steps_per_epoch

    peak = scaled_peak_lr(optim.lr, world_size, accumulate, optim.scale_lr_with_world_size)
    # one_rank: the rate before world-size scaling (optim.lr x accumulate), Horovod's start
    start = (scaled_peak_lr(optim.lr, 1, accumulate, optim.scale_lr_with_world_size)
             if optim.warmup_start == "one_rank" else 0.0)
    warmup = step_of(optim.warmup_epochs) if optim.warmup_epochs else optim.warmup_steps
    return LRSchedule(peak=peak, total_steps=total_steps, warmup_steps=max(0.0, warmup),
                      kind=optim.schedule, min_lr_ratio=optim.min_lr_ratio, warmup_start=start,
                      milestones=tuple(step_of(m) for m in optim.milestones), gamma=optim.gamma)

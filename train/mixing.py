"""MixUp and CutMix of training micro-batches (`train.mixup_alpha`, `train.cutmix_alpha`):
torchvision's v2.MixUp / v2.CutMix as its reference classification recipe applies them
(`--mixup-alpha`, `--cutmix-alpha`; both: `RandomChoice([MixUp, CutMix])`, one of the two per
batch, 50/50), on each rank's own micro-batches, as the reference does in each process.

    draw = mix_draw(config.train, epoch, step, micro, rank, height, width)   # None: off
    x, draw = mixed_torch_inputs(x, config.train, (epoch, step), micro, rank, channels_first)
    x = mixed_tf(x, tf.constant(draw.vector()), spatial)   # in TensorFlow's traced step
    loss = mixed_loss(loss_fn, out, y, draw)   # (TensorFlow: the vector)

torchvision's rules: the partner of sample i is sample i - 1 (the batch rolled by one,
`roll(1, 0)`; the batches are shuffled); lam ~ Beta(alpha, alpha). MixUp: x lam + rolled
(1 - lam). CutMix: a box centred at a uniform pixel, sides sqrt(1 - lam) of the image's, clipped
to it, pasted from the rolled batch; lam becomes the share of the image left. The targets are
lam one-hot(y) + (1 - lam) one-hot(rolled y), smoothed by `label_smoothing` (linear: smoothing
before or after mixing is the same), and the cross entropy is linear in its target, so the loss
is lam loss(out, y) + (1 - lam) loss(out, rolled y): the built-in cross entropy on the soft
targets exactly (a user's train.loss gets the same combination of its integer-target losses).

The draws (which of the two, lam, the box) are a pure function of (train.seed, epoch, the
optimizer step, the micro-batch's index in it, rank): a resumed run mixes as the uninterrupted
one. Validation is never mixed; the training metrics compare outputs with the unmixed targets.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import numpy as np

from ringfeed.errors import UserError

MIX_STREAM = 0x6D6978  # "mix": the draws' own SeedSequence entropy word


class MixDraw(NamedTuple):
    """One micro-batch's mixing: `weight` of the sample's own pixels outside the box
    (MixUp's lam, 1 for CutMix), `lam` of its own target, CutMix's box (top, bottom, left,
    right: rows [top, bottom), columns [left, right) taken from the rolled batch) or None."""

    weight: float
    lam: float
    box: tuple[int, int, int, int] | None

    def vector(self) -> np.ndarray:
        """[weight, lam, top, bottom, left, right] (no box: an empty one), float32: what the
        TensorFlow step takes as a tensor, so one traced graph serves every draw."""
        box = self.box if self.box is not None else (0, 0, 0, 0)
        return np.array([self.weight, self.lam, *box], np.float32)


def mixing_on(train: Any) -> bool:
    return bool(train.mixup_alpha or train.cutmix_alpha)


def check_mixing(train: Any, task: str, image: bool) -> None:
    """UserError (exit 2) when mixing is set for anything but image classification (CutMix)
    or classification (MixUp)."""
    names = [n for n in ("mixup_alpha", "cutmix_alpha") if getattr(train, n)]
    if not names:
        return
    if task != "classify":
        raise UserError(f"train.{names[0]}: MixUp and CutMix are for classification, and this "
                        f"run's task is {task}: set train.{names[0]} to 0")
    if train.cutmix_alpha and not image:
        raise UserError("train.cutmix_alpha: CutMix pastes boxes of images, and this run's "
                        "inputs are not images (height x width x channels): set it to 0 or "
                        "use train.mixup_alpha")


MixAt = tuple[int, int] | None  # train_step's `at`: (epoch, steps done), or not given


def mix_position(at: MixAt) -> tuple[int, int]:
    """train_step's `at`, (epoch, steps done): without it every step would draw alike, so its
    absence is an error, not (0, 0)."""
    if at is None:
        raise RuntimeError("MixUp/CutMix: train_step needs at=(epoch, steps done) "
                           "(train/loop.py passes it)")
    return at


def mix_draw(train: Any, epoch: int, step: int, micro: int, rank: int,
             height: int = 1, width: int = 1) -> MixDraw | None:
    """The mixing of micro-batch `micro` of optimizer step `step` (steps done before it) on
    `rank`, images of `height` x `width`; None when both alphas are 0."""
    mixup, cutmix = float(train.mixup_alpha), float(train.cutmix_alpha)
    if not mixup and not cutmix:
        return None
    words = [MIX_STREAM, int(train.seed) % 2 ** 64, int(epoch), int(step), int(micro), int(rank)]
    rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence(words)))
    use_cutmix = cutmix > 0 and (mixup == 0 or rng.random() < 0.5)
    lam = float(rng.beta(cutmix, cutmix) if use_cutmix else rng.beta(mixup, mixup))
    if not use_cutmix:
        return MixDraw(lam, lam, None)
    # v2.CutMix._get_params: r_x, r_y uniform pixels; half-sides int(r W), int(r H)
    r_x, r_y = int(rng.integers(width)), int(rng.integers(height))
    r = 0.5 * math.sqrt(1.0 - lam)
    half_w, half_h = int(r * width), int(r * height)
    left, top = max(r_x - half_w, 0), max(r_y - half_h, 0)
    right, bottom = min(r_x + half_w, width), min(r_y + half_h, height)
    kept = 1.0 - (right - left) * (bottom - top) / (width * height)
    return MixDraw(1.0, kept, (top, bottom, left, right))


def spatial_axes(ndim: int, channels_first: bool) -> tuple[int, int] | None:
    """The (height, width) axes of an image batch of `ndim` dims; None for other inputs."""
    if ndim != 4:
        return None
    return (2, 3) if channels_first else (1, 2)


def mixed_torch(x: Any, draw: MixDraw, spatial: tuple[int, int] | None) -> Any:
    """A float micro-batch mixed with itself rolled by one sample (torch)."""
    rolled = x.roll(1, 0)
    if draw.box is None:
        return rolled.mul(1.0 - draw.weight).add_(x.mul(draw.weight))
    top, bottom, left, right = draw.box
    index: list[Any] = [slice(None)] * x.dim()
    index[spatial[0]], index[spatial[1]] = slice(top, bottom), slice(left, right)
    out = x.clone()
    out[tuple(index)] = rolled[tuple(index)]
    return out


def mixed_tf(x: Any, vector: Any, spatial: tuple[int, int] | None) -> Any:
    """mixed_torch in a TensorFlow graph, `vector` = MixDraw.vector() as a tensor: inside the
    box the rolled pixels, elsewhere x weight + rolled (1 - weight) (CutMix: weight 1, x)."""
    import tensorflow as tf

    rolled = tf.roll(x, 1, 0)
    blend = x * vector[0] + rolled * (1.0 - vector[0])
    if spatial is None:
        return blend
    shape = tf.shape(x)
    rows = tf.cast(tf.range(shape[spatial[0]]), tf.float32)
    cols = tf.cast(tf.range(shape[spatial[1]]), tf.float32)
    in_rows = (rows >= vector[2]) & (rows < vector[3])
    in_cols = (cols >= vector[4]) & (cols < vector[5])
    mask = in_rows[:, None] & in_cols[None, :]  # (H, W)
    mask = tf.reshape(mask, [1, shape[spatial[0]], shape[spatial[1]], 1] if spatial == (1, 2)
                      else [1, 1, shape[spatial[0]], shape[spatial[1]]])
    return tf.where(mask, rolled, blend)


def mixed_loss(loss_fn: Any, out: Any, y: Any, mix: Any) -> Any:
    """Per-sample loss against the mixed targets: lam loss(out, y) + (1 - lam)
    loss(out, rolled y) (the cross entropy of the soft targets: it is linear in them). `mix`:
    a MixDraw (torch), its vector() as a tensor (TensorFlow's graph), or None: loss(out, y)."""
    if mix is None:
        return loss_fn(out, y)
    if isinstance(mix, MixDraw):
        lam, rolled = mix.lam, y.roll(1, 0)
    else:
        import tensorflow as tf

        lam, rolled = mix[1], tf.roll(y, 1, 0)
    return loss_fn(out, y) * lam + loss_fn(out, rolled) * (1.0 - lam)


def mixed_torch_inputs(x: Any, train: Any, at: MixAt, micro: int, rank: int,
                       channels_first: bool) -> tuple[Any, MixDraw | None]:
    """Micro-batch `micro`'s float inputs (torch) mixed as train.mixup_alpha/cutmix_alpha
    say at position `at` (mix_position), and the draw; (x, None) when both are 0."""
    if not mixing_on(train):
        return x, None
    spatial = spatial_axes(x.dim(), channels_first)
    size = (int(x.shape[spatial[0]]), int(x.shape[spatial[1]])) if spatial else (1, 1)
    draw = mix_draw(train, *mix_position(at), micro, rank, *size)
    return mixed_torch(x, draw, spatial), draw

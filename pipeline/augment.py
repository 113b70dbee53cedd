"""Image augmentation stages (`augment`, `val_augment`): torchvision's names, defaults and
rules; a sample's random draws are a function of (seed, epoch, its key) only.

    stages = parse_augment(["random_resized_crop", "horizontal_flip"], (224, 224))
    params = crop_params(stages, seed, epoch, key, height, width)

`crop_params(stages: Augment, seed: int, epoch: int, key: str, height: int, width: int)
-> CropParams` is pure: for an image of `height` x `width` pixels (as encoded, before any
decoder scaling) it gives the region of the image to resample (`top`, `left`, `height`,
`width`, floats in source pixels; integers where no `resize` precedes the crop; a box larger
than the image means zero padding, torchvision's CenterCrop), the output size, `flip`, and the
colour jitter (`brightness`, `contrast`, `saturation` factors, 1.0 = unchanged, applied in
`jitter_order`). The CPU path (augment_pixels.py) and the GPU path call it alike, so both take
the same crops. Its random numbers come from blake2b digests of (seed, epoch,
key) (`SampleDraws`): not Python's `hash`, so every process, rank count and loader worker
count draws the same.

Stages, in list order, as torchvision composes them (items: a name, or {name: {args}}):
  random_resized_crop  scale=(0.08, 1.0), ratio=(3/4, 4/3); output image_size
                       (RandomResizedCrop.get_params: 10 tries, then the central crop)
  horizontal_flip      p=0.5
  resize               shorter=int(max(image_size) / 0.875): Resize(int), the shorter side
  center_crop          to image_size (CenterCrop; zero-padded where the image is smaller)
  color_jitter         brightness, contrast, saturation: a number b -> [max(0, 1 - b), 1 + b],
                       or a [min, max] pair; 0 = off (ColorJitter, its random order)
  random_erasing       p=0.5, scale=(0.02, 0.33), ratio=(0.3, 3.3), value=0 (RandomErasing,
                       get_params; last in the list: torchvision erases the normalized tensor).
                       `value` (a number, or one per channel) is in normalized units, as
                       torchvision's: the box's uint8 pixels are round(255 (mean + value std))
                       with `normalize`'s mean and std, so value 0 is the mean colour, 0 after
                       normalization; without `normalize`, units of x / 255 (0: black). Its
                       draws are a stream of their own: adding it moves no other stage's.
`default_val_augment` gives torchvision's eval preset for a list that crops at random.
"""

from __future__ import annotations

import hashlib
import math
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

# torchvision's reference ImageNet recipe: eval resizes to crop_size / 0.875 (224 -> 256)
EVAL_CROP_FRACTION = 0.875
CROP_TRIES = 10  # RandomResizedCrop.get_params: tries before the central crop
JITTER_NAMES = ("brightness", "contrast", "saturation")


@dataclass(frozen=True)
class RandomResizedCrop:
    scale: tuple[float, float] = (0.08, 1.0)
    ratio: tuple[float, float] = (3 / 4, 4 / 3)


@dataclass(frozen=True)
class HorizontalFlip:
    p: float = 0.5


@dataclass(frozen=True)
class Resize:
    shorter: int | None = None  # None: int(max(image_size) / 0.875)


@dataclass(frozen=True)
class CenterCrop:
    pass


@dataclass(frozen=True)
class ColorJitter:
    brightness: tuple[float, float] | None = None
    contrast: tuple[float, float] | None = None
    saturation: tuple[float, float] | None = None


@dataclass(frozen=True)
class RandomErasing:
    p: float = 0.5
    scale: tuple[float, float] = (0.02, 0.33)
    ratio: tuple[float, float] = (0.3, 3.3)
    value: tuple[float, ...] = (0.0,)  # normalized units, one or one per channel


Stage = RandomResizedCrop | HorizontalFlip | Resize | CenterCrop | ColorJitter | RandomErasing
STAGES: dict[str, type] = {"random_resized_crop": RandomResizedCrop,
                           "horizontal_flip": HorizontalFlip, "resize": Resize,
                           "center_crop": CenterCrop, "color_jitter": ColorJitter,
                           "random_erasing": RandomErasing}
ERASE_STREAM = "random_erasing"  # SampleDraws stream of the erase draws
CROPS = (RandomResizedCrop, CenterCrop)


@dataclass(frozen=True)
class Augment:
    """A parsed stage list and the output size of its crop (None: no crop stage)."""

    stages: tuple[Stage, ...]
    size: tuple[int, int] | None
    fill: tuple[int, ...] = (0,)  # random_erasing's uint8 levels per channel (erase_fill)

    @property
    def random(self) -> bool:
        """Whether any stage draws (else every epoch gives the same pixels)."""
        return any(isinstance(s, (RandomResizedCrop, ColorJitter))
                   or (isinstance(s, HorizontalFlip) and 0.0 < s.p < 1.0)
                   or (isinstance(s, RandomErasing) and s.p > 0.0) for s in self.stages)

    @property
    def crops(self) -> bool:
        return any(isinstance(s, CROPS) for s in self.stages)


class CropParams(NamedTuple):
    """One sample's augmentation for one image (see the module docstring)."""

    top: float
    left: float
    height: float
    width: float
    out_height: int
    out_width: int
    flip: bool
    brightness: float = 1.0
    contrast: float = 1.0
    saturation: float = 1.0
    jitter_order: tuple[int, ...] = ()  # indices into JITTER_NAMES, applied in this order
    # random_erasing: (top, left, height, width) of the output set to `fill`, last; None: none
    erase: tuple[int, int, int, int] | None = None
    fill: tuple[int, ...] = (0,)  # uint8 levels, one or one per channel


# -- parsing -----------------------------------------------------------------------------------
def parse_augment(items: Sequence[Any] | None, image_size: tuple[int, int] | None,
                  option: str = "augment", sized: bool = True,
                  normalize: tuple[Any, Any] | None = None) -> Augment | None:
    """The stage list of option `option`, validated; raises ValueError, one line naming the
    option, the item and what is allowed (`sized` False: image_size is not checked;
    `normalize`: (mean, std), what random_erasing's value is in units of)."""
    if items is None:
        return None
    if isinstance(items, (str, bytes)) or not isinstance(items, Sequence):
        raise ValueError(f"{option}: expected a list of stages ({', '.join(STAGES)}), "
                         f"got {items!r}")
    stages = tuple(parse_stage(item, f"{option}[{i}]") for i, item in enumerate(items))
    check_order(stages, option)
    if sized and any(isinstance(s, CROPS) for s in stages) and image_size is None:
        raise ValueError(f"{option}: its crop's output size is image_size: set image_size")
    erasing = [s for s in stages if isinstance(s, RandomErasing)]
    fill = erase_fill(erasing[0].value, normalize) if erasing else (0,)
    return Augment(stages, image_size, fill)


def erase_fill(value: tuple[float, ...], normalize: tuple[Any, Any] | None
               ) -> tuple[int, ...]:
    """random_erasing's uint8 levels: the pixels that normalize to `value`, the nearest
    level (torchvision writes `value` into the normalized tensor)."""
    mean, std = normalize if normalize is not None else ((0.0,), (1.0,))
    mean, std = [float(m) for m in _seq(mean)], [float(s) for s in _seq(std)]
    count = max(len(value), len(mean), len(std))
    return tuple(min(255, max(0, round(255.0 * (_at(mean, i) + _at(value, i) * _at(std, i)))))
                 for i in range(count))


def _at(values: Sequence[float], i: int) -> float:
    """values[i], or the one value that stands for every channel."""
    return values[i] if len(values) > 1 else values[0]


def _seq(value: Any) -> list[Any]:
    return list(value) if isinstance(value, Sequence) and not isinstance(value, str) else [value]


def parse_stage(item: Any, where: str) -> Stage:
    name, args = item, {}
    if isinstance(item, dict):
        if len(item) != 1:
            raise ValueError(f"{where}: {item!r}: a stage is a name or a one-key mapping "
                             f"name -> arguments")
        [(name, args)] = item.items()
        args = {} if args is None else args
    cls = STAGES.get(name) if isinstance(name, str) else None
    if cls is None:
        raise ValueError(f"{where}: {name!r} is not a stage (allowed: {', '.join(STAGES)})")
    if not isinstance(args, dict):
        raise ValueError(f"{where}: {name} takes a mapping of arguments, got {args!r}")
    allowed = list(cls.__dataclass_fields__)
    unknown = sorted(set(args) - set(allowed))
    if unknown:
        takes = f"takes {', '.join(allowed)}" if allowed else "takes no arguments"
        raise ValueError(f"{where}: {name} has no argument {unknown[0]!r} ({name} {takes})")
    try:
        return _stage(cls, name, args)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{where}: {name}: {e}") from None


def _stage(cls: type, name: str, args: dict[str, Any]) -> Stage:
    if cls is RandomResizedCrop:
        scale = _pair(args.get("scale", (0.08, 1.0)), "scale")
        ratio = _pair(args.get("ratio", (3 / 4, 4 / 3)), "ratio")
        if not 0 < scale[0] <= scale[1] <= 1:
            raise ValueError(f"scale={list(scale)}: needs 0 < min <= max <= 1")
        if not 0 < ratio[0] <= ratio[1]:
            raise ValueError(f"ratio={list(ratio)}: needs 0 < min <= max")
        return RandomResizedCrop(scale, ratio)
    if cls is HorizontalFlip:
        p = _number(args.get("p", 0.5), "p")
        if not 0 <= p <= 1:
            raise ValueError(f"p={p}: a probability in [0, 1]")
        return HorizontalFlip(p)
    if cls is Resize:
        shorter = args.get("shorter")
        if shorter is not None and (isinstance(shorter, bool) or not isinstance(shorter, int)
                                    or shorter < 1):
            raise ValueError(f"shorter={shorter!r}: a positive number of pixels")
        return Resize(shorter)
    if cls is ColorJitter:
        factors = {k: _jitter_range(args[k], k) for k in JITTER_NAMES if k in args}
        return ColorJitter(**factors)
    if cls is RandomErasing:
        return _erasing(args)
    return CenterCrop()


def _erasing(args: dict[str, Any]) -> RandomErasing:
    p = _number(args.get("p", 0.5), "p")
    scale = _pair(args.get("scale", (0.02, 0.33)), "scale")
    ratio = _pair(args.get("ratio", (0.3, 3.3)), "ratio")
    if not 0 <= p <= 1:
        raise ValueError(f"p={p}: a probability in [0, 1]")
    if not 0 < scale[0] <= scale[1] <= 1:
        raise ValueError(f"scale={list(scale)}: needs 0 < min <= max <= 1")
    if not 0 < ratio[0] <= ratio[1]:
        raise ValueError(f"ratio={list(ratio)}: needs 0 < min <= max")
    value = args.get("value", 0)
    values = _seq(value)
    if value == "random" or len(values) not in (1, 3):
        raise ValueError(f"value={value!r}: a number or one per channel, in normalized units "
                         "('random' noise is not supported)")
    return RandomErasing(p, scale, ratio, tuple(_number(v, "value") for v in values))


def _number(value: Any, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name}={value!r}: a number")
    return float(value)


def _pair(value: Any, name: str) -> tuple[float, float]:
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence) or len(value) != 2:
        raise ValueError(f"{name}={value!r}: a pair [min, max]")
    low, high = (_number(v, name) for v in value)
    return low, high


def _jitter_range(value: Any, name: str) -> tuple[float, float] | None:
    """ColorJitter's rule: b -> [max(0, 1 - b), 1 + b]; a pair as given; 0 or [1, 1]: off."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if value < 0:
            raise ValueError(f"{name}={value}: must be >= 0")
        low, high = max(0.0, 1.0 - value), 1.0 + value
    else:
        low, high = _pair(value, name)
        if not 0 <= low <= high:
            raise ValueError(f"{name}={value!r}: needs 0 <= min <= max")
    return None if low == high == 1.0 else (low, high)


def check_order(stages: tuple[Stage, ...], option: str) -> None:
    """At most one crop, a `resize` only before it (the output must be image_size), and
    random_erasing last (torchvision erases the finished tensor)."""
    for i, stage in enumerate(stages[:-1]):
        if isinstance(stage, RandomErasing):
            raise ValueError(f"{option}[{i}]: random_erasing must be the last stage "
                             "(torchvision erases the finished, normalized image)")
    crops = [i for i, s in enumerate(stages) if isinstance(s, CROPS)]
    if len(crops) > 1:
        raise ValueError(f"{option}: one crop stage at most (random_resized_crop or "
                         f"center_crop), got {len(crops)}")
    for i, stage in enumerate(stages):
        if isinstance(stage, Resize) and not (crops and i < crops[0]):
            raise ValueError(f"{option}[{i}]: resize must come before a crop stage "
                             "(center_crop or random_resized_crop), so images come out "
                             "at image_size")


def default_val_augment(augment: Sequence[Any] | None, image_size: Any) -> list[Any] | None:
    """The validation stages when none are given: torchvision's eval preset (shorter side to
    int(size / 0.875), then a center crop to image_size) when the train list crops at random,
    else None (validation images are decoded as without augmentation)."""
    parsed = parse_augment(augment, as_size(image_size))
    if parsed is None or not any(isinstance(s, RandomResizedCrop) for s in parsed.stages):
        return None
    return [{"resize": {"shorter": eval_resize(parsed.size)}}, "center_crop"]


def eval_resize(size: tuple[int, int] | None) -> int:
    """The eval preset's shorter side for output `size`: int(max(size) / 0.875)."""
    if size is None:
        raise ValueError("resize: without image_size, give resize its `shorter` side")
    return int(max(size) / EVAL_CROP_FRACTION)


def as_size(value: Any) -> tuple[int, int] | None:
    if value is None:
        return None
    if isinstance(value, int):
        return (value, value)
    h, w = value
    return (int(h), int(w))


# -- a sample's parameters -----------------------------------------------------------------------
class SampleDraws:
    """One sample's random numbers: draw k is the k % 8-th little-endian uint64 of block
    k // 8 = blake2b("seed NUL epoch NUL key NUL block", 64 bytes), its top 53 bits over 2^53:
    uniform in [0, 1), the same in every process and language (a numpy Generator seeded from
    the digest cost 18 us a sample to create; this, 1 us a block)."""

    def __init__(self, seed: int, epoch: int, key: str, stream: str = "") -> None:
        # a named `stream` (block "stream NUL n") is independent of the default one's draws
        stream = f"{stream}\x00" if stream else ""
        self._prefix = f"{int(seed)}\x00{int(epoch)}\x00{key}\x00{stream}".encode()
        self._block: tuple[int, ...] = ()
        self._count = 0

    def random(self) -> float:
        k = self._count % 8
        if k == 0:
            digest = hashlib.blake2b(self._prefix + str(self._count // 8).encode(),
                                     digest_size=64).digest()
            self._block = struct.unpack("<8Q", digest)
        self._count += 1
        return (self._block[k] >> 11) * 2.0 ** -53

    def uniform(self, low: float, high: float) -> float:
        return low + (high - low) * self.random()

    def below(self, n: int) -> int:
        """An integer uniform in [0, n)."""
        return min(int(self.random() * n), n - 1)

    def permutation(self, n: int) -> tuple[int, ...]:
        keys = [self.random() for _ in range(n)]
        return tuple(sorted(range(n), key=keys.__getitem__))


def crop_params(stages: Augment, seed: int, epoch: int, key: str, height: int,
                width: int) -> CropParams:
    """The sample's augmentation for a `height` x `width` image (module docstring)."""
    rng = SampleDraws(seed, epoch, key) if stages.random else None
    box = [0.0, 0.0, float(height), float(width)]  # top, left, height, width (source pixels)
    size = (int(height), int(width))  # the current image's size
    flip = False
    jitter: dict[str, float] = {}
    order: tuple[int, ...] = ()
    for stage in stages.stages:
        if isinstance(stage, Resize):
            size = resized_shorter(size, stage.shorter or eval_resize(stages.size))
        elif isinstance(stage, CenterCrop):
            oh, ow = stages.size
            top, left = int(round((size[0] - oh) / 2.0)), int(round((size[1] - ow) / 2.0))
            if size[0] < oh:  # torchvision pads first: the image sits at (oh - h) // 2
                top = -((oh - size[0]) // 2)
            if size[1] < ow:
                left = -((ow - size[1]) // 2)
            box, size = _crop(box, size, (top, left, oh, ow), flip), (oh, ow)
        elif isinstance(stage, RandomResizedCrop):
            region = random_resized_crop(rng, size[0], size[1], stage.scale, stage.ratio)
            box, size = _crop(box, size, region, flip), stages.size
        elif isinstance(stage, HorizontalFlip):
            if stage.p >= 1.0 or (stage.p > 0.0 and rng.random() < stage.p):
                flip = not flip
        elif isinstance(stage, ColorJitter):
            order = rng.permutation(len(JITTER_NAMES))
            for name in JITTER_NAMES:
                bounds = getattr(stage, name)
                if bounds is not None:
                    jitter[name] = rng.uniform(*bounds)
            order = tuple(i for i in order if JITTER_NAMES[i] in jitter)
    out = stages.size if stages.size is not None and not stages.crops else size
    erase = None
    last = stages.stages[-1] if stages.stages else None
    if isinstance(last, RandomErasing) and last.p > 0.0:
        erase = random_erasing(SampleDraws(seed, epoch, key, ERASE_STREAM), int(out[0]),
                               int(out[1]), last)
    return CropParams(box[0], box[1], box[2], box[3], int(out[0]), int(out[1]), flip,
                      jitter.get("brightness", 1.0), jitter.get("contrast", 1.0),
                      jitter.get("saturation", 1.0), order, erase, stages.fill)


def random_erasing(rng: SampleDraws, height: int, width: int, stage: RandomErasing
                   ) -> tuple[int, int, int, int] | None:
    """RandomErasing: with probability p, get_params' box (top, left, h, w) of a
    `height` x `width` image: area a uniform share in `scale`, h/w log-uniform in `ratio`,
    h < height and w < width, 10 tries; after 10 misses nothing is erased (torchvision
    returns the image itself)."""
    if rng.random() >= stage.p:
        return None
    area = height * width
    log_ratio = (math.log(stage.ratio[0]), math.log(stage.ratio[1]))
    for _ in range(CROP_TRIES):
        target = area * rng.uniform(*stage.scale)
        aspect = math.exp(rng.uniform(*log_ratio))
        h = int(round(math.sqrt(target * aspect)))
        w = int(round(math.sqrt(target / aspect)))
        if h < height and w < width:
            return rng.below(height - h + 1), rng.below(width - w + 1), h, w
    return None


def random_resized_crop(rng: SampleDraws, height: int, width: int,
                        scale: tuple[float, float], ratio: tuple[float, float]
                        ) -> tuple[int, int, int, int]:
    """RandomResizedCrop.get_params: (top, left, h, w) of a crop whose area is a uniform share
    in `scale` of the image's and whose aspect ratio w/h is log-uniform in `ratio`; after
    CROP_TRIES misses, the central crop of the whole image clamped to `ratio`."""
    area = height * width
    log_ratio = (math.log(ratio[0]), math.log(ratio[1]))
    for _ in range(CROP_TRIES):
        target = area * rng.uniform(scale[0], scale[1])
        aspect = math.exp(rng.uniform(log_ratio[0], log_ratio[1]))
        w = int(round(math.sqrt(target * aspect)))
        h = int(round(math.sqrt(target / aspect)))
        if 0 < w <= width and 0 < h <= height:
            return rng.below(height - h + 1), rng.below(width - w + 1), h, w
    in_ratio = width / height
    if in_ratio < min(ratio):
        w, h = width, int(round(width / min(ratio)))
    elif in_ratio > max(ratio):
        w, h = int(round(height * max(ratio))), height
    else:
        w, h = width, height
    return (height - h) // 2, (width - w) // 2, h, w


def resized_shorter(size: tuple[int, int], shorter: int) -> tuple[int, int]:
    """torchvision's Resize(int): the shorter side to `shorter`, the longer int(scaled)."""
    h, w = size
    short, long = min(h, w), max(h, w)
    if short == shorter:
        return size
    new_long = int(shorter * long / short)
    return (shorter, new_long) if h <= w else (new_long, shorter)


def _crop(box: list[float], size: tuple[int, int], region: tuple[int, int, int, int],
          flipped: bool) -> list[float]:
    """`box` narrowed to `region` (top, left, h, w) of the current `size` image (mirrored
    first when the current image is flipped)."""
    top, left, h, w = region
    if flipped:
        left = size[1] - left - w
    sy, sx = box[2] / size[0], box[3] / size[1]
    return [box[0] + top * sy, box[1] + left * sx, h * sy, w * sx]

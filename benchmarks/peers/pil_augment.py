"""torchvision's train-time augmentation on PIL images, written out by hand: what
`transforms.RandomResizedCrop(size)` + `transforms.RandomHorizontalFlip()` do to a PIL image.

PyPI's torchvision is a CUDA build that does not load beside the CPU torch of either venv here
(.venv, benchmarks/.peers-venv), so benchmarks/augment_bench.py and peer_worker.py use this
instead: the same arithmetic (`RandomResizedCrop.get_params`: 10 tries at a random area and
log-uniform aspect ratio, then the clamped central crop), the same PIL calls (`crop`, then
`resize` BILINEAR, which PIL antialiases; `transpose(FLIP_LEFT_RIGHT)`), with Python's
`random.Random` in place of torch's generator. Standard library, numpy and PIL only: both venvs
import it.
"""

from __future__ import annotations

import io
import math
import random

import numpy as np

SCALE = (0.08, 1.0)          # torchvision's defaults
RATIO = (3 / 4, 4 / 3)


def crop_params(width: int, height: int, rng: random.Random,
                scale: tuple[float, float] = SCALE,
                ratio: tuple[float, float] = RATIO) -> tuple[int, int, int, int]:
    """(top, left, height, width) of the crop: RandomResizedCrop.get_params."""
    area = height * width
    log_ratio = (math.log(ratio[0]), math.log(ratio[1]))
    for _ in range(10):
        target_area = area * rng.uniform(*scale)
        aspect = math.exp(rng.uniform(*log_ratio))
        w = int(round(math.sqrt(target_area * aspect)))
        h = int(round(math.sqrt(target_area / aspect)))
        if 0 < w <= width and 0 < h <= height:
            return rng.randint(0, height - h), rng.randint(0, width - w), h, w
    in_ratio = width / height
    if in_ratio < min(ratio):
        w, h = width, int(round(width / min(ratio)))
    elif in_ratio > max(ratio):
        h, w = height, int(round(height * max(ratio)))
    else:
        w, h = width, height
    return (height - h) // 2, (width - w) // 2, h, w


def crop_flip(image, size: int, rng: random.Random):
    """A PIL image -> RandomResizedCrop(size) then RandomHorizontalFlip(), as torchvision's
    functional PIL path does it (resized_crop = crop + resize; hflip = transpose)."""
    from PIL import Image

    top, left, h, w = crop_params(image.width, image.height, rng)
    out = image.crop((left, top, left + w, top + h)).resize((size, size),
                                                            Image.Resampling.BILINEAR)
    if rng.random() < 0.5:
        out = out.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
    return out


def load_rgb(data_or_path) -> object:
    """torchvision's `pil_loader`: open, convert("RGB") (which decodes the whole image)."""
    from PIL import Image

    source = io.BytesIO(data_or_path) if isinstance(data_or_path, bytes) else data_or_path
    with Image.open(source) as image:
        return image.convert("RGB")


def augmented(data_or_path, size: int, rng: random.Random) -> np.ndarray:
    """The whole PIL path for one encoded image: uint8 HWC RGB, size x size."""
    return np.asarray(crop_flip(load_rgb(data_or_path), size, rng))

"""Augmented pixels on the CPU: decode, crop + resize, flip, colour jitter, in one pass per
image, on numpy (the same pixels for torch and TF), in the decode threads (libjpeg-turbo and
OpenCV release the GIL).

    decode_augmented(data, stages, seed, epoch, key, channels) -> uint8 HWC   (from bytes)
    decode_source(data, short_side, channels) -> SourceImage      (what the decoded cache keeps)
    augment_source(image, stages, seed, epoch, key) -> uint8 HWC   (a later epoch, from it)

The crop comes from augment.crop_params on the encoded size; random_erasing's box is filled
last. A JPEG is decoded at the largest DCT scale (1/2, 1/4, 1/8) at which the crop still covers
the output (libjpeg-turbo's scaled IDCT: it only pays off for crops of 2x the output or more:
2x-8x less IDCT and colour work); the crop is a view of the decoded array, resized with OpenCV's
bilinear (`cv2.resize`, or `cv2.warpAffine` for a box with fractional corners, e.g. resize +
center_crop; a random crop from the decoded cache's copy is moved to that copy's whole pixels,
`on_grid`), and the flip is OpenCV's (a contiguous copy, cheaper than the batch's copy of a
reversed view). Measured on one core (ImageNet-like 500x375 photos, 105 KB,
RandomResizedCrop(224) + flip): OpenCV's resize took 0.18 ms an image against PIL's 1.16 ms, so
the whole path ran at 1.76-1.85x torchvision's PIL path; its pixels differ from that path's
(PIL's bilinear filter widens to antialias a downscale, OpenCV's does not): mean 1.3 levels,
99th percentile 9, max 80 on those photos; an upscaled crop differs by at most 1. Without OpenCV
installed PIL resizes (`Image.resize(box=...)`): torchvision's pixels.

`decode_source` keeps an image whose shorter side exceeds `short_side` reduced to that side
(DCT scaling, then OpenCV's area filter): FFCV's max_resolution. Crops are still drawn on the
encoded size and mapped onto the reduced copy, so a cached epoch crops the same region of the
photo as a cold one; only the resampling differs (see pipeline/README.md).
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import numpy as np

from ringfeed.pipeline import codecs
from ringfeed.pipeline.augment import (
    JITTER_NAMES,
    Augment,
    CropParams,
    crop_params,
    resized_shorter,
)

try:
    import cv2
except ImportError:  # optional at import time; pyproject.toml depends on it
    cv2 = None

DCT_SCALES = (8, 4, 2)
# ITU-R 601 luma, torchvision's rgb_to_grayscale (the contrast and saturation references)
LUMA = np.array([0.2989, 0.587, 0.114], dtype=np.float32)


class SourceImage(NamedTuple):
    """A decoded image kept for later epochs: its pixels (possibly reduced) and the size it
    was encoded at (the size crops are drawn on)."""

    pixels: np.ndarray  # uint8 HWC
    height: int
    width: int


def resizer() -> str:
    """What resizes crops here: "cv2" (OpenCV bilinear) or "PIL" (no OpenCV installed)."""
    return "cv2" if cv2 is not None else "PIL"


def decode_augmented(data: bytes, stages: Augment, seed: int, epoch: int, key: str,
                     channels: int | None) -> np.ndarray:
    """The sample's augmented image straight from its encoded bytes."""
    chosen: list[CropParams] = []

    def scale_for(height: int, width: int) -> int:
        chosen.append(crop_params(stages, seed, epoch, key, height, width))
        return dct_scale(chosen[0], exact=not stages.random)

    pixels, (height, width) = codecs.decode_scaled(data, scale_for, channels)
    return apply(pixels, chosen[0], height, width, exact=not stages.random)


def decode_source(data: bytes, short_side: int | None, channels: int | None) -> SourceImage:
    """The image at most `short_side` on its shorter side (None: as encoded)."""
    def scale_for(height: int, width: int) -> int:
        short = min(height, width)
        return next((s for s in DCT_SCALES if short_side and short // s >= short_side), 1)

    pixels, (height, width) = codecs.decode_scaled(data, scale_for, channels)
    h, w = pixels.shape[:2]
    if short_side is not None and min(h, w) > short_side:
        pixels = area_resize(pixels, resized_shorter((h, w), short_side))
    return SourceImage(pixels, height, width)


def augment_source(image: SourceImage, stages: Augment, seed: int, epoch: int,
                   key: str) -> np.ndarray:
    """The sample's augmented image from a kept SourceImage."""
    params = crop_params(stages, seed, epoch, key, image.height, image.width)
    return apply(image.pixels, params, image.height, image.width, snap=stages.random)


def dct_scale(params: CropParams, exact: bool = False) -> int:
    """The largest DCT scale at which the crop still covers the output size (1 if `exact`)."""
    return 1 if exact else next((s for s in DCT_SCALES if params.height / s >= params.out_height
                 and params.width / s >= params.out_width), 1)


def apply(pixels: np.ndarray, params: CropParams, height: int, width: int,
          exact: bool = False, snap: bool = False) -> np.ndarray:
    """`params` (drawn for a `height` x `width` image) applied to `pixels`, that image decoded
    at any scale: crop + resize, flip, jitter. `exact`: PIL resizes (torchvision's pixels;
    a deterministic list is decoded once, so its speed matters less). `snap`: a random crop's
    box goes to whole pixels of `pixels` (on_grid)."""
    sy, sx = pixels.shape[0] / height, pixels.shape[1] / width
    box = (params.top * sy, params.left * sx, params.height * sy, params.width * sx)
    size = (params.out_height, params.out_width)
    if exact:
        out = _pil_resample(pixels, box, size)
    else:
        out = resample(pixels, on_grid(box) if snap else box, size)
    if params.flip:  # a contiguous copy: the batch's copy of a negative-stride view is 3-6x slower
        out = _hwc(cv2.flip(out, 1), out) if cv2 is not None else out[:, ::-1]
    if params.jitter_order:
        out = color_jitter(out, params)
    if params.erase is not None:
        out = erase(out, params)
    return out


def erase(pixels: np.ndarray, params: CropParams) -> np.ndarray:
    """random_erasing: a copy (`pixels` may be a view of a cached image) with the box
    `params.erase` set to `params.fill`, per channel."""
    top, left, h, w = params.erase
    out = np.array(pixels)
    out[top:top + h, left:left + w] = erase_levels(params.fill, out.shape[2])
    return out


def erase_levels(fill: tuple[int, ...], channels: int) -> np.ndarray:
    """The fill's uint8 level per channel (one level for all, or the first for a grey image)."""
    levels = np.asarray(fill, np.uint8)
    return levels if levels.size == channels else np.full(channels, levels[0], np.uint8)


def on_grid(box: tuple[float, float, float, float]) -> tuple[int, int, int, int]:
    """A random crop's box in the decoded cache's reduced copy moved to whole pixels of it, at
    most half a pixel per edge: OpenCV's resize of a view then takes 0.14-0.3 ms an image where
    warpAffine of the fractional box took 0.65 (a 224 crop from a 256 copy; the copy resamples
    otherwise than a cold decode already). A random draw loses nothing by the shift; the cold
    path (its DCT-scaled decodes are held to torchvision's pixels) and deterministic crops
    (center_crop) keep their fractional box."""
    top, left, h, w = box
    t0, l0 = round(top), round(left)
    return (t0, l0, max(1, round(top + h) - t0), max(1, round(left + w) - l0))


def resample(pixels: np.ndarray, box: tuple[float, float, float, float],
             size: tuple[int, int]) -> np.ndarray:
    """The `box` (top, left, height, width; may reach past the image: zeros there) of
    `pixels`, resampled to `size` (h, w), bilinear."""
    top, left, h, w = box
    H, W = pixels.shape[:2]
    whole = (int(top) == top and int(left) == left and int(h) == h and int(w) == w
             and top >= 0 and left >= 0 and top + h <= H and left + w <= W)
    if whole:
        crop = pixels[int(top):int(top + h), int(left):int(left + w)]
        if crop.shape[:2] == tuple(size):
            return crop
        if cv2 is not None:
            return _hwc(cv2.resize(crop, (size[1], size[0]), interpolation=cv2.INTER_LINEAR),
                        pixels)
    if cv2 is None:
        return _pil_resample(pixels, box, size)
    sy, sx = h / size[0], w / size[1]  # destination pixel -> source, half-pixel centres
    matrix = np.array([[sx, 0, left + 0.5 * sx - 0.5], [0, sy, top + 0.5 * sy - 0.5]])
    out = _hwc(cv2.warpAffine(pixels, matrix, (size[1], size[0]),
                              flags=cv2.INTER_LINEAR | cv2.WARP_INVERSE_MAP,
                              borderMode=cv2.BORDER_REPLICATE), pixels)
    return _zero_outside(out, box, (H, W))


def _zero_outside(out: np.ndarray, box: tuple[float, float, float, float],
                  shape: tuple[int, int]) -> np.ndarray:
    """Zero the output rows/columns whose source lies outside the image (the padding of a
    center crop larger than the image, as torchvision pads)."""
    top, left, h, w = box
    oh, ow = out.shape[:2]
    sy, sx = h / oh, w / ow
    y0, y1 = _inside(top, sy, shape[0], oh)
    x0, x1 = _inside(left, sx, shape[1], ow)
    if (y0, y1, x0, x1) != (0, oh, 0, ow):
        kept = out[y0:y1, x0:x1].copy()
        out[:] = 0
        out[y0:y1, x0:x1] = kept
    return out


def _inside(start: float, step: float, size: int, count: int) -> tuple[int, int]:
    """The output indices i whose source centre start + (i + 0.5) step lies in [0, size)."""
    first = max(0, math.ceil(-start / step - 0.5 - 1e-9))
    last = min(count, math.floor((size - start) / step - 0.5 - 1e-9) + 1)
    return first, max(first, last)


def _hwc(array: np.ndarray, like: np.ndarray) -> np.ndarray:
    """OpenCV drops a trailing channel axis of 1: put it back."""
    return array[:, :, None] if array.ndim == 2 and like.ndim == 3 else array


def _pil_resample(pixels: np.ndarray, box: tuple[float, float, float, float],
                  size: tuple[int, int]) -> np.ndarray:
    from PIL import Image

    top, left, h, w = box
    H, W = pixels.shape[:2]
    image = Image.fromarray(pixels[:, :, 0] if pixels.shape[2] == 1 else pixels)
    clipped = (max(0.0, left), max(0.0, top), min(float(W), left + w), min(float(H), top + h))
    if clipped == (left, top, left + w, top + h):
        out = np.asarray(image.resize((size[1], size[0]), Image.Resampling.BILINEAR,
                                      box=clipped))
        return out[:, :, None] if out.ndim == 2 else out
    # a box past the image (a center crop larger than it): the part inside, placed
    oh, ow = size
    y0, y1 = _inside(top, h / oh, H, oh)
    x0, x1 = _inside(left, w / ow, W, ow)
    out = np.zeros((oh, ow, pixels.shape[2]), np.uint8)
    if y1 > y0 and x1 > x0:
        part = np.asarray(image.resize((x1 - x0, y1 - y0), Image.Resampling.BILINEAR,
                                       box=clipped))
        out[y0:y1, x0:x1] = part[:, :, None] if part.ndim == 2 else part
    return out


def area_resize(pixels: np.ndarray, size: tuple[int, int]) -> np.ndarray:
    """A reduction to `size` (h, w) with an area filter (once per image: quality over speed)."""
    if cv2 is not None:
        return _hwc(cv2.resize(pixels, (size[1], size[0]), interpolation=cv2.INTER_AREA),
                    pixels)
    return codecs.resize(pixels, size)


def color_jitter(pixels: np.ndarray, params: CropParams) -> np.ndarray:
    """torchvision's ColorJitter on uint8 tensors: each factor blends with a reference
    (black, the mean grey, the pixel's grey), clamped to [0, 255] and truncated to uint8
    after each step, in `params.jitter_order`."""
    out = np.asarray(pixels)
    for index in params.jitter_order:
        name = JITTER_NAMES[index]
        factor = getattr(params, name)
        x = out.astype(np.float32)
        if name == "brightness":
            blended = x * factor
        elif name == "contrast":
            mean = float(_gray(out).mean())
            blended = x * factor + (1.0 - factor) * mean
        elif out.shape[2] == 3:  # saturation (a grey image has none)
            blended = x * factor + (1.0 - factor) * _gray(out)[:, :, None]
        else:
            continue
        out = np.clip(blended, 0, 255).astype(np.uint8)
    return out


def _gray(pixels: np.ndarray) -> np.ndarray:
    """torchvision's rgb_to_grayscale of uint8 pixels (truncated to uint8), float32."""
    if pixels.shape[2] == 1:
        return pixels[:, :, 0].astype(np.float32)
    return (pixels.astype(np.float32) @ LUMA).astype(np.uint8).astype(np.float32)


def source_bytes(image: Any) -> int:
    """Bytes a SourceImage takes in the decoded cache (pixels and its index row)."""
    return int(image.pixels.nbytes) + 48

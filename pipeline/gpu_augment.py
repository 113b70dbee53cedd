"""Augmentation of a decoded batch on its device (`decode_device: cuda` with `augment`): every
image's crop + resize, flip, colour jitter and normalization in a fixed number of kernels,
whatever the batch's count and sizes of images.

    params = [crop_params(stages, seed, epoch, key, h, w) for ...]      # augment.py, CPU
    batch = augment_batch(images, params, sizes, scale=..., shift=...)  # (N, C, H, W)
    pixels = decode_augment_batch(datas, keys, stages, seed, epoch, device)  # bytes -> NHWC

`decode_augment_batch` is what the torch adapter runs: each JPEG's size read from its header
on the CPU, its parameters drawn by augment.crop_params from (seed, epoch, key, height, width),
the function the CPU path calls (so a sample's crop is the same box on either), the batch
decoded by nvJPEG (gpu_decode.py; other formats on the CPU, then uploaded), then
`augment_batch`.

`augment_batch`: the images (uint8 CHW, any sizes) are concatenated as pixel rows of one (P, C)
buffer (`torch.cat`); each output pixel's taps and weights are computed on the host in numpy
from the boxes (small: N x (H + W) numbers, two pinned asynchronous uploads); one gather fetches
every output pixel's 2 x 2 neighbours for the whole batch (the horizontal pair as one row of an
overlapping view), one multiply and one sum weigh them. Then a mask where a box reaches past its
image (zeros, as torchvision's CenterCrop pads), a rounding to the uint8 levels the CPU path
gives, the jitter (batched over samples, each step in the sample's order) and the normalization
as one multiply-add (Decoder's pixel_scale/pixel_shift: (x / 255 - mean) / std),
random_erasing's box just before it (+3 ops). 8 torch ops a batch (cat, add, index, 2 mul, sum,
round, addcmul; counted with torch.profiler at 4 and 32 images) and 3 small uploads, +1 of each
where a box is padded, +11 ops a jitter step: a kernel each on CUDA (cat's batched copy may take
a few); none per image, no host-device synchronization. The result is NHWC in memory: a
channels_last (N, C, H, W) view (`channels_last=False` makes it contiguous NCHW). Not
`grid_sample` over a padded batch: that needs float input padded to the batch's largest image
(an ImageNet batch holding one 4000 x 3000 photo: 144 MB float an image), where the gather reads
each output's taps from the uint8 pixels as decoded.

Pixels: each output pixel centre maps to box_top + (i + 0.5) * box_height / out_height - 0.5
(align_corners=False), sampled bilinearly, not antialiased. A box on whole pixels inside the
image is sampled as its own image (edges replicated at the box), i.e. crop, then
`F.interpolate(bilinear, antialias=False)`, and OpenCV's `resize` of the crop, what the CPU
path does; a fractional box (resize then center_crop) samples the whole image around it, as
the CPU path's `warpAffine`. Against the CPU path: when it decodes at full scale (the crop under
2x the output), it differs by OpenCV's fixed-point weights (tests/test_gpu_augment.py bounds
both); when it decodes at a DCT scale of 1/2-1/8 (crops of 2x the output or more) and for
deterministic lists (PIL's antialiased resize, e.g. the eval preset's downscale), the GPU path's
plain bilinear samples the full-size image and aliases more (bounds in that test).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np

from ringfeed.pipeline import gpu_decode
from ringfeed.pipeline.augment import JITTER_NAMES, Augment, CropParams, crop_params
from ringfeed.pipeline.augment_pixels import erase_levels
from ringfeed.pipeline.errors import PipelineDataError

# ITU-R 601 luma, torchvision's rgb_to_grayscale (augment_pixels.LUMA, the CPU path's)
LUMA = (0.2989, 0.587, 0.114)


class Taps(NamedTuple):
    """One axis's bilinear taps for every output row (or column) of every image."""

    first: np.ndarray  # (N, out) int64: the first source pixel
    second: np.ndarray  # (N, out) int64: the second (== first where its weight is 0)
    weight: np.ndarray  # (N, out) float32: the second's weight
    inside: np.ndarray  # (N, out) bool: the output pixel's centre lies in the image


def axis_taps(start: np.ndarray, length: np.ndarray, size: np.ndarray, out: int,
              whole: np.ndarray) -> Taps:
    """Taps of `out` outputs over the box [start, start + length) of axes of `size` pixels
    (arrays over the batch). `whole`: the box is whole pixels inside the image, sampled as its
    own image (clamped to the box); else clamped to the image. The arithmetic is torch's
    upsample_bilinear2d's, in float32 (area_pixel_compute_source_index, guard_index_and_lambda),
    so a whole box gives crop-then-F.interpolate's taps."""
    step = (length.astype(np.float32) / np.float32(out))[:, None]
    base = np.floor(start)
    offset = (start - base).astype(np.float32)[:, None]  # 0 for a whole box
    index = np.arange(out, dtype=np.float32)[None, :]
    position = offset + (step * (index + np.float32(0.5)) - np.float32(0.5))
    low = np.where(whole, 0.0, -base).astype(np.float32)[:, None]
    high = np.where(whole, length - 1, size - 1 - base).astype(np.float32)[:, None]
    position = np.clip(position, low, high)
    first = np.floor(position)
    weight = (position - first).astype(np.float32)
    first = first.astype(np.int64) + base.astype(np.int64)[:, None]
    last = base.astype(np.int64)[:, None] + high.astype(np.int64)
    second = np.minimum(first + 1, last)
    # augment_pixels._inside's rule: the centre start + (i + 0.5) * step in [0, size)
    step64 = (length / out)[:, None]
    lo = -start[:, None] / step64 - 0.5 - 1e-9
    hi = (size - start)[:, None] / step64 - 0.5 - 1e-9
    inside = (index >= lo) & (index <= hi)
    return Taps(first, second, weight, inside)


def flipped(taps: Taps, flip: np.ndarray) -> Taps:
    """Each flipped image's taps in reverse order (the output mirrored: the exact mirror)."""
    return Taps(*(np.where(flip[:, None], a[:, ::-1], a) for a in taps))


class Boxes(NamedTuple):
    """The batch's boxes in decoded pixels: arrays over the images."""

    top: np.ndarray
    left: np.ndarray
    height: np.ndarray
    width: np.ndarray
    rows: np.ndarray  # the decoded images' heights
    cols: np.ndarray  # and widths
    flip: np.ndarray

    @classmethod
    def of(cls, params: Sequence[CropParams], shapes: Sequence[tuple[int, int]],
           sources: Sequence[tuple[int, int]]) -> Boxes:
        """params (drawn for images of `sources` sizes) on images decoded at `shapes`."""
        p = np.array([(q.top, q.left, q.height, q.width) for q in params], np.float64)
        shape = np.array(shapes, np.float64).reshape(-1, 2)
        scale = shape / np.array(sources, np.float64).reshape(-1, 2)  # (1 at full scale)
        return cls(p[:, 0] * scale[:, 0], p[:, 1] * scale[:, 1], p[:, 2] * scale[:, 0],
                   p[:, 3] * scale[:, 1], shape[:, 0], shape[:, 1],
                   np.array([q.flip for q in params], bool))

    @property
    def whole(self) -> np.ndarray:
        """Boxes on whole pixels, inside their image (sampled as crops)."""
        edges = np.stack([self.top, self.left, self.height, self.width])
        return ((edges == np.round(edges)).all(0) & (self.top >= 0) & (self.left >= 0)
                & (self.top + self.height <= self.rows) & (self.left + self.width <= self.cols))


def augment_batch(images: Sequence[Any], params: Sequence[CropParams],
                  sources: Sequence[tuple[int, int]] | None = None, *,
                  scale: Any = None, shift: Any = None, channels_last: bool = False) -> Any:
    """uint8 CHW tensors (one device, one channel count, any sizes) -> their augmented batch
    (N, C, out_height, out_width): uint8, or float32 x * scale - shift (per channel) when
    `scale` and `shift` are given. params[i] was drawn for an image of sources[i] = (height,
    width) (default: images[i]'s own size; a smaller decode maps the box onto it)."""
    import torch

    if not images or len(images) != len(params):
        raise ValueError(f"augment_batch: {len(images)} images for {len(params)} parameters")
    channels = {int(im.shape[0]) for im in images}
    outs = {(p.out_height, p.out_width) for p in params}
    if len(channels) > 1 or len(outs) > 1:
        raise ValueError(f"augment_batch: the images do not stack (channels {sorted(channels)}, "
                         f"output sizes {sorted(outs)}): convert them alike (channels: 3) and "
                         "give every sample the same crop size")
    (c,), ((oh, ow),) = channels, outs
    shapes = [(int(im.shape[1]), int(im.shape[2])) for im in images]
    boxes = Boxes.of(params, shapes, sources if sources is not None else shapes)
    pixels = sample_bilinear(images, boxes, (oh, ow))
    pixels.round_()  # the uint8 levels the CPU path's resize gives
    if any(p.jitter_order for p in params):
        pixels = jitter(pixels, params)
    if any(p.erase is not None for p in params):
        pixels = erase(pixels, params)
    if scale is not None:
        factors = upload(np.stack([np.asarray(scale, np.float32).reshape(c),
                                   -np.asarray(shift, np.float32).reshape(c)]), pixels.device)
        pixels = torch.addcmul(factors[1], pixels, factors[0])  # x * scale - shift, one kernel
    else:
        pixels = pixels.to(torch.uint8)
    batch = pixels.permute(0, 3, 1, 2)  # NHWC memory: channels_last
    return batch if channels_last else batch.contiguous()


def sample_bilinear(images: Sequence[Any], boxes: Boxes, size: tuple[int, int]) -> Any:
    """float32 (N, out_height, out_width, C): every image's box resampled, flipped, zero where
    the box reaches past the image; values in [0, 255], not rounded."""
    import torch

    device, c = images[0].device, int(images[0].shape[0])
    whole = boxes.whole
    rows = axis_taps(boxes.top, boxes.height, boxes.rows, size[0], whole)
    cols = flipped(axis_taps(boxes.left, boxes.width, boxes.cols, size[1], whole), boxes.flip)
    # the pixels as rows of one buffer, one spare row: a column's right neighbour is the next
    # row (read with weight 0 where the column is the image's last)
    spare = images[0].new_zeros((1, c))
    buffer = torch.cat([im.permute(1, 2, 0).reshape(-1, c) for im in images] + [spare])
    pairs = buffer.as_strided((buffer.shape[0] - 1, 2, c), (c, c, 1))
    starts = np.concatenate([[0], np.cumsum(boxes.rows * boxes.cols)[:-1]]).astype(np.int64)
    width = boxes.cols.astype(np.int64)[:, None]
    n, (oh, ow) = len(images), size
    # each output's upper and lower source rows (N, oh, 2), its column pairs (N, ow), and the
    # weights of its four taps (N, oh, ow, 2, 2): two uploads for the batch
    index = np.concatenate([
        (starts[:, None, None] + np.stack([rows.first, rows.second], 2) * width[:, :, None])
        .ravel(), cols.first.ravel()])
    wy = np.stack([1 - rows.weight, rows.weight], 2)
    wx = np.stack([1 - cols.weight, cols.weight], 2)
    index_d = upload(index, device)
    weight_d = upload(np.concatenate([wy.ravel(), wx.ravel()]), device)
    row_pair, col = index_d.split([n * oh * 2, n * ow])
    taps = pairs[row_pair.view(n, oh, 1, 2) + col.view(n, 1, ow, 1)]  # (N, oh, ow, 2, 2, C)
    wy_d, wx_d = weight_d.split([n * oh * 2, n * ow * 2])
    weights = wy_d.view(n, oh, 1, 2, 1) * wx_d.view(n, 1, ow, 1, 2)  # (N, oh, ow, 2, 2)
    # uint8 taps times float32 weights: cast inside the multiply, no float copy of the taps
    pixels = (taps * weights.unsqueeze(5)).sum(dim=(3, 4))
    inside = rows.inside[:, :, None] & cols.inside[:, None, :]
    if not inside.all():
        pixels *= upload(inside[..., None], device)
    return pixels


def upload(array: np.ndarray, device: Any) -> Any:
    """A host array as a tensor on `device`: to a GPU from pinned memory, asynchronously (a
    plain `.to()` from pageable memory waits for the stream's queued work, i.e. the previous
    training step)."""
    import torch

    tensor = torch.from_numpy(np.ascontiguousarray(array))
    if torch.device(device).type != "cuda":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)


def jitter(pixels: Any, params: Sequence[CropParams]) -> Any:
    """augment_pixels.color_jitter over a batch (float32 NHWC of uint8 levels): step k blends
    each sample with its k-th stage's reference (brightness: black, contrast: the image's
    mean grey, saturation: the pixel's grey), factor 1 where a sample has no k-th stage
    (exactly unchanged), clamped and truncated to uint8 levels after each step."""

    device, c = pixels.device, pixels.shape[3]
    luma = upload(np.array(LUMA, np.float32), device)
    for step in range(max(len(p.jitter_order) for p in params)):
        names = [JITTER_NAMES[p.jitter_order[step]] if step < len(p.jitter_order) else None
                 for p in params]
        if c == 1:  # no saturation in a grey image
            names = [None if name == "saturation" else name for name in names]
        factor = [getattr(p, name) if name else 1.0 for p, name in zip(params, names,
                                                                       strict=True)]
        # (1 - factor) in float64, then float32, as the CPU path's Python float does
        table = np.array([factor, [1.0 - v for v in factor],
                          [name == "contrast" for name in names],
                          [name == "saturation" for name in names]]).astype(np.float32)
        f, rest, by_mean, by_pixel = upload(table, device).view(4, -1, 1, 1, 1)
        if table[2:].any():  # a grey reference (decided on the host: no device sync)
            # torchvision's rgb_to_grayscale, truncated (a grey image's own levels)
            grey = ((pixels @ luma).floor_() if c == 3 else pixels[..., 0]).unsqueeze(3)
            mean = grey.mean(dim=(1, 2), keepdim=True)
            pixels = pixels * f + rest * (by_mean * mean + by_pixel * grey)
        else:
            pixels = pixels * f
        pixels = pixels.clamp_(0, 255).floor_()
    return pixels


def erase(pixels: Any, params: Sequence[CropParams]) -> Any:
    """random_erasing over a batch (float32 NHWC): each sample's box (params.erase, on the
    output, as the CPU path's) set to its fill levels; the box as a row and a column mask
    (one upload), 3 ops for the batch."""
    import torch

    n, oh, ow, c = pixels.shape
    inside = np.zeros((n, oh + ow), bool)
    for i, p in enumerate(params):
        if p.erase is not None:
            top, left, h, w = p.erase
            inside[i, top:top + h] = True
            inside[i, oh + left:oh + left + w] = True
    rows, cols = upload(inside, pixels.device).split([oh, ow], dim=1)
    fill = upload(erase_levels(params[0].fill, c).astype(np.float32), pixels.device)
    return torch.where((rows[:, :, None] & cols[:, None, :]).unsqueeze(3), fill, pixels)


def sample_params(stages: Augment, seed: int, epoch: int, keys: Sequence[str],
                  sizes: Sequence[tuple[int, int]]) -> list[CropParams]:
    """Each sample's parameters, drawn as the CPU path draws them (augment.crop_params)."""
    return [crop_params(stages, seed, epoch, key, h, w)
            for key, (h, w) in zip(keys, sizes, strict=True)]


def decode_augment_batch(datas: Sequence[bytes], keys: Sequence[str], stages: Augment,
                         seed: int, epoch: int, device: Any,
                         decode: gpu_decode.Decode | None = None, *, channels: int | None = 3,
                         scale: Any = None, shift: Any = None) -> Any:
    """Encoded images -> their augmented batch, NHWC on `device` (uint8, or normalized with
    `scale`/`shift`): sizes from the JPEG headers, parameters from (seed, epoch, key, size),
    nvJPEG (`decode`: a stand-in for tests) then augment_batch. Raises ValueError naming an
    image that does not decode."""
    import torch

    device = torch.device(device)
    headers = [gpu_decode.jpeg_header(d) for d in datas]
    if decode is None:
        decode = gpu_decode.nvjpeg_decoder()
    images = gpu_decode.decode_images(datas, device, decode, channels, headers)
    sizes = [(h, w) if c else (int(im.shape[1]), int(im.shape[2]))
             for (c, h, w), im in zip(headers, images, strict=True)]
    params = sample_params(stages, seed, epoch, keys, sizes)
    outs: dict[tuple[int, int], str] = {}
    for key, p in zip(keys, params, strict=True):
        outs.setdefault((p.out_height, p.out_width), key)
    if len(outs) > 1:  # no crop stage and no image_size: the CPU path's error, its words
        seen = ", ".join(f"{k!r} is {s}" for s, k in list(outs.items())[:3])
        raise PipelineDataError(f"the images of one batch differ in shape ({seen}): set "
                                "image_size or augment (a crop) so they come out alike")
    batch = augment_batch(images, params, sizes, scale=scale, shift=shift, channels_last=True)
    return batch.permute(0, 2, 3, 1)  # NHWC, contiguous: the pipeline's image layout

"""GPU JPEG decoding for `decode_device="cuda"` (torch adapter): nvJPEG through torchvision.

    check_available("cuda")                                  # at pipeline build: one-line error
    pixels = decode_jpeg_batch(datas, (h, w), torch.device("cuda", 0))   # per batch
    images = decode_images(datas, device, nvjpeg_decoder(), channels=3)  # CHW list (augment)

`decode_jpeg_batch` returns uint8 NHWC on the device, the layout the CPU decode gives (C=1 for
grayscale JPEGs, 3 for colour; `channels=3` makes grey JPEGs RGB in the same nvJPEG call):
`torchvision.io.decode_jpeg(list, device=...)` decodes the batch's JPEGs in one batched nvJPEG
call per mode (GRAY for 1-component, RGB for YCbCr), then images whose
size differs from `image_size` are resized on the GPU, bilinear with antialiasing
(`torch.nn.functional.interpolate(..., antialias=True)`, PIL's BILINEAR filter in spirit), rounded
to uint8. `decode_images` leaves each image at its size (gpu_augment.py crops and resizes the
batch); `jpeg_header` reads a JPEG's size and components without decoding.

The pixels are NOT PIL's: nvJPEG is another JPEG decoder (its IDCT and chroma upsampling differ
from libjpeg's; how much could not be measured here, there is no GPU on the machine this was
written on), and torch's antialiased bilinear differs from PIL's resize by rounding (at most a few
levels; tests/test_codecs.py bounds it on the CPU). So a model trained with decode_device=cuda
sees slightly different pixels than with cpu, and the decoded-sample cache is not used.

Images nvJPEG is not given: non-JPEG data (a PNG in a mixed folder), CMYK/YCCK or Adobe-RGB
JPEGs, headers that do not parse: these are decoded on the CPU by pipeline.codecs (PIL's pixels,
resized there) and copied over. If nvJPEG rejects a batch, its images are retried one by one on
the GPU and the ones it still rejects go to the CPU decoder, which raises for a corrupt image
(ValueError naming its index in the batch).

Before each nvJPEG call the current CUDA stream is synchronized: torchvision's CUDA decoder was
reported to let nvJPEG (its hardware engine) write output memory that kernels queued on the
caller's stream may still be reading (pytorch/vision PR 9606, torchcodec PR 1634). This costs
the overlap of decoding with queued GPU work, not correctness.

torch and torchvision are imported inside the functions: `import pipeline` needs neither.
torchvision must be the build matching torch (`pip install 'ringfeed[gpu-decode]'`; a CUDA
torch, e.g. from PyTorch's cu128 index as in docker/Dockerfile.gpu).
"""

from __future__ import annotations

import io
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from ringfeed.pipeline import codecs

EXTRA = "gpu-decode"  # the pyproject.toml extra that installs torchvision
NO_GPU = ("data.decode_device: cuda needs a CUDA GPU; none is visible "
          "(use decode_device: cpu)")
NOT_INSTALLED = "(not installed)"
_checked: set[str] = set()  # devices where a probe JPEG decoded


class GpuDecodeUnavailable(ValueError):
    """decode_device="cuda" cannot work here; the message is one line naming what is missing."""


def check_available(device: str = "cuda") -> None:
    """Raise GpuDecodeUnavailable (a ValueError, one line) unless JPEGs can be decoded with
    nvJPEG on `device`: PyTorch present, a CUDA GPU visible (and that index), torchvision
    installed and loadable, and built with nvJPEG (a probe JPEG is decoded on the device)."""
    try:
        import torch
    except ImportError:
        raise GpuDecodeUnavailable("data.decode_device: cuda needs PyTorch with CUDA; torch is "
                                   "not installed (use decode_device: cpu)") from None
    if not torch.cuda.is_available():
        raise GpuDecodeUnavailable(NO_GPU)
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise GpuDecodeUnavailable(f"data.decode_device: {device!r} is not a torch device "
                                   f"({_line(e)})") from None
    if dev.type != "cuda":
        raise GpuDecodeUnavailable(f"data.decode_device: GPU decoding needs a cuda device "
                                   f"(got {device!r})")
    count = torch.cuda.device_count()
    if dev.index is not None and dev.index >= count:
        raise GpuDecodeUnavailable(f"data.decode_device: {device} is not visible ({count} CUDA "
                                   f"device(s) here)")
    decode_jpeg, mode = _torchvision_io()
    key = str(dev)
    if key in _checked:
        return
    probe = torch.from_numpy(np.frombuffer(_probe_jpeg(), np.uint8).copy())
    try:
        decode_jpeg([probe], mode=mode.RGB, device=dev)
    except Exception as e:  # noqa: BLE001 - any failure: it cannot decode here
        raise GpuDecodeUnavailable(
            f"data.decode_device: cuda needs torchvision built with nvJPEG; torchvision "
            f"{_version('torchvision')} could not decode a JPEG on {dev} ({_line(e)}) "
            f"(use decode_device: cpu)") from None
    _checked.add(key)


def decode_jpeg_batch(datas: Sequence[bytes], image_size: tuple[int, int] | None,
                      device: Any, channels: int | None = None) -> Any:
    """Encoded images -> uint8 tensor [N, H, W, C] on `device` (a torch.device or a string
    such as "cuda:0"): JPEGs decoded with nvJPEG, resized on the GPU to image_size=(h, w) when
    given; see the module docstring for what goes to the CPU and how pixels differ from it.
    `channels` 3 or 1 converts every image (as the CPU decode's `channels`). Without
    image_size every image must decode to the same shape. Raises ValueError when the images
    do not stack (grayscale and colour mixed, different sizes) or one is corrupt."""
    import torch

    return decode_batch(datas, image_size, torch.device(device), nvjpeg_decoder(), channels)


def nvjpeg_decoder() -> Decode:
    """The Decode that runs torchvision's batched nvJPEG (the current stream synchronized
    first, see the module docstring)."""
    import torch

    decode_jpeg, mode = _torchvision_io()
    modes = {1: mode.GRAY, 3: mode.RGB}

    def nvjpeg(tensors: list, channels: int, dev: Any) -> list:
        if dev.type == "cuda":
            torch.cuda.current_stream(dev).synchronize()  # see the module docstring
        return decode_jpeg(tensors, mode=modes[channels], device=dev)

    return nvjpeg


# -- the batch logic, with the decoder passed in (tests give it a CPU stand-in) ---------------
Decode = Callable[[list, int, Any], list]  # (uint8 1-D CPU tensors, channels, device) -> CHW
Header = tuple[int, int, int]  # jpeg_header's (channels for nvJPEG or 0, height, width)


def decode_each(datas: Sequence[bytes], device: Any, decode: Decode,
                channels: int | None = None, headers: Sequence[Header] | None = None,
                image_size: tuple[int, int] | None = None) -> list[Any]:
    """Each image decoded: CHW uint8 tensors on `device` from nvJPEG (one call per output
    mode), HWC arrays from the CPU decoder (resized to image_size) for the rest (see the
    module docstring). `channels` 3 or 1: every image converted (a grey JPEG as RGB by
    nvJPEG; a colour one to grey by the CPU, PIL's luma). Raises ValueError naming an image
    that does not decode."""
    n = len(datas)
    if n == 0:
        raise ValueError("decode_jpeg_batch: an empty batch")
    if headers is None:
        headers = [jpeg_header(d) for d in datas]
    # nvJPEG's output mode per image, 0: the CPU decodes it
    modes = [0 if c == 0 or (channels == 1 and c == 3) else channels or c
             for c, _, _ in headers]
    images: list[Any] = [None] * n
    for m in (1, 3):
        index = [i for i in range(n) if modes[i] == m]
        if index:
            for i, image in zip(index, _gpu_decode([datas[i] for i in index], m, device,
                                                   decode), strict=True):
                images[i] = image
    for i in range(n):
        if images[i] is None:
            try:
                images[i] = codecs.decode_image(bytes(datas[i]), image_size, channels=channels)
            except Exception as e:
                raise ValueError(f"image {i} of the batch: {type(e).__name__}: "
                                 f"{_line(e)}") from e
    return images


def decode_images(datas: Sequence[bytes], device: Any, decode: Decode,
                  channels: int | None = None, headers: Sequence[Header] | None = None
                  ) -> list[Any]:
    """decode_each at full size, every image a CHW uint8 tensor on `device` (the CPU's
    uploaded)."""
    import torch

    return [image if isinstance(image, torch.Tensor)
            else torch.from_numpy(np.require(image, requirements="CW")).permute(2, 0, 1)
            .to(device) for image in decode_each(datas, device, decode, channels, headers)]


def decode_batch(datas: Sequence[bytes], image_size: tuple[int, int] | None, device: Any,
                 decode: Decode, channels: int | None = None) -> Any:
    import torch

    n = len(datas)
    images = decode_each(datas, device, decode, channels, image_size=image_size)
    # shapes as (C, H, W), before resizing
    shapes = [tuple(im.shape) if isinstance(im, torch.Tensor)
              else (im.shape[2], im.shape[0], im.shape[1]) for im in images]
    depth = {s[0] for s in shapes}
    if len(depth) > 1:
        raise ValueError("decode_jpeg_batch: the batch mixes grayscale (C=1) and colour (C=3) "
                         "images, which do not stack (the CPU decode gives them these channel "
                         "counts too; channels: 3 converts them)")
    if image_size is None:
        if len({s[1:] for s in shapes}) > 1:
            raise ValueError("decode_jpeg_batch: images of different sizes need "
                             "data.image_size to be stacked")
        h, w = shapes[0][1:]
    else:
        h, w = image_size
    out = torch.empty((n, h, w, depth.pop()), dtype=torch.uint8, device=device)
    groups: dict[tuple, list[int]] = {}
    for i, image in enumerate(images):
        if isinstance(image, torch.Tensor):
            groups.setdefault(shapes[i], []).append(i)
        else:  # decoded (and resized) on the CPU
            out[i] = torch.from_numpy(np.require(image, requirements="CW")).to(device)
    for shape, index in groups.items():
        batch = torch.stack([images[i] for i in index])
        if shape[1:] != (h, w):
            batch = resize_nchw(batch, (h, w))
        out[torch.as_tensor(index, device=device)] = batch.permute(0, 2, 3, 1)
    return out


def resize_nchw(batch: Any, image_size: tuple[int, int]) -> Any:
    """uint8 NCHW -> uint8 NCHW of image_size: bilinear, antialiased, rounded."""
    import torch
    import torch.nn.functional as F

    resized = F.interpolate(batch.float(), size=tuple(image_size), mode="bilinear",
                            align_corners=False, antialias=True)
    return resized.round_().clamp_(0, 255).to(torch.uint8)


def _gpu_decode(datas: list[bytes], channels: int, device: Any, decode: Decode) -> list:
    """CHW tensors for the images nvJPEG decodes; None for those left to the CPU."""
    tensors = _host_tensors(datas)
    try:
        return list(decode(tensors, channels, device))
    except Exception:  # noqa: BLE001 - one bad image fails the whole call: retry one by one
        if len(tensors) == 1:
            return [None]
    out = []
    for tensor in tensors:
        try:
            out.append(decode([tensor], channels, device)[0])
        except Exception:  # noqa: BLE001 - the CPU decoder decides (and raises if corrupt)
            out.append(None)
    return out


def _host_tensors(datas: list[bytes]) -> list:
    """One uint8 CPU buffer holding every image, as 1-D tensor views (one copy, no warnings
    about read-only buffers)."""
    import torch

    sizes = [len(d) for d in datas]
    buffer = np.empty(sum(sizes), np.uint8)
    offsets = np.concatenate([[0], np.cumsum(sizes)])
    for d, start, end in zip(datas, offsets[:-1], offsets[1:], strict=True):
        buffer[start:end] = np.frombuffer(d, np.uint8)
    host = torch.from_numpy(buffer)
    return [host[int(s):int(e)] for s, e in zip(offsets[:-1], offsets[1:], strict=True)]


def jpeg_channels(data: bytes) -> int:
    """1 (grayscale) or 3 (YCbCr) for JPEGs nvJPEG decodes as the CPU would; 0 for anything
    the CPU must decode (not a JPEG, CMYK, YCCK, Adobe RGB, an unreadable header)."""
    return jpeg_header(data)[0]


def jpeg_header(data: bytes) -> Header:
    """(jpeg_channels, height, width) from the JPEG's frame header, without decoding; (0, 0, 0)
    where it is not a JPEG nvJPEG takes."""
    if data[:3] != codecs.JPEG_SIGNATURE:
        return (0, 0, 0)
    if codecs.simplejpeg is not None:
        try:
            height, width, colorspace, _ = codecs.simplejpeg.decode_jpeg_header(data)
        except Exception:  # noqa: BLE001
            return (0, 0, 0)
        channels = {"Gray": 1, "YCbCr": 3}.get(colorspace, 0)
        return (channels, height, width) if channels else (0, 0, 0)
    return _jpeg_header_py(bytes(data))


def _jpeg_channels_py(data: bytes) -> int:
    return _jpeg_header_py(data)[0]


def _jpeg_header_py(data: bytes) -> Header:
    """jpeg_header without simplejpeg: the SOF's size and component count; 3 components
    count as YCbCr unless an Adobe APP14 marker says RGB (transform 0)."""
    pos, adobe_rgb, none = 2, False, (0, 0, 0)
    while pos + 4 <= len(data):
        if data[pos] != 0xFF:
            return none
        marker = data[pos + 1]
        if marker == 0xFF:  # fill byte
            pos += 1
            continue
        length = int.from_bytes(data[pos + 2:pos + 4], "big")
        if marker == 0xEE and data[pos + 4:pos + 9] == b"Adobe" and pos + 15 < len(data):
            adobe_rgb = data[pos + 15] == 0
        if marker in (0xC0, 0xC1, 0xC2):  # baseline, extended, progressive Huffman
            if pos + 9 >= len(data):
                return none
            height = int.from_bytes(data[pos + 5:pos + 7], "big")
            width = int.from_bytes(data[pos + 7:pos + 9], "big")
            components = data[pos + 9]
            channels = 1 if components == 1 else 3 if components == 3 and not adobe_rgb else 0
            return (channels, height, width) if channels else none
        if 0xC3 <= marker <= 0xCF and marker not in (0xC4, 0xC8, 0xCC) or marker == 0xDA:
            return none  # lossless/arithmetic coded, or image data before a frame header
        pos += 2 + length
    return none


def _torchvision_io():
    """(torchvision.io.decode_jpeg, ImageReadMode), or GpuDecodeUnavailable naming the fix."""
    try:
        from torchvision.io import ImageReadMode, decode_jpeg
    except ImportError as e:
        if _version("torchvision") == NOT_INSTALLED:
            raise GpuDecodeUnavailable(
                f"data.decode_device: cuda needs torchvision; it is not installed (pip "
                f"install 'ringfeed[{EXTRA}]', the build matching torch "
                f"{_version('torch')}; or use decode_device: cpu)") from None
        raise _broken_torchvision(e) from None
    except Exception as e:  # noqa: BLE001 - e.g. a torchvision built for another torch
        raise _broken_torchvision(e) from None
    return decode_jpeg, ImageReadMode


def _broken_torchvision(e: BaseException) -> GpuDecodeUnavailable:
    return GpuDecodeUnavailable(
        f"data.decode_device: cuda needs torchvision; torchvision {_version('torchvision')} "
        f"does not load with torch {_version('torch')} ({type(e).__name__}: {_line(e)}); "
        f"install the matching build (pip install 'ringfeed[{EXTRA}]') or use "
        f"decode_device: cpu")


def _probe_jpeg() -> bytes:
    from PIL import Image

    buffer = io.BytesIO()
    Image.new("RGB", (16, 16), (200, 120, 40)).save(buffer, "JPEG", quality=90)
    return buffer.getvalue()


def _version(package: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(package)
    except PackageNotFoundError:
        return NOT_INSTALLED


def _line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__

"""CPU image decoders: encoded bytes -> uint8 HWC arrays, the pixels PIL gives, faster.

`decode_image(data, image_size)` is what `Decoder` (pipeline/decode.py) calls for every image:
uint8 HWC, C=1 for grayscale (PIL modes L, 1, I, I;16, F, LA), C=3 otherwise (`channels=3` or 1
forces it: PIL's convert("RGB") or convert("L") of any mode, CMYK and palettes too), resized with PIL's
BILINEAR filter to (h, w) when `image_size` is given and differs. Its output is bit for bit that
of the reference path, `decode_pil` (open with PIL, convert to L/RGB, resize, np.asarray):

- JPEG (told by its signature FF D8 FF) with 3 YCbCr/RGB or 1 grayscale component decodes with
  simplejpeg (libjpeg-turbo's TurboJPEG API, accurate DCT, fancy upsampling: what PIL's libjpeg
  does): 4-5x faster than PIL at 32-64 px, ~2x at 128-256 px on one core
  (benchmarks/decode_bench.py). simplejpeg releases the GIL while it decodes.
- Before its first use in a process, simplejpeg must decode a set of probe JPEGs (4:2:0, 4:2:2,
  4:4:4, progressive, grayscale, odd sizes) exactly as PIL does; if it does not (two builds of
  libjpeg-turbo that disagree), PIL decodes every JPEG and a warning says why. `jpeg_backend()`
  tells which one is in use.
- Everything else goes to PIL: CMYK/YCCK JPEGs, images larger than PIL.Image.MAX_IMAGE_PIXELS
  (so PIL's decompression-bomb warning/error still comes), any JPEG simplejpeg rejects (it is
  strict: libjpeg warnings such as a truncated file are errors), and every other format. PNG
  stays with PIL on purpose: OpenCV decodes 8-bit RGB PNGs with the same pixels, 1.6-2.4x faster
  at 32 px but 1.25-1.6x at 64 px and no faster from 128 px up (zlib dominates), for a 150 MB
  dependency and a second PNG decoder whose handling of 16-bit, palette and damaged files
  would have to be matched to PIL's.
- A corrupt image raises whatever PIL raises for it today (simplejpeg's rejection only sends the
  bytes to PIL, which then decides), so the pipeline's on_error policy sees the same errors.
- Without simplejpeg installed everything is decoded by PIL: same results, slower.

`dct_downscale=True` (opt-in, off by default) lets libjpeg shrink a large JPEG while decoding
(scale 1/2, 1/4 or 1/8 in the DCT domain: the largest power of two with the result still at least
`image_size`, PIL's `draft` rule) before the bilinear resize to the exact size: 256->128 px
3.8x faster, 256->64 3.3x, 512->224 1.8x, but the pixels differ from the default path (max abs
diff 6-10, mean 0.65-1.0 on the benchmark's images; the tests bound it at 32 / 4). Without
simplejpeg the same scaled decode (identical pixels) comes from PIL's `draft`. A cache of
decoded samples must key on this setting.

No batch variant: none of these libraries decodes several images in one call on the CPU, so a
batch would be this loop. simplejpeg does release the GIL, so threads can decode in parallel.
"""

from __future__ import annotations

import io
import sys
import threading
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np

try:
    import simplejpeg
except ImportError:  # optional at import time; pyproject.toml depends on it
    simplejpeg = None

JPEG_SIGNATURE = b"\xff\xd8\xff"
# simplejpeg header colourspace -> its decode colourspace, where the pixels equal PIL's
_SIMPLEJPEG_COLORSPACE = {"YCbCr": "RGB", "RGB": "RGB", "Gray": "GRAY"}
# PIL modes decode_pil converts to L (the rest but L/RGB go to RGB)
GRAY_MODES = ("1", "I", "I;16", "F", "LA")

_probe_lock = threading.Lock()
_probe: tuple[Any, bool, str] | None = None  # (simplejpeg module, usable, why not)


def decode_image(data: bytes, image_size: tuple[int, int] | None = None, *,
                 dct_downscale: bool = False, channels: int | None = None) -> np.ndarray:
    """uint8 HWC (C = 1 or 3; `channels` 3 or 1 forces it, as PIL's convert("RGB"/"L")),
    resized to image_size=(h, w) when given; equal to decode_pil's result (unless
    dct_downscale=True, see the module docstring). Raises on a corrupt image."""
    if data[:3] == JPEG_SIGNATURE:
        if simplejpeg is not None and _simplejpeg_usable():
            array = _decode_simplejpeg(data, image_size, dct_downscale, channels)
            if array is not None:
                return array
        if dct_downscale and image_size is not None:
            return decode_pil(data, image_size, draft=True, channels=channels)
    return decode_pil(data, image_size, channels=channels)


def decode_pil(data: bytes, image_size: tuple[int, int] | None = None, *,
               draft: bool = False, channels: int | None = None) -> np.ndarray:
    """The reference decode (PIL): open, convert to L or RGB (`channels` 1 or 3 forces which),
    resize BILINEAR to (h, w) when given and different, HWC. `draft=True`: a JPEG is first
    decoded at a reduced DCT scale (PIL's Image.draft), the fallback of dct_downscale."""
    from PIL import Image

    with Image.open(io.BytesIO(data)) as img:
        if draft and image_size is not None and img.format == "JPEG":
            h, w = image_size
            img.draft(img.mode, (w, h))
        img = _converted(img, channels)
        if image_size is not None:
            h, w = image_size
            if img.size != (w, h):
                img = img.resize((w, h), Image.Resampling.BILINEAR)
        array = np.asarray(img)
    return array[:, :, None] if array.ndim == 2 else array


def decode_scaled(data: bytes, choose_scale: Callable[[int, int], int],
                  channels: int | None = None) -> tuple[np.ndarray, tuple[int, int]]:
    """uint8 HWC decoded at 1/s of its size, s = choose_scale(height, width) in (1, 2, 4, 8)
    (a JPEG's DCT-domain scaling, ceil(H / s) x ceil(W / s); other formats at full size), and
    the encoded (height, width). Scale 1 gives decode_image's pixels."""
    if data[:3] == JPEG_SIGNATURE and simplejpeg is not None and _simplejpeg_usable():
        try:
            height, width, colorspace, _ = simplejpeg.decode_jpeg_header(data)
        except Exception:
            colorspace = None
        target = _simplejpeg_target(colorspace, channels)
        if target is not None and not _too_large(height, width):
            scale = choose_scale(height, width)
            kwargs = ({"min_height": -(-height // scale), "min_width": -(-width // scale)}
                      if scale > 1 else {})
            try:
                array = simplejpeg.decode_jpeg(data, colorspace=target, **kwargs)
            except Exception:
                array = None
            if array is not None:
                return _to_channels(array, channels), (height, width)
    from PIL import Image

    with Image.open(io.BytesIO(data)) as img:
        width, height = img.size
        scale = choose_scale(height, width)
        if scale > 1 and img.format == "JPEG":  # PIL's draft rule keeps >= the size asked
            img.draft(img.mode, (max(1, width // scale), max(1, height // scale)))
        array = np.asarray(_converted(img, channels))
    return (array[:, :, None] if array.ndim == 2 else array), (height, width)


def _converted(img: Any, channels: int | None) -> Any:
    """A PIL image in mode L or RGB: as `channels` says, else L for grayscale modes."""
    mode = {1: "L", 3: "RGB"}.get(channels) if channels else (
        img.mode if img.mode in ("L", "RGB") else "L" if img.mode in GRAY_MODES else "RGB")
    return img if img.mode == mode else img.convert(mode)


def _simplejpeg_target(colorspace: str | None, channels: int | None) -> str | None:
    """simplejpeg's output colourspace for a JPEG of header `colorspace` (None: PIL must
    decode it); grayscale to RGB replicates the channel, as PIL's convert("RGB")."""
    target = _SIMPLEJPEG_COLORSPACE.get(colorspace)
    if target is not None and channels == 3:
        return "RGB"
    return target


def _to_channels(array: np.ndarray, channels: int | None) -> np.ndarray:
    """channels=1 of an RGB decode: PIL's convert("L") of it (ITU-R 601-2 luma)."""
    if channels == 1 and array.shape[2] == 3:
        from PIL import Image

        return np.asarray(Image.fromarray(array).convert("L"))[:, :, None]
    return array


def resize(array: np.ndarray, image_size: tuple[int, int] | None) -> np.ndarray:
    """An HWC uint8 array (C = 1 or 3) resized as decode_pil resizes (PIL BILINEAR)."""
    if image_size is None or array.shape[:2] == tuple(image_size):
        return array
    from PIL import Image

    h, w = image_size
    img = Image.fromarray(array[:, :, 0] if array.shape[2] == 1 else array)
    out = np.asarray(img.resize((w, h), Image.Resampling.BILINEAR))
    return out[:, :, None] if out.ndim == 2 else out


def jpeg_backend() -> str:
    """'simplejpeg' when it decodes the JPEGs here, else 'PIL' (simplejpeg missing, or its
    pixels differ from PIL's in this process)."""
    return "simplejpeg" if simplejpeg is not None and _simplejpeg_usable() else "PIL"


def _decode_simplejpeg(data: bytes, image_size: tuple[int, int] | None,
                       dct_downscale: bool, channels: int | None = None) -> np.ndarray | None:
    """The decoded (and resized) image, or None where PIL must decode it."""
    try:
        height, width, colorspace, _ = simplejpeg.decode_jpeg_header(data)
    except Exception:
        return None  # PIL decides (and raises for a corrupt file)
    target = _simplejpeg_target(colorspace, channels)
    if target is None or _too_large(height, width):
        return None
    kwargs: dict[str, int] = {}
    if dct_downscale and image_size is not None:
        scale = draft_scale((height, width), image_size)
        if scale > 1:  # output -(-H // scale) x -(-W // scale), as libjpeg rounds
            kwargs = {"min_height": -(-height // scale), "min_width": -(-width // scale)}
    try:
        array = simplejpeg.decode_jpeg(data, colorspace=target, **kwargs)
    except Exception:
        return None
    return resize(_to_channels(array, channels), image_size)


def draft_scale(size: tuple[int, int], image_size: tuple[int, int]) -> int:
    """PIL's Image.draft rule: the largest of 8, 4, 2, 1 not above min(H // h, W // w)."""
    ratio = min(size[0] // image_size[0], size[1] // image_size[1])
    return next((s for s in (8, 4, 2) if ratio >= s), 1)


def _too_large(height: int, width: int) -> bool:
    image = sys.modules.get("PIL.Image")  # imported already (the probe); a lookup is cheaper
    if image is None:
        from PIL import Image as image
    limit = image.MAX_IMAGE_PIXELS
    return limit is not None and height * width > limit


def _simplejpeg_usable() -> bool:
    global _probe
    probe = _probe
    if probe is None or probe[0] is not simplejpeg:
        with _probe_lock:
            probe = _probe
            if probe is None or probe[0] is not simplejpeg:
                usable, why = _check_simplejpeg()
                if not usable:
                    warnings.warn(f"pipeline.codecs: decoding JPEGs with PIL, not simplejpeg: "
                                  f"{why}", RuntimeWarning, stacklevel=3)
                probe = _probe = (simplejpeg, usable, why)
    return probe[1]


def probe_jpegs() -> list[tuple[str, bytes]]:
    """Small JPEGs covering the decoder paths simplejpeg takes: (name, bytes)."""
    from PIL import Image

    rng = np.random.default_rng(1)
    h, w = 37, 29  # odd sizes: partial MCUs in both directions
    y, x = np.mgrid[0:h, 0:w]
    smooth = np.stack([x * 255 // w, y * 255 // h, (x + y) * 255 // (h + w)], -1)
    pixels = np.clip(smooth + rng.integers(-40, 40, (h, w, 3)), 0, 255).astype(np.uint8)
    out = []
    for name, image, options in [
        ("4:2:0", Image.fromarray(pixels), {"subsampling": 2}),
        ("4:2:2", Image.fromarray(pixels), {"subsampling": 1}),
        ("4:4:4", Image.fromarray(pixels), {"subsampling": 0}),
        ("progressive 4:2:0", Image.fromarray(pixels), {"subsampling": 2, "progressive": True}),
        ("grayscale", Image.fromarray(pixels[:, :, 1]), {}),
    ]:
        buffer = io.BytesIO()
        try:
            image.save(buffer, "JPEG", quality=90, **options)
        except OSError:  # an encoder problem, not a decoder one: skip this probe
            continue
        out.append((name, buffer.getvalue()))
    return out


def _check_simplejpeg() -> tuple[bool, str]:
    """(usable, why not): simplejpeg must give PIL's pixels for every probe."""
    try:
        probes = probe_jpegs()
        if not probes:
            return False, "PIL could not encode the probe JPEGs to compare with"
        for name, data in probes:
            array = _decode_simplejpeg(data, None, False)
            reference = decode_pil(data)
            if array is None or array.shape != reference.shape or not np.array_equal(
                    array, reference):
                return False, (f"simplejpeg {getattr(simplejpeg, '__version__', '?')} decodes "
                               f"a {name} JPEG differently from PIL")
    except Exception as e:  # noqa: BLE001 - any failure means: do not use it
        return False, f"simplejpeg failed on a probe JPEG: {type(e).__name__}: {e}"
    return True, ""

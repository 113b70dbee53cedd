"""pipeline/codecs.py decodes every image bit for bit as the PIL reference path does (and
pipeline/gpu_decode.py's CPU-testable parts: its one-line errors and its batch logic)."""

from __future__ import annotations

import io
import sys
import types
import warnings

import numpy as np
import pytest
from PIL import Image, ImageFile

from ringfeed.pipeline import codecs, gpu_decode

SIZES = [(1, 1), (7, 13), (16, 16), (33, 47), (64, 64), (97, 130)]
RESIZES = [None, (16, 16), (50, 20), (120, 90)]


def reference(data: bytes, image_size: tuple[int, int] | None) -> np.ndarray:
    """The decode every image had before codecs.py (pipeline/decode.py), copied verbatim."""
    with Image.open(io.BytesIO(data)) as img:
        if img.mode not in ("L", "RGB"):
            img = img.convert("L" if img.mode in ("1", "I", "I;16", "F", "LA") else "RGB")
        if image_size is not None:
            h, w = image_size
            if img.size != (w, h):
                img = img.resize((w, h), Image.BILINEAR)
        array = np.asarray(img)
    return array[:, :, None] if array.ndim == 2 else array


def natural(h: int, w: int, channels: int = 3, seed: int = 0) -> np.ndarray:
    """Smooth gradients plus noise: JPEG-typical content."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:h, 0:w].astype(np.float32)
    planes = [127 + 60 * np.sin(x / w * a * 6.28 + p) * np.cos(y / h * b * 6.28)
              for a, b, p in rng.uniform(0.5, 3, (channels, 3))]
    pixels = np.stack(planes, -1) + rng.normal(0, 12, (h, w, channels))
    pixels = np.clip(pixels, 0, 255).astype(np.uint8)
    return pixels[:, :, 0] if channels == 1 else pixels


def encode(image: Image.Image | np.ndarray, fmt: str = "JPEG", **options) -> bytes:
    if isinstance(image, np.ndarray):
        image = Image.fromarray(image)
    buffer = io.BytesIO()
    maxblock = ImageFile.MAXBLOCK
    ImageFile.MAXBLOCK = max(maxblock, 1 << 22)  # progressive JPEGs need one large buffer
    try:
        image.save(buffer, fmt, **options)
    finally:
        ImageFile.MAXBLOCK = maxblock
    return buffer.getvalue()


def assert_same(data: bytes, image_size=None) -> np.ndarray:
    got = codecs.decode_image(data, image_size)
    want = reference(data, image_size)
    assert got.dtype == np.uint8 and got.ndim == 3 and got.flags.c_contiguous
    assert got.shape == want.shape
    assert np.array_equal(got, want)
    return got


@pytest.fixture
def no_pil_for_jpeg(monkeypatch):
    """Fail if PIL decodes a JPEG: proves the simplejpeg path was taken."""
    if codecs.simplejpeg is None:
        pytest.skip("simplejpeg is not installed")
    # The one-time check that simplejpeg gives PIL's pixels decodes its probes with PIL: run
    # it before the guard (a test that comes first in its process would fail it otherwise).
    assert codecs._simplejpeg_usable(), codecs._probe
    real = codecs.decode_pil

    def guarded(data, image_size=None, **kw):
        assert bytes(data[:3]) != codecs.JPEG_SIGNATURE, "PIL decoded a JPEG"
        return real(data, image_size, **kw)

    monkeypatch.setattr(codecs, "decode_pil", guarded)


@pytest.fixture
def without_simplejpeg(monkeypatch):
    monkeypatch.setattr(codecs, "simplejpeg", None)


# -- JPEG -------------------------------------------------------------------------------------
def test_simplejpeg_is_used_when_installed():
    pytest.importorskip("simplejpeg")
    assert codecs.jpeg_backend() == "simplejpeg"


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("subsampling", [0, 1, 2], ids=["444", "422", "420"])
@pytest.mark.parametrize("progressive", [False, True], ids=["baseline", "progressive"])
def test_rgb_jpeg_equals_pil(size, subsampling, progressive, no_pil_for_jpeg):
    data = encode(natural(*size, seed=size[0]), quality=90, subsampling=subsampling,
                  progressive=progressive)
    for image_size in [*RESIZES, size]:
        out = assert_same(data, image_size)
        assert out.shape == (*(image_size or size), 3)


@pytest.mark.parametrize("quality", [30, 75, 95, 100])
def test_jpeg_qualities_equal_pil(quality, no_pil_for_jpeg):
    data = encode(natural(61, 45, seed=quality), quality=quality, optimize=True)
    for image_size in RESIZES:
        assert_same(data, image_size)


@pytest.mark.parametrize("subsampling", ["440", "411"])
def test_other_subsamplings_equal_pil(subsampling, no_pil_for_jpeg):
    """Chroma layouts PIL cannot write (encoded with simplejpeg's libjpeg-turbo)."""
    import simplejpeg

    data = simplejpeg.encode_jpeg(natural(45, 70, seed=3), quality=85,
                                  colorsubsampling=subsampling)
    for image_size in RESIZES:
        assert_same(data, image_size)


@pytest.mark.parametrize("size", SIZES)
def test_grayscale_jpeg_equals_pil(size, no_pil_for_jpeg):
    data = encode(natural(*size, channels=1, seed=size[1]), quality=90)
    for image_size in [*RESIZES, size]:
        out = assert_same(data, image_size)
        assert out.shape == (*(image_size or size), 1)
    progressive = encode(natural(*size, channels=1), quality=80, progressive=True)
    assert_same(progressive, (20, 20))


def test_adobe_rgb_jpeg_equals_pil(no_pil_for_jpeg):
    data = encode(natural(40, 50), quality=90, keep_rgb=True)  # 3 components, no YCbCr
    assert Image.open(io.BytesIO(data)).mode == "RGB"
    for image_size in RESIZES:
        assert_same(data, image_size)


@pytest.mark.parametrize("image_size", RESIZES)
def test_cmyk_jpeg_falls_back_to_pil(image_size, monkeypatch):
    data = encode(Image.fromarray(natural(40, 50)).convert("CMYK"), quality=90)
    calls = []
    real = codecs.decode_pil
    monkeypatch.setattr(codecs, "decode_pil", lambda *a, **k: calls.append(1) or real(*a, **k))
    out = assert_same(data, image_size)
    assert calls and out.shape[2] == 3


def test_memoryview_and_bytearray_inputs(no_pil_for_jpeg):
    data = encode(natural(30, 40), quality=90)
    want = reference(data, (20, 25))
    for value in (bytearray(data), memoryview(data)):
        assert np.array_equal(codecs.decode_image(value, (20, 25)), want)


def test_jpeg_with_trailing_bytes_and_exif_equals_pil(no_pil_for_jpeg):
    image = Image.fromarray(natural(30, 40))
    exif = Image.Exif()
    exif[0x0112] = 6  # orientation: neither decoder applies it
    data = encode(image, quality=90, exif=exif.tobytes()) + b"trailing garbage"
    assert_same(data, None)


# -- PNG and the rest: PIL ----------------------------------------------------------------------
def png_cases() -> dict[str, bytes]:
    rgb = natural(33, 47, seed=5)
    alpha = natural(33, 47, channels=1, seed=6)
    palette = Image.fromarray(rgb).convert("P")
    with_transparency = palette.copy()
    with_transparency.info["transparency"] = 3
    return {
        "RGB": encode(rgb, "PNG"),
        "L": encode(alpha, "PNG"),
        "RGBA": encode(np.dstack([rgb, alpha]), "PNG"),
        "LA": encode(Image.fromarray(rgb).convert("LA"), "PNG"),
        "P": encode(palette, "PNG"),
        "P+transparency": encode(with_transparency, "PNG"),
        "1": encode(Image.fromarray(alpha > 127), "PNG"),
        "I;16": encode(Image.fromarray(alpha.astype(np.uint16) * 257), "PNG"),
        "I;16 large values": encode(Image.fromarray(
            (np.arange(33 * 47, dtype=np.uint16) * 31).reshape(33, 47)), "PNG"),
    }


@pytest.mark.parametrize("name", list(png_cases()))
@pytest.mark.parametrize("image_size", [*RESIZES, (33, 47)])
def test_png_equals_pil(name, image_size):
    out = assert_same(png_cases()[name], image_size)
    assert out.shape[2] == (1 if name in ("L", "LA", "1", "I;16", "I;16 large values") else 3)


@pytest.mark.parametrize("fmt", ["BMP", "GIF", "TIFF", "WEBP", "PPM"])
def test_other_formats_equal_pil(fmt):
    data = encode(natural(21, 34, seed=9), fmt)
    for image_size in RESIZES:
        assert_same(data, image_size)


# -- without simplejpeg, with a simplejpeg that disagrees -------------------------------------
def test_without_simplejpeg_everything_decodes_with_pil(without_simplejpeg):
    assert codecs.jpeg_backend() == "PIL"
    cases = [encode(natural(33, 47), quality=90, subsampling=2),
             encode(natural(33, 47), quality=90, progressive=True),
             encode(natural(20, 20, channels=1), quality=90),
             encode(Image.fromarray(natural(20, 20)).convert("CMYK"), quality=90),
             *png_cases().values()]
    for data in cases:
        for image_size in RESIZES:
            assert_same(data, image_size)


def test_a_simplejpeg_whose_pixels_differ_is_not_used(monkeypatch):
    real = pytest.importorskip("simplejpeg")
    fake = types.SimpleNamespace(
        __version__="0-test",
        decode_jpeg_header=real.decode_jpeg_header,
        decode_jpeg=lambda data, **kw: real.decode_jpeg(data, **kw) ^ np.uint8(1))
    monkeypatch.setattr(codecs, "simplejpeg", fake)
    monkeypatch.setattr(codecs, "_probe", None)
    with pytest.warns(RuntimeWarning, match="decodes a .* JPEG differently from PIL"):
        assert codecs.jpeg_backend() == "PIL"
    assert_same(encode(natural(33, 47), quality=90), (20, 20))
    monkeypatch.setattr(codecs, "simplejpeg", real)
    assert codecs.jpeg_backend() == "simplejpeg"  # checked again for another module


# -- corrupt data raises ------------------------------------------------------------------------
def corrupt_cases() -> dict[str, bytes]:
    jpeg = encode(natural(64, 64), quality=90)
    png = encode(natural(64, 64), "PNG")
    return {
        "empty": b"",
        "random bytes": bytes(np.random.default_rng(0).integers(0, 256, 500, dtype=np.uint8)),
        "JPEG signature then zeros": codecs.JPEG_SIGNATURE + bytes(200),
        "truncated JPEG": jpeg[: len(jpeg) // 2],
        "JPEG header only": jpeg[:300],
        "truncated PNG": png[: len(png) // 2],
    }


@pytest.mark.parametrize("name", list(corrupt_cases()))
@pytest.mark.parametrize("with_simplejpeg", [True, False], ids=["simplejpeg", "pil-only"])
def test_corrupt_images_raise(name, with_simplejpeg, monkeypatch):
    if not with_simplejpeg:
        monkeypatch.setattr(codecs, "simplejpeg", None)
    data = corrupt_cases()[name]
    with pytest.raises(Exception) as want:
        reference(data, None)
    with pytest.raises(Exception) as got:
        codecs.decode_image(data, (32, 32))
    assert type(got.value) is type(want.value)  # the error PIL gives today


def test_decompression_bomb_limits_still_apply(monkeypatch):
    data = encode(natural(64, 64), quality=90)
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 1000)  # 4096 pixels > 2 x 1000: an error
    with pytest.raises(Image.DecompressionBombError):
        codecs.decode_image(data, None)
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 3000)  # > 1 x: PIL's warning
    with pytest.warns(Image.DecompressionBombWarning):
        assert_same(data, None)


# -- opt-in DCT-domain downscale ----------------------------------------------------------------
@pytest.mark.parametrize("source, target", [((256, 256), (64, 64)), ((255, 301), (64, 50)),
                                            ((517, 263), (100, 60)), ((300, 200), (37, 25)),
                                            ((256, 256), (200, 200)), ((64, 64), (128, 128))])
def test_dct_downscale_is_opt_in_and_close(source, target, monkeypatch):
    data = encode(natural(*source, seed=source[1]), quality=90, subsampling=2)
    exact = codecs.decode_image(data, target)
    fast = codecs.decode_image(data, target, dct_downscale=True)
    assert fast.shape == exact.shape == (*target, 3)
    diff = np.abs(fast.astype(int) - exact)
    assert diff.max() <= 32 and diff.mean() <= 4  # measured: max 4-9, mean 0.8-1.5
    if codecs.draft_scale(source, target) == 1:
        assert np.array_equal(fast, exact)  # nothing to gain: the exact path
    # the same scaled decode with or without simplejpeg (PIL's draft)
    monkeypatch.setattr(codecs, "simplejpeg", None)
    assert np.array_equal(codecs.decode_image(data, target, dct_downscale=True), fast)


@pytest.mark.parametrize("kind", ["gray", "cmyk"])
def test_dct_downscale_gray_and_cmyk(kind, monkeypatch):
    image = (Image.fromarray(natural(200, 260, channels=1)) if kind == "gray"
             else Image.fromarray(natural(200, 260)).convert("CMYK"))
    data = encode(image, quality=90)
    exact = codecs.decode_image(data, (48, 64))
    fast = codecs.decode_image(data, (48, 64), dct_downscale=True)
    assert fast.shape == exact.shape == (48, 64, 1 if kind == "gray" else 3)
    diff = np.abs(fast.astype(int) - exact)
    assert diff.max() <= 32 and diff.mean() <= 4
    monkeypatch.setattr(codecs, "simplejpeg", None)
    assert np.array_equal(codecs.decode_image(data, (48, 64), dct_downscale=True), fast)


def test_dct_downscale_leaves_non_jpegs_and_unsized_decodes_exact():
    png = encode(natural(128, 128), "PNG")
    assert np.array_equal(codecs.decode_image(png, (32, 32), dct_downscale=True),
                          reference(png, (32, 32)))
    jpeg = encode(natural(128, 128), quality=90)
    assert np.array_equal(codecs.decode_image(jpeg, None, dct_downscale=True),
                          reference(jpeg, None))


# -- the pipeline uses it -------------------------------------------------------------------------
def test_decoder_decodes_through_codecs(no_pil_for_jpeg):
    from ringfeed.pipeline.decode import Decoder

    data = encode(natural(40, 30), quality=90)
    decoder = Decoder({"jpg": "image"}, image_size=(24, 24))
    assert np.array_equal(decoder.decode_image(data), reference(data, (24, 24)))


# -- gpu_decode: what runs without a GPU --------------------------------------------------------
def test_check_available_without_a_gpu_is_one_line():
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("a CUDA GPU is visible")
    with pytest.raises(gpu_decode.GpuDecodeUnavailable) as err:
        gpu_decode.check_available("cuda")
    assert str(err.value) == ("data.decode_device: cuda needs a CUDA GPU; none is visible "
                              "(use decode_device: cpu)")
    assert isinstance(err.value, ValueError)


@pytest.fixture
def fake_gpu(monkeypatch):
    """torch says one CUDA device is visible."""
    torch = pytest.importorskip("torch")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(gpu_decode, "_checked", set())
    return torch


def without_torchvision(monkeypatch, version: str) -> None:
    monkeypatch.setitem(sys.modules, "torchvision", None)  # import raises ImportError
    monkeypatch.setitem(sys.modules, "torchvision.io", None)
    real = gpu_decode._version
    monkeypatch.setattr(gpu_decode, "_version",
                        lambda p: version if p == "torchvision" else real(p))


def test_check_available_names_the_torchvision_extra(fake_gpu, monkeypatch):
    without_torchvision(monkeypatch, gpu_decode.NOT_INSTALLED)
    with pytest.raises(gpu_decode.GpuDecodeUnavailable) as err:
        gpu_decode.check_available("cuda")
    message = str(err.value)
    assert "\n" not in message
    assert "torchvision; it is not installed" in message
    assert "pip install 'ringfeed[gpu-decode]'" in message


def test_check_available_names_a_torchvision_that_does_not_load(fake_gpu, monkeypatch):
    without_torchvision(monkeypatch, "0.28.0")
    with pytest.raises(gpu_decode.GpuDecodeUnavailable) as err:
        gpu_decode.check_available("cuda")
    assert "\n" not in str(err.value)
    assert "torchvision 0.28.0 does not load with torch" in str(err.value)


def test_check_available_without_nvjpeg(fake_gpu, monkeypatch):
    io_module = types.ModuleType("torchvision.io")

    def decode_jpeg(tensors, mode=None, device=None):
        raise RuntimeError("Not compiled with nvJPEG support\nsecond line")

    io_module.decode_jpeg = decode_jpeg
    io_module.ImageReadMode = types.SimpleNamespace(GRAY="GRAY", RGB="RGB")
    monkeypatch.setitem(sys.modules, "torchvision", types.ModuleType("torchvision"))
    monkeypatch.setitem(sys.modules, "torchvision.io", io_module)
    with pytest.raises(gpu_decode.GpuDecodeUnavailable) as err:
        gpu_decode.check_available("cuda")
    message = str(err.value)
    assert "\n" not in message
    assert "needs torchvision built with nvJPEG" in message
    assert "Not compiled with nvJPEG support" in message
    with pytest.raises(gpu_decode.GpuDecodeUnavailable, match="is not visible"):
        gpu_decode.check_available("cuda:3")
    with pytest.raises(gpu_decode.GpuDecodeUnavailable, match="needs a cuda device"):
        gpu_decode.check_available("cpu")


def test_check_available_is_what_the_pipeline_reports():
    """core.py turns ValueError into PipelineError: GpuDecodeUnavailable must be one."""
    assert issubclass(gpu_decode.GpuDecodeUnavailable, ValueError)


def pil_stand_in(torch):
    """A CPU stand-in for nvJPEG: (1-D uint8 tensors, channels, device) -> CHW tensors."""
    calls = []

    def decode(tensors, channels, device):
        calls.append(len(tensors))
        out = []
        for t in tensors:
            data = t.numpy().tobytes()
            if b"BAD" in data:
                raise RuntimeError("nvjpeg: cannot decode")
            hwc = codecs.decode_pil(data)
            assert hwc.shape[2] == channels
            hwc = np.require(hwc, requirements="CW")
            out.append(torch.from_numpy(hwc).permute(2, 0, 1).to(device))
        return out

    return decode, calls


def test_decode_batch_layout_matches_the_cpu_decode():
    torch = pytest.importorskip("torch")
    decode, calls = pil_stand_in(torch)
    datas = [encode(natural(33, 47, seed=i), quality=90) for i in range(5)]
    out = gpu_decode.decode_batch(datas, None, torch.device("cpu"), decode)
    want = np.stack([reference(d, None) for d in datas])
    assert out.dtype == torch.uint8 and tuple(out.shape) == want.shape == (5, 33, 47, 3)
    assert np.array_equal(out.numpy(), want)
    assert calls == [5]  # one batched call


def test_decode_batch_resizes_within_one_level_of_pil():
    torch = pytest.importorskip("torch")
    decode, _ = pil_stand_in(torch)
    sizes = [(256, 256), (100, 77), (33, 47), (64, 64), (20, 30)]
    datas = [encode(natural(*s, seed=i), quality=90) for i, s in enumerate(sizes)]
    out = gpu_decode.decode_batch(datas, (64, 64), torch.device("cpu"), decode).numpy()
    want = np.stack([reference(d, (64, 64)) for d in datas])
    assert out.shape == want.shape
    assert np.abs(out.astype(int) - want).max() <= 1  # antialiased bilinear, rounding apart
    assert np.array_equal(out[3], want[3])  # already the size: not resized


def test_decode_batch_sends_the_rest_to_the_cpu():
    torch = pytest.importorskip("torch")
    decode, calls = pil_stand_in(torch)
    gray = [encode(natural(30, 30, channels=1, seed=i), quality=90) for i in range(2)]
    gray_png = encode(natural(30, 30, channels=1), "PNG")
    out = gpu_decode.decode_batch([*gray, gray_png], (16, 16), torch.device("cpu"), decode)
    assert tuple(out.shape) == (3, 16, 16, 1)
    assert np.array_equal(out[2].numpy(), reference(gray_png, (16, 16)))  # PIL's pixels
    cmyk = encode(Image.fromarray(natural(30, 30)).convert("CMYK"), quality=90)
    rgb = encode(natural(30, 30), quality=90)
    out = gpu_decode.decode_batch([rgb, cmyk], None, torch.device("cpu"), decode)
    assert np.array_equal(out[1].numpy(), reference(cmyk, None))
    assert calls == [2, 1]


def test_decode_batch_retries_one_by_one_and_names_a_corrupt_image():
    torch = pytest.importorskip("torch")
    decode, calls = pil_stand_in(torch)
    good = [encode(natural(30, 30, seed=i), quality=90) for i in range(3)]
    odd = good[1] + b"BAD"  # the stand-in rejects it, PIL decodes it (trailing bytes)
    out = gpu_decode.decode_batch([good[0], odd, good[2]], None, torch.device("cpu"), decode)
    assert np.array_equal(out.numpy(), np.stack([reference(d, None) for d in good]))
    assert calls == [3, 1, 1, 1]
    corrupt = good[1][:200] + b"BAD"
    with pytest.raises(ValueError, match="image 1 of the batch"):
        gpu_decode.decode_batch([good[0], corrupt], None, torch.device("cpu"), decode)


def test_decode_batch_refuses_what_does_not_stack():
    torch = pytest.importorskip("torch")
    decode, _ = pil_stand_in(torch)
    rgb = encode(natural(30, 30), quality=90)
    gray = encode(natural(30, 30, channels=1), quality=90)
    with pytest.raises(ValueError, match="mixes grayscale"):
        gpu_decode.decode_batch([rgb, gray], (16, 16), torch.device("cpu"), decode)
    other = encode(natural(20, 30), quality=90)
    with pytest.raises(ValueError, match="need data.image_size"):
        gpu_decode.decode_batch([rgb, other], None, torch.device("cpu"), decode)


def test_jpeg_channels_without_simplejpeg_agrees(monkeypatch):
    cases = {
        "ycbcr": (encode(natural(30, 30), quality=90), 3),
        "progressive": (encode(natural(30, 30), quality=90, progressive=True), 3),
        "gray": (encode(natural(30, 30, channels=1), quality=90), 1),
        "cmyk": (encode(Image.fromarray(natural(30, 30)).convert("CMYK"), quality=90), 0),
        "adobe rgb": (encode(natural(30, 30), quality=90, keep_rgb=True), 0),
        "png": (encode(natural(30, 30), "PNG"), 0),
        "garbage": (codecs.JPEG_SIGNATURE + bytes(20), 0),
    }
    for name, (data, channels) in cases.items():
        if codecs.simplejpeg is not None:
            assert gpu_decode.jpeg_channels(data) == channels, name
        assert gpu_decode._jpeg_channels_py(data) == channels, name
    monkeypatch.setattr(codecs, "simplejpeg", None)
    assert gpu_decode.jpeg_channels(cases["gray"][0]) == 1


@pytest.mark.system
def test_importing_the_modules_needs_no_torch():
    import subprocess

    code = ("import sys; import ringfeed.pipeline.codecs, ringfeed.pipeline.gpu_decode; "
            "assert 'torch' not in sys.modules and 'torchvision' not in sys.modules")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            cwd=str(__import__("pathlib").Path(__file__).parent.parent))
    assert result.returncode == 0, result.stderr


def test_no_warnings_on_the_fast_path():
    data = encode(natural(30, 30), quality=90)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        codecs.decode_image(data, (16, 16))

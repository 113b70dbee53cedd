"""pipeline/gpu_augment.py on CPU tensors (the same torch ops run on the GPU): shapes and
layouts, exact flips, the boxes the CPU path takes, normalization, colour jitter, and the
pixels against crop-then-F.interpolate and against the CPU path, with the bounds stated. nvJPEG
is stood in for by PIL (what the CPU decoder gives); the one CUDA test is skipped without a GPU.

Bounds, on this file's photo-like images (pipeline/gpu_augment.py says why):
- against crop + F.interpolate(bilinear, antialias=False) + round: at most 1 level (float
  summation order), on at most 0.5% of the values (0.23% measured);
- against the CPU path (augment_pixels.py) where it decodes at full scale (crop < 2x the
  output): at most 1 level (OpenCV's fixed-point weights), mean <= 0.2 (0.12 measured);
- where it decodes at a DCT scale of 1/2-1/8: mean <= 4, 99th percentile <= 24 levels (2.8 and
  17 measured; its scaled IDCT low-passes, the GPU's bilinear of the full image aliases);
- the eval preset (PIL's antialiased resize on the CPU): mean <= 2, 99th percentile <= 16
  (1.55 and 15 measured);
- colour jitter: at most 1 level (identical on these images).
"""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from ringfeed.pipeline import augment_pixels, codecs, gpu_augment, gpu_decode
from ringfeed.pipeline.augment import (
    CropParams,
    crop_params,
    default_val_augment,
    parse_augment,
)
from ringfeed.pipeline.augment_pixels import color_jitter, dct_scale, decode_augmented
from ringfeed.pipeline.decode import Decoder

torch = pytest.importorskip("torch")
F = torch.nn.functional

TRAIN = ["random_resized_crop", "horizontal_flip"]
MEAN_STD = ((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))


# -- images --------------------------------------------------------------------------------
def photo(height: int, width: int, seed: int = 0) -> np.ndarray:
    """A photo-like RGB image: smooth shading, hard-edged discs, a little noise."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    image = np.stack([128 + 90 * np.sin(x / (7 + c * 3) + c) * np.cos(y / (11 + c * 2))
                      for c in range(3)], -1)
    for _ in range(6):
        cy, cx, r = rng.uniform(0, height), rng.uniform(0, width), rng.uniform(1, 1 + height / 3)
        image[(y - cy) ** 2 + (x - cx) ** 2 < r * r] = rng.uniform(0, 255, 3)
    image += rng.normal(0, 6, image.shape)
    return np.clip(image, 0, 255).astype(np.uint8)


def encoded(pixels: np.ndarray, fmt: str = "JPEG", mode: str | None = None) -> bytes:
    image = Image.fromarray(pixels)
    if mode is not None:
        image = image.convert(mode)
    buffer = io.BytesIO()
    image.save(buffer, fmt, **({"quality": 90} if fmt == "JPEG" else {}))
    return buffer.getvalue()


def photos(count: int, low: int, high: int, seed: int = 0) -> list[bytes]:
    rng = np.random.default_rng(seed)
    return [encoded(photo(int(h), int(w), seed + g))
            for g, (h, w) in enumerate(rng.integers(low, high, (count, 2)))]


def chw(pixels: np.ndarray):
    return torch.from_numpy(np.ascontiguousarray(pixels.transpose(2, 0, 1)))


def pil_nvjpeg(calls: list[tuple[int, int]] | None = None) -> gpu_decode.Decode:
    """nvJPEG's stand-in: PIL's pixels in the mode asked for, CHW on the device."""
    def decode(tensors, channels, device):
        if calls is not None:
            calls.append((len(tensors), channels))
        return [chw(codecs.decode_pil(t.numpy().tobytes(), channels=channels)).to(device)
                for t in tensors]
    return decode


def reference(image, p: CropParams):
    """Crop, then F.interpolate(bilinear, align_corners=False, antialias=False), rounded."""
    top, left, h, w = (int(v) for v in (p.top, p.left, p.height, p.width))
    crop = image[:, top:top + h, left:left + w].float()[None]
    out = F.interpolate(crop, size=(p.out_height, p.out_width), mode="bilinear",
                        align_corners=False, antialias=False)[0].round()
    return out.flip(-1) if p.flip else out


def random_boxes(shapes, out: tuple[int, int], seed: int, flip: bool = False
                 ) -> list[CropParams]:
    """Whole-pixel boxes inside each image, down- and upscaling."""
    rng = np.random.default_rng(seed)
    boxes = []
    for h, w in shapes:
        bh, bw = int(rng.integers(1, h + 1)), int(rng.integers(1, w + 1))
        boxes.append(CropParams(int(rng.integers(0, h - bh + 1)), int(rng.integers(0, w - bw + 1)),
                                bh, bw, *out, flip))
    return boxes


# -- the resampler ---------------------------------------------------------------------------
def test_crops_resize_as_crop_then_interpolate():
    rng = np.random.default_rng(0)
    shapes = [(int(h), int(w)) for h, w in rng.integers(5, 90, (24, 2))]
    images = [chw(photo(h, w, g)) for g, (h, w) in enumerate(shapes)]
    params = random_boxes(shapes, (20, 28), seed=1)
    out = gpu_augment.augment_batch(images, params)
    want = torch.stack([reference(im, p) for im, p in zip(images, params, strict=True)])
    diff = (out.float() - want).abs()
    assert diff.max() <= 1 and (diff > 0).float().mean() <= 5e-3


def test_a_flip_is_the_exact_mirror():
    rng = np.random.default_rng(2)
    shapes = [(int(h), int(w)) for h, w in rng.integers(8, 60, (10, 2))]
    images = [chw(photo(h, w, g)) for g, (h, w) in enumerate(shapes)]
    params = random_boxes(shapes, (16, 16), seed=3)
    plain = gpu_augment.augment_batch(images, params)
    mirrored = gpu_augment.augment_batch(images, [p._replace(flip=True) for p in params])
    assert torch.equal(mirrored, plain.flip(-1))
    assert not torch.equal(mirrored, plain)


def test_shapes_dtypes_and_layouts():
    images = [chw(photo(30, 40)), chw(photo(50, 20, 1))]
    params = [CropParams(2, 3, 20, 30, 12, 14, False), CropParams(0, 0, 50, 20, 12, 14, True)]
    out = gpu_augment.augment_batch(images, params)
    assert out.shape == (2, 3, 12, 14) and out.dtype == torch.uint8 and out.is_contiguous()
    last = gpu_augment.augment_batch(images, params, channels_last=True)
    assert last.is_contiguous(memory_format=torch.channels_last) and torch.equal(last, out)
    grey = [im[:1].contiguous() for im in images]
    assert gpu_augment.augment_batch(grey, params).shape == (2, 1, 12, 14)
    with pytest.raises(ValueError, match="do not stack"):
        gpu_augment.augment_batch([images[0], grey[1]], params)
    with pytest.raises(ValueError, match="do not stack"):
        gpu_augment.augment_batch(images, [params[0], params[1]._replace(out_width=13)])


def test_normalize_is_the_cpu_paths_arithmetic():
    decoder = Decoder({"jpg": "image"}, normalize=MEAN_STD)
    images = [chw(photo(30, 40)), chw(photo(25, 33, 1))]
    params = [CropParams(2, 3, 20, 30, 16, 16, False), CropParams(1, 0, 24, 33, 16, 16, True)]
    levels = gpu_augment.augment_batch(images, params, channels_last=True)
    out = gpu_augment.augment_batch(images, params, scale=decoder.pixel_scale,
                                    shift=decoder.pixel_shift, channels_last=True)
    assert out.dtype == torch.float32 and out.is_contiguous(memory_format=torch.channels_last)
    want = decoder.normalized(levels.permute(0, 2, 3, 1).numpy())  # the CPU batch's formula
    assert np.allclose(out.permute(0, 2, 3, 1).numpy(), want, rtol=0, atol=1e-6)


def test_a_box_past_the_image_is_zero_padded_as_the_cpu_path():
    """center_crop larger than the image (torchvision pads) and a fractional box (resize then
    center_crop): the CPU path's resample (OpenCV warpAffine, zeros outside)."""
    pixels = photo(20, 26)
    boxes = [(-6.0, -3.0, 32.0, 32.0), (2.5, 1.25, 15.5, 20.0), (-2.0, 4.0, 24.0, 18.0)]
    params = [CropParams(*box, 32, 32, False) for box in boxes]
    out = gpu_augment.augment_batch([chw(pixels)] * 3, params).numpy().astype(int)
    for got, box in zip(out, boxes, strict=True):
        want = augment_pixels.resample(pixels, box, (32, 32)).transpose(2, 0, 1).astype(int)
        assert np.array_equal(got == 0, want == 0)  # the same padding
        assert np.abs(got - want).max() <= 1
    assert (out[0][:, :6] == 0).all() and (out[0][:, 6:26, 3:29] > 0).any()


def test_jitter_is_the_cpu_paths_within_one_level():
    stages = parse_augment([{"color_jitter": {"brightness": 0.4, "contrast": 0.4,
                                              "saturation": 0.4}}, "horizontal_flip"], None)
    images = [photo(24, 30, g) for g in range(12)]
    params = [crop_params(stages, 5, 0, f"k{g}", 24, 30) for g in range(12)]
    assert {p.jitter_order for p in params} > {params[0].jitter_order}  # orders differ
    out = gpu_augment.augment_batch([chw(im) for im in images], params).numpy().astype(int)
    for got, image, p in zip(out, images, params, strict=True):
        flipped = image[:, ::-1] if p.flip else image
        want = color_jitter(flipped, p).transpose(2, 0, 1).astype(int)
        assert np.abs(got - want).max() <= 1
    grey = gpu_augment.augment_batch([chw(im[:, :, :1]) for im in images], params)
    for got, image, p in zip(grey.numpy().astype(int), images, params, strict=True):
        flipped = image[:, ::-1, :1] if p.flip else image[:, :, :1]
        want = color_jitter(np.ascontiguousarray(flipped), p).transpose(2, 0, 1).astype(int)
        assert np.abs(got - want).max() <= 1  # no saturation in grey
    untouched = gpu_augment.augment_batch([chw(images[0])], [params[0]._replace(
        brightness=1.0, contrast=1.0, saturation=1.0, flip=False)])
    assert np.array_equal(untouched[0].numpy().transpose(1, 2, 0), images[0])


# -- the GPU path against the CPU path ---------------------------------------------------------
def spied_params(monkeypatch, module) -> list[tuple[str, int, int, CropParams]]:
    """Record the (key, height, width, parameters) `module` draws through crop_params."""
    seen = []

    def recording(stages, seed, epoch, key, height, width):
        params = crop_params(stages, seed, epoch, key, height, width)
        seen.append((key, height, width, params))
        return params

    monkeypatch.setattr(module, "crop_params", recording)
    return seen


def test_a_samples_box_is_the_cpu_paths(monkeypatch):
    datas = photos(16, 20, 120, seed=4)
    keys = [f"n{g:03d}/img" for g in range(16)]
    stages = parse_augment(TRAIN, (32, 32))
    cpu_seen = spied_params(monkeypatch, augment_pixels)
    gpu_seen = spied_params(monkeypatch, gpu_augment)
    for epoch in (0, 3):
        for data, key in zip(datas, keys, strict=True):
            decode_augmented(data, stages, 7, epoch, key, 3)
        gpu_augment.decode_augment_batch(datas, keys, stages, 7, epoch, "cpu", pil_nvjpeg())
    assert len(gpu_seen) == 32 and gpu_seen == cpu_seen
    assert len({p for *_, p in gpu_seen}) == 32  # every sample and epoch its own draw


def against_cpu(datas: list[bytes], stages, epoch: int, seed: int = 3):
    keys = [f"k{g}" for g in range(len(datas))]
    gpu = gpu_augment.decode_augment_batch(datas, keys, stages, seed, epoch, "cpu",
                                           pil_nvjpeg()).numpy().astype(int)
    cpu = np.stack([decode_augmented(d, stages, seed, epoch, k, 3)
                    for d, k in zip(datas, keys, strict=True)]).astype(int)
    scales = np.array([dct_scale(crop_params(stages, seed, epoch, k, *Image.open(
        io.BytesIO(d)).size[::-1]), exact=not stages.random) for d, k in zip(datas, keys,
                                                                           strict=True)])
    return np.abs(gpu - cpu), scales


def test_train_pixels_against_the_cpu_path():
    stages = parse_augment(TRAIN, (32, 32))
    diff, scales = against_cpu(photos(24, 40, 200, seed=5), stages, epoch=1)
    full, scaled = diff[scales == 1], diff[scales > 1]
    assert len(full) >= 4 and len(scaled) >= 4  # both kinds of decode compared
    assert full.max() <= 1 and full.mean() <= 0.2
    assert scaled.mean() <= 4 and np.percentile(scaled, 99) <= 24


def test_eval_pixels_against_the_cpu_path():
    stages = parse_augment(default_val_augment(TRAIN, 32), (32, 32))
    diff, _ = against_cpu(photos(12, 30, 90, seed=6), stages, epoch=0)
    assert diff.mean() <= 2 and np.percentile(diff, 99) <= 16


def test_grey_cmyk_and_png_come_out_as_colour():
    pixels = photo(40, 50)
    datas = [encoded(pixels), encoded(pixels, mode="L"), encoded(pixels, mode="CMYK"),
             encoded(pixels, "PNG")]
    calls: list[tuple[int, int]] = []
    stages = parse_augment(TRAIN, (28, 28))  # crops under 2x: no DCT scaling on the CPU
    out = gpu_augment.decode_augment_batch(datas, ["a", "b", "c", "d"], stages, 0, 0, "cpu",
                                           pil_nvjpeg(calls))
    assert out.shape == (4, 28, 28, 3) and out.dtype == torch.uint8
    assert out.is_contiguous()  # NHWC, the pipeline's image layout
    assert calls == [(2, 3)]  # colour and grey JPEGs: one nvJPEG call in RGB mode
    grey = out[1].numpy()
    assert np.array_equal(grey[..., 0], grey[..., 2])
    for i, data in enumerate(datas):  # CMYK and PNG: the CPU decoder's pixels, uploaded
        want = decode_augmented(data, stages, 0, 0, "abcd"[i], 3).astype(int)
        assert np.abs(out[i].numpy().astype(int) - want).max() <= 1


def test_images_of_other_sizes_without_a_crop_name_the_samples():
    from ringfeed.pipeline import PipelineDataError

    datas = [encoded(photo(20, 30)), encoded(photo(24, 30))]
    stages = parse_augment(["horizontal_flip"], None)
    with pytest.raises(PipelineDataError, match="'b' is \\(24, 30\\)"):
        gpu_augment.decode_augment_batch(datas, ["a", "b"], stages, 0, 0, "cpu", pil_nvjpeg())


def test_jpeg_header_sizes_without_simplejpeg_agree():
    for data in [encoded(photo(37, 53)), encoded(photo(20, 30), mode="L")]:
        with Image.open(io.BytesIO(data)) as image:
            size = image.size[::-1]
        assert gpu_decode.jpeg_header(data)[1:] == size
        assert gpu_decode._jpeg_header_py(data)[1:] == size
    assert gpu_decode.jpeg_header(encoded(photo(20, 30), "PNG")) == (0, 0, 0)


# -- through the torch adapter -----------------------------------------------------------------
def write_shards(directory: Path, images: list[bytes]) -> Path:
    import webdataset as wds

    from ringfeed.formats.manifest import Manifest, ShardInfo, Split
    from ringfeed.fsutil import sha256_file

    directory.mkdir(parents=True)
    path = directory / "train-000000.tar"
    with wds.TarWriter(str(path)) as sink:
        for g, data in enumerate(images):
            sink.write({"__key__": f"img{g:04d}", "jpg": data, "cls": str(g).encode()})
    Manifest(splits={"train": Split([ShardInfo(path.name, len(images), path.stat().st_size,
                                               sha256_file(path))])},
             fields={"jpg": "image", "cls": "int"}, created_by="tests").save(directory)
    return directory


@pytest.mark.integration
def test_the_torch_adapter_feeds_the_gpu_path(tmp_path, monkeypatch):
    """decode_device: cuda through make_loader, the device and nvJPEG stood in for: each
    sample's pixels those of the CPU pipeline in every epoch (within the full-scale bound:
    images under 2x the output, so no DCT scaling on the CPU)."""
    from ringfeed.pipeline import ShardPipeline, core
    from ringfeed.pipeline.torch import TorchLoader, make_loader

    shards = write_shards(tmp_path / "shards", photos(12, 20, 40, seed=8))
    monkeypatch.setattr(core, "check_decode_device", lambda device: None)
    monkeypatch.setattr(TorchLoader, "_decode_device", staticmethod(lambda: torch.device("cpu")))
    monkeypatch.setattr(gpu_decode, "nvjpeg_decoder", pil_nvjpeg)
    options = {"batch_size": 4, "image_size": 24, "augment": TRAIN, "seed": 3,
               "normalize": MEAN_STD, "cache_dir": str(tmp_path / "cache")}
    pipes = {device: ShardPipeline(str(shards), decode_device=device, **options)
             for device in ("cpu", "cuda")}
    by_epoch = []
    for epoch in (0, 1):
        seen = {}
        for device, pipe in pipes.items():
            pipe.set_epoch(epoch)
            for batch in make_loader(pipe):
                for key, pixels in zip(batch["__key__"], batch["jpg"], strict=True):
                    seen.setdefault(key, {})[device] = np.asarray(pixels)
        assert len(seen) == 12
        for pixels in seen.values():
            assert pixels["cuda"].shape == pixels["cpu"].shape == (24, 24, 3)
            level = np.abs(pixels["cuda"] - pixels["cpu"]) * 255 * np.array(MEAN_STD[1])
            assert level.max() <= 1 + 1e-3
        by_epoch.append(seen)
    changed = [not np.array_equal(by_epoch[0][k]["cuda"], by_epoch[1][k]["cuda"])
               for k in by_epoch[0]]
    assert sum(changed) >= 9  # the epoch reached the GPU path's draws


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU and torchvision's "
                    "nvJPEG (run on a GPU machine: benchmarks/gpu_augment_check.py too)")
def test_on_the_gpu_nvjpeg_against_the_stand_in():
    datas = photos(16, 100, 300, seed=9)
    keys = [f"k{g}" for g in range(16)]
    stages = parse_augment(TRAIN, (64, 64))
    gpu = gpu_augment.decode_augment_batch(datas, keys, stages, 0, 0, "cuda")
    cpu = gpu_augment.decode_augment_batch(datas, keys, stages, 0, 0, "cpu", pil_nvjpeg())
    assert gpu.is_cuda and gpu.shape == cpu.shape
    diff = (gpu.cpu().int() - cpu.int()).abs()  # nvJPEG's IDCT and upsampling against libjpeg's
    assert diff.float().mean() <= 2 and diff.max() <= 64


def test_random_erasing_is_the_cpu_paths_box_and_fill():
    """The GPU path erases the box crop_params drew, with the fill the CPU path writes; every
    other pixel is the batch without the stage's."""
    datas = photos(12, 40, 120, seed=8)
    keys = [f"k{g}" for g in range(12)]
    erasing = [*TRAIN, {"random_erasing": {"value": [1.0, 0.0, -1.0]}}]
    stages = parse_augment(erasing, (32, 32), normalize=MEAN_STD)
    plain = parse_augment(TRAIN, (32, 32))
    out = gpu_augment.decode_augment_batch(datas, keys, stages, 3, 1, "cpu", pil_nvjpeg())
    without = gpu_augment.decode_augment_batch(datas, keys, plain, 3, 1, "cpu", pil_nvjpeg())
    erased = 0
    for g, (data, key) in enumerate(zip(datas, keys, strict=True)):
        p = crop_params(stages, 3, 1, key, *Image.open(io.BytesIO(data)).size[::-1])
        mask = np.zeros((32, 32), bool)
        if p.erase is not None:
            top, left, h, w = p.erase
            mask[top:top + h, left:left + w] = True
            erased += mask.any()
        fill = np.array(p.fill)
        assert (out[g].numpy()[mask] == fill).all()
        assert torch.equal(out[g][torch.from_numpy(~mask)], without[g][torch.from_numpy(~mask)])
        cpu = decode_augmented(data, stages, 3, 1, key, 3)
        assert (cpu[mask] == fill).all()
    assert erased >= 3

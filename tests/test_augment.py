"""Image augmentation (pipeline/augment.py, augment_pixels.py): torchvision's rules, a sample's
pixels a function of (seed, epoch, key) at any rank count, worker count and after a resume, the
fused decode's pixels against torchvision's PIL path, colour for every photo, the decoded
cache's bounded copies, and the user's exceptions as theirs."""

from __future__ import annotations

import io
import math
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from ringfeed.formats.manifest import Manifest, ShardInfo, Split
from ringfeed.fsutil import sha256_file
from ringfeed.pipeline import PipelineDataError, PipelineError, ShardPipeline
from ringfeed.pipeline.augment import (
    CROP_TRIES,
    ERASE_STREAM,
    RandomErasing,
    SampleDraws,
    crop_params,
    default_val_augment,
    parse_augment,
)
from ringfeed.pipeline.augment_pixels import (
    augment_source,
    decode_augmented,
    decode_source,
    on_grid,
    resample,
)
from ringfeed.pipeline.config import augment_for, pipeline_config
from ringfeed.userhooks import UserCode, load_callable

TRAIN = ["random_resized_crop", "horizontal_flip"]


# -- images and shards ---------------------------------------------------------------------
def photo(height: int, width: int, seed: int = 0) -> np.ndarray:
    """A photo-like RGB image: smooth shapes, edges and a little noise."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    image = np.stack([128 + 90 * np.sin(x / (7 + c * 3) + c) * np.cos(y / (11 + c * 2))
                      for c in range(3)], -1)
    for _ in range(6):  # hard-edged discs
        cy, cx, r = rng.uniform(0, height), rng.uniform(0, width), rng.uniform(5, height / 3)
        image[(y - cy) ** 2 + (x - cx) ** 2 < r * r] = rng.uniform(0, 255, 3)
    image += rng.normal(0, 6, image.shape)
    return np.clip(image, 0, 255).astype(np.uint8)


def jpeg(pixels: np.ndarray, mode: str | None = None, quality: int = 90) -> bytes:
    image = Image.fromarray(pixels)
    if mode is not None:
        image = image.convert(mode)
    buffer = io.BytesIO()
    image.save(buffer, "JPEG", quality=quality)
    return buffer.getvalue()


def png(pixels: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, "PNG")
    return buffer.getvalue()


def write_images(directory: Path, images: list[bytes], per_shard: int = 8) -> Path:
    """Shards of samples {"jpg": images[g], "cls": g}, keys `img{g}`, and their manifest."""
    import webdataset as wds

    directory.mkdir(parents=True, exist_ok=True)
    infos = []
    for s, start in enumerate(range(0, len(images), per_shard)):
        path = directory / f"train-{s:06d}.tar"
        chunk = images[start:start + per_shard]
        with wds.TarWriter(str(path)) as sink:
            for g, data in enumerate(chunk, start):
                sink.write({"__key__": f"img{g:04d}", "jpg": data, "cls": str(g).encode()})
        infos.append(ShardInfo(path.name, len(chunk), path.stat().st_size, sha256_file(path)))
    Manifest(splits={"train": Split(infos)}, fields={"jpg": "image", "cls": "int"},
             created_by="tests").save(directory)
    return directory


@pytest.fixture(scope="module")
def small_images() -> list[bytes]:
    rng = np.random.default_rng(1)
    return [jpeg(photo(int(rng.integers(24, 48)), int(rng.integers(24, 48)), g))
            for g in range(36)]


@pytest.fixture(scope="module")
def shards(tmp_path_factory, small_images) -> Path:
    return write_images(tmp_path_factory.mktemp("augment") / "shards", small_images)


def by_key(batches) -> dict[str, np.ndarray]:
    out = {}
    for batch in batches:
        for key, pixels, valid in zip(batch["__key__"], batch["jpg"], batch["__valid__"],
                                      strict=True):
            if valid:
                out[key] = np.asarray(pixels)
    return out


def pipe_of(shards: Path, tmp_path: Path, **options) -> ShardPipeline:
    options = {"batch_size": 4, "image_size": 12, "augment": TRAIN, "seed": 3,
               "cache_dir": str(tmp_path / "cache"), **options}
    return ShardPipeline(str(shards), **options)


# -- options -------------------------------------------------------------------------------
@pytest.mark.parametrize("augment, says", [
    (["random_crop"], "augment[0]: 'random_crop' is not a stage (allowed: random_resized_crop"),
    ([{"horizontal_flip": {"prob": 0.5}}], "augment[0]: horizontal_flip has no argument 'prob'"),
    ([{"random_resized_crop": {"scale": [0.5, 2]}}], "augment[0]: random_resized_crop: scale"),
    (["center_crop", "resize"], "augment[1]: resize must come before a crop stage"),
    (["center_crop", "random_resized_crop"], "augment: one crop stage at most"),
    ([{"color_jitter": {"brightness": -1}}], "augment[0]: color_jitter: brightness=-1"),
    ("horizontal_flip", "augment: expected a list of stages"),
])
def test_a_bad_stage_is_one_line_naming_the_option_and_item(augment, says):
    with pytest.raises(PipelineError) as err:
        pipeline_config(None, {"augment": augment, "image_size": 8})
    assert says in str(err.value) and "\n" not in str(err.value)


def test_a_crop_needs_image_size():
    with pytest.raises(PipelineError, match="augment: its crop's output size is image_size"):
        pipeline_config(None, {"augment": TRAIN})


def test_validation_defaults_to_torchvisions_eval_preset():
    assert default_val_augment(TRAIN, 224) == [{"resize": {"shorter": 256}}, "center_crop"]
    assert default_val_augment(["horizontal_flip"], 224) is None
    config = pipeline_config(None, {"augment": TRAIN, "image_size": 224})
    assert augment_for(config, training=True) == TRAIN
    assert augment_for(config, training=False) == [{"resize": {"shorter": 256}},
                                                   "center_crop"]
    config = pipeline_config(None, {"augment": TRAIN, "val_augment": ["center_crop"],
                                    "image_size": 224})
    assert augment_for(config, training=False) == ["center_crop"]


# -- parameters: torchvision's rules -------------------------------------------------------
def test_random_resized_crop_follows_get_params():
    stages = parse_augment([{"random_resized_crop": {"scale": [0.25, 0.5],
                                                     "ratio": [0.5, 2.0]}}], (32, 32))
    areas, ratios = [], []
    for k in range(2000):
        p = crop_params(stages, 0, 0, f"k{k}", 300, 400)
        assert p.top == int(p.top) and p.left == int(p.left)
        assert 0 <= p.top and p.top + p.height <= 300 and 0 <= p.left
        assert p.left + p.width <= 400 and (p.out_height, p.out_width) == (32, 32)
        areas.append(p.height * p.width / (300 * 400))
        ratios.append(p.width / p.height)
    # rounding to whole pixels moves area and ratio by at most a pixel's share
    assert 0.25 - 0.01 <= min(areas) and max(areas) <= 0.5 + 0.01
    assert 0.5 * 0.98 <= min(ratios) and max(ratios) <= 2.0 * 1.02
    # area uniform in scale, log-ratio uniform: their medians sit mid-range
    assert abs(np.median(areas) - 0.375) < 0.02
    assert abs(np.median(np.log(ratios))) < 0.08


def test_random_resized_crop_falls_back_to_the_central_crop():
    # a 10 x 1000 strip: no crop of ratio <= 4/3 and area >= 90% fits in 10 tries
    stages = parse_augment([{"random_resized_crop": {"scale": [0.9, 1.0]}}], (8, 8))
    p = crop_params(stages, 0, 0, "strip", 10, 1000)
    w = int(round(10 * 4 / 3))  # in_ratio > max(ratio): h = height, w = round(h * 4/3)
    assert (p.top, p.left, p.height, p.width) == (0, (1000 - w) // 2, 10, w)
    assert CROP_TRIES == 10


def test_draws_depend_on_seed_epoch_and_key_only():
    stages = parse_augment(TRAIN, (16, 16))
    p = crop_params(stages, 7, 2, "a/b", 100, 120)
    assert crop_params(stages, 7, 2, "a/b", 100, 120) == p
    others = {crop_params(stages, *args, 100, 120) for args in
              [(8, 2, "a/b"), (7, 3, "a/b"), (7, 2, "a/c")]}
    assert p not in others
    flips = [crop_params(stages, 0, 0, f"k{k}", 50, 50).flip for k in range(2000)]
    assert 0.45 < np.mean(flips) < 0.55


def torchvision_erasing_params(rng, height: int, width: int, p: float, scale, ratio):
    """RandomErasing.forward + get_params (torchvision 0.2x) written out, its torch.rand /
    uniform_ / randint calls made on `rng` in the same order: (top, left, h, w) or None."""
    if not rng.random() < p:
        return None
    area = height * width
    log_ratio = (math.log(ratio[0]), math.log(ratio[1]))
    for _ in range(10):
        erase_area = area * rng.uniform(scale[0], scale[1])
        aspect_ratio = math.exp(rng.uniform(log_ratio[0], log_ratio[1]))
        h = int(round(math.sqrt(erase_area * aspect_ratio)))
        w = int(round(math.sqrt(erase_area / aspect_ratio)))
        if not (h < height and w < width):
            continue
        return rng.below(height - h + 1), rng.below(width - w + 1), h, w
    return None  # torchvision: (0, 0, H, W, img), the image unchanged


def test_random_erasing_follows_get_params():
    stages = parse_augment([*TRAIN, "random_erasing"], (40, 30))
    assert stages.stages[-1] == RandomErasing(0.5, (0.02, 0.33), (0.3, 3.3), (0.0,))
    boxes = []
    for k in range(3000):
        p = crop_params(stages, 5, 1, f"k{k}", 120, 90)
        want = torchvision_erasing_params(SampleDraws(5, 1, f"k{k}", ERASE_STREAM), 40, 30,
                                          0.5, (0.02, 0.33), (0.3, 3.3))
        assert p.erase == want
        boxes.append(p.erase)
    erased = [b for b in boxes if b is not None]
    assert 0.46 < len(erased) / len(boxes) < 0.54  # p = 0.5
    areas = [h * w / 1200 for _, _, h, w in erased]
    ratios = [h / w for _, _, h, w in erased if w]
    assert all(0 <= t and t + h <= 40 and 0 <= left and left + w <= 30
               for t, left, h, w in erased)
    assert min(areas) >= 0.02 * 0.8 and max(areas) <= 0.33 * 1.1
    # torchvision's log-uniform ratio h/w over [0.3, 3.3]: its median is about 1 (the boxes
    # that fit are kept, the rest redrawn: allow for it)
    assert abs(np.median(np.log(ratios))) < 0.15


def test_random_erasing_moves_no_other_stages_draws():
    base = parse_augment([*TRAIN, {"color_jitter": {"brightness": 0.4}}], (16, 16))
    erasing = parse_augment([*TRAIN, {"color_jitter": {"brightness": 0.4}},
                             {"random_erasing": {"p": 1.0}}], (16, 16))
    for k in range(200):
        p, q = (crop_params(s, 1, 2, f"k{k}", 50, 70) for s in (base, erasing))
        assert q._replace(erase=None) == p
    assert "random_erasing must be the last stage" in _config_error(
        [{"random_erasing": {}}, "horizontal_flip"])
    assert "augment[0]: random_erasing: value='random': a number or one per channel" in _config_error(
        [{"random_erasing": {"value": "random"}}])


def _config_error(augment) -> str:
    with pytest.raises(PipelineError) as err:
        pipeline_config(None, {"augment": augment, "image_size": 8})
    return str(err.value)


def test_resize_and_center_crop_are_torchvisions():
    stages = parse_augment([{"resize": {"shorter": 256}}, "center_crop"], (224, 224))
    p = crop_params(stages, 0, 0, "k", 375, 500)  # resized to 256 x 341, crop at (16, 58)
    sy, sx = 375 / 256, 500 / 341  # each axis maps back at its own scale
    assert (p.top, p.left) == pytest.approx((16 * sy, int(round((341 - 224) / 2)) * sx))
    assert (p.height, p.width) == pytest.approx((224 * sy, 224 * sx))
    small = crop_params(parse_augment(["center_crop"], (8, 8)), 0, 0, "k", 4, 6)
    assert (small.top, small.left, small.height, small.width) == (-2, -1, 8, 8)  # padded


def test_color_jitter_factors_in_range_and_random_order():
    stages = parse_augment([{"color_jitter": {"brightness": 0.4, "contrast": [0.5, 0.6]}}],
                           None)
    orders = set()
    for k in range(200):
        p = crop_params(stages, 0, 0, f"k{k}", 20, 20)
        assert 0.6 <= p.brightness <= 1.4 and 0.5 <= p.contrast <= 0.6
        assert p.saturation == 1.0
        orders.add(p.jitter_order)
    assert orders == {(0, 1), (1, 0)}


# -- pixels --------------------------------------------------------------------------------
def torchvision_pil(data: bytes, p) -> np.ndarray:
    """torchvision's PIL path by hand: open, RGB, crop, resize BILINEAR, flip."""
    image = Image.open(io.BytesIO(data)).convert("RGB")
    box = (int(p.left), int(p.top), int(p.left + p.width), int(p.top + p.height))
    image = image.crop(box).resize((p.out_width, p.out_height), Image.Resampling.BILINEAR)
    if p.flip:
        image = image.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
    return np.asarray(image)


def test_train_pixels_against_torchvisions_pil_path():
    """OpenCV's bilinear does not widen its filter for a downscale as PIL's does: the bound
    (README) is a mean of 2 levels and a 99th percentile of 16 (measured on photos: 1.3, 9)."""
    stages = parse_augment(TRAIN, (64, 64))
    diffs = []
    for k in range(12):
        data = jpeg(photo(150, 200, k))
        p = crop_params(stages, 0, 0, f"k{k}", 150, 200)
        ours = decode_augmented(data, stages, 0, 0, f"k{k}", 3)
        diffs.append(np.abs(ours.astype(int) - torchvision_pil(data, p)).ravel())
    diffs = np.concatenate(diffs)
    assert diffs.mean() <= 2.0 and np.percentile(diffs, 99) <= 16


def test_eval_pixels_are_torchvisions_within_one_level():
    stages = parse_augment([{"resize": {"shorter": 73}}, "center_crop"], (64, 64))
    data = jpeg(photo(150, 200))
    ours = decode_augmented(data, stages, 0, 0, "k", 3)
    image = Image.open(io.BytesIO(data)).convert("RGB").resize((97, 73),
                                                               Image.Resampling.BILINEAR)
    top, left = int(round((73 - 64) / 2)), int(round((97 - 64) / 2))
    reference = np.asarray(image.crop((left, top, left + 64, top + 64)))
    assert np.abs(ours.astype(int) - reference).max() <= 1


def test_crop_aware_decode_against_decode_then_crop():
    """A crop of 2x the output or more decodes at a DCT scale (libjpeg's scaled IDCT, which
    filters as it shrinks): against the full decode cropped and resized alike the bound is a
    mean of 4 levels, a 99th percentile of 32 (measured 3.2, 27 at ~5x), and it is nearer
    torchvision's PIL path than that full decode is (measured mean 1.9 against 4.3)."""
    stages = parse_augment([{"random_resized_crop": {"scale": [0.8, 1.0]}}], (48, 48))
    data = jpeg(photo(300, 400))
    full = np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))
    to_full, to_pil, full_to_pil = [], [], []
    for k in range(8):
        p = crop_params(stages, 0, 0, f"k{k}", 300, 400)
        assert p.height >= 2 * 48  # at least 1/2 scale
        reference = resample(full, (p.top, p.left, p.height, p.width), (48, 48)).astype(int)
        ours = decode_augmented(data, stages, 0, 0, f"k{k}", 3).astype(int)
        pil = torchvision_pil(data, p).astype(int)
        to_full.append(np.abs(ours - reference).ravel())
        to_pil.append(np.abs(ours - pil).mean())
        full_to_pil.append(np.abs(reference - pil).mean())
    to_full = np.concatenate(to_full)
    assert to_full.mean() <= 4.0 and np.percentile(to_full, 99) <= 32
    assert np.mean(to_pil) < np.mean(full_to_pil)


def test_a_flip_is_a_contiguous_mirror_image():
    """Contiguous, so the batch's copy of it is a plain one (a negative-stride view's is 3-6x
    slower); in colour and in grey (OpenCV drops a channel axis of 1)."""
    for mode, channels in [(None, 3), ("L", 1)]:
        stages = parse_augment([{"horizontal_flip": {"p": 1.0}}, "center_crop"], (16, 16))
        data = jpeg(photo(16, 16), mode)
        out = decode_augmented(data, stages, 0, 0, "k", channels)
        assert out.flags.c_contiguous and out.shape == (16, 16, channels)
        decoded = np.asarray(Image.open(io.BytesIO(data)))
        assert np.array_equal(out[..., 0] if mode else out, decoded[:, ::-1])


def test_a_cached_copy_crops_on_its_own_pixel_grid():
    """From the decoded cache's reduced copy a random crop's box moves to whole pixels of the
    copy (OpenCV's resize of a view, 2-4x faster than warpAffine of a fractional box): at most
    half a pixel of the copy per edge, so the region is the cold path's within that."""
    stages = parse_augment(TRAIN, (48, 48))
    data = jpeg(photo(300, 400))
    source = decode_source(data, 100, 3)
    assert source.pixels.shape[:2] == (100, 133)
    for k in range(8):
        p = crop_params(stages, 0, 0, f"k{k}", 300, 400)
        box = (p.top / 3, p.left * 133 / 400, p.height / 3, p.width * 133 / 400)
        snapped = on_grid(box)
        assert all(float(v).is_integer() for v in snapped)
        assert abs(snapped[0] - box[0]) <= 0.5 and abs(snapped[1] - box[1]) <= 0.5
        assert abs(snapped[0] + snapped[2] - box[0] - box[2]) <= 0.5
        ours = augment_source(source, stages, 0, 0, f"k{k}")
        expected = resample(source.pixels, snapped, (48, 48))
        assert np.array_equal(ours, expected[:, ::-1] if p.flip else expected)


# -- the pipeline ----------------------------------------------------------------------------
@pytest.mark.integration
def test_a_samples_pixels_are_the_same_at_any_rank_and_worker_count(shards, tmp_path):
    reference: dict[str, np.ndarray] = {}
    for world, workers in [(1, 0), (2, 2), (3, 0), (1, 2)]:
        seen: dict[str, np.ndarray] = {}
        for rank in range(world):
            pipe = pipe_of(shards, tmp_path, rank=rank, world_size=world, num_workers=workers,
                           balance="pad")
            pipe.set_epoch(1)
            seen.update(by_key(pipe))
        assert len(seen) == 36
        for key, pixels in seen.items():
            assert np.array_equal(reference.setdefault(key, pixels), pixels), (world, workers)
    pipe = pipe_of(shards, tmp_path)  # another epoch: other crops
    pipe.set_epoch(2)
    other = by_key(pipe)
    assert sum(not np.array_equal(other[k], reference[k]) for k in other) > len(other) // 2


@pytest.mark.integration
def test_random_erasing_is_zero_after_normalization_at_any_worker_count(shards, tmp_path,
                                                                         small_images):
    """value 0 = torchvision's: the erased pixels normalize to 0 (within half a uint8 level,
    the batch being uint8 before normalization), the same at any rank and worker count."""
    mean, std = np.array([0.485, 0.456, 0.406]), np.array([0.229, 0.224, 0.225])
    options = {"augment": [*TRAIN, {"random_erasing": {"p": 1.0}}],
               "normalize": (mean.tolist(), std.tolist()), "balance": "pad"}
    seen = [{}, {}]
    for i, (world, workers) in enumerate([(1, 0), (2, 2)]):
        for rank in range(world):
            pipe = pipe_of(shards, tmp_path, rank=rank, world_size=world, num_workers=workers,
                           **options)
            pipe.set_epoch(1)
            seen[i].update(by_key(pipe))
    assert seen[0].keys() == seen[1].keys() and len(seen[0]) == 36
    stages = parse_augment(options["augment"], (12, 12))
    erased = 0
    for key, pixels in seen[0].items():
        assert np.array_equal(pixels, seen[1][key])
        height, width = Image.open(io.BytesIO(small_images[int(key[-4:])])).size[::-1]
        p = crop_params(stages, 3, 1, key, height, width)
        if p.erase is not None:
            top, left, h, w = p.erase
            box = pixels[top:top + h, left:left + w]
            assert np.abs(box).max() <= 0.5 / 255 / std.min() + 1e-6
            erased += box.size > 0
    assert erased >= 30


@pytest.mark.integration
def test_a_resumed_pipeline_gives_the_same_pixels(shards, tmp_path):
    whole = pipe_of(shards, tmp_path, num_workers=2)
    whole.set_epoch(1)
    expected = by_key(whole)
    first = pipe_of(shards, tmp_path, num_workers=2)
    first.set_epoch(1)
    batches = iter(first)
    head = by_key([next(batches) for _ in range(3)])
    state = first.state_dict()
    batches.close()
    resumed = pipe_of(shards, tmp_path, num_workers=2)
    resumed.load_state_dict(state)
    rest = by_key(resumed)
    assert set(head) | set(rest) == set(expected) and not set(head) & set(rest)
    for key, pixels in {**head, **rest}.items():
        assert np.array_equal(pixels, expected[key])


@pytest.mark.integration
def test_validation_pixels_are_the_same_every_epoch_and_run(shards, tmp_path):
    val = default_val_augment(TRAIN, 12)
    runs = []
    for run in range(2):
        pipe = pipe_of(shards, tmp_path / str(run), augment=val, shuffle=False,
                       balance="pad", decoded_cache=run == 1)
        for epoch in range(2):
            pipe.set_epoch(epoch)
            runs.append(by_key(pipe))
    for other in runs[1:]:
        assert all(np.array_equal(runs[0][k], other[k]) for k in runs[0])


@pytest.mark.integration
def test_cached_epochs_crop_the_bounded_copy(tmp_path):
    images = [jpeg(photo(40 + 4 * g, 56, g)) for g in range(8)]
    shards = write_images(tmp_path / "shards", images)
    stages = parse_augment(TRAIN, (12, 12))
    cold = pipe_of(shards, tmp_path)
    cached = pipe_of(shards, tmp_path, decoded_cache=True, cache_short_side=20)
    for epoch in range(2):
        cold.set_epoch(epoch)
        cached.set_epoch(epoch)
        got_cold, got_cached = by_key(cold), by_key(cached)
        for g, data in enumerate(images):
            key = f"img{g:04d}"
            assert np.array_equal(got_cold[key],
                                  decode_augmented(data, stages, 3, epoch, key, 3))
            source = decode_source(data, 20, 3)
            assert min(source.pixels.shape[:2]) == 20
            assert np.array_equal(got_cached[key],
                                  augment_source(source, stages, 3, epoch, key))
    assert cached.stats()["decoded_cache_hits"] > 0


@pytest.mark.integration
@pytest.mark.parametrize("workers, limit", [(0, 1), (2, None)])
def test_with_the_decoded_cache_on_a_miss_crops_the_same_copy(tmp_path, workers, limit):
    """A shard not served from the cache (no room for its entry: cache_limit 1 byte; or
    another loader worker is writing it) is cropped from the same bounded copy as a cached
    one, so a sample's pixels do not depend on who wrote the entry (Decoder.via_source)."""
    images = [jpeg(photo(40 + 4 * g, 56, g)) for g in range(16)]
    shards = write_images(tmp_path / "shards", images, per_shard=4)
    stages = parse_augment(TRAIN, (12, 12))
    for epoch in range(2):
        pipe = pipe_of(shards, tmp_path, decoded_cache=True, cache_short_side=20,
                       cache_limit=limit, num_workers=workers)
        pipe.set_epoch(epoch)
        got = by_key(pipe)
        for g, data in enumerate(images):
            key = f"img{g:04d}"
            expected = augment_source(decode_source(data, 20, 3), stages, 3, epoch, key)
            assert np.array_equal(got[key], expected), (epoch, key)


@pytest.mark.integration
def test_grey_cmyk_and_png_named_jpeg_come_out_as_colour(tmp_path):
    pixels = photo(20, 24)
    images = [jpeg(pixels), jpeg(pixels, "L"), jpeg(pixels, "CMYK"), png(pixels)] * 2
    shards = write_images(tmp_path / "shards", images)
    for options in [{"augment": TRAIN, "image_size": 12},
                    {"channels": 3, "image_size": 12, "augment": None},
                    {"image_size": 12, "augment": None}]:  # mixed: promoted to 3
        pipe = pipe_of(shards, tmp_path, batch_size=8, shuffle=False, **options)
        [batch] = list(pipe)
        assert batch["jpg"].shape == (8, 12, 12, 3), options


@pytest.mark.system  # TensorFlow's import starts a process
def test_the_photo_folder_in_both_frameworks(tmp_path):
    pixels = photo(20, 24)
    images = [jpeg(pixels), jpeg(pixels, "L"), jpeg(pixels, "CMYK"), png(pixels)] * 2
    shards = write_images(tmp_path / "shards", images)
    from ringfeed.pipeline.tf import make_dataset
    from ringfeed.pipeline.torch import make_loader

    [torch_batch] = list(make_loader(pipe_of(shards, tmp_path, batch_size=8, shuffle=False)))
    [tf_batch] = list(make_dataset(pipe_of(shards, tmp_path, batch_size=8, shuffle=False)))
    assert tuple(torch_batch["jpg"].shape) == (8, 12, 12, 3)
    assert np.array_equal(torch_batch["jpg"].numpy(), tf_batch["jpg"].numpy())
    erasing = {"batch_size": 8, "shuffle": False,
               "augment": [*TRAIN, {"random_erasing": {"p": 1.0, "value": 0.5}}]}
    [torch_batch] = list(make_loader(pipe_of(shards, tmp_path, **erasing)))
    [tf_batch] = list(make_dataset(pipe_of(shards, tmp_path, **erasing)))
    assert (torch_batch["jpg"].numpy() == 128).all(-1).any()  # value 0.5 of x / 255: 128
    assert np.array_equal(torch_batch["jpg"].numpy(), tf_batch["jpg"].numpy())


@pytest.mark.integration
def test_grey_datasets_keep_one_channel(tmp_path):
    images = [jpeg(photo(16, 16, g), "L") for g in range(8)]
    shards = write_images(tmp_path / "shards", images)
    [batch] = list(pipe_of(shards, tmp_path, batch_size=8, augment=None, image_size=None))
    assert batch["jpg"].shape == (8, 16, 16, 1)
    [batch] = list(pipe_of(shards, tmp_path, batch_size=8, channels=1))
    assert batch["jpg"].shape == (8, 12, 12, 1)


@pytest.mark.integration
def test_images_that_do_not_stack_name_the_samples(tmp_path):
    images = [jpeg(photo(16 + g, 16)) for g in range(4)]
    shards = write_images(tmp_path / "shards", images)
    pipe = pipe_of(shards, tmp_path, augment=None, image_size=None, shuffle=False,
                   on_error="fail")
    with pytest.raises(PipelineDataError, match="'img0000' is \\(16, 16, 3\\)"):
        list(pipe)


def failing_transform(sample):
    raise KeyError("no such field in my transform")


@pytest.mark.integration
def test_a_user_transform_that_raises_is_the_users_error(shards, tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(Path(__file__).parent))
    hook = load_callable("test_augment:failing_transform", "data.transform")
    user_code = UserCode([("data.transform", "test_augment:failing_transform")])
    for options in [{}, {"decoded_cache": True}, {"num_workers": 2}]:
        pipe = pipe_of(shards, tmp_path, transform=hook, **options)
        with pytest.raises(KeyError) as err:
            list(pipe)
        assert pipe.stats()["skipped"] == 0
        assert user_code.culprit(err.value) == " (data.transform=test_augment:failing_transform)"
    assert "test_augment" in sys.modules


def test_jitter_keeps_uint8_and_moves_brightness():
    stages = parse_augment([{"color_jitter": {"brightness": [1.5, 1.5]}}], None)
    data = jpeg(np.full((8, 8, 3), 100, np.uint8))
    out = decode_augmented(data, stages, 0, 0, "k", 3)
    assert out.dtype == np.uint8 and math.isclose(out.mean(), 150, abs_tol=2)

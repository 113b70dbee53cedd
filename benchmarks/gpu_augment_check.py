"""GPU augmentation check (issue 45, `decode_device: cuda` with `augment`), for a machine with
one CUDA GPU and torchvision (nvJPEG). Three parts, one run:

1. pixels: one batch through nvJPEG + gpu_augment against the same batch decoded by PIL on the
   CPU and augmented by the same code (nvJPEG's IDCT/upsampling against libjpeg's), and
   against ringfeed's CPU path (augment_pixels.py): mean, 99th percentile, max levels;
2. the batch op: `augment_batch` on a decoded batch against a per-image loop (crop,
   F.interpolate, flip, normalize, stack), and nvJPEG's decode alone; ms a batch, interleaved
   repeats, median and min-max, CUDA-synchronized;
3. feeding torchvision's ResNet-50 (224 px, bf16 autocast, channels_last, SGD): one batch
   already on the GPU (synthetic), ringfeed with decode_device cuda, ringfeed decoding on the
   CPU (W loader workers), and the Horovod example's pipeline (torchvision ImageFolder +
   DataLoader, 16 workers, RandomResizedCrop + flip + ToTensor + Normalize); contenders
   interleaved round by round, images/s, ratio to synthetic in the same round (median, min-max)
   and the CPU cores each used (CPU seconds of the process tree over wall seconds).

Images: photo-like JPEGs made here (smooth shading, hard-edged discs, sensor noise; ImageNet's
500x375-class sizes, quality 90, 1 in 16 grey), or `--folder` of your own JPEGs.

    python benchmarks/gpu_augment_check.py                     # ~5 min on an H100
    python benchmarks/gpu_augment_check.py --quick             # ~1 min
    python benchmarks/gpu_augment_check.py --out /tmp/gpu_augment.json

Measures, never asserts. Exit 2: no CUDA GPU or no torchvision with nvJPEG.
"""

from __future__ import annotations

import argparse
import io
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

TRAIN = ["random_resized_crop", "horizontal_flip"]
MEAN_STD = ((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))
SHAPES = ((375, 500), (500, 375), (333, 500), (500, 333), (400, 500), (500, 500), (480, 640))


# -- images ------------------------------------------------------------------------------------
def photo_jpeg(i: int) -> bytes:
    from PIL import Image

    rng = np.random.default_rng(i)
    h, w = SHAPES[i % len(SHAPES)]
    y, x = np.mgrid[0:h, 0:w].astype(np.float32)
    image = np.stack([128 + 80 * np.sin(x / rng.uniform(5, 40) + c) *
                      np.cos(y / rng.uniform(5, 40)) for c in range(3)], -1)
    for _ in range(12):
        cy, cx, r = rng.uniform(0, h), rng.uniform(0, w), rng.uniform(5, h / 4)
        image[(y - cy) ** 2 + (x - cx) ** 2 < r * r] = rng.uniform(0, 255, 3)
    image += rng.normal(0, 16, image.shape)  # ~100 KB at q90, as ImageNet's photos
    pil = Image.fromarray(np.clip(image, 0, 255).astype(np.uint8))
    if i % 16 == 15:
        pil = pil.convert("L")
    buffer = io.BytesIO()
    pil.save(buffer, "JPEG", quality=90)
    return buffer.getvalue()


def make_images(count: int, folder: str | None) -> list[bytes]:
    if folder:
        files = sorted(Path(folder).rglob("*.[jJ][pP]*[gG]"))[:count]
        return [f.read_bytes() for f in files]
    with ProcessPoolExecutor() as pool:
        return list(pool.map(photo_jpeg, range(count), chunksize=16))


def write_shards(directory: Path, images: list[bytes], per_shard: int = 512) -> Path:
    import webdataset as wds

    from ringfeed.formats.manifest import Manifest, ShardInfo, Split
    from ringfeed.fsutil import sha256_file

    directory.mkdir(parents=True)
    infos = []
    for s, start in enumerate(range(0, len(images), per_shard)):
        path = directory / f"train-{s:06d}.tar"
        with wds.TarWriter(str(path)) as sink:
            for g in range(start, min(start + per_shard, len(images))):
                sink.write({"__key__": f"img{g:06d}", "jpg": images[g],
                            "cls": str(g % 1000).encode()})
        infos.append(ShardInfo(path.name, min(per_shard, len(images) - start),
                               path.stat().st_size, sha256_file(path)))
    Manifest(splits={"train": Split(infos)}, fields={"jpg": "image", "cls": "int"},
             created_by="gpu_augment_check").save(directory)
    return directory


def write_folder(directory: Path, images: list[bytes]) -> Path:
    for g, data in enumerate(images):
        folder = directory / f"class{g % 10}"
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"{g:06d}.jpg").write_bytes(data)
    return directory


# -- 1. pixels -----------------------------------------------------------------------------------
def pil_decode(tensors: list, channels: int, device: Any) -> list:
    import torch

    from ringfeed.pipeline import codecs

    return [torch.from_numpy(np.ascontiguousarray(
        codecs.decode_pil(t.numpy().tobytes(), channels=channels).transpose(2, 0, 1)))
        .to(device) for t in tensors]


def levels(a: np.ndarray, b: np.ndarray) -> dict[str, float]:
    d = np.abs(a.astype(np.int32) - b.astype(np.int32))
    return {"mean": float(d.mean()), "p99": float(np.percentile(d, 99)), "max": int(d.max())}


def pixels(images: list[bytes], batch: int) -> dict[str, Any]:
    from ringfeed.pipeline.augment import parse_augment
    from ringfeed.pipeline.augment_pixels import decode_augmented
    from ringfeed.pipeline.gpu_augment import decode_augment_batch

    datas, keys = images[:batch], [f"img{g:06d}" for g in range(batch)]
    stages = parse_augment(TRAIN, (224, 224))
    gpu = decode_augment_batch(datas, keys, stages, 0, 0, "cuda").cpu().numpy()
    pil = decode_augment_batch(datas, keys, stages, 0, 0, "cpu", pil_decode).numpy()
    cpu = np.stack([decode_augmented(d, stages, 0, 0, k, 3) for d, k in zip(datas, keys,
                                                                            strict=True)])
    return {"nvjpeg_vs_pil_same_augment": levels(gpu, pil),
            "gpu_path_vs_cpu_path": levels(gpu, cpu)}


# -- 2. the batch op -----------------------------------------------------------------------------
def cuda_ms(fn: Callable[[], Any]) -> float:
    import torch

    torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return 1000 * (time.perf_counter() - start)


def per_image(images: list, params: list, scale: Any, shift: Any) -> Any:
    """The loop gpu_augment replaces: a few kernels per image, then a stack."""
    import torch
    import torch.nn.functional as F

    out = []
    for image, p in zip(images, params, strict=True):
        top, left, h, w = (int(v) for v in (p.top, p.left, p.height, p.width))
        crop = image[:, top:top + h, left:left + w].float()[None]
        x = F.interpolate(crop, size=(p.out_height, p.out_width), mode="bilinear",
                          align_corners=False, antialias=False)[0].round_()
        out.append(x.flip(-1) if p.flip else x)
    return torch.stack(out) * scale - shift


def batch_op(images: list[bytes], batch: int, repeats: int) -> dict[str, Any]:
    import torch

    from ringfeed.pipeline import gpu_decode
    from ringfeed.pipeline.augment import parse_augment
    from ringfeed.pipeline.gpu_augment import augment_batch, sample_params

    device = torch.device("cuda")
    datas = images[:batch]
    decode = gpu_decode.nvjpeg_decoder()
    decoded = gpu_decode.decode_images(datas, device, decode, 3)
    sizes = [(int(im.shape[1]), int(im.shape[2])) for im in decoded]
    stages = parse_augment(TRAIN, (224, 224))
    params = sample_params(stages, 0, 0, [f"k{g}" for g in range(batch)], sizes)
    mean, std = (torch.tensor(v, device=device).view(3, 1, 1) for v in MEAN_STD)
    scale, shift = 1 / (255 * std), mean / std
    host_scale = (1 / (255 * np.array(MEAN_STD[1]))).astype(np.float32)
    host_shift = (np.array(MEAN_STD[0]) / np.array(MEAN_STD[1])).astype(np.float32)
    contenders = {
        "augment_batch": lambda: augment_batch(decoded, params, sizes, scale=host_scale,
                                               shift=host_shift, channels_last=True),
        "per-image loop": lambda: per_image(decoded, params, scale, shift),
        "nvJPEG decode": lambda: gpu_decode.decode_images(datas, device, decode, 3),
    }
    times: dict[str, list[float]] = {name: [] for name in contenders}
    for fn in contenders.values():  # warm-up
        fn()
    for _ in range(repeats):
        for name, fn in contenders.items():
            times[name].append(cuda_ms(fn))
    ratio = [b / a for a, b in zip(times["augment_batch"], times["per-image loop"],
                                      strict=True)]
    return {"batch": batch, "ms": {k: summary(v) for k, v in times.items()},
            "per_image_over_batched": summary(ratio)}


# -- 3. feeding ResNet-50 ------------------------------------------------------------------------
def summary(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def tree_cpu_s() -> float:
    import psutil

    me = psutil.Process()
    total = 0.0
    for proc in [me, *me.children(recursive=True)]:
        try:
            t = proc.cpu_times()
            total += t.user + t.system
        except psutil.Error:
            pass
    return total


def ringfeed_batches(shards: Path, opts: argparse.Namespace, device_decode: bool,
                     cache: Path) -> Iterator[Any]:
    import torch

    from ringfeed.pipeline import ShardPipeline
    from ringfeed.pipeline.torch import make_loader

    options = {"batch_size": opts.batch, "image_size": 224, "augment": TRAIN, "seed": 0,
               "cache_dir": str(cache)}
    if device_decode:
        pipe = ShardPipeline(str(shards), decode_device="cuda", normalize=MEAN_STD,
                             num_workers=opts.gpu_workers, **options)
    else:
        pipe = ShardPipeline(str(shards), num_workers=opts.cpu_workers, **options)
    mean, std = (torch.tensor(v, device="cuda").view(1, 3, 1, 1) for v in MEAN_STD)
    loader, epoch = make_loader(pipe), 0
    while True:
        pipe.set_epoch(epoch)
        for batch in loader:
            x = batch["jpg"].to("cuda", non_blocking=True).permute(0, 3, 1, 2)
            if not device_decode:  # uint8 over PCIe, normalized on the GPU
                x = x.float().div_(255).sub_(mean).div_(std)
            yield x, batch["cls"].to("cuda", non_blocking=True)
        epoch += 1


def imagefolder_batches(folder: Path, opts: argparse.Namespace) -> Iterator[Any]:
    import torch
    from torchvision import datasets, transforms

    transform = transforms.Compose([
        transforms.RandomResizedCrop(224), transforms.RandomHorizontalFlip(),
        transforms.ToTensor(), transforms.Normalize(*MEAN_STD)])
    loader = torch.utils.data.DataLoader(
        datasets.ImageFolder(str(folder), transform), batch_size=opts.batch, shuffle=True,
        num_workers=16, pin_memory=True, persistent_workers=True, drop_last=True)
    while True:
        for x, y in loader:
            yield (x.to("cuda", non_blocking=True).contiguous(memory_format=torch.channels_last),
                   y.to("cuda", non_blocking=True))


def synthetic_batches(opts: argparse.Namespace) -> Iterator[Any]:
    import torch

    x = torch.randn(opts.batch, 3, 224, 224, device="cuda").contiguous(
        memory_format=torch.channels_last)
    y = torch.randint(0, 1000, (opts.batch,), device="cuda")
    while True:
        yield x, y


def trainer() -> Callable[[Any, Any], None]:
    import torch
    import torch.nn.functional as F
    from torchvision.models import resnet50

    model = resnet50().cuda().to(memory_format=torch.channels_last)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

    def step(x: Any, y: Any) -> None:
        with torch.autocast("cuda", torch.bfloat16):
            loss = F.cross_entropy(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    return step


def feeding(shards: Path, folder: Path, opts: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    import torch

    step = trainer()
    feeds = {"synthetic (on the GPU)": synthetic_batches(opts),
             "ringfeed decode_device cuda": ringfeed_batches(shards, opts, True, tmp / "c1"),
             f"ringfeed CPU decode ({opts.cpu_workers} workers)":
                 ringfeed_batches(shards, opts, False, tmp / "c2"),
             "torchvision ImageFolder + DataLoader (16 workers)":
                 imagefolder_batches(folder, opts)}
    for feed in feeds.values():  # start the workers, warm the model and the allocator
        for _ in range(opts.warmup):
            step(*next(feed))
    rates: dict[str, list[float]] = {name: [] for name in feeds}
    cores: dict[str, list[float]] = {name: [] for name in feeds}
    for _ in range(opts.repeats):
        for name, feed in feeds.items():
            torch.cuda.synchronize()
            cpu, start = tree_cpu_s(), time.perf_counter()
            for _ in range(opts.steps):
                step(*next(feed))
            torch.cuda.synchronize()
            wall = time.perf_counter() - start
            rates[name].append(opts.steps * opts.batch / wall)
            cores[name].append((tree_cpu_s() - cpu) / wall)
    base = rates["synthetic (on the GPU)"]
    return {name: {"images_per_s": summary(r), "cpu_cores": summary(cores[name]),
                   "ratio_to_synthetic": summary([a / b for a, b in zip(r, base, strict=True)])}
            for name, r in rates.items()}


# -- main ----------------------------------------------------------------------------------------
def ready() -> str | None:
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if not torch.cuda.is_available():
        return "no CUDA GPU visible"
    from ringfeed.pipeline.gpu_decode import check_available

    try:
        check_available("cuda")
    except ValueError as e:
        return str(e)
    return None


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--images", type=int, default=8192)
    p.add_argument("--folder", help="your own JPEGs (searched recursively) instead")
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--steps", type=int, default=30, help="timed steps per contender a round")
    p.add_argument("--warmup", type=int, default=8)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--cpu-workers", type=int, default=14)
    p.add_argument("--gpu-workers", type=int, default=4)
    p.add_argument("--quick", action="store_true", help="2048 images, 10 steps, 2 rounds")
    p.add_argument("--out", help="write the results as JSON here")
    opts = p.parse_args(argv)
    if opts.quick:
        opts.images, opts.steps, opts.repeats, opts.warmup = 2048, 10, 2, 4
    return opts


def main(argv: list[str] | None = None) -> int:
    opts = parse(argv)
    why = ready()
    if why is not None:
        print(f"gpu_augment_check: {why}", file=sys.stderr)
        return 2
    import torch

    results: dict[str, Any] = {"device": torch.cuda.get_device_name(),
                               "torch": torch.__version__, "options": vars(opts)}
    images = make_images(opts.images, opts.folder)
    results["images"] = {"count": len(images), "mean_kb": float(np.mean([len(d) for d in
                                                                       images]) / 1e3)}
    results["pixels"] = pixels(images, min(64, len(images)))
    results["batch_op"] = batch_op(images, opts.batch, max(5, opts.repeats * 3))
    with tempfile.TemporaryDirectory() as tmp:
        shards = write_shards(Path(tmp) / "shards", images)
        folder = write_folder(Path(tmp) / "folder", images)
        results["feeding"] = feeding(shards, folder, opts, Path(tmp))
    text = json.dumps(results, indent=1)
    print(text)
    if opts.out:
        Path(opts.out).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Generated shard sets for the trainer and scaling benchmarks: small PNG images with a class
label, written with webdataset's TarWriter plus a ringfeed manifest (ringfeed/formats/manifest.py), and
cached in the temp dir so repeated runs reuse them."""

from __future__ import annotations

import io
import shutil
import tempfile
from pathlib import Path

import numpy as np

from ringfeed.formats.manifest import Manifest, ShardInfo, Split
from ringfeed.fsutil import sha256_file

CACHE = Path(tempfile.gettempdir()) / "ringfeed-bench"


def cached_dir(name: str, build) -> Path:
    """`CACHE/name`, built by `build(tmp_dir)` into a temp dir renamed into place."""
    path = CACHE / name
    if (path / "manifest.json").exists():
        return path
    CACHE.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=CACHE, prefix=f".{name}-"))
    try:
        build(tmp)
        tmp.rename(path)
    except OSError:
        if not (path / "manifest.json").exists():
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # gone after the rename; left over otherwise
    return path


def _png(pixels: np.ndarray) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return buf.getvalue()


def _manifest(out: Path, names: list[str], counts: list[int], classes: int) -> None:
    shards = [ShardInfo(n, c, (out / n).stat().st_size, sha256_file(out / n))
              for n, c in zip(names, counts, strict=True)]
    Manifest(splits={"train": Split(shards)}, fields={"png": "image", "cls": "int"},
             source={"format": "generated", "path": "benchmarks/datasets.py"},
             class_names=[f"class{i}" for i in range(classes)],
             created_by="ringfeed benchmarks").save(out)


def image_shards(samples: int, per_shard: int, side: int = 32, classes: int = 10) -> Path:
    """`ringfeed shard` of an image folder (class subfolders) of `samples` random-texture
    `side`x`side` RGB PNGs, `per_shard` a shard, shuffled across shards: what users feed
    `ringfeed train`."""
    from ringfeed.train.cli import main as ringfeed

    def build(out: Path) -> None:
        rng = np.random.default_rng(0)
        with tempfile.TemporaryDirectory(dir=CACHE, prefix=".images-") as src:
            for c in range(classes):
                (Path(src) / f"class{c}").mkdir()
            for i in range(samples):
                # blocky colour patches plus noise: PNGs of realistic, varied size
                base = rng.integers(0, 256, (4, 4, 3), dtype=np.uint8)
                image = np.kron(base, np.ones((side // 4, side // 4, 1), np.uint8))
                image += rng.integers(0, 32, image.shape, dtype=np.uint8)
                (Path(src) / f"class{i % classes}" / f"{i:08d}.png").write_bytes(_png(image))
            code = ringfeed(["shard", src, str(out), "--format", "imagefolder", "--max-count",
                             str(per_shard), "--shuffle-seed", "0", "--no-progress"])
        if code != 0:
            raise RuntimeError(f"ringfeed shard exited {code}")

    return cached_dir(f"shards-{samples}x{side}px-{per_shard}per-v2", build)


def replicated(base: Path, times: int) -> Path:
    """`base`'s shards copied `times` over (distinct files), with the manifest to match: the
    same data distribution at `times` the dataset size."""
    if times == 1:
        return base

    def build(out: Path) -> None:
        split = Manifest.load(base).split("train")
        names, counts = [], []
        for _ in range(times):
            for shard in split.shards:
                name = f"train-{len(names):06d}.tar"
                shutil.copyfile(base / shard.name, out / name)
                names.append(name)
                counts.append(shard.num_samples)
        classes = len(Manifest.load(base).class_names or [])
        _manifest(out, names, counts, classes)

    return cached_dir(f"{base.name}-x{times}", build)

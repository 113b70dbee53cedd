"""Small datasets and readers for the `ringfeed shard / verify / inspect` tests."""

from __future__ import annotations

import io
import json
import tarfile
from pathlib import Path

import numpy as np

from ringfeed.train.cli import main as ringfeed_main


def cli(capsys, *args: str) -> tuple[int, str, str]:
    """Run `ringfeed ARGS` in this process: (exit code, stdout, stderr)."""
    capsys.readouterr()
    code = ringfeed_main([str(a) for a in args])
    out, err = capsys.readouterr()
    return code, out, err


def make_images(root: Path, classes: dict[str, int], side: int = 8, seed: int = 0) -> Path:
    """root/<class>/imgNNN.{png,jpg}: `classes[name]` small random images per class."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    for name, count in classes.items():
        (root / name).mkdir(parents=True, exist_ok=True)
        for i in range(count):
            pixels = rng.integers(0, 256, (side, side, 3), dtype=np.uint8)
            ext = "png" if i % 2 else "jpg"
            Image.fromarray(pixels).save(root / name / f"img{i:03d}.{ext}")
    return root


def members(tar_path: Path) -> list[tuple[str, bytes]]:
    """(name, bytes) of every member, in tar order."""
    with tarfile.open(tar_path) as tar:
        return [(m.name, tar.extractfile(m).read()) for m in tar if m.isfile()]


def samples(tar_path: Path) -> list[dict[str, bytes]]:
    """Members grouped as webdataset does: consecutive names sharing the part before the first '.'"""
    out: list[dict[str, bytes]] = []
    for name, data in members(tar_path):
        key, ext = name.split(".", 1)
        if not out or out[-1]["__key__"] != key:
            out.append({"__key__": key})
        out[-1][ext] = data
    return out


def manifest(out: Path) -> dict:
    return json.loads((out / "manifest.json").read_text())


def split_samples(out: Path, split: str) -> list[dict[str, bytes]]:
    m = manifest(out)
    return [s for shard in m["splits"][split]["shards"] for s in samples(out / shard["name"])]


def tree_bytes(out: Path) -> dict[str, bytes]:
    """Every file under `out` (relative name -> content), hidden ones included."""
    return {str(p.relative_to(out)): p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()}


def load_npy(data: bytes) -> np.ndarray:
    return np.load(io.BytesIO(data), allow_pickle=False)

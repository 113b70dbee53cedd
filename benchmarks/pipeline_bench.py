"""Pipeline benchmark: ringfeed's ShardPipeline against its peers, in the same run.

1. Decoded samples/s: ringfeed (`pipeline.torch.make_loader`) vs bare `webdataset.WebDataset`
   (+ DataLoader), same shards, same work (PNG -> uint8 HWC array, class int, shuffle buffer,
   batches of 32), for W = 1 and 2 loader workers. Goal: ratio >= 0.95.
2. Raw shard bytes/s: ringfeed reading every sample without decoding (fields as bytes) vs
   `cat` of the same files to /dev/null, both from the page cache. Goal: ratio >= 0.8.
3. Cold vs warm epoch: the same pipeline from a loopback HTTP store (a child process) throttled
   to 10 MB/s per connection, first with an empty cache (download) then with a warm one.
   Goal: cold / warm >= 5. The ratio is about (bytes / rate) / (decode-bound epoch time), so it
   is also reported at 40 MB/s, with warm / local (a warm epoch vs reading the files in place)
   and cold / (bytes / rate) (how close a cold epoch gets to the download bound).

Prints the ratios, writes benchmarks/results/pipeline_bench.json and .png. Does not assert.
    python benchmarks/pipeline_bench.py [--quick] [--out DIR]
"""

from __future__ import annotations

import argparse
import io
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))

GOALS = {"decoded_w1": 0.95, "decoded_w2": 0.95, "raw_vs_cat": 0.8, "cold_vs_warm": 5.0}


def write_bench_shards(directory: Path, samples: int, shards: int, image: int,
                       payload: int = 0) -> list[Path]:
    """Noise PNGs (`image` px square) + class labels; with `payload` > 0, a `bin` member of that
    many bytes instead of the image (for raw-read throughput)."""
    import webdataset as wds
    from PIL import Image

    from shards.fsutil import sha256_file
    from shards.manifest import Manifest, ShardInfo, Split

    directory.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    per_shard = -(-samples // shards)
    paths, infos = [], []
    for s in range(shards):
        path = directory / f"train-{s:06d}.tar"
        count = min(per_shard, samples - s * per_shard)
        with wds.TarWriter(str(path)) as sink:
            for i in range(count):
                sample = {"__key__": f"s{s:04d}_{i:05d}", "cls": str(i % 10).encode()}
                if payload:
                    sample["bin"] = rng.bytes(payload)
                else:
                    buf = io.BytesIO()
                    pixels = rng.integers(0, 256, (image, image, 3), dtype=np.uint8)
                    Image.fromarray(pixels).save(buf, format="PNG", compress_level=1)
                    sample["png"] = buf.getvalue()
                sink.write(sample)
        paths.append(path)
        infos.append(ShardInfo(path.name, count, path.stat().st_size, sha256_file(path)))
    fields = {"cls": "int", **({"bin": "bytes"} if payload else {"png": "image"})}
    Manifest(splits={"train": Split(infos)}, fields=fields, created_by="bench").save(directory)
    return paths


def timed_epochs(loader, epochs: int) -> tuple[float, int]:
    start, samples = time.perf_counter(), 0
    for _ in range(epochs):
        for batch in loader:
            samples += len(batch["__key__"])
    return time.perf_counter() - start, samples


def decoded_rates(shard_dir: Path, workers: int, epochs: int, rounds: int, batch: int
                  ) -> dict[str, float]:
    import webdataset as wds
    from torch.utils.data import DataLoader

    from pipeline import ShardPipeline
    from pipeline.torch import make_loader

    urls = [str(p) for p in sorted(shard_dir.glob("*.tar"))]
    ours = make_loader(ShardPipeline(shard_dir, batch_size=batch, shuffle_buffer=1000,
                                     num_workers=workers, balance="pad"))
    dataset = (wds.WebDataset(urls, shardshuffle=False, empty_check=False)
               .shuffle(1000).decode("rgb8").batched(batch))
    theirs = DataLoader(dataset, batch_size=None, num_workers=workers,
                        persistent_workers=True, prefetch_factor=2)
    timed_epochs(ours, 1)  # warm-up: worker start, page cache
    timed_epochs(theirs, 1)
    best = {"ringfeed": 0.0, "webdataset": 0.0}
    for _ in range(rounds):  # interleaved, best of: the machine is shared
        for name, loader in (("ringfeed", ours), ("webdataset", theirs)):
            seconds, samples = timed_epochs(loader, epochs)
            best[name] = max(best[name], samples / seconds)
    return best


def raw_rates(shard_dir: Path, rounds: int) -> dict[str, float]:
    """Bytes/s over all shards: `cat`; ringfeed's I/O path alone (ShardCache.open + read);
    ringfeed's whole pipeline without decoding; webdataset iterating the same tars."""
    import webdataset as wds

    from pipeline import ShardPipeline
    from pipeline.cache import ShardCache
    from pipeline.source import ShardRef

    paths = sorted(shard_dir.glob("*.tar"))
    total = sum(p.stat().st_size for p in paths)
    pipe = ShardPipeline(shard_dir, batch_size=16, shuffle=False, balance="pad",
                         fields={"png": "bytes", "bin": "bytes", "cls": "bytes"})
    cache = ShardCache(None)
    refs = [ShardRef(str(p), 0) for p in paths]

    def cat() -> None:
        subprocess.run(["cat", *map(str, paths)], stdout=subprocess.DEVNULL, check=True)

    def io_path() -> None:
        for ref in refs:
            handle = cache.open(ref)
            while handle.file.read(1 << 20):
                pass
            handle.close()

    def pipeline() -> None:
        for _ in pipe:
            pass

    def webdataset() -> None:
        for _ in wds.WebDataset(list(map(str, paths)), shardshuffle=False, empty_check=False):
            pass

    best = dict.fromkeys(("cat", "io", "ringfeed", "webdataset"), 0.0)
    runs = {"cat": cat, "io": io_path, "ringfeed": pipeline, "webdataset": webdataset}
    for _ in range(rounds + 1):  # the first round also warms the page cache
        for name, run in runs.items():
            start = time.perf_counter()
            run()
            best[name] = max(best[name], total / (time.perf_counter() - start))
    best["bytes"] = total
    return best


def cold_warm(shard_dir: Path, rates: list[float], batch: int) -> dict[str, Any]:
    """Epoch time from a loopback HTTP store throttled to each rate (B/s, per connection):
    cold (empty cache) then warm (cached); and the same epoch reading the directory in place."""
    from pipeline_util import http_server_process

    from pipeline import ShardPipeline

    def epoch_s(pipe: ShardPipeline, epoch: int) -> float:
        pipe.set_epoch(epoch)
        start = time.perf_counter()
        for _ in pipe:
            pass
        return time.perf_counter() - start

    options = {"batch_size": batch, "shuffle_buffer": 1000, "balance": "pad", "prefetch": 2}
    total = sum(p.stat().st_size for p in shard_dir.glob("*.tar"))
    result: dict[str, Any] = {"local_s": epoch_s(ShardPipeline(shard_dir, **options), 1),
                              "bytes": total, "runs": []}
    for rate in rates:
        with tempfile.TemporaryDirectory() as cache, http_server_process(shard_dir, rate) as url:
            pipe = ShardPipeline(url, cache_dir=cache, **options)
            cold, warm = epoch_s(pipe, 0), epoch_s(pipe, 1)
            result["runs"].append({"throttle_bytes_per_s": rate, "cold_s": cold, "warm_s": warm,
                                   "download_bound_s": total / rate,
                                   "cache_hit_rate": pipe.stats()["cache_hit_rate"]})
    return result


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(GOALS)
    ratios = [result["ratios"][n] for n in names]
    fig, ax = plt.subplots(figsize=(7, 3.5))
    ax.bar(names, [r / GOALS[n] for n, r in zip(names, ratios, strict=True)], color="tab:blue")
    ax.axhline(1.0, color="tab:red", linestyle="--", label="goal")
    for i, (n, r) in enumerate(zip(names, ratios, strict=True)):
        ax.text(i, r / GOALS[n], f"{r:.2f}\n(goal {GOALS[n]})", ha="center", va="bottom",
                fontsize=8)
    ax.set_ylabel("ratio / goal")
    ax.set_title("ringfeed pipeline vs peers (same run)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny smoke run")
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results"))
    args = parser.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    q = args.quick
    samples, shards, image = (256, 4, 32) if q else (4096, 16, 64)
    batch, epochs, rounds = (16, 1, 1) if q else (32, 2, 3)
    rates = [10e6, 40e6]  # B/s per connection: a slow and a fast remote store
    with tempfile.TemporaryDirectory() as tmp:
        images = Path(tmp) / "images"
        write_bench_shards(images, samples, shards, image)
        blobs = Path(tmp) / "blobs"
        write_bench_shards(blobs, 64 if q else 512, 4 if q else 8, 0, payload=256 * 1024)
        result: dict = {"config": {"quick": q, "samples": samples, "shards": shards,
                                   "image": image, "batch": batch, "cpus": os.cpu_count()}}
        for w in (1, 2):
            result[f"decoded_w{w}"] = decoded_rates(images, w, epochs, rounds, batch)
        result["raw_images"] = raw_rates(images, rounds)
        result["raw_blobs"] = raw_rates(blobs, rounds)
        result["cold_warm"] = cold_warm(images, rates, batch)
    result["ratios"] = {
        "decoded_w1": result["decoded_w1"]["ringfeed"] / result["decoded_w1"]["webdataset"],
        "decoded_w2": result["decoded_w2"]["ringfeed"] / result["decoded_w2"]["webdataset"],
        "raw_vs_cat": result["raw_blobs"]["ringfeed"] / result["raw_blobs"]["cat"],
        "raw_vs_cat_small_samples": result["raw_images"]["ringfeed"] / result["raw_images"]["cat"],
        "raw_vs_webdataset": result["raw_blobs"]["ringfeed"] / result["raw_blobs"]["webdataset"],
        "webdataset_raw_vs_cat": result["raw_blobs"]["webdataset"] / result["raw_blobs"]["cat"],
        "io_vs_cat": result["raw_blobs"]["io"] / result["raw_blobs"]["cat"],
    }
    slow, fast = result["cold_warm"]["runs"]
    result["ratios"].update({
        "cold_vs_warm": slow["cold_s"] / slow["warm_s"],
        "cold_vs_warm_40MBps": fast["cold_s"] / fast["warm_s"],
        "warm_vs_local": slow["warm_s"] / result["cold_warm"]["local_s"],
        "cold_vs_download_bound": slow["cold_s"] / slow["download_bound_s"],
    })
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    name = "pipeline_bench_quick" if q else "pipeline_bench"
    from shards.fsutil import atomic_write_text

    atomic_write_text(out / f"{name}.json", json.dumps(result, indent=2) + "\n")
    plot(result, out / f"{name}.png")
    for key, ratio in result["ratios"].items():
        goal = GOALS.get(key)
        print(f"{key:28s} {ratio:7.3f}" + (f"   (goal >= {goal})" if goal else ""))
    print(f"wrote {out / name}.json and .png")
    return result


if __name__ == "__main__":
    main()

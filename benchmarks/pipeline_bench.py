"""Pipeline benchmark: ringfeed's ShardPipeline against its peers, in the same run.

1. Decoded samples/s: ringfeed (`ringfeed.pipeline.torch.make_loader`) vs bare `webdataset.WebDataset`
   (+ DataLoader), same shards, same work (PNG -> uint8 HWC array, class int, shuffle buffer,
   batches of 32), for W = 1 and 2 loader workers. Goal: ratio >= 0.95.
2. Raw shard bytes/s: ringfeed reading every sample without decoding (fields as bytes) vs
   `cat` of the same files to /dev/null, both from the page cache. Goal: ratio >= 0.8.
3. One core, in-process, 64x64 JPEG shards made by `ringfeed shard` (a child process pinned
   to one CPU): ringfeed's first epoch (reading through the tar index, decoding, writing the
   decoded-sample cache) and second epoch (batches gathered from the cache) vs bare
   `webdataset.WebDataset(...).shuffle(1000).decode("rgb8").batched(32)` in the same process.
   Goals: first epoch >= 2.5x, cached epoch >= 10x.
4. Cold vs warm epoch: the same pipeline from a loopback HTTP store (a child process) throttled
   to 10 MB/s per connection, first with an empty cache (download) then with a warm one.
   Goal: cold / warm >= 5. The ratio is about (bytes / rate) / (decode-bound epoch time), so it
   is also reported at 40 MB/s, with warm / local (a warm epoch vs reading the files in place)
   and cold / (bytes / rate) (how close a cold epoch gets to the download bound).

Prints a table of ratios, writes benchmarks/results/pipeline_bench.json and .png (via
benchmarks/common.py). Does not assert.
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
sys.path.insert(0, str(REPO / "tests"))  # pipeline_util: the loopback HTTP store
sys.path.insert(0, str(REPO / "benchmarks"))  # common: rows, JSON/PNG output


def write_bench_shards(directory: Path, samples: int, shards: int, image: int,
                       payload: int = 0) -> list[Path]:
    """Noise PNGs (`image` px square) + class labels; with `payload` > 0, a `bin` member of that
    many bytes instead of the image (for raw-read throughput)."""
    import webdataset as wds
    from PIL import Image

    from ringfeed.formats.manifest import Manifest, ShardInfo, Split
    from ringfeed.fsutil import sha256_file

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

    from ringfeed.pipeline import ShardPipeline
    from ringfeed.pipeline.torch import make_loader

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


def write_jpeg_folder(directory: Path, samples: int, size: int) -> None:
    """An image folder of `samples` JPEGs (q90, `size` px, 10 classes): smooth gradients with
    noise, so they compress like photos rather than like noise."""
    from PIL import Image

    rng = np.random.default_rng(0)
    yy, xx = np.mgrid[0:size, 0:size].astype(np.float32) / size
    for i in range(samples):
        folder = directory / f"class{i % 10}"
        folder.mkdir(parents=True, exist_ok=True)
        a, b, c = rng.random(3) * 255
        base = np.stack([a * xx, b * yy, c * (1 - xx) * yy], axis=-1)
        pixels = np.clip(base + rng.normal(0, 12, base.shape), 0, 255).astype(np.uint8)
        Image.fromarray(pixels).save(folder / f"{i:06d}.jpg", quality=90)


def one_core_jpeg(shard_dir: Path, rounds: int, batch: int) -> dict[str, float]:
    """Run `--one-core` in a child pinned to one CPU; its best-of-`rounds` samples/s."""
    out = subprocess.run([sys.executable, __file__, "--one-core", str(shard_dir),
                          "--rounds", str(rounds), "--batch", str(batch)],
                         capture_output=True, text=True, check=True, timeout=1800)
    return json.loads(out.stdout.strip().splitlines()[-1])


def one_core_child(shard_dir: Path, rounds: int, batch: int) -> dict[str, float]:
    """In this process, on one CPU: webdataset vs ringfeed's first (cache-filling) and
    second (cached) epochs, and ringfeed's first epoch without the decoded cache."""
    import webdataset as wds

    from ringfeed.pipeline import ShardPipeline

    os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})
    urls = [str(p) for p in sorted(shard_dir.glob("*.tar"))]
    options = {"batch_size": batch, "shuffle_buffer": 1000, "balance": "pad",
               "num_workers": 0, "prefetch": 0}

    def webdataset() -> float:
        dataset = (wds.WebDataset(urls, shardshuffle=False, empty_check=False)
                   .shuffle(1000).decode("rgb8").batched(batch))
        start, n = time.perf_counter(), 0
        for b in dataset:
            n += len(b["__key__"])
        return n / (time.perf_counter() - start)

    def ringfeed_epoch(pipe, e: int) -> float:
        pipe.set_epoch(e)
        start, n = time.perf_counter(), 0
        for b in pipe:
            n += len(b["__key__"])
        return n / (time.perf_counter() - start)

    best = dict.fromkeys(("webdataset", "first", "cached", "uncached"), 0.0)
    webdataset()  # warm-up: page cache, imports
    with tempfile.TemporaryDirectory() as tmp:
        # the tar indexes: ringfeed shard wrote sidecars; a warm-up pass also builds any
        # missing ones into this index cache before anything is timed
        for _ in ShardPipeline(shard_dir, cache_dir=tmp, **options):
            pass
        for r in range(rounds):
            best["webdataset"] = max(best["webdataset"], webdataset())
            plain = ShardPipeline(shard_dir, cache_dir=tmp, **options)
            best["uncached"] = max(best["uncached"], ringfeed_epoch(plain, 0))
            decoded = Path(tmp) / f"decoded{r}"
            pipe = ShardPipeline(shard_dir, cache_dir=tmp, decoded_cache=str(decoded), **options)
            best["first"] = max(best["first"], ringfeed_epoch(pipe, 0))
            best["cached"] = max(best["cached"], ringfeed_epoch(pipe, 1))
            assert pipe.stats()["cached_samples"] > 0, "the second epoch did not use the cache"
    return best


def raw_rates(shard_dir: Path, rounds: int) -> dict[str, float]:
    """Bytes/s over all shards: `cat`; ringfeed's I/O path alone (ShardCache.open + read); a
    bare pread loop (the ceiling of per-sample bytes); ringfeed's whole pipeline without
    decoding; webdataset iterating the same tars."""
    import collections
    import tarfile

    import webdataset as wds

    from ringfeed.pipeline import ShardPipeline, malloc
    from ringfeed.pipeline.cache import ShardCache
    from ringfeed.pipeline.source import ShardRef

    paths = sorted(shard_dir.glob("*.tar"))
    total = sum(p.stat().st_size for p in paths)
    raw = {"batch_size": 16, "shuffle": False, "balance": "pad",
           "fields": {"png": "bytes", "bin": "bytes", "cls": "bytes"}}
    pipe = ShardPipeline(shard_dir, **raw)  # a reader thread, 2 batches ahead (the default)
    inline = ShardPipeline(shard_dir, prefetch=0, **raw)  # read in the consumer's thread
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

    def pipeline_inline() -> None:
        for _ in inline:
            pass

    def webdataset() -> None:
        for _ in wds.WebDataset(list(map(str, paths)), shardshuffle=False, empty_check=False):
            pass

    # The ceiling of any reader that hands out each member as its own bytes object: a bare
    # loop of one pread per member, the last 3 batches held (as a pipeline with 2 batches in
    # flight and one with its consumer holds them). Unlike `cat`, whose one buffer stays in the
    # CPU cache, every copy lands in memory that is not.
    members = []
    for path in paths:
        with tarfile.open(path) as tar:
            members.append((str(path), [(m.offset_data, m.size) for m in tar.getmembers()]))
    per_batch = len(raw["fields"]) * raw["batch_size"]

    def pread_ceiling() -> None:
        held: collections.deque = collections.deque(maxlen=3)
        for path, spans in members:
            fd = os.open(path, os.O_RDONLY)
            batch = []
            for offset, size in spans:
                batch.append(os.pread(fd, size, offset))
                if len(batch) == per_batch:
                    held.append(batch)
                    batch = []
            os.close(fd)

    malloc.tune()  # the allocator settings the pipeline runs with
    runs = {"cat": cat, "io": io_path, "pread": pread_ceiling, "ringfeed": pipeline,
            "inline": pipeline_inline, "webdataset": webdataset}
    best = dict.fromkeys(runs, 0.0)
    for _ in range(rounds + 1):  # the first round also warms the page cache
        for name, run in runs.items():
            start = time.perf_counter()
            run()
            best[name] = max(best[name], total / (time.perf_counter() - start))
    best["bytes"] = total
    return best


def cold_warm(shard_dir: Path, rates: list[float], batch: int, rounds: int) -> dict[str, Any]:
    """Epoch time from a loopback HTTP store throttled to each rate (B/s, per connection):
    cold (empty cache) then warm (cached), best of `rounds` fresh caches; and the same epoch
    reading the directory in place, measured alongside."""
    from pipeline_util import http_server_process

    from ringfeed.pipeline import ShardPipeline

    def epoch_s(pipe: ShardPipeline, epoch: int) -> float:
        pipe.set_epoch(epoch)
        start = time.perf_counter()
        for _ in pipe:
            pass
        return time.perf_counter() - start

    options = {"batch_size": batch, "shuffle_buffer": 1000, "balance": "pad", "prefetch": 2}
    total = sum(p.stat().st_size for p in shard_dir.glob("*.tar"))
    local = ShardPipeline(shard_dir, **options)
    result: dict[str, Any] = {"local_s": float("inf"), "bytes": total, "runs": []}
    for rate in rates:
        run = {"throttle_bytes_per_s": rate, "cold_s": float("inf"), "warm_s": float("inf"),
               "download_bound_s": total / rate}
        with http_server_process(shard_dir, rate) as url:
            for _ in range(rounds):
                with tempfile.TemporaryDirectory() as cache:
                    pipe = ShardPipeline(url, cache_dir=cache, **options)
                    run["cold_s"] = min(run["cold_s"], epoch_s(pipe, 0))
                    run["warm_s"] = min(run["warm_s"], epoch_s(pipe, 1))
                    run["cache_hit_rate"] = pipe.stats()["cache_hit_rate"]
                result["local_s"] = min(result["local_s"], epoch_s(local, 1))
        result["runs"].append(run)
    return result


def mbps(bytes_per_s: float) -> float:
    return bytes_per_s / 1e6


def rows_of(result: dict[str, Any]) -> list[Any]:
    from common import Row

    d1, d2 = result["decoded_w1"], result["decoded_w2"]
    jpeg = result["one_core_jpeg"]
    blobs, small16 = result["raw_blobs"], result["raw_blobs16"]
    cw = result["cold_warm"]
    slow, fast = cw["runs"]
    return [
        Row("pipeline", "decoded samples/s, W=1", d1["ringfeed"], "samples/s", "webdataset",
            d1["webdataset"], goal=(">=", 0.95)),
        Row("pipeline", "decoded samples/s, W=2", d2["ringfeed"], "samples/s", "webdataset",
            d2["webdataset"], goal=(">=", 0.95)),
        Row("pipeline", "1 core, 64px JPEG, first epoch (fills decoded cache)", jpeg["first"],
            "samples/s", "webdataset", jpeg["webdataset"], goal=(">=", 2.5)),
        Row("pipeline", "1 core, 64px JPEG, epoch from decoded cache", jpeg["cached"],
            "samples/s", "webdataset", jpeg["webdataset"], goal=(">=", 10.0)),
        Row("pipeline", "1 core, 64px JPEG, epoch without decoded cache", jpeg["uncached"],
            "samples/s", "webdataset", jpeg["webdataset"]),
        Row("pipeline", "raw read, 256 KiB samples, consumer's thread", mbps(blobs["inline"]),
            "MB/s", "cat", mbps(blobs["cat"]), goal=(">=", 0.8)),
        Row("pipeline", "raw read, 16 KiB samples, consumer's thread", mbps(small16["inline"]),
            "MB/s", "cat", mbps(small16["cat"]), goal=(">=", 0.3)),
        Row("pipeline", "raw read, 256 KiB samples, reader thread", mbps(blobs["ringfeed"]),
            "MB/s", "cat", mbps(blobs["cat"])),
        Row("pipeline", "raw read, 16 KiB samples, reader thread", mbps(small16["ringfeed"]),
            "MB/s", "cat", mbps(small16["cat"])),
        Row("pipeline", "raw read vs webdataset, 256 KiB", mbps(blobs["ringfeed"]), "MB/s",
            "webdataset", mbps(blobs["webdataset"])),
        Row("pipeline", "webdataset raw read, 256 KiB", mbps(blobs["webdataset"]), "MB/s", "cat",
            mbps(blobs["cat"]), note="the tar-parsing ceiling we share"),
        Row("pipeline", "cache I/O path (open + read)", mbps(blobs["io"]), "MB/s", "cat",
            mbps(blobs["cat"])),
        Row("pipeline", "pread per member into its own bytes, 256 KiB", mbps(blobs["pread"]),
            "MB/s", "cat", mbps(blobs["cat"]),
            note="the ceiling of handing out each sample's bytes (a bare loop)"),
        Row("pipeline", "raw read, 256 KiB, consumer's thread vs that ceiling",
            mbps(blobs["inline"]), "MB/s", "pread loop", mbps(blobs["pread"])),
        Row("pipeline", "cold / warm epoch, 10 MB/s store", slow["cold_s"], "s", "warm",
            slow["warm_s"], goal=(">=", 5.0)),
        Row("pipeline", "cold / warm epoch, 40 MB/s store", fast["cold_s"], "s", "warm",
            fast["warm_s"]),
        Row("pipeline", "warm epoch / local read in place", slow["warm_s"], "s", "local",
            cw["local_s"]),
        Row("pipeline", "cold epoch / download bound (10 MB/s)", slow["cold_s"], "s",
            "bytes/rate", slow["download_bound_s"]),
    ]


def plot(rows: list[Any]):
    from common import new_figure

    fig, (ax,) = new_figure(width=9.0, height=4.0)
    names = [r.metric for r in rows]
    ax.barh(names, [r.ratio for r in rows],
            color=["tab:green" if r.met else "tab:red" if r.met is False else "tab:gray"
                   for r in rows])
    for i, r in enumerate(rows):
        label = f"{r.ratio:.2f}" + (f" (goal {r.goal[0]} {r.goal[1]:g})" if r.goal else "")
        ax.text(r.ratio, i, " " + label, va="center", fontsize=8)
    ax.invert_yaxis()
    ax.set_xscale("log")
    ax.set_xlabel("ratio ringfeed / peer (log)")
    ax.set_title("pipeline: ringfeed vs peers, same run")
    return fig


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny smoke run")
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results"))
    parser.add_argument("--one-core", metavar="SHARDS", help=argparse.SUPPRESS)  # the child
    parser.add_argument("--rounds", type=int, default=2, help=argparse.SUPPRESS)
    parser.add_argument("--batch", type=int, default=32, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.one_core:
        print(json.dumps(one_core_child(Path(args.one_core), args.rounds, args.batch)))
        return {}
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    q = args.quick
    samples, shards, image = (256, 4, 32) if q else (4096, 16, 64)
    batch, epochs, rounds = (16, 1, 1) if q else (32, 2, 2)
    rates = [10e6, 40e6]  # B/s per connection: a slow and a fast remote store
    data: dict[str, Any] = {"samples": samples, "shards": shards, "image": image, "batch": batch}
    with tempfile.TemporaryDirectory() as tmp:
        images = Path(tmp) / "images"
        write_bench_shards(images, samples, shards, image)
        blobs = Path(tmp) / "blobs"
        write_bench_shards(blobs, 64 if q else 512, 4 if q else 8, 0, payload=256 * 1024)
        for w in (1, 2):
            data[f"decoded_w{w}"] = decoded_rates(images, w, epochs, rounds, batch)
        blobs16 = Path(tmp) / "blobs16"
        write_bench_shards(blobs16, 256 if q else 8192, 4 if q else 8, 0, payload=16 * 1024)
        # (each round takes well under a second: more of them steady the best-of figures of
        # every contender, `cat` included)
        data["raw_blobs"] = raw_rates(blobs, rounds if q else 6)
        data["raw_blobs16"] = raw_rates(blobs16, rounds if q else 6)
        jpegs, jpeg_shards = Path(tmp) / "jpegs", Path(tmp) / "jpeg_shards"
        write_jpeg_folder(jpegs, 512 if q else 8192, 64)
        from ringfeed.train.cli import main as ringfeed

        ringfeed(["shard", str(jpegs), str(jpeg_shards), "--format", "imagefolder",
                  "--shuffle-seed", "0", "--max-count", "1000", "--no-progress"])
        data["one_core_jpeg"] = one_core_jpeg(jpeg_shards, 1 if q else 3, batch)
        data["cold_warm"] = cold_warm(images, rates, batch, rounds)
    from common import finish

    rows = rows_of(data)
    return finish("pipeline_bench", q, Path(args.out), rows, data, plot(rows))


if __name__ == "__main__":
    main()

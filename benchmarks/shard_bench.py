"""`ringfeed shard` throughput: 1 and 2 worker processes vs webdataset's ShardWriter (one
process) on the same generated image folder.

    .venv/bin/python benchmarks/shard_bench.py            # ~300 MB of PNG/JPEG files
    .venv/bin/python benchmarks/shard_bench.py --quick    # a few MB, seconds (smoke test)
    .venv/bin/python benchmarks/shard_bench.py --parts [--quick]   # issue 50: 4 parts' CPU

`--parts`: per format (csv, jsonl, parquet and npz of 200,000 rows, the image folder, the jsonl's
text with a BPE trained on it), the CPU (user + sys, startup included) of `--part 0/4` .. `3/4`
run one after another into one OUT against one whole run, and whether both give the same shards
and manifest.

The image folder (random-content PNG and JPEG files, 10 classes) is generated once into the temp
dir and reused. Each run starts a fresh interpreter, as the command would, and times the work
after its imports. Every contender reads the same files (page cache warmed first) and writes
uncompressed tars of the original bytes plus a `cls` member to a fresh folder; the best of
--repeat runs counts. Prints MB/s (input image bytes per second of wall time) and the ratios;
writes benchmarks/results/shard_bench.json and .png. It measures, it does not assert.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import multiprocessing as mp
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

RESULTS = REPO / "benchmarks" / "results"
CLASSES = 10
IMAGE_SIDE = 256  # random 256x256 RGB: ~197 KB as PNG, ~60-140 KB as JPEG


def image_folder(total_mb: float, root: Path | None = None) -> Path:
    """A cached SRC/<class>/<image> tree of about `total_mb` MB."""
    from PIL import Image

    root = root or Path(tempfile.gettempdir()) / "ringfeed-bench"
    path = root / f"images-{total_mb:g}MB-v1"
    if path.is_dir():
        return path
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=root, prefix=".generating-"))
    rng = np.random.default_rng(0)
    written, i = 0, 0
    while written < total_mb * 1e6:
        # smooth gradients plus noise: files of realistic, varied sizes
        base = rng.integers(0, 256, (8, 8, 3), dtype=np.uint8)
        image = np.kron(base, np.ones((IMAGE_SIDE // 8, IMAGE_SIDE // 8, 1), np.uint8))
        noise = rng.integers(0, int(rng.integers(8, 128)), image.shape, dtype=np.uint8)
        pixels = Image.fromarray(image + noise)
        folder = tmp / f"class{i % CLASSES}"
        folder.mkdir(exist_ok=True)
        file = folder / (f"{i:06d}.png" if i % 2 else f"{i:06d}.jpg")
        pixels.save(file, quality=95) if file.suffix == ".jpg" else pixels.save(file)
        written += file.stat().st_size
        i += 1
    try:
        tmp.rename(path)
    except OSError:  # another run generated it meanwhile
        shutil.rmtree(tmp)
    return path


def _files(src: Path) -> list[tuple[Path, int]]:
    classes = sorted(d.name for d in src.iterdir())
    return [(f, label) for label, c in enumerate(classes) for f in sorted((src / c).iterdir())]


def _warm(src: Path) -> int:
    return sum(len(f.read_bytes()) for f, _ in _files(src))


def run_ringfeed(src: Path, out: Path, workers: int, max_size: str
                 ) -> tuple[float, float, float]:
    from ringfeed.train.cli import build_parser
    from ringfeed.train.cli import main as ringfeed

    build_parser()  # imports what `ringfeed shard` imports, outside the timing
    start, cpu = time.perf_counter(), _cpu_seconds()
    code = ringfeed(["shard", str(src), str(out), "--format", "imagefolder", "--max-size",
                     max_size, "--workers", str(workers), "--no-progress"])
    seconds, cpu = time.perf_counter() - start, _cpu_seconds() - cpu
    if code != 0:
        raise RuntimeError(f"ringfeed shard exited {code}")
    return seconds, cpu, 0.0  # (its shards are fsynced as part of the run)


def run_shardwriter(src: Path, out: Path, max_size: str) -> tuple[float, float, float]:
    """(wall s, CPU s, s to fsync its shards afterwards): ShardWriter leaves its shards in
    the page cache; ringfeed's runs end with theirs on the disk."""
    from webdataset import ShardWriter  # imports torch, outside the timing

    from ringfeed.fsutil import fsync_path, parse_size

    out.mkdir(parents=True)
    start, cpu = time.perf_counter(), _cpu_seconds()
    with ShardWriter(str(out / "shard-%06d.tar"), maxsize=parse_size(max_size),
                     maxcount=10**9, verbose=0) as sink:
        for path, label in _files(src):
            sink.write({"__key__": f"{path.parent.name}_{path.stem}",
                        path.suffix[1:]: path.read_bytes(), "cls": label})
    wall, cpu = time.perf_counter() - start, _cpu_seconds() - cpu
    start = time.perf_counter()
    for shard in sorted(out.iterdir()):
        fsync_path(shard)
    fsync_path(out)
    return wall, cpu, time.perf_counter() - start


def _cpu_seconds() -> float:
    """User + system CPU of this process and its finished children (the forked writers)."""
    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def in_fresh_process(contender: str, src: Path, out: Path, workers: int, max_size: str
                     ) -> tuple[float, float, float]:
    """(wall s, CPU s, fsync s after it) of one contender's run, imports excluded, in a new
    interpreter: each
    starts as its command would, with only its own imports (webdataset's pull in torch, and a
    process that forks writers pays for the memory it forks)."""
    out_json = subprocess.run(
        [sys.executable, __file__, "--contender", contender, str(src), str(out), str(workers),
         max_size], check=True, capture_output=True, text=True, timeout=600,
    ).stdout.splitlines()[-1]
    wall, cpu, synced = json.loads(out_json)
    return wall, cpu, synced


def _contender(argv: list[str]) -> None:
    """`--contender NAME SRC OUT WORKERS MAX_SIZE`: run it here, print [wall s, CPU s,
    fsync s]."""
    name, src, out, workers, max_size = argv
    if name == "shardwriter":
        timing = run_shardwriter(Path(src), Path(out), max_size)
    else:
        timing = run_ringfeed(Path(src), Path(out), int(workers), max_size)
    print(json.dumps(timing))


def _hash_work(rounds: int) -> None:
    block = bytes(range(256)) * (1 << 17)  # 32 MiB
    for _ in range(rounds):
        hashlib.sha256(block).digest()


def parallel_ceiling(rounds: int) -> float:
    """Throughput of 2 processes over 1 on trivially parallel work (sha256), measured now: the
    most any 2-worker run can gain on this machine while others share it."""
    with mp.get_context("fork").Pool(2) as pool:
        pool.map(_hash_work, [1, 1])  # start both workers
        start = time.perf_counter()
        pool.map(_hash_work, [rounds])
        one = time.perf_counter() - start
        start = time.perf_counter()
        pool.map(_hash_work, [rounds, rounds], chunksize=1)
        two = time.perf_counter() - start
    return 2 * one / two


def _digests(out: Path) -> dict[str, str]:
    return {s["name"]: s["sha256"] for split in json.loads((out / "manifest.json").read_text())
            ["splits"].values() for s in split["shards"]}


PART_FORMATS = ("csv", "jsonl", "parquet", "npz", "imagefolder", "text")


def table_sources(rows: int, root: Path | None = None) -> Path:
    """A cached folder of one table as t.csv, t.jsonl and t.parquet (8 float columns, an int, a
    4-class label, 6 words of text) and arrays as d.npz (x float32[64], y class) of `rows`."""
    import pyarrow as pa
    import pyarrow.csv as pcsv
    import pyarrow.parquet as pq

    root = root or Path(tempfile.gettempdir()) / "ringfeed-bench"
    path = root / f"tables-{rows}-v1"
    if path.is_dir():
        return path
    tmp = Path(tempfile.mkdtemp(dir=root, prefix=".generating-"))
    rng = np.random.default_rng(0)
    words = np.array("the quick brown fox jumps over a lazy dog in the sun".split())
    table = pa.table({**{f"f{i}": rng.normal(size=rows).round(5) for i in range(8)},
                      "n": rng.integers(0, 1000, rows),
                      "label": np.array(["cat", "dog", "bird", "fish"])[rng.integers(0, 4, rows)],
                      "text": [" ".join(w) for w in words[rng.integers(0, 12, (rows, 6))]]})
    pq.write_table(table, tmp / "t.parquet", row_group_size=50_000)
    pcsv.write_csv(table, tmp / "t.csv")
    with open(tmp / "t.jsonl", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in table.to_pylist())
    np.savez(tmp / "d.npz", x=rng.normal(size=(rows, 64)).astype(np.float32),
             y=rng.integers(0, 10, rows))
    try:
        tmp.rename(path)
    except OSError:
        shutil.rmtree(tmp)
    return path


def bpe_tokenizer(tables: Path) -> Path:
    """A byte-level BPE (vocabulary 4096) trained on t.jsonl's text, cached beside it: the text
    row tokenizes with a real tokenizer, whose CPU the parts share (bytes would be I/O)."""
    path = tables / "tokenizer.json"
    if not path.exists():
        from tokenizers import Tokenizer, models, pre_tokenizers, trainers

        bpe = Tokenizer(models.BPE())
        bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        with open(tables / "t.jsonl") as f:
            bpe.train_from_iterator((json.loads(line)["text"] for line in f), trainers.BpeTrainer(
                vocab_size=4096, special_tokens=["<|endoftext|>"], show_progress=False,
                initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
        bpe.save(str(path.with_suffix(".tmp")))
        path.with_suffix(".tmp").rename(path)
    return path


def _cpu_of(argv: list[str]) -> float:
    """User + system CPU of one `ringfeed shard` process (and its writers), startup included:
    each part is a process of its own, as on a cluster."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    subprocess.run([sys.executable, "-m", "ringfeed.train.cli", "shard", *argv, "--no-progress"],
                   check=True, capture_output=True, timeout=1800, cwd=REPO)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime


def parts_against_one(src: Path, args: list[str], work: Path, parts: int = 4) -> dict:
    """CPU of one run and of `--part 0/N` .. `N-1/N` one after another into one OUT; whether
    the two OUTs hold the same shards and manifest."""
    one, many = work / "one", work / "parts"
    cpu_one = _cpu_of([str(src), str(one), *args])
    cpu_parts = [_cpu_of([str(src), str(many), *args, "--part", f"{i}/{parts}"])
                 for i in range(parts)]
    same = (_digests(one) == _digests(many)
            and (one / "manifest.json").read_bytes() == (many / "manifest.json").read_bytes())
    shutil.rmtree(one)
    shutil.rmtree(many)
    return {"one": cpu_one, "parts": cpu_parts, "ratio": sum(cpu_parts) / cpu_one,
            "identical": same}


def measure_parts(args: argparse.Namespace) -> dict:
    """`--parts`: issue 50's goal, the parts' total CPU within 1.1x of one run's, per format;
    the median ratio of --repeat rounds (CPU time drifts less than wall time under load)."""
    rows = args.rows or (2_000 if args.quick else 200_000)
    tables = table_sources(rows, args.data_dir)
    table = ["--categorical", "label", "--field", "label=cls"]
    sources = {"csv": (tables / "t.csv", ["--format", "csv", *table]),
               "jsonl": (tables / "t.jsonl", ["--format", "jsonl", *table]),
               "parquet": (tables / "t.parquet", ["--format", "parquet", *table]),
               "npz": (tables / "d.npz", ["--format", "npz", "--field", "y=cls"]),
               "imagefolder": (image_folder(args.mb or (4 if args.quick else 300), args.data_dir),
                               ["--format", "imagefolder"]),
               "text": (tables / "t.jsonl", ["--format", "text", "--text-field", "text",
                                            "--tokenizer", str(bpe_tokenizer(tables))])}
    max_size = args.max_size or ("256KB" if args.quick else "16MB")
    repeat = args.repeat or (1 if args.quick else 3)
    results: dict = {"rows": rows, "repeat": repeat, "max_size": max_size, "parts": 4,
                     "cpus": os.cpu_count(), "formats": {}}
    work = Path(tempfile.mkdtemp(prefix="ringfeed-shard-parts-"))
    try:
        for fmt in PART_FORMATS:
            src, options = sources[fmt]
            rounds = [parts_against_one(src, [*options, "--max-size", max_size], work)
                      for _ in range(repeat)]
            ratios = sorted(r["ratio"] for r in rounds)
            results["formats"][fmt] = {"ratio": ratios[len(ratios) // 2], "ratios": ratios,
                                       "rounds": rounds,
                                       "identical": all(r["identical"] for r in rounds)}
            print(f"{fmt:<12} 4 parts / one run: {ratios[len(ratios) // 2]:.2f}x CPU "
                  f"(rounds {', '.join(f'{r:.2f}' for r in ratios)}; one run "
                  f"{rounds[0]['one']:.1f} s) identical: {results['formats'][fmt]['identical']}")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    results["load_avg_1m"] = os.getloadavg()[0]
    args.results.mkdir(parents=True, exist_ok=True)
    stem = "shard_bench_parts_quick" if args.quick else "shard_bench_parts"
    (args.results / f"{stem}.json").write_text(json.dumps(results, indent=2) + "\n")
    return results


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(results["mb_per_s"])
    fig, ax = plt.subplots(figsize=(7, 3.5))
    bars = ax.bar(names, [results["mb_per_s"][n] for n in names],
                  color=["#4c72b0", "#55a868", "#c44e52", "#8172b2"])
    ax.bar_label(bars, fmt="%.0f")
    ax.tick_params(axis="x", labelsize=8)
    ax.set_ylabel("MB/s (input bytes / wall s)")
    ax.set_title(f"sharding {results['dataset_mb']:.0f} MB of images, {results['cpus']} CPUs "
                 f"(load {results['load_avg_1m']:.1f}; 2-process ceiling "
                 f"{results['parallel_ceiling_2_over_1']:.2f}x)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _print_results(results: dict, best: dict[str, float]) -> None:
    for name, value in results["mb_per_s"].items():
        print(f"{name:<26} {value:8.1f} MB/s   (best of {results['repeat']}: {best[name]:.2f} s "
              f"wall, {min(results['cpu_seconds'][name]):.2f} s CPU)")
    for name, value in results["ratios"].items():
        print(f"{name:<40} {value:5.2f}x")
    print(f"this machine meanwhile: 2 processes of pure sha256 ran "
          f"{results['parallel_ceiling_2_over_1']:.2f}x one at best (what any K=2 could gain)")
    print(f"K=1 and K=2 shards byte-identical: {results['k1_k2_identical_shards']}; "
          f"{results['dataset_mb']:.0f} MB, {results['files']} files, load avg "
          f"{results['load_avg_1m']:.1f} on {results['cpus']} CPUs")


def _args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="a few MB, one repeat (smoke test)")
    ap.add_argument("--mb", type=float, help="dataset size in MB (default 300, quick 4)")
    ap.add_argument("--repeat", type=int, help="runs per contender, best counts (default 3)")
    ap.add_argument("--max-size", default=None, help="shard size (default 32MB, quick 1MB)")
    ap.add_argument("--data-dir", type=Path, help="where the generated images are cached")
    ap.add_argument("--results", type=Path, default=RESULTS)
    ap.add_argument("--parts", action="store_true",
                    help="instead: CPU of --part 0/4 .. 3/4 against one run, per format")
    ap.add_argument("--rows", type=int, help="--parts: table rows (default 200000, quick 2000)")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    args = _args(argv)
    if args.parts:
        return measure_parts(args)
    mb = args.mb or (4 if args.quick else 300)
    repeat = args.repeat or (1 if args.quick else 3)
    max_size = args.max_size or ("1MB" if args.quick else "32MB")
    os.environ.setdefault("OMP_NUM_THREADS", "1")

    src = image_folder(mb, args.data_dir)
    data_bytes = _warm(src)
    durable = "ShardWriter, then fsynced"  # the same output on the disk, as ringfeed's runs end
    seconds: dict[str, list[float]] = {"ShardWriter (1 proc)": [], "ringfeed K=1": [],
                                       "ringfeed K=2": [], durable: []}
    cpu: dict[str, list[float]] = {name: [] for name in seconds}
    ceilings = []
    digests = {}
    work = Path(tempfile.mkdtemp(prefix="ringfeed-shard-bench-"))
    try:
        for r in range(repeat):
            ceilings.append(parallel_ceiling(2 if args.quick else 16))
            for name in list(seconds)[:3]:
                out = work / f"{name.split()[-1]}-{r}"
                if name.startswith("ShardWriter"):
                    wall, cpu_s, synced = in_fresh_process("shardwriter", src, out, 1, max_size)
                    seconds[durable].append(wall + synced)
                    cpu[durable].append(cpu_s)
                else:
                    workers = int(name[-1])
                    wall, cpu_s, _ = in_fresh_process("ringfeed", src, out, workers, max_size)
                    digests[workers] = _digests(out)
                seconds[name].append(wall)
                cpu[name].append(cpu_s)
                shutil.rmtree(out)
    finally:
        shutil.rmtree(work, ignore_errors=True)

    best = {name: min(v) for name, v in seconds.items()}
    rate = {name: data_bytes / 1e6 / s for name, s in best.items()}
    sw, k1, k2, sw_synced = (rate[n] for n in seconds)
    results = {
        "dataset": str(src), "dataset_mb": data_bytes / 1e6, "files": len(_files(src)),
        "max_size": max_size, "repeat": repeat, "cpus": os.cpu_count(),
        "load_avg_1m": os.getloadavg()[0], "seconds": seconds, "cpu_seconds": cpu,
        "mb_per_s": rate,
        "ratios": {"ringfeed K=1 / ShardWriter": k1 / sw, "ringfeed K=2 / ringfeed K=1": k2 / k1,
                   "ringfeed K=2 / ShardWriter": k2 / sw,
                   "ringfeed K=2 / ShardWriter then fsynced": k2 / sw_synced},
        "k1_k2_identical_shards": digests.get(1) == digests.get(2),
        "parallel_ceiling_2_over_1": max(ceilings),  # best of repeat, like the timings
    }
    _print_results(results, best)
    args.results.mkdir(parents=True, exist_ok=True)
    stem = "shard_bench_quick" if args.quick else "shard_bench"
    (args.results / f"{stem}.json").write_text(json.dumps(results, indent=2) + "\n")
    plot(results, args.results / f"{stem}.png")
    return results


if __name__ == "__main__":
    if sys.argv[1:2] == ["--contender"]:
        _contender(sys.argv[2:])
    else:
        main()

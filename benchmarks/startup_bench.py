"""What the shard count costs a real `ringfeed train` (issue 17): the wall time of a 2-rank,
2-step run on a manifest of S shards against the same run on the ~1,600 real shards it is made of.

    .venv/bin/python benchmarks/startup_bench.py           # S = 10^4, 10^5, 10^6
    .venv/bin/python benchmarks/startup_bench.py --quick   # S = 10^4, one rank

The real shards: the demo's digits (32x32 PNGs), one sample per shard, so that S shards hold S
samples and a rank's plan stays the size it has in a real job of that many shards on thousands of
ranks (10^9 samples on 4,096 ranks is 2.4x10^5 samples a rank; here S/2). A manifest of S shards
names train-0000000.tar ... whose files are symbolic links to the real shards in turn, with
their real sample counts, sizes and hashes (manifest.json and manifest.bin written directly,
benchmarks/plan_bench.py's writer): the run reads real tar files, and everything that scales
with the shard table (config validation, the pipelines, the plan, the data spec) runs at S.
The run: examples/configs/digits.yaml (torch), no validation split, a shuffle buffer of one
batch (not the 1,000 samples = 1,000 shards here), train.max_steps=2, under horovodrun on 2 ranks (quick: 1); wall time from launch to exit, best of --repeat. Measures, never asserts.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS, Row, finish, new_figure, pending_row  # noqa: E402
from demo_run import CONFIG, demo_missing, digit_shards  # noqa: E402
from plan_bench import write_manifest  # noqa: E402
from trainrun import ringfeed_train  # noqa: E402

NAME = "startup"
FULL, QUICK = (10**4, 10**5, 10**6), (10**4,)


def one_sample_shards() -> Path:
    """The demo's digit images, sharded one sample a shard (train split only)."""
    return digit_shards("digits-shards-1-per-shard-v1",
                        ["--format", "imagefolder", "--val-fraction", "0", "--shuffle-seed", "0",
                         "--max-count", "1", "--no-progress"])


def manifest_of(real: Path, shards: int, out: Path) -> Path:
    """`shards` entries over the real shards, round robin: a link and a manifest row each."""
    from ringfeed.formats.manifest import Manifest, manifest_meta

    manifest = Manifest.load(real)
    table = manifest.split("train").shards
    pick = np.arange(shards) % len(table)
    names = [f"train-{i:07d}.tar" for i in range(shards)]
    out.mkdir(parents=True)
    targets = [str((real / s.name).resolve()) for s in table]
    for name, k in zip(names, pick.tolist(), strict=True):
        os.symlink(targets[k], out / name)
    counts = np.array([s.num_samples for s in table], np.int64)[pick]
    sizes = np.array([s.bytes for s in table], np.int64)[pick]
    sha = np.frombuffer(bytes.fromhex("".join(s.sha256 for s in table)), np.uint8)
    write_manifest(out, manifest_meta(manifest), names, counts, sizes, sha.reshape(-1, 32)[pick])
    return out


def timed_run(data: Path, out: Path, ranks: int, repeat: int, timeout: float) -> float:
    overrides = [f"data.train={data}", "framework=torch", "data.val_split=null",
                 "train.max_steps=2", "train.log_every=1", "checkpoint.every_steps=null",
                 # a buffer of one batch: with one-sample shards the default 1,000 would open
                 # 1,000 shards for the first batch (a real shard fills it by itself)
                 "data.shuffle_buffer=32"]
    best = float("inf")
    for r in range(repeat):
        run = ringfeed_train(ranks, CONFIG, out / f"run{r}", timeout, overrides)
        assert run.summary["status"] == "finished", run.summary
        best = min(best, run.wall_s)
    return best


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="S = 10^4 only, one rank, one repeat")
    ap.add_argument("--ranks", type=int, default=None, help="default 2 (quick: 1)")
    ap.add_argument("--repeat", type=int, default=None, help="runs per point (default 2)")
    ap.add_argument("--results", type=Path, default=RESULTS)
    ap.add_argument("--timeout", type=float, default=600, help="per training run (s)")
    opts = ap.parse_args(argv)
    sizes = QUICK if opts.quick else FULL
    repeat = opts.repeat or (1 if opts.quick else 2)
    ranks = opts.ranks or (1 if opts.quick else 2)
    why = demo_missing()
    if why:
        rows = [pending_row(NAME, f"2-rank run, {s:,} shards", f"pending: {why}") for s in sizes]
        return finish(NAME, opts.quick, opts.results, rows, {})

    from ringfeed.formats.manifest import Manifest

    real = one_sample_shards()
    real_count = len(Manifest.load(real).split("train").shards)
    data: dict = {"real_shards": real_count, "ranks": ranks, "runs": {}}
    with tempfile.TemporaryDirectory(prefix="ringfeed-startup-") as tmp:
        for count in (real_count, *sizes):  # the real shards' own count first: the baseline
            start = time.perf_counter()
            directory = manifest_of(real, count, Path(tmp) / f"s{count}")
            made = time.perf_counter() - start
            seconds = timed_run(directory, Path(tmp) / f"out{count}", ranks, repeat,
                                opts.timeout)
            run = {"wall_s": seconds, "write_s": made,
                   "json_mb": (directory / "manifest.json").stat().st_size / 1e6,
                   "bin_mb": (directory / "manifest.bin").stat().st_size / 1e6}
            data["runs"][count] = run
            print(f"{count:>9,} shards: {seconds:6.2f} s (manifest {made:.1f} s to write, "
                  f"{run['json_mb']:.1f} MB)", flush=True)
            for link in directory.glob("train-*.tar"):  # before the next (10^6 links, inodes)
                link.unlink()
    base_count = data["real_shards"]
    base = data["runs"][base_count]["wall_s"]
    rows = [Row(NAME, f"{ranks}-rank 2-step run, {s:,} shards vs {base_count:,}",
                data["runs"][s]["wall_s"], "s", f"{base_count:,} shards", base,
                note=f"+{data['runs'][s]['wall_s'] - base:.1f} s; manifest.json "
                     f"{data['runs'][s]['json_mb']:.0f} MB")
            for s in sizes]
    fig, (ax,) = new_figure(width=6, height=3.6)
    counts = sorted(data["runs"])
    ax.plot(counts, [data["runs"][c]["wall_s"] for c in counts], marker="o")
    ax.set_xscale("log")
    ax.set_xlabel("shards in the manifest")
    ax.set_ylabel("wall s (launch to exit, 2 steps)")
    ax.set_title(f"ringfeed train on {ranks} rank(s): cost of the shard count")
    ax.set_ylim(bottom=0)
    return finish(NAME, opts.quick, opts.results, rows, data, fig)


if __name__ == "__main__":
    main()

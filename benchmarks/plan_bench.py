"""Plans at internet scale (issue 17): per-rank time and memory of an epoch's plan, fresh and
resumed at another world size, and of loading the manifest, by simulation (no launch, no shards).

    .venv/bin/python benchmarks/plan_bench.py            # 10^6..10^9 samples, 8..8,192 ranks
    .venv/bin/python benchmarks/plan_bench.py --quick    # 10^5..10^6 samples, 8 and 64 ranks

Layouts are synthetic: shards of ~1,000 samples (500-1,500, summing exactly to the sample
count), batch 32, 2 loader workers, shuffle buffer 1,000, balance drop, seed 0, epoch 0.
- fresh: the plan of the last rank (every worker's slots, validity and emission order), what a
  rank computes before its first batch (`ringfeed.pipeline.plan.plan_segments` + `SegmentPlan.worker`).
- resume: the epoch ran min(50, B/2) batches on N ranks and resumes on N/2 (4 for 8); the plan
  of the new last rank.
- manifest load: a `ShardPipeline` built over a synthetic manifest of S shards (manifest.json
  and its binary index `manifest.bin`, both written directly: no tar files), i.e. mapping the
  index, the shard table and the sample-count layout. "json" is the path it replaces (parse
  manifest.json into a Manifest, a ShardRef per shard, the counts array).
- "old" is tests/plan_reference.py (the planner before issue 17, the tests' specification),
  where it is feasible (<= 10^7 samples; and 10^8 at 4,096 ranks in full mode); both plans'
  arrays are hashed and compared ("same" in the JSON).
Every point runs in a fresh Python process (`plan_bench.py --point JSON`): seconds is the wall
time of the planning alone; rss_mb is the process's peak resident set (VmHWM: interpreter,
numpy and the layout included, what the goals are judged on); plan_mb is that
peak less the peak before planning (the plan's own memory). Points where one rank's own share
exceeds 10^7 samples (10^9 on 8 or 64 ranks, 10^8 on 8) are left out: a rank then holds
>= 80 MB of its own ids by definition, and the box has 24 GB for every point.
Goals (10^9 samples in 10^6 shards, 4,096 ranks): fresh < 1 s and < 200 MB per rank; resume
< 5 s and < 500 MB; manifest load < 1 s. Prints a table, writes plan_bench[_quick].json/.png.
Measures, does not assert.
"""

from __future__ import annotations

import argparse
import binascii
import hashlib
import json
import resource
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from common import (  # noqa: E402
    REPO,
    RESULTS,
    Row,
    bench_env,
    finish,
    machine,
    new_figure,
    pending_row,
    run,
)

if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))  # plan_reference: the tests' oracle, not installed

NAME = "plan_bench"
SHARD_SIZE, BATCH, WORKERS, BUFFER, RESUME_AFTER = 1000, 32, 2, 1000, 50
FULL = {"samples": (10**6, 10**7, 10**8, 10**9), "ranks": (8, 64, 512, 4096, 8192),
        "old_samples": 10**7, "old_extra": ((10**8, 4096),), "manifests": (10**5, 10**6)}
QUICK = {"samples": (10**5, 10**6), "ranks": (8, 64), "old_samples": 10**6, "old_extra": (),
         "manifests": (10**4,)}
MAX_OWN = 10**7  # samples of one rank's own share beyond which a point is left out
GOAL_POINT = (10**9, 4096)
GOALS = {"fresh": (1.0, 200.0), "resume": (5.0, 500.0), "load": (1.0, None)}  # (s, MB)
POINT_TIMEOUT_S = 600


# -- synthetic layouts and manifests -----------------------------------------------------------
def synthetic_counts(shards: int, samples: int, seed: int = 0) -> np.ndarray:
    """`shards` counts of ~samples/shards each (0.5x-1.5x), summing to exactly `samples`."""
    mean = samples // shards
    counts = np.random.default_rng(seed).integers(mean // 2, mean * 3 // 2 + 1, shards)
    diff = samples - int(counts.sum())
    counts += diff // shards
    counts[:diff % shards] += 1
    return counts.astype(np.int64)


def synthetic_manifest(directory: Path, shards: int, samples: int, seed: int = 0) -> np.ndarray:
    """manifest.json and manifest.bin for `shards` shards (names train-0000000.tar, fake
    sizes and hashes), written directly: no tar files, no ShardInfo objects. Returns counts."""
    from ringfeed.formats.manifest import Manifest, manifest_meta

    counts = synthetic_counts(shards, samples, seed)
    sha = np.frombuffer(np.random.default_rng(seed + 1).bytes(32 * shards), np.uint8)
    meta = manifest_meta(Manifest(splits={}, fields={"jpg": "image", "cls": "int"},
                                  created_by="plan_bench"))
    write_manifest(directory, meta, [f"train-{i:07d}.tar" for i in range(shards)], counts,
                   counts * 1100 + 1024, sha.reshape(shards, 32))
    return counts


def write_manifest(directory: Path, meta: dict[str, Any], names: list[str], counts: np.ndarray,
                   sizes: np.ndarray, sha: np.ndarray) -> None:
    """manifest.json and manifest.bin of one split, train, written directly from arrays (at
    10^6 shards a Manifest of ShardInfo objects is what is being measured, not a way to write
    one). `meta`: the manifest's keys but splits; `names` all of one length; `sha` (shards, 32)
    uint8."""
    from ringfeed.formats.manifest_format import HAS_SHA256, INDEX_NAME, SplitArrays, write_index

    directory.mkdir(parents=True, exist_ok=True)
    shards = len(names)
    hexes = binascii.hexlify(sha.tobytes()).decode()
    entries = ",\n".join(
        f'{{"name": "{names[i]}", "num_samples": {c}, "bytes": {b}, '
        f'"sha256": "{hexes[64 * i:64 * i + 64]}", "index": null}}'
        for i, (c, b) in enumerate(zip(counts.tolist(), sizes.tolist(), strict=True)))
    text = json.dumps({**meta, "splits": {"train": {"shards": "@"}}}, indent=1)
    data = text.replace('"@"', f"[\n{entries}\n]").encode()
    (directory / "manifest.json").write_bytes(data)
    width = len(names[0])
    arrays = SplitArrays(np.asarray(counts, np.int64), np.asarray(sizes, np.int64), sha,
                         np.full(shards, HAS_SHA256, np.uint8),
                         np.arange(shards + 1, dtype=np.int64) * width,
                         np.frombuffer("".join(names).encode(), np.uint8),
                         np.zeros(shards + 1, np.int64), np.zeros(0, np.uint8))
    write_index(directory / INDEX_NAME, meta, {"train": arrays}, len(data),
                hashlib.sha256(data).hexdigest())


# -- one point, in a fresh process ------------------------------------------------------------
def _maxrss_mb() -> float:
    """This process's peak resident set, MB. VmHWM, not getrusage's ru_maxrss: that one keeps
    the parent's peak across fork + exec (here: the parent that wrote a 10^6-shard manifest)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024  # kB
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def plan_rank(layout, point: dict[str, Any]) -> tuple[int, str]:
    """Plan one rank as the point says; (slots planned, digest of the plan's arrays)."""
    from ringfeed.pipeline import plan as P

    module = P
    if point["planner"] == "old":
        import plan_reference as module  # type: ignore[no-redef]
    ranks = point["ranks"]
    config = P.SegmentConfig(ranks, WORKERS, BATCH, BUFFER, "drop")
    segments, rank = [P.Segment(config)], ranks - 1
    if point["kind"] == "resume":
        batches = P.batches_for(layout.num_samples, ranks, BATCH, "drop")
        half = max(1, ranks // 2)
        segments = [P.Segment(config, min(RESUME_AFTER, batches // 2)),
                    P.Segment(P.SegmentConfig(half, WORKERS, BATCH, BUFFER, "drop"))]
        rank = half - 1
    plan = module.plan_segments(layout, 0, 0, True, segments)[-1]
    workers = [plan.worker(rank, w) for w in range(WORKERS)]
    digest = hashlib.sha1()
    for wp in workers:
        for a in (wp.ids, wp.valid, wp.order):
            digest.update(np.ascontiguousarray(a).tobytes())
    return sum(len(wp.ids) for wp in workers), digest.hexdigest()


def json_manifest_load(directory: Path) -> int:
    """What ShardPipeline did before the index (pipeline/source.py's read_manifest and
    refs_from_manifest): parse manifest.json, a ShardRef per shard, the counts array."""
    from ringfeed.formats.manifest import Manifest
    from ringfeed.pipeline.plan import Layout
    from ringfeed.pipeline.source import ShardRef

    manifest = Manifest.load(directory)
    refs = [ShardRef(str(directory / s.name), s.num_samples, s.bytes, s.sha256, s.index)
            for s in manifest.split("train").shards]
    return Layout(np.array([r.num_samples for r in refs], dtype=np.int64)).num_samples


def measure(point: dict[str, Any]) -> dict[str, Any]:
    """Run one point in this (fresh) process."""
    # both imported before the clock starts
    import plan_reference  # noqa: F401

    from ringfeed.pipeline import ShardPipeline
    from ringfeed.pipeline import plan as P

    if point["kind"] == "load":
        directory = Path(point["directory"])
        before = _maxrss_mb()
        start = time.perf_counter()
        if point["planner"] == "json":
            samples = json_manifest_load(directory)
        else:
            pipe = ShardPipeline(directory, batch_size=BATCH, rank=4095, world_size=4096,
                                 cache_dir=point["cache_dir"])
            samples = pipe.layout.num_samples
        seconds = time.perf_counter() - start
        return {"seconds": seconds, "rss_mb": _maxrss_mb(), "plan_mb": _maxrss_mb() - before,
                "samples": samples}
    layout = P.Layout(synthetic_counts(point["shards"], point["samples"]))
    before = _maxrss_mb()
    start = time.perf_counter()
    slots, digest = plan_rank(layout, point)
    seconds = time.perf_counter() - start
    return {"seconds": seconds, "rss_mb": _maxrss_mb(), "plan_mb": _maxrss_mb() - before,
            "slots": slots, "digest": digest}


def run_point(point: dict[str, Any]) -> dict[str, Any]:
    """`measure(point)` in a fresh interpreter: the point and its result, or why it failed."""
    result = run([sys.executable, str(Path(__file__).resolve()), "--point", json.dumps(point)],
                 timeout=POINT_TIMEOUT_S, env=bench_env())
    if result.returncode != 0 or result.timed_out:
        why = "timed out" if result.timed_out else result.output.strip().splitlines()[-1:]
        return {**point, "error": str(why)}
    measured = json.loads(result.stdout.strip().splitlines()[-1])
    what = f"{point['kind']:6} {point['planner']:4}"
    size = (f"{point['shards']:>9,} shards" if point["kind"] == "load"
            else f"{point['samples']:>13,} samples {point['ranks']:>5} ranks")
    print(f"  {what} {size}: {measured['seconds']:8.3f} s  {measured['rss_mb']:8.1f} MB peak "
          f"RSS  ({measured['plan_mb']:.1f} MB its own)", flush=True)
    return {**point, **measured}


def plan_points(grid: dict[str, Any]) -> list[dict[str, Any]]:
    points = []
    for samples in grid["samples"]:
        for ranks in grid["ranks"]:
            if samples // ranks > MAX_OWN:
                continue
            old = samples <= grid["old_samples"] or (samples, ranks) in grid["old_extra"]
            for kind in ("fresh", "resume"):
                for planner in ("new", "old") if old else ("new",):
                    points.append({"kind": kind, "planner": planner, "samples": samples,
                                   "ranks": ranks, "shards": samples // SHARD_SIZE})
    return points


# -- the report ---------------------------------------------------------------------------------
def find(points: list[dict], **match: Any) -> dict | None:
    for p in points:
        if all(p.get(k) == v for k, v in match.items()) and "error" not in p:
            return p
    return None


def rows_of(points: list[dict], grid: dict[str, Any], quick: bool) -> list[Row]:
    rows: list[Row] = []
    samples, ranks = GOAL_POINT
    label = f"10^9 samples / 10^6 shards / {ranks:,} ranks"
    for kind in ("fresh", "resume"):
        what = "fresh epoch plan" if kind == "fresh" else f"resume on {ranks // 2:,} ranks"
        p = find(points, kind=kind, planner="new", samples=samples, ranks=ranks)
        s_goal, mb_goal = GOALS[kind]
        for metric, unit, bound in ((f"{what}, {label}: s per rank", "s", s_goal),
                                    (f"{what}, {label}: peak RSS per rank", "MB", mb_goal)):
            if p is None:
                rows.append(pending_row("plan", metric, "full mode only" if quick else
                                        "pending: not measured", ("<=", 1.0)))
                continue
            value = p["seconds"] if unit == "s" else p["rss_mb"]
            rows.append(Row("plan", metric, value, unit, "goal", bound, goal=("<=", 1.0)))
    shards = max(grid["manifests"])
    load = find(points, kind="load", planner="new", shards=shards)
    metric = f"manifest load, {shards:,} shards (binary index): s per rank"
    if load is None or shards < 10**6:
        rows.append(pending_row("plan", metric, "full mode only" if quick else "pending",
                                ("<=", 1.0)))
    else:
        rows.append(Row("plan", metric, load["seconds"], "s", "goal", GOALS["load"][0],
                        goal=("<=", 1.0)))
    for shards in grid["manifests"]:
        new = find(points, kind="load", planner="new", shards=shards)
        old = find(points, kind="load", planner="json", shards=shards)
        if new and old:  # ratios as gains: JSON / index
            rows.append(Row("plan", f"manifest load, {shards:,} shards: JSON / index, s",
                            new["seconds"], "s", "JSON", old["seconds"],
                            ratio=old["seconds"] / new["seconds"]))
            rows.append(Row("plan", f"manifest load, {shards:,} shards: JSON / index, "
                            "peak RSS", new["rss_mb"], "MB", "JSON", old["rss_mb"],
                            ratio=old["rss_mb"] / new["rss_mb"]))
    # against the old planner, at the largest size it ran at
    for kind in ("fresh", "resume"):
        pairs = [(p, find(points, kind=kind, planner="old", samples=p["samples"],
                          ranks=p["ranks"]))
                 for p in points if p.get("kind") == kind and p.get("planner") == "new"]
        pairs = [(a, b) for a, b in pairs if a and b and "error" not in a]
        if not pairs:
            continue
        a, b = max(pairs, key=lambda ab: (ab[0]["samples"], ab[0]["ranks"] == 4096,
                                          ab[0]["ranks"]))
        where = f"{a['samples']:.0e} samples / {a['ranks']:,} ranks".replace("e+0", "e")
        rows.append(Row("plan", f"{kind} plan, {where}: old planner / new, s", a["seconds"],
                        "s", "old", b["seconds"], ratio=b["seconds"] / a["seconds"]))
        rows.append(Row("plan", f"{kind} plan, {where}: old planner / new, peak RSS",
                        a["rss_mb"], "MB", "old", b["rss_mb"], ratio=b["rss_mb"] / a["rss_mb"]))
    return rows


def plot(points: list[dict]):
    fig, axes = new_figure(ncols=2, width=6.5, height=4.2)
    colors = dict(zip((10**5, 10**6, 10**7, 10**8, 10**9),
                      ("tab:gray", "tab:blue", "tab:green", "tab:orange", "tab:red"), strict=True))
    for ax, key, unit in ((axes[0], "seconds", "s per rank"), (axes[1], "rss_mb",
                                                               "peak RSS per rank, MB")):
        for samples in sorted({p["samples"] for p in points if "samples" in p
                               and p["kind"] != "load"}):
            for kind, style in (("fresh", "-"), ("resume", "--")):
                for planner, marker in (("new", "o"), ("old", "x")):
                    sel = sorted((p["ranks"], p[key]) for p in points
                                 if p["kind"] == kind and p["planner"] == planner
                                 and p.get("samples") == samples and "error" not in p)
                    if not sel:
                        continue
                    label = (f"{samples:.0e} {kind}".replace("e+0", "e")
                             + (" (old)" if planner == "old" else ""))
                    ax.plot(*zip(*sel, strict=True), style, marker=marker,
                            color=colors.get(samples, "k"), alpha=1 if planner == "new" else .5,
                            label=label)
        goals = (1.0, 5.0) if key == "seconds" else (200.0, 500.0)
        for g, style in zip(goals, ("-", "--"), strict=True):
            ax.axhline(g, color="k", linestyle=style, linewidth=0.8, alpha=0.4)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("ranks")
        ax.set_ylabel(unit)
    axes[0].set_title("plan time (fresh -, resume at N/2 --; goals: lines)")
    axes[1].set_title("memory (x: old planner)")
    axes[1].legend(fontsize=6, ncol=2)
    return fig


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="10^5-10^6 samples, 8 and 64 ranks")
    parser.add_argument("--results", default=str(RESULTS), help="where the JSON/PNG go")
    parser.add_argument("--point", help=argparse.SUPPRESS)  # one measurement (child process)
    parser.add_argument("--report", type=Path, metavar="JSON",
                        help="no measuring: the table and plot again from a saved result")
    args = parser.parse_args(argv)
    if args.point:
        print(json.dumps(measure(json.loads(args.point))))
        return {}
    grid = QUICK if args.quick else FULL
    if args.report:
        data = json.loads(args.report.read_text())["data"]
        return finish(NAME, args.quick, Path(args.results),
                      rows_of(data["points"], grid, args.quick), data, plot(data["points"]))
    points: list[dict[str, Any]] = []
    started_on = machine()  # (the load average when measuring began; finish() adds the end's)
    with tempfile.TemporaryDirectory(prefix="plan_bench-") as tmp:
        for shards in grid["manifests"]:
            directory = Path(tmp) / f"m{shards}"
            started = time.perf_counter()
            synthetic_manifest(directory, shards, shards * SHARD_SIZE)
            print(f"synthetic manifest of {shards:,} shards: "
                  f"{time.perf_counter() - started:.1f} s", flush=True)
            for planner in ("new", "json"):
                points.append(run_point({"kind": "load", "planner": planner, "shards": shards,
                                         "directory": str(directory),
                                         "cache_dir": str(Path(tmp) / "cache")}))
        for point in plan_points(grid):
            points.append(run_point(point))
    for p in points:
        if p["kind"] != "load" and p["planner"] == "old" and "error" not in p:
            new = find(points, kind=p["kind"], planner="new", samples=p["samples"],
                       ranks=p["ranks"])
            p["same"] = new is not None and new["digest"] == p["digest"]
    same = [p["same"] for p in points if "same" in p]
    print(f"old and new planner gave identical plans at {sum(same)} of {len(same)} points")
    data = {"settings": {"shard_size": SHARD_SIZE, "batch_size": BATCH, "workers": WORKERS,
                         "shuffle_buffer": BUFFER, "resume_after": RESUME_AFTER,
                         "max_own_share": MAX_OWN},
            "started_on": started_on, "points": points, "identical_to_old": all(same)}
    return finish(NAME, args.quick, Path(args.results), rows_of(points, grid, args.quick), data,
                  plot(points))


if __name__ == "__main__":
    main()

"""Trainer overhead: the step time of `ringfeed train` (reading PNG shards through the
pipeline) against hand-written loops on the same model and batch with the data in memory:
a minimal Horovod PyTorch loop (pytorch_synthetic_benchmark.py style), torch DDP (gloo,
torchrun) and, for TensorFlow, a minimal DistributedGradientTape loop. 2 ranks.

    .venv/bin/python benchmarks/trainer_bench.py            # torch and TF, best of 2
    .venv/bin/python benchmarks/trainer_bench.py --quick    # torch only, one rank, few steps
    .venv/bin/python benchmarks/trainer_bench.py --in-memory --repeat 5   # + the loop alone
    .venv/bin/python benchmarks/trainer_bench.py --cache-dir /tmp/rf-cache  # warm decoded cache
    .venv/bin/python benchmarks/trainer_bench.py --compile   # + ringfeed torch with train.compile

Goals: ringfeed / minimal Horovod <= 1.03 (both frameworks), ringfeed / DDP <= 1.0.
Step times are wall time per step after the warm-up steps, on every side. The contenders run
one after another, interleaved across repeats; the best repeat of each counts. Writes
benchmarks/results/trainer[_quick].json and .png. Measures, never asserts.

`ringfeed train` runs with the trainer's default `data.decoded_cache: auto` and one
`data.cache_dir` for all repeats (a fresh temporary one, or --cache-dir, which persists): the
first repeat decodes and fills the decoded-sample cache, later ones read it warm. Each repeat's
decoded-cache hits and writes are recorded, and the context row says whether the best repeat
read a warm cache. --in-memory adds `workers/ringfeed_loop.py`: the trainer's own loop (backend,
logger, per-step agreement) fed one in-memory batch, like the minimal loops, which isolates the
loop's per-step cost from the input pipeline's.

Every launched process runs with the glibc malloc settings that the pipeline applies to
ringfeed's own processes (pipeline/malloc.py: no mmap/unmap and trim of every large block), set
through glibc's MALLOC_MMAP_THRESHOLD_/MALLOC_TRIM_THRESHOLD_: with glibc's defaults the minimal
torch loop re-faults its activations' pages every step (1.1-1.9x slower on the 2-core box), which
would count an allocator setting as the trainer's advantage. --default-malloc leaves the peers
at glibc's defaults.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (  # noqa: E402
    RESULTS,
    WORKERS,
    Row,
    check,
    finish,
    hvd_launch,
    new_figure,
    pending_row,
    read_json,
    torchrun,
)
from datasets import image_shards  # noqa: E402
from trainrun import ringfeed_train, trainer_available, write_config  # noqa: E402

NAME = "trainer"
GOAL_VS_HOROVOD = ("<=", 1.03)
GOAL_VS_DDP = ("<=", 1.0)
PEERS = {  # contender -> (launcher, worker script)
    "horovod torch loop": ("horovodrun", "hvd_torch_loop.py"),
    "torch DDP (gloo)": ("torchrun", "ddp_loop.py"),
    "horovod TF loop": ("horovodrun", "hvd_tf_loop.py"),
    "ringfeed torch loop, in-memory batch": ("horovodrun", "ringfeed_loop.py"),
    "ringfeed tensorflow loop, in-memory batch": ("horovodrun", "ringfeed_loop.py"),
}
IN_MEMORY = "ringfeed {} loop, in-memory batch"
COMPILED = "ringfeed torch, train.compile"


def run_peer(name: str, ranks: int, peer_args: list[str], tmp: Path, timeout: float,
             shards: Path | None = None) -> float:
    launcher, script = PEERS[name]
    out = tmp / f"{script}.json"
    args = [*peer_args, "--out", str(out)]
    if script == "ringfeed_loop.py":
        run_dir = Path(tempfile.mkdtemp(dir=tmp, prefix="ringfeed-loop-"))
        args += ["--framework", name.split()[1], "--shards", str(shards), "--run-dir",
                 str(run_dir / "run")]
    launch = hvd_launch if launcher == "horovodrun" else torchrun
    check(launch(ranks, WORKERS / script, args, timeout), f"{launcher} {script}")
    return read_json(out)["step_s_mean"]


def run_ringfeed(framework: str, ranks: int, shards: Path, tmp: Path, opts: argparse.Namespace,
                 timeout: float, compiled: bool = False) -> tuple[float, float, dict]:
    """(step seconds, data-wait share, decoded-cache counters and the first step's seconds) of
    `ringfeed train` after the warm-up steps; `compiled`: with train.compile."""
    run_dir = Path(tempfile.mkdtemp(dir=tmp, prefix=f"ringfeed-{framework}-"))  # per repeat
    data = {"num_workers": opts.num_workers, "cache_dir": str(opts.cache_dir),
            "decoded_cache": opts.decoded_cache}
    config = write_config(run_dir / "config.yaml", framework, shards, opts.batch,
                          max_steps=opts.warmup + opts.steps, log_every=opts.warmup,
                          model="cnn", model_args={"width": opts.width}, data=data)
    run = ringfeed_train(ranks, config, run_dir / "run", timeout,
                         ["train.compile=true"] if compiled else [])
    stats = run.summary.get("pipeline") or {}
    cache = {k: stats.get(k, 0) for k in ("decoded_cache_hits", "decoded_cache_writes")}
    cache["warm"] = bool(cache["decoded_cache_hits"]) and not cache["decoded_cache_writes"]
    cache["first_step_s"] = run.summary.get("first_step_s")
    return run.step_s(after_step=opts.warmup), run.data_wait_share_after(opts.warmup), cache


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true",
                    help="torch only, one rank, few steps, one repeat")
    ap.add_argument("--frameworks", default=None, help="torch,tensorflow (quick: torch)")
    ap.add_argument("--ranks", type=int, default=None, help="default 2 (quick: 1)")
    ap.add_argument("--batch", type=int, default=64, help="per rank")
    ap.add_argument("--width", type=int, default=32, help="cnn width")
    ap.add_argument("--warmup", type=int, default=None, help="untimed steps (default 5)")
    ap.add_argument("--steps", type=int, default=None, help="timed steps (default 40)")
    ap.add_argument("--repeat", type=int, default=None, help="runs per contender (default 2)")
    ap.add_argument("--num-workers", type=int, default=0, help="ringfeed data.num_workers")
    ap.add_argument("--cache-dir", type=Path, default=None,
                    help="ringfeed data.cache_dir, kept (default: a temporary one shared by the "
                    "repeats)")
    ap.add_argument("--decoded-cache", default="auto", type=lambda v: {"true": True,
                    "false": False}.get(v.lower(), v), help="ringfeed data.decoded_cache")
    ap.add_argument("--default-malloc", action="store_true",
                    help="peers with glibc's default malloc settings (ringfeed tunes its own)")
    ap.add_argument("--in-memory", action="store_true",
                    help="also run ringfeed's loop on one in-memory batch (workers/ringfeed_loop)")
    ap.add_argument("--compile", action="store_true",
                    help="also run ringfeed torch with train.compile (torch.compile)")
    ap.add_argument("--results", type=Path, default=RESULTS)
    ap.add_argument("--timeout", type=float, default=300, help="per launch (s)")
    opts = ap.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if not opts.default_malloc:  # every contender with the allocator settings ringfeed uses
        from ringfeed.pipeline.malloc import MMAP_THRESHOLD, TRIM_THRESHOLD

        os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", str(MMAP_THRESHOLD))
        os.environ.setdefault("MALLOC_TRIM_THRESHOLD_", str(TRIM_THRESHOLD))
    # quick is the smoke test: every contender's code runs, on one rank (a launch costs ~7 s
    # of CPU in imports on the 2-core box; the allreduce benchmark runs two ranks)
    opts.ranks = opts.ranks or (1 if opts.quick else 2)
    opts.warmup = opts.warmup or (2 if opts.quick else 5)
    opts.steps = opts.steps or (4 if opts.quick else 40)
    repeat = opts.repeat or (1 if opts.quick else 2)
    frameworks = (opts.frameworks or ("torch" if opts.quick else "torch,tensorflow")).split(",")

    contenders = []
    for fw in frameworks:
        contenders += [f"ringfeed {fw}"] + (["horovod torch loop", "torch DDP (gloo)"]
                                            if fw == "torch" else ["horovod TF loop"])
        if opts.in_memory:
            contenders.append(IN_MEMORY.format(fw))
        if opts.compile and fw == "torch":
            contenders.append(COMPILED)
    trainer = trainer_available()
    # One epoch covers warm-up and timed steps: the comparison is the steady state (the
    # stall benchmark covers epoch boundaries).
    samples = 1024 * -(-opts.ranks * opts.batch * (opts.warmup + opts.steps) // 1024)
    shards = image_shards(samples, per_shard=1024) if trainer else None
    peer_args = ["--model", "cnn", "--width", str(opts.width), "--image", "32", "--batch",
                 str(opts.batch), "--warmup", str(opts.warmup), "--steps", str(opts.steps)]

    trains = [f"ringfeed {fw}" for fw in frameworks]  # `ringfeed train` runs
    if opts.compile and "torch" in frameworks:
        trains.append(COMPILED)
    step_s: dict[str, list[float]] = {c: [] for c in contenders}
    wait_share: dict[str, list[float]] = {c: [] for c in trains}
    decoded: dict[str, list[dict]] = {c: [] for c in trains}
    kept_cache = opts.cache_dir
    with tempfile.TemporaryDirectory(prefix="ringfeed-trainer-bench-") as tmp:
        opts.cache_dir = kept_cache or Path(tmp) / "cache"  # shared by the repeats
        for _ in range(repeat):
            for c in contenders:
                if c in trains:
                    if trainer:
                        seconds, share, cache = run_ringfeed(
                            c.split()[1].rstrip(","), opts.ranks, shards, Path(tmp), opts,
                            opts.timeout, compiled=c == COMPILED)
                        step_s[c].append(seconds)
                        wait_share[c].append(share)
                        decoded[c].append(cache)
                elif PEERS[c][1] != "ringfeed_loop.py" or trainer:
                    step_s[c].append(run_peer(c, opts.ranks, peer_args, Path(tmp),
                                              opts.timeout, shards))
    best = {c: min(v) for c, v in step_s.items() if v}
    # The data-wait share of the best ringfeed repeat: how much of its step was input.
    best_wait = {c: v[step_s[c].index(best[c])] for c, v in wait_share.items() if v}
    best_warm = {c: v[step_s[c].index(best[c])]["warm"] for c, v in decoded.items() if v}

    rows = []
    for fw in frameworks:
        ours = best.get(f"ringfeed {fw}")
        peers = [("horovod torch loop", GOAL_VS_HOROVOD), ("torch DDP (gloo)", GOAL_VS_DDP)] \
            if fw == "torch" else [("horovod TF loop", GOAL_VS_HOROVOD)]
        for peer, goal in peers:
            metric = f"{fw} step time vs {peer}"
            if ours is None:
                rows.append(pending_row(NAME, metric, "pending: no train/main.py", goal))
            else:
                rows.append(Row(NAME, metric, ours * 1e3, "ms", peer, best[peer] * 1e3,
                                goal=goal))
        if ours is not None:  # context: the same step without the time spent waiting for input
            wait = best_wait[f"ringfeed {fw}"]
            warm = "warm" if best_warm[f"ringfeed {fw}"] else "cold"
            peer = peers[0][0]
            rows.append(Row(NAME, f"{fw} step time less data wait ({100 * wait:.0f}%, {warm} "
                            f"decoded cache) vs {peer}", ours * (1 - wait) * 1e3, "ms", peer,
                            best[peer] * 1e3))
        loop = best.get(IN_MEMORY.format(fw))
        if loop is not None:  # context: the trainer's own loop, no input pipeline
            peer = peers[0][0]
            rows.append(Row(NAME, f"{fw} loop on an in-memory batch vs {peer}", loop * 1e3, "ms",
                            peer, best[peer] * 1e3))
    if COMPILED in best:  # compiled vs eager, and the warm-up compiling costs
        first = decoded[COMPILED][step_s[COMPILED].index(best[COMPILED])]["first_step_s"]
        eager_first = decoded["ringfeed torch"][step_s["ringfeed torch"].index(
            best["ringfeed torch"])]["first_step_s"]
        rows.append(Row(NAME, f"torch step time, compiled vs eager (warm-up {first:.1f} s vs "
                        f"{eager_first:.1f} s)", best[COMPILED] * 1e3, "ms", "ringfeed torch",
                        best["ringfeed torch"] * 1e3))
    if "torch" in frameworks:
        rows.append(Row(NAME, "horovod loop vs DDP (context)", best["horovod torch loop"] * 1e3,
                        "ms", "torch DDP (gloo)", best["torch DDP (gloo)"] * 1e3))

    fig, (ax,) = new_figure(width=7, height=3.8)
    names = list(best)
    bars = ax.barh(names, [best[n] * 1e3 for n in names],
                   color=["#c44e52" if n.startswith("ringfeed") else "#4c72b0" for n in names])
    ax.bar_label(bars, fmt="%.0f ms", padding=3)
    ax.margins(x=0.15)
    ax.invert_yaxis()
    ax.set_xlabel(f"step time (ms), {opts.ranks} ranks x batch {opts.batch}, cnn width "
                  f"{opts.width}, 32x32x3")
    ax.set_title("trainer overhead (lower is better)")
    data = {"step_s": step_s, "best_step_s": best, "data_wait_share": wait_share,
            "decoded_cache": decoded, "decoded_cache_setting": opts.decoded_cache,
            "cache_dir": str(kept_cache) if kept_cache else "temporary", "ranks": opts.ranks, "batch": opts.batch,
            "warmup": opts.warmup, "steps": opts.steps, "repeat": repeat,
            "num_workers": opts.num_workers, "dataset_samples": samples if trainer else None,
            "malloc": {k: os.environ.get(k) for k in ("MALLOC_MMAP_THRESHOLD_",
                                                      "MALLOC_TRIM_THRESHOLD_")}}
    return finish(NAME, opts.quick, opts.results, rows, data, fig)


if __name__ == "__main__":
    main()

"""Trainer overhead: the step time of `ringfeed train` (reading PNG shards through the
pipeline) against hand-written loops on the same model and batch with the data in memory:
a minimal Horovod PyTorch loop (pytorch_synthetic_benchmark.py style), torch DDP (gloo,
torchrun) and, for TensorFlow, a minimal DistributedGradientTape loop. 2 ranks.

    .venv/bin/python benchmarks/trainer_bench.py            # torch and TF, best of 2
    .venv/bin/python benchmarks/trainer_bench.py --quick    # torch only, few steps

Goals: ringfeed / minimal Horovod <= 1.03 (both frameworks), ringfeed / DDP <= 1.0.
Step times are wall time per step after the warm-up steps, on every side. The contenders run
one after another, interleaved across repeats; the best repeat of each counts. Writes
benchmarks/results/trainer[_quick].json and .png. Measures, never asserts.
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
}


def run_peer(name: str, ranks: int, peer_args: list[str], tmp: Path, timeout: float) -> float:
    launcher, script = PEERS[name]
    out = tmp / f"{script}.json"
    args = [*peer_args, "--out", str(out)]
    launch = hvd_launch if launcher == "horovodrun" else torchrun
    check(launch(ranks, WORKERS / script, args, timeout), f"{launcher} {script}")
    return read_json(out)["step_s_mean"]


def run_ringfeed(framework: str, ranks: int, shards: Path, tmp: Path, opts: argparse.Namespace,
                 timeout: float) -> tuple[float, float]:
    """(step seconds, data-wait share) of `ringfeed train` after the warm-up steps."""
    run_dir = Path(tempfile.mkdtemp(dir=tmp, prefix=f"ringfeed-{framework}-"))  # per repeat
    config = write_config(run_dir / "config.yaml", framework, shards, opts.batch,
                          max_steps=opts.warmup + opts.steps, log_every=opts.warmup,
                          model="cnn", model_args={"width": opts.width},
                          data={"num_workers": opts.num_workers})
    run = ringfeed_train(ranks, config, run_dir / "run", timeout)
    return run.step_s(after_step=opts.warmup), run.data_wait_share_after(opts.warmup)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="torch only, few steps, one repeat")
    ap.add_argument("--frameworks", default=None, help="torch,tensorflow (quick: torch)")
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--batch", type=int, default=64, help="per rank")
    ap.add_argument("--width", type=int, default=32, help="cnn width")
    ap.add_argument("--warmup", type=int, default=None, help="untimed steps (default 5)")
    ap.add_argument("--steps", type=int, default=None, help="timed steps (default 40)")
    ap.add_argument("--repeat", type=int, default=None, help="runs per contender (default 2)")
    ap.add_argument("--num-workers", type=int, default=0, help="ringfeed data.num_workers")
    ap.add_argument("--results", type=Path, default=RESULTS)
    ap.add_argument("--timeout", type=float, default=300, help="per launch (s)")
    opts = ap.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    opts.warmup = opts.warmup or (3 if opts.quick else 5)
    opts.steps = opts.steps or (8 if opts.quick else 40)
    repeat = opts.repeat or (1 if opts.quick else 2)
    frameworks = (opts.frameworks or ("torch" if opts.quick else "torch,tensorflow")).split(",")

    contenders = []
    for fw in frameworks:
        contenders += [f"ringfeed {fw}"] + (["horovod torch loop", "torch DDP (gloo)"]
                                            if fw == "torch" else ["horovod TF loop"])
    trainer = trainer_available()
    # One epoch covers warm-up and timed steps: the comparison is the steady state (the
    # stall benchmark covers epoch boundaries).
    samples = 1024 * -(-opts.ranks * opts.batch * (opts.warmup + opts.steps) // 1024)
    shards = image_shards(samples, per_shard=1024) if trainer else None
    peer_args = ["--model", "cnn", "--width", str(opts.width), "--image", "32", "--batch",
                 str(opts.batch), "--warmup", str(opts.warmup), "--steps", str(opts.steps)]

    step_s: dict[str, list[float]] = {c: [] for c in contenders}
    wait_share: dict[str, list[float]] = {c: [] for c in contenders if c.startswith("ringfeed")}
    with tempfile.TemporaryDirectory(prefix="ringfeed-trainer-bench-") as tmp:
        for _ in range(repeat):
            for c in contenders:
                if c.startswith("ringfeed"):
                    if trainer:
                        seconds, share = run_ringfeed(c.split()[1], opts.ranks, shards,
                                                      Path(tmp), opts, opts.timeout)
                        step_s[c].append(seconds)
                        wait_share[c].append(share)
                else:
                    step_s[c].append(run_peer(c, opts.ranks, peer_args, Path(tmp), opts.timeout))
    best = {c: min(v) for c, v in step_s.items() if v}
    # The data-wait share of the best ringfeed repeat: how much of its step was input.
    best_wait = {c: v[step_s[c].index(best[c])] for c, v in wait_share.items() if v}

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
            peer = peers[0][0]
            rows.append(Row(NAME, f"{fw} step time less data wait ({100 * wait:.0f}%) vs "
                            f"{peer}", ours * (1 - wait) * 1e3, "ms", peer, best[peer] * 1e3))
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
            "ranks": opts.ranks, "batch": opts.batch, "warmup": opts.warmup, "steps": opts.steps, "repeat": repeat,
            "num_workers": opts.num_workers, "dataset_samples": samples if trainer else None}
    return finish(NAME, opts.quick, opts.results, rows, data, fig)


if __name__ == "__main__":
    main()

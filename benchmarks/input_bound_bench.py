"""How input-bound the demo is (issue 46): the demo's model (examples/configs/digits.yaml,
torch) trained from its digits shards and from data.synthetic (one batch of the same shape on
the device, no input at all), interleaved, repeated. The ratio of their samples/s is the share
of the model's own speed the input leaves, the bound the demo's data-wait figure is read
against: 1.0 = not input-bound at all.

    .venv/bin/python benchmarks/input_bound_bench.py            # 2 ranks, 150 steps, 5 pairs
    .venv/bin/python benchmarks/input_bound_bench.py --quick    # 1 rank, 20 steps, 1 pair

Each figure is the global batch over rank 0's median step time (summary.json ranks.step_s.p50,
data waits included; the first step, the warm-up, untimed): on a shared machine a step now and
then is slowed by other work, and a mean takes those in. The pairs alternate which goes
first, so a slow spell falls on both. Reported: the medians, the median of the per-pair ratios
and its range. Writes
benchmarks/results/input_bound[_quick].json and .png. Measures, never asserts.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS, Row, finish, new_figure, pending_row  # noqa: E402
from demo_run import CONFIG, demo_missing, demo_shards  # noqa: E402
from trainrun import ringfeed_train  # noqa: E402

from ringfeed.train.config import load_config  # noqa: E402

NAME = "input_bound"
METRIC = "demo from shards / synthetic samples/s"
# the same steps for both, nothing but the training itself: no profile window, no checkpoint
# but the last, no validation
COMMON = ["framework=torch", "train.profile=null", "checkpoint.every_steps=null",
          "data.val_split=null", "train.epochs=null"]


def synthetic_sets(shards: Path) -> list[str]:
    """The demo's data spec for data.synthetic: its image size, the run's channel count (the
    digits are grey) and the shards' class count."""
    from ringfeed.train.data import make_pipeline, run_channels

    cfg = load_config(CONFIG, [f"data.train={shards}", "data.val_split=null"])
    pipe = make_pipeline(cfg, "train", 0, 1)
    try:
        classes = len(pipe.manifest.class_names)
    finally:
        pipe.close()
    size = list(cfg.data.image_size) if isinstance(cfg.data.image_size, tuple) \
        else cfg.data.image_size
    return ["data.synthetic=true", f"data.image_size={size}",
            f"data.channels={run_channels(cfg)}", f"model.args.num_classes={classes}"]


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="1 rank, 20 steps, 1 pair")
    ap.add_argument("--ranks", type=int, default=None, help="default 2 (quick: 1)")
    ap.add_argument("--steps", type=int, default=None, help="default 150 (quick: 20)")
    ap.add_argument("--pairs", type=int, default=None, help="default 5 (quick: 1)")
    ap.add_argument("--results", type=Path, default=RESULTS)
    ap.add_argument("--timeout", type=float, default=300, help="per training run (s)")
    opts = ap.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    ranks = opts.ranks or (1 if opts.quick else 2)
    steps = opts.steps or (20 if opts.quick else 150)
    pairs = opts.pairs or (1 if opts.quick else 5)
    missing = demo_missing()
    if missing:
        return finish(NAME, opts.quick, opts.results,
                      [pending_row(NAME, METRIC, f"pending: {missing}")], {})
    shards = demo_shards()
    batch = load_config(CONFIG, check_paths=False).data.batch_size
    sets = {"shards": [f"data.train={shards}"], "synthetic": synthetic_sets(shards)}
    rates: dict[str, list[float]] = {"shards": [], "synthetic": []}
    with tempfile.TemporaryDirectory(prefix="ringfeed-input-bound-") as tmp:
        for pair in range(pairs):
            order = ["synthetic", "shards"] if pair % 2 == 0 else ["shards", "synthetic"]
            for kind in order:
                run = ringfeed_train(ranks, CONFIG, Path(tmp) / f"{kind}{pair}", opts.timeout,
                                     [*COMMON, f"train.max_steps={steps}", *sets[kind]])
                step_s = run.summary["ranks"]["step_s"]["p50"][0]
                rates[kind].append(batch * ranks / step_s)
    ratios = [s / b for s, b in zip(rates["shards"], rates["synthetic"], strict=True)]
    median = {kind: statistics.median(values) for kind, values in rates.items()}
    ratio = statistics.median(ratios)
    rows = [Row(NAME, METRIC, median["shards"], "samples/s", peer="synthetic",
                peer_value=median["synthetic"], ratio=ratio,
                note=f"{ranks} rank(s), {steps} steps, {pairs} pairs; per-pair ratio "
                     f"{min(ratios):.3f}-{max(ratios):.3f}")]
    fig, (ax,) = new_figure(width=6.0, height=3.5)
    for kind, marker in (("synthetic", "s"), ("shards", "o")):
        ax.plot(range(1, pairs + 1), rates[kind], marker + "-", label=kind)
    ax.set_xlabel("pair")
    ax.set_ylabel("samples/s (all ranks)")
    ax.set_title(f"demo model: shards vs synthetic, {ranks} rank(s); median ratio {ratio:.3f}")
    ax.legend(fontsize=8)
    data = {"ranks": ranks, "steps": steps, "rates": rates, "ratios": ratios,
            "median": median, "ratio_median": ratio}
    return finish(NAME, opts.quick, opts.results, rows, data, fig)


if __name__ == "__main__":
    main()

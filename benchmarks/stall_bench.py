"""Data stall: the share of step time the demo's 2 ranks spend waiting for batches, as the
trainer itself measures it (summary.json's data_wait_share: summed over ranks, epoch
boundaries included). Goal: < 5%.

    .venv/bin/python benchmarks/stall_bench.py            # the demo's torch config as shipped
    .venv/bin/python benchmarks/stall_bench.py --quick    # capped at a few steps, one rank

Writes benchmarks/results/stall[_quick].json and .png. Measures, never asserts.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS, Row, finish, new_figure, pending_row  # noqa: E402
from demo_run import demo_missing, demo_run  # noqa: E402

NAME = "stall"
GOAL = ("<=", 0.05)
METRIC = "demo data-wait share of step time"


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="a few steps on one rank only")
    ap.add_argument("--ranks", type=int, default=None, help="default 2 (quick: 1)")
    ap.add_argument("--results", type=Path, default=RESULTS)
    ap.add_argument("--timeout", type=float, default=300, help="for the training run (s)")
    opts = ap.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    opts.ranks = opts.ranks or (1 if opts.quick else 2)

    missing = demo_missing()
    if missing:
        return finish(NAME, opts.quick, opts.results,
                      [pending_row(NAME, METRIC, f"pending: {missing}", GOAL)], {})
    run = demo_run(opts.ranks, opts.timeout, max_steps=20 if opts.quick else None)
    share = run.data_wait_share
    rows = [Row(NAME, METRIC, 100 * share, "%", ratio=share, goal=GOAL,
                note=f"{run.summary['step']} steps, {opts.ranks} ranks")]
    windows = [m for m in run.metrics if "data_wait" in m]
    fig, (ax,) = new_figure(width=6.5, height=3.5)
    ax.plot([m["step"] for m in windows], [100 * m["data_wait"] for m in windows], "o-",
            label="per logging window")
    ax.axhline(100 * share, color="black", ls="--", label=f"whole run: {100 * share:.1f}%")
    ax.axhline(100 * GOAL[1], color="red", ls=":", label="goal")
    ax.set_xlabel("step")
    ax.set_ylabel("data wait (% of step time)")
    ax.set_title(f"demo data stall, {opts.ranks} ranks")
    ax.legend(fontsize=8)
    data = {"data_wait_share": share, "summary": run.summary, "windows": windows,
            "wall_s": run.wall_s}
    return finish(NAME, opts.quick, opts.results, rows, data, fig)


if __name__ == "__main__":
    main()

"""The demo's training run, for the scaling (time per epoch vs ranks) and data-stall
benchmarks: the demo's own torch config and shards (examples/), launched with horovodrun.
Runs are memoised per rank count, so `run_all.py` trains each configuration once."""

from __future__ import annotations

from functools import cache

from common import REPO
from trainrun import TrainRun, trainer_available

EXAMPLES = REPO / "examples"


def demo_missing() -> str | None:
    """Why the demo cannot be run from here, or None when it can."""
    if not trainer_available():
        return "no train/main.py"
    if not (EXAMPLES / "demo.py").exists():
        return "no examples/demo.py"
    return "demo wiring not written yet"


@cache
def demo_run(ranks: int, timeout: float) -> TrainRun:
    raise RuntimeError(demo_missing())

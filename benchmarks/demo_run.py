"""The demo's training run, for the scaling (time per epoch vs ranks) and data-stall
benchmarks: examples/configs/digits.yaml on the demo's digits shards (made once with the
demo's own image builder and its `ringfeed shard` flags, then cached), launched with
horovodrun under a timeout. Runs are memoised, so `run_all.py` trains each setup once."""

from __future__ import annotations

import importlib.util
import tempfile
from functools import cache
from pathlib import Path

from common import REPO
from datasets import CACHE, cached_dir
from trainrun import TrainRun, ringfeed_train, trainer_available

EXAMPLES = REPO / "examples"
CONFIG = EXAMPLES / "configs" / "digits.yaml"
# examples/demo.py's digits_demo() shards the images with these flags.
SHARD_FLAGS = ["--format", "imagefolder", "--val-fraction", "0.1", "--shuffle-seed", "0",
               "--max-count", "200", "--no-progress"]


def demo_missing() -> str | None:
    """Why the demo cannot be run from here, or None when it can."""
    if not trainer_available():
        return "no train/main.py"
    for path in (EXAMPLES / "demo.py", CONFIG):
        if not path.exists():
            return f"no {path.relative_to(REPO)}"
    return None


def demo_shards() -> Path:
    """The demo's digits shards (32x32 PNGs of sklearn's bundled digits, train + val)."""
    return digit_shards("digits-shards-v1", SHARD_FLAGS)


def digit_shards(name: str, flags: list[str]) -> Path:
    """The demo's digit images sharded with `ringfeed shard IMAGES OUT *flags`, made once
    under the benchmarks' cache as `name`."""
    from ringfeed.train.cli import main as ringfeed

    spec = importlib.util.spec_from_file_location("ringfeed_demo", EXAMPLES / "demo.py")
    demo = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(demo)

    def build(out: Path) -> None:
        with tempfile.TemporaryDirectory(dir=CACHE, prefix=".digits-") as tmp:
            images = Path(tmp) / "images"
            demo.build_digits(images)
            code = ringfeed(["shard", str(images), str(out), *flags])
        if code != 0:
            raise RuntimeError(f"ringfeed shard of the digits exited {code}")

    return cached_dir(name, build)


def demo_run(ranks: int, timeout: float, max_steps: int | None = None) -> TrainRun:
    """The demo's torch config on `ranks` ranks, as shipped (or capped at `max_steps`)."""
    return _demo_run(ranks, max_steps, timeout)


@cache  # keyed on positional arguments only, so every caller shares a run
def _demo_run(ranks: int, max_steps: int | None, timeout: float) -> TrainRun:
    overrides = [f"data.train={demo_shards()}", "framework=torch"]
    if max_steps is not None:
        overrides.append(f"train.max_steps={max_steps}")
    with tempfile.TemporaryDirectory(prefix=f"ringfeed-demo-{ranks}r-") as tmp:
        return ringfeed_train(ranks, CONFIG, Path(tmp) / "run", timeout, overrides)

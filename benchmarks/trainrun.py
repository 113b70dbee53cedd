"""Running `ringfeed train` for a benchmark: write a config, launch it on N ranks with
horovodrun (bounded), and read back what rank 0 logged (metrics.jsonl, summary.json)."""

from __future__ import annotations

import importlib.util
import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from common import check, horovodrun

from ringfeed.fsutil import atomic_write_text


def trainer_available() -> bool:
    return importlib.util.find_spec("ringfeed.train.main") is not None


@dataclass
class TrainRun:
    wall_s: float  # launch to exit, startup included
    summary: dict[str, Any]
    metrics: list[dict[str, Any]] = field(default_factory=list)

    def _windows(self, after_step: int) -> tuple[dict, list[dict]]:
        """The train record at `after_step` (a logged step) and the ones after it."""
        train = [m for m in self.metrics if "data_wait" in m and "time" in m]
        first = next(m for m in train if m["step"] >= after_step)
        later = [m for m in train if m["step"] > first["step"]]
        if not later:
            raise ValueError(f"no logged steps after step {after_step}")
        return first, later

    def step_s(self, after_step: int) -> float:
        """Mean wall seconds per step after `after_step`, from the time stamps of rank 0's
        metrics records: data waits, logging and the trainer's own per-step collectives
        included, nothing left out."""
        first, later = self._windows(after_step)
        return (later[-1]["time"] - first["time"]) / (later[-1]["step"] - first["step"])

    def data_wait_share_after(self, after_step: int) -> float:
        """Rank 0's data-wait share of step time over the steps after `after_step`."""
        first, later = self._windows(after_step)
        steps = [m["step"] - prev["step"] for prev, m in zip([first, *later], later,
                                                             strict=False)]
        return sum(n * m["data_wait"] for n, m in zip(steps, later, strict=True)) / sum(steps)

    @property
    def data_wait_share(self) -> float:
        return float(self.summary["data_wait_share"])


def write_config(path: Path, framework: str, shards: Path, batch: int,
                 max_steps: int | None = None, epochs: int | None = None, log_every: int = 10,
                 model: str = "cnn", model_args: dict | None = None,
                 data: dict | None = None) -> Path:
    """A `ringfeed train` config: no validation split, no TensorBoard, one checkpoint at the
    end (outside the timed steps)."""
    config = {
        "framework": framework,
        "model": {"name": model, "args": dict(model_args or {})},
        "data": {"train": str(shards), "val_split": None, "batch_size": batch, **(data or {})},
        "optim": {"name": "sgd", "lr": 0.01, "momentum": 0.9},
        "train": {"epochs": epochs, "max_steps": max_steps, "log_every": log_every, "seed": 0},
        "output": {"tensorboard": False},  # output.dir: given at launch
    }
    atomic_write_text(path, yaml.safe_dump(config, sort_keys=False))
    return path


def ringfeed_train(ranks: int, config: Path, out_dir: Path, timeout: float,
                   overrides: list[str] = ()) -> TrainRun:
    """`horovodrun -np RANKS ringfeed train CONFIG --set output.dir=OUT_DIR [--set ...]`;
    raises with the output's tail if it fails or times out."""
    sets = [a for o in [f"output.dir={out_dir}", *overrides] for a in ("--set", o)]
    start = time.perf_counter()
    result = horovodrun(ranks, [str(Path(sys.executable).parent / "ringfeed"), "train",
                                str(config), *sets], timeout=timeout)
    wall = time.perf_counter() - start
    check(result, f"ringfeed train ({ranks} ranks, {config})")
    metrics = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()
               if line.strip()]
    return TrainRun(wall, json.loads((out_dir / "summary.json").read_text()), metrics)

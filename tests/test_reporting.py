"""train/observe/reporter.py in-process, on one rank with a stand-in backend: the hooks write
config.yaml, metrics.jsonl, samples.jsonl and summary.json; the first step is the untimed
warm-up; a mixture's shares are counted per source."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from ringfeed.train.backends.base import Dist, StepResult
from ringfeed.train.config import RunConfig
from ringfeed.train.data import CLASSIFY, DataSpec
from ringfeed.train.observe.reporter import Reporter, step_extras, valid_sample_ids
from ringfeed.train.observe.throughput import FlopCount
from ringfeed.train.runstate import Recovery, TrainState

SPEC = DataSpec(CLASSIFY, "x.npy", "y.npy", (4,), num_classes=2)


class OneRank:
    dist = Dist(0, 1, 0)
    cpu_threads = None

    def allreduce_sum(self, values: dict[str, float]) -> dict[str, float]:
        return dict(values)

    def gather_object(self, obj: Any) -> list[Any]:
        return [obj]

    def accounting_device(self) -> tuple[str | None, str]:
        return None, "fp32"

    def count_flops(self, batch: dict[str, Any]) -> FlopCount:
        return FlopCount(100.0, "test")

    def comm_stats(self) -> dict[str, float]:
        return {}


class Mixture:
    per_epoch = np.array([6, 2])
    epoch_samples = 8


class Pipe:
    def __init__(self, mixture: bool = False):
        self.mixture = Mixture() if mixture else None
        self.source_names = ["a", "b"]

    def example_batch(self) -> dict[str, Any]:
        return {}

    def source_of(self, ids: list[int]) -> tuple[np.ndarray, np.ndarray]:
        ids = np.asarray(ids)
        return (ids % 2).astype(np.int64), ids // 2

    def stats(self) -> dict[str, Any]:
        return {}


def batch(ids: list[int], valid: list[bool]) -> dict[str, Any]:
    return {"__index__": np.array(ids), "__valid__": np.array(valid)}


def reporter(tmp_path: Path, **train: Any) -> Reporter:
    cfg = RunConfig.model_validate({
        "framework": "torch", "data": {"train": "unused"},
        "train": {"log_every": 2, **train},
        "output": {"dir": str(tmp_path), "tensorboard": False, "sample_log": True}})
    return Reporter(cfg.output, cfg.train, OneRank(), framework=cfg.framework,
                    config=cfg.model_dump(mode="json"), config_yaml=cfg.to_yaml(),
                    resuming=cfg.checkpoint.resume != "none")


def report_step(r: Reporter, state: TrainState, result: StepResult, micro: list[Any],
                lr: float, waited: float) -> None:
    """What the loop calls after an optimizer step (train/loop.py Trainer.step)."""
    r.on_step(state, result, micro, waited)
    figures = r.gather_rank_figures(state.step) if r.log_due(state.step) else {}
    r.log_step(state, result, lr, waited, figures)


def test_the_hooks_write_the_logs_and_the_summary(tmp_path):
    r = reporter(tmp_path)
    r.open(0, 4, 8, SPEC, Pipe())
    r.start_timing(0)
    state = TrainState()
    for step in range(1, 5):
        state.step = step
        report_step(r, state, StepResult(float(step)),
                    [batch([2 * step, 2 * step + 1], [True, False])], 0.1, 0.0)
        r.restart_clock()
    r.on_validate(state, {"loss": 0.5})
    r.finish("finished", state, Recovery(), steps_per_epoch=4)
    r.close()
    assert (tmp_path / "config.yaml").exists()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [2, 4, 4] and rows[-1]["val_loss"] == 0.5
    samples = [json.loads(line) for line in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert [s["step"] for s in samples] == [1, 2, 3, 4]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["step"] == 4 and summary["epochs_done"] == 1.0
    assert summary["final_loss"] == 3.5  # the last log_every steps
    assert summary["first_step_s"] is not None  # the warm-up, not in train_seconds
    assert summary["throughput"]["flops_per_sample"] == 100.0


def test_a_mixture_counts_its_samples_per_source(tmp_path):
    r = reporter(tmp_path)
    r.open(0, 2, 8, SPEC, Pipe(mixture=True))
    r.start_timing(0)
    state = TrainState(step=1)
    r.on_step(state, StepResult(1.0), [batch([0, 2, 4, 1], [True, True, True, True])], 0.0)
    assert r.mixture.shares() == {"share/a": 0.75, "share/b": 0.25}
    r.close()


def test_helpers_return_values():
    assert valid_sample_ids([batch([5, 6, 7], [True, False, True])]) == [5, 7]
    assert step_extras(StepResult(1.0)) == {}
    assert step_extras(StepResult(1.0, applied=False, grad_norm=2.0, loss_scale=8.0)) == {
        "grad_norm": 2.0, "loss_scale": 8.0, "skipped": 1.0}

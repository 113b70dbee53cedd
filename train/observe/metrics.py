"""Rank 0's view of a run: progress bar or log lines, `metrics.jsonl`, TensorBoard event files,
and the end-of-run summary with the "is input the bottleneck" line.

Framework-free on purpose: TensorBoard events are written with tensorboard's own record writer
and protos (torch's SummaryWriter and tf.summary would drag the other framework in).
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from ringfeed.fsutil import atomic_write_text
from ringfeed.train.observe.runfiles import (
    METRICS_FILE,
    SAMPLES_FILE,
    SUMMARY_FILE,
    AppendFile,
    output_dir_error,
    output_write_error,
)
from ringfeed.train.observe.throughput import Accounting, summary_lines
from ringfeed.train.observe.trackers import ScalarSink, finite_scalars

# Data-wait share of step time above which we call the input pipeline the bottleneck.
BOTTLENECK_SHARE = 0.20
MINOR_SHARE = 0.05


@dataclass
class Throughput:
    """Step-time accounting for one rank: where the time between optimizer steps went."""

    steps: int = 0
    samples: int = 0
    step_s: float = 0.0  # wall time of train steps, data waits included
    data_wait_s: float = 0.0

    def add(self, samples: int, step_s: float, data_wait_s: float) -> None:
        self.steps += 1
        self.samples += samples
        self.step_s += step_s
        self.data_wait_s += data_wait_s

    @property
    def samples_per_s(self) -> float:
        return self.samples / self.step_s if self.step_s > 0 else 0.0

    @property
    def data_wait_share(self) -> float:
        return self.data_wait_s / self.step_s if self.step_s > 0 else 0.0


def bottleneck_line(share: float) -> str:
    pct = f"{100 * share:.1f}%"
    if share >= BOTTLENECK_SHARE:
        return (f"input IS the bottleneck: ranks waited on data for {pct} of step time "
                "(raise data.num_workers, set data.cache_dir for remote shards, or make "
                "decode/transform cheaper)")
    if share >= MINOR_SHARE:
        return f"input is a minor cost: ranks waited on data for {pct} of step time"
    return f"input is not the bottleneck: ranks waited on data for {pct} of step time"


@dataclass
class RunLogger:
    """Everything rank 0 reports. On other ranks every method is a no-op."""

    out_dir: Path
    enabled: bool
    total_steps: int
    global_batch: int
    log_every: int
    # where every record's scalars, and the summary, also go (trackers.py: TensorBoard,
    # MLflow, W&B); opened and closed by the caller, so they outlive a logger reopened at a step
    sinks: Sequence[ScalarSink] = ()
    start_step: int = 0
    stream: IO[str] = field(default_factory=lambda: sys.stdout)
    accounting: Accounting | None = None  # FLOPs per sample and peak: tflops, mfu, tokens/s

    def __post_init__(self) -> None:
        self.window = Throughput()
        self._window_loss = 0.0
        self._window_means: dict[str, float] = {}  # sums of the steps' training metrics
        self.train_metrics: dict[str, float] = {}  # the last log record's (summary.json)
        self._bar = None
        self._jsonl: AppendFile | None = None
        self.metrics_path = self.out_dir / METRICS_FILE
        self.rewound = Rewound()

    def open(self) -> RunLogger:
        """Rank 0: metrics.jsonl opened (the records after start_step, an interrupted run's,
        dropped: `rewound` says how far they went) and, on a terminal, the progress bar;
        returns the logger."""
        if not self.enabled:
            return self
        try:
            self.out_dir.mkdir(parents=True, exist_ok=True)
            self.rewound = _truncate_after(self.metrics_path, self.start_step)
            self._jsonl = AppendFile(self.metrics_path)
            if self.rewound.steps:  # for the attempts after this one (Rewound.earlier)
                self.event(self.start_step, {"event": RESUMED_EVENT,
                                             "steps_redone": self.rewound.steps})
        except OSError as e:
            raise output_dir_error(self.out_dir, e) from None
        if sys.stderr.isatty():  # a live bar on a terminal; plain log lines otherwise
            from tqdm import tqdm

            self._bar = tqdm(total=self.total_steps, initial=self.start_step, unit="step",
                             dynamic_ncols=True, file=sys.stderr)
        return self

    def info(self, message: str) -> None:
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.write(message, file=self.stream)
        else:
            print(message, file=self.stream, flush=True)

    def train_step(self, step: int, epoch: int, loss: float, lr: float, step_s: float,
                   data_wait_s: float,
                   extra: dict[str, float] | Callable[[], dict[str, float]] | None = None,
                   means: dict[str, float] | None = None) -> None:
        """Called after every optimizer step (`step` counts completed steps). Between log steps
        it only adds to the window; `extra` (or the function giving it, called on log steps
        only) holds per-step values such as the gradient norm; `means` the step's training
        metrics (accuracy, top5), recorded like the loss: their mean over the window."""
        if not self.enabled:
            return
        self.window.add(self.global_batch, step_s, data_wait_s)
        self._window_loss += loss
        for name, value in (means or {}).items():
            self._window_means[name] = self._window_means.get(name, 0.0) + value
        if self._bar is not None:
            self._bar.update(1)
        if step % self.log_every and step != self.total_steps:
            return
        if callable(extra):
            extra = extra()
        self.train_metrics = {name: total / self.window.steps
                              for name, total in self._window_means.items()}
        record = {"step": step, "epoch": epoch, "loss": self._window_loss / self.window.steps,
                  **self.train_metrics, "lr": lr, "samples_per_s": self.window.samples_per_s,
                  "data_wait": self.window.data_wait_share, **(extra or {})}
        if self.accounting is not None:
            record.update(self.accounting.rates(record["samples_per_s"]))
        self._record(record)
        shown = "".join(f"{name} {value:.4f}  " for name, value in self.train_metrics.items())
        tokens = (f"{record['tokens_per_s']:.0f} tokens/s  " if "tokens_per_s" in record
                  else "")
        text = (f"loss {record['loss']:.4f}  {shown}{record['samples_per_s']:.0f} samples/s  "
                f"{tokens}data-wait {100 * record['data_wait']:.0f}%  lr {lr:.3g}")
        if self._bar is not None:
            self._bar.set_postfix_str(text, refresh=True)
        else:
            self.info(f"step {step}/{self.total_steps}  epoch {epoch}  {text}")
        self.window = Throughput()
        self._window_loss = 0.0
        self._window_means = {}

    def event(self, step: int, details: dict[str, Any]) -> None:
        """A non-metric record in metrics.jsonl (e.g. an elastic reset), not in TensorBoard."""
        if self.enabled:
            assert self._jsonl is not None
            self._jsonl.append((json.dumps({"step": step, **details,
                                            "time": round(time.time(), 3)}) + "\n").encode())

    def validation(self, step: int, epoch: int, metrics: dict[str, float]) -> None:
        if not self.enabled:
            return
        self._record({"step": step, "epoch": epoch, **{f"val_{k}": v for k, v in metrics.items()}})
        shown = "  ".join(f"{k} {v:.4f}" for k, v in metrics.items())
        self.info(f"validation at step {step}: {shown}")

    def _record(self, record: dict[str, Any]) -> None:
        assert self._jsonl is not None
        record = {**record, "time": round(time.time(), 3)}
        self._jsonl.append((json.dumps(record) + "\n").encode())
        if self.sinks:
            values = finite_scalars(record)
            for sink in self.sinks:
                sink.scalars(record["step"], values)

    def summary(self, summary: dict[str, Any]) -> None:
        """Print the end-of-run summary and write it to `summary.json`."""
        if not self.enabled:
            return
        path = self.out_dir / SUMMARY_FILE
        try:
            atomic_write_text(path, json.dumps(summary, indent=2, default=str) + "\n")
        except OSError as e:
            raise output_write_error(path, e) from None
        lines = [f"ringfeed train: {summary['status']} at step {summary['step']} "
                 f"(epoch {summary['epoch']}), {summary['train_seconds']:.1f}s training"]
        if summary.get("final_loss") is not None:
            lines.append(f"  final train loss   {summary['final_loss']:.4f}")
        for k, v in (summary.get("train") or {}).items():
            lines.append(f"  final train {k:<6} {v:.4f}")
        for k, v in (summary.get("val") or {}).items():  # (a long name keeps a space)
            lines.append(f"  final val {k + ' ' if len(k) >= 9 else k:<9}{v:.4f}")
        lines.append(f"  throughput         {summary['samples_per_s']:.1f} samples/s "
                     f"({summary['world_size']} ranks, global batch {self.global_batch})")
        lines.append(f"  data wait          {bottleneck_line(summary['data_wait_share'])}")
        lagging = (summary.get("ranks") or {}).get("straggler")
        if lagging:
            lines.append(f"  straggler          rank {lagging['rank']}: {lagging['lag_s']:.3f} s per "
                         "step of its own work over the other ranks' median "
                         f"({100 * lagging['share_of_step']:.0f}% of a step; summary.json ranks)")
        storage = summary.get("storage") or {}
        if storage.get("retries"):
            lines.append(f"  storage            {storage['retries']:.0f} retried read(s) "
                         f"({storage['throttles']:.0f} throttled), {storage['wait_s']:.1f}s "
                         "waiting on storage (all ranks)")
        if summary.get("first_step_s") is not None:
            lines.append(f"  first step         {summary['first_step_s']:.1f}s (warm-up: tracing"
                         ", compiling; not in the throughput)")
        if summary.get("mixture"):
            lines.append("  mixture shares     " + ", ".join(
                f"{name} {v['share']:.3f} (weight {v['weight']:.3f})"
                for name, v in summary["mixture"].items()))
        if summary.get("throughput"):
            lines += summary_lines(summary["throughput"])
        lines.append(f"  metrics            {self.metrics_path}")
        for sink in self.sinks:
            sink.summary(summary["step"], summary)
            lines.append(f"  {sink.name:<19}{sink.describe()}")
        if summary.get("checkpoint"):
            lines.append(f"  last checkpoint    {summary['checkpoint']}")
        if summary.get("recovery_text"):
            lines.append(f"  recovery           {summary['recovery_text']}")
        self.info("\n".join(lines))

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
        if self._jsonl is not None:
            self._jsonl.close()


class SampleLog:
    """`samples.jsonl`: per optimizer step, the global sample ids (__index__) every rank
    trained on, `{"step", "epoch", "ids": [[rank 0's], [rank 1's], ...]}` (a weighted
    mixture's samples as [source index, id within the source]). Rank 0 writes; a
    resumed or rolled-back run rewrites it from its step on, like metrics.jsonl, so it holds
    exactly the steps that made the current weights."""

    def __init__(self, out_dir: Path, enabled: bool, start_step: int = 0):
        self.out_dir, self.enabled, self.start_step = Path(out_dir), enabled, start_step
        self._file: AppendFile | None = None

    def open(self) -> SampleLog:
        """Rank 0: samples.jsonl opened (the records after start_step dropped); returns the
        log."""
        if self.enabled:
            path = self.out_dir / SAMPLES_FILE
            try:
                _truncate_after(path, self.start_step)
                self._file = AppendFile(path)
            except OSError as e:
                raise output_dir_error(self.out_dir, e) from None
        return self

    def step(self, step: int, epoch: int, ids_per_rank: list[list[int]]) -> None:
        if self._file is not None:
            self._file.append((json.dumps({"step": step, "epoch": epoch, "ids": ids_per_rank})
                               + "\n").encode())

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


@dataclass(frozen=True)
class Rewound:
    """What a resume found in metrics.jsonl: the steps the interrupted run had logged past the
    checkpoint (redone now; a lower bound, logged every log_every steps), and those earlier
    resumes of the same run recorded (their RESUMED_EVENT records)."""

    steps: int = 0
    earlier: int = 0

    @property
    def total(self) -> int:
        return self.steps + self.earlier


RESUMED_EVENT = "resumed"  # a metrics.jsonl event: {"event": "resumed", "steps_redone": n}


def _truncate_after(path: Path, step: int) -> Rewound:
    """A resumed run rewrites its history from the checkpoint's step on: drop later records
    (written by the interrupted run) so metrics.jsonl reads as one consistent run."""
    if not path.exists():
        return Rewound()
    if step == 0:
        path.unlink()
        return Rewound()
    stepped = [(line, _step_of(line)) for line in path.read_text().splitlines() if line.strip()]
    kept = [line for line, at in stepped if at <= step]
    atomic_write_text(path, "".join(line + "\n" for line in kept))
    dropped = max((at for _, at in stepped if at > step), default=step)
    return Rewound(dropped - step, sum(_redone_in(line) for line in kept
                                       if RESUMED_EVENT in line))


def _redone_in(line: str) -> int:
    try:
        record = json.loads(line)
        return int(record.get("steps_redone", 0)) if record.get("event") == RESUMED_EVENT else 0
    except (ValueError, AttributeError):
        return 0


def _step_of(line: str) -> int:
    try:
        return int(json.loads(line).get("step", 0))
    except (ValueError, AttributeError):
        return 0

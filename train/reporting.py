"""What a run reports, as hooks the loop (train/loop.py) calls; the loop itself only trains.

    open()           at every start (and again after an elastic reset): rank 0's config.yaml,
                     metrics.jsonl (and TensorBoard), samples.jsonl, each rewound to the step;
                     the FLOP/peak accounting (rank 0, once) and the profiler (once)
    start_timing()   training starts: the first step of a stretch is the warm-up, not timed
    on_step()        after every optimizer step: the step's time, loss, lr, data wait, the
                     sample ids and mixture counts; a log line every train.log_every steps
    on_step_end()    after the step's validation and checkpoint: the profiler's window moves
                     on and the clock restarts (validation and checkpoints are not step time)
    on_validate()    validation metrics
    on_checkpoint()  before a checkpoint or an elastic commit: samples.jsonl is flushed, so
                     it covers every step the checkpoint or commit holds
    finish()         summary.json (collective: the data-wait share is averaged over ranks)

Rules: rank 0 writes every file; every method is called on every rank in the same order, and
those marked collective talk to all ranks (the sample log's allgather every log_every steps,
the mixture shares' allreduce on log steps). Trackers (MLflow, W&B) belong here as hooks.
"""

from __future__ import annotations

import contextlib
import time
from collections import deque
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np

from ringfeed.fsutil import atomic_write_text
from ringfeed.train.backend import Backend, StepResult
from ringfeed.train.config import RunConfig
from ringfeed.train.data import LM, DataSpec
from ringfeed.train.metrics import RunLogger, SampleLog, Throughput, output_dir_error
from ringfeed.train.profile import StepProfiler
from ringfeed.train.runstate import Recovery, TrainState
from ringfeed.train.throughput import Accounting, FlopCount, resolve_peak

STORAGE_COUNTS = ("storage_retries", "storage_throttles", "storage_wait_s")


class Reporter:
    """The run's logs, summary, sample log, mixture shares, throughput and profiler."""

    cfg: RunConfig
    backend: Backend
    # the current start's train pipeline (a new one after an elastic reset) and step counts
    pipe: Any
    total_steps: int
    global_batch: int
    logger: RunLogger | None
    sample_log: SampleLog | None
    pending_ids: list[tuple[int, int, list]]  # sample ids of steps not yet gathered
    mixture_samples: np.ndarray | None  # a mixture's samples trained on per source, this rank
    totals: Throughput
    recent_losses: deque[float]
    last_val: dict[str, float]
    first_step: int  # the step this stretch of training started at (its first is not timed)
    first_step_s: float | None  # how long that first step took: the warm-up
    t_last: float  # when the previous step ended
    accounting: Accounting | None  # FLOPs per sample, peak (rank 0, once)
    profiler: StepProfiler | None  # train.profile's window; None when off

    def __init__(self, cfg: RunConfig, backend: Backend):
        self.cfg, self.backend = cfg, backend
        self.pipe, self.total_steps, self.global_batch = None, 0, 0
        self.logger = self.sample_log = None
        self.pending_ids = []
        self.mixture_samples = None
        self.totals = Throughput()
        self.recent_losses = deque(maxlen=cfg.train.log_every)
        self.last_val = {}
        self.first_step, self.first_step_s = 0, None
        self.t_last = time.perf_counter()
        self.accounting = self.profiler = None

    def say(self, message: str) -> None:
        """Print on rank 0."""
        if self.backend.dist.is_root:
            print(message, flush=True)

    def info(self, message: str) -> None:
        """A line of the run's log (rank 0; beside a progress bar when there is one)."""
        if self.logger is not None:
            self.logger.info(message)

    def event(self, step: int, details: dict[str, Any]) -> None:
        """A non-metric record in metrics.jsonl (an elastic reset)."""
        self.logger.event(step, details)

    # -- hooks --------------------------------------------------------------------------------
    def open(self, step: int, total_steps: int, global_batch: int, spec: DataSpec,
             pipe: Any) -> None:
        """Rank 0's config.yaml, metrics and sample logs rewound to `step`; the accounting and
        the profiler the first time."""
        cfg, dist, out = self.cfg, self.backend.dist, Path(self.cfg.output.dir)
        self._close_logs()
        self.pipe, self.total_steps, self.global_batch = pipe, total_steps, global_batch
        if pipe.mixture is not None and self.mixture_samples is None:
            self.mixture_samples = np.zeros(len(pipe.source_names), dtype=np.int64)
        if dist.is_root:
            try:
                out.mkdir(parents=True, exist_ok=True)
                atomic_write_text(out / "config.yaml", cfg.to_yaml())
            except OSError as e:
                raise output_dir_error(out, e) from None
        if dist.is_root and self.accounting is None:
            self.accounting = count_throughput(self.backend, spec, pipe, cfg.train.peak_tflops)
        self.logger = RunLogger(out, dist.is_root, total_steps, global_batch,
                                cfg.train.log_every, cfg.output.tensorboard,
                                start_step=step, accounting=self.accounting)
        self._open_profiler()
        self.pending_ids = []
        if cfg.output.sample_log:
            self.sample_log = SampleLog(out, dist.is_root, start_step=step)

    def start_timing(self, step: int) -> None:
        """Training starts (again) after `step`: its next step is the untimed warm-up."""
        self.first_step = step
        if self.profiler is not None:
            self.profiler.at(step + 1)
        self.t_last = time.perf_counter()

    def span(self, name: str, step: int | None = None) -> contextlib.AbstractContextManager:
        """A named range of the profiler's trace (nothing when profiling is off)."""
        if self.profiler is None:
            return contextlib.nullcontext()
        return self.profiler.span(name, step=step)

    def on_step(self, state: TrainState, result: StepResult, micro: list[Any], lr: float,
                waited: float) -> None:
        """After optimizer step `state.step` (collective on log steps: mixture shares, and the
        sample log's allgather)."""
        step, now = state.step, time.perf_counter()
        if step > self.first_step + 1:  # the first step traces/compiles: not timed
            self.totals.add(self.global_batch, now - self.t_last, waited)
        else:  # its cost is reported instead: the warm-up (tf.function tracing, compiling)
            self.first_step_s = now - self.t_last
        self.recent_losses.append(result.loss)
        ids = self._count_samples(micro)
        log_step = step % self.cfg.train.log_every == 0
        shares = (self.mixture_shares() if self.mixture_samples is not None and (
            log_step or step == self.total_steps) else {})  # (collective: steps every rank logs)
        # grad norm / loss scale are read (a device sync) only when a log line is written
        self.logger.train_step(step, state.epoch, result.loss, lr, now - self.t_last, waited,
                               lambda: {**step_extras(result), **shares,
                                        **self._storage_waits()})
        if self.sample_log is not None:
            self.pending_ids.append((step, state.epoch, ids))
            if log_step:
                self.flush_samples()

    def _storage_waits(self) -> dict[str, float]:
        """This rank's storage retries so far, in a log record once there were any."""
        stats = self.pipe.stats()
        return ({k: float(stats[k]) for k in STORAGE_COUNTS} if stats.get("storage_retries")
                else {})

    def on_step_end(self, step: int) -> None:
        """Step `step` and what followed it (validation, checkpoint, commit) are done."""
        if self.profiler is not None:
            self.profiler.at(step + 1)
        self.t_last = time.perf_counter()

    def on_epoch_end(self) -> None:
        """The epoch's end-of-pass validation is not step time."""
        self.t_last = time.perf_counter()

    def on_validate(self, state: TrainState, metrics: dict[str, float]) -> None:
        """Validation metrics at `state.step` (the summary's "val" is the last)."""
        self.last_val = metrics
        self.logger.validation(state.step, state.epoch, metrics)

    def on_checkpoint(self) -> None:
        """Collective: before a checkpoint or a commit, samples.jsonl catches up."""
        self.flush_samples()

    def flush_samples(self) -> None:
        """Collective: the sample ids of the steps since the last flush, from every rank, into
        samples.jsonl (one allgather per log_every steps, and before every checkpoint, commit
        and the end). All ranks have the same steps pending, so all of them gather or none."""
        if self.sample_log is None or not self.pending_ids:
            return
        pending, self.pending_ids = self.pending_ids, []
        gathered = self.backend.gather_object([ids for _, _, ids in pending])
        for i, (step, epoch, _) in enumerate(pending):
            self.sample_log.step(step, epoch, [rank_ids[i] for rank_ids in gathered])

    def finish(self, status: str, state: TrainState, recovery: Recovery,
               steps_per_epoch: int) -> None:
        """Collective: summary.json; the data-wait share is averaged over all ranks."""
        totals, losses, backend = self.totals, self.recent_losses, self.backend
        self.flush_samples()
        stats = self.pipe.stats()
        waits = backend.allreduce_sum({
            "wait": totals.data_wait_s, "step": totals.step_s,
            **{k: float(stats.get(k, 0)) for k in STORAGE_COUNTS}})
        summary = {
            "status": status, "framework": self.cfg.framework, "world_size": backend.dist.size,
            "step": state.step, "epoch": state.epoch,
            "epochs_done": round(state.step / steps_per_epoch, 3),
            "final_loss": sum(losses) / len(losses) if losses else None,
            "val": self.last_val,
            "train_seconds": totals.step_s, "samples_per_s": totals.samples_per_s,
            "first_step_s": self.first_step_s,  # the warm-up: tracing, torch.compile
            "cpu_threads": backend.cpu_threads,  # per rank (null: the framework's own)
            "data_wait_share": waits["wait"] / waits["step"] if waits["step"] else 0.0,
            "checkpoint": str(state.last_checkpoint) if state.last_checkpoint else None,
            "recovery": asdict(recovery), "recovery_text": recovery.describe(),
            "pipeline": stats,  # rank 0's
            # storage faults every rank's reads waited out (pipeline/README.md)
            "storage": {k.removeprefix("storage_"): waits[k] for k in STORAGE_COUNTS},
            "communication": backend.comm_stats(),  # allreduce bytes per sample, ...
            "throughput": (self.accounting.summary(totals.samples_per_s)
                           if self.accounting is not None else None),
        }
        if self.mixture_samples is not None:
            shares = self.mixture_shares()
            mixture = self.pipe.mixture
            weights = mixture.per_epoch / mixture.epoch_samples
            summary["mixture"] = {name: {"weight": float(w), "share": shares[f"share/{name}"]}
                                  for name, w in zip(self.pipe.source_names, weights, strict=True)}
        self.logger.summary(summary)

    def close(self) -> None:
        """The profiler's window and the logs, closed (idempotent)."""
        if self.profiler is not None:
            self.profiler.close()
        self._close_logs()

    # -- parts --------------------------------------------------------------------------------
    def _count_samples(self, micro: list[Any]) -> list:
        """The step's sample ids for the sample log (a mixture's as [source, id]); a mixture's
        samples are counted per source."""
        mixture = self.mixture_samples is not None
        ids = valid_sample_ids(micro) if self.sample_log is not None or mixture else []
        if mixture:
            sources, local = self.pipe.source_of(ids)
            self.mixture_samples += np.bincount(sources, minlength=len(self.mixture_samples))
            if self.sample_log is not None:
                ids = np.stack([sources, local], axis=1).tolist()
        return ids

    def mixture_shares(self) -> dict[str, float]:
        """Collective: each mixture source's share of the samples trained on so far in this
        run, all ranks together, as {"share/{source}": share}."""
        assert self.mixture_samples is not None
        names = self.pipe.source_names
        total = self.backend.allreduce_sum(dict(zip(names, self.mixture_samples.tolist(),
                                                    strict=True)))
        count = sum(total.values())
        return {f"share/{name}": (n / count if count else 0.0) for name, n in total.items()}

    def _open_profiler(self) -> None:
        """train.profile: this rank's window (None when off), its named ranges handed to the
        backend's step."""
        section, dist = self.cfg.train.profile, self.backend.dist
        if section is None or self.profiler is not None:
            return
        self.profiler = StepProfiler(self.cfg.framework, section, dist.rank, dist.size,
                                     Path(self.cfg.output.dir), say_any)
        if self.profiler.traced:
            self.backend.span = self.profiler.span

    def _close_logs(self) -> None:
        for log in (self.logger, self.sample_log):
            if log is not None:
                log.close()
        self.logger = self.sample_log = None


def say_any(message: str) -> None:
    """Print on any rank."""
    print(message, flush=True)


def step_extras(result: StepResult) -> dict[str, float]:
    """The step's gradient norm, fp16 loss scale and skipped flag, where the step has them."""
    extras = {}
    if result.grad_norm is not None:
        extras["grad_norm"] = result.grad_norm
    if result.loss_scale is not None:
        extras["loss_scale"] = result.loss_scale
        extras["skipped"] = float(not result.applied)
    return extras


def valid_sample_ids(micro_batches: list[dict[str, Any]]) -> list[int]:
    """The global ids (__index__) of the real samples of a step's micro-batches."""
    ids: list[int] = []
    for batch in micro_batches:
        index = np.asarray(batch["__index__"])
        ids.extend(index[np.asarray(batch["__valid__"], dtype=bool)].tolist())
    return ids


def count_throughput(backend: Backend, spec: DataSpec, pipe: Any,
                     peak_tflops: float | None) -> Accounting:
    """The model's FLOPs per sample (at the real batch shape, outside the timed steps), the
    device's peak, tokens per sample. A failed count is reported as unknown, never raised."""
    name, dtype = backend.accounting_device()
    try:
        flops = backend.count_flops(pipe.example_batch())
    except Exception as e:  # noqa: BLE001 - a report never stops a run
        flops = FlopCount(None, f"unknown: counting failed ({type(e).__name__}: {e})")
    return Accounting(flops, resolve_peak(name, dtype, peak_tflops),
                      devices=backend.dist.size,
                      tokens_per_sample=spec.input_shape[0] if spec.task == LM else None)

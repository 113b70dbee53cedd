"""What a run reports, as hooks the loop (train/loop.py) calls; the loop itself only trains.

    open()           at every start (and again after an elastic reset): rank 0's config.yaml,
                     metrics.jsonl (and TensorBoard), samples.jsonl, each rewound to the step;
                     the FLOP/peak accounting (rank 0, once) and the profiler (once)
    start_timing()   training starts: the first step of a stretch is the warm-up, not timed
    on_step()        after every optimizer step: the step's time, loss, lr, data wait, the
                     sample ids and mixture counts; a log line every train.log_every steps,
                     with every rank's figures (ranks.py: one small allreduce) and the
                     straggler named
    on_step_end()    after the step's validation and checkpoint: the profiler's window moves
                     on and the clock restarts (validation and checkpoints are not step time)
    on_validate()    validation metrics
    on_checkpoint()  before a checkpoint or an elastic commit: samples.jsonl is flushed, so
                     it covers every step the checkpoint or commit holds
    finish()         summary.json (collective: the data-wait share is averaged over ranks;
                     each rank's percentiles gathered in one allreduce, train/observe/ranks.py)

Rules: rank 0 writes every file; every method is called on every rank in the same order, and
those marked collective talk to all ranks (the sample log's allgather every log_every steps,
the mixture shares' allreduce on log steps). Rank 0's trackers (output.loggers: TensorBoard,
MLflow, W&B; train/observe/trackers.py) are opened at the first open() and closed by close().
"""

from __future__ import annotations

import contextlib
import time
from collections import deque
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from ringfeed.fsutil import atomic_write_text
from ringfeed.train.backends.base import Backend, StepResult
from ringfeed.train.config import RunConfig
from ringfeed.train.data import LM, DataSpec
from ringfeed.train.observe.metrics import RunLogger, SampleLog, Throughput
from ringfeed.train.observe.profiler import StepProfiler
from ringfeed.train.observe.ranks import RankFigures
from ringfeed.train.observe.runfiles import CONFIG_FILE, output_dir_error
from ringfeed.train.observe.throughput import Accounting, FlopCount, resolve_peak
from ringfeed.train.observe.trackers import ScalarSink, close_sinks, open_sinks
from ringfeed.train.runstate import Recovery, TrainState

if TYPE_CHECKING:
    from ringfeed.train.checkpoint.checkpointer import Saved

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
    mixture: MixtureShares | None  # a mixture's samples per source and their shares
    totals: Throughput
    recent_losses: deque[float]
    last_val: dict[str, float]
    first_step: int  # the step this stretch of training started at (its first is not timed)
    first_step_s: float | None  # how long that first step took: the warm-up
    t_last: float  # when the previous step ended
    accounting: Accounting | None  # FLOPs per sample, peak (rank 0, once)
    ranks: RankFigures  # every rank's step, data-wait and own-work times; the straggler
    profiler: StepProfiler | None  # train.profile's window; None when off
    checkpoint_costs: list[tuple[float, float]]  # (blocked s, write s) of each checkpoint

    def __init__(self, cfg: RunConfig, backend: Backend):
        self.cfg, self.backend = cfg, backend
        self.pipe, self.total_steps, self.global_batch = None, 0, 0
        self.logger = self.sample_log = None
        self.pending_ids = []
        self.mixture = None
        self.totals = Throughput()
        self.recent_losses = deque(maxlen=cfg.train.log_every)
        self.last_val = {}
        self.first_step, self.first_step_s = 0, None
        self.t_last = time.perf_counter()
        self.accounting = self.profiler = None
        self.sinks: list[ScalarSink] | None = None  # rank 0's trackers, open for the whole run
        self.checkpoint_costs = []
        self.ranks = RankFigures(cfg.train.straggler_margin, backend, self.info)

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
        if pipe.mixture is not None and self.mixture is None:
            self.mixture = MixtureShares(pipe.source_names, self.backend)
        if dist.is_root:
            try:
                out.mkdir(parents=True, exist_ok=True)
                atomic_write_text(out / CONFIG_FILE, cfg.to_yaml())
            except OSError as e:
                raise output_dir_error(out, e) from None
        if dist.is_root and self.accounting is None:
            self.accounting = count_throughput(self.backend, spec, pipe, cfg.train.peak_tflops)
        if dist.is_root and self.sinks is None:
            # a resumed run continues the tracker runs in output.dir/trackers.json
            self.sinks = open_sinks(cfg.output.loggers, out,
                                    resume=step > 0 or cfg.checkpoint.resume != "none",
                                    config=cfg.model_dump(mode="json"))
        self.logger = RunLogger(out, dist.is_root, total_steps, global_batch,
                                cfg.train.log_every, sinks=self.sinks or (),
                                start_step=step, accounting=self.accounting).open()
        self._open_profiler()
        self.pending_ids = []
        if cfg.output.sample_log:
            self.sample_log = SampleLog(out, dist.is_root, start_step=step).open()

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
                waited: float, collective_s: float = 0.0) -> None:
        """After optimizer step `state.step`, which spent `collective_s` in its collective
        (ranks.py) (collective on log steps: the per-rank figures, mixture shares, and the
        sample log's allgather)."""
        step, now = state.step, time.perf_counter()
        if step > self.first_step + 1:  # the first step traces/compiles: not timed
            self.totals.add(self.global_batch, now - self.t_last, waited)
            self.ranks.times.add(now - self.t_last, waited, collective_s)
        else:  # its cost is reported instead: the warm-up (tf.function tracing, compiling)
            self.first_step_s = now - self.t_last
        self.recent_losses.append(result.loss)
        ids = self._count_samples(micro)
        log_step = step % self.cfg.train.log_every == 0
        shares = (self.mixture.shares() if self.mixture is not None and (
            log_step or step == self.total_steps) else {})  # (collective: steps every rank logs)
        ranks = (self.ranks.window(step, self._storage_wait_s())
                 if log_step or step == self.total_steps else {})
        # grad norm / loss scale are read (a device sync) only when a log line is written
        self.logger.train_step(step, state.epoch, result.loss, lr, now - self.t_last, waited,
                               lambda: {**step_extras(result), **shares,
                                        **self._storage_waits(), **ranks})
        if self.sample_log is not None:
            self.pending_ids.append((step, state.epoch, ids))
            if log_step:
                self.flush_samples()

    def _storage_waits(self) -> dict[str, float]:
        """This rank's storage retries so far, in a log record once there were any."""
        stats = self.pipe.stats()
        return ({k: float(stats[k]) for k in STORAGE_COUNTS} if stats.get("storage_retries")
                else {})

    def _storage_wait_s(self) -> float:
        """This rank's pipeline's seconds waiting out storage faults so far."""
        return float(self.pipe.stats().get("storage_wait_s", 0.0))

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

    def on_checkpoint_saved(self, saved: Saved) -> None:
        """A checkpoint write the ranks agreed on (train/checkpoint/checkpointer.py): what it
        cost, as an event in metrics.jsonl and in summary.json's totals."""
        self.checkpoint_costs.append((saved.blocked_s, saved.write_s))
        if self.logger is not None:
            self.logger.event(saved.step, {
                "event": "checkpoint", "path": saved.location, "reason": saved.reason,
                "blocked_s": round(saved.blocked_s, 4), "write_s": round(saved.write_s, 4),
                **({"error": saved.error} if saved.error else {})})

    def checkpoint_summary(self) -> dict[str, Any]:
        """summary.json's checkpoint costs: seconds training was blocked and seconds the
        writes took, total and largest, over this run's checkpoints."""
        blocked = [b for b, _ in self.checkpoint_costs]
        written = [w for _, w in self.checkpoint_costs]
        return {"checkpoints_written": len(self.checkpoint_costs),
                "checkpoint_blocked_s": {"total": sum(blocked), "max": max(blocked, default=0.0)},
                "checkpoint_write_s": {"total": sum(written), "max": max(written, default=0.0)}}

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
        ranks = self.ranks.summary(self._storage_wait_s())
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
            **self.checkpoint_summary(),  # what checkpoints cost: blocked and write seconds
            "pipeline": stats,  # rank 0's
            # storage faults every rank's reads waited out (pipeline/README.md)
            "storage": {k.removeprefix("storage_"): waits[k] for k in STORAGE_COUNTS},
            "communication": backend.comm_stats(),  # allreduce bytes per sample, ...
            "ranks": ranks,  # per rank: step time, data wait, own work percentiles; straggler
            "throughput": (self.accounting.summary(totals.samples_per_s)
                           if self.accounting is not None else None),
        }
        if self.mixture is not None:
            summary["mixture"] = self.mixture.summary(self.pipe.mixture)
        self.logger.summary(summary)

    def close(self) -> None:
        """The profiler's window, the logs and the trackers, closed (idempotent)."""
        if self.profiler is not None:
            self.profiler.close()
        self._close_logs()
        sinks, self.sinks = self.sinks, None
        if sinks:
            close_sinks(sinks)

    # -- parts --------------------------------------------------------------------------------
    def _count_samples(self, micro: list[Any]) -> list:
        """The step's sample ids for the sample log (a mixture's as [source, id]); a mixture's
        samples are counted per source."""
        mixture = self.mixture is not None
        ids = valid_sample_ids(micro) if self.sample_log is not None or mixture else []
        if mixture:
            pairs = self.mixture.count(self.pipe, ids)
            if self.sample_log is not None:
                ids = pairs
        return ids

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


class MixtureShares:
    """A mixture's samples trained on per source in this run, this rank's (its own state), and
    each source's share of them over all ranks."""

    def __init__(self, names: list[str], backend: Backend):
        self.names, self.backend = names, backend
        self.samples = np.zeros(len(names), dtype=np.int64)

    def count(self, pipe: Any, ids: list[int]) -> list[list[int]]:
        """Count a step's global sample `ids` per source: the same ids as [source, id] pairs."""
        sources, local = pipe.source_of(ids)
        self.samples += np.bincount(sources, minlength=len(self.samples))
        return np.stack([sources, local], axis=1).tolist()

    def shares(self) -> dict[str, float]:
        """Collective: each source's share of the samples trained on so far in this run, all
        ranks together, as {"share/{source}": share}."""
        total = self.backend.allreduce_sum(dict(zip(self.names, self.samples.tolist(),
                                                    strict=True)))
        count = sum(total.values())
        return {f"share/{name}": (n / count if count else 0.0) for name, n in total.items()}

    def summary(self, mixture: Any) -> dict[str, dict[str, float]]:
        """Collective: summary.json's "mixture": each source's weight and share."""
        shares = self.shares()
        weights = mixture.per_epoch / mixture.epoch_samples
        return {name: {"weight": float(w), "share": shares[f"share/{name}"]}
                for name, w in zip(self.names, weights, strict=True)}


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

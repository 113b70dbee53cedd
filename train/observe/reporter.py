"""What a run reports, as hooks the loop (train/loop.py) calls; the loop itself only trains.

    open()           at every start (and again after an elastic reset): rank 0's config.yaml,
                     metrics.jsonl (and TensorBoard), samples.jsonl, each rewound to the step;
                     the FLOP/peak accounting (rank 0, once)
    start_timing()   training starts: the first step of a stretch is the warm-up, not timed
    on_step()        after every optimizer step, this rank's own: the step's time, loss, data
                     wait and time in its collective, the sample ids and mixture counts
    gather_rank_figures()  collective, on log steps (log_due(): every train.log_every steps
                     and the last): every rank's figures and the straggler (ranks.py), the
                     mixture's shares, the sample ids since the last gather (samples.jsonl)
    log_step()       the step's record (a log line on log steps, with those figures)
    restart_clock()  after the step's validation and checkpoint, and an epoch's validation
                     (neither is step time)
    on_validate()    validation metrics
    flush_samples()  collective: before a checkpoint or an elastic commit, samples.jsonl
                     catches up, so it covers every step the checkpoint or commit holds
    finish()         summary.json (collective: the data-wait share is averaged over ranks;
                     each rank's percentiles gathered in one allreduce, train/observe/ranks.py)

Rules: rank 0 writes every file; every method is called on every rank in the same order, and
those marked collective talk to all ranks: the loop calls each of them by name. Rank 0's
trackers (output.loggers: TensorBoard, MLflow, W&B; train/observe/trackers.py) are opened at the
first open() and closed by close().
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import asdict, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from ringfeed.fsutil import atomic_write_text
from ringfeed.train.backends.base import Backend, StepResult
from ringfeed.train.config import OutputSection, TrainSection
from ringfeed.train.data import LM, DataSpec, SyntheticPipeline, TrainPipeline
from ringfeed.train.observe.metrics import RunLogger, SampleLog, Throughput
from ringfeed.train.observe.ranks import RankFigures, RankTimes
from ringfeed.train.observe.runfiles import CONFIG_FILE, output_dir_error
from ringfeed.train.observe.throughput import Accounting, FlopCount, resolve_peak
from ringfeed.train.observe.trackers import ScalarSink, close_sinks, open_sinks
from ringfeed.train.runstate import Recovery, TrainState

if TYPE_CHECKING:
    from ringfeed.train.checkpoint.checkpointer import Saved

STORAGE_COUNTS = ("storage_retries", "storage_throttles", "storage_wait_s")


class Reporter:
    """The run's logs, summary, sample log, mixture shares and throughput."""

    output: OutputSection  # dir, loggers, sample_log
    train: TrainSection  # its log_every, straggler_margin, peak_tflops
    backend: Backend
    # the current start's train pipeline (a new one after an elastic reset) and step counts
    pipe: TrainPipeline | None
    total_steps: int
    global_batch: int
    logger: RunLogger | None
    samples: SampleIds | None  # samples.jsonl: the sample ids not yet gathered
    mixture: MixtureShares | None  # a mixture's samples per source and their shares
    totals: Throughput
    recent_losses: deque[float]
    last_val: dict[str, float]
    first_step: int  # the step this stretch of training started at (its first is not timed)
    first_step_s: float | None  # how long that first step took: the warm-up
    t_last: float  # when the previous step ended
    step_s: float  # the last step's time (data wait included)
    accounting: Accounting | None  # FLOPs per sample, peak (rank 0, once)
    ranks: RankFigures  # every rank's step, data-wait and own-work times; the straggler
    checkpoint_costs: list[tuple[float, float]]  # (blocked s, write s) of each checkpoint

    def __init__(self, output: OutputSection, train: TrainSection, backend: Backend, *,
                 framework: str, config: dict[str, Any], config_yaml: str, resuming: bool):
        """`framework`, `config` (the resolved config as plain values, for the trackers) and
        `config_yaml` (config.yaml) say what the run is; `resuming`: checkpoint.resume asks
        for a checkpoint (the trackers continue their runs)."""
        self.output, self.train, self.backend = output, train, backend
        self.framework, self.config, self.config_yaml = framework, config, config_yaml
        self.resuming = resuming
        self.pipe, self.total_steps, self.global_batch = None, 0, 0
        self.logger = self.samples = None
        self.redone_before: int | None = None  # steps earlier attempts redid (first open)
        self.mixture = None
        self.totals = Throughput()
        self.recent_losses = deque(maxlen=train.log_every)
        self.last_val = {}
        self.first_step, self.first_step_s, self.step_s = 0, None, 0.0
        self.t_last = time.perf_counter()
        self.accounting = None
        self.sinks: list[ScalarSink] | None = None  # rank 0's trackers, open for the whole run
        self.checkpoint_costs = []
        self.ranks = RankFigures(train.straggler_margin, backend, self.info)

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
             pipe: TrainPipeline) -> None:
        """Rank 0's config.yaml, metrics and sample logs rewound to `step`; the accounting the
        first time."""
        dist, out = self.backend.dist, Path(self.output.dir)
        self._close_logs()
        self.pipe, self.total_steps, self.global_batch = pipe, total_steps, global_batch
        if pipe.mixture is not None and self.mixture is None:
            self.mixture = MixtureShares(pipe.source_names, self.backend)
        if dist.is_root:
            try:
                out.mkdir(parents=True, exist_ok=True)
                atomic_write_text(out / CONFIG_FILE, self.config_yaml)
            except OSError as e:
                raise output_dir_error(out, e) from None
        if dist.is_root and self.accounting is None:
            self.accounting = count_throughput(self.backend, spec, pipe, self.train.peak_tflops)
        if dist.is_root and self.sinks is None:
            # a resumed run continues the tracker runs in output.dir/trackers.json
            self.sinks = open_sinks(self.output.loggers, out, resume=step > 0 or self.resuming,
                                    config=self.config)
        self.logger = RunLogger(out, dist.is_root, total_steps, global_batch,
                                self.train.log_every, sinks=self.sinks or (),
                                start_step=step, accounting=self.accounting).open()
        if self.redone_before is None:  # the first open: a resume (later: elastic resets)
            self.redone_before = self.logger.rewound.total
        if self.output.sample_log:
            self.samples = SampleIds(SampleLog(out, dist.is_root, start_step=step).open(),
                                     self.backend)

    def start_timing(self, step: int) -> None:
        """Training starts (again) after `step`: its next step is the untimed warm-up."""
        self.first_step = step
        self.t_last = time.perf_counter()

    def on_step(self, state: TrainState, result: StepResult, micro: list[Any],
                waited: float) -> None:
        """After optimizer step `state.step`, this rank's own figures (no collective): its
        time, the `waited` for data and the time in its collective (result.collective_s),
        its loss, its sample ids and mixture counts."""
        step, now = state.step, time.perf_counter()
        self.step_s = now - self.t_last
        if step > self.first_step + 1:  # the first step traces/compiles: not timed
            self.totals.add(self.global_batch, self.step_s, waited)
            self.ranks.times.add(self.step_s, waited, result.collective_s)
        else:  # its cost is reported instead: the warm-up (tf.function tracing, compiling)
            self.first_step_s = self.step_s
        self.recent_losses.append(result.loss)
        ids = self._count_samples(micro)
        if self.samples is not None:
            self.samples.add(step, state.epoch, ids)

    def log_due(self, step: int) -> bool:
        """Whether step `step` writes a log record (every train.log_every steps, and the
        last), so every rank gathers the figures of its window (the same on every rank)."""
        return step % self.train.log_every == 0 or step == self.total_steps

    def gather_rank_figures(self, step: int) -> dict[str, Any]:
        """Collective, on every rank at the steps log_due() names: every rank's figures of the
        window (one small allreduce; the straggler named in the log), a mixture's shares (one
        allreduce), and the sample ids since the last gather into samples.jsonl (one
        allgather). The figures for log_step()."""
        shares = self.mixture.shares() if self.mixture is not None else {}
        figures = {**shares, **self.ranks.window(step, self._storage_wait_s())}
        self.flush_samples()
        return figures

    def log_step(self, state: TrainState, result: StepResult, lr: float, waited: float,
                 figures: dict[str, Any]) -> None:
        """Step `state.step`'s record: added to the window, written on log steps with the
        gathered `figures`."""
        # grad norm / loss scale are read (a device sync) only when a log line is written
        self.logger.train_step(state.step, state.epoch, result.loss, lr, self.step_s, waited,
                               lambda: {**step_extras(result), **self._storage_waits(),
                                        **figures}, means=result.metrics)

    def _storage_waits(self) -> dict[str, float]:
        """This rank's storage retries so far, in a log record once there were any."""
        stats = self.pipe.stats()
        return ({k: float(stats[k]) for k in STORAGE_COUNTS} if stats.get("storage_retries")
                else {})

    def _storage_wait_s(self) -> float:
        """This rank's pipeline's seconds waiting out storage faults so far."""
        return float(self.pipe.stats().get("storage_wait_s", 0.0))

    def restart_clock(self) -> None:
        """What comes next is step time again: after a step's validation, checkpoint and
        commit, and after an epoch's end-of-pass validation (neither is step time)."""
        self.t_last = time.perf_counter()

    def on_skipped_step(self, step: int, samples: int) -> None:
        """data.skip_steps: step `step`'s `samples` (all ranks) were read, not trained on."""
        self.event(step, {"event": "skipped_step", "samples": samples})
        self.say(f"step {step}: skipped (data.skip_steps), {samples} samples not trained on")

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

    def flush_samples(self) -> None:
        """Collective (when output.sample_log is on): the sample ids of the steps since the
        last flush, from every rank, into samples.jsonl."""
        if self.samples is not None:
            self.samples.flush()

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
        recovery = replace(recovery,
                           steps_redone=recovery.steps_redone + (self.redone_before or 0))
        summary = {
            "status": status, "framework": self.framework, "world_size": backend.dist.size,
            "step": state.step, "epoch": state.epoch,
            "epochs_done": round(state.step / steps_per_epoch, 3),
            "final_loss": sum(losses) / len(losses) if losses else None,
            "train": self.logger.train_metrics,  # the last log window's accuracy, top5
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
        write_summary(self.logger, summary, synthetic_rate(self.pipe, self.ranks.times))

    def close(self) -> None:
        """The logs and the trackers, closed (idempotent)."""
        self._close_logs()
        sinks, self.sinks = self.sinks, None
        if sinks:
            close_sinks(sinks)

    # -- parts --------------------------------------------------------------------------------
    def _count_samples(self, micro: list[Any]) -> list:
        """The step's sample ids for the sample log (a mixture's as [source, id]); a mixture's
        samples are counted per source."""
        mixture = self.mixture is not None
        ids = valid_sample_ids(micro) if self.samples is not None or mixture else []
        if mixture:
            pairs = self.mixture.count(self.pipe, ids)
            if self.samples is not None:
                ids = pairs
        return ids

    def _close_logs(self) -> None:
        if self.logger is not None:
            self.logger.close()
        if self.samples is not None:
            self.samples.close()
        self.logger = self.samples = None


class SampleIds:
    """samples.jsonl's part of the run: the sample ids of this rank's steps since the last
    gather, and the collective that puts every rank's into the file (rank 0 writes)."""

    def __init__(self, log: SampleLog, backend: Backend):
        self.log, self.backend = log, backend
        self.pending: list[tuple[int, int, list]] = []  # (step, epoch, ids)

    def add(self, step: int, epoch: int, ids: list) -> None:
        self.pending.append((step, epoch, ids))

    def flush(self) -> None:
        """Collective: every rank's pending ids into samples.jsonl, one allgather. All ranks
        have the same steps pending, so all of them gather or none."""
        if not self.pending:
            return
        pending, self.pending = self.pending, []
        gathered = self.backend.gather_object([ids for _, _, ids in pending])
        for i, (step, epoch, _) in enumerate(pending):
            self.log.step(step, epoch, [rank_ids[i] for rank_ids in gathered])

    def close(self) -> None:
        self.log.close()


class MixtureShares:
    """A mixture's samples trained on per source in this run, this rank's (its own state), and
    each source's share of them over all ranks."""

    def __init__(self, names: list[str], backend: Backend):
        self.names, self.backend = names, backend
        self.samples = np.zeros(len(names), dtype=np.int64)

    def count(self, pipe: TrainPipeline, ids: list[int]) -> list[list[int]]:
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


def count_throughput(backend: Backend, spec: DataSpec, pipe: TrainPipeline,
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


# the synthetic benchmark's interval: mean +- 1.96 x std, a normal 95% interval
Z95 = 1.96


def synthetic_rate(pipe: TrainPipeline, times: RankTimes) -> dict[str, float] | None:
    """data.synthetic: this rank's samples/s at each timed step (the first, the warm-up, is
    not timed), as pytorch_synthetic_benchmark.py's "Img/sec per GPU: mean +-1.96*std" (its
    figure is per 10-batch iteration, this one per step, so its interval is wider); None for
    a run from shards or before 2 timed steps."""
    steps = np.frombuffer(times.runs["step_s"], dtype=np.float64) if times.runs["step_s"] \
        else np.zeros(0)
    if not isinstance(pipe, SyntheticPipeline) or len(steps) < 2:
        return None
    rates = pipe.samples_per_step / steps
    return {"samples_per_s_per_rank": float(rates.mean()),
            "ci95_per_rank": float(Z95 * rates.std()), "timed_steps": len(rates)}


def write_summary(logger: RunLogger, summary: dict[str, Any],
                  synthetic: dict[str, float] | None) -> None:
    """summary.json and the console's summary; a synthetic run's rate in both (all ranks':
    the world size times rank 0's, as the benchmark's "Total img/sec")."""
    if synthetic is not None:
        summary["synthetic"] = synthetic
    logger.summary(summary)
    if synthetic is not None:
        size = summary["world_size"]
        logger.info(f"  synthetic          {synthetic['samples_per_s_per_rank']:.1f} "
                    f"+-{synthetic['ci95_per_rank']:.1f} samples/s per rank (95%, "
                    f"{synthetic['timed_steps']} timed steps); on {size} rank(s): "
                    f"{size * synthetic['samples_per_s_per_rank']:.1f} "
                    f"+-{size * synthetic['ci95_per_rank']:.1f}")

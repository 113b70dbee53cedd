"""The training loop both frameworks share. Read it top to bottom:

    run()      prepare() -> start() -> train() -> wrap_up()
    prepare()  pipelines for this rank, the data spec, the model (nothing collective yet)
    start()    resume from the newest checkpoint (rank 0 reads, all ranks take its state),
               count_steps(): the steps left and the lr schedule, open the logs
    train()    epoch() until the counted steps are done
    epoch()    for every group of k micro-batches (data wait timed): step();
               validate at the end of the epoch
    step()     backend.train_step: forward + backward on each micro-batch, one gradient
               allreduce, the optimizer step; then stop on a non-finite loss, log, validate,
               checkpoint every N steps or on request, and the elastic commit
    wrap_up()  the last validation and checkpoint, summary.json, a barrier

`TrainState.step` (optimizer steps) is the only progress counter: the schedule, logging,
validation and checkpoints are functions of it; the pipeline's own state (epoch, batches
consumed) travels in every checkpoint so a resumed run sees exactly the batches it would have.
Elastic runs (train/elastic.py) wrap train() and wrap_up() in Horovod Elastic's retry loop and
commit every N steps: a strategy the loop calls, not a subclass, which changes the trainer only
through its methods (progress() to commit, rejoin() after a reset, count_elastic_reset()).
"""

from __future__ import annotations

import os
import time
from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np

from ringfeed.errors import UserError
from ringfeed.fsutil import atomic_write_text
from ringfeed.train import faults
from ringfeed.train.backend import Backend, Dist, StepResult
from ringfeed.train.checkpoint import (
    CheckpointWriteError,
    checkpoint_path,
    find_resume_point,
    list_checkpoints,
    probe_writable,
    remove_stale_temporaries,
    write_checkpoint,
)
from ringfeed.train.config import RunConfig
from ringfeed.train.data import LM, DataSpec, infer_spec, make_pipeline
from ringfeed.train.elastic import ElasticRun
from ringfeed.train.frameworks import make_backend
from ringfeed.train.metrics import RunLogger, SampleLog, Throughput
from ringfeed.train.profile import StepProfiler, want_dynamic_timeline
from ringfeed.train.runstate import EXIT_PREEMPTED, Recovery, SignalRequests, TrainState
from ringfeed.train.schedule import LRSchedule, make_schedule
from ringfeed.train.supervise import RESTART_ENV
from ringfeed.train.throughput import Accounting, FlopCount, resolve_peak


class TrainingDiverged(UserError):
    """The loss became NaN/inf: stop before the update is applied (exit 3)."""

    exit_code = 3


def micro_batch_groups(loader: Iterable, k: int, profiler: StepProfiler | None = None
                       ) -> Iterator[tuple[list[Any], float]]:
    """Groups of k batches and the seconds spent waiting for them; a last group shorter than
    k is dropped (every rank has the same batch count, so every rank drops the same). With a
    profiler, each wait is a named range of its trace."""
    iterator = iter(loader)
    group: list[Any] = []
    waited = 0.0
    while True:
        start = time.perf_counter()
        try:
            if profiler is None:
                batch = next(iterator)
            else:
                with profiler.span("ringfeed.data_wait"):
                    batch = next(iterator)
        except StopIteration:
            return
        waited += time.perf_counter() - start
        group.append(batch)
        if len(group) == k:
            yield group, waited
            group, waited = [], 0.0


def evaluate(backend: Backend, pipe, loader) -> dict[str, float]:
    """Exact validation metrics over the whole split, all ranks together (padding masked); for
    a mixture also per source, as "{source}/{metric}"."""
    if pipe.batches_remaining != pipe.batches_per_epoch:  # a pass left unfinished
        pipe.set_epoch(pipe.epoch + 1)
    names = pipe.source_names if pipe.mixture is not None else []
    sums: dict[str, float] = {}
    for batch in loader:
        groups = (pipe.source_of(np.asarray(batch["__index__"]))[0], len(names)) if names \
            else None
        for name, value in backend.eval_batch(batch, groups).items():
            sums[name] = sums.get(name, 0.0) + value
    if not sums:
        return {}
    total = backend.allreduce_sum(sums)
    metrics: dict[str, float] = {}
    for prefix in ["", *(f"{g}/" for g in range(len(names)))]:
        count = total.get(prefix + "count")
        if not count:
            continue
        label = names[int(prefix[:-1])] + "/" if prefix else ""
        metrics.update({label + name[len(prefix):]: value / count for name, value in total.items()
                        if name.startswith(prefix) and name != prefix + "count"
                        and (prefix or "/" not in name)})
    return metrics


class Trainer:
    """One run: built from a validated config, `run()` returns the process exit code."""

    cfg: RunConfig
    backend: Backend
    dist: Dist  # this rank and the world size (rejoin() changes it in elastic runs)
    elastic: ElasticRun | None
    state: TrainState
    recovery: Recovery
    # data: set by prepare(); again after an elastic world-size change
    train_pipe: Any  # pipeline.ShardPipeline
    val_pipe: Any | None
    loader: Iterable | None  # the framework's loaders over the pipes, made when training starts
    val_loader: Iterable | None
    spec: DataSpec
    steps_per_epoch: int
    # set by count_steps() from the pipeline's position and the world size
    total_steps: int
    global_batch: int
    schedule: LRSchedule
    # reporting
    logger: RunLogger | None
    sample_log: SampleLog | None
    pending_ids: list[tuple[int, int, list]]  # sample ids of steps not yet gathered
    mixture_samples: np.ndarray | None  # a mixture's samples trained on per source, this rank
    totals: Throughput
    recent_losses: deque[float]
    last_val: dict[str, float]
    failed_save_step: int  # (checkpoint.on_error: warn) not retried at the end
    first_step: int  # the step this stretch of training started at (its first is not timed)
    first_step_s: float | None  # how long that first step took: the warm-up
    t_last: float  # when the previous step ended
    accounting: Accounting | None  # FLOPs per sample, peak (rank 0, once)
    profiler: StepProfiler | None  # train.profile's window; None when off

    def __init__(self, cfg: RunConfig, backend: Backend | None = None):
        self.cfg = cfg
        want_dynamic_timeline(cfg)  # (before hvd.init)
        self.backend = backend or make_backend(cfg)
        self.dist = self.backend.dist
        self.elastic = ElasticRun(self) if cfg.elastic.enabled else None
        self.state = TrainState()
        self.recovery = Recovery(restarts=int(os.environ.get(RESTART_ENV, "0") or 0))
        self.train_pipe = self.val_pipe = self.loader = self.val_loader = None
        self.logger = self.sample_log = None
        self.pending_ids = []
        self.mixture_samples = None
        self.totals = Throughput()
        self.recent_losses = deque(maxlen=cfg.train.log_every)
        self.last_val = {}
        self.failed_save_step = -1
        self.first_step = 0
        self.first_step_s = None
        self.t_last = time.perf_counter()
        self.accounting = self.profiler = None

    def say(self, message: str) -> None:
        if self.dist.is_root:
            print(message, flush=True)

    # -- the run ------------------------------------------------------------------------------
    def run(self) -> int:
        signals = None  # until the first step, StartupSignals (train/main.py) handle signals
        try:
            self.prepare()
            if self.elastic is not None:
                signals = SignalRequests(self.cfg.checkpoint.save_on_signal)
                stopped = self.elastic.run(signals)
            else:
                self.start()
                signals = SignalRequests(self.cfg.checkpoint.save_on_signal)
                stopped = self.train(signals)
                self.wrap_up(stopped)
        finally:
            if signals is not None:
                signals.restore()
            self.close()
        return EXIT_PREEMPTED if stopped else 0

    def prepare(self) -> None:
        """Pipelines, data spec, model: nothing collective (an elastic worker joining a running
        job must meet Horovod's sync first)."""
        self.build_pipelines()
        self.spec = infer_spec(self.cfg, self.train_pipe)
        self.backend.build(self.spec)

    def start(self, resume: bool = True, note: str = "") -> None:
        """Collective: resume from a checkpoint (unless `resume` is False: an elastic reset
        continues from its commit), count the steps left, open the logs."""
        if resume:
            self.restore()
        self.count_steps()
        self.say(self.header() + note)
        self.open_logs()

    def train(self, signals: SignalRequests) -> bool:
        """Epochs until the counted steps are done; True when a signal stopped the run."""
        if self.loader is None:
            self.loader = self.backend.loader(self.train_pipe)
            self.val_loader = self.backend.loader(self.val_pipe) if self.val_pipe else None
        self.first_step = self.state.step
        if self.profiler is not None:
            self.profiler.at(self.state.step + 1)
        self.t_last = time.perf_counter()
        while self.state.step < self.total_steps:
            if self.epoch(signals):
                return True
        return False

    def epoch(self, signals: SignalRequests) -> bool:
        """The rest of the pipeline's current epoch (or as much of it as the steps left need);
        True when a signal stopped the run."""
        state, pipe, k = self.state, self.train_pipe, self.cfg.train.accumulate
        if pipe.batches_remaining == 0:  # (also when resumed at its end)
            pipe.set_epoch(pipe.epoch + 1)
        state.epoch = pipe.epoch
        # read the next epoch ahead only if the run goes on into it
        pipe.expect_next_epoch(state.step + pipe.batches_remaining // k < self.total_steps)
        for micro, waited in micro_batch_groups(self.loader, k, self.profiler):
            if self.step(micro, waited, signals):
                return True
            if state.step >= self.total_steps:
                return False
        if self.cfg.train.val_every is None:  # the epoch's batches are exhausted
            self.validate()
        self.t_last = time.perf_counter()
        return False

    def step(self, micro: list[Any], waited: float, signals: SignalRequests) -> bool:
        """One optimizer step over k micro-batches and what follows it; True when a signal
        asked to stop."""
        cfg, state = self.cfg, self.state
        faults.before_step(state.step + 1, self.dist.rank)
        lr = self.schedule(state.step)
        if self.profiler is None:
            result = self.backend.train_step(micro, lr, signals.take())
        else:
            with self.profiler.span("ringfeed.step", step=state.step + 1):
                result = self.backend.train_step(micro, lr, signals.take())
        if not result.finite:  # every rank sees the same averaged loss: all stop here
            raise TrainingDiverged(
                f"loss is {result.loss} at step {state.step + 1} (epoch "
                f"{state.epoch}); stopped before applying that update; last "
                f"checkpoint: {state.last_checkpoint or 'none'} (try a lower "
                "optim.lr, optim.warmup_steps, train.grad_clip, or fp32/bf16)")
        state.step += 1
        self.log_step(result, micro, lr, waited)
        if cfg.train.val_every and state.step % cfg.train.val_every == 0:
            self.validate()
        every = cfg.checkpoint.every_steps
        if result.save_requested or result.stop_requested:
            self.save("signal")
        elif every and state.step % every == 0:
            self.save("every_steps")
        if self.elastic is not None:
            self.elastic.after_step()
        if self.profiler is not None:
            self.profiler.at(state.step + 1)
        self.t_last = time.perf_counter()
        return result.stop_requested

    def log_step(self, result: StepResult, micro: list[Any], lr: float, waited: float) -> None:
        state, now = self.state, time.perf_counter()
        if state.step > self.first_step + 1:  # the first step traces/compiles: not timed
            self.totals.add(self.global_batch, now - self.t_last, waited)
        else:  # its cost is reported instead: the warm-up (tf.function tracing, compiling)
            self.first_step_s = now - self.t_last
        self.recent_losses.append(result.loss)
        mixture = self.mixture_samples is not None
        ids = valid_sample_ids(micro) if self.sample_log is not None or mixture else []
        if mixture:
            sources, local = self.train_pipe.source_of(ids)
            self.mixture_samples += np.bincount(sources, minlength=len(self.mixture_samples))
            if self.sample_log is not None:  # a mixture's samples as [source, id]
                ids = np.stack([sources, local], axis=1).tolist()
        shares = (self.mixture_shares() if mixture and (
            state.step % self.cfg.train.log_every == 0 or state.step == self.total_steps)
            else {})  # (collective: on the steps every rank logs)
        # grad norm / loss scale are read (a device sync) only when a log line is written
        self.logger.train_step(state.step, state.epoch, result.loss, lr,
                               now - self.t_last, waited,
                               lambda: {**self._step_extras(result), **shares})
        if self.sample_log is not None:
            self.pending_ids.append((state.step, state.epoch, ids))
            if state.step % self.cfg.train.log_every == 0:
                self.flush_sample_log()

    def mixture_shares(self) -> dict[str, float]:
        """Collective: each mixture source's share of the samples trained on so far in this
        run, all ranks together, as {"share/{source}": share}."""
        assert self.mixture_samples is not None
        names = self.train_pipe.source_names
        total = self.backend.allreduce_sum(dict(zip(names, self.mixture_samples.tolist(),
                                                    strict=True)))
        count = sum(total.values())
        return {f"share/{name}": (n / count if count else 0.0) for name, n in total.items()}

    def _step_extras(self, result) -> dict[str, float]:
        extras = {}
        if result.grad_norm is not None:
            extras["grad_norm"] = result.grad_norm
        if result.loss_scale is not None:
            extras["loss_scale"] = result.loss_scale
            extras["skipped"] = float(not result.applied)
        return extras

    def validate(self) -> dict[str, float]:
        if self.val_pipe is None:
            return {}
        self.backend.sync_replicas()  # local SGD: score the averaged model, not each replica
        metrics = evaluate(self.backend, self.val_pipe, self.val_loader)
        self.state.last_val_step = self.state.step
        self.last_val = metrics
        self.logger.validation(self.state.step, self.state.epoch, metrics)
        return metrics

    def wrap_up(self, stopped: bool) -> None:
        """Collective: the last validation and checkpoint, the summary, and a barrier."""
        state = self.state
        if not stopped:
            if self.val_pipe is not None and state.last_val_step != state.step:
                self.validate()
            if state.saved_step != state.step and self.failed_save_step != state.step:
                self.save("end")
        self.finish("stopped by SIGTERM" if stopped else "finished")
        # Nobody leaves before rank 0 has written everything: a launcher kills the rest
        # of the job as soon as one rank exits.
        self.backend.allreduce_sum({"done": 0.0})

    # -- data and steps -----------------------------------------------------------------------
    def build_pipelines(self) -> None:
        """The train (and val) pipelines of this rank at the current world size."""
        cfg, dist = self.cfg, self.dist
        self.close_loaders()  # made for another rank/size; new ones when training starts
        self.train_pipe = make_pipeline(cfg, "train", dist.rank, dist.size)
        self.val_pipe = (make_pipeline(cfg, "val", dist.rank, dist.size)
                         if cfg.val_source else None)
        if self.train_pipe.mixture is not None and self.mixture_samples is None:
            self.mixture_samples = np.zeros(len(self.train_pipe.source_names), dtype=np.int64)
        k = cfg.train.accumulate
        self.steps_per_epoch = self.train_pipe.batches_per_epoch // k
        if self.steps_per_epoch == 0:
            raise UserError(
                f"data.train: {self.train_pipe.batches_per_epoch} batches of "
                f"{cfg.data.batch_size} per rank per epoch on {dist.size} ranks is fewer than "
                f"train.accumulate={k} (lower data.batch_size or train.accumulate)")

    def count_steps(self) -> None:
        """Steps to run and the lr schedule, from the pipeline's position and the world size:
        the steps done, what is left of this epoch, and the epochs after it."""
        cfg, k = self.cfg, self.cfg.train.accumulate
        if cfg.train.max_steps:
            self.total_steps = cfg.train.max_steps
        else:
            epochs_after = max(0, cfg.train.epochs - self.train_pipe.epoch - 1)
            self.total_steps = (self.state.step + self.train_pipe.batches_remaining // k
                                + epochs_after * self.steps_per_epoch)
        self.global_batch = self.dist.size * cfg.data.batch_size * k
        self.schedule = make_schedule(cfg.optim, self.dist.size, k, self.total_steps)

    def header(self) -> str:
        cfg, spec, k = self.cfg, self.spec, self.cfg.train.accumulate
        return (
            f"ringfeed train: {cfg.framework}, {self.dist.size} rank(s), model {cfg.model.name}, "
            f"{spec.task} on {spec.input_key} {spec.input_shape}, global batch "
            f"{self.global_batch} = {self.dist.size} x {cfg.data.batch_size} x {k} accumulated, "
            f"{self.steps_per_epoch} steps/epoch, {self.total_steps} steps, "
            f"{cfg.train.precision}, peak lr {self.schedule.peak:.3g}")

    # -- checkpoints --------------------------------------------------------------------------
    def restore(self) -> None:
        """Rank 0 checks that checkpoints can be written, finds and loads the checkpoint;
        everyone takes rank 0's state. Errors are decided on rank 0 and raised on every rank
        (a lone raise would hang the others)."""
        cfg, state = self.cfg, self.state
        found: dict[str, Any] | None = None
        if self.dist.is_root:
            try:
                self._probe_checkpoint_dir()
                if cfg.checkpoint.resume == "none" and list_checkpoints(cfg.checkpoint_dir):
                    raise UserError(
                        f"checkpoint.dir {cfg.checkpoint_dir} already holds checkpoints of an "
                        "earlier run; continue it with --resume auto, or choose another "
                        "output.dir / checkpoint.dir")
                remove_stale_temporaries(cfg.checkpoint_dir)
                hit = find_resume_point(cfg.checkpoint.resume, cfg.checkpoint_dir, self.say)
                if hit is not None:
                    if hit.meta.get("framework") != cfg.framework:
                        raise UserError(f"checkpoint {hit.path} was written by "
                                        f"{hit.meta.get('framework')}, not {cfg.framework}")
                    self.backend.read_payload(hit.path)
                    found = {"path": str(hit.path), "meta": hit.meta}
            except Exception as e:  # noqa: BLE001 - re-raised on every rank below
                found = {"error": f"{e}", "exit_code": getattr(e, "exit_code", 2)}
        found = self.backend.broadcast_object(found)
        if found is not None and "error" in found:
            raise UserError(found["error"], exit_code=found["exit_code"])
        self.backend.sync_from_root(resumed=found is not None)
        restart = (f"; restart {self.recovery.restarts} by `ringfeed run`"
                   if self.recovery.restarts else "")
        if found is None:
            self.say("starting at step 0" + (
                f" (no checkpoint to resume in {cfg.checkpoint_dir})"
                if cfg.checkpoint.resume != "none" else " (checkpoint.resume: none)") + restart)
            return
        meta = found["meta"]
        state.step, state.epoch = int(meta["step"]), int(meta["epoch"])
        state.last_checkpoint = Path(found["path"])
        state.saved_step = state.step
        self.train_pipe.load_state_dict(meta["pipeline"])
        self.say(f"resumed from {found['path']} at step {state.step} (epoch {state.epoch}, "
                 f"saved by {meta.get('world_size')} rank(s)){restart}")

    def _probe_checkpoint_dir(self) -> None:
        try:
            probe_writable(self.cfg.checkpoint_dir)
        except CheckpointWriteError as e:
            if self.cfg.checkpoint.on_error == "fail":
                raise
            self.say(f"warning: {e}; training on WITHOUT checkpoints (checkpoint.on_error: warn)")

    def save(self, reason: str) -> None:
        """Collective (RNG states are gathered from every rank); rank 0 writes and every rank
        learns whether it worked, so a failed write stops all of them together (or, under
        checkpoint.on_error: warn, none of them)."""
        cfg, state = self.cfg, self.state
        self.flush_sample_log()
        self.backend.sync_replicas()  # local SGD: a checkpoint holds the averaged model
        rng = self.backend.rng_states()
        error = None
        if self.dist.is_root:
            meta = {"framework": cfg.framework, "epoch": state.epoch,
                    "world_size": self.dist.size, "reason": reason,
                    "pipeline": self.train_pipe.state_dict(),
                    "config": cfg.model_dump(mode="json")}
            try:
                path = write_checkpoint(cfg.checkpoint_dir, state.step, meta,
                                        lambda d: self.backend.write_payload(d, rng),
                                        cfg.checkpoint.keep)
                self.logger.info(f"saved checkpoint {path} ({reason})")
            except CheckpointWriteError as e:
                error = str(e)
        error = self.backend.broadcast_object(error)
        if error is not None:
            if cfg.checkpoint.on_error == "fail":
                raise CheckpointWriteError(f"at step {state.step}: {error}")
            self.recovery.failed_checkpoints += 1
            self.failed_save_step = state.step
            self.logger.info(f"warning: checkpoint at step {state.step} NOT saved: {error}; "
                             "training on (checkpoint.on_error: warn)")
            return
        state.last_checkpoint = checkpoint_path(cfg.checkpoint_dir, state.step)
        state.saved_step = state.step

    # -- elastic resets (train/elastic.py calls these) ----------------------------------------
    def progress(self) -> dict[str, Any]:
        """The run's position as plain values, what an elastic commit holds: the TrainState
        (the checkpoint path as text) and the train pipeline's state."""
        progress = asdict(self.state)
        progress["last_checkpoint"] = (str(self.state.last_checkpoint)
                                       if self.state.last_checkpoint else None)
        progress["pipeline"] = self.train_pipe.state_dict()
        return progress

    def rejoin(self, dist: Dist, recovery: Recovery, progress: dict[str, Any] | None) -> None:
        """Go on after Horovod (re-)formed the ring: as `dist` (pipelines rebuilt if the rank
        or world size changed), with the commit's recovery counts and its progress (what
        progress() returned on rank 0; None before the first commit)."""
        before, self.dist = self.dist, dist
        if (before.rank, before.size) != (dist.rank, dist.size):
            self.build_pipelines()
        self.recovery = recovery
        if progress is not None:
            progress = dict(progress)
            self.train_pipe.load_state_dict(progress.pop("pipeline"))
            checkpoint = progress.pop("last_checkpoint")
            self.state = TrainState(**progress,
                                    last_checkpoint=Path(checkpoint) if checkpoint else None)

    def count_elastic_reset(self, lost_steps: int) -> None:
        """Count an elastic reset; the `lost_steps` trained past the last commit are redone (a
        rollback when there are any)."""
        r = self.recovery
        r.elastic_resets += 1
        r.rollbacks += int(lost_steps > 0)
        r.steps_redone += lost_steps

    # -- logs and teardown -------------------------------------------------------------------
    def open_logs(self) -> None:
        """Rank 0's metrics and sample logs, rewound to the current step."""
        cfg, out = self.cfg, Path(self.cfg.output.dir)
        self.close_logs()
        if self.dist.is_root:
            out.mkdir(parents=True, exist_ok=True)
            atomic_write_text(out / "config.yaml", cfg.to_yaml())
        if self.dist.is_root and self.accounting is None:
            self.accounting = self.count_throughput()
        self.logger = RunLogger(out, self.dist.is_root, self.total_steps, self.global_batch,
                                cfg.train.log_every, cfg.output.tensorboard,
                                start_step=self.state.step, accounting=self.accounting)
        self.open_profiler()
        self.pending_ids = []
        if cfg.output.sample_log:
            self.sample_log = SampleLog(out, self.dist.is_root, start_step=self.state.step)

    def flush_sample_log(self) -> None:
        """Collective: the sample ids of the steps since the last flush, from every rank, into
        samples.jsonl (one allgather per log_every steps, and before every checkpoint, commit
        and the end, so the file always covers the steps a checkpoint or commit holds). All
        ranks have the same steps pending, so all of them gather or none."""
        if self.sample_log is None or not self.pending_ids:
            return
        pending, self.pending_ids = self.pending_ids, []
        gathered = self.backend.gather_object([ids for _, _, ids in pending])
        for i, (step, epoch, _) in enumerate(pending):
            self.sample_log.step(step, epoch, [rank_ids[i] for rank_ids in gathered])

    def finish(self, status: str) -> None:
        """Collective: the run's data-wait share is averaged over all ranks."""
        totals, recent_losses = self.totals, self.recent_losses
        self.flush_sample_log()
        waits = self.backend.allreduce_sum({"wait": totals.data_wait_s, "step": totals.step_s})
        summary = {
            "status": status, "framework": self.cfg.framework, "world_size": self.dist.size,
            "step": self.state.step, "epoch": self.state.epoch,
            "epochs_done": round(self.state.step / self.steps_per_epoch, 3),
            "final_loss": sum(recent_losses) / len(recent_losses) if recent_losses else None,
            "val": self.last_val,
            "train_seconds": totals.step_s, "samples_per_s": totals.samples_per_s,
            "first_step_s": self.first_step_s,  # the warm-up: tracing, torch.compile
            "cpu_threads": self.backend.cpu_threads,  # per rank (null: the framework's own)
            "data_wait_share": waits["wait"] / waits["step"] if waits["step"] else 0.0,
            "checkpoint": str(self.state.last_checkpoint) if self.state.last_checkpoint else None,
            "recovery": asdict(self.recovery), "recovery_text": self.recovery.describe(),
            "pipeline": self.train_pipe.stats(),
            "communication": self.backend.comm_stats(),  # allreduce bytes per sample, ...
            "throughput": (self.accounting.summary(totals.samples_per_s)
                           if self.accounting is not None else None),
        }
        if self.mixture_samples is not None:
            pipe = self.train_pipe
            shares = self.mixture_shares()
            weights = pipe.mixture.per_epoch / pipe.mixture.epoch_samples
            summary["mixture"] = {name: {"weight": float(w), "share": shares[f"share/{name}"]}
                                  for name, w in zip(pipe.source_names, weights, strict=True)}
        self.logger.summary(summary)


    def count_throughput(self) -> Accounting:
        """Rank 0, once, before training: the model's FLOPs per sample (at the real batch
        shape, outside the timed steps), the device's peak, tokens per sample."""
        name, dtype = self.backend.accounting_device()
        spec = self.spec
        try:
            flops = self.backend.count_flops(self.train_pipe.example_batch())
        except Exception as e:  # noqa: BLE001 - a report never stops a run
            flops = FlopCount(None, f"unknown: counting failed ({type(e).__name__}: {e})")
        return Accounting(flops, resolve_peak(name, dtype, self.cfg.train.peak_tflops),
                          devices=self.dist.size,
                          tokens_per_sample=spec.input_shape[0] if spec.task == LM else None)

    def open_profiler(self) -> None:
        """train.profile: this rank's window (None when off: nothing profiler-related is
        made), its named ranges in the backend's step."""
        section = self.cfg.train.profile
        if section is None or self.profiler is not None:
            return
        self.profiler = StepProfiler(self.cfg.framework, section, self.dist.rank,
                                     self.dist.size, Path(self.cfg.output.dir), self.say_any)
        if self.profiler.traced:
            self.backend.span = self.profiler.span

    def say_any(self, message: str) -> None:
        print(message, flush=True)

    def close_loaders(self) -> None:
        """Stop loader worker processes (torch) and read-ahead threads now rather than at
        interpreter exit."""
        for closable in (self.loader, self.val_loader, self.train_pipe):
            close = getattr(closable, "close", None)  # (a TensorLoader has none)
            if close is not None:
                close()
        self.loader = self.val_loader = None

    def close_logs(self) -> None:
        for log in (self.logger, self.sample_log):
            if log is not None:
                log.close()
        self.logger = self.sample_log = None

    def close(self) -> None:
        if self.profiler is not None:
            self.profiler.close()
        self.close_loaders()
        self.close_logs()


def valid_sample_ids(micro_batches: list[dict[str, Any]]) -> list[int]:
    """The global ids (__index__) of the real samples of a step's micro-batches."""
    ids: list[int] = []
    for batch in micro_batches:
        index = np.asarray(batch["__index__"])
        ids.extend(index[np.asarray(batch["__valid__"], dtype=bool)].tolist())
    return ids


def train(cfg: RunConfig) -> int:
    return Trainer(cfg).run()

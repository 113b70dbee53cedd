"""The training loop both frameworks share. Read it top to bottom:

    run()      prepare() -> start() -> train() -> wrap_up()
    prepare()  pipelines for this rank, the data spec, the model (nothing collective yet)
    start()    resume from the newest checkpoint (Checkpointer.restore: rank 0 reads, all ranks
               take its state), count_steps(): the steps left and the lr schedule, open the logs
    train()    epoch() until the counted steps are done
    epoch()    for every group of k micro-batches (data wait timed): step();
               validate at the end of the epoch
    step()     backend.train_step: forward + backward on each micro-batch, one gradient
               allreduce, the optimizer step; then stop on a non-finite loss, report, validate,
               checkpoint every N steps or on request, and the elastic commit
    wrap_up()  the last validation and checkpoint, summary.json, a barrier

The hang watchdog (train/resilience/watchdog.py) hears where each rank is: phase() at every
move (data, step, report, validate, checkpoint, end); it runs from start() to close(), not in
elastic runs.

Components, each owning its state: the backend (model, optimizer, Horovod), the Checkpointer
(train/checkpoint/checkpointer.py: resume, save, keep), the Reporter (train/observe/reporter.py:
logs, sample log, mixture shares, throughput, profiler, summary; the loop calls its hooks). k
(train.accumulate) is decided here once and handed to the backend, which asserts it.

`TrainState.step` (optimizer steps) is the only progress counter: the schedule, logging,
validation and checkpoints are functions of it; the pipeline's own state (epoch, batches
consumed) travels in every checkpoint so a resumed run sees exactly the batches it would have.
Elastic runs (train/resilience/elastic.py) wrap train() and wrap_up() in Horovod Elastic's
retry loop and commit every N steps: a strategy the loop calls, not a subclass, which changes
the trainer only through its methods (commit_values() to commit, rejoin() and elastic_reset()
after a reset).
"""

from __future__ import annotations

import os
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict
from typing import Any

import numpy as np

from ringfeed.errors import EXIT_DIVERGED, UserError
from ringfeed.train.backends.base import Backend, Dist
from ringfeed.train.backends.select import make_backend
from ringfeed.train.checkpoint.checkpointer import Checkpointer, Saved
from ringfeed.train.config import RunConfig
from ringfeed.train.data import DataSpec, infer_spec, make_pipeline
from ringfeed.train.observe.profiler import StepProfiler
from ringfeed.train.observe.reporter import Reporter
from ringfeed.train.resilience.elastic import ElasticRun
from ringfeed.train.resilience.faults import NO_FAULTS, FaultPlan
from ringfeed.train.resilience.supervise import RESTART_ENV
from ringfeed.train.resilience.watchdog import Watchdog, limits_for
from ringfeed.train.runstate import (
    EXIT_PREEMPTED,
    Recovery,
    SignalRequests,
    StartupSignals,
    TrainState,
)
from ringfeed.train.schedule import LRSchedule, make_schedule
from ringfeed.userhooks import UserCode


class TrainingDiverged(UserError):
    """The loss became NaN/inf: stop before the update is applied (exit 3)."""

    exit_code = EXIT_DIVERGED

    @classmethod
    def at(cls, loss: float, state: TrainState) -> TrainingDiverged:
        """The error for a step after `state` whose averaged loss is `loss`."""
        return cls(f"loss is {loss} at step {state.step + 1} (epoch {state.epoch}); stopped "
                   f"before applying that update; last checkpoint: "
                   f"{state.last_checkpoint or 'none'} (try a lower optim.lr, "
                   "optim.warmup_steps, train.grad_clip, or fp32/bf16)")


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


def evaluate(backend: Backend, pipe: Any, loader: Iterable) -> dict[str, float]:
    """Collective: exact validation metrics over the whole split, all ranks together (padding
    masked); for a mixture also per source, as "{source}/{metric}". Local SGD's replicas are
    averaged first: the score is the averaged model's, not each replica's."""
    backend.sync_replicas()
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
    accumulate: int  # k: micro-batches per optimizer step, decided here, asserted by the backend
    elastic: ElasticRun | None
    checkpointer: Checkpointer  # resume, save, keep
    reporter: Reporter  # logs, sample log, summary, throughput, profiler
    watchdog: Watchdog | None  # the hang watchdog (train/resilience/watchdog.py); None when off
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

    def __init__(self, cfg: RunConfig, backend: Backend | None = None, *,
                 user_code: UserCode | None = None, faults: FaultPlan = NO_FAULTS,
                 startup: StartupSignals | None = None):
        """From the entry point (train/main.py): `user_code`, told of every step; `faults`,
        the test-only fault plan; `startup`, the signal handlers until the first step."""
        self.cfg, self.accumulate = cfg, cfg.train.accumulate
        self.user_code, self.faults, self.startup = user_code or UserCode(), faults, startup
        self.backend = backend or make_backend(cfg)
        self.dist = self.backend.dist
        self.elastic = (ElasticRun(self, self.backend, cfg.elastic.commit_every_steps)
                        if cfg.elastic.enabled else None)
        self.reporter = Reporter(cfg, self.backend)
        self.checkpointer = Checkpointer(cfg, self.backend, self.reporter.say,
                                         self.reporter.info, self.reporter.on_checkpoint_saved,
                                         faults=faults)
        self.state = TrainState()
        self.recovery = Recovery(restarts=int(os.environ.get(RESTART_ENV, "0") or 0))
        self.train_pipe = self.val_pipe = self.loader = self.val_loader = None
        limits = limits_for(cfg)
        self.watchdog = (Watchdog(self.dist.rank, self.dist.size, limits, cfg.output.dir)
                         if limits is not None else None)

    # -- the run ------------------------------------------------------------------------------
    def run(self) -> int:
        """The whole run: 0 when done, EXIT_PREEMPTED (143) when SIGTERM stopped it."""
        signals = None  # until the first step, StartupSignals (train/main.py) handle signals
        try:
            self.prepare()
            if self.elastic is not None:
                signals = SignalRequests(self.cfg.checkpoint.save_on_signal, self.startup)
                stopped = self.elastic.run(signals)
            else:
                if self.watchdog is not None:  # (collective: the hub's address)
                    self.watchdog.start(self.backend.broadcast_object)
                self.start()
                signals = SignalRequests(self.cfg.checkpoint.save_on_signal, self.startup)
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
        self.backend.build(self.spec, self.accumulate)

    def start(self, resume: bool = True, note: str = "") -> None:
        """Collective: resume from a checkpoint (unless `resume` is False: an elastic reset
        continues from its commit), count the steps left, open the logs."""
        if resume:
            self.state = (self.checkpointer.restore(self.train_pipe, self.recovery.restarts)
                          or self.state)
        self.count_steps()
        self.reporter.say(self.header() + note)
        self.reporter.open(self.state.step, self.total_steps, self.global_batch, self.spec,
                           self.train_pipe)

    def train(self, signals: SignalRequests) -> bool:
        """Epochs until the counted steps are done; True when a signal stopped the run."""
        if self.loader is None:
            self.loader = self.backend.loader(self.train_pipe)
            self.val_loader = self.backend.loader(self.val_pipe) if self.val_pipe else None
        self.reporter.start_timing(self.state.step)
        if self.watchdog is not None:
            self.watchdog.begin_training(self.state.step)
        while self.state.step < self.total_steps:
            if self.epoch(signals):
                return True
        return False

    def epoch(self, signals: SignalRequests) -> bool:
        """The rest of the pipeline's current epoch (or as much of it as the steps left need);
        True when a signal stopped the run."""
        state, pipe, k = self.state, self.train_pipe, self.accumulate
        if pipe.batches_remaining == 0:  # (also when resumed at its end)
            pipe.set_epoch(pipe.epoch + 1)
        state.epoch = pipe.epoch
        # read the next epoch ahead only if the run goes on into it
        pipe.expect_next_epoch(state.step + pipe.batches_remaining // k < self.total_steps)
        self.phase("data")
        for micro, waited in micro_batch_groups(self.loader, k, self.reporter.profiler):
            if self.step(micro, waited, signals):
                return True
            if state.step >= self.total_steps:
                return False
        if self.cfg.train.val_every is None:  # the epoch's batches are exhausted
            self.validate()
        self.reporter.on_epoch_end()
        return False

    def step(self, micro: list[Any], waited: float, signals: SignalRequests) -> bool:
        """One optimizer step over k micro-batches and what follows it; True when a signal
        asked to stop."""
        state, val_every = self.state, self.cfg.train.val_every
        if state.step + 1 in self.cfg.data.skip_steps:
            return self.skip_step(micro)
        self.phase("step")
        self.faults.before_step(state.step + 1, self.dist.rank)
        lr = self.schedule(state.step)
        started = time.perf_counter()
        with self.reporter.span("ringfeed.step", step=state.step + 1):
            result = self.backend.train_step(micro, lr, signals.take())
        # the time this rank spent in the step's collective (per-rank figures, observe/reporter.py):
        # the backend's own count where it has one, else the whole step
        collective_s = getattr(self.backend, "collective_s", None)
        if collective_s is None:
            collective_s = time.perf_counter() - started
        if not result.finite:  # every rank sees the same averaged loss: all stop here
            raise TrainingDiverged.at(result.loss, state)
        state.step += 1
        self.user_code.note_step(state.step)
        self.phase("report")
        self.reporter.on_step(state, result, micro, lr, waited, collective_s)
        if val_every and state.step % val_every == 0:
            self.validate()
        reason = self.checkpointer.due(state.step, result)
        if reason is not None:
            self.save(reason)
        if self.elastic is not None:
            self.elastic.after_step(state.step)
        self.reporter.on_step_end(state.step)
        self.phase("data")
        return result.stop_requested

    def skip_step(self, micro: list[Any]) -> bool:
        """data.skip_steps: the step's batches were read (the data position moves on, as on
        every rank) and are not trained on; the step counts, weights and optimizer stay."""
        self.state.step += 1
        samples = sum(len(m["__index__"]) for m in micro) * self.dist.size
        self.reporter.event(self.state.step, {"event": "skipped_step", "samples": samples})
        self.reporter.say(f"step {self.state.step}: skipped (data.skip_steps), {samples} "
                          "samples not trained on")
        return False

    def validate(self) -> None:
        """Collective: the validation metrics of the model as it is now."""
        if self.val_pipe is None:
            return
        self.phase("validate")
        metrics = evaluate(self.backend, self.val_pipe, self.val_loader)
        self.state.last_val_step = self.state.step
        self.reporter.on_validate(self.state, metrics)

    def save(self, reason: str) -> None:
        """Collective: a checkpoint of this step (samples.jsonl covers it); a failed write under
        checkpoint.on_error: warn is counted and training goes on."""
        self.phase("checkpoint")
        self.reporter.on_checkpoint()
        self.count_saved(self.checkpointer.save(self.state, self.train_pipe, reason))
        self.state.saved_step = self.state.step  # (written, being written, or failed: warn)

    def count_saved(self, outcomes: list[Saved]) -> None:
        """Writes the checkpointer saw finish (with checkpoint.async, a save or the end
        collects the one before): the newest complete checkpoint, and failures counted."""
        for saved in outcomes:
            if saved.location is None:
                self.recovery.failed_checkpoints += 1
            else:
                self.state.last_checkpoint = saved.location

    def wrap_up(self, stopped: bool) -> None:
        """Collective: the last validation and checkpoint, the summary, and a barrier."""
        state = self.state
        self.phase("end")
        if not stopped:
            if self.val_pipe is not None and state.last_val_step != state.step:
                self.validate()
            if self.checkpointer.due_at_end(state):
                self.save("end")
        self.count_saved(self.checkpointer.drain())  # a write in flight (checkpoint.async)
        self.reporter.finish("stopped by SIGTERM" if stopped else "finished", state,
                             self.recovery, self.steps_per_epoch)
        # Nobody leaves before rank 0 has written everything: a launcher kills the rest
        # of the job as soon as one rank exits.
        self.backend.allreduce_sum({"done": 0.0})

    def phase(self, name: str) -> None:
        """Tell the hang watchdog where this rank is (train/resilience/watchdog.py PHASES)."""
        if self.watchdog is not None:
            self.watchdog.at(self.state.step, name)

    # -- data and steps -----------------------------------------------------------------------
    def build_pipelines(self) -> None:
        """The train (and val) pipelines of this rank at the current world size."""
        self.close_loaders()  # made for another rank/size; new ones when training starts
        self.train_pipe, self.val_pipe, self.steps_per_epoch = make_pipelines(
            self.cfg, self.dist, self.accumulate)

    def count_steps(self) -> None:
        """total_steps, global_batch and the lr schedule at this position and world size."""
        self.total_steps, self.global_batch, self.schedule = plan_steps(
            self.cfg, self.train_pipe, self.state.step, self.steps_per_epoch, self.dist.size,
            self.accumulate)
        if self.cfg.train.stop_after_step is not None:  # (the schedule plans the whole run)
            self.total_steps = min(self.total_steps, self.cfg.train.stop_after_step)

    def header(self) -> str:
        """The run's first line: framework, ranks, model, data, batch, steps, precision, lr."""
        cfg, spec, k = self.cfg, self.spec, self.accumulate
        return (
            f"ringfeed train: {cfg.framework}, {self.dist.size} rank(s), model {cfg.model.name}, "
            f"{spec.task} on {spec.input_key} {spec.input_shape}, global batch "
            f"{self.global_batch} = {self.dist.size} x {cfg.data.batch_size} x {k} accumulated, "
            f"{self.steps_per_epoch} steps/epoch, {self.total_steps} steps, "
            f"{cfg.train.precision}, peak lr {self.schedule.peak:.3g}")

    @property
    def recent_losses(self) -> deque[float]:
        """The last train.log_every steps' losses (benchmarks/workers/ringfeed_loop.py)."""
        return self.reporter.recent_losses

    # -- elastic resets (train/resilience/elastic.py calls these) ----------------------------------
    def commit_values(self) -> tuple[dict[str, Any], dict[str, int]]:
        """Collective: samples.jsonl flushed up to this step, then what an elastic commit
        holds as plain values: (the TrainState with the train pipeline's state, the recovery
        counts)."""
        self.reporter.on_checkpoint()
        progress = {**self.state.as_plain(), "pipeline": self.train_pipe.state_dict()}
        return progress, self.recovery_counts()

    def recovery_counts(self) -> dict[str, int]:
        """What the run survived so far, as plain values."""
        return asdict(self.recovery)

    def position(self) -> tuple[int, int]:
        """(optimizer steps done, epoch)."""
        return self.state.step, self.state.epoch

    def rejoin(self, dist: Dist, recovery: Recovery, progress: dict[str, Any] | None) -> None:
        """Go on after Horovod (re-)formed the ring: as `dist` (pipelines rebuilt if the rank
        or world size changed), with the commit's recovery counts and its progress (what
        commit_values() gave on rank 0; None before the first commit)."""
        before, self.dist = self.dist, dist
        if (before.rank, before.size) != (dist.rank, dist.size):
            self.build_pipelines()
        self.recovery = recovery
        if progress is not None:
            progress = dict(progress)
            self.train_pipe.load_state_dict(progress.pop("pipeline"))
            self.state = TrainState.from_plain(progress)

    def elastic_reset(self, lost_steps: int, note: Callable[[Recovery], str]) -> None:
        """Collective: go on after an elastic reset; the `lost_steps` trained past the last
        commit are redone (a rollback when there are any). The header ends with
        `note(recovery)`; metrics.jsonl records the reset."""
        self.recovery.count_reset(lost_steps)
        self.start(resume=False, note=note(self.recovery))
        self.reporter.event(self.state.step, {"event": "elastic_reset", "size": self.dist.size,
                                              "steps_redone": lost_steps})

    # -- teardown -----------------------------------------------------------------------------
    def close_loaders(self) -> None:
        """Stop loader worker processes (torch) and read-ahead threads now rather than at
        interpreter exit."""
        for closable in (self.loader, self.val_loader, self.train_pipe):
            close = getattr(closable, "close", None)  # (a TensorLoader has none)
            if close is not None:
                close()
        self.loader = self.val_loader = None

    def close(self) -> None:
        """Watchdog, profiler, logs, loaders and pipelines closed (also after an error)."""
        if self.watchdog is not None:
            self.watchdog.stop()
        self.reporter.close()
        self.close_loaders()


def make_pipelines(cfg: RunConfig, dist: Dist, k: int) -> tuple[Any, Any | None, int]:
    """(train pipeline, val pipeline or None, optimizer steps per epoch) of rank `dist.rank` of
    `dist.size`, for steps of k micro-batches; UserError when an epoch holds no step."""
    train_pipe = make_pipeline(cfg, "train", dist.rank, dist.size)
    val_pipe = make_pipeline(cfg, "val", dist.rank, dist.size) if cfg.val_source else None
    steps_per_epoch = train_pipe.batches_per_epoch // k
    if steps_per_epoch == 0:
        raise UserError(
            f"data.train: {train_pipe.batches_per_epoch} batches of {cfg.data.batch_size} per "
            f"rank per epoch on {dist.size} ranks is fewer than train.accumulate={k} (lower "
            "data.batch_size or train.accumulate)")
    return train_pipe, val_pipe, steps_per_epoch


def plan_steps(cfg: RunConfig, pipe: Any, step: int, steps_per_epoch: int, world_size: int,
               k: int) -> tuple[int, int, LRSchedule]:
    """(total steps, global batch, lr schedule) from the pipeline's position and the world
    size: train.max_steps, or the steps done, what is left of this epoch and the epochs
    after it."""
    if cfg.train.max_steps:
        total = cfg.train.max_steps
    else:
        epochs_after = max(0, cfg.train.epochs - pipe.epoch - 1)
        total = step + pipe.batches_remaining // k + epochs_after * steps_per_epoch
    if cfg.data.order == "global":  # the global batch is data.global_batch_size at any size,
        # and so is the rate: optim.lr as given (no world-size scaling)
        return total, cfg.data.global_batch_size, make_schedule(cfg.optim, 1, 1, total)
    return (total, world_size * cfg.data.batch_size * k,
            make_schedule(cfg.optim, world_size, k, total))


def train(cfg: RunConfig, *, user_code: UserCode | None = None, faults: FaultPlan = NO_FAULTS,
          startup: StartupSignals | None = None) -> int:
    """`ringfeed train` on a validated config: the process exit code."""
    return Trainer(cfg, user_code=user_code, faults=faults, startup=startup).run()

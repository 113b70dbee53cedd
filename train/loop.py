"""The training loop both frameworks share. Read it top to bottom:

    run()      launch() -> prepare() -> start() -> train() -> wrap_up()
    launch()   Horovod started (the backend) and the components built on it
    prepare()  pipelines for this rank (train/feed.py), the data spec, the model (nothing
               collective yet)
    start()    resume from the newest checkpoint (Checkpointer.restore: rank 0 reads, all ranks
               take its state), feed.plan(): the steps left and the lr schedule, open the logs
    train()    epoch() until the counted steps are done
    epoch()    for every group of k micro-batches (data wait timed): step();
               validate at the end of the epoch
    step()     backend.train_step: forward + backward on each micro-batch, one gradient
               allreduce, the optimizer step; then stop on a non-finite loss, report (on log
               steps every rank's figures gathered), validate, checkpoint every N steps or on
               request, and the elastic commit
    wrap_up()  the last validation and checkpoint, summary.json, a barrier

The hang watchdog (train/resilience/watchdog.py) hears where each rank is: phase() at every
move (data, step, report, validate, checkpoint, end); it runs from start() to close(), not in
elastic runs.

Components, each owning its state and built by launch() from its own config section: the
backend (model, optimizer, Horovod), the Checkpointer (train/checkpoint/checkpointer.py: resume,
save, keep; each write's outcome comes back to record_save()), the Reporter
(train/observe/reporter.py: logs, sample log, mixture shares, throughput, summary; the loop
calls its hooks, and each of its collectives by name), the profiler (train.profile: the loop's
named ranges, handed to the backend's step as `span`). They talk through values the loop
passes: the step's StepResult (with the time this rank spent in its collectives), the
pipeline (train/data.py TrainPipeline). k (train.accumulate) is decided here once and handed
to the backend, which asserts it. Every method marked collective runs on every rank in the
same order.

`TrainState.step` (optimizer steps) is the only progress counter: the schedule, logging,
validation and checkpoints are functions of it; the pipeline's own state (epoch, batches
consumed) travels in every checkpoint so a resumed run sees exactly the batches it would have.
Elastic runs (train/resilience/elastic.py) wrap train() and wrap_up() in Horovod Elastic's
retry loop and commit every N steps: a strategy the loop calls, not a subclass, which changes
the trainer only through its methods (commit_values() to commit, rejoin() and elastic_reset()
after a reset).
"""

from __future__ import annotations

import gc
import math
import os
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict
from itertools import islice
from pathlib import Path
from typing import Any

import numpy as np

from ringfeed.errors import EXIT_DIVERGED, UserError
from ringfeed.train.backends.base import Backend, Dist
from ringfeed.train.backends.select import make_backend
from ringfeed.train.checkpoint.checkpointer import Checkpointer, Saved
from ringfeed.train.config import RunConfig
from ringfeed.train.data import LM, DataSpec, TrainPipeline
from ringfeed.train.feed import Feed
from ringfeed.train.observe.profiler import StepProfiler
from ringfeed.train.observe.reporter import Reporter, say_any
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


def evaluate(backend: Backend, pipe: TrainPipeline, loader: Iterable, steps: int | None = None,
             perplexity: bool = False) -> dict[str, float]:
    """Collective: exact validation metrics over the whole split, all ranks together (padding
    masked), or over its first `steps` batches on every rank (train.val_steps: every rank has
    at least as many batches as any other, so all read the same count); for a mixture also per
    source, as "{source}/{metric}". With `perplexity`, exp of the loss beside it. Local SGD's
    replicas are averaged first: the score is the averaged model's, not each replica's."""
    backend.sync_replicas()
    if pipe.batches_remaining != pipe.batches_per_epoch:  # a pass left unfinished
        pipe.set_epoch(pipe.epoch + 1)
    names = pipe.source_names if pipe.mixture is not None else []
    sums: dict[str, float] = {}
    for batch in loader if steps is None else islice(loader, steps):
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
        if perplexity:
            metrics[label + "perplexity"] = perplexity_of(metrics[label + "loss"])
    return metrics


def perplexity_of(loss: float) -> float:
    """exp(loss), inf past float range. For the built-in LM loss the validation loss is the
    token-weighted mean over every rank's tokens: each row's loss is the mean over its
    positions, every row of a run has as many positions, and the sums of rows and row counts
    are allreduced (evaluate), never a mean of per-rank or per-batch means, which weighs a
    short last batch like a full one."""
    return math.exp(loss) if loss < 709.0 else math.inf


def reports_perplexity(cfg: RunConfig, spec: DataSpec | None) -> bool:
    """Perplexity only where the loss is the built-in next-token cross entropy, unsmoothed."""
    t = cfg.train
    return spec is not None and spec.task == LM and t.loss is None and not t.label_smoothing


class FrozenAfterBuild:
    """The start-up's imports and model build make the frameworks' heap (~10^6 objects): the
    collector's full passes over it while it grows cost ~0.7 CPU-s a torch rank. So no pass
    until `built()`; then all of it is frozen (gc.freeze: no pass traces it, nor touches its
    pages in loader workers forked later) until the block ends, which leaves the collector as
    the caller had it, nothing frozen."""

    def __enter__(self) -> FrozenAfterBuild:
        self.collecting = gc.isenabled()
        gc.disable()
        return self

    def built(self) -> None:
        gc.freeze()
        if self.collecting:
            gc.enable()

    def __exit__(self, *exc: object) -> None:
        gc.unfreeze()
        if self.collecting:
            gc.enable()


class Trainer:
    """One run of a validated config (built without I/O); `run()` gives the exit code."""

    cfg: RunConfig
    accumulate: int  # k: micro-batches per optimizer step, decided here, asserted by the backend
    state: TrainState
    recovery: Recovery
    # set by launch(): the backend (unless given) and the components built on it
    backend: Backend
    dist: Dist  # this rank and the world size (rejoin() changes it in elastic runs)
    elastic: ElasticRun | None
    checkpointer: Checkpointer  # resume, save, keep
    reporter: Reporter  # logs, sample log, summary, throughput
    profiler: StepProfiler  # train.profile's window and its named ranges (`span`)
    watchdog: Watchdog | None  # the hang watchdog (train/resilience/watchdog.py); None when off
    feed: Feed  # this rank's pipelines and loaders, the step plan (train/feed.py)

    def __init__(self, cfg: RunConfig, backend: Backend | None = None, *,
                 user_code: UserCode | None = None, faults: FaultPlan = NO_FAULTS,
                 startup: StartupSignals | None = None):
        """`backend`: one already started (tests, benchmarks), else launch() makes it; from
        train/main.py: `user_code` (told of every step), `faults` (test-only), `startup`."""
        self.cfg, self.accumulate, self._given = cfg, cfg.train.accumulate, backend
        self.user_code, self.faults, self.startup = user_code or UserCode(), faults, startup
        self.state = TrainState()
        self.recovery = Recovery(restarts=int(os.environ.get(RESTART_ENV, "0") or 0))
        self.feed = Feed(cfg, self.accumulate)

    # -- the run ------------------------------------------------------------------------------
    def run(self) -> int:
        """The whole run: 0 when done, EXIT_PREEMPTED (143) when SIGTERM stopped it."""
        with FrozenAfterBuild() as heap:
            self.launch()
            signals = None  # until the first step, StartupSignals (train/main.py) handle signals
            try:
                self.prepare()
                heap.built()
                if self.elastic is None:  # (an elastic run starts and ends in its retry loop)
                    if self.watchdog is not None:  # (collective: the hub's address)
                        self.watchdog.start(self.backend.broadcast_object)
                    self.start()
                signals = SignalRequests(self.cfg.checkpoint.save_on_signal, self.startup)
                if self.elastic is not None:
                    stopped = self.elastic.run(signals)
                else:
                    stopped = self.train(signals)
                    self.wrap_up(stopped)
            finally:
                if signals is not None:
                    signals.restore()
                self.close()
            return EXIT_PREEMPTED if stopped else 0

    def launch(self) -> None:
        """Collective: Horovod started by the backend (hvd.init, the GPU choice's allgather)
        unless one was given, and the components built on it from their config sections."""
        cfg = self.cfg
        self.backend = backend = self._given or make_backend(cfg)
        self.dist = dist = backend.dist
        self.elastic = (ElasticRun(self, backend, cfg.elastic.commit_every_steps)
                        if cfg.elastic.enabled else None)
        self.reporter = Reporter(cfg.output, cfg.train, backend, framework=cfg.framework,
                                 config=cfg.model_dump(mode="json"), config_yaml=cfg.to_yaml(),
                                 resuming=cfg.checkpoint.resume != "none")
        self.checkpointer = Checkpointer.for_run(cfg, backend, say=self.reporter.say,
                                                 log=self.reporter.info, record=self.record_save,
                                                 faults=self.faults)
        self.profiler = StepProfiler(cfg.framework, cfg.train.profile, dist.rank, dist.size,
                                     Path(cfg.output.dir), say_any)
        self.watchdog = (Watchdog(dist.rank, dist.size, limits, cfg.output.dir)
                         if (limits := limits_for(cfg)) is not None else None)

    def prepare(self) -> None:
        """Pipelines, data spec, model: nothing collective (an elastic worker joining a running
        job must meet Horovod's sync first)."""
        self.feed.build(self.dist)
        self.backend.build(self.feed.spec, self.accumulate)

    def start(self, resume: bool = True, note: str = "") -> None:
        """Collective: resume from a checkpoint (unless `resume` is False: an elastic reset
        continues from its commit), count the steps left, open the logs."""
        feed = self.feed
        if resume:
            self.state = (self.checkpointer.restore(feed.train_pipe, self.recovery.restarts)
                          or self.state)
        feed.plan(self.state.step, self.dist.size)
        self.reporter.say(feed.header(self.dist.size) + note)
        self.reporter.open(self.state.step, feed.total_steps, feed.global_batch, feed.spec,
                           feed.train_pipe)

    def train(self, signals: SignalRequests) -> bool:
        """Epochs until the counted steps are done; True when a signal stopped the run."""
        self.feed.open_loaders(self.backend)
        self.profiler.at(self.state.step + 1)  # (its window opens before the clock starts)
        self.reporter.start_timing(self.state.step)
        if self.watchdog is not None:
            self.watchdog.begin_training(self.state.step)
        while self.state.step < self.feed.total_steps:
            if self.epoch(signals):
                return True
        return False

    def epoch(self, signals: SignalRequests) -> bool:
        """The rest of the pipeline's current epoch (or as much of it as the steps left need);
        True when a signal stopped the run."""
        state, feed = self.state, self.feed
        state.epoch = feed.begin_epoch(state.step)
        self.phase("data")
        for micro, waited in micro_batch_groups(feed.loader, self.accumulate, self.profiler):
            if self.step(micro, waited, signals):
                return True
            if state.step >= feed.total_steps:
                return False
        if self.cfg.train.val_every is None:  # the epoch's batches are exhausted
            self.validate()
        if self.checkpointer.due_after_epoch(state):
            self.save("every_epochs")
        self.reporter.restart_clock()
        return False

    def step(self, micro: list[Any], waited: float, signals: SignalRequests) -> bool:
        """One optimizer step over k micro-batches and what follows it; True when a signal
        asked to stop."""
        state, val_every = self.state, self.cfg.train.val_every
        if state.step + 1 in self.cfg.data.skip_steps:
            return self.skip_step(micro)
        self.phase("step")
        self.faults.before_step(state.step + 1, self.dist.rank)
        lr = self.feed.schedule(state.step)
        with self.profiler.span("ringfeed.step", step=state.step + 1):
            result = self.backend.train_step(micro, lr, signals.take(), self.profiler.span,
                                             at=(state.epoch, state.step))
        if not result.finite:  # every rank sees the same averaged loss: all stop here
            raise TrainingDiverged.at(result.loss, state)
        state.step += 1
        self.user_code.note_step(state.step)
        self.phase("report")
        self.reporter.on_step(state, result, micro, waited)
        figures = (self.reporter.gather_rank_figures(state.step)  # collective, on every rank
                   if self.reporter.log_due(state.step) else {})
        self.reporter.log_step(state, result, lr, waited, figures)
        if val_every and state.step % val_every == 0:
            self.validate()
        reason = self.checkpointer.due(state.step, result)
        if reason is not None:
            self.save(reason)
        if self.elastic is not None:
            self.elastic.after_step(state.step)
        self.profiler.at(state.step + 1)  # (its window moves on before the clock restarts)
        self.reporter.restart_clock()
        self.phase("data")
        return result.stop_requested

    def skip_step(self, micro: list[Any]) -> bool:
        """data.skip_steps: the step's batches were read (the data position moves on, as on
        every rank) and are not trained on; the step counts, weights and optimizer stay."""
        self.state.step += 1
        self.reporter.on_skipped_step(self.state.step,
                                      sum(len(m["__index__"]) for m in micro) * self.dist.size)
        return False

    def validate(self) -> None:
        """Collective: the validation metrics of the model as it is now."""
        if self.feed.val_pipe is None:
            return
        self.phase("validate")
        self.state.last_val_step = self.state.step
        self.reporter.on_validate(self.state, evaluate(
            self.backend, self.feed.val_pipe, self.feed.val_loader, self.cfg.train.val_steps,
            reports_perplexity(self.cfg, self.feed.spec)))

    def save(self, reason: str) -> None:
        """Collective: a checkpoint of this step (samples.jsonl covers it); a failed write under
        checkpoint.on_error: warn is counted and training goes on."""
        self.phase("checkpoint")
        self.reporter.flush_samples()  # collective: samples.jsonl covers the checkpoint
        self.checkpointer.save(self.state, self.feed.train_pipe, reason)
        self.state.saved_step = self.state.step  # (written, being written, or failed: warn)

    def record_save(self, saved: Saved) -> None:
        """The one place a checkpoint write's outcome is recorded, on every rank once they
        agreed on it: the newest complete checkpoint or a failure counted, and its cost."""
        if saved.location is None:
            self.recovery.failed_checkpoints += 1
        else:
            self.state.last_checkpoint = saved.location
        self.reporter.on_checkpoint_saved(saved)

    def wrap_up(self, stopped: bool) -> None:
        """Collective: the last validation and checkpoint, the summary, and a barrier."""
        state = self.state
        self.phase("end")
        if not stopped:
            if self.feed.val_pipe is not None and state.last_val_step != state.step:
                self.validate()
            if self.checkpointer.due_at_end(state):
                self.save("end")
        self.checkpointer.drain()  # a write in flight (checkpoint.async)
        self.reporter.finish("stopped by SIGTERM" if stopped else "finished", state,
                             self.recovery, self.feed.steps_per_epoch)
        # Nobody leaves before rank 0 has written everything: a launcher kills the rest
        # of the job as soon as one rank exits.
        self.backend.allreduce_sum({"done": 0.0})

    def phase(self, name: str) -> None:
        """Tell the hang watchdog where this rank is (train/resilience/watchdog.py PHASES)."""
        if self.watchdog is not None:
            self.watchdog.at(self.state.step, name)

    # -- elastic resets (train/resilience/elastic.py calls these) ----------------------------------
    def commit_values(self) -> tuple[dict[str, Any], dict[str, int]]:
        """Collective: samples.jsonl flushed; an elastic commit's (progress, recovery counts)."""
        self.reporter.flush_samples()
        progress = {**self.state.as_plain(), "pipeline": self.feed.train_pipe.state_dict()}
        return progress, self.recovery_counts()

    def recovery_counts(self) -> dict[str, int]:
        """What the run survived so far, as plain values."""
        return asdict(self.recovery)

    def position(self) -> tuple[int, int]:
        """(optimizer steps done, epoch)."""
        return self.state.step, self.state.epoch

    def rejoin(self, dist: Dist, recovery: Recovery, progress: dict[str, Any] | None) -> None:
        """Go on after Horovod (re-)formed the ring: as `dist` (pipelines rebuilt), with the
        commit's recovery counts and progress (commit_values() of rank 0; None before one)."""
        self.dist = dist
        self.feed.build(dist)
        self.recovery = recovery
        if progress is not None:
            progress = dict(progress)
            self.feed.train_pipe.load_state_dict(progress.pop("pipeline"))
            self.state = TrainState.from_plain(progress)

    def elastic_reset(self, lost_steps: int, note: Callable[[Recovery], str]) -> None:
        """Collective: go on after an elastic reset, redoing the `lost_steps` past the last
        commit; the header ends with `note(recovery)`; metrics.jsonl records the reset."""
        self.recovery.count_reset(lost_steps)
        self.start(resume=False, note=note(self.recovery))
        self.reporter.event(self.state.step, {"event": "elastic_reset", "size": self.dist.size,
                                              "steps_redone": lost_steps})

    def close(self) -> None:
        """Watchdog, profiler, logs, loaders and pipelines closed (also after an error)."""
        if self.watchdog is not None:
            self.watchdog.stop()
        self.profiler.close()
        self.reporter.close()
        self.feed.close()


def train(cfg: RunConfig, *, user_code: UserCode | None = None, faults: FaultPlan = NO_FAULTS,
          startup: StartupSignals | None = None) -> int:
    """`ringfeed train` on a validated config: the process exit code."""
    return Trainer(cfg, user_code=user_code, faults=faults, startup=startup).run()

"""Profiles on demand (`train.profile`, `ringfeed train --profile`): a profiler trace of a few
steps, plus Horovod's timeline of the same steps.

- torch: `torch.profiler.profile` (CPU activity, and CUDA when the run has a GPU), written with
  `tensorboard_trace_handler` as `<output.dir>/profile/rank<r>/rank<r>.<time>.pt.trace.json`
  (Chrome trace format: Perfetto, chrome://tracing, TensorBoard's torch profiler plugin).
  Named ranges: `ringfeed.data_wait` (the loop waiting for the step's batches),
  `ringfeed.forward`, `ringfeed.backward`, `ringfeed.allreduce` (waiting for the gradient and
  agreement allreduces), `ringfeed.optimizer_step`, and `ringfeed.step` around each whole step.
- TensorFlow: `tf.profiler.experimental.start/stop` into `<output.dir>/profile/rank<r>/`
  (`plugins/profile/<run>/<host>.xplane.pb`: TensorBoard's profile plugin), with trace
  annotations `ringfeed.data_wait` and `ringfeed.step` (step_num N: the plugin's step view);
  inside the step's graph the model's forward ops are named `ringfeed_forward/...`, their
  gradients `gradient_tape/ringfeed_forward/...`, the update `.../ringfeed_optimizer_step/...`,
  and Horovod's allreduces (asynchronous kernels) are the `ExecutorState::ProcessAsync` events
  whose `kernel_type` is HorovodGroupedAllreduce / HorovodAllreduce.
- Horovod's timeline (`hvd.start_timeline` / `hvd.stop_timeline`, which need HOROVOD_TIMELINE=
  DYNAMIC at hvd.init(): `ringfeed train` sets it when profiling is asked for) into
  `<output.dir>/profile/horovod_timeline.json`, written by rank 0 (Horovod's coordinator) for
  every rank's collectives. Not when `horovod.timeline` already records the whole run.

Steps are those `start_step .. start_step + steps - 1`; the window opens before the data wait
of its first step and closes after its last step (or when the run ends inside it). Off (the
default), the window never opens: a span is the reusable NO_SPAN, one attribute checked.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

TIMELINE_FILE = "horovod_timeline.json"
NO_SPAN = contextlib.nullcontext()  # reusable: what a span is when nothing is profiled


def no_span(name: str) -> contextlib.AbstractContextManager:
    return NO_SPAN


def dynamic_timeline_env(cfg: Any) -> dict[str, str]:
    """What the environment needs before Horovod loads for its timeline to be started and
    stopped at run time, when profiling: HOROVOD_TIMELINE=DYNAMIC, unless horovod.timeline
    records one for the whole run (the entry point sets it where the environment has none)."""
    if cfg.train.profile is not None and cfg.horovod.timeline is None:
        return {"HOROVOD_TIMELINE": "DYNAMIC"}
    return {}


class StepProfiler:
    """The profile window of one rank (train.profile; None: off, the window never opens).
    Every rank has one (rank 0 starts Horovod's timeline even when only other ranks are
    traced); ranks not in `ranks` trace nothing themselves."""

    def __init__(self, framework: str, section: Any | None, rank: int, world_size: int,
                 out_dir: Path, say: Callable[[str], None]):
        self.framework = framework
        first, steps, ranks = ((section.start_step, section.steps, section.ranks)
                               if section is not None else (0, 0, []))
        self.first, self.last = first, first + steps - 1
        self.rank = rank
        self.traced = rank in ranks
        self.dir = Path(out_dir) / "profile"
        self.say = say
        self.active = False
        self.done = section is None
        self._next = self.first  # the step about to run
        self._profiler: Any = None
        self._timeline = False
        missing = [r for r in ranks if r >= world_size]
        if missing:
            say(f"warning: train.profile.ranks {missing}: no such rank ({world_size} ranks)")

    # -- the window ---------------------------------------------------------------------------
    def at(self, next_step: int) -> None:
        """Called before the data wait of step `next_step` (and at the start of training):
        opens or closes the window."""
        self._next = next_step
        if self.active and next_step > self.last:
            self.stop()
        elif not self.active and not self.done:
            if next_step == self.first:
                self.start()
            elif next_step > self.first:
                self.done = True
                if self.traced:
                    self.say(f"profile: training starts at step {next_step}, past "
                             f"train.profile.start_step {self.first}: nothing profiled")

    def start(self) -> None:
        self.active = True
        if self.traced:
            trace_dir = self.dir / f"rank{self.rank}"
            trace_dir.mkdir(parents=True, exist_ok=True)
            self._profiler = (self._start_torch(trace_dir) if self.framework == "torch"
                              else self._start_tf(trace_dir))
        self._timeline = self._start_timeline()

    def stop(self) -> None:
        """Close the window: traces written, the timeline stopped (collective-free)."""
        if not self.active:
            return
        self.active, self.done = False, True
        timeline = self._timeline
        if timeline:
            self._hvd().stop_timeline()
            self._timeline = False
        if self._profiler is None:
            return
        if self.framework == "torch":
            self._profiler.stop()  # the trace handler writes the file
        else:
            import tensorflow as tf

            tf.profiler.experimental.stop()
        self._profiler = None
        where = self.dir / f"rank{self.rank}"
        also = (f"; Horovod timeline of all ranks: {self.dir / TIMELINE_FILE}"
                if timeline and self.rank == 0 else "")
        self.say(f"profile: steps {self.first}-{min(self.last, self._next - 1)} of rank "
                 f"{self.rank} in {where}{also}")

    close = stop

    # -- named ranges -------------------------------------------------------------------------
    def span(self, name: str, step: int | None = None) -> contextlib.AbstractContextManager:
        """A named range in the trace while the window is open on a traced rank."""
        if not (self.active and self.traced):
            return NO_SPAN
        if self.framework == "torch":
            import torch

            return torch.profiler.record_function(name)
        import tensorflow as tf

        if step is not None:  # a step marker TensorBoard's profile plugin recognises
            return tf.profiler.experimental.Trace(name, step_num=step, _r=1)
        return tf.profiler.experimental.Trace(name)

    # -- framework pieces ---------------------------------------------------------------------
    def _start_torch(self, trace_dir: Path) -> Any:
        import torch
        from torch.profiler import ProfilerActivity, profile, tensorboard_trace_handler

        activities = [ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(ProfilerActivity.CUDA)
        profiler = profile(activities=activities,
                           on_trace_ready=tensorboard_trace_handler(
                               str(trace_dir), worker_name=f"rank{self.rank}"))
        profiler.start()
        return profiler

    def _start_tf(self, trace_dir: Path) -> Any:
        import tensorflow as tf

        tf.profiler.experimental.start(str(trace_dir))
        return True

    def _hvd(self) -> Any:
        if self.framework == "torch":
            import horovod.torch as hvd
        else:
            import horovod.tensorflow as hvd
        return hvd

    def _start_timeline(self) -> bool:
        hvd = self._hvd()
        setting = os.environ.get("HOROVOD_TIMELINE")
        if setting != "DYNAMIC":
            if self.rank == 0:
                self.say("profile: no Horovod timeline of the window: " + (
                    "HOROVOD_TIMELINE was not DYNAMIC at hvd.init()" if not setting else
                    f"horovod.timeline / HOROVOD_TIMELINE ({setting}) records the whole run"))
            return False
        if not hasattr(hvd, "start_timeline"):
            if self.rank == 0:
                self.say("profile: this Horovod has no start_timeline: no Horovod timeline")
            return False
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            hvd.start_timeline(str((self.dir / TIMELINE_FILE).absolute()))
        except ValueError as e:  # HOROVOD_TIMELINE was not DYNAMIC at hvd.init()
            if self.rank == 0:
                self.say(f"profile: no Horovod timeline ({e})")
            return False
        return True

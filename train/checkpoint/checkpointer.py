"""The checkpoint protocol of a run: where it resumes from, when it saves, how a write is made
(now, or in the background) and how a failed one is handled. train/checkpoint/files.py has the
files (staging, verification, retention), train/checkpoint/store.py where they live (a local
directory or object storage).

    restore()  collective: rank 0 probes checkpoint.dir, refuses a dir of an earlier run under
               `resume: none`, removes what killed writes left, finds the checkpoint (`resume:
               auto|PATH|URL`), downloads and verifies it if remote, and loads it; every rank
               takes rank 0's state, or rank 0's error
    due()      after a step: "signal" (SIGUSR1; SIGTERM saves, then the loop stops),
               "every_steps", or nothing
    save()     collective: snapshot() on every rank, then rank 0 writes it: at once
               (checkpoint.async: false), or in a background thread while training goes on
    drain()    collective: the end of the run (and SIGTERM's stop) waits for a write in flight

Two halves, so the write can change without the protocol changing: `snapshot()` takes what must
be saved (the meta, the RNG states of every rank, and the function that writes the model's
payload: of the live objects for a write made now, of a host-memory copy for one made in the
background) and `write()` puts a snapshot in the store, retention (`checkpoint.keep`) included.

Agreement: a write's outcome is known on rank 0 only. A synchronous save broadcasts it at once.
An asynchronous one is collected at the next save() or at drain(), points every rank reaches
(both are collective anyway): rank 0 waits there for the write in flight (at most one; the wait
is logged), broadcasts its outcome, and every rank handles a failure alike under
checkpoint.on_error (fail: all stop; warn: all go on). So a background write that fails is
reported up to checkpoint.every_steps steps later, never by one rank alone.

Every outcome is a `Saved`: the seconds training was blocked by the save and the seconds the
write took, logged ("saved checkpoint ...") and handed once to `record`, the one place the run
records it (train/loop.py: the newest checkpoint, the failures, the costs), before a failure
is raised.
"""

from __future__ import annotations

import copy as copy_module
import os
import threading
import time
from collections.abc import Callable
from contextlib import suppress
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from ringfeed.errors import EXIT_CONFIG, EXIT_STORAGE_UNAVAILABLE, EXIT_WRITE, UserError
from ringfeed.remote import RetryPolicy, StorageUnavailable
from ringfeed.train.backends.base import Backend, StepResult
from ringfeed.train.checkpoint.changes import resume_warnings
from ringfeed.train.checkpoint.files import (
    CheckpointWriteError,
    find_resume_point,
    probe_writable,
    refuse_earlier_run,
    remove_stale_temporaries,
    write_checkpoint,
)
from ringfeed.train.checkpoint.store import CheckpointStore, open_store
from ringfeed.train.config import CheckpointSection, RunConfig
from ringfeed.train.data import TrainPipeline
from ringfeed.train.resilience.faults import NO_FAULTS, FaultPlan
from ringfeed.train.runstate import TrainState


@dataclass(frozen=True)
class Snapshot:
    """What one checkpoint holds, taken on every rank before anything is written."""

    step: int
    reason: str  # why it is saved: signal, every_steps, every_epochs, end
    meta: dict[str, Any] | None  # meta.json's run fields (rank 0; None elsewhere)
    write_payload: Callable[[Path], None]  # writes model, optimizer, scaler, RNG into a dir


@dataclass(frozen=True)
class Saved:
    """The outcome of one checkpoint write, the same on every rank once agreed."""

    step: int
    reason: str
    location: str | None  # its path or URL; None when it was not written
    blocked_s: float  # seconds training waited for this save (rank 0's)
    write_s: float  # seconds the write took: serialise, hash, write/upload, keep
    error: str | None = None  # why it was not written
    exit_code: int = EXIT_WRITE  # under on_error: fail (75: storage unavailable)

    def describe(self) -> str:
        return (f"training blocked {self.blocked_s:.2f}s, write {self.write_s:.2f}s")


class BackgroundWriter:
    """Rank 0's writer thread: one write at a time. The thread is not a daemon, so a process
    that ends with a write in flight (an exception elsewhere) finishes it first. It runs at a
    lower CPU priority (nice +10, this thread only): where training computes on the same cores
    (CPU training, a busy data pipeline) the kernel gives them to training first and the write
    takes the cycles left over."""

    NICE = 10

    def __init__(self) -> None:
        self._thread: threading.Thread | None = None
        self._outcome: Saved | None = None

    def start(self, write: Callable[[], Saved]) -> None:
        assert self._thread is None, "one checkpoint write at a time"

        def run() -> None:
            with suppress(OSError, AttributeError):  # (Linux: per thread; elsewhere: as is)
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), self.NICE)
            self._outcome = write()

        self._thread = threading.Thread(target=run, name="ringfeed-checkpoint-writer")
        self._thread.start()

    @property
    def pending(self) -> bool:
        return self._thread is not None

    def wait(self) -> Saved | None:
        """The outcome of the write in flight once it is done (None if there is none)."""
        if self._thread is None:
            return None
        self._thread.join()
        self._thread, outcome, self._outcome = None, self._outcome, None
        return outcome


class Checkpointer:
    """Restores, saves and keeps the run's checkpoints. Its own state: the step whose save
    failed under on_error: warn (not retried at the end), and rank 0's writer thread."""

    section: CheckpointSection
    backend: Backend
    store: CheckpointStore
    failed_step: int

    @classmethod
    def for_run(cls, cfg: RunConfig, backend: Backend, **hooks: Any) -> Checkpointer:
        """A run's checkpointer: its section, the resolved directory, the run's framework,
        config, staging folder and storage budget; `hooks`: say, log, record, faults."""
        return cls(cfg.checkpoint, cfg.checkpoint_dir, backend, framework=cfg.framework,
                   config=cfg.model_dump(mode="json"), retry_budget_s=cfg.data.retry_budget_s,
                   staging=Path(cfg.output.dir) / ".checkpoint-staging", **hooks)

    def __init__(self, section: CheckpointSection, directory: str, backend: Backend, *,
                 framework: str, config: dict[str, Any], staging: Path, retry_budget_s: float,
                 say: Callable[[str], None], log: Callable[[str], None],
                 record: Callable[[Saved], None] | None = None, faults: FaultPlan = NO_FAULTS):
        """`directory`: checkpoint.dir resolved (a path or URL); `framework` and `config`
        (the resolved config as plain values) go into every meta.json, and a checkpoint of
        another framework is refused; `staging`: where remote checkpoints are staged;
        `retry_budget_s`: how long storage may fail before a write or read gives up. `say`: a
        line on rank 0 before the logs open; `log`: a line of the run's log; `record`: each
        agreed outcome, once; `faults`: the test-only fault plan (train/resilience/faults.py)."""
        self.section, self.backend, self.faults = section, backend, faults
        self.framework, self.config, self.staging = framework, config, staging
        self.policy = RetryPolicy(budget_s=retry_budget_s)
        self.store = self.open(directory)
        self.directory = self.store.url
        self.say, self.log, self.record = say, log, record or (lambda saved: None)
        self.failed_step = -1
        self.writer = BackgroundWriter()

    def open(self, location: str) -> CheckpointStore:
        """The store of a checkpoint path or URL, with checkpoint.storage_options; remote
        checkpoints are staged under `staging`."""
        return open_store(location, self.section.storage_options, self.staging, self.policy)

    # -- restore ------------------------------------------------------------------------------
    def restore(self, pipe: TrainPipeline, restarts: int) -> TrainState | None:
        """Collective: the progress of the checkpoint resumed from (its model state and
        `pipe`'s position loaded), or None when starting at step 0. Errors are decided on
        rank 0 and raised on every rank (a lone raise would hang the others)."""
        found = self._find() if self.backend.dist.is_root else None
        found = self.backend.broadcast_object(found)
        if found is not None and "error" in found:
            raise _error(found["error"], found["exit_code"])
        self.backend.sync_from_root(resumed=found is not None)
        restart = f"; restart {restarts} by `ringfeed run`" if restarts else ""
        if found is None:
            self.say("starting at step 0" + (
                f" (no checkpoint to resume in {self.directory})"
                if self.section.resume != "none" else " (checkpoint.resume: none)") + restart)
            return None
        meta = found["meta"]
        try:
            step = int(meta["step"])
            state = TrainState(step=step, epoch=int(meta["epoch"]),
                               last_checkpoint=found["path"], saved_step=step)
            pipe.load_state_dict(meta["pipeline"])
        except UserError as e:  # the pipeline refused its state: name the checkpoint
            raise UserError(f"checkpoint {found['path']}: {e}", exit_code=e.exit_code) from None
        except (KeyError, TypeError, ValueError, AttributeError) as e:  # the same on every rank
            raise UserError(f"checkpoint {found['path']}: meta.json is damaged ({type(e).__name__}"
                            f": {e}); resume from another checkpoint (--resume PATH) or move "
                            "this one away") from None
        self.say(f"resumed from {found['path']} at step {state.step} (epoch {state.epoch}, "
                 f"saved by {meta.get('world_size')} rank(s)){restart}")
        for line in resume_warnings(meta.get("config") or {}, int(meta.get("world_size") or 0),
                                    self.config, self.backend.dist.size, step):
            self.say(line)
        return state

    def _find(self) -> dict[str, Any] | None:
        """Rank 0: {"path", "meta"} of the checkpoint loaded into the backend, None, or
        {"error", "exit_code"} of what stops the run."""
        try:
            self._probe()
            refuse_earlier_run(self.section.resume, self.store)
            removed = remove_stale_temporaries(self.store)
            if removed:
                self.say(f"removed incomplete checkpoint(s) {', '.join(removed)} in "
                         f"{self.directory} (a write or delete cut short)")
            hit = find_resume_point(self.section.resume, self.store, self.say, self.open)
            if hit is None:
                return None
            try:
                if hit.meta.get("framework") != self.framework:
                    raise UserError(f"checkpoint {hit.location} was written by "
                                    f"{hit.meta.get('framework')}, not {self.framework}")
                self.backend.read_payload(hit.path)
            finally:
                hit.store.release(hit.path)
            return {"path": hit.location, "meta": hit.meta}
        except Exception as e:  # noqa: BLE001 - re-raised on every rank by restore()
            return {"error": f"{e}", "exit_code": getattr(e, "exit_code", EXIT_CONFIG)}

    def _probe(self) -> None:
        """Fail before training when checkpoint.dir cannot hold files (on_error: warn says so
        and goes on)."""
        try:
            probe_writable(self.store)
        except CheckpointWriteError as e:
            if self.section.on_error == "fail":
                raise
            self.say(f"warning: {e}; training on WITHOUT checkpoints (checkpoint.on_error: warn)")

    # -- save ---------------------------------------------------------------------------------
    def due(self, step: int, result: StepResult) -> str | None:
        """Why a checkpoint is due after `step`: "signal", "every_steps", or None."""
        every = self.section.every_steps
        if result.save_requested or result.stop_requested:
            return "signal"
        if every and step % every == 0:
            return "every_steps"
        return None

    def due_after_epoch(self, state: TrainState) -> bool:
        """Whether the end of epoch `state.epoch` (counted from 0) saves: every
        checkpoint.every_epochs-th epoch, unless this step is saved already."""
        every = self.section.every_epochs
        return bool(every) and (state.epoch + 1) % every == 0 and state.saved_step != state.step

    def due_at_end(self, state: TrainState) -> bool:
        """The end saves unless this step is saved already, or its save failed (warn)."""
        return state.saved_step != state.step and self.failed_step != state.step

    def save(self, state: TrainState, pipe: TrainPipeline, reason: str) -> list[Saved]:
        """Collective: a checkpoint of `state.step`. Returns the writes this call saw finish,
        agreed on every rank (a failed one has no location under on_error: warn; under fail
        CheckpointWriteError, or StorageUnavailable, is raised on every rank): the one just
        written, or with checkpoint.async, the previous one (this one goes on in the
        background; drain() collects the last)."""
        started = time.perf_counter()
        done = self.drain()
        snapshot = self.snapshot(state, pipe, reason, copy=self.section.async_write)
        if not self.section.async_write:
            return done + [self.write(snapshot, started)]
        if self.backend.dist.is_root:
            blocked = time.perf_counter() - started
            self.writer.start(lambda: self._write(snapshot, blocked))
        return done

    def drain(self) -> list[Saved]:
        """Collective: rank 0 waits for the write in flight (saying so when it had to wait);
        its outcome, agreed on every rank ([] when none was in flight)."""
        if not self.section.async_write:
            return []
        outcome = None
        if self.writer.pending:  # (rank 0's; after an elastic reset maybe no longer rank 0)
            started = time.perf_counter()
            outcome = self.writer.wait()
            waited = time.perf_counter() - started
            if waited >= 0.01:
                self.log(f"waited {waited:.2f}s for the checkpoint write of step "
                         f"{outcome.step} (checkpoint.async: one write at a time)")
        outcome = self.backend.broadcast_object(outcome if self.backend.dist.is_root else None)
        return [] if outcome is None else [self._settle(outcome)]

    def snapshot(self, state: TrainState, pipe: TrainPipeline, reason: str, copy: bool = False
                 ) -> Snapshot:
        """Collective: local SGD's replicas averaged (a checkpoint holds one model), every
        rank's RNG state gathered on rank 0, and rank 0's meta; with `copy`, rank 0's payload
        copied to host memory (the only rank that writes), so training may go on."""
        backend, dist = self.backend, self.backend.dist
        backend.sync_replicas()
        rng = backend.rng_states()
        meta, write_payload = None, _nothing
        if dist.is_root:
            meta = {"framework": self.framework, "epoch": state.epoch,
                    "world_size": dist.size, "reason": reason,
                    "pipeline": copy_module.deepcopy(pipe.state_dict()), "config": self.config}
            write_payload = backend.payload(rng, copy)
        return Snapshot(state.step, reason, meta, write_payload)

    def write(self, snapshot: Snapshot, started: float | None = None) -> Saved:
        """Collective: rank 0 writes `snapshot` now (keeping the newest checkpoint.keep) and
        every rank learns whether it worked, so a failed write stops all ranks together (or,
        under checkpoint.on_error: warn, none of them). `started`: when the save began (the
        blocked time counts from there)."""
        outcome = None
        if self.backend.dist.is_root:
            outcome = self._write(snapshot, 0.0)
            blocked = time.perf_counter() - started if started is not None else outcome.write_s
            outcome = replace(outcome, blocked_s=blocked)
        return self._settle(self.backend.broadcast_object(outcome))

    def _write(self, snapshot: Snapshot, blocked_s: float) -> Saved:
        """Rank 0 (the caller's thread or the writer's): `snapshot` into the store; the
        outcome, an error included (never raised: the ranks agree on it first)."""
        started = time.perf_counter()
        location, error, code = None, None, EXIT_WRITE
        try:
            location = write_checkpoint(self.store, snapshot.step, snapshot.meta,
                                        snapshot.write_payload, self.section.keep, self.faults)
        except StorageUnavailable as e:
            error, code = str(e), EXIT_STORAGE_UNAVAILABLE
        except CheckpointWriteError as e:
            error = str(e)
        except Exception as e:  # noqa: BLE001 - a background write's failure is agreed first
            if not self.section.async_write:
                raise
            error = f"cannot write checkpoint at step {snapshot.step}: {type(e).__name__}: {e}"
        return Saved(snapshot.step, snapshot.reason, location, blocked_s,
                     time.perf_counter() - started, error, code)

    def _settle(self, outcome: Saved) -> Saved:
        """Every rank: an agreed outcome logged and recorded; a failure raised (on_error:
        fail) or remembered (warn)."""
        if outcome.error is None:
            self.log(f"saved checkpoint {outcome.location} ({outcome.reason}): "
                     f"{outcome.describe()}")
            self.record(outcome)
            return outcome
        self.record(outcome)
        if self.section.on_error == "fail":
            raise _error(f"at step {outcome.step}: {outcome.error}", outcome.exit_code)
        self.failed_step = outcome.step
        self.log(f"warning: checkpoint at step {outcome.step} NOT saved: {outcome.error}; "
                 "training on (checkpoint.on_error: warn)")
        return outcome


def _nothing(directory: Path) -> None:
    """(the payload of a rank that does not write)"""


def _error(message: str, exit_code: int) -> UserError:
    """The exception that stops every rank alike for an error decided on rank 0."""
    if exit_code == EXIT_STORAGE_UNAVAILABLE:
        return StorageUnavailable(message)
    if exit_code == EXIT_WRITE:
        return CheckpointWriteError(message)
    return UserError(message, exit_code=exit_code)

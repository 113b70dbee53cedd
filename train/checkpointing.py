"""The checkpoint protocol of a run: where it resumes from, when it saves, how a failed write is
handled. train/checkpoint.py has the files (atomic directories, verification, retention).

    restore()  collective: rank 0 probes checkpoint.dir, refuses a dir of an earlier run under
               `resume: none`, removes stale temporaries, finds the checkpoint (`resume:
               auto|PATH`) and loads it; every rank takes rank 0's state, or rank 0's error
    due()      after a step: "signal" (SIGUSR1; SIGTERM saves, then the loop stops),
               "every_steps", or nothing
    save()     collective: snapshot() on every rank, then write() by rank 0, the outcome agreed
               by all ranks (checkpoint.on_error: fail raises on every rank, warn goes on)

Two halves, so the write can change without the protocol changing: `snapshot()` takes what must
be saved (the meta, the RNG states of every rank, and the function that writes the model's
payload) and `write()` puts a snapshot on disk, retention (`checkpoint.keep`) included.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ringfeed.errors import UserError
from ringfeed.train.backend import Backend, StepResult
from ringfeed.train.checkpoint import (
    CheckpointWriteError,
    checkpoint_path,
    find_resume_point,
    probe_writable,
    refuse_earlier_run,
    remove_stale_temporaries,
    write_checkpoint,
)
from ringfeed.train.config import RunConfig
from ringfeed.train.runstate import TrainState


@dataclass(frozen=True)
class Snapshot:
    """What one checkpoint holds, taken on every rank before anything is written."""

    step: int
    reason: str  # why it is saved: signal, every_steps, end
    meta: dict[str, Any] | None  # meta.json's run fields (rank 0; None elsewhere)
    write_payload: Callable[[Path], None]  # writes model, optimizer, scaler, RNG into a dir


class Checkpointer:
    """Restores, saves and keeps the run's checkpoints. Its own state: the step whose save
    failed under on_error: warn (not retried at the end)."""

    cfg: RunConfig
    backend: Backend
    failed_step: int

    def __init__(self, cfg: RunConfig, backend: Backend, say: Callable[[str], None],
                 log: Callable[[str], None]):
        """`say`: a line on rank 0 before the logs open; `log`: a line of the run's log."""
        self.cfg, self.backend = cfg, backend
        self.section, self.directory = cfg.checkpoint, cfg.checkpoint_dir
        self.say, self.log = say, log
        self.failed_step = -1

    # -- restore ------------------------------------------------------------------------------
    def restore(self, pipe: Any, restarts: int) -> TrainState | None:
        """Collective: the progress of the checkpoint resumed from (its model state and
        `pipe`'s position loaded), or None when starting at step 0. Errors are decided on
        rank 0 and raised on every rank (a lone raise would hang the others)."""
        found = self._find() if self.backend.dist.is_root else None
        found = self.backend.broadcast_object(found)
        if found is not None and "error" in found:
            raise UserError(found["error"], exit_code=found["exit_code"])
        self.backend.sync_from_root(resumed=found is not None)
        restart = f"; restart {restarts} by `ringfeed run`" if restarts else ""
        if found is None:
            self.say("starting at step 0" + (
                f" (no checkpoint to resume in {self.directory})"
                if self.section.resume != "none" else " (checkpoint.resume: none)") + restart)
            return None
        meta, step = found["meta"], int(found["meta"]["step"])
        state = TrainState(step=step, epoch=int(meta["epoch"]),
                           last_checkpoint=Path(found["path"]), saved_step=step)
        pipe.load_state_dict(meta["pipeline"])
        self.say(f"resumed from {found['path']} at step {state.step} (epoch {state.epoch}, "
                 f"saved by {meta.get('world_size')} rank(s)){restart}")
        return state

    def _find(self) -> dict[str, Any] | None:
        """Rank 0: {"path", "meta"} of the checkpoint loaded into the backend, None, or
        {"error", "exit_code"} of what stops the run."""
        try:
            self._probe()
            refuse_earlier_run(self.section.resume, self.directory)
            remove_stale_temporaries(self.directory)
            hit = find_resume_point(self.section.resume, self.directory, self.say)
            if hit is None:
                return None
            if hit.meta.get("framework") != self.cfg.framework:
                raise UserError(f"checkpoint {hit.path} was written by "
                                f"{hit.meta.get('framework')}, not {self.cfg.framework}")
            self.backend.read_payload(hit.path)
            return {"path": str(hit.path), "meta": hit.meta}
        except Exception as e:  # noqa: BLE001 - re-raised on every rank by restore()
            return {"error": f"{e}", "exit_code": getattr(e, "exit_code", 2)}

    def _probe(self) -> None:
        """Fail before training when checkpoint.dir cannot hold files (on_error: warn says so
        and goes on)."""
        try:
            probe_writable(self.directory)
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

    def due_at_end(self, state: TrainState) -> bool:
        """The end saves unless this step is saved already, or its save failed (warn)."""
        return state.saved_step != state.step and self.failed_step != state.step

    def save(self, state: TrainState, pipe: Any, reason: str) -> Path | None:
        """Collective: the checkpoint of `state.step` written, the same answer on every rank:
        its path, or None when the write failed under on_error: warn (CheckpointWriteError
        under fail)."""
        return self.write(self.snapshot(state, pipe, reason))

    def snapshot(self, state: TrainState, pipe: Any, reason: str) -> Snapshot:
        """Collective: local SGD's replicas averaged (a checkpoint holds one model), every
        rank's RNG state gathered on rank 0, and rank 0's meta."""
        backend, dist = self.backend, self.backend.dist
        backend.sync_replicas()
        rng = backend.rng_states()
        meta = None
        if dist.is_root:
            meta = {"framework": self.cfg.framework, "epoch": state.epoch,
                    "world_size": dist.size, "reason": reason, "pipeline": pipe.state_dict(),
                    "config": self.cfg.model_dump(mode="json")}
        return Snapshot(state.step, reason, meta,
                        lambda directory: backend.write_payload(directory, rng))

    def write(self, snapshot: Snapshot) -> Path | None:
        """Collective: rank 0 writes `snapshot` (keeping the newest checkpoint.keep) and every
        rank learns whether it worked, so a failed write stops all ranks together (or, under
        checkpoint.on_error: warn, none of them)."""
        error = None
        if self.backend.dist.is_root:
            try:
                path = write_checkpoint(self.directory, snapshot.step, snapshot.meta,
                                        snapshot.write_payload, self.section.keep)
                self.log(f"saved checkpoint {path} ({snapshot.reason})")
            except CheckpointWriteError as e:
                error = str(e)
        error = self.backend.broadcast_object(error)
        if error is None:
            return checkpoint_path(self.directory, snapshot.step)
        if self.section.on_error == "fail":
            raise CheckpointWriteError(f"at step {snapshot.step}: {error}")
        self.failed_step = snapshot.step
        self.log(f"warning: checkpoint at step {snapshot.step} NOT saved: {error}; "
                 "training on (checkpoint.on_error: warn)")
        return None

"""The training loop both frameworks share: epochs, accumulation groups, validation, checkpoint
policy, resume, signals, NaN stop, the end-of-run summary.

    state <- newest checkpoint (or step 0)
    while state.step < total_steps:
        for k micro-batches of the epoch:            # data wait timed here
            result = backend.train_step(micro, lr(step), signal requests)
            stop on a non-finite loss (all ranks see the same averaged loss)
            log; validate every N steps; checkpoint every N steps / on request
        next epoch (pipeline.set_epoch)
    validate, save the final checkpoint, print the summary

`TrainState.step` (optimizer steps) is the only progress counter: the schedule, logging,
validation and checkpoints are functions of it; the pipeline's own state (epoch, batches
consumed) travels in every checkpoint so a resumed run sees exactly the batches it would have.
"""

from __future__ import annotations

import signal
import time
from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shards.errors import UserError
from shards.fsutil import atomic_write_text
from train.backend import Backend, make_backend
from train.checkpoint import (
    checkpoint_path,
    find_resume_point,
    remove_stale_temporaries,
    write_checkpoint,
)
from train.config import RunConfig
from train.data import infer_spec, make_pipeline
from train.metrics import RunLogger, Throughput
from train.schedule import make_schedule

EXIT_PREEMPTED = 128 + signal.SIGTERM  # what a shell reports for a job ended by SIGTERM


class TrainingDiverged(UserError):
    """The loss became NaN/inf: stop before the update is applied (exit 3)."""

    exit_code = 3


@dataclass
class TrainState:
    """All progress of a run in one place (what an elastic state object commits)."""

    step: int = 0  # optimizer steps completed
    epoch: int = 0  # the train pipeline's epoch
    last_checkpoint: Path | None = None
    saved_step: int = -1
    last_val_step: int = -1


class SignalRequests:
    """SIGTERM (what schedulers send before killing a job): save, then stop. SIGUSR1: save and
    carry on. The handlers only set flags; the loop agrees on them across ranks at the next
    step, so a signal that reaches one rank stops all of them at the same step."""

    def __init__(self, enabled: bool):
        self.save = self.stop = False
        self._previous: dict[int, Any] = {}
        if enabled:
            self._previous[signal.SIGTERM] = signal.signal(signal.SIGTERM, self._on_term)
            self._previous[signal.SIGUSR1] = signal.signal(signal.SIGUSR1, self._on_usr1)

    def _on_term(self, signum, frame) -> None:
        self.stop = True

    def _on_usr1(self, signum, frame) -> None:
        self.save = True

    def take(self) -> tuple[float, float]:
        """(save, stop) for this step; a save request is consumed by taking it."""
        requests = (float(self.save), float(self.stop))
        self.save = False
        return requests

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


def micro_batch_groups(loader: Iterable, k: int) -> Iterator[tuple[list[Any], float]]:
    """Groups of k batches and the seconds spent waiting for them; a last group shorter than
    k is dropped (every rank has the same batch count, so every rank drops the same)."""
    iterator = iter(loader)
    group: list[Any] = []
    waited = 0.0
    while True:
        start = time.perf_counter()
        try:
            batch = next(iterator)
        except StopIteration:
            return
        waited += time.perf_counter() - start
        group.append(batch)
        if len(group) == k:
            yield group, waited
            group, waited = [], 0.0


def evaluate(backend: Backend, pipe, loader) -> dict[str, float]:
    """Exact validation metrics over the whole split, all ranks together (padding masked)."""
    if pipe.batches_remaining != pipe.batches_per_epoch:  # a pass left unfinished
        pipe.set_epoch(pipe.epoch + 1)
    sums: dict[str, float] = {}
    for batch in loader:
        for name, value in backend.eval_batch(batch).items():
            sums[name] = sums.get(name, 0.0) + value
    if not sums:
        return {}
    total = backend.allreduce_sum(sums)
    count = total.pop("count")
    return {name: value / count for name, value in total.items()} if count else {}


class Trainer:
    """One run: built from a validated config, `run()` returns the process exit code."""

    def __init__(self, cfg: RunConfig, backend: Backend | None = None):
        self.cfg = cfg
        self.backend = backend or make_backend(cfg)
        self.dist = self.backend.dist
        self.state = TrainState()

    def say(self, message: str) -> None:
        if self.dist.is_root:
            print(message, flush=True)

    # -- setup --------------------------------------------------------------------------------
    def setup(self) -> None:
        cfg, dist = self.cfg, self.dist
        self.train_pipe = make_pipeline(cfg, "train", dist.rank, dist.size)
        spec = infer_spec(cfg, self.train_pipe)
        self.val_pipe = (make_pipeline(cfg, "val", dist.rank, dist.size)
                         if cfg.val_source else None)
        k = cfg.train.accumulate
        self.steps_per_epoch = self.train_pipe.batches_per_epoch // k
        if self.steps_per_epoch == 0:
            raise UserError(
                f"data.train: {self.train_pipe.batches_per_epoch} batches of "
                f"{cfg.data.batch_size} per rank per epoch on {dist.size} ranks is fewer than "
                f"train.accumulate={k} (lower data.batch_size or train.accumulate)")
        self.total_steps = cfg.train.max_steps or cfg.train.epochs * self.steps_per_epoch
        self.global_batch = dist.size * cfg.data.batch_size * k
        self.backend.build(spec)
        self.schedule = make_schedule(cfg.optim, dist.size, k, self.total_steps)
        self.say(
            f"ringfeed train: {cfg.framework}, {dist.size} rank(s), model {cfg.model.name}, "
            f"{spec.task} on {spec.input_key} {spec.input_shape}, global batch "
            f"{self.global_batch} = {dist.size} x {cfg.data.batch_size} x {k} accumulated, "
            f"{self.steps_per_epoch} steps/epoch, {self.total_steps} steps, "
            f"{cfg.train.precision}, peak lr {self.schedule.peak:.3g}")
        self.restore()
        out = Path(cfg.output.dir)
        if dist.is_root:
            out.mkdir(parents=True, exist_ok=True)
            atomic_write_text(out / "config.yaml", cfg.to_yaml())
        self.logger = RunLogger(out, dist.is_root, self.total_steps, self.global_batch,
                                cfg.train.log_every, cfg.output.tensorboard,
                                start_step=self.state.step)

    def restore(self) -> None:
        """Rank 0 finds and loads the checkpoint; everyone takes rank 0's state. Errors are
        decided on rank 0 and raised on every rank (a lone raise would hang the others)."""
        cfg, state = self.cfg, self.state
        found: dict[str, Any] | None = None
        if self.dist.is_root:
            try:
                remove_stale_temporaries(cfg.checkpoint_dir)
                hit = find_resume_point(cfg.checkpoint.resume, cfg.checkpoint_dir, self.say)
                if hit is not None:
                    if hit.meta.get("framework") != cfg.framework:
                        raise UserError(f"checkpoint {hit.path} was written by "
                                        f"{hit.meta.get('framework')}, not {cfg.framework}")
                    self.backend.read_payload(hit.path)
                    found = {"path": str(hit.path), "meta": hit.meta}
            except Exception as e:  # noqa: BLE001 - re-raised on every rank below
                found = {"error": f"{e}"}
        found = self.backend.broadcast_object(found)
        if found is not None and "error" in found:
            raise UserError(found["error"])
        self.backend.sync_from_root(resumed=found is not None)
        if found is None:
            self.say("starting at step 0" + (
                f" (no checkpoint to resume in {cfg.checkpoint_dir})"
                if cfg.checkpoint.resume != "none" else " (checkpoint.resume: none)"))
            return
        meta = found["meta"]
        state.step, state.epoch = int(meta["step"]), int(meta["epoch"])
        state.last_checkpoint = Path(found["path"])
        state.saved_step = state.step
        self.train_pipe.load_state_dict(meta["pipeline"])
        self.say(f"resumed from {found['path']} at step {state.step} (epoch {state.epoch}, "
                 f"saved by {meta.get('world_size')} rank(s))")

    # -- the loop -----------------------------------------------------------------------------
    def run(self) -> int:
        self.setup()
        cfg, state, backend = self.cfg, self.state, self.backend
        k = cfg.train.accumulate
        signals = SignalRequests(cfg.checkpoint.save_on_signal)
        loader = backend.loader(self.train_pipe)
        self.val_loader = backend.loader(self.val_pipe) if self.val_pipe else None
        totals = Throughput()
        first_step = state.step
        recent_losses: deque[float] = deque(maxlen=cfg.train.log_every)
        stopped = False
        try:
            t_last = time.perf_counter()
            while state.step < self.total_steps and not stopped:
                if self.train_pipe.batches_remaining == 0:  # (also when resumed at its end)
                    self.train_pipe.set_epoch(self.train_pipe.epoch + 1)
                state.epoch = self.train_pipe.epoch
                for micro, waited in micro_batch_groups(loader, k):
                    lr = self.schedule(state.step)
                    result = backend.train_step(micro, lr, signals.take())
                    if not result.finite:
                        raise TrainingDiverged(
                            f"loss is {result.loss} at step {state.step + 1} (epoch "
                            f"{state.epoch}); stopped before applying that update; last "
                            f"checkpoint: {state.last_checkpoint or 'none'} (try a lower "
                            "optim.lr, optim.warmup_steps, train.grad_clip, or fp32/bf16)")
                    state.step += 1
                    now = time.perf_counter()
                    if state.step > first_step + 1:  # the first step traces/compiles: not timed
                        totals.add(self.global_batch, now - t_last, waited)
                    recent_losses.append(result.loss)
                    self.logger.train_step(state.step, state.epoch, result.loss, lr,
                                           now - t_last, waited, self._step_extras(result))
                    if cfg.train.val_every and state.step % cfg.train.val_every == 0:
                        self.validate()
                    every = cfg.checkpoint.every_steps
                    if (every and state.step % every == 0) or result.save_requested \
                            or result.stop_requested:
                        reason = ("signal" if result.save_requested or result.stop_requested
                                  else "every_steps")
                        self.save(reason)
                    t_last = time.perf_counter()
                    if result.stop_requested:
                        stopped = True
                        break
                    if state.step >= self.total_steps:
                        break
                else:  # the epoch's batches are exhausted
                    if cfg.train.val_every is None:
                        self.validate()
                    t_last = time.perf_counter()
            if not stopped:
                if self.val_pipe is not None and state.last_val_step != state.step:
                    self.validate()
                if state.saved_step != state.step:
                    self.save("end")
            self.finish(totals, recent_losses, "stopped by SIGTERM" if stopped else "finished")
            # Nobody leaves before rank 0 has written everything: a launcher kills the rest
            # of the job as soon as one rank exits.
            backend.allreduce_sum({"done": 0.0})
        finally:
            signals.restore()
            self.logger.close()
        return EXIT_PREEMPTED if stopped else 0

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
        metrics = evaluate(self.backend, self.val_pipe, self.val_loader)
        self.state.last_val_step = self.state.step
        self.last_val = metrics
        self.logger.validation(self.state.step, self.state.epoch, metrics)
        return metrics

    def save(self, reason: str) -> None:
        """Collective (RNG states are gathered from every rank); rank 0 writes."""
        cfg, state = self.cfg, self.state
        rng = self.backend.rng_states()
        if self.dist.is_root:
            meta = {"framework": cfg.framework, "epoch": state.epoch,
                    "world_size": self.dist.size, "reason": reason,
                    "pipeline": self.train_pipe.state_dict(),
                    "config": cfg.model_dump(mode="json")}
            path = write_checkpoint(cfg.checkpoint_dir, state.step, meta,
                                    lambda d: self.backend.write_payload(d, rng),
                                    cfg.checkpoint.keep)
            self.logger.info(f"saved checkpoint {path} ({reason})")
        state.last_checkpoint = checkpoint_path(cfg.checkpoint_dir, state.step)
        state.saved_step = state.step

    def finish(self, totals: Throughput, recent_losses: deque[float], status: str) -> None:
        """Collective: the run's data-wait share is averaged over all ranks."""
        waits = self.backend.allreduce_sum({"wait": totals.data_wait_s, "step": totals.step_s})
        summary = {
            "status": status, "framework": self.cfg.framework, "world_size": self.dist.size,
            "step": self.state.step, "epoch": self.state.epoch,
            "epochs_done": round(self.state.step / self.steps_per_epoch, 3),
            "final_loss": sum(recent_losses) / len(recent_losses) if recent_losses else None,
            "val": getattr(self, "last_val", {}),
            "train_seconds": totals.step_s, "samples_per_s": totals.samples_per_s,
            "data_wait_share": waits["wait"] / waits["step"] if waits["step"] else 0.0,
            "checkpoint": str(self.state.last_checkpoint) if self.state.last_checkpoint else None,
            "pipeline": self.train_pipe.stats(),
        }
        self.logger.summary(summary)


def train(cfg: RunConfig) -> int:
    return Trainer(cfg).run()

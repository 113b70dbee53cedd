"""What one rank reads at one world size, and the steps that makes (train/loop.py holds one):

    build(dist)      the train (and val) pipelines of rank dist.rank of dist.size and the
                     optimizer steps per epoch; the data spec the first time (an elastic
                     reset to another rank or world size builds the pipelines again)
    plan(step, n)    the steps to train, the global batch and the lr schedule, from the train
                     pipeline's position after `step` steps and the world size n
    open_loaders()   the framework's loaders over the pipelines, when training starts
    begin_epoch()    the epoch the next steps read, and whether to read ahead into the next
    close()          loader worker processes and read-ahead threads stopped

It reads the data, train and optim sections (the pipelines, the batch rule, the schedule).
"""

from __future__ import annotations

from collections.abc import Iterable

from ringfeed.errors import UserError
from ringfeed.train.backends.base import Backend, Dist
from ringfeed.train.checkpoint.changes import step_batch
from ringfeed.train.config import RunConfig
from ringfeed.train.data import (
    DataSpec,
    SyntheticPipeline,
    TrainPipeline,
    infer_spec,
    make_pipeline,
)
from ringfeed.train.schedule import LRSchedule, make_schedule


class Feed:
    """One rank's pipelines and loaders, and the step plan they make."""

    cfg: RunConfig
    k: int  # micro-batches per optimizer step (train.accumulate)
    train_pipe: TrainPipeline | None
    val_pipe: TrainPipeline | None
    loader: Iterable | None  # the framework's loaders over the pipes, made when training starts
    val_loader: Iterable | None
    spec: DataSpec | None  # what the model sees, from the first train pipeline
    built_for: tuple[int, int] | None  # (rank, world size) of the pipelines
    steps_per_epoch: int
    # set by plan() from the pipeline's position and the world size
    total_steps: int
    global_batch: int
    schedule: LRSchedule

    def __init__(self, cfg: RunConfig, k: int):
        self.cfg, self.k = cfg, k
        self.train_pipe = self.val_pipe = self.loader = self.val_loader = self.spec = None
        self.built_for = None

    def build(self, dist: Dist) -> None:
        """The pipelines of this rank at this world size, unless built for them already
        (loaders made for another are closed; new ones when training starts); the data spec
        the first time."""
        if self.built_for == (dist.rank, dist.size):
            return
        self.close()
        self.built_for = (dist.rank, dist.size)
        self.train_pipe, self.val_pipe, self.steps_per_epoch = make_pipelines(
            self.cfg, dist, self.k)
        if self.spec is None:
            self.spec = infer_spec(self.cfg, self.train_pipe)

    def plan(self, step: int, world_size: int) -> None:
        """total_steps, global_batch and the lr schedule after `step` steps at this world
        size; train.stop_after_step ends the run early (the schedule plans the whole run)."""
        self.total_steps, self.global_batch, self.schedule = plan_steps(
            self.cfg, self.train_pipe, step, self.steps_per_epoch, world_size, self.k)
        if self.cfg.train.stop_after_step is not None:
            self.total_steps = min(self.total_steps, self.cfg.train.stop_after_step)

    def open_loaders(self, backend: Backend) -> None:
        """The backend's loaders over the pipelines, unless open already."""
        if self.loader is None and isinstance(self.train_pipe, SyntheticPipeline):
            self.loader = self.train_pipe.loader(backend, self.cfg.framework)
        elif self.loader is None:
            self.loader = backend.loader(self.train_pipe)
            self.val_loader = backend.loader(self.val_pipe) if self.val_pipe else None

    def begin_epoch(self, step: int) -> int:
        """The epoch steps after `step` read: the next one once this one's batches are
        exhausted (also when resumed at its end); the one after it is read ahead only if the
        run goes on into it."""
        pipe = self.train_pipe
        if pipe.batches_remaining == 0:
            pipe.set_epoch(pipe.epoch + 1)
        pipe.expect_next_epoch(step + pipe.batches_remaining // self.k < self.total_steps)
        return pipe.epoch

    def header(self, world_size: int) -> str:
        """The run's first line: framework, ranks, model, data, batch, steps, precision, lr."""
        cfg, spec = self.cfg, self.spec
        return (
            f"ringfeed train: {cfg.framework}, {world_size} rank(s), model {cfg.model.name}, "
            f"{spec.task} on {'synthetic ' if cfg.data.synthetic else ''}{spec.input_key} "
            f"{spec.input_shape}, global batch "
            f"{self.global_batch} = {world_size} x {cfg.data.batch_size} x {self.k} "
            f"accumulated, {self.steps_per_epoch} steps/epoch, {self.total_steps} steps, "
            f"{cfg.train.precision}, peak lr {self.schedule.peak:.3g}")

    def close(self) -> None:
        """Stop loader worker processes (torch) and read-ahead threads now rather than at
        interpreter exit."""
        for closable in (self.loader, self.val_loader, self.train_pipe):
            close = getattr(closable, "close", None)  # (a TensorLoader has none)
            if close is not None:
                close()
        self.loader = self.val_loader = self.built_for = None


def make_pipelines(cfg: RunConfig, dist: Dist, k: int
                   ) -> tuple[TrainPipeline, TrainPipeline | None, int]:
    """(train pipeline, val pipeline or None, optimizer steps per epoch) of rank `dist.rank` of
    `dist.size`, for steps of k micro-batches; UserError when an epoch holds no step.
    data.synthetic: one batch made once, no validation."""
    if cfg.data.synthetic:
        synthetic = SyntheticPipeline(cfg, dist.rank, dist.size)
        return synthetic, None, synthetic.batches_per_epoch // k
    train_pipe = make_pipeline(cfg, "train", dist.rank, dist.size)
    val_pipe = make_pipeline(cfg, "val", dist.rank, dist.size) if cfg.val_source else None
    steps_per_epoch = train_pipe.batches_per_epoch // k
    if steps_per_epoch == 0:
        raise UserError(
            f"data.train: {train_pipe.batches_per_epoch} batches of {cfg.data.batch_size} per "
            f"rank per epoch on {dist.size} ranks is fewer than train.accumulate={k} (lower "
            "data.batch_size or train.accumulate)")
    return train_pipe, val_pipe, steps_per_epoch


def plan_steps(cfg: RunConfig, pipe: TrainPipeline, step: int, steps_per_epoch: int,
               world_size: int, k: int) -> tuple[int, int, LRSchedule]:
    """(total steps, global batch, lr schedule) from the pipeline's position and the world
    size: train.max_steps, or the steps done, what is left of this epoch and the epochs
    after it."""
    if cfg.train.max_steps:
        total = cfg.train.max_steps
    else:
        epochs_after = max(0, cfg.train.epochs - pipe.epoch - 1)
        total = step + pipe.batches_remaining // k + epochs_after * steps_per_epoch
    # where epoch 0 began as this world size counts steps (0 unless an earlier part of the
    # run had another): the pipeline's next epoch starts after the steps left in this one
    epoch_zero = step + pipe.batches_remaining // k - (pipe.epoch + 1) * steps_per_epoch
    batch = step_batch(cfg.data.global_batch_size, cfg.data.batch_size, world_size, k)
    if cfg.data.order == "global":  # the global batch is the same at any size, and so is
        # the rate: optim.lr as given (no world-size scaling)
        return total, batch, make_schedule(cfg.optim, 1, 1, total, steps_per_epoch, epoch_zero)
    return total, batch, make_schedule(cfg.optim, world_size, k, total, steps_per_epoch,
                                       epoch_zero)

"""Horovod Elastic training: workers may fail, leave and join while the job runs.

    horovodrun -np 3 --min-np 2 --max-np 3 --host-discovery-script ./hosts.sh \
        ringfeed train cfg.yaml --elastic

Every `elastic.commit_every_steps` steps each worker commits, in memory, the model, the
optimizer (and fp16 loss scaler) and the TrainState with the pipeline's position (Horovod's
`State.commit`, which is also where host changes announced by the discovery script are
noticed). Then:

- a worker dies: the others' next collective fails (HorovodInternalError); they restore the last
  commit, Horovod re-forms the ring without the dead worker's host, and training continues from
  that commit: the steps since it are redone (a *rollback*);
- the discovery script adds or removes hosts: at the next commit every worker stops
  (HostsUpdatedInterrupt), Horovod re-forms the ring, and workers that join receive the
  committed state by broadcast from rank 0 (an old worker: Horovod keeps the oldest hosts first).

After every reset each worker rebuilds its pipelines for its new rank and world size and loads
the committed pipeline state, so the rest of the epoch is dealt over the new ranks, every
remaining sample exactly once (pipeline/README.md). The batch/lr rule: the per-rank batch stays
`data.batch_size`, so the global batch follows the world size, and so does the peak lr when
`optim.scale_lr_with_world_size` (Horovod's linear scaling rule); the steps left are recounted
from the pipeline's position. Checkpoints are still written to disk every
`checkpoint.every_steps` for restarts of the whole job.

`ElasticRun` is a strategy the loop (train/loop.py) holds and calls: `run()` in place of the
loop's start/train/wrap_up, `after_step()` after every step. It owns Horovod's elastic State;
the trainer is reached only through its methods (`commit_values()` for a commit,
`recovery_counts()`, `rejoin()` and `elastic_reset()` after a reset, `position()`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ringfeed.train.runstate import Recovery, SignalRequests

if TYPE_CHECKING:  # (type hints only: the loop imports this module)
    from ringfeed.train.backends.base import Backend
    from ringfeed.train.loop import Trainer


class ElasticRun:
    trainer: Trainer
    backend: Backend
    commit_every: int  # elastic.commit_every_steps
    state: Any  # Horovod's elastic State (model, optimizer, scaler, progress, recovery)
    lost_steps: int | None  # trained past the last commit when a reset came

    def __init__(self, trainer: Trainer, backend: Backend, commit_every: int):
        self.trainer, self.backend, self.commit_every = trainer, backend, commit_every
        self.state = None
        self.lost_steps = None

    def run(self, signals: SignalRequests) -> bool:
        """The trainer is prepared (pipelines, model), nothing collective has happened: a
        worker that joins a running job enters Horovod's retry loop straight away, and
        Horovod's sync is the first collective it meets. True when a signal stopped the run."""
        self.state = self.backend.elastic_state(progress=None,
                                                recovery=self.trainer.recovery_counts())
        self.state.register_reset_callbacks([self._on_reset])
        return self.backend.elastic_run(self._generation)(self.state, signals)

    def _generation(self, state: Any, signals: SignalRequests) -> bool:
        """One stretch of training at one world size; runs again after every reset."""
        t = self.trainer
        first = state.progress is None
        # the committed state (synced from rank 0) at this worker's rank and size
        dist = self.backend.refresh_dist()
        t.rejoin(dist, Recovery(**state.recovery), state.progress)
        if first:  # the checkpoint on disk, if any; errors agreed across ranks
            t.start(note=f"; elastic, commit every {self.commit_every} steps")
        else:
            # Rank 0 lived through the reset (Horovod keeps the oldest hosts first); a worker
            # that just joined learns from it what the reset cost.
            lost = self.backend.broadcast_object(self.lost_steps)
            step, epoch = t.position()

            def note(r: Recovery) -> str:
                rolled = f"rolled back {lost} step(s); " if lost else ""
                return (f"\nelastic: {dist.size} rank(s) from step {step} (epoch {epoch}); "
                        f"{rolled}so far {r.elastic_resets} reset(s), {r.rollbacks} rollback(s)")

            t.elastic_reset(lost, note)
        self.commit()
        stopped = t.train(signals)
        t.wrap_up(stopped)
        return stopped

    def _on_reset(self) -> None:
        """After a failure (the state already restored to the last commit) or a host change.
        Steps past the committed one were trained and are lost; Horovod's sync, which comes
        next, resets plain values to the committed ones, so this is only kept locally."""
        committed = self.state.progress["step"] if self.state.progress else 0
        self.lost_steps = max(0, self.trainer.position()[0] - committed)
        self.backend.after_rollback()

    def after_step(self, step: int) -> None:
        """Optimizer step `step` is done: commit every commit_every steps."""
        if step % self.commit_every == 0:
            self.commit()

    def commit(self) -> None:
        """Copy progress into the elastic state and commit it (new objects every time:
        Horovod keeps references to the committed values)."""
        # (samples.jsonl holds every committed step)
        self.state.progress, self.state.recovery = self.trainer.commit_values()
        self.state.commit()

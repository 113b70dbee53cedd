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
`optim.scale_lr_with_world_size` (Horovod's linear scaling rule); the steps left are re-planned
from the pipeline's position. Checkpoints are still written to disk every
`checkpoint.every_steps` for restarts of the whole job.
"""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import Any

from train.data import infer_spec
from train.loop import EXIT_PREEMPTED, Recovery, SignalRequests, Trainer, TrainState


class ElasticTrainer(Trainer):
    def run(self) -> int:
        self.build_pipelines()
        self.spec = infer_spec(self.cfg, self.train_pipe)
        self.backend.build(self.spec)
        # Nothing collective happens before the elastic function: a worker that joins a running
        # job enters it straight away, and Horovod's sync is the first collective it meets.
        state = self.backend.elastic_state(progress=None, recovery=asdict(self.recovery))
        state.register_reset_callbacks([lambda: self._on_reset(state)])
        self._lost_steps: int | None = None
        signals = SignalRequests(self.cfg.checkpoint.save_on_signal)
        try:
            stopped = self.backend.elastic_run(self._generation)(state, signals)
        finally:
            signals.restore()
            self.close_loaders()
            self.close_logs()
        return EXIT_PREEMPTED if stopped else 0

    def _generation(self, state: Any, signals: SignalRequests) -> bool:
        """One stretch of training at one world size; runs again after every reset."""
        first = state.progress is None
        self._adopt(state)
        self.plan()
        if first:
            self.say(self.header() + f"; elastic, commit every "
                     f"{self.cfg.elastic.commit_every_steps} steps")
            self.restore()  # the checkpoint on disk, if any; errors agreed across ranks
            self.plan()
        else:
            # Rank 0 lived through the reset (Horovod keeps the oldest hosts first); a worker
            # that just joined learns from it what the reset cost.
            lost = self.backend.broadcast_object(self._lost_steps)
            r = self.recovery
            r.elastic_resets += 1
            r.rollbacks += int(lost > 0)
            r.steps_redone += lost
            rolled = f"rolled back {lost} step(s); " if lost else ""
            self.say(f"elastic: {self.dist.size} rank(s) from step {self.state.step} (epoch "
                     f"{self.state.epoch}); {rolled}so far {r.elastic_resets} reset(s), "
                     f"{r.rollbacks} rollback(s); global batch {self.global_batch}, peak lr "
                     f"{self.schedule.peak:.3g}, {self.total_steps} steps")
        self.close_logs()
        self.open_logs()
        if not first:
            self.logger.event(self.state.step, {"event": "elastic_reset", "size": self.dist.size,
                                                "steps_redone": lost})
        self.commit(state)
        stopped = self.train_until_done(signals)
        self.wrap_up(stopped)
        return stopped

    def _adopt(self, state: Any) -> None:
        """Take the committed state (synced from rank 0) at this worker's rank and size."""
        before = self.dist
        self.dist = self.backend.refresh_dist()
        if (before.rank, before.size) != (self.dist.rank, self.dist.size):
            self.build_pipelines()
        self.recovery = Recovery(**state.recovery)
        if state.progress is not None:
            progress = dict(state.progress)
            self.train_pipe.load_state_dict(progress.pop("pipeline"))
            checkpoint = progress.pop("last_checkpoint")
            self.state = TrainState(**progress,
                                    last_checkpoint=Path(checkpoint) if checkpoint else None)

    def _on_reset(self, state: Any) -> None:
        """After a failure (the state already restored to the last commit) or a host change.
        Steps past the committed one were trained and are lost; Horovod's sync, which comes
        next, resets plain values to the committed ones, so this is only kept locally."""
        committed = state.progress["step"] if state.progress else 0
        self._lost_steps = max(0, self.state.step - committed)
        self.backend.after_rollback()

    def after_step(self) -> None:
        if self.state.step % self.cfg.elastic.commit_every_steps == 0:
            self.commit(self._state)

    def commit(self, state: Any) -> None:
        """Copy progress into the elastic state and commit it (new objects every time:
        Horovod keeps references to the committed values)."""
        self._state = state
        self.flush_sample_log()  # samples.jsonl holds every committed step
        progress = asdict(self.state)
        progress["last_checkpoint"] = (str(self.state.last_checkpoint)
                                       if self.state.last_checkpoint else None)
        progress["pipeline"] = self.train_pipe.state_dict()
        state.progress = progress
        state.recovery = asdict(self.recovery)
        state.commit()

"""Horovod Elastic's strategy (train/resilience/elastic.py): when it commits, what a reset rolls
back and how it is counted, who starts the run and who is told about the reset. Run here in
one process under Horovod's own elastic machinery (`horovod.common.elastic`: ObjectState and
the `run_fn` retry loop that `hvd.elastic.run` is), with a broadcast that is the identity and
a trainer that only counts steps; real multi-worker elastic jobs are in test_fault_elastic.py."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

import pytest
from horovod.common.elastic import ObjectState, run_fn
from horovod.common.exceptions import HorovodInternalError
from horovod.runner.elastic.worker import HostUpdateResult

from ringfeed.train.backends.base import Dist
from ringfeed.train.resilience.elastic import ElasticRun
from ringfeed.train.runstate import Recovery, SignalRequests


class OneProcessBackend:
    """What ElasticRun needs of a backend, over Horovod's ObjectState with one worker."""

    def __init__(self) -> None:
        self.resets = 0
        self.rollbacks_seen = 0
        self.state: ObjectState | None = None

    def elastic_state(self, **values: Any) -> ObjectState:
        self.state = ObjectState(bcast_object=lambda obj: obj, get_rank=lambda: 0, **values)
        return self.state

    def elastic_run(self, fn):
        return run_fn(fn, self._reset)

    def _reset(self) -> None:
        self.resets += 1

    def refresh_dist(self) -> Dist:
        return Dist(0, 1, 0)

    def broadcast_object(self, obj: Any) -> Any:
        return obj

    def after_rollback(self) -> None:
        self.rollbacks_seen += 1


class CountingTrainer:
    """A trainer that trains `max_steps` steps, failing as `fail_at` says: {step: what to do
    after that step's optimizer step} ("collective": a lost worker, HorovodInternalError;
    "hosts": the discovery script announced a host before the next commit)."""

    def __init__(self, elastic_of, max_steps: int, fail_at: dict[int, str] | None = None):
        self.elastic_of = elastic_of
        self.max_steps = max_steps
        self.fail_at = dict(fail_at or {})
        self.step = 0
        self.recovery = Recovery()
        self.commits: list[int] = []
        self.started: list[str] = []
        self.resets: list[tuple[int, str]] = []
        self.rejoined: list[int | None] = []
        self.trained: list[int] = []  # every step trained, redone ones again

    # the trainer's side of the contract (train/loop.py)
    def recovery_counts(self) -> dict[str, int]:
        return asdict(self.recovery)

    def commit_values(self) -> tuple[dict[str, Any], dict[str, int]]:
        self.commits.append(self.step)
        return {"step": self.step}, self.recovery_counts()

    def position(self) -> tuple[int, int]:
        return self.step, 0

    def rejoin(self, dist: Dist, recovery: Recovery, progress: dict[str, Any] | None) -> None:
        self.recovery = recovery
        self.rejoined.append(None if progress is None else progress["step"])
        if progress is not None:
            self.step = progress["step"]

    def start(self, note: str = "") -> None:
        self.started.append(note)

    def elastic_reset(self, lost: int, note) -> None:
        self.recovery.count_reset(lost)
        self.resets.append((lost, note(self.recovery)))

    def train(self, signals: SignalRequests) -> bool:
        elastic = self.elastic_of()
        while self.step < self.max_steps:
            self.step += 1
            self.trained.append(self.step)
            what = self.fail_at.pop(self.step, None)
            if what == "collective":
                raise HorovodInternalError(f"rank 1 lost at step {self.step}")
            if what == "hosts":
                elastic.state.on_hosts_updated(self.step, HostUpdateResult.added)
            elastic.after_step(self.step)
        return False

    def wrap_up(self, stopped: bool) -> None:
        self.wrapped = stopped


def run(max_steps: int, commit_every: int, fail_at: dict[int, str] | None = None):
    backend = OneProcessBackend()
    holder: list[ElasticRun] = []
    trainer = CountingTrainer(lambda: holder[0], max_steps, fail_at)
    elastic = ElasticRun(trainer, backend, commit_every)
    holder.append(elastic)
    stopped = elastic.run(SignalRequests(enabled=False))
    return stopped, trainer, backend, elastic


@pytest.fixture(autouse=True)
def _no_elastic_launcher(monkeypatch):
    """Outside `horovodrun --host-discovery-script` there is no driver to register with."""
    monkeypatch.delenv("HOROVOD_GLOO_RENDEZVOUS_ADDR", raising=False)


def test_a_run_without_failures_commits_at_the_start_and_every_commit_every_steps():
    stopped, trainer, backend, _ = run(max_steps=10, commit_every=4)
    assert stopped is False and trainer.wrapped is False
    assert trainer.commits == [0, 4, 8]
    assert trainer.trained == list(range(1, 11))
    assert trainer.started == ["; elastic, commit every 4 steps"]  # the checkpoint on disk
    assert trainer.rejoined == [None] and trainer.resets == [] and backend.resets == 0


def test_a_lost_worker_rolls_back_to_the_last_commit_and_redoes_the_steps_after_it():
    _, trainer, backend, elastic = run(max_steps=10, commit_every=3, fail_at={8: "collective"})
    assert backend.resets == 1 and backend.rollbacks_seen == 1
    assert elastic.lost_steps == 2  # steps 7 and 8 trained past the commit of step 6
    assert trainer.rejoined == [None, 6]  # the committed progress, restored by Horovod
    assert trainer.trained == [*range(1, 9), 7, 8, 9, 10]
    assert trainer.started == ["; elastic, commit every 3 steps"]  # not started again
    [(lost, note)] = trainer.resets
    assert lost == 2
    assert "elastic: 1 rank(s) from step 6 (epoch 0); rolled back 2 step(s); so far 1 " \
           "reset(s), 1 rollback(s)" in note
    assert trainer.recovery.steps_redone == 2
    assert trainer.commits == [0, 3, 6, 6, 9]  # each generation commits where it starts


def test_only_the_steps_past_the_last_commit_are_lost():
    _, trainer, _, elastic = run(max_steps=8, commit_every=3, fail_at={7: "collective"})
    assert elastic.lost_steps == 1 and trainer.rejoined == [None, 6]
    # a step due to commit that fails in its collective: its commit never happened
    _, trainer, _, elastic = run(max_steps=8, commit_every=3, fail_at={6: "collective"})
    assert elastic.lost_steps == 3 and trainer.rejoined == [None, 3]


def test_a_host_added_is_noticed_at_the_next_commit_and_rolls_nothing_back():
    _, trainer, backend, elastic = run(max_steps=9, commit_every=3, fail_at={5: "hosts"})
    assert backend.resets == 1 and elastic.lost_steps == 0
    # the commit of step 6 raised HostsUpdatedInterrupt after saving: training goes on from 6
    assert trainer.rejoined == [None, 6]
    assert trainer.trained == list(range(1, 10))
    [(lost, note)] = trainer.resets
    assert lost == 0 and "rolled back" not in note
    assert (trainer.recovery.elastic_resets, trainer.recovery.rollbacks) == (1, 0)


def test_recovery_counts_travel_with_the_commit():
    _, trainer, _, _ = run(max_steps=12, commit_every=2,
                           fail_at={5: "collective", 9: "collective"})
    r = trainer.recovery
    assert (r.elastic_resets, r.rollbacks, r.steps_redone) == (2, 2, 2)
    assert "so far 2 reset(s), 2 rollback(s)" in trainer.resets[-1][1]

"""train/checkpoint/checkpointer.py in-process, on one rank with a stand-in backend: restore,
the save rules (due, due at the end), snapshot then write, checkpoint.on_error."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from ringfeed.errors import UserError
from ringfeed.train.backends.base import Dist, StepResult
from ringfeed.train.checkpoint.checkpointer import Checkpointer
from ringfeed.train.checkpoint.files import CheckpointWriteError, list_checkpoints
from ringfeed.train.config import RunConfig
from ringfeed.train.runstate import TrainState


class OneRank:
    """The backend calls the Checkpointer makes, for a job of one rank."""

    def __init__(self) -> None:
        self.dist = Dist(0, 1, 0)
        self.loaded: list[Path] = []
        self.synced: list[bool] = []

    def broadcast_object(self, obj: Any) -> Any:
        return obj

    def sync_from_root(self, resumed: bool) -> None:
        self.synced.append(resumed)

    def sync_replicas(self) -> None:
        pass

    def rng_states(self) -> Any:
        return ["rng"]

    def payload(self, rng_states: Any, copy: bool) -> Any:
        return lambda directory: (Path(directory) / "state.bin").write_text(
            json.dumps(rng_states))

    def read_payload(self, directory: Path) -> None:
        self.loaded.append(Path(directory))


class Pipe:
    def __init__(self) -> None:
        self.loaded: list[dict] = []

    def state_dict(self) -> dict:
        return {"epoch": 1, "consumed": 7}

    def load_state_dict(self, state: dict) -> None:
        self.loaded.append(state)


def checkpointer_of(cfg: RunConfig, backend: Any, say: Any, log: Any,
                    record: Any = None) -> Checkpointer:
    """The Checkpointer of a run of `cfg`, built as train/loop.py builds it."""
    return Checkpointer(cfg.checkpoint, cfg.checkpoint_dir, backend, framework=cfg.framework,
                        config=cfg.model_dump(mode="json"),
                        staging=Path(cfg.output.dir) / ".checkpoint-staging",
                        retry_budget_s=cfg.data.retry_budget_s, say=say, log=log, record=record)


def make(tmp_path: Path, **checkpoint: Any) -> tuple[Checkpointer, OneRank, list[str]]:
    cfg = RunConfig.model_validate({"framework": "torch", "data": {"train": "unused"},
                                    "output": {"dir": str(tmp_path / "run")},
                                    "checkpoint": checkpoint})
    backend, lines = OneRank(), []
    return checkpointer_of(cfg, backend, lines.append, lines.append), backend, lines


def test_a_fresh_dir_starts_at_step_0_and_a_saved_step_is_resumed(tmp_path):
    ckpt, backend, lines = make(tmp_path, keep=2)
    assert ckpt.restore(Pipe(), restarts=0) is None
    assert backend.synced == [False] and "starting at step 0" in lines[-1]
    pipe = Pipe()
    directory = Path(ckpt.directory)
    for step in (10, 20, 30):
        (saved,) = ckpt.save(TrainState(step=step, epoch=1), pipe, "every_steps")
        assert saved.location == str(directory / f"ckpt-{step:09d}") and saved.error is None
        assert saved.blocked_s >= saved.write_s > 0
        assert f"saved checkpoint {saved.location} (every_steps): training blocked " \
            in lines[-1]
    assert [p.name for p in list_checkpoints(directory)] == ["ckpt-000000020", "ckpt-000000030"]
    resumed, backend, lines = make(tmp_path, resume="auto")
    pipe = Pipe()
    state = resumed.restore(pipe, restarts=2)
    assert state == TrainState(step=30, epoch=1,
                               last_checkpoint=str(directory / "ckpt-000000030"), saved_step=30)
    assert pipe.loaded == [{"epoch": 1, "consumed": 7}]
    assert backend.loaded == [directory / "ckpt-000000030"] and backend.synced == [True]
    assert lines[-1].endswith("; restart 2 by `ringfeed run`")


def test_resume_none_refuses_a_dir_of_an_earlier_run_on_every_rank(tmp_path):
    ckpt, _, _ = make(tmp_path)
    ckpt.save(TrainState(step=5), Pipe(), "end")
    again, backend, _ = make(tmp_path)
    with pytest.raises(UserError, match="already holds checkpoints of an earlier run"):
        again.restore(Pipe(), restarts=0)
    assert backend.synced == []  # decided before any rank took state


def test_a_checkpoint_is_due_on_a_signal_every_n_steps_and_at_an_unsaved_end(tmp_path):
    ckpt, _, _ = make(tmp_path, every_steps=4)
    assert ckpt.due(4, StepResult(1.0)) == "every_steps"
    assert ckpt.due(5, StepResult(1.0)) is None
    assert ckpt.due(5, StepResult(1.0, save_requested=True)) == "signal"
    assert ckpt.due(5, StepResult(1.0, stop_requested=True)) == "signal"
    assert ckpt.due_at_end(TrainState(step=6, saved_step=4))
    assert not ckpt.due_at_end(TrainState(step=6, saved_step=6))


def test_a_snapshot_is_taken_before_and_apart_from_its_write(tmp_path):
    ckpt, _, _ = make(tmp_path)
    snapshot = ckpt.snapshot(TrainState(step=3, epoch=2), Pipe(), "signal")
    assert not Path(ckpt.directory).exists()  # nothing written yet
    assert snapshot.meta["pipeline"] == {"epoch": 1, "consumed": 7}
    path = Path(ckpt.write(snapshot).location)
    meta = json.loads((path / "meta.json").read_text())
    assert (meta["step"], meta["epoch"], meta["reason"]) == (3, 2, "signal")
    assert json.loads((path / "state.bin").read_text()) == ["rng"]


@pytest.mark.parametrize("on_error", ["fail", "warn"])
def test_a_failed_write_raises_or_is_reported_and_not_retried_at_the_end(tmp_path, on_error):
    ckpt, _, lines = make(tmp_path, on_error=on_error)
    Path(ckpt.directory).parent.mkdir(parents=True)
    Path(ckpt.directory).write_text("a file, not a directory")
    state = TrainState(step=8)
    if on_error == "fail":
        with pytest.raises(CheckpointWriteError, match="at step 8"):
            ckpt.save(state, Pipe(), "every_steps")
        return
    (saved,) = ckpt.save(state, Pipe(), "every_steps")
    assert saved.location is None and "cannot write checkpoint" in saved.error
    assert "checkpoint at step 8 NOT saved" in lines[-1]
    assert not ckpt.due_at_end(state)


def test_a_local_dir_keeps_renaming_and_loses_what_killed_writes_and_deletes_left(tmp_path):
    from ringfeed.train.checkpoint.files import remove_stale_temporaries, write_checkpoint

    write_checkpoint(tmp_path, 10, {}, lambda d: (d / "state.bin").write_text("10"), keep=3)
    (tmp_path / ".ckpt-000000020.tmp-99").mkdir()  # a write killed before its rename
    (tmp_path / "ckpt-000000030").mkdir()  # a delete cut short after its meta.json went
    (tmp_path / "ckpt-000000030" / "state.bin").write_text("30")
    assert remove_stale_temporaries(tmp_path) == ["ckpt-000000030"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt-000000010"]

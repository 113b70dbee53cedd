"""The TPE loop of `ringfeed tune` (train/tune/tpe.py) and the trial result it reads
(train/tune/launch.py), without launching jobs: the budget a worker asks within, a retried
trial's checkpoint found along its chain of interrupted attempts, a trial's run dir, and a
finished job's value or the reason it has none. Real TPE studies: test_tune.py."""

from __future__ import annotations

import threading
import time

import pytest
from tune_util import add_trial, make_search, memory_study, write_checkpoint_dir

from ringfeed.train.tune.launch import outcome_value
from ringfeed.train.tune.study import TrialFailed
from ringfeed.train.tune.tpe import TPELoop, carried_over, fresh_dir
from ringfeed.train.tune.trial import Outcome

# (open_study filters optuna's ExperimentalWarning; these studies are made without it)
pytestmark = pytest.mark.filterwarnings("ignore::optuna.exceptions.ExperimentalWarning")


def test_workers_ask_for_trials_until_the_budget_counts_running_and_finished_ones(tmp_path):
    search = make_search(tmp_path, trials=3)
    study = memory_study()
    add_trial(study, search, value=0.5)
    add_trial(study, search, "FAIL")  # interrupted: retried, not counted
    loop = TPELoop(search, study, threading.Event())
    first, second = loop.next_trial(), loop.next_trial()
    assert first is not None and second is not None and loop.running == 2
    assert loop.next_trial() is None  # 1 finished + 2 running = trials
    study.tell(first, 0.1)
    loop.running -= 1
    assert loop.next_trial() is None  # 2 finished + 1 running


def test_no_trial_is_asked_for_once_stopped_or_out_of_time(tmp_path):
    search = make_search(tmp_path, trials=10, hours=1)
    stop = threading.Event()
    loop = TPELoop(search, memory_study(), stop)
    assert loop.deadline == pytest.approx(time.monotonic() + 3600, abs=60)
    loop.deadline = time.monotonic() - 1
    assert loop.next_trial() is None
    loop.deadline = None
    stop.set()
    assert loop.next_trial() is None


def test_a_retry_continues_from_the_nearest_attempt_that_left_a_checkpoint(tmp_path):
    search = make_search(tmp_path)
    study = memory_study()
    first = add_trial(study, search, "FAIL", run_dir=str(tmp_path / "t0"))
    write_checkpoint_dir(tmp_path / "t0", 20)
    second = add_trial(study, search, "FAIL", run_dir=str(tmp_path / "t1"),
                       retry_of=first.number)  # killed before its first checkpoint
    assert carried_over(study, second.number) == (
        tmp_path / "t0" / "checkpoints" / "ckpt-000000020", tmp_path / "t0")
    write_checkpoint_dir(tmp_path / "t1", 30)
    assert carried_over(study, second.number)[1] == tmp_path / "t1"
    assert carried_over(study, None) is None


def test_a_run_dir_left_by_a_deleted_study_is_moved_aside(tmp_path):
    run_dir = tmp_path / "trials" / "trial-0000"
    assert fresh_dir(run_dir) == run_dir and run_dir.is_dir()
    (run_dir / "metrics.jsonl").write_text("old\n")
    fresh_dir(run_dir)
    assert list(run_dir.iterdir()) == []
    [aside] = [p for p in run_dir.parent.iterdir() if p.name.startswith("trial-0000.old-")]
    assert (aside / "metrics.jsonl").read_text() == "old\n"


def test_a_finished_jobs_value_is_its_last_metric_or_a_failure_saying_why(tmp_path):
    search = make_search(tmp_path)
    study = memory_study()
    done = Outcome(0, 3.0)
    (tmp_path / "metrics.jsonl").write_text(
        '{"step": 5, "loss": 1.2}\n{"step": 10, "val_accuracy": 0.5}\n'
        '{"step": 20, "val_accuracy": 0.75}\n')
    trial = study.ask(search.distributions())
    assert outcome_value(search, trial, done, tmp_path) == 0.75
    assert outcome_value(search, trial, done, tmp_path, at_step=10) == 0.5
    with pytest.raises(TrialFailed, match="finished without val_accuracy at step 30 in "
                                          "metrics.jsonl \\(validation metrics need a val "
                                          "split\\); it has: loss, val_accuracy"):
        outcome_value(search, trial, done, tmp_path, at_step=30)
    assert trial.user_attrs["failure"] == "no_metric" and trial.user_attrs["wall_s"] == 3.0
    (tmp_path / "metrics.jsonl").write_text('{"step": 10, "val_accuracy": NaN}\n')
    with pytest.raises(TrialFailed, match="val_accuracy is nan"):
        outcome_value(search, trial, done, tmp_path)
    assert trial.user_attrs["failure"] == "crash"

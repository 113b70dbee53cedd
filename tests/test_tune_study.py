"""The Optuna study behind `ringfeed tune` (train/tune/study.py): one study per algorithm and
metric, the budget (what counts as a finished trial), trials of a dead `ringfeed tune` marked
failed and retried a bounded number of times, and the pruner each setting makes. On a SQLite
file in tmp_path, as the tuner keeps it."""

from __future__ import annotations

import optuna
import pytest
from optuna.trial import TrialState
from tune_util import add_trial, make_search, memory_study

from ringfeed.errors import UserError
from ringfeed.train.tune.study import counted, make_pruner, open_study, recover, retry_interrupted
from ringfeed.train.tune.trial import owner

REFUSED = [
    ({"algorithm": "pbt", "space": {"optim.lr": "uniform(0.01, 0.1)"}},
     "algorithm: study 'search' in .* was made with algorithm 'tpe', not 'pbt'"),
    ({"metric": "val_loss"}, "metric: study 'search' .* made with metric 'val_accuracy'"),
    ({"direction": "minimize"}, "direction: study 'search' was made to maximize"),
]


def test_a_study_is_continued_and_one_made_for_another_search_refused(tmp_path):
    """(One SQLite file for all cases: creating one costs ~0.3 s.)"""
    search = make_search(tmp_path)
    study = open_study(search)
    add_trial(study, search, value=0.5)
    again = open_study(search)
    assert len(again.trials) == 1 and again.user_attrs == {"algorithm": "tpe",
                                                           "metric": "val_accuracy"}
    assert isinstance(again.sampler, optuna.samplers.TPESampler)
    assert (tmp_path / "study.db").is_file()
    for change, message in REFUSED:
        with pytest.raises(UserError, match=message):
            open_study(make_search(tmp_path, **change))
    other = open_study(make_search(tmp_path, study={"name": "another"}, **REFUSED[0][0]))
    assert isinstance(other.sampler, optuna.samplers.RandomSampler)  # PBT's first population


def test_a_storage_that_cannot_be_opened_is_one_line(tmp_path):
    search = make_search(tmp_path, study={"storage": "nosuchdb://x/y"})
    with pytest.raises(UserError, match="study.storage: cannot open nosuchdb://x/y"):
        open_study(search)


def test_the_budget_counts_finished_pruned_and_self_failed_trials_not_interrupted_ones(tmp_path):
    search = make_search(tmp_path)
    study = memory_study()
    add_trial(study, search, value=0.5)
    add_trial(study, search, "PRUNED")
    for failure in ("crash", "config", "timeout", "no_metric"):
        add_trial(study, search, "FAIL", failure=failure)
    add_trial(study, search, "FAIL")  # a dead worker's: no failure recorded
    add_trial(study, search, "FAIL", failure="interrupted")
    assert counted(study) == 6


def test_interrupted_trials_are_retried_with_their_parameters_up_to_retries_times(tmp_path):
    search = make_search(tmp_path)
    study = memory_study()
    first = add_trial(study, search, "FAIL", params={"optim.lr": 0.01})
    add_trial(study, search, "FAIL", failure="crash")  # its own fault: not retried
    add_trial(study, search, "FAIL", member=0)  # PBT reruns its own intervals
    assert retry_interrupted(study, retries=2) == [first.number]
    assert retry_interrupted(study, retries=2) == []  # already retried
    retry = study.ask(search.distributions())
    assert retry.params == {"optim.lr": 0.01} and retry.user_attrs["retry_of"] == first.number
    study.tell(retry, state=TrialState.FAIL)  # interrupted again
    assert len(retry_interrupted(study, retries=2)) == 1
    second = study.ask(search.distributions())
    study.tell(second, state=TrialState.FAIL)
    assert retry_interrupted(study, retries=2) == []  # two retries of the first: enough


def test_trials_left_running_by_a_dead_tuner_on_this_host_are_failed_not_a_live_ones(tmp_path):
    search = make_search(tmp_path)
    study = memory_study()
    me = owner()
    dead = {**me, "started": me["started"] - 100}  # this pid, another process's start time
    gone = add_trial(study, search, "RUNNING", owner=dead)
    alive = add_trial(study, search, "RUNNING", owner=me)
    elsewhere = add_trial(study, search, "RUNNING", owner={**dead, "host": "other-host"})
    recover(study)
    states = {t.number: t.state for t in study.get_trials()}
    assert states[gone.number] == TrialState.FAIL
    assert states[alive.number] == states[elsewhere.number] == TrialState.RUNNING


@pytest.mark.parametrize("fields, pruner", [
    ({}, optuna.pruners.NopPruner),
    ({"pruner": {"name": "asha"}}, optuna.pruners.SuccessiveHalvingPruner),
    ({"pruner": {"name": "median", "warmup_steps": 5}}, optuna.pruners.MedianPruner),
    ({"pruner": {"name": "median"}, "algorithm": "pbt"}, optuna.pruners.NopPruner),
])
def test_the_pruner_of_each_setting(tmp_path, fields, pruner):
    assert type(make_pruner(make_search(tmp_path, **fields))) is pruner

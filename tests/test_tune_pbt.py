"""Population-Based Training of `ringfeed tune` (train/tune/pbt.py), without launching members:
the intervals, who copies whom (the bottom quantile and crashed members take a top member's
checkpoint, decided once per seed and interval), explore's parameters, and carrying out the
plan (the donor's checkpoint and metrics adopted, recorded in the study, done once). A real
PBT study: test_tune.py."""

from __future__ import annotations

import json
import random
import threading

import pytest
from tune_util import add_trial, make_search, memory_study, write_checkpoint_dir

from ringfeed.errors import UserError
from ringfeed.train.tune.pbt import PBT, _lock
from ringfeed.train.tune.trial import newest_checkpoint

SPACE = {"optim.lr": "loguniform(1e-3, 1)", "optim.momentum": "uniform(0, 0.99)"}


def pbt(tmp_path, population: int = 4, quantile: float = 0.25, direction: str = "maximize",
        seed: int = 0, **pbt_fields) -> PBT:
    search = make_search(tmp_path, algorithm="pbt", space=SPACE, direction=direction,
                         seed=seed, pbt={"population": population, "interval": 10,
                                         "quantile": quantile, **pbt_fields})
    return PBT(search, memory_study(direction), threading.Event())


def finish_interval(p: PBT, g: int, values: dict[int, float | None]) -> dict[int, object]:
    """Member m's interval-g trial, complete with values[m] (None: it crashed)."""
    trials = {}
    for m, value in values.items():
        params = {"optim.lr": 0.01 * (m + 1), "optim.momentum": 0.5}
        attrs = {"member": m, "generation": g, "start_step": p.start(g), "end_step": p.ends[g]}
        if value is None:
            trials[m] = add_trial(p.study, p.search, "FAIL", params=params, failure="crash",
                                  **attrs)
        else:
            trials[m] = add_trial(p.study, p.search, value=value, params=params, **attrs)
    return trials


def test_intervals_end_every_interval_steps_and_at_max_steps(tmp_path):
    p = pbt(tmp_path)  # train.max_steps: 30 in the base config
    assert p.ends == [10, 20, 30] and [p.start(g) for g in range(3)] == [0, 10, 20]
    p.search.base_raw["train"] = {"max_steps": 25}
    assert PBT(p.search, p.study, p.stop).ends == [10, 20, 25]


@pytest.mark.parametrize("direction, best, worst", [("maximize", 3, 0), ("minimize", 0, 3)])
def test_the_bottom_quantile_takes_a_top_members_weights_and_perturbed_parameters(
        tmp_path, direction, best, worst):
    p = pbt(tmp_path, direction=direction, resample_probability=0.0)
    trials = finish_interval(p, 0, {0: 0.1, 1: 0.5, 2: 0.6, 3: 0.9})
    plan = p.decide(1)
    assert set(plan) == {"0", "1", "2", "3"}
    weak = plan[str(worst)]
    assert weak["exploited"] and weak["parent_member"] == best
    assert weak["parent_trial"] == trials[best].number
    assert weak["donor_value"] == trials[best].value
    donor_lr = trials[best].params["optim.lr"]
    assert weak["params"]["optim.lr"] in (pytest.approx(donor_lr * 0.8),
                                          pytest.approx(donor_lr * 1.2))
    for m in {0, 1, 2, 3} - {worst}:  # the others go on with their own weights and values
        assert plan[str(m)] == {"params": trials[m].params, "exploited": False,
                                "parent_member": m, "parent_trial": trials[m].number,
                                "value": trials[m].value}


def test_a_crashed_member_is_weak_whatever_the_quantile(tmp_path):
    p = pbt(tmp_path, population=5, quantile=0.2)
    finish_interval(p, 0, {0: 0.3, 1: None, 2: 0.5, 3: 0.9, 4: 0.7})
    plan = p.decide(1)
    exploited = sorted(int(m) for m, e in plan.items() if e["exploited"])
    assert exploited == [0, 1]  # the worst (0) and the crashed one (1)
    assert {plan["0"]["parent_member"], plan["1"]["parent_member"]} == {3}


def test_the_decision_depends_on_the_seed_and_the_results_only(tmp_path):
    plans = []
    for name, seed in (("a", 0), ("b", 0), ("c", 1)):
        p = pbt(tmp_path / name, population=8, quantile=0.5, seed=seed)
        finish_interval(p, 0, {m: 0.1 * m for m in range(8)})
        plans.append(p.decide(1))
    assert plans[0] == plans[1]  # a rerun of a killed controller decides the same
    assert plans[0] != plans[2]


def test_explore_resamples_from_the_space_with_its_probability(tmp_path):
    p = pbt(tmp_path, resample_probability=1.0)
    donor = {"optim.lr": 0.5, "optim.momentum": 0.5}
    drawn = [p.explore(donor, random.Random(i)) for i in range(20)]
    assert all(1e-3 <= d["optim.lr"] <= 1 and 0 <= d["optim.momentum"] <= 0.99 for d in drawn)
    assert len({d["optim.lr"] for d in drawn}) == 20  # not scaled by 0.8 / 1.2: drawn afresh


def test_prepare_hands_the_donors_checkpoint_and_history_on_once(tmp_path):
    p = pbt(tmp_path)
    finish_interval(p, 0, {0: 0.1, 1: 0.5, 2: 0.6, 3: 0.9})
    for m in range(4):
        write_checkpoint_dir(p.member_dir(m), 10)
        (p.member_dir(m) / "metrics.jsonl").write_text(
            json.dumps({"step": 10, "val_accuracy": m / 10, "member": m}) + "\n")
    p.prepare(1)
    plan = p.study.user_attrs["pbt_plan_1"]
    assert plan["copied"] is True and plan["members"]["0"]["parent_member"] == 3
    records = [json.loads(line) for line in
               (p.member_dir(0) / "metrics.jsonl").read_text().splitlines()]
    assert records[0]["member"] == 3  # the donor's history, then the exploit record
    assert {k: records[1][k] for k in ("step", "event", "from_member")} == \
        {"step": 10, "event": "pbt_exploit", "from_member": 3}
    assert newest_checkpoint(p.member_dir(0)).name == "ckpt-000000010"
    p.prepare(1)  # a rerun after the copy: nothing copied twice
    assert len((p.member_dir(0) / "metrics.jsonl").read_text().splitlines()) == 2


def test_a_donor_without_the_intervals_checkpoint_stops_the_study(tmp_path):
    p = pbt(tmp_path)
    finish_interval(p, 0, {0: 0.1, 1: 0.5, 2: 0.6, 3: 0.9})
    write_checkpoint_dir(p.member_dir(3), 5)  # not the step where interval 1 starts
    with pytest.raises(UserError, match="member 3 has no complete checkpoint of step 10") as e:
        p.prepare(1)
    assert e.value.exit_code == 1
    assert p.study.user_attrs["pbt_plan_1"]["copied"] is False  # decided, to be carried out


def test_one_controller_per_pbt_study(tmp_path):
    search = make_search(tmp_path, algorithm="pbt", space=SPACE)
    with _lock(tmp_path / "pbt.lock", search):
        with pytest.raises(UserError, match="another ringfeed tune is running this PBT study"):
            with _lock(tmp_path / "pbt.lock", search):
                pass
    with _lock(tmp_path / "pbt.lock", search):  # released with its controller
        pass

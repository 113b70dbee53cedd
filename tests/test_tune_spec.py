"""The `ringfeed tune` search file (train/tune/spec.py): the space syntax and its values in
optuna and back, PBT's explore moves, dotted keys into the trainer config, the trial config
and command made for a trial, and the one-line errors of load_search, each naming the field
(a bad file in the CLI: test_tune.py)."""

from __future__ import annotations

import random
import re
from pathlib import Path

import numpy as np
import pytest
import yaml
from tune_util import BASE, make_search

from ringfeed.errors import UserError
from ringfeed.shards.build import shard_dataset
from ringfeed.shards.options import ShardOptions
from ringfeed.train.tune.spec import (
    MANAGED_KEYS,
    check_config_key,
    get_dotted,
    load_search,
    parse_param,
    set_dotted,
)


# -- the space --------------------------------------------------------------------------------
@pytest.mark.parametrize("text, kind, low, high, choices", [
    ("loguniform(1e-4, 1e-1)", "loguniform", 1e-4, 0.1, []),  # YAML 1.1 reads 1e-4 as text
    ("uniform(-1, .5)", "uniform", -1.0, 0.5, []),
    ("int( 1 ,8)", "int", 1.0, 8.0, []),
    ("choice(sgd, adamw)", "choice", 0, 0, ["sgd", "adamw"]),
    ("choice(1, 2.5, true, null)", "choice", 0, 0, [1, 2.5, True, None]),
    ("choice([64], [128, 128])", "choice", 0, 0, [[64], [128, 128]]),
])
def test_the_space_syntax(text, kind, low, high, choices):
    p = parse_param("k", text)
    assert (p.kind, p.low, p.high, p.choices) == (kind, low, high, choices)


@pytest.mark.parametrize("text, message", [
    ("normal(0, 1)", "expected loguniform"), (3, "expected loguniform"),
    ("loguniform(0, 1)", "needs 0 < low"), ("uniform(2, 1)", "low must be below high"),
    ("int(1.5, 4)", "int\\(\\) takes two integers"), ("uniform(1, 2, 3)", "takes two numbers"),
    ("uniform(a, b)", "takes two numbers"), ("choice()", "needs at least one value"),
    ("uniform(1, [2)", "cannot read the arguments"),
])
def test_what_the_space_syntax_refuses(text, message):
    with pytest.raises(ValueError, match=message):
        parse_param("k", text)


def test_choices_that_are_lists_travel_through_optuna_as_text_and_come_back():
    p = parse_param("model.args.hidden", "choice([64], [128, 128])")
    assert p.distribution().choices == ("[64]", "[128, 128]")
    assert p.decode("[128, 128]") == [128, 128] and p.decode(0.5) == 0.5
    assert p.extremes() == [[64], [128, 128]]


def test_a_fresh_draw_stays_in_the_range_and_loguniform_draws_by_orders_of_magnitude():
    rng = random.Random(0)
    lr = parse_param("k", "loguniform(1e-4, 1e-0)")
    draws = np.array([lr.sample(rng) for _ in range(2000)])
    assert draws.min() >= 1e-4 and draws.max() <= 1.0
    assert 0.2 < np.mean(draws < 1e-2) < 0.8  # half the orders of magnitude, about half
    steps = parse_param("k", "int(2, 4)")
    assert {steps.sample(rng) for _ in range(200)} == {2, 3, 4}
    assert parse_param("k", "choice(a, b)").sample(rng) in ("a", "b")


@pytest.mark.parametrize("text, value, factor, moved", [
    ("uniform(0, 1)", 0.5, 1.2, 0.6), ("uniform(0, 1)", 0.9, 1.2, 1.0),  # kept in the range
    ("loguniform(1e-3, 1)", 0.01, 0.8, 0.008),
    ("int(1, 10)", 2, 1.2, 3),  # a small int still moves
    ("int(1, 10)", 1, 0.8, 1), ("int(1, 100)", 50, 0.8, 40),
    ("choice(1, 2, 4)", 2, 1.2, 4), ("choice(1, 2, 4)", 2, 0.8, 1),
    ("choice(1, 2, 4)", 4, 1.2, 4), ("choice(1, 2, 4)", 1, 0.8, 1),
])
def test_pbt_explore_scales_numbers_in_range_and_moves_choices_to_a_neighbour(text, value,
                                                                            factor, moved):
    assert parse_param("k", text).perturb(value, factor, random.Random(0)) == \
        pytest.approx(moved)


# -- keys into the trainer config -------------------------------------------------------------
@pytest.mark.parametrize("key, why", [
    ("optim.lr", None), ("model.args.anything.at.all", None), ("train.accumulate", None),
    ("optim", "is a section; name one of its keys"),
    ("optim.lrr", "did you mean 'optim.lr'"),
    ("optim.lr.value", "optim.lr is a value, not a section"),
    ("nothing", "not a key of the trainer config"),
])
def test_space_keys_are_leaf_keys_of_the_trainer_config(key, why):
    found = check_config_key(key)
    assert found is None if why is None else why in found


def test_dotted_keys_set_and_get_nested_values():
    raw = {"optim": {"lr": 1}}
    set_dotted(raw, "optim.lr", 2)
    set_dotted(raw, "model.args.hidden", [8])
    assert raw == {"optim": {"lr": 2}, "model": {"args": {"hidden": [8]}}}
    assert get_dotted(raw, "model.args.hidden") == [8]
    assert get_dotted(raw, "optim.lr.x", "none") == "none"
    with pytest.raises(UserError, match="optim.lr.x: lr is not a section in the base config"):
        set_dotted(raw, "optim.lr.x", 1)


# -- a trial's config and command --------------------------------------------------------------
def test_a_trial_config_is_the_base_with_set_the_parameters_and_its_own_run_dir(tmp_path):
    search = make_search(tmp_path, set={"train.max_steps": 7, "optim.lr": 9.0},
                         base={**BASE, "checkpoint": {"dir": "/shared/ckpt", "keep": 2}})
    raw = search.trial_config({"optim.lr": 0.01}, tmp_path / "trial-0003", resume="auto")
    assert raw["optim"]["lr"] == 0.01  # the trial's value wins over set
    assert raw["train"]["max_steps"] == 7
    assert raw["output"]["dir"] == str(tmp_path / "trial-0003")
    assert raw["checkpoint"] == {"keep": 2, "resume": "auto"}  # checkpoints in its run dir
    assert search.base_raw["checkpoint"]["dir"] == "/shared/ckpt"  # the base is not changed


def test_the_launch_template_is_split_then_filled_so_paths_stay_one_argument(tmp_path):
    search = make_search(tmp_path, launch="srun --job-name=t{trial} -o '{run_dir}/log x' "
                                          "ringfeed train {config}")
    cmd = search.command(Path("/a b/trial.yaml"), Path("/runs/t 7"), 7)
    assert cmd == ["srun", "--job-name=t7", "-o", "/runs/t 7/log x", "ringfeed", "train",
                   "/a b/trial.yaml"]
    listed = make_search(tmp_path, launch=["mpirun", "-np", "2", "ringfeed", "train",
                                           "{config}"])
    assert listed.command(Path("c.yaml"), Path("r"), 0)[-1] == "c.yaml"


# -- load_search ------------------------------------------------------------------------------
@pytest.fixture
def shards(tmp_path: Path) -> Path:
    np.savez(tmp_path / "d.npz", x=np.zeros((12, 2), np.float32), y=np.arange(12) % 3)
    opts = ShardOptions(src=tmp_path / "d.npz", out=tmp_path / "shards", format="npz",
                        fields={"y": "cls"}, val_fraction=0.25, progress=False)
    return shard_dataset(opts).out


def search_file(tmp_path: Path, shards: Path, **fields) -> Path:
    data = {"base": {**BASE, "data": {"train": str(shards), "batch_size": 4}},
            "space": {"optim.lr": "loguniform(1e-4, 1e-1)"}, "metric": "val_accuracy",
            "direction": "maximize", "launch": "ringfeed train {config}",
            "output": str(tmp_path / "out"), **fields}
    data = {k: v for k, v in data.items() if v is not None}
    path = tmp_path / "my-search.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def test_a_good_search_file_loads_with_its_defaults(tmp_path, shards):
    search = load_search(search_file(tmp_path, shards))
    assert search.study_name == "my-search"
    assert search.storage_url == f"sqlite:///{tmp_path / 'out' / 'study.db'}"
    assert [p.key for p in search.params] == ["optim.lr"]
    assert (search.spec.trials, search.spec.parallel, search.spec.retries) == (20, 1, 2)
    assert not (tmp_path / "out" / ".check").exists()  # the configs checked are removed


@pytest.mark.parametrize("fields, message", [
    ({"spaec": {}}, "spaec: unknown key \\(did you mean 'space'\\?\\)"),
    ({"metric": "accuracy"}, "metric: expected loss \\(training\\) or val_<name>"),
    ({"launch": "horovodrun -np 2 ringfeed train cfg.yaml"}, "launch: the command must "
                                                             "contain \\{config\\}"),
    ({"space": {}}, "space: no keys to search"),
    ({"direction": None}, "direction: required key is missing"),
    ({"space": {"output.dir": "choice(a, b)"}}, "space.output.dir: set by ringfeed tune"),
    ({"space": {"optim.lr": "uniform(1, 0)"}}, "space.optim.lr: low must be below high"),
    ({"set": {"optim.lrr": 0.1}}, "set.optim.lrr: not a key .*did you mean 'optim.lr'"),
    ({"initial": [{"optim.lr": 5.0}]}, "initial\\[0\\].optim.lr: 5.0 is outside the space"),
    ({"initial": [{"optim.momentum": 0.9}]}, "initial\\[0\\].optim.momentum: not a key of "
                                             "space"),
    ({"base": "nowhere.yaml"}, "base: nowhere.yaml not found"),
    ({"space": {"train.accumulate": "choice(1, 0)"}},
     "space.train.accumulate: with train.accumulate=0: "),
    ({"algorithm": "pbt", "space": {"data.batch_size": "choice(4, 8)"}},
     "space.data.batch_size: PBT continues members from checkpoints"),
    ({"algorithm": "pbt", "pbt": {"interval": 30}}, "pbt.interval: 30 is not below "
                                                    "train.max_steps \\(30\\)"),
    ({"algorithm": "pbt", "pbt": {"interval": 10}, "set": {"optim.schedule": "cosine"}},
     "set.optim.schedule: PBT runs each interval as a run to its end step"),
])
def test_a_bad_search_file_is_one_line_naming_the_field(tmp_path, shards, fields, message):
    path = search_file(tmp_path, shards, **fields)
    with pytest.raises(UserError) as exc:
        load_search(path)
    assert str(exc.value).startswith(f"{path}: ") and "\n" not in str(exc.value)
    assert exc.value.exit_code == 2
    assert re.search(message, str(exc.value)), str(exc.value)


def test_the_keys_the_tuner_owns():
    assert MANAGED_KEYS == ("output.dir", "checkpoint.dir", "checkpoint.resume")

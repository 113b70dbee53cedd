"""The run config's data section and its validation (issue 37, part 2): validation returns a
resolved config and leaves what it checked as it was, and the data section gives the pipeline
its config through one pure function, `to_pipeline_config(split)`."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml
from train_util import toy_config, write_config, write_toy_shards

from ringfeed.errors import UserError
from ringfeed.pipeline import ShardPipeline
from ringfeed.pipeline.config import PipelineConfig
from ringfeed.train.config import RunConfig, load_config, resolve_config
from ringfeed.train.data import make_pipeline


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> Path:
    return write_toy_shards(tmp_path_factory.mktemp("toy") / "shards")


@pytest.fixture(scope="module")
def lone(shards, tmp_path_factory) -> Path:
    """The toy shards without a val split."""
    manifest = json.loads((shards / "manifest.json").read_text())
    del manifest["splits"]["val"]
    lone = tmp_path_factory.mktemp("lone")
    for name in [s["name"] for s in manifest["splits"]["train"]["shards"]]:
        (lone / name).symlink_to(shards / name)
    (lone / "manifest.json").write_text(json.dumps(manifest))
    return lone


def test_path_checks_on_or_off_give_the_same_config(lone, tmp_path, monkeypatch):
    monkeypatch.setenv("HOROVOD_SIZE", "2")
    cfg_file = write_config(tmp_path / "c.yaml", **toy_config(lone, tmp_path / "out"))
    sets = ["data.global_batch_size=24", "train.accumulate=3"]
    checked, unchecked = load_config(cfg_file, sets), load_config(cfg_file, sets,
                                                                 check_paths=False)
    assert checked.model_dump() == unchecked.model_dump()
    assert checked.data.batch_size == 4 and checked.data.val_split is None


def test_validation_returns_a_resolved_copy_and_leaves_its_input(lone, tmp_path, monkeypatch):
    monkeypatch.setenv("HOROVOD_SIZE", "2")
    raw = toy_config(lone, tmp_path / "out")
    raw["data"]["global_batch_size"] = 8
    cfg = RunConfig.model_validate(raw)
    before = cfg.model_dump()
    resolved = resolve_config(cfg, "c.yaml")
    assert cfg.model_dump() == before  # nothing edited
    assert resolved is not cfg and resolved.data is not cfg.data
    assert resolved.data.batch_size == 4 and resolved.data.val_split is None
    assert cfg.data.val_split == "val" and cfg.data.batch_size == before["data"]["batch_size"]
    assert resolve_config(resolved).model_dump() == resolved.model_dump()  # settled


def test_to_pipeline_config_is_pure_and_shard_pipeline_takes_it(shards, tmp_path):
    cfg_file = write_config(tmp_path / "c.yaml", **toy_config(shards, tmp_path / "out"))
    cfg = load_config(cfg_file, ["train.seed=5", "data.normalize={mean: [0.5], std: [0.25]}",
                                 "data.balance=drop"])
    before = cfg.model_dump()
    train, val = cfg.to_pipeline_config("train"), cfg.to_pipeline_config("val")
    assert cfg.model_dump() == before
    assert type(train) is PipelineConfig and type(val) is PipelineConfig
    assert (train.split, train.seed, train.read_ahead) == ("train", 5, True)
    assert train.normalize == ((0.5,), (0.25,)) or train.normalize == ([0.5], [0.25])
    assert train.shuffle == cfg.data.shuffle and train.batch_size == cfg.data.batch_size
    assert (val.split, val.shuffle, val.balance, val.read_ahead) == ("val", False, "pad", False)
    assert cfg.data.to_pipeline_config("train", seed=5) == train
    pipe = ShardPipeline(str(shards), train, rank=0, world_size=1)
    assert pipe.config == train
    assert make_pipeline(cfg, "train", 0, 1).config == train
    assert make_pipeline(cfg, "val", 0, 1).config == val
    auto = load_config(cfg_file)  # normalize: auto is the run's (split_batch), not the pipeline's
    assert auto.data.normalize == "auto" and auto.to_pipeline_config("train").normalize is None
    with pytest.raises(UserError, match="data.val_split: null"):
        load_config(cfg_file, ["data.val_split=null"]).to_pipeline_config("val")
    with pytest.raises(ValueError, match="split must be one of"):
        cfg.to_pipeline_config("test")


def test_print_config_keys_are_unchanged(shards, tmp_path, capsys):
    from ringfeed.train.cli import main

    cfg_file = write_config(tmp_path / "c.yaml", **toy_config(shards, tmp_path / "out"))
    assert main(["train", str(cfg_file), "--print-config"]) == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    expected = set(RunConfig.model_fields["data"].annotation.model_fields) - {
        "split", "seed", "read_ahead"}
    assert set(printed["data"]) == expected


@pytest.mark.parametrize("item", [".=0", "train..max_steps=1", "train.=1", ".train=1"])
def test_a_set_key_with_an_empty_part_is_one_line_naming_it(tmp_path, item):
    """(found by test_fuzz: `--set .=0` said "cfg.yaml: : unknown key", naming nothing)"""
    cfg = tmp_path / "run.yaml"
    cfg.write_text(f"model: {{name: mlp}}\ndata: {{train: {tmp_path}}}\n")
    with pytest.raises(UserError, match=re.escape(f"--set {item!r}: ") + ".*empty part"):
        load_config(cfg, [item])

"""A resume that changes the global batch, or moves the learning rate back up, says so in one
warning line each (train/checkpoint/changes.py); nothing is refused."""

from __future__ import annotations

import pytest
from train_util import toy_config, write_config, write_toy_shards

from ringfeed.train.checkpoint.changes import resume_warnings


def config(batch=4, accumulate=1, max_steps=12, schedule="cosine", **data):
    return {"data": {"batch_size": batch, **data},
            "train": {"accumulate": accumulate, "max_steps": max_steps},
            "optim": {"name": "sgd", "lr": 0.1, "schedule": schedule, "warmup_steps": 2}}


def test_the_global_batch_change_is_named_with_both_world_sizes():
    (line,) = resume_warnings(config(), 4, config(), 2, 6)
    assert line.startswith("warning: the global batch changes from 16 samples per step (4 "
                           "rank(s) when checkpointed) to 8 (2 now)")
    assert resume_warnings(config(batch=2, accumulate=2), 2, config(batch=4), 2, 6)[:1] == []
    fixed = config(global_batch_size=16)
    assert resume_warnings(fixed, 4, fixed, 2, 6) == []  # data.global_batch_size holds it


def test_a_longer_cosine_moves_the_rate_up_and_says_why():
    (line,) = resume_warnings(config(max_steps=12), 1, config(max_steps=24), 1, 10)
    assert "learning rate moves up at this resume" in line and "at step 11" in line
    assert "(train.max_steps 12 -> 24)" in line
    assert resume_warnings(config(max_steps=12), 1, config(max_steps=12), 1, 10) == []
    assert resume_warnings(config(max_steps=24), 1, config(max_steps=12), 1, 10) == []  # down
    # a constant rate, or epochs (steps per epoch unknown here): nothing to compare
    assert resume_warnings(config(max_steps=12, schedule="constant"), 1,
                           config(max_steps=24, schedule="constant"),
                           1, 10) == []
    assert resume_warnings({}, 0, config(), 1, 3) == []  # an old meta.json without them


@pytest.mark.integration
def test_a_resume_with_a_larger_batch_and_max_steps_prints_both_warnings(tmp_path, capsys):
    from ringfeed.train.cli import main

    shards = write_toy_shards(tmp_path / "shards", n_train=80, n_val=8, per_shard=20)
    cfg = toy_config(shards, tmp_path / "out", train={"max_steps": 8},
                     optim={"schedule": "cosine"}, checkpoint={"every_steps": 4})
    path = write_config(tmp_path / "a.yaml", **cfg)
    assert main(["train", str(path)]) == 0
    capsys.readouterr()
    assert main(["train", str(path), "--resume", "auto", "--set", "train.max_steps=16",
                 "--set", "data.batch_size=8"]) == 0
    err = capsys.readouterr()
    text = err.out + err.err
    assert "resumed from" in text
    assert "warning: the global batch changes from 4 samples per step (1 rank(s) when " \
           "checkpointed) to 8 (1 now)" in text
    # the 8-step cosine ended at its floor; the 16-step one is half way down at step 9
    assert "warning: the learning rate moves up at this resume: 0.05 at step 9 where the " \
           "checkpoint's config gave 0 (train.max_steps 8 -> 16, optim changed)" not in text
    assert "warning: the learning rate moves up at this resume" in text


def test_one_global_batch_rule_for_the_feed_and_the_resume_check():
    from ringfeed.train import feed
    from ringfeed.train.checkpoint.changes import global_batch, step_batch

    assert feed.step_batch is step_batch  # plan_steps counts with the same function
    assert global_batch(config(batch=4, accumulate=2), 3) == step_batch(None, 4, 3, 2) == 24
    for order in ("rank", "global"):  # data.global_batch_size holds at any world size
        fixed = config(batch=4, global_batch_size=32, order=order)
        assert global_batch(fixed, 2) == global_batch(fixed, 8) == step_batch(32, 2, 8, 1) == 32
    assert global_batch({"data": {}}, 2) is None  # (a meta.json without the keys)

"""The global order's rules outside a pipeline run (pipeline/canonical.py): the config it plans
with, the skip list (inline or a file: ids, or samples.jsonl lines) and what it can take out of
a stream, and joining the canonical streams' chunks into one batch. The order itself, across
world sizes and resumes: test_global_order.py."""

from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pytest

from ringfeed.pipeline.canonical import _concat, canonical_config, leave_out_for, load_skip
from ringfeed.pipeline.config import PipelineConfig
from ringfeed.pipeline.errors import PipelineError


def config(**kw) -> PipelineConfig:
    return PipelineConfig(**{"order": "global", "global_batch_size": 24,
                             "canonical_streams": 12, **kw})


def test_the_canonical_plan_has_one_rank_per_stream_and_no_loader_workers():
    c = canonical_config(config(shuffle_buffer=64), world_size=4)
    assert (c.world_size, c.num_workers, c.batch_size, c.shuffle_buffer, c.balance) == \
        (12, 0, 2, 64, "drop")
    assert canonical_config(config(shuffle=False), world_size=3).shuffle_buffer == 0


@pytest.mark.parametrize("kw, world, message", [
    ({"global_batch_size": None}, 2, "order: global needs global_batch_size"),
    ({"balance": "pad"}, 2, "balance='pad' is for the rank order"),
    ({}, 5, "canonical_streams"),  # 12 streams do not deal evenly over 5 ranks
    ({"global_batch_size": 30}, 2, "global_batch_size"),  # 30 is not a multiple of 12
])
def test_the_rules_it_checks_are_one_line_naming_the_option(kw, world, message):
    with pytest.raises(PipelineError, match=message):
        canonical_config(config(**kw), world_size=world)


def test_a_skip_list_is_sorted_unique_and_within_the_split(tmp_path):
    assert load_skip(None, 10).tolist() == []
    assert load_skip([7, 3, 3, 12], 10).tolist() == [3, 7]
    path = tmp_path / "skip.txt"
    path.write_text("5, 1\n\n 9 2,2\n")
    assert load_skip(str(path), 10).tolist() == [1, 2, 5, 9]


def test_samples_jsonl_lines_name_the_ids_to_skip(tmp_path):
    path = tmp_path / "samples.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in [
        {"step": 1, "ids": [[4, 0], [8]]}, {"step": 2, "ids": [3]}]) + "\n")
    assert load_skip(str(path), 100).tolist() == [0, 3, 4, 8]


@pytest.mark.parametrize("text, message", [
    ("1 2 x\n", "skip.txt:1: expected sample ids"),
    ('1\n{"step": 1}\n', "skip.txt:2: expected sample ids"),
    ('{"ids": [1, true]}\n', "skip.txt:1: expected sample ids"),
    ("3 -1\n", "skip: .*skip.txt: sample ids are >= 0"),
])
def test_a_bad_skip_file_is_one_line_naming_file_and_line(tmp_path, text, message):
    (tmp_path / "skip.txt").write_text(text)
    with pytest.raises(PipelineError, match=message):
        load_skip(str(tmp_path / "skip.txt"), 100)
    with pytest.raises(PipelineError, match="skip: cannot read"):
        load_skip(str(tmp_path / "missing.txt"), 100)


def test_what_a_skip_list_can_take_out_of_one_stream():
    ids = np.array([1, 5, 12])
    assert leave_out_for(ids, None) == 3  # each id is emitted once an epoch
    # a mixture of sources of 4 and 8 samples, 24 drawn an epoch: small sources repeat
    mixture = SimpleNamespace(starts=np.array([0, 4, 12, 20]), per_epoch=np.array([12, 8, 4]))
    assert leave_out_for(ids, mixture) == 3 + 1 + 1  # ceil(12/4), ceil(8/8), ceil(4/8)
    assert leave_out_for(np.array([], np.int64), mixture) == 0


def test_chunks_of_the_streams_join_into_one_batch():
    a = {"x": np.zeros((2, 3)), "key": ["a0", "a1"], "img": [np.zeros(2), np.zeros(3)]}
    b = {"x": np.ones((1, 3)), "key": ["b0"], "img": [np.zeros(4)]}
    joined = _concat([a, b])
    assert joined["x"].tolist() == [[0, 0, 0], [0, 0, 0], [1, 1, 1]]
    assert joined["key"] == ["a0", "a1", "b0"] and len(joined["img"]) == 3
    assert _concat([a]) is a

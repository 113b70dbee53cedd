"""pipeline/state.py: PipelineState, a pipeline's position (epoch, segments, batches consumed)
over the real planner. No reading: layouts are sample counts per shard."""

from __future__ import annotations

import json

import numpy as np
import pytest

from ringfeed.pipeline.errors import PipelineError
from ringfeed.pipeline.plan import Layout, SegmentConfig, batches_for
from ringfeed.pipeline.state import STATE_VERSION, PipelineState

COUNTS = [10, 7, 13]  # 30 samples
SHARDS = len(COUNTS)


def make(world_size=2, workers=0, batch_size=2, balance="drop", seed=1, counts=COUNTS):
    return PipelineState(Layout(np.array(counts, dtype=np.int64)), seed, True,
                         SegmentConfig(world_size, workers, batch_size, 5, balance))


def consume(state, n):
    """Begin a pass and mark its next `n` batches consumed; the last mark's result."""
    plan, t0, _ = state.begin()
    result = None
    for t in range(t0, t0 + n):
        result = state.mark_consumed([plan.epoch, plan.index, t])
    return result


@pytest.mark.parametrize("balance", ["drop", "pad"])
def test_a_fresh_state_starts_epoch_0_with_the_planned_batch_count(balance):
    state = make(balance=balance)
    assert state.epoch == 0
    assert state.batches_per_epoch == batches_for(30, 2, 2, balance)
    plan, t0, key = state.begin()
    assert (plan.epoch, plan.index, t0) == (0, 0, 0)
    assert plan.batches == state.batches_per_epoch == state.batches_remaining
    assert key == state.pass_key()


def test_the_last_batch_of_the_pass_is_flagged_and_the_next_pass_is_the_next_epoch():
    state = make()
    total = state.batches_per_epoch
    assert consume(state, total - 1) == (True, False)
    assert state.batches_remaining == 1
    assert consume(state, 1) == (True, True)
    assert state.batches_remaining == 0
    plan, t0, _ = state.begin()
    assert (state.epoch, plan.epoch, t0) == (1, 1, 0)


def test_a_tag_from_a_replaced_state_is_not_counted():
    state = make()
    consume(state, 2)
    state.set_epoch(5)
    assert state.mark_consumed([0, 0, 2]) == (False, False)  # epoch 0's batch arrives late
    assert state.mark_consumed([5, 1, 0]) == (False, False)  # no segment 1
    assert state.batches_remaining == state.batches_per_epoch


def test_set_epoch_to_the_current_epoch_keeps_its_progress():
    state = make()
    consume(state, 2)
    state.set_epoch(0)
    assert state.begin()[1] == 2
    state.set_epoch(1)
    assert (state.epoch, state.begin()[1]) == (1, 0)


def test_state_dict_is_json_and_another_state_continues_exactly_from_it():
    state = make()
    consume(state, 3)
    saved = json.loads(json.dumps(state.state_dict(SHARDS)))
    assert saved["version"] == STATE_VERSION and saved["num_samples"] == 30
    assert saved["segments"][0]["batches_consumed"] == 3
    again = make()
    again.load_state_dict(saved, SHARDS)
    (plan_a, t0_a, key_a), (plan_b, t0_b, key_b) = state.begin(), again.begin()
    assert (t0_a, key_a) == (t0_b, key_b) == (3, state.pass_key())
    for w in range(plan_a.config.streams):
        a, b = plan_a.worker(0, w), plan_b.worker(0, w)
        assert np.array_equal(a.ids[a.order], b.ids[b.order])


def test_a_state_at_another_world_size_starts_a_new_segment_over_what_is_left():
    state = make(world_size=2)
    consume(state, 2)
    saved = state.state_dict(SHARDS)
    wider = make(world_size=3)
    wider.load_state_dict(saved, SHARDS)
    plan, t0, _ = wider.begin()
    assert (plan.index, t0) == (1, 0)
    assert [s["world_size"] for s in wider.segment_dicts()] == [2, 3]
    # the new segment plans over the samples not consumed: 30 - 2 batches * 2 * 2 ranks
    assert len(plan.remaining) == 30 - 2 * 2 * 2


def test_a_segment_that_consumed_nothing_is_replaced_not_stacked():
    state = make(world_size=2)
    saved = state.state_dict(SHARDS)  # nothing consumed
    other = make(world_size=3)
    other.load_state_dict(saved, SHARDS)
    assert [s["world_size"] for s in other.segment_dicts()] == [3]


@pytest.mark.parametrize("field,value", [("num_samples", 31), ("seed", 9), ("num_shards", 4),
                                         ("version", STATE_VERSION + 1)])
def test_a_state_of_another_dataset_or_setup_is_refused(field, value):
    saved = make().state_dict(SHARDS)
    saved[field] = value
    with pytest.raises(PipelineError, match=f"{field}=.*another dataset or setup"):
        make().load_state_dict(saved, SHARDS)


@pytest.mark.parametrize("broken", [{"epoch": 0}, {"epoch": "x", "segments": []},
                                    {"epoch": 0, "segments": []},
                                    {"epoch": 0, "segments": [{"batch_size": 2}]}])
def test_a_malformed_state_is_one_error(broken):
    with pytest.raises(PipelineError, match="malformed pipeline state"):
        make().load_state_dict(broken, SHARDS)


def test_next_epoch_pass_is_the_pass_begin_runs_after_the_epoch_ends():
    state = make(workers=2)
    consume(state, state.batches_per_epoch)
    ahead, ahead_key = state.next_epoch_pass()
    plan, t0, key = state.begin()
    assert (key, t0, plan.epoch) == (ahead_key, 0, 1)
    for w in range(2):
        a, b = ahead.worker(0, w), plan.worker(0, w)
        assert np.array_equal(a.ids[a.order], b.ids[b.order])


def test_ranks_of_a_pass_cover_each_sample_once_with_drop():
    state = make(world_size=2, balance="drop")
    plan, _, _ = state.begin()
    ids = np.concatenate([plan.rank_slots(r)[0] for r in range(2)])
    assert len(ids) == state.batches_per_epoch * 2 * 2
    assert len(set(ids.tolist())) == len(ids) and ids.max() < 30

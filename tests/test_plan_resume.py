"""Resuming across the growing shuffle buffer (issue 45): a pipeline state saved before the
buffer's initial fill was recorded (its segments without `shuffle_initial`) finishes its epoch
in the order it started, a buffer that emitted only once full; the next epoch and new states
use the growing buffer. Pure bookkeeping (pipeline/state.py over plan.py), nothing read."""

from __future__ import annotations

import numpy as np
import pytest

from ringfeed.pipeline import plan as P
from ringfeed.pipeline.state import PipelineState

COUNTS = [30, 25, 40, 12, 33]
BUFFER = 40


def old_state(order: str, consumed: int) -> dict:
    """What a state_dict() looked like before shuffle_initial: the same keys less that one."""
    state = PipelineState(P.Layout(np.array(COUNTS)), 3, True, config(), order=order)
    saved = state.state_dict(len(COUNTS))
    for seg in saved["segments"]:
        del seg["shuffle_initial"]
        seg["batches_consumed"] = consumed
    return saved


def config() -> P.SegmentConfig:
    return P.SegmentConfig(1, 2, 4, BUFFER, "drop")


@pytest.mark.parametrize("order", ["rank", "global"])
def test_a_state_saved_before_the_initial_fill_keeps_its_epochs_order(order):
    state = PipelineState(P.Layout(np.array(COUNTS)), 3, True, config(), order=order)
    state.load_state_dict(old_state(order, 5), len(COUNTS))
    plan, consumed, _ = state.begin()
    assert consumed == 5 and len(state.segments) == 1
    assert plan.config.initial == BUFFER + 1
    wp = plan.worker(0, 1)
    full = P.shuffle_order(len(wp.ids), BUFFER, plan.stream_rng(0, 1), initial=BUFFER + 1)
    assert np.array_equal(wp.order, full)
    assert not np.array_equal(wp.order, P.shuffle_order(len(wp.ids), BUFFER,
                                                        plan.stream_rng(0, 1)))
    assert state.state_dict(len(COUNTS))["segments"][0]["shuffle_initial"] == BUFFER + 1
    state.mark_consumed((plan.epoch, 0, plan.batches - 1))
    nxt, consumed, _ = state.begin()
    assert (nxt.epoch, consumed) == (plan.epoch + 1, 0)
    assert nxt.config.initial == P.default_initial(BUFFER) == 4


def test_a_new_state_resumes_in_the_growing_order():
    state = PipelineState(P.Layout(np.array(COUNTS)), 3, True, config())
    saved = state.state_dict(len(COUNTS))
    saved["segments"][0]["batches_consumed"] = 5
    again = PipelineState(P.Layout(np.array(COUNTS)), 3, True, config())
    again.load_state_dict(saved, len(COUNTS))
    plan, consumed, _ = again.begin()
    assert consumed == 5 and plan.config == config() and plan.config.initial == 4


def test_the_first_batch_opens_only_the_shards_the_ramp_needs(tmp_path):
    """End to end (one stream, read in the consumer's thread): 40 shards of 10 samples, a
    buffer of 200 (initial 20), batches of 8. The first batch is drawn from the first
    20 + 2 * 7 = 34 slots of the epoch's order, so it opens at most 4 shards (those of the
    slots it emits); a buffer that emitted only once full drew it from the first 208."""
    from pipeline_util import collect, write_shards

    from ringfeed.pipeline import ShardPipeline

    write_shards(tmp_path, [10] * 40)

    def make() -> ShardPipeline:
        return ShardPipeline(tmp_path, batch_size=8, shuffle_buffer=200, seed=1, prefetch=0)

    pipe = make()
    batches = iter(pipe)
    next(batches)
    assert pipe.stats()["shards_opened"] <= 4
    batches.close()
    assert len(collect(make())) == 400 // 8

"""A pipeline's position: the epoch, its segments and the batches each consumed.

Pure bookkeeping over plan.py (no reading): what `state_dict()` saves and `load_state_dict()`
restores, which pass an iteration runs, and when a batch handed out counts as consumed.
Thread-safe: batches are marked consumed from the consumer's thread while reader threads plan.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Sequence
from typing import Any

from ringfeed.pipeline.errors import PipelineError
from ringfeed.pipeline.plan import (
    Layout,
    Mixed,
    Planner,
    Segment,
    SegmentConfig,
    SegmentPlan,
    batches_for,
)

STATE_VERSION = 1


class PipelineState:
    def __init__(self, layout: Layout, seed: int, shuffle: bool, config: SegmentConfig,
                 mixture: Mixed | None = None, order: str = "rank", leave_out: int = 0) -> None:
        """`order` "global": `config` is the canonical one (canonical.py), the same at every
        world size, so a state resumes as one segment; `leave_out`: see plan.batches_for."""
        self.layout, self.seed, self.shuffle, self.config = layout, seed, shuffle, config
        self.mixture, self.order, self.leave_out = mixture, order, leave_out
        self.planner = Planner(layout, seed, shuffle, mixture, leave_out)
        self.lock = threading.Lock()
        self.epoch = 0
        self.segments = [Segment(config)]
        self.last_batch_of_pass: tuple[int, int, int] | None = None

    @property
    def batches_per_epoch(self) -> int:
        c = self.config
        return batches_for(self.planner.epoch_samples, c.world_size, c.batch_size, c.balance,
                           self.leave_out)

    @property
    def batches_remaining(self) -> int:
        with self.lock:
            return max(0, self._plans()[-1].batches - self.segments[-1].batches_consumed)

    def set_epoch(self, epoch: int) -> None:
        with self.lock:
            if epoch != self.epoch:
                self._start_epoch(epoch)

    def state_dict(self, num_shards: int) -> dict[str, Any]:
        with self.lock:
            return {
                "version": STATE_VERSION,
                "epoch": self.epoch,
                "seed": self.seed,
                "batch_size": self.config.batch_size,
                "shuffle": self.shuffle,
                "num_samples": self.layout.num_samples,
                "num_shards": num_shards,
                "segments": [s.to_dict() for s in self.segments],
                **({"mixture": self.mixture.describe()} if self.mixture is not None else {}),
                **({"order": self.order} if self.order != "rank" else {}),
            }

    def load_state_dict(self, state: dict[str, Any], num_shards: int) -> None:
        for name, mine in (("version", STATE_VERSION), ("seed", self.seed),
                           ("shuffle", self.shuffle), ("num_samples", self.layout.num_samples),
                           ("num_shards", num_shards),
                           ("mixture", self.mixture.describe() if self.mixture else None)):
            if name in state and state[name] != mine:
                raise PipelineError(f"pipeline state has {name}={state[name]!r}, this pipeline "
                                    f"{mine!r}: it belongs to another dataset or setup")
        if state.get("order", "rank") != self.order:
            raise PipelineError(f"pipeline state has order={state.get('order', 'rank')!r}, this "
                                f"pipeline order={self.order!r}: resume with the order it was "
                                "taken with")
        c = self.config
        defaults = {"batch_size": state.get("batch_size", c.batch_size),
                    "shuffle_buffer": c.shuffle_buffer, "balance": c.balance}
        try:
            segments = [Segment.from_dict(d, defaults) for d in state["segments"]]
            epoch = int(state["epoch"])
        except (KeyError, TypeError, ValueError) as e:
            raise PipelineError(f"malformed pipeline state ({e!r})") from None
        if not segments:
            raise PipelineError("malformed pipeline state (no segments)")
        if self.order == "global" and any(not seg.config.same_but_initial(c) for seg in segments):
            other = segments[-1].config
            raise PipelineError(
                f"pipeline state has canonical_streams={other.world_size}, "
                f"{other.batch_size * other.world_size} samples per global batch, "
                f"shuffle_buffer={other.shuffle_buffer}; this pipeline {c.world_size}, "
                f"{c.batch_size * c.world_size}, {c.shuffle_buffer}: order: global resumes "
                "only with the same ones")
        with self.lock:
            self.epoch, self.segments = epoch, segments
            if not segments[-1].config.same_but_initial(c) and not self._epoch_complete():
                # a segment that consumed nothing changes nothing: replace it, don't stack it
                while len(self.segments) > 1 and self.segments[-1].batches_consumed == 0:
                    self.segments.pop()
                if self.segments[-1].batches_consumed == 0:
                    self.segments = [Segment(self.config)]
                elif self.segments[-1].config != self.config:
                    self.segments.append(Segment(self.config))

    def begin(self) -> tuple[SegmentPlan, int, tuple]:
        """The segment a new pass iterates, the batches of it already consumed and the pass's
        key; moves to the next epoch first when the current one is complete."""
        with self.lock:
            if self._epoch_complete():
                self._start_epoch(self.epoch + 1)
            plan = self._plans()[-1]
            self.last_batch_of_pass = (plan.epoch, plan.index, plan.batches - 1)
            return plan, self.segments[-1].batches_consumed, self.pass_key()

    def mark_consumed(self, tag: Sequence[int]) -> tuple[bool, bool]:
        """Batch [epoch, segment, t] reached the training loop: (it belongs to the current
        state, it was the last batch of the pass)."""
        epoch, segment, t = (int(x) for x in tag)
        with self.lock:
            if epoch != self.epoch or segment != len(self.segments) - 1:
                return False, False
            seg = self.segments[-1]
            seg.batches_consumed = max(seg.batches_consumed, t + 1)
            return True, (epoch, segment, t) == self.last_batch_of_pass

    def next_epoch_pass(self) -> tuple[SegmentPlan, tuple]:
        """The pass that follows a finished epoch (what reading ahead starts on)."""
        segments = [Segment(self.config)]
        epoch = self.epoch + 1
        return self.planner.plans(epoch, segments)[-1], _pass_key(epoch, segments)

    def pass_key(self) -> tuple:
        return _pass_key(self.epoch, self.segments)

    def segment_dicts(self) -> list[dict[str, Any]]:
        with self.lock:
            return [s.to_dict() for s in self.segments]

    def _plans(self) -> list[SegmentPlan]:
        return self.planner.plans(self.epoch, self.segments)

    def _epoch_complete(self) -> bool:
        return self.segments[-1].batches_consumed >= self._plans()[-1].batches

    def _start_epoch(self, epoch: int) -> None:
        self.epoch, self.segments = int(epoch), [Segment(self.config)]


def _pass_key(epoch: int, segments: list[Segment]) -> tuple:
    """What decides a pass's batches: the epoch and its segments (with their consumed counts)."""
    return epoch, tuple(json.dumps(seg.to_dict(), sort_keys=True) for seg in segments)

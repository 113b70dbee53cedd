"""The read plan of one worker stream, made once per stream from its `WorkerPlan`: the slots it
still emits, where each lies (shard, position), and the *runs* its shards are opened in.

A run is a maximal stretch of needed slots in one shard with rising positions, in read order (a
shard may appear in more than one run after a resume reordered the epoch). Pure index
arithmetic, vectorised: a rank's share of a 10^6-shard epoch may be 10^5+ runs.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import NamedTuple

import numpy as np

from ringfeed.pipeline.plan import Layout, WorkerPlan


class Chunk(NamedTuple):
    """The slots of one batch (or the stream's last, shorter one) and the runs they read."""

    first: int  # emission index of its first slot
    slots: np.ndarray
    runs: np.ndarray  # the run of each slot
    used: list[int]  # the distinct runs, ascending


class ReadPlan:
    def __init__(self, plan: WorkerPlan, needed: np.ndarray, layout: Layout) -> None:
        """`needed`: the slots still to emit, in emission order (the plan's order past the
        batches already consumed)."""
        self.ids, self.valid, self.batch_size = plan.ids, plan.valid, plan.batch_size
        self.needed = needed
        self.shard_of, self.pos_of = layout.locate(plan.ids)  # per slot
        self.run_shard, self.run_of, self._slots, self._bounds = _runs(
            needed, self.shard_of, self.pos_of)
        # the emission index (within `needed`) of each run's last slot: when it may close
        self.last_use = np.full(len(self.run_shard), -1, dtype=np.int64)
        np.maximum.at(self.last_use, self.run_of[needed], np.arange(len(needed)))

    def chunks(self) -> Iterator[Chunk]:
        """The needed slots a batch at a time."""
        b = self.batch_size
        for first in range(0, len(self.needed), b):
            slots = self.needed[first:first + b]
            runs = self.run_of[slots]
            yield Chunk(first, slots, runs, np.unique(runs).tolist())

    def run_positions(self, run: int) -> set[int]:
        """The positions run `run` reads in its shard."""
        return set(self.pos_of[self._slots[self._bounds[run]:self._bounds[run + 1]]].tolist())


def _runs(needed: np.ndarray, shard_of: np.ndarray, pos_of: np.ndarray
          ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(each run's shard, each slot's run or -1 where not needed, the needed slots in slot
    order, bounds: run r's needed slots are slots[bounds[r]:bounds[r + 1]])."""
    n = len(shard_of)
    is_new = np.ones(n, dtype=bool)
    is_new[1:] = (shard_of[1:] != shard_of[:-1]) | (pos_of[1:] <= pos_of[:-1])
    stretch = np.cumsum(is_new) - 1
    slots = np.sort(needed)
    used = np.zeros(int(stretch[-1]) + 1 if n else 0, dtype=bool)
    used[stretch[slots]] = True
    run_of_stretch = np.cumsum(used) - 1
    run_shard = shard_of[np.flatnonzero(is_new)[used]].astype(np.int64)
    run_of = np.full(n, -1, dtype=np.int64)
    run_of[slots] = run_of_stretch[stretch[slots]]
    bounds = np.searchsorted(run_of[slots], np.arange(len(run_shard) + 1))
    return run_shard, run_of, slots, bounds

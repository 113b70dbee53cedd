"""Every rank measured: each rank's step time, data wait and own work (busy) per step, the
straggler named, and the per-rank percentiles of summary.json.

    RankTimes     one rank's figures, per step (for the run's percentiles) and per log window
    RankFigures   the Reporter's part (reporter.py): every train.log_every steps one small
                  allreduce gathers every rank's window means for metrics.jsonl and names the
                  straggler in the log; at the end, every rank's percentiles for summary.json

The straggler rule: the rank whose own work per step exceeds the other ranks' median by more
than train.straggler_margin x the step time (in a synchronous job every rank's step time is the
same: the others wait, inside the collective, for the slowest).
"""

from __future__ import annotations

import functools
from array import array
from collections.abc import Callable
from typing import Any

import numpy as np

from ringfeed.train.backends.base import Backend


class RankTimes:
    """One rank's per-step times, for the per-rank figures: `step_s` (wall time from the end of
    the previous step to the end of this one, data wait included), `data_wait_s`, and `busy_s`,
    this rank's own work: the step time less the time it spent in the step's collective (torch:
    blocked in the gradient and agreement allreduces; TensorFlow: the whole compiled step, so
    there its own work is what happens outside the step). In a synchronous job every rank's
    step time is the same - the others wait, inside the collective, for the slowest - so the
    busy time is what tells the straggler. Kept per step for the run's percentiles (8 bytes a
    figure a step), and summed over the window since the last log step."""

    FIELDS = ("step_s", "data_wait_s", "busy_s")

    def __init__(self) -> None:
        self.runs = {f: array("d") for f in self.FIELDS}
        self.window = dict.fromkeys(self.FIELDS, 0.0)
        self.window_steps = 0
        self.storage_wait_s = 0.0  # this rank's pipeline storage_wait_s at the last log step
        self.window_storage_s = 0.0

    def add(self, step_s: float, data_wait_s: float, collective_s: float) -> None:
        values = (step_s, data_wait_s, max(0.0, step_s - collective_s))
        for name, value in zip(self.FIELDS, values, strict=True):
            self.runs[name].append(value)
            self.window[name] += value
        self.window_steps += 1

    def take_window(self, storage_wait_s: float) -> list[float]:
        """The window's means per step, then its storage wait (seconds, from the pipeline's
        running total `storage_wait_s`); the window starts again."""
        n = max(1, self.window_steps)
        means = [self.window[f] / n for f in self.FIELDS]
        storage = max(0.0, storage_wait_s - self.storage_wait_s)
        self.storage_wait_s = storage_wait_s
        self.window = dict.fromkeys(self.FIELDS, 0.0)
        self.window_steps = 0
        return [*means, storage]

    def percentiles(self) -> list[float]:
        """p50, p90, max of each field (0 before any timed step), field after field."""
        out: list[float] = []
        for name in self.FIELDS:
            values = np.frombuffer(self.runs[name], dtype=np.float64) if self.runs[name] \
                else np.zeros(1)
            out += [float(np.percentile(values, 50)), float(np.percentile(values, 90)),
                    float(values.max())]
        return out


@functools.lru_cache(maxsize=8)
def _slots(keys: tuple[str, ...], size: int) -> tuple[str, ...]:
    return tuple(f"{r}/{key}" for r in range(size) for key in keys)


def per_rank(values: dict[str, float], rank: int, size: int, allreduce_sum: Callable[
        [dict[str, float]], dict[str, float]]) -> dict[str, list[float]]:
    """Collective: every rank's `values` (the same keys everywhere), as {key: [rank 0's, ...]},
    in one small allreduce (each rank fills its own slots, the others are zeros)."""
    keys = tuple(values)
    slots = _slots(keys, size)
    flat = [0.0] * len(slots)
    flat[rank * len(keys):(rank + 1) * len(keys)] = values.values()
    summed = allreduce_sum(dict(zip(slots, flat, strict=True)))
    gathered = [summed[slot] for slot in slots]
    return {key: gathered[i::len(keys)] for i, key in enumerate(keys)}


def straggler(busy: list[float], step_s: float, margin: float) -> tuple[int, float] | None:
    """(rank, lag) of the rank whose own work per step (`busy`, per rank) exceeds the median of
    the other ranks' by more than `margin` x the step time, the largest such lag; else None."""
    if len(busy) < 2 or step_s <= 0:
        return None
    rank = int(np.argmax(busy))
    lag = busy[rank] - float(np.median(busy[:rank] + busy[rank + 1:]))
    return (rank, lag) if lag > margin * step_s else None


class RankFigures:
    """Every rank's figures and the straggler; its own state: this rank's RankTimes and how
    many log windows named each rank."""

    def __init__(self, margin: float, backend: Backend, log: Callable[[str], None]):
        """`margin`: train.straggler_margin; `backend`: its rank, world size (read at each
        call: an elastic reset changes them) and allreduce; `log`: a line of the run's log."""
        self.margin, self.backend, self.log = margin, backend, log
        self.times = RankTimes()
        self.stragglers: dict[int, int] = {}  # rank -> log windows that named it
        self.last_straggler: int | None = None  # the previous log window's

    def window(self, step: int, storage_wait_s: float) -> dict[str, Any]:
        """Collective (one small allreduce): every rank's means per step over the window since
        the last log step - step time, data wait, own work (busy) - and its storage wait, for
        metrics.jsonl; the straggler, if one is behind by train.straggler_margin, is named in
        the log."""
        dist = self.backend.dist
        names = ("step_s", "data_wait_s", "busy_s", "storage_wait_s")
        mine = self.times.take_window(storage_wait_s)
        figures = per_rank(dict(zip(names, mine, strict=True)), dist.rank, dist.size,
                           self.backend.allreduce_sum)
        record: dict[str, Any] = {f"rank_{name}": values for name, values in figures.items()}
        step_s = float(np.median(figures["step_s"]))
        # scalars for TensorBoard and the trackers (the lists above are metrics.jsonl's)
        record["rank_busy_max_s"] = max(figures["busy_s"])
        record["rank_busy_median_s"] = float(np.median(figures["busy_s"]))
        record["rank_data_wait_max_s"] = max(figures["data_wait_s"])
        found = straggler(figures["busy_s"], step_s, self.margin)
        rank = None if found is None else found[0]
        if found is not None:
            lag = found[1]
            self.stragglers[rank] = windows = self.stragglers.get(rank, 0) + 1
            record["straggler"] = rank
        # said when the straggler changes, then every 50th window it stays (metrics.jsonl has
        # every window's)
        if found is not None and (rank != self.last_straggler or windows % 50 == 0):
            self.log(f"straggler: rank {rank} is behind at step {step}: its own work is "
                     f"{lag:.3f} s per step over the other ranks' median ({100 * lag / step_s:.0f}%"
                     f" of the {step_s:.3f} s step; data wait {figures['data_wait_s'][rank]:.3f}"
                     f" s/step, storage wait {figures['storage_wait_s'][rank]:.1f} s; "
                     f"{windows} log window(s) so far)")
        elif found is None and self.last_straggler is not None:
            self.log(f"straggler: none at step {step} (rank {self.last_straggler} caught up)")
        self.last_straggler = rank
        return record

    def summary(self, storage_wait_s: float) -> dict[str, Any]:
        """Collective (one small allreduce): summary.json's "ranks": p50/p90/max of each
        rank's step time, data wait and own work per step, its storage wait, and the straggler
        over the whole run (by the ranks' median own work), with the log windows that named
        each rank."""
        dist = self.backend.dist
        keys = [f"{name}/{p}" for name in RankTimes.FIELDS for p in ("p50", "p90", "max")]
        figures = per_rank({**dict(zip(keys, self.times.percentiles(), strict=True)),
                            "storage_wait_s": storage_wait_s}, dist.rank, dist.size,
                           self.backend.allreduce_sum)
        ranks: dict[str, Any] = {name: {p: figures[f"{name}/{p}"] for p in ("p50", "p90", "max")}
                                 for name in RankTimes.FIELDS}
        ranks["storage_wait_s"] = figures["storage_wait_s"]
        step_s = float(np.median(figures["step_s/p50"]))
        found = straggler(figures["busy_s/p50"], step_s, self.margin)
        ranks["straggler"] = None if found is None else {
            "rank": found[0], "lag_s": found[1],
            "share_of_step": found[1] / step_s if step_s else 0.0}
        ranks["named_in_log"] = {str(r): n for r, n in sorted(self.stragglers.items())}
        ranks["margin"] = self.margin
        return ranks

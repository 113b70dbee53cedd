"""What both allreduce workers (Horovod, torch.distributed) share: the plan of tensor sizes,
iteration counts every rank agrees on without talking, and the bus-bandwidth arithmetic."""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from pathlib import Path


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", type=lambda s: [int(x) for x in s.split(",")], required=True,
                    help="tensor sizes in bytes (float32), comma separated")
    ap.add_argument("--budget-bytes", type=float, default=2e9,
                    help="bytes to reduce per size: iterations = budget / size, within 3..200")
    ap.add_argument("--small-count", type=int, default=64, help="tensors in the many-small test")
    ap.add_argument("--small-bytes", type=int, default=16384)
    ap.add_argument("--small-rounds", type=int, default=20)
    ap.add_argument("--knob-run", action="store_true",
                    help="Horovod only: the fp32 sweep and the many-small round, nothing else")
    ap.add_argument("--small-only", action="store_true",
                    help="Horovod only: the many-small round, nothing else")
    ap.add_argument("--out", type=Path, required=True)
    return ap.parse_args(argv)


def iterations(size: int, budget_bytes: float) -> int:
    # A pure function of the size: every rank runs the same count, no agreement needed.
    return max(3, min(200, int(budget_bytes // size)))


def bus_bandwidth(size: int, seconds: float, ranks: int) -> float:
    """NCCL-tests' busbw: algorithm bandwidth times 2(n-1)/n, comparable to a link's speed."""
    return 2 * (ranks - 1) / ranks * size / seconds


def timed(fn: Callable[[], None], n: int, barrier: Callable[[], None]) -> float:
    """Seconds per call of `fn`, after one untimed warm-up call and a barrier."""
    fn()
    barrier()
    start = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - start) / n


def sweep(sizes: list[int], budget: float, ranks: int, reduce_fn: Callable[[int], Callable],
          barrier: Callable[[], None]) -> list[dict]:
    """[{bytes, seconds, busbw}] for each size; `reduce_fn(size)` returns the call to time."""
    rows = []
    for size in sizes:
        seconds = timed(reduce_fn(size), iterations(size, budget), barrier)
        rows.append({"bytes": size, "seconds": seconds,
                     "busbw": bus_bandwidth(size, seconds, ranks)})
    return rows


def write(out: Path, data: dict) -> None:
    out.write_text(json.dumps(data, indent=1) + "\n")

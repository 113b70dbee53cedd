"""`ringfeed train` with every step's wait for its batches recorded: each rank appends one JSON
line per step, [step of the pass, wait in ms, unix time], to OUT.<rank>, and "pass end" when a
pass is exhausted. What the data-wait share in summary.json sums, step by step (how the demo's
data stall was profiled; benchmarks/README.md, causes of the misses).

    horovodrun -np 2 -H localhost:2 --gloo python benchmarks/workers/step_waits.py OUT \\
        train CONFIG [--set ...]
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Iterable, Iterator
from typing import Any

import ringfeed.train.loop as loop
from ringfeed.train.cli import main

grouped = loop.micro_batch_groups


def recorded(out: str, loader: Iterable, k: int, profiler: Any = None
             ) -> Iterator[tuple[list[Any], float]]:
    with open(f"{out}.{os.environ.get('HOROVOD_RANK', '0')}", "a") as log:
        for n, (group, waited) in enumerate(grouped(loader, k, profiler)):
            log.write(json.dumps([n, round(waited * 1e3, 3), time.time()]) + "\n")
            log.flush()
            yield group, waited
        log.write("pass end\n")


if __name__ == "__main__":
    target = sys.argv[1]
    loop.micro_batch_groups = lambda loader, k, profiler=None: recorded(target, loader, k,
                                                                        profiler)
    sys.exit(main(sys.argv[2:]))

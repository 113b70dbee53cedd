"""Watchdogs of a job's ranks in threads of one process, over their real UDP channel (the
watchdog tests: test_hang.py, test_dead_host.py)."""

from __future__ import annotations

import threading
from pathlib import Path

from ringfeed.train.resilience.watchdog import Limits, Watchdog


class Job:
    """Ranks 0-2 of a job in threads of this process: each its Watchdog over real UDP, the
    hub's addresses passed as Horovod's broadcast would; exits recorded, not taken."""

    def __init__(self, out: Path, limits: Limits, size: int = 3):
        self.exits: dict[int, int] = {}
        self.lines: list[str] = []
        self.dogs = [Watchdog(r, size, limits, out, say=self.lines.append) for r in range(size)]
        for r, dog in enumerate(self.dogs):
            dog.exit = lambda code, r=r: self.exits.setdefault(r, code)
            dog.silence = lambda: None  # (the real one sends this process's output away)
        box: list = []
        ready = threading.Barrier(size)

        def broadcast(value, r):
            if r == 0:
                box.append(value)
            ready.wait()
            return box[0]

        threads = [threading.Thread(target=dog.start, args=(lambda v, r=r: broadcast(v, r),))
                   for r, dog in enumerate(self.dogs)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

    def stop(self):
        for dog in self.dogs:
            dog.stop()

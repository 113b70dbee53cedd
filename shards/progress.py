"""A progress bar (samples, MB/s) when stderr is a terminal; silence otherwise.

Shard writers in forked worker processes add to shared counters; the main process redraws.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import sys
import time


class Progress:
    REFRESH_S = 0.2

    def __init__(self, total_samples: int, enabled: bool | None = None, desc: str = "shard"):
        self.enabled = sys.stderr.isatty() if enabled is None else enabled
        self._start = time.monotonic()
        self._last = 0.0
        self._pid = os.getpid()
        self._counts = mp.Array("q", 2) if self.enabled else None  # samples, bytes
        self._bar = None
        if self.enabled:
            from tqdm import tqdm

            tqdm.monitor_interval = 0  # no monitor thread: shard writers are forked after this
            self._bar = tqdm(total=total_samples, desc=desc, unit="sample", file=sys.stderr,
                             dynamic_ncols=True, leave=False)

    def add(self, samples: int, nbytes: int) -> None:
        """Count finished samples; safe to call from forked workers."""
        if self._counts is None:
            return
        with self._counts.get_lock():
            self._counts[0] += samples
            self._counts[1] += nbytes
        if os.getpid() == self._pid and time.monotonic() - self._last >= self.REFRESH_S:
            self.refresh()

    def on_sample(self, nbytes: int) -> None:
        self.add(1, nbytes)

    def refresh(self) -> None:
        if self._bar is None or self._counts is None:
            return
        self._last = time.monotonic()
        samples, nbytes = self._counts[0], self._counts[1]
        elapsed = max(self._last - self._start, 1e-9)
        self._bar.n = samples
        self._bar.set_postfix_str(f"{nbytes / 1e6 / elapsed:.1f} MB/s", refresh=False)
        self._bar.refresh()

    def close(self) -> None:
        if self._bar is not None:
            self.refresh()
            self._bar.close()


def rate(nbytes: int, seconds: float) -> str:
    return f"{nbytes / 1e6 / max(seconds, 1e-9):.1f} MB/s"


def human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if abs(n) < 1000:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"

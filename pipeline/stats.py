"""Throughput and health counters, for the trainer's bottleneck report.

Worker streams (threads or DataLoader worker processes) count what they read into a
`StreamCounters` and ship the increments beside every batch (`Booked.stats`, stream.py), so
the consumer's `PipelineStats` is complete whatever process did the reading.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from typing import Any

COUNTERS = ("bytes_read", "bytes_downloaded", "cache_hits", "cache_misses", "shards_opened",
            "samples_read", "skipped", "padded", "decoded_hits", "decoded_writes",
            "cached_samples", "decoded_ahead")


class StreamCounters:
    def __init__(self) -> None:
        self.counts: Counter = Counter()
        self.skipped_by_shard: Counter = Counter()

    def take(self) -> dict[str, Any]:
        """The increments since the last take (what travels with a batch)."""
        delta = {"counts": dict(self.counts), "skipped_by_shard": dict(self.skipped_by_shard)}
        self.counts.clear()
        self.skipped_by_shard.clear()
        return delta


class PipelineStats:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.counts: Counter = Counter()
        self.skipped_by_shard: Counter = Counter()
        self.batches = 0
        self.samples = 0
        self.data_wait_s = 0.0
        self._started: float | None = None
        self._last: float | None = None

    def add(self, delta: dict[str, Any] | None) -> None:
        if not delta:
            return
        with self._lock:
            self.counts.update(delta.get("counts", {}))
            self.skipped_by_shard.update(delta.get("skipped_by_shard", {}))

    def waited(self, seconds: float) -> None:
        """The consumer waited `seconds` for a batch (the clock starts with the first wait)."""
        now = time.perf_counter()
        with self._lock:
            if self._started is None:
                self._started = now - seconds
            self.data_wait_s += seconds

    def consumed(self, samples: int) -> None:
        now = time.perf_counter()
        with self._lock:
            if self._started is None:
                self._started = now
            self._last = now
            self.batches += 1
            self.samples += samples

    def as_dict(self) -> dict[str, Any]:
        with self._lock:
            # (a wait starts the clock before any batch is consumed: nothing elapsed until one is)
            elapsed = (self._last - self._started) if self._last is not None else 0.0
            c = self.counts
            lookups = c["cache_hits"] + c["cache_misses"]

            def rate(x: float) -> float:
                return x / elapsed if elapsed > 0 else 0.0

            return {
                "batches": self.batches,
                "samples": self.samples,
                "elapsed_s": elapsed,
                "samples_per_s": rate(self.samples),
                "bytes_read": c["bytes_read"],
                "bytes_per_s": rate(c["bytes_read"]),
                "bytes_downloaded": c["bytes_downloaded"],
                "shards_opened": c["shards_opened"],
                "samples_read": c["samples_read"],
                "cache_hits": c["cache_hits"],
                "cache_misses": c["cache_misses"],
                "cache_hit_rate": c["cache_hits"] / lookups if lookups else None,
                "skipped": c["skipped"],
                "skipped_by_shard": dict(self.skipped_by_shard),
                "padded": c["padded"],
                "decoded_cache_hits": c["decoded_hits"],  # shards served from decoded arrays
                "decoded_cache_writes": c["decoded_writes"],
                # entries found changed since written: removed, never served, written again
                "decoded_cache_damaged": c["decoded_damaged"],
                "cached_samples": c["cached_samples"],  # samples gathered from those arrays
                # samples decoded while their stream waited for a download (ahead.py)
                "decoded_ahead": c["decoded_ahead"],
                # storage faults retried (ringfeed/remote.py): retries, of them throttles
                # (429/503 SlowDown), seconds spent waiting out the backoff
                "storage_retries": c["storage_retries"],
                "storage_throttles": c["storage_throttles"],
                "storage_wait_s": c["storage_wait_s"],
                "data_wait_s": self.data_wait_s,
                "data_wait_fraction": self.data_wait_s / elapsed if elapsed > 0 else 0.0,
            }

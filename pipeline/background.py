"""One background-iterator helper: a thread runs an iterator up to `depth` items ahead of its
consumer through a bounded queue. Used by the worker streams' reader threads (core.py) and the
shard prefetcher (cache.py), so the thread + queue + stop-event pattern is written once.

Items arrive in order; an exception raised by the iterator is re-raised in the consumer at the
position it happened (and ends the iteration); `close()` stops the thread without waiting out
a slow item (a download) and hands items fetched but never consumed to `discard`.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterator
from typing import Any

_END = object()


class _Raised:
    """An exception travelling through the queue (so an iterator may also yield exceptions)."""

    def __init__(self, error: BaseException) -> None:
        self.error = error


class BackgroundIterator:
    def __init__(self, items: Iterator[Any], depth: int, name: str,
                 discard: Callable[[Any], None] | None = None) -> None:
        self._items = items
        self._discard = discard
        self._queue: queue.Queue = queue.Queue(maxsize=max(1, depth))
        self._stop = threading.Event()
        self._done = False
        self._thread = threading.Thread(target=self._run, daemon=True, name=name)
        self._thread.start()

    def _put(self, item: Any) -> bool:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def _run(self) -> None:
        items = self._items
        try:
            for item in items:
                if not self._put(item):
                    if self._discard is not None:
                        self._discard(item)
                    return
            self._put(_END)
        except BaseException as e:  # handed to the consumer, raised there
            self._put(_Raised(e))
        finally:
            close = getattr(items, "close", None)
            if close is not None:
                close()

    def __iter__(self) -> BackgroundIterator:
        return self

    def __next__(self) -> Any:
        if self._done:
            raise StopIteration
        while True:
            try:
                item = self._queue.get(timeout=1.0)
                break
            except queue.Empty:
                if not self._thread.is_alive() and self._queue.empty():
                    self._done = True
                    raise RuntimeError(f"{self._thread.name} stopped without a result") from None
        if item is _END:
            self._done = True
            raise StopIteration
        if isinstance(item, _Raised):
            self._done = True
            raise item.error
        return item

    def ready(self) -> bool:
        """Whether `next` would return without waiting for the thread."""
        return self._done or not self._queue.empty() or not self._thread.is_alive()

    def close(self) -> None:
        """Stop the thread at its next hand-over; discard what it fetched ahead."""
        self._stop.set()
        self._done = True
        self._drain()
        self._thread.join(timeout=0.5)
        self._drain()  # a hand-over that raced with the first drain

    def _drain(self) -> None:
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                return
            if self._discard is not None and item is not _END and not isinstance(item, _Raised):
                self._discard(item)

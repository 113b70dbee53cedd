"""Fork-based process pools that hand their workers one large read-only object.

The object (a scanned source with its sample tables) reaches each worker through the pool's
initializer, whose arguments a forked worker inherits (never pickled), instead of a pickled copy
with every task. The parent keeps nothing: two pools in one process each hand over their own.
"""

from __future__ import annotations

import ctypes
import multiprocessing as mp
import os
import signal
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ProcessPoolExecutor
from functools import partial
from typing import Any, TypeVar

T = TypeVar("T")
R = TypeVar("R")

PR_SET_PDEATHSIG = 1  # <sys/prctl.h>
_worker_shared: Any = None  # set only in a forked worker, by _start_worker: the worker's own


def _call(fn: Callable[[Any, T], R], item: T) -> R:
    return fn(_worker_shared, item)


def _start_worker(parent: int, shared: Any) -> None:
    """A forked worker's start: die with the parent, keep the pool's shared object."""
    global _worker_shared
    _worker_shared = shared
    die_with_parent(parent)


def die_with_parent(parent: int) -> None:
    """In a worker: be killed when the process that forked it dies, even by SIGKILL (Linux's
    PR_SET_PDEATHSIG; the pool's own watch needs a live parent), so a killed `ringfeed shard`
    leaves no worker writing on."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):  # not Linux: the pool's watch is what there is
        return
    if os.getppid() != parent:  # it died before the death signal was armed
        os._exit(1)


def fork_pool(workers: int, shared: Any) -> ProcessPoolExecutor:
    """A pool of `workers` forked processes; `pool_task(fn)` runs `fn(shared, item)` in them."""
    return ProcessPoolExecutor(workers, mp_context=mp.get_context("fork"),
                               initializer=_start_worker, initargs=(os.getpid(), shared))


def pool_task(fn: Callable[[Any, T], R]) -> Callable[[T], R]:
    """`fn(shared, item)` as a picklable one-argument task for a `fork_pool`."""
    return partial(_call, fn)


def parallel_map(fn: Callable[[Any, T], R], items: Iterable[T], workers: int, shared: Any,
                 chunksize: int = 64) -> Iterator[R]:
    """`fn(shared, item)` for each item, in order; in this process when `workers` is 1."""
    items = list(items)
    if workers <= 1 or len(items) < 2:
        for item in items:
            yield fn(shared, item)
        return
    with fork_pool(workers, shared) as pool:
        yield from pool.map(pool_task(fn), items, chunksize=chunksize)

"""Fork-based process pools that hand their workers one large read-only object.

The object (a scanned source with its sample tables) is set as a module global before the pool
forks, so each worker inherits it instead of receiving a pickled copy with every task.
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

_shared: Any = None
PR_SET_PDEATHSIG = 1  # <sys/prctl.h>


def _call(fn: Callable[[Any, T], R], item: T) -> R:
    return fn(_shared, item)


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
    global _shared
    _shared = shared
    # Python 3.11 forks every worker when the first task is submitted, after `_shared` is set.
    return ProcessPoolExecutor(workers, mp_context=mp.get_context("fork"),
                               initializer=die_with_parent, initargs=(os.getpid(),))


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

"""Fork-based pools of `ringfeed shard` (shards/parallel.py): results in input order whatever the
number of workers, the shared object reaching the workers without being pickled, and work in
this process when one worker (or one item) is asked for."""

from __future__ import annotations

import os
import threading

from ringfeed.shards.parallel import parallel_map


class Unpicklable:
    """A shared object that cannot be pickled (a lock): workers must inherit it by fork."""

    def __init__(self, base: int):
        self.base = base
        self.lock = threading.Lock()


def add(shared: Unpicklable, item: int) -> tuple[int, int]:
    return shared.base + item, os.getpid()


def test_one_worker_runs_in_this_process_in_order():
    results = list(parallel_map(add, [3, 1, 2], 1, Unpicklable(10)))
    assert results == [(13, os.getpid()), (11, os.getpid()), (12, os.getpid())]


def test_several_workers_fork_get_the_shared_object_and_keep_the_order():
    items = list(range(40))
    results = list(parallel_map(add, items, 2, Unpicklable(100), chunksize=3))
    assert [r for r, _ in results] == [100 + i for i in items]
    assert os.getpid() not in {pid for _, pid in results}


def test_a_single_item_needs_no_pool():
    assert list(parallel_map(add, [5], 4, Unpicklable(0))) == [(5, os.getpid())]

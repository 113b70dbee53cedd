"""pipeline/background.py: BackgroundIterator runs an iterator in a thread, a bounded number of
items ahead of its consumer. Real threads and generators; timing bounds are generous."""

from __future__ import annotations

import threading
import time

import pytest

from ringfeed.pipeline.background import BackgroundIterator


def counting(n, produced, gate=None):
    """Yields 0..n-1, recording each item as it is made; `gate`: wait for it before each."""
    for i in range(n):
        if gate is not None:
            gate.wait()
        produced.append(i)
        yield i


def wait_until(condition, timeout=5.0):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_items_arrive_in_order_then_the_iteration_ends_for_good():
    it = BackgroundIterator(iter(range(50)), depth=4, name="t-order")
    assert list(it) == list(range(50))
    with pytest.raises(StopIteration):
        next(it)
    it.close()


def test_the_thread_runs_at_most_depth_items_ahead_of_the_consumer():
    produced: list[int] = []
    it = BackgroundIterator(counting(100, produced), depth=3, name="t-depth")
    wait_until(lambda: len(produced) >= 3)
    time.sleep(0.3)  # it would run further now if the queue did not bound it
    # `depth` in the queue, plus the one made and waiting for a place
    assert 3 <= len(produced) <= 4
    assert next(it) == 0
    wait_until(lambda: len(produced) >= 4)
    time.sleep(0.2)
    assert len(produced) <= 5
    it.close()


def test_an_exception_is_raised_at_its_position_and_ends_the_iteration():
    def failing():
        yield 1
        yield 2
        raise ValueError("bad item 3")

    it = BackgroundIterator(failing(), depth=8, name="t-raise")
    assert next(it) == 1
    assert next(it) == 2
    with pytest.raises(ValueError, match="bad item 3"):
        next(it)
    with pytest.raises(StopIteration):
        next(it)
    it.close()


def test_an_exception_object_yielded_as_an_item_is_an_item():
    error = KeyError("just data")
    it = BackgroundIterator(iter([error, 5]), depth=2, name="t-item")
    assert list(it) == [error, 5]


def test_close_discards_what_was_fetched_ahead_and_closes_the_source():
    closed = threading.Event()
    produced: list[int] = []

    def source():
        try:
            yield from counting(100, produced)
        finally:
            closed.set()

    discarded: list[int] = []
    it = BackgroundIterator(source(), depth=3, name="t-close", discard=discarded.append)
    assert next(it) == 0
    wait_until(lambda: len(produced) >= 4)
    it.close()
    assert closed.wait(5.0)  # the generator's finally ran in the thread
    # every item made is consumed or discarded, exactly once
    assert sorted([0, *discarded]) == sorted(produced)
    with pytest.raises(StopIteration):
        next(it)


def test_close_does_not_wait_out_a_slow_item():
    gate = threading.Event()
    produced: list[int] = []
    it = BackgroundIterator(counting(10, produced, gate), depth=2, name="t-slow")
    started = time.monotonic()
    it.close()  # the thread is blocked before its first item (a download, say)
    assert time.monotonic() - started < 2.0
    gate.set()  # let the thread finish: its item has nowhere to go
    wait_until(lambda: all(t.name != "t-slow" for t in threading.enumerate()))
    assert produced == [0]

"""Batch assembly (pipeline/batch.py): which fields stack into one array (same shape and dtype,
or numbers of one kind) and which stay lists, and `gather`, the decoded cache's batch, equal
to collate() of the same samples."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from ringfeed.pipeline.batch import collate, gather, stack


def test_arrays_of_one_shape_and_dtype_stack():
    out = stack([np.zeros((2, 3), np.uint8), np.ones((2, 3), np.uint8)])
    assert out.shape == (2, 2, 3) and out.dtype == np.uint8


@pytest.mark.parametrize("values", [
    [np.zeros(3), np.zeros(4)],  # ragged
    [np.zeros(3, np.float32), np.zeros(3, np.float64)],  # mixed dtypes
    [np.zeros(3), [0, 0, 0]],
    ["a", "b"], [b"x", b"y"], [{"a": 1}, {"a": 2}],
    [1, 2.5, "3"], [True, 1], [1, True],
])
def test_values_that_do_not_stack_stay_a_list(values):
    assert stack(values) is values


@pytest.mark.parametrize("values, dtype", [
    ([1, np.int16(2)], np.int64), ([True, np.bool_(False)], np.bool_),
    ([1.5, 2, np.float32(3)], np.float64),
])
def test_numbers_of_one_kind_become_one_array(values, dtype):
    out = stack(values)
    assert isinstance(out, np.ndarray) and out.dtype == dtype and len(out) == len(values)


def test_collate_stacks_field_by_field():
    samples = [{"x": np.full(2, i, np.float32), "cls": i, "txt": f"s{i}"} for i in range(3)]
    batch = collate(samples)
    assert batch["x"].tolist() == [[0, 0], [1, 1], [2, 2]]
    assert batch["cls"].dtype == np.int64 and batch["txt"] == ["s0", "s1", "s2"]


def entry(offset: int, n: int):
    """What gather reads of a decoded-cache entry: fixed-shape arrays and keys."""
    return SimpleNamespace(arrays={"x": np.arange(offset, offset + 2 * n, dtype=np.float32)
                                   .reshape(n, 2),
                                   "cls": np.arange(offset, offset + n)},
                           ragged={}, keys=[f"k{offset + i}" for i in range(n)])


def test_gather_is_collate_of_the_same_samples_in_batch_order():
    sources = [entry(0, 4), entry(100, 3)]
    positions = np.array([2, 0, 3, 1, 2])
    source_of = np.array([0, 1, 0, 1, 1])
    batch, keys = gather(sources, positions, source_of)
    samples = [{name: sources[s].arrays[name][p] for name in ("x", "cls")}
               for s, p in zip(source_of, positions, strict=True)]
    expected = collate(samples)
    assert keys == ["k2", "k100", "k3", "k101", "k102"]
    for name in ("x", "cls"):
        assert np.array_equal(batch[name], expected[name])
        assert batch[name].dtype == expected[name].dtype

"""The manifest's per-feature statistics of a table (shards/sources/tablestats.py): mean, std
(population), min and max over the train split's rows only, read in chunks from the scan's
stats rows, equal to numpy's over the same rows whatever the chunking."""

from __future__ import annotations

import numpy as np
import pytest

from ringfeed.shards.sources import tablestats
from ringfeed.shards.sources.tablestats import moments


def stats_files(tmp_path, parts: dict[str, np.ndarray]):
    files = {}
    for part, rows in parts.items():
        files[part] = tmp_path / f"{part}.stats"
        rows.astype(np.float64).tofile(files[part])
    return files, {part: len(rows) for part, rows in parts.items()}


@pytest.mark.parametrize("chunk", [1, 3, 65536])
def test_moments_are_numpys_over_the_train_rows_whatever_the_chunk(tmp_path, monkeypatch,
                                                                   chunk):
    monkeypatch.setattr(tablestats, "STATS_CHUNK", chunk)
    rng = np.random.default_rng(0)
    parts = {"a": rng.normal(5, 2, (10, 3)), "b": rng.normal(-1, 1, (7, 3))}
    files, rows_in = stats_files(tmp_path, parts)
    train = [("a", np.array([9, 0, 4, 5, 1])), ("b", np.array([6, 2]))]  # val: the rest
    mean, std, low, high = moments(files, rows_in, 3, train)
    chosen = np.concatenate([parts["a"][[9, 0, 4, 5, 1]], parts["b"][[6, 2]]])
    assert np.allclose(mean, chosen.mean(0)) and np.allclose(std, chosen.std(0))
    assert np.array_equal(low, chosen.min(0)) and np.array_equal(high, chosen.max(0))


def test_no_train_rows_or_no_numbers_give_no_statistics(tmp_path):
    files, rows_in = stats_files(tmp_path, {"a": np.zeros((4, 2))})
    assert moments(files, rows_in, 2, [("a", np.array([], np.int64))]) == (None,) * 4
    assert moments(files, rows_in, 0, [("a", np.arange(4))]) == (None,) * 4


def test_a_large_offset_does_not_cost_precision(tmp_path):
    values = 1e9 + np.array([[0.0], [1.0], [2.0], [3.0]])  # two passes: no E[x^2] - E[x]^2
    files, rows_in = stats_files(tmp_path, {"a": values})
    _, std, _, _ = moments(files, rows_in, 1, [("a", np.arange(4))])
    assert std[0] == pytest.approx(np.std([0.0, 1.0, 2.0, 3.0]), rel=1e-9)

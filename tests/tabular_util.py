"""Real tables for the tabular tests, made from scikit-learn's bundled datasets (no download):
breast cancer (569 rows, 30 float features, a 0/1 label) and diabetes (442 rows, 10 features, a
float target), written as CSV (Python's csv module) and Parquet (pyarrow)."""

from __future__ import annotations

import csv
from pathlib import Path

import numpy as np


def _dataset(name: str) -> tuple[list[str], np.ndarray, np.ndarray, str]:
    from sklearn.datasets import load_breast_cancer, load_diabetes

    if name == "breast_cancer":
        d = load_breast_cancer()
        return list(d.feature_names), d.data, d.target.astype(np.int64), "label"
    d = load_diabetes(scaled=False)
    return list(d.feature_names), d.data, d.target.astype(np.float64), "progression"


def write_csv(path: Path, name: str) -> Path:
    """The dataset as CSV: a header, one row per sample, numbers as Python writes them."""
    columns, x, y, target = _dataset(name)
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow([*columns, target])
        for row, value in zip(x.tolist(), y.tolist(), strict=True):
            w.writerow([*map(repr, row), repr(value)])
    return path


def write_parquet(path: Path, name: str, row_group_size: int = 100) -> Path:
    """The dataset as Parquet (float64 features, int64 or float64 target), several row groups."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    columns, x, y, target = _dataset(name)
    table = pa.table({**{c: pa.array(x[:, i]) for i, c in enumerate(columns)},
                      target: pa.array(y)})
    pq.write_table(table, path, row_group_size=row_group_size)
    return path


def target_column(name: str) -> str:
    return _dataset(name)[3]

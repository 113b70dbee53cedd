"""Tables, the manifest's `features`: what each member holds, and the mean/std (min/max for a
field) of its numbers over the train split, read from the scan's stats rows."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from ringfeed.shards.sources.tableencode import RowEncoder
from ringfeed.shards.sources.tableplan import Member

STATS_CHUNK = 65536  # rows per read when the train split's mean/std are computed


def column_stats(encoder: RowEncoder, moments: tuple[np.ndarray | None, ...]
                 ) -> dict[str, Any]:
    """{ext: entry} per member of the encoder's plan, given moments() of the train rows."""
    mean, std, low, high = moments
    plan = encoder.plan
    out: dict[str, Any] = {}
    for m in plan.members:
        entry: dict[str, Any] = {"role": m.role, "columns": list(m.columns)}
        if m.role == "features":
            entry["names"] = list(m.names)
            vocab = {name: list(v) for name, v in m.slots if v is not None}
            if vocab:
                entry["vocabulary"] = vocab
        elif m.columns[0] in plan.categorical:
            entry["vocabulary"] = list(plan.vocab[m.columns[0]])
        if m.kind == "npy":
            dtype, shape = encoder.array_type(m)
            entry["dtype"] = dtype
            entry["shape"] = None if shape is None else list(shape)
        if m.stats >= 0 and mean is not None:
            entry.update(_span_stats(m, mean, std, low, high))
        filled = {n: encoder.filled[n] for n in m.columns if encoder.filled[n]}
        if filled:
            entry["filled"] = filled
        out[m.ext] = entry
    return out


def _span_stats(m: Member, mean: np.ndarray, std: Any, low: Any, high: Any) -> dict[str, Any]:
    span = slice(m.stats, m.stats + m.width)
    entry: dict[str, Any] = dict(mean=mean[span].tolist(), std=std[span].tolist(),
                                 stats_split="train")
    if m.role == "field":
        entry.update(min=float(low[m.stats]), max=float(high[m.stats]))
    return entry


def moments(stat_files: Mapping[str, Path], rows_in: Mapping[str, int], width: int,
            train: list[tuple[str, np.ndarray]]) -> tuple[np.ndarray | None, ...]:
    """Per stats column over the train rows: mean, std (population), min, max; float64,
    two passes over the stats files in chunks (bounded memory, stable). `rows_in`: rows per
    part (each part's file holds `width` float64 numbers per row)."""
    total = sum(len(i) for _, i in train)
    if not width or not total:
        return None, None, None, None

    def chunks() -> Iterator[np.ndarray]:
        for part, indices in train:
            rows = np.memmap(stat_files[part], np.float64, "r", shape=(rows_in[part], width))
            order = np.sort(indices)
            for at in range(0, len(order), STATS_CHUNK):
                yield np.asarray(rows[order[at:at + STATS_CHUNK]])
    acc = np.zeros(width)
    low, high = np.full(width, np.inf), np.full(width, -np.inf)
    for block in chunks():
        acc += block.sum(0)
        low, high = np.minimum(low, block.min(0)), np.maximum(high, block.max(0))
    mean = acc / total
    sq = np.zeros(width)
    for block in chunks():
        sq += ((block - mean) ** 2).sum(0)
    return mean, np.sqrt(sq / total), low, high

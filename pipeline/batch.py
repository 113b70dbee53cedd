"""Batch assembly: samples -> one array per field (or a list when the values do not stack)."""

from __future__ import annotations

from typing import Any

import numpy as np


def collate(samples: list[dict[str, Any]]) -> dict[str, Any]:
    """Field -> stacked array when every value is an array of one shape/dtype or a number;
    otherwise a list (strings, dicts, bytes, ragged arrays)."""
    return {name: stack([s[name] for s in samples]) for name in samples[0]}


def stack(values: list[Any]) -> Any:
    first = values[0]
    if isinstance(first, np.ndarray):
        if all(isinstance(v, np.ndarray) and v.shape == first.shape and v.dtype == first.dtype
               for v in values):
            return np.stack(values)
        return values
    if isinstance(first, (bool, np.bool_)):
        if all(isinstance(v, (bool, np.bool_)) for v in values):
            return np.array(values, dtype=bool)
    elif isinstance(first, (int, np.integer)):
        if all(isinstance(v, (int, np.integer)) and not isinstance(v, bool) for v in values):
            return np.array(values, dtype=np.int64)
    elif isinstance(first, (float, np.floating)):
        if all(isinstance(v, (float, int, np.number)) and not isinstance(v, bool)
               for v in values):
            return np.array(values)
    return values


def gather(sources: list[Any], positions: np.ndarray, source_of: np.ndarray
           ) -> tuple[dict[str, Any], list[str]]:
    """A batch straight from decoded-cache entries: element i is sample `positions[i]` of
    `sources[source_of[i]]` (each with `arrays`, `ragged` and `keys`); one fancy-index copy per
    field and entry, no per-sample dicts. The arrays equal collate() of the same samples; a
    ragged image field is a list of SourceImages (Decoder.realize_columns augments them)."""
    first = sources[0]
    out = {name: np.empty((len(positions), *a.shape[1:]), a.dtype)
           for name, a in first.arrays.items()}
    keys: list[str] = [""] * len(positions)
    ragged: dict[str, list[Any]] = {name: [None] * len(positions) for name in first.ragged}
    for k, source in enumerate(sources):
        rows = np.flatnonzero(source_of == k)
        picked = positions[rows]
        for name, array in source.arrays.items():
            out[name][rows] = array[picked]
        for i, p in zip(rows.tolist(), picked.tolist(), strict=True):
            keys[i] = source.keys[p]
            for name, images in ragged.items():
                images[i] = source.source_image(name, p)
    return {**out, **ragged}, keys

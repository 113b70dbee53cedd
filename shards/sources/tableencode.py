"""Tables, one row -> its members' bytes, as a `TablePlan` says. The encoder reads the plan and
never changes it; what it learns while encoding (the cells --fill filled, each npy field's dtype
and shape) it keeps in its own counters, which the manifest reads."""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ringfeed.errors import UserError
from ringfeed.formats.members import encode, json_bytes, npy_bytes
from ringfeed.shards.sources.tableplan import NUMERIC, REST, Member, TablePlan


@dataclass
class Encoded:
    """One row's members: bytes, the members that are image paths (read at write time), their
    tar sizes, and the row's numbers for the stats."""

    members: dict[str, bytes] = field(default_factory=dict)
    paths: set[str] = field(default_factory=set)
    sizes: dict[str, int] = field(default_factory=dict)
    numbers: list[float] = field(default_factory=list)


class RowEncoder:
    """Rows -> members by a plan. `filled`: column -> missing cells filled (or one-hot zeros);
    `arrays`: npy field ext -> (dtype, shape of its values; None: varies)."""

    def __init__(self, plan: TablePlan, fmt: str, fill: float | None,
                 list_dtype: Callable[[str], Any]):
        self.plan = plan
        self.format = fmt
        self.fill = fill
        self.list_dtype = list_dtype
        self.filled: Counter = Counter()
        self.arrays: dict[str, tuple[str, tuple[int, ...] | None]] = {}

    def value(self, row: dict[str, Any], name: str, where: str, required: bool = False) -> Any:
        """A row's value of column `name` (None: missing). A JSON row without a `required`
        field (one that is not a number) is an error."""
        if required and name not in row and self.format == "jsonl":
            raise UserError(f"{where}: no field {name!r} (fields: {', '.join(row)})")
        return row.get(name)

    def number(self, value: Any, name: str, where: str) -> Any:
        """A numeric cell's value; a missing (or NaN, inf) one takes --fill or is an error."""
        if value is None or (isinstance(value, float) and not np.isfinite(value)):
            if self.fill is None:
                what = "has no value (a missing cell)" if value is None else f"is {value}"
                raise UserError(f"{where}: column {name!r} {what}; fill missing cells with "
                                "--fill VALUE, or fix the table")
            self.filled[name] += 1
            return self.fill
        if isinstance(value, (bool, int, float, np.number)):
            return value
        raise UserError(f"{where}: column {name!r}: {value!r} is not a number")

    def category(self, value: Any, name: str) -> int | None:
        """The id of a categorical value; None for a missing one."""
        return None if value is None else self.plan.vocab[name][value]

    def encode(self, row: dict[str, Any], where: str, path: Path) -> Encoded:
        out = Encoded()
        for m in self.plan.members:
            if m.role == "features":
                out.members[m.ext] = self._features(m, row, where, out.numbers)
            else:
                self._field(m, row, where, path, out)
        rest = {k: v for k, v in row.items() if k not in self.plan.used}
        if rest:
            out.members[REST] = json_bytes(rest)
        return out

    def _features(self, m: Member, row: dict[str, Any], where: str,
                  numbers: list[float]) -> bytes:
        vector = np.zeros(len(m.names), np.float32)
        at = 0
        for name, vocab in m.slots:
            value = self.value(row, name, where)
            if vocab is None:
                vector[at] = self.number(value, name, where)
                at += 1
            else:  # one-hot; a missing category is all zeros
                category = self.category(value, name)
                if category is None:
                    self.filled[name] += 1
                else:
                    vector[at + category] = 1.0
                at += len(vocab)
        numbers.extend(vector.tolist())
        return m.header + vector.tobytes()

    def _field(self, m: Member, row: dict[str, Any], where: str, path: Path,
               out: Encoded) -> None:
        name = m.columns[0]
        categorical = name in self.plan.categorical
        numeric = m.kind in ("int", "npy") and (m.column_kind in NUMERIC or categorical)
        value = self.value(row, name, where, required=not numeric)
        if m.kind == "image":
            data, size = image_value(value, f"{where}: field {name!r}", path)
            if isinstance(data, str):
                out.paths.add(m.ext)
                out.sizes[m.ext] = size
                data = data.encode()
            out.members[m.ext] = data
            return
        if categorical:
            value = self.category(value, name)
            if value is None:
                raise UserError(f"{where}: column {name!r} has no value (a missing "
                                "category); fix the table")
        elif numeric:
            value = self.number(value, name, where)
        elif m.kind == "int" and m.column_kind == "str":
            raise UserError(f"{where}: field {name!r}: cannot store {value!r} as .{m.ext} "
                            f"(a class index is an integer; map text labels to ids with "
                            f"--categorical {name})")
        if m.kind == "npy":
            array_ = self._array(value, m, name, where)
            if m.stats >= 0:
                out.numbers.append(float(array_.item()))
            out.members[m.ext] = npy_bytes(array_)
        else:
            out.members[m.ext] = encode(m.ext, value, f"{where}: field {name!r}")

    def _array(self, value: Any, m: Member, name: str, where: str) -> np.ndarray:
        """An npy field's value: a number keeps its column's type (int64, float64, bool), a
        list is an array (dtype from the schema, or numpy's)."""
        if value is None:
            raise UserError(f"{where}: column {name!r} has no value (a missing cell)")
        dtype = {"int": np.int64, "float": np.float64, "bool": np.bool_}.get(m.column_kind)
        if name in self.plan.categorical:
            dtype = np.int64
        elif dtype is np.int64 and isinstance(value, float) and not value.is_integer():
            raise UserError(f"{where}: column {name!r} holds integers; --fill {value} is not "
                            "one")
        try:
            out = np.asarray(value, dtype=dtype or self.list_dtype(name))
        except (TypeError, ValueError) as e:
            raise UserError(f"{where}: field {name!r}: cannot store {value!r} as .{m.ext} "
                            f"({e})") from None
        if out.dtype.hasobject:
            raise UserError(f"{where}: field {name!r}: a ragged or mixed value cannot be an "
                            f".{m.ext} array (store it as json)")
        out = np.atleast_1d(out)  # as npy_bytes stores it: a number is shape (1,)
        seen = self.arrays.get(m.ext)
        if seen is None:
            self.arrays[m.ext] = (out.dtype.name, out.shape)
        elif seen[1] is not None and seen[1] != out.shape:
            self.arrays[m.ext] = (seen[0], None)  # varies from row to row
        return out

    def array_type(self, m: Member) -> tuple[str | None, tuple[int, ...] | None]:
        """(dtype, shape) of an npy member's values, for the manifest."""
        if m.role == "features":
            return "float32", (m.width,)
        return self.arrays.get(m.ext, (None, ()))


def image_value(value: Any, where: str, table: Path) -> tuple[bytes | str, int]:
    """(bytes, size) of an image value, or (file path, size) of an image file it names:
    a path relative to the table's folder, bytes, or Hugging Face's {bytes, path}."""
    if isinstance(value, dict):
        value = value.get("bytes") or value.get("path")
    if isinstance(value, (bytes, bytearray)):
        return bytes(value), len(value)
    if not isinstance(value, str) or not value:
        raise UserError(f"{where}: no image (expected a file path or image bytes, got "
                        f"{value!r})")
    path = os.path.join(os.path.dirname(table), value)
    try:
        return path, os.stat(path).st_size
    except OSError as e:
        raise UserError(f"{where}: {path}: cannot read ({e.strerror})") from None

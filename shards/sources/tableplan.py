"""Tables, from the scan to the plan: what the scan learns about each column (`Column`), and
`plan_table`, which turns that and the table options into a frozen `TablePlan`: the members a
row becomes, the categorical vocabularies, and where each member's numbers go in the stats rows.
The plan is computed once, after the typing pass, and only read after that."""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import MappingProxyType
from typing import Any

import numpy as np

from ringfeed.errors import UserError
from ringfeed.formats.kinds import kind_of
from ringfeed.formats.members import npy_bytes
from ringfeed.shards.keys import check_ext

REST = "json"  # the member holding the columns no other member names
DEFAULT_FEATURES = "x.npy"
NUMERIC = frozenset({"int", "float", "bool"})
MISSING = frozenset({"", "na", "n/a", "nan", "null", "none"})  # CSV cells that hold no value
# numbers as written; a leading zero (007, 02139) makes a code, which stays text
_INT = re.compile(r"^[+-]?(0|[1-9]\d*)$")
_FLOAT = re.compile(r"^[+-]?((0|[1-9]\d*)(\.\d*)?|\.\d+)([eE][+-]?\d+)?$")


def value_kind(value: Any) -> str | None:
    """The column kind a JSON/Parquet value stands for; None for a missing value."""
    if value is None:
        return None
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, int):
        return "int"
    if isinstance(value, float):
        return "float" if np.isfinite(value) else None  # NaN: missing, as pandas writes it
    if isinstance(value, str):
        return "str"
    if isinstance(value, (list, tuple)):
        return "list"
    if isinstance(value, (bytes, bytearray)):
        return "binary"
    return "other"


def cell_kind(cell: str) -> str | None:
    """The kind of one CSV cell (None: missing)."""
    text = cell.strip()
    if text.lower() in MISSING:
        return None
    if _INT.match(text):
        return "int"
    if _FLOAT.match(text):
        return "float"
    if text.lower() in ("true", "false"):
        return "bool"
    return "str"


@dataclass
class Column:
    """What the scan learned about one column over every row."""

    name: str
    kinds: set[str] = field(default_factory=set)  # kinds of its non-missing values
    first_text: tuple[str, Any] | None = None  # (where, value): its first value not a number
    numbers: int = 0  # values that are numbers
    vocab: set | None = None  # the distinct values of a --categorical column
    kind_hint: str | None = None  # Parquet: the kind its schema gives

    def see(self, kind: str | None, value: Any, where: str) -> None:
        if kind is None:
            return
        self.kinds.add(kind)
        if kind in NUMERIC:
            self.numbers += 1
        elif self.first_text is None:
            self.first_text = (where, value)
        if self.vocab is not None:
            if isinstance(value, (list, dict, bytes)):
                raise UserError(f"{where}: column {self.name!r}: --categorical takes text or "
                                f"numbers, not {type(value).__name__} values")
            self.vocab.add(value)

    @property
    def kind(self) -> str:
        """int, float, bool, str, list, binary, image, other; or null: no value at all."""
        if self.kind_hint is not None:
            return self.kind_hint
        if not self.kinds:
            return "null"
        if self.kinds <= {"int"}:
            return "int"
        if self.kinds <= {"int", "float"}:
            return "float"
        if len(self.kinds) == 1:
            return next(iter(self.kinds))
        return "other"

    @property
    def numeric(self) -> bool:
        return self.kind in NUMERIC

    @property
    def mixed(self) -> bool:
        """Numbers and text in one column: a typo in a numeric column, most likely."""
        return self.numbers > 0 and self.first_text is not None


def vocab_order(value: Any) -> tuple:
    """Vocabulary order: numbers (and CSV cells that are numbers) by value, then text."""
    if isinstance(value, (bool, int, float)):
        return (0, float(value), "")
    if isinstance(value, str) and cell_kind(value) in ("int", "float"):
        return (0, float(value), value)
    return (1, 0.0, str(value))


@dataclass(frozen=True)
class TableSpec:
    """The table options of one run, checked: --field, --key, --features, --categorical, --fill."""

    fields: Mapping[str, str]  # column -> member ext (lower case, checked)
    key_field: str | None
    features: tuple[tuple[str, str], ...] | None  # (COLS, EXT) per --features
    categorical: tuple[str, ...]
    fill: float | None

    @classmethod
    def of(cls, opts: Any) -> TableSpec:
        fields = {name: check_ext(ext.lower(), f"--field {name}={ext}")
                  for name, ext in opts.fields.items()}
        if REST in fields.values():
            raise UserError(f"--field ...={REST}: the {REST} member holds the columns no other "
                            "member names; store this field under another name (e.g. meta.json)")
        features = None if opts.features is None else tuple(tuple(s) for s in opts.features)
        return cls(MappingProxyType(fields), opts.key_field, features,
                   tuple(dict.fromkeys(opts.categorical)), opts.fill)


@dataclass(frozen=True)
class Member:
    """One tar member made from columns: a --field (one column) or a feature vector."""

    ext: str
    columns: tuple[str, ...]
    role: str  # "field" or "features"
    kind: str = ""  # the member's kind (manifest fields)
    column_kind: str = ""  # field: the column's kind
    slots: tuple[tuple[str, tuple | None], ...] = ()  # features: (column, vocabulary when
    # one-hot)
    names: tuple[str, ...] = ()  # features: one name per vector element
    header: bytes = b""  # features: the .npy header of a float32 vector of this width
    stats: int = -1  # first column of its numbers in the stats matrix (-1: none)

    @property
    def width(self) -> int:
        return len(self.names) if self.role == "features" else 1


@dataclass(frozen=True)
class TablePlan:
    """Which member holds which column, decided once from the scan; read, never changed."""

    members: tuple[Member, ...]
    vocab: Mapping[str, Mapping[Any, int]]  # categorical column -> {value: id}
    used: frozenset[str]  # the columns some member holds (the rest go into `json`)
    stats_width: int  # numbers per row in the stats rows
    categorical: tuple[str, ...]
    key_field: str | None

    @property
    def exts(self) -> list[str]:
        return [m.ext for m in self.members]

    def member(self, ext: str) -> Member | None:
        return next((m for m in self.members if m.ext == ext), None)


def missing_column(path: Path, columns: Mapping[str, Column], name: str, what: str) -> UserError:
    return UserError(f"{path}: no column {name!r} named by {what} (columns: "
                     f"{', '.join(columns)})")


@dataclass(frozen=True)
class _Planning:
    """What the member choices read: the columns (a copy), the spec, the format and path."""

    cols: dict[str, Column]
    spec: TableSpec
    format: str
    path: Path
    vocab: Mapping[str, Mapping[Any, int]]

    def missing(self, name: str, what: str) -> UserError:
        return missing_column(self.path, self.cols, name, what)


def plan_table(columns: Mapping[str, Column], spec: TableSpec, fmt: str, path: Path) -> TablePlan:
    """The plan of a table whose columns the typing pass found (`columns` is not changed)."""
    cols = dict(columns)
    for name in spec.categorical:
        if name not in cols:
            raise missing_column(path, cols, name, "--categorical")
    vocab = MappingProxyType({
        name: MappingProxyType({v: i for i, v in enumerate(sorted(cols[name].vocab or (),
                                                                  key=vocab_order))})
        for name in spec.categorical})
    p = _Planning(cols, spec, fmt, path, vocab)
    named = set(spec.fields) | ({spec.key_field} if spec.key_field else set())
    members = [_field_member(p, name, ext) for name, ext in spec.fields.items()]
    members += _default_features(p, named) if spec.features is None else _features(p, named)
    _check_exts(members)
    if spec.key_field and spec.key_field not in cols:
        raise p.missing(spec.key_field, "--key")
    width, placed = 0, []
    for m in members:
        if m.role == "features" or (m.kind == "npy" and m.column_kind in NUMERIC
                                    and m.columns[0] not in spec.categorical):
            m, width = replace(m, stats=width), width + m.width
        placed.append(m)
    return TablePlan(tuple(placed), vocab, frozenset(n for m in placed for n in m.columns),
                     width, spec.categorical, spec.key_field)


def _default_features(p: _Planning, named: set[str]) -> list[Member]:
    """Without --features: every numeric or categorical column no option names, as x.npy."""
    categorical = p.spec.categorical
    free = [c for c in p.cols.values() if c.name not in named
            and (c.numeric or c.name in categorical or c.mixed)]
    for c in free:
        if c.mixed and c.name not in categorical:
            where, value = c.first_text
            raise UserError(
                f"{where}: column {c.name!r}: {value!r} is not a number, but the "
                f"column's other values are; fix that cell, or name the column "
                f"(--field {c.name}=txt, --categorical {c.name}) or the feature "
                "columns (--features COLS=x.npy)")
    return [_vector(p, DEFAULT_FEATURES, [c.name for c in free])] if free else []


def _features(p: _Planning, named: set[str]) -> list[Member]:
    """One vector member per --features COLS=EXT."""
    specs = p.spec.features or ()
    explicit = {name.strip() for spec, _ in specs for name in spec.split(",")} & set(p.cols)
    members = []
    for spec, ext in specs:
        chosen = _select(p, spec, named, explicit)
        if not chosen:
            raise UserError(f"--features {spec}={ext}: no column matches (columns: "
                            f"{', '.join(p.cols)})")
        members.append(_vector(p, check_ext(ext.lower(), f"--features {spec}={ext}"), chosen))
    return members


def _check_exts(members: list[Member]) -> None:
    seen: dict[str, str] = {}
    for m in members:
        if m.ext in seen or m.ext == REST:
            raise UserError(f"{', '.join(m.columns[:3])} and {seen.get(m.ext, REST)} would "
                            f"both be member .{m.ext}; give them different extensions")
        seen[m.ext] = ", ".join(m.columns[:3])


def _select(p: _Planning, spec: str, named: set[str], explicit: set[str]) -> list[str]:
    """The columns of one --features COLS, in order: names as given; a glob's matches and
    `numeric` (numeric columns no other option names) in table order. Globs and `numeric`
    skip the --field and --key columns."""
    chosen: list[str] = []
    for term in (t.strip() for t in spec.split(",")):
        if term == "numeric":
            found = [c.name for c in p.cols.values() if c.numeric
                     and c.name not in named | explicit and c.name not in p.spec.categorical]
        elif any(ch in term for ch in "*?["):
            found = [n for n in p.cols if fnmatch.fnmatchcase(n, term) and n not in named]
        elif term in p.cols:
            found = [term]
        else:
            raise p.missing(term, f"--features {spec}")
        chosen.extend(n for n in found if n not in chosen)
    return chosen


def _field_member(p: _Planning, name: str, ext: str) -> Member:
    col = p.cols.get(name)
    if col is None:
        if p.format != "jsonl":  # jsonl rows report it (naming the first such row)
            raise p.missing(name, f"--field {name}={ext}")
        col = p.cols[name] = Column(
            name, vocab=set() if name in p.spec.categorical else None)
    return Member(ext, (name,), "field", kind_of(ext), col.kind)


def _vector(p: _Planning, ext: str, names: list[str]) -> Member:
    """A float32 vector member; each categorical column one-hot over its vocabulary."""
    if kind_of(ext) != "npy":
        raise UserError(f"--features ...={ext}: a feature vector is an .npy member "
                        "(e.g. x.npy)")
    slots: list[tuple[str, tuple | None]] = []
    labels: list[str] = []
    for name in names:
        col = p.cols[name]
        if name in p.spec.categorical:
            vocab = tuple(p.vocab[name])
            slots.append((name, vocab))
            labels.extend(f"{name}={v}" for v in vocab)
            continue
        if not col.numeric and col.kind != "null":
            what = (f"{p.path}: column {name!r} holds {col.kind} values"
                    if col.first_text is None or col.kind_hint is not None
                    else f"{col.first_text[0]}: column {name!r}: {col.first_text[1]!r}")
            raise UserError(f"{what}, not numbers; feature columns must be numeric (fix the "
                            f"table, or map text categories to ids with --categorical {name})")
        slots.append((name, None))
        labels.append(name)
    header = npy_bytes(np.zeros(len(labels), np.float32))[:-4 * len(labels) or None]
    return Member(ext, tuple(names), "features", "npy", "float", tuple(slots), tuple(labels),
                  header)

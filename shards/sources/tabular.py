"""Tables: one sample per row of typed columns. `jsonl` and `csv` here, `parquet` in parquet.py.

The scan types every column over the whole table first: a CSV column is int, float or bool when
each of its non-missing cells parses as one (missing: an empty cell, NA, N/A, NaN, null, None;
a number with a leading zero, like 007, is a code and stays text), else text; JSON values keep their own types; Parquet columns have their schema's. Each row then
becomes these members:

- `--field NAME=EXT`: column NAME as member EXT, typed (`price=y.npy`: a float64 array of one,
  `label=cls`: the integer). An image EXT (`path=jpg`) takes the image file the cell names,
  relative to the table's folder, or a Parquet image column's bytes.
- `--features COLS=EXT`: the columns as one float32 vector (COLS: names, globs and `numeric`, for
  every numeric column nothing else names); a `--categorical` column in it is one-hot. Without
  `--features`, every numeric column that no `--field` or `--key` names, and every categorical
  column no `--field` names, goes into `x.npy`.
- `json`: the columns no other member holds, as the row has them.

`--categorical COL` maps COL's values to ids (its sorted distinct values, the vocabulary in the
manifest). A missing cell where a number is needed is an error naming row and column, or takes
`--fill VALUE`.

The scan writes every sample's member bytes into a work file under OUT, so a shard writer in any
process reads its samples with one pread each, and keeps the numbers of the features and numeric
fields, whose mean/std over the train split go into the manifest's `features`
(`data.normalize: auto` standardises the inputs with them).
"""

from __future__ import annotations

import csv
import fnmatch
import json
import os
import re
from array import array
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import numpy as np

from ringfeed.errors import UserError
from ringfeed.formats.kinds import kind_of
from ringfeed.formats.members import encode, json_bytes, npy_bytes
from ringfeed.formats.tarblocks import member_tar_bytes
from ringfeed.shards.keys import NumberedKeys, check_ext, check_unique, safe_key
from ringfeed.shards.options import ShardOptions
from ringfeed.shards.sources.base import (
    SPLIT_NAMES,
    Part,
    Source,
    WorkDir,
    class_record,
    int_sizes,
    source_splits,
    visible,
)

SUFFIXES = {"jsonl": (".jsonl", ".ndjson"), "csv": (".csv",), "parquet": (".parquet", ".pq")}
REST = "json"  # the member holding the columns no other member names
DEFAULT_FEATURES = "x.npy"
NUMERIC = frozenset({"int", "float", "bool"})
MISSING = frozenset({"", "na", "n/a", "nan", "null", "none"})  # CSV cells that hold no value
# numbers as written; a leading zero (007, 02139) makes a code, which stays text
_INT = re.compile(r"^[+-]?(0|[1-9]\d*)$")
_FLOAT = re.compile(r"^[+-]?((0|[1-9]\d*)(\.\d*)?|\.\d+)([eE][+-]?\d+)?$")
_SPLIT_PREFIX = re.compile(r"^([a-z]+)[-_.]", re.IGNORECASE)
STATS_CHUNK = 65536  # rows per read when the train split's mean/std are computed


def _jsonl_rows(f: IO[bytes]) -> Iterator[tuple[int, int, Any]]:
    """(byte offset, line number, parsed row) for each non-blank line."""
    offset = 0
    for number, line in enumerate(f, 1):
        start, offset = offset, offset + len(line)
        if line.strip():
            try:
                yield start, number, json.loads(line)
            except ValueError as e:
                raise UserError(f"{f.name}:{number}: not valid JSON ({e})") from None


def _csv_rows(f: IO[bytes]) -> Iterator[tuple[int, int, list[str]]]:
    """(byte offset, first line number, cells) per record; a quoted cell may span lines."""
    consumed = [0]

    def lines() -> Iterator[str]:
        for raw in f:
            consumed[0] += len(raw)
            yield raw.decode("utf-8-sig" if consumed[0] == len(raw) else "utf-8")

    reader = csv.reader(lines())
    start, line = 0, 1
    try:
        for cells in reader:
            # csv pulls lines only as a record needs them: `consumed` is where the next one starts
            yield start, line, cells
            start, line = consumed[0], reader.line_num + 1
    except (csv.Error, UnicodeDecodeError) as e:
        raise UserError(f"{f.name}:{reader.line_num}: not readable as UTF-8 CSV ({e})") from None


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


@dataclass
class Member:
    """One tar member made from columns: a --field (one column) or a feature vector."""

    ext: str
    columns: list[str]
    role: str  # "field" or "features"
    kind: str = ""  # the member's kind (manifest fields)
    column_kind: str = ""  # field: the column's kind
    slots: list[tuple[str, list | None]] = field(default_factory=list)  # features: (column,
    # vocabulary when one-hot)
    names: list[str] = field(default_factory=list)  # features: one name per vector element
    header: bytes = b""  # features: the .npy header of a float32 vector of this width
    stats: int = -1  # first column of its numbers in the stats matrix (-1: none)
    shape: tuple[int, ...] | None = ()  # field: the shape of its values (None: varies)
    dtype: str | None = None

    @property
    def width(self) -> int:
        return len(self.names) if self.role == "features" else 1


class _Store:
    """Every sample's member bytes, appended to one work file; read back with one pread per
    sample in any process. Per sample: its offset, each member's length (-1: absent) and
    whether the member is an image file path to read at write time (CSV/JSONL images)."""

    def __init__(self, path: Path, exts: list[str]):
        self.path = path
        self.exts = exts
        self._out: IO[bytes] | None = open(path, "wb")
        self._size = 0
        self.starts: dict[str, array] = {}
        self.lengths: dict[str, array] = {}
        self.paths: dict[str, array] = {}
        self._fd: int | None = None
        self._fd_pid = -1

    def add(self, part: str, members: dict[str, bytes], paths: set[str]) -> None:
        if part not in self.starts:
            self.starts[part], self.lengths[part], self.paths[part] = (
                array("q"), array("q"), array("b"))
        self.starts[part].append(self._size)
        assert self._out is not None
        for ext in self.exts:
            data = members.get(ext)
            self.lengths[part].append(-1 if data is None else len(data))
            self.paths[part].append(ext in paths)
            if data:
                self._out.write(data)
                self._size += len(data)

    def finish(self) -> None:
        if self._out is not None:
            self._out.close()
            self._out = None

    def read(self, part: str, index: int) -> tuple[dict[str, bytes], set[str]]:
        if self._fd_pid != os.getpid():  # a forked writer opens its own descriptor
            self._fd, self._fd_pid = os.open(self.path, os.O_RDONLY), os.getpid()
        m = len(self.exts)
        lengths = self.lengths[part][index * m:(index + 1) * m]
        data = os.pread(self._fd, sum(n for n in lengths if n > 0), self.starts[part][index])
        members, paths, at = {}, set(), 0
        for k, (ext, n) in enumerate(zip(self.exts, lengths, strict=True)):
            if n >= 0:
                members[ext] = data[at:at + n]
                at += n
                if self.paths[part][index * m + k]:
                    paths.add(ext)
        return members, paths

    def close(self) -> None:
        self.finish()
        if self._fd is not None and self._fd_pid == os.getpid():
            os.close(self._fd)
        self._fd = None


class TableSource(Source):
    """What every table format shares: column typing, the members a row becomes, the work
    store, the statistics. A format provides its files, a typing pass and typed rows."""

    def __init__(self, opts: ShardOptions):
        super().__init__(opts)
        self._map = {name: check_ext(ext.lower(), f"--field {name}={ext}")
                     for name, ext in opts.fields.items()}
        if REST in self._map.values():
            raise UserError(f"--field ...={REST}: the {REST} member holds the columns no other "
                            "member names; store this field under another name (e.g. meta.json)")
        self._key_field = opts.key_field
        self._fill = opts.fill
        self._feature_specs = opts.features
        self._categorical = list(dict.fromkeys(opts.categorical))
        self.options = {"fields": dict(opts.fields), "key": opts.key_field,
                        "features": [list(s) for s in opts.features] if opts.features else None,
                        "categorical": self._categorical, "fill": opts.fill}
        self._columns: dict[str, Column] = {}
        self._vocab: dict[str, dict[Any, int]] = {}  # categorical column -> {value: id}
        self._filled: Counter = Counter()  # column -> missing cells filled (or one-hot zeros)
        self._scratch = WorkDir(opts.out)
        self._store: _Store | None = None
        try:
            self._scan(opts)
        except BaseException:
            self.close()
            raise

    # -- what a format provides ---------------------------------------------------------------
    def type_file(self, path: Path) -> None:
        """Update self._columns with every column of one file (a pass over its values)."""
        raise NotImplementedError

    def rows(self, path: Path) -> Iterator[tuple[int, dict[str, Any]]]:
        """(number, {column: typed value, None when missing}) per row, in file order; the number
        names the row in messages (see where())."""
        raise NotImplementedError

    def where(self, path: Path, number: int) -> str:
        """A row in messages: `file:line`."""
        return f"{path}:{number}"

    def rest(self, row: dict[str, Any]) -> dict[str, Any]:
        """The `json` member: the columns no other member names."""
        return {k: v for k, v in row.items() if k not in self._used}

    def column(self, name: str) -> Column:
        col = self._columns.get(name)
        if col is None:
            col = self._columns[name] = Column(
                name, vocab=set() if name in self._categorical else None)
        return col

    def missing_column(self, name: str, what: str) -> UserError:
        return UserError(f"{self.path}: no column {name!r} named by {what} (columns: "
                         f"{', '.join(self._columns)})")

    # -- the scan -----------------------------------------------------------------------------
    def _scan(self, opts: ShardOptions) -> None:
        part_files = self._part_files(opts.src)
        for files in part_files.values():
            for path in files:
                self.record_input(path)
                self.type_file(path)
        self._plan_members()
        exts = [m.ext for m in self._members] + [REST]
        self._store = _Store(self._scratch.make() / "rows.bin", exts)
        self._stat_files: dict[str, Path] = {}
        rest_seen = False
        for part, files in part_files.items():
            keys, sizes, labels = [], array("q"), array("q")
            origins = (array("q"), array("q"))  # --key: each row's (file, number), for messages
            stats_path = self._scratch.path / f"{part}.stats"
            self._stat_files[part] = stats_path
            with open(stats_path, "wb") as stats_out:
                for file, path in enumerate(files):
                    for number, row in self.rows(path):
                        where = self.where(path, number)
                        members, paths, sizes_of, numbers = self._encode(row, where, path)
                        self._store.add(part, members, paths)
                        rest_seen |= REST in members
                        sizes.append(sum(member_tar_bytes(sizes_of.get(e, len(v)))
                                         for e, v in members.items()))
                        if numbers:
                            stats_out.write(np.asarray(numbers, np.float64).tobytes())
                        if "cls" in members:  # class labels: a stratified val split
                            labels.append(int(members["cls"]))
                        if self._key_field is not None:
                            key = self._value(row, self._key_field, where, required=True)
                            keys.append(safe_key(str(key)))
                            origins[0].append(file)
                            origins[1].append(number)
            if not sizes:
                raise UserError(f"{opts.src}: no rows in {', '.join(map(str, files))}")
            if self._key_field is None:
                keys = NumberedKeys(len(sizes))
            else:
                check_unique(keys, lambda i, files=files, origins=origins: self.where(
                    files[origins[0][i]], origins[1][i]), f"split {part!r}")
            self.parts[part] = Part(keys, int_sizes(np.frombuffer(sizes, np.int64)),
                                    np.frombuffer(labels, np.int64).copy() if labels else None)
        self._store.finish()
        self.fields = {m.ext: m.kind for m in self._members}
        if rest_seen:
            self.fields[REST] = "json"
        self._record_classes()

    def _part_files(self, src: Path) -> dict[str, list[Path]]:
        suffixes = SUFFIXES[self.format]
        if src.is_file():
            return {"train": [src]}
        splits = source_splits(src)
        if splits and all(p.is_file() for p in splits.values()):
            return {part: [p] for part, p in splits.items()}
        if splits and all(p.is_dir() for p in splits.values()):
            return {part: self._folder_files(p, suffixes) for part, p in splits.items()}
        files = self._folder_files(src, suffixes)
        # files named by split as Hugging Face publishes them: train-00000-of-00002.parquet
        prefixed = [SPLIT_NAMES.get(m.group(1).lower()) if (m := _SPLIT_PREFIX.match(p.name))
                    else None for p in files]
        if "train" in prefixed and None not in prefixed:
            return {part: [p for p, s in zip(files, prefixed, strict=True) if s == part]
                    for part in dict.fromkeys(prefixed)}
        return {"train": files}

    @staticmethod
    def _folder_files(folder: Path, suffixes: tuple[str, ...]) -> list[Path]:
        files = [p for p in visible(folder) if p.is_file() and p.name.lower().endswith(suffixes)]
        if not files:
            raise UserError(f"{folder}: no {'/'.join(suffixes)} files in this folder")
        return files

    # -- which member holds which column ------------------------------------------------------
    def _plan_members(self) -> None:
        cols = self._columns
        for name in self._categorical:
            if name not in cols:
                raise self.missing_column(name, "--categorical")
            self._vocab[name] = {v: i for i, v in enumerate(sorted(cols[name].vocab or (),
                                                                   key=vocab_order))}
        named = set(self._map) | ({self._key_field} if self._key_field else set())
        members = [self._field_member(name, ext) for name, ext in self._map.items()]
        if self._feature_specs is None:
            free = [c for c in cols.values() if c.name not in named
                    and (c.numeric or c.name in self._categorical or c.mixed)]
            for c in free:
                if c.mixed and c.name not in self._categorical:
                    where, value = c.first_text
                    raise UserError(
                        f"{where}: column {c.name!r}: {value!r} is not a number, but the "
                        f"column's other values are; fix that cell, or name the column "
                        f"(--field {c.name}=txt, --categorical {c.name}) or the feature "
                        "columns (--features COLS=x.npy)")
            if free:
                members.append(self._vector(DEFAULT_FEATURES, [c.name for c in free]))
        else:
            explicit = {name.strip() for spec, _ in self._feature_specs
                        for name in spec.split(",")} & set(cols)
            for spec, ext in self._feature_specs:
                chosen = self._select(spec, named, explicit)
                if not chosen:
                    raise UserError(f"--features {spec}={ext}: no column matches (columns: "
                                    f"{', '.join(cols)})")
                members.append(self._vector(check_ext(ext.lower(), f"--features {spec}={ext}"),
                                            chosen))
        seen: dict[str, str] = {}
        for m in members:
            if m.ext in seen or m.ext == REST:
                raise UserError(f"{', '.join(m.columns[:3])} and {seen.get(m.ext, REST)} would "
                                f"both be member .{m.ext}; give them different extensions")
            seen[m.ext] = ", ".join(m.columns[:3])
        self._members = members
        self._used = {name for m in members for name in m.columns}
        if self._key_field and self._key_field not in cols:
            raise self.missing_column(self._key_field, "--key")
        width = 0
        for m in members:
            if m.role == "features" or (m.kind == "npy" and m.column_kind in NUMERIC
                                        and m.columns[0] not in self._categorical):
                m.stats, width = width, width + m.width
        self._stats_width = width

    def _select(self, spec: str, named: set[str], explicit: set[str]) -> list[str]:
        """The columns of one --features COLS, in order: names as given; a glob's matches and
        `numeric` (numeric columns no other option names) in table order. Globs and `numeric`
        skip the --field and --key columns."""
        chosen: list[str] = []
        for term in (t.strip() for t in spec.split(",")):
            if term == "numeric":
                found = [c.name for c in self._columns.values() if c.numeric
                         and c.name not in named | explicit and c.name not in self._categorical]
            elif any(ch in term for ch in "*?["):
                found = [n for n in self._columns
                         if fnmatch.fnmatchcase(n, term) and n not in named]
            elif term in self._columns:
                found = [term]
            else:
                raise self.missing_column(term, f"--features {spec}")
            chosen.extend(n for n in found if n not in chosen)
        return chosen

    def _field_member(self, name: str, ext: str) -> Member:
        col = self._columns.get(name)
        if col is None:
            if self.format != "jsonl":  # jsonl rows report it (naming the first such row)
                raise self.missing_column(name, f"--field {name}={ext}")
            col = self.column(name)
        return Member(ext, [name], "field", kind_of(ext), col.kind)

    def _vector(self, ext: str, names: list[str]) -> Member:
        """A float32 vector member; each categorical column one-hot over its vocabulary."""
        if kind_of(ext) != "npy":
            raise UserError(f"--features ...={ext}: a feature vector is an .npy member "
                            "(e.g. x.npy)")
        slots: list[tuple[str, list | None]] = []
        labels: list[str] = []
        for name in names:
            col = self._columns[name]
            if name in self._categorical:
                vocab = list(self._vocab[name])
                slots.append((name, vocab))
                labels.extend(f"{name}={v}" for v in vocab)
                continue
            if not col.numeric and col.kind != "null":
                what = (f"{self.path}: column {name!r} holds {col.kind} values"
                        if col.first_text is None or col.kind_hint is not None
                        else f"{col.first_text[0]}: column {name!r}: {col.first_text[1]!r}")
                raise UserError(f"{what}, not numbers; feature columns must be numeric (fix the "
                                f"table, or map text categories to ids with --categorical {name})")
            slots.append((name, None))
            labels.append(name)
        header = npy_bytes(np.zeros(len(labels), np.float32))[:-4 * len(labels) or None]
        return Member(ext, names, "features", "npy", "float", slots, labels, header,
                      shape=(len(labels),), dtype="float32")

    # -- one row -> members -------------------------------------------------------------------
    def _value(self, row: dict[str, Any], name: str, where: str, required: bool = False) -> Any:
        """A row's value of column `name` (None: missing). A JSON row without a `required`
        field (one that is not a number) is an error."""
        if required and name not in row and self.format == "jsonl":
            raise UserError(f"{where}: no field {name!r} (fields: {', '.join(row)})")
        return row.get(name)

    def _number(self, value: Any, name: str, where: str) -> Any:
        """A numeric cell's value; a missing (or NaN, inf) one takes --fill or is an error."""
        if value is None or (isinstance(value, float) and not np.isfinite(value)):
            if self._fill is None:
                what = "has no value (a missing cell)" if value is None else f"is {value}"
                raise UserError(f"{where}: column {name!r} {what}; fill missing cells with "
                                "--fill VALUE, or fix the table")
            self._filled[name] += 1
            return self._fill
        if isinstance(value, (bool, int, float, np.number)):
            return value
        raise UserError(f"{where}: column {name!r}: {value!r} is not a number")

    def _category(self, value: Any, name: str, where: str) -> int | None:
        """The id of a categorical value; None for a missing one."""
        return None if value is None else self._vocab[name][value]

    def _encode(self, row: dict[str, Any], where: str, path: Path
                ) -> tuple[dict[str, bytes], set[str], dict[str, int], list[float]]:
        """(member bytes, members that are image paths, their tar sizes, stats numbers)."""
        members: dict[str, bytes] = {}
        paths: set[str] = set()
        sizes: dict[str, int] = {}
        numbers: list[float] = []
        for m in self._members:
            if m.role == "features":
                vector = np.zeros(len(m.names), np.float32)
                at = 0
                for name, vocab in m.slots:
                    value = self._value(row, name, where)
                    if vocab is None:
                        vector[at] = self._number(value, name, where)
                        at += 1
                    else:  # one-hot; a missing category is all zeros
                        category = self._category(value, name, where)
                        if category is None:
                            self._filled[name] += 1
                        else:
                            vector[at + category] = 1.0
                        at += len(vocab)
                members[m.ext] = m.header + vector.tobytes()
                numbers.extend(vector.tolist())
                continue
            name = m.columns[0]
            numeric = m.kind in ("int", "npy") and (m.column_kind in NUMERIC
                                                    or name in self._categorical)
            value = self._value(row, name, where, required=not numeric)
            if m.kind == "image":
                data, size = self._image(value, f"{where}: field {name!r}", path)
                if isinstance(data, str):
                    paths.add(m.ext)
                    sizes[m.ext] = size
                    data = data.encode()
                members[m.ext] = data
                continue
            if name in self._categorical:
                value = self._category(value, name, where)
                if value is None:
                    raise UserError(f"{where}: column {name!r} has no value (a missing "
                                    "category); fix the table")
            elif numeric:
                value = self._number(value, name, where)
            elif m.kind == "int" and m.column_kind == "str":
                raise UserError(f"{where}: field {name!r}: cannot store {value!r} as .{m.ext} "
                                f"(a class index is an integer; map text labels to ids with "
                                f"--categorical {name})")
            if m.kind == "npy":
                array_ = self._array(value, m, name, where)
                if m.stats >= 0:
                    numbers.append(float(array_.item()))
                members[m.ext] = npy_bytes(array_)
            else:
                members[m.ext] = encode(m.ext, value, f"{where}: field {name!r}")
        rest = self.rest(row)
        if rest:
            members[REST] = json_bytes(rest)
        return members, paths, sizes, numbers

    def _array(self, value: Any, m: Member, name: str, where: str) -> np.ndarray:
        """An npy field's value: a number keeps its column's type (int64, float64, bool), a
        list is an array (dtype from the schema, or numpy's)."""
        if value is None:
            raise UserError(f"{where}: column {name!r} has no value (a missing cell)")
        dtype = {"int": np.int64, "float": np.float64, "bool": np.bool_}.get(m.column_kind)
        if name in self._categorical:
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
        if m.dtype is None:
            m.dtype = out.dtype.name
            m.shape = out.shape
        elif m.shape is not None and m.shape != out.shape:
            m.shape = None  # varies from row to row
        return out

    def list_dtype(self, name: str) -> Any:
        """The numpy dtype of a list column's elements (None: let numpy choose)."""
        return None

    def _image(self, value: Any, where: str, table: Path) -> tuple[bytes | str, int]:
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

    # -- manifest -----------------------------------------------------------------------------
    def _record_classes(self) -> None:
        """class_names (a categorical cls) and the class ids seen (manifest.classes)."""
        cls = next((m for m in self._members if m.ext == "cls"), None)
        if cls is None:
            return
        counts: Counter = Counter()
        for part in self.parts.values():
            if part.labels is not None:
                counts.update(part.labels.tolist())
        if cls.columns[0] in self._categorical:
            self.class_names = [str(v) for v in self._vocab[cls.columns[0]]]
        self.classes = class_record(counts, len(self.class_names) if self.class_names else None)

    def column_stats(self, train: list[tuple[str, np.ndarray]]) -> dict[str, Any]:
        mean, std, low, high = self._moments(train)
        out: dict[str, Any] = {}
        for m in self._members:
            entry: dict[str, Any] = {"role": m.role, "columns": list(m.columns)}
            if m.role == "features":
                entry["names"] = list(m.names)
                vocab = {name: v for name, v in m.slots if v is not None}
                if vocab:
                    entry["vocabulary"] = vocab
            elif m.columns[0] in self._categorical:
                entry["vocabulary"] = list(self._vocab[m.columns[0]])
            if m.kind == "npy":
                entry["dtype"] = m.dtype
                entry["shape"] = None if m.shape is None else list(m.shape)
            if m.stats >= 0 and mean is not None:
                span = slice(m.stats, m.stats + m.width)
                entry.update(mean=mean[span].tolist(), std=std[span].tolist(),
                             stats_split="train")
                if m.role == "field":
                    entry.update(min=float(low[m.stats]), max=float(high[m.stats]))
            filled = {n: self._filled[n] for n in m.columns if self._filled[n]}
            if filled:
                entry["filled"] = filled
            out[m.ext] = entry
        return out

    def _moments(self, train: list[tuple[str, np.ndarray]]
                 ) -> tuple[np.ndarray | None, ...]:
        """Per stats column over the train rows: mean, std (population), min, max; float64,
        two passes over the work file in chunks (bounded memory, stable)."""
        width = self._stats_width
        total = sum(len(i) for _, i in train)
        if not width or not total:
            return None, None, None, None

        def chunks() -> Iterator[np.ndarray]:
            for part, indices in train:
                rows = np.memmap(self._stat_files[part], np.float64, "r",
                                 shape=(len(self.parts[part]), width))
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

    # -- writing ------------------------------------------------------------------------------
    def sample(self, part: str, index: int) -> dict[str, Any]:
        assert self._store is not None
        members, paths = self._store.read(part, index)
        for ext in paths:
            path = members[ext].decode()
            try:
                with open(path, "rb") as f:
                    members[ext] = f.read()
            except OSError as e:
                raise UserError(f"{path}: cannot read ({e.strerror}); run the same command "
                                "again") from None
        return {"__key__": self.parts[part].keys[index], **members}

    def close(self) -> None:
        if self._store is not None:
            self._store.close()
        self._scratch.remove()


class Tabular(TableSource):
    """`csv` and `jsonl` files."""

    def type_file(self, path: Path) -> None:
        if self.format == "jsonl":
            for _, line, row in self._lines(path):
                where = f"{path}:{line}"
                for name, value in row.items():
                    self.column(name).see(value_kind(value), value, where)
            return
        header, records = self._csv(path)
        for line, cells in records:
            where = f"{path}:{line}"
            for name, cell in zip(header, cells, strict=True):
                self.column(name).see(cell_kind(cell), cell, where)

    def rows(self, path: Path) -> Iterator[tuple[int, dict[str, Any]]]:
        if self.format == "jsonl":
            for _, line, row in self._lines(path):
                yield line, row
            return
        header, records = self._csv(path)
        convert = [(lambda cell: cell) if name == self._key_field  # keys as written
                   else self._converter(self._columns[name]) for name in header]
        for line, cells in records:
            yield line, {name: f(cell) for name, f, cell
                                     in zip(header, convert, cells, strict=True)}

    def _converter(self, col: Column):
        """A CSV cell -> its column's type (None when missing)."""
        kind = col.kind
        if col.vocab is not None:
            return lambda cell: None if cell_kind(cell) is None else cell
        if kind == "int":
            return lambda cell: None if cell.strip().lower() in MISSING else int(cell)
        if kind == "float":
            return lambda cell: None if cell.strip().lower() in MISSING else float(cell)
        if kind == "bool":
            return lambda cell: (None if cell.strip().lower() in MISSING
                                 else cell.strip().lower() == "true")
        return lambda cell: cell

    def _lines(self, path: Path) -> Iterator[tuple[int, int, Any]]:
        with self._open(path) as f:
            for offset, line, row in _jsonl_rows(f):
                if not isinstance(row, dict):
                    raise UserError(f"{path}:{line}: not a JSON object (each line must be one "
                                    "{...} row)")
                yield offset, line, row

    def _csv(self, path: Path) -> tuple[list[str], Iterator[tuple[int, list[str]]]]:
        f = self._open(path)
        rows = _csv_rows(f)
        first = next(rows, None)
        if first is None:
            f.close()
            raise UserError(f"{path}: empty CSV (expected a header row)")
        header = first[2]
        if len(set(header)) != len(header):
            twice = next(n for n in header if header.count(n) > 1)
            f.close()
            raise UserError(f"{path}: column {twice!r} appears twice in the header")
        for name in [*self._map, *([self._key_field] if self._key_field else [])]:
            if name not in header:
                f.close()
                raise UserError(f"{path}: no column {name!r} (columns: {', '.join(header)})")

        def records() -> Iterator[tuple[int, list[str]]]:
            with f:
                for _, line, cells in rows:
                    if len(cells) != len(header):
                        raise UserError(f"{path}:{line}: {len(cells)} cells, the header has "
                                        f"{len(header)}")
                    yield line, cells

        return header, records()

    @staticmethod
    def _open(path: Path) -> IO[bytes]:
        try:
            return open(path, "rb")
        except OSError as e:
            raise UserError(f"{path}: cannot read ({e.strerror})") from None

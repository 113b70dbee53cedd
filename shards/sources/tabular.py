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

In code: `TableSource(opts)` only checks the options; `scan()` types the columns (a format's
`type_file`), computes a frozen `TablePlan` from them (tableplan.plan_table), and encodes every
row with a `RowEncoder` (tableencode.py), which reads the plan and never changes it; the
manifest's `features` come from tablestats.py.
"""

from __future__ import annotations

import csv
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
from ringfeed.formats.tarblocks import member_tar_bytes
from ringfeed.shards.keys import NumberedKeys, check_unique, safe_key
from ringfeed.shards.options import ShardOptions
from ringfeed.shards.sources.base import (
    SPLIT_NAMES,
    Part,
    SharedScan,
    Source,
    WorkDir,
    class_record,
    int_sizes,
    source_splits,
    visible,
)
from ringfeed.shards.sources.tableencode import RowEncoder
from ringfeed.shards.sources.tableplan import (  # noqa: F401 (Member, NUMERIC...: this module's before)
    DEFAULT_FEATURES,
    MISSING,
    NUMERIC,
    REST,
    Column,
    Member,
    TablePlan,
    TableSpec,
    cell_kind,
    plan_table,
    value_kind,
    vocab_order,
)
from ringfeed.shards.sources.tablestats import STATS_CHUNK, column_stats, moments  # noqa: F401

SUFFIXES = {"jsonl": (".jsonl", ".ndjson"), "csv": (".csv",), "parquet": (".parquet", ".pq")}
_SPLIT_PREFIX = re.compile(r"^([a-z]+)[-_.]", re.IGNORECASE)


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
    consumed, read = [0], [0]  # bytes and lines pulled from the file so far

    def lines() -> Iterator[str]:
        for raw in f:
            consumed[0] += len(raw)
            read[0] += 1
            try:
                yield raw.decode("utf-8-sig" if consumed[0] == len(raw) else "utf-8")
            except UnicodeDecodeError as e:  # named by the line it is on, not the record's
                raise UserError(
                    f"{f.name}:{read[0]}: not UTF-8 (byte 0x{raw[e.start]:02x} at column "
                    f"{e.start + 1}; save the file as UTF-8, e.g. iconv -f latin1 -t utf-8)"
                ) from None

    reader = csv.reader(lines())
    start, line = 0, 1
    try:
        for cells in reader:
            # csv pulls lines only as a record needs them: `consumed` is where the next one starts
            yield start, line, cells
            start, line = consumed[0], reader.line_num + 1
    except csv.Error as e:
        raise UserError(f"{f.name}:{reader.line_num}: not readable as CSV ({e})") from None


class _Store:
    """Every sample's member bytes, appended to one work file; read back with one pread per
    sample in any process. Per sample: its offset, each member's length (-1: absent) and
    whether the member is an image file path to read at write time (CSV/JSONL images)."""

    INDEX = ("starts", "lengths", "paths")  # index()'s kinds of arrays

    def __init__(self, path: Path, exts: list[str]):
        self.path = path
        self.exts = exts
        self._out: IO[bytes] | None = None  # opened by the first add()
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
        if self._out is None:
            self._out = open(self.path, "wb")
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

    def index(self) -> dict[str, np.ndarray]:
        """Where each sample's members are (a shared scan's `index.npz`)."""
        return {f"{kind}:{part}": np.frombuffer(table[part], dtype)
                for kind, table, dtype in (("starts", self.starts, np.int64),
                                           ("lengths", self.lengths, np.int64),
                                           ("paths", self.paths, np.int8))
                for part in table}

    def adopt(self, path: Path, index: dict[str, np.ndarray]) -> None:
        """Read a finished store at `path` (a shared scan's) with `index()`'s arrays."""
        self.path = path
        for name, values in index.items():
            kind, part = name.split(":", 1)
            getattr(self, kind)[part] = array("b" if kind == "paths" else "q", values.tobytes())

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


@dataclass
class _PartRows:
    """One part's rows as the scan collects them."""

    keys: list[str] = field(default_factory=list)
    sizes: array = field(default_factory=lambda: array("q"))
    labels: array = field(default_factory=lambda: array("q"))
    origins: tuple[array, array] = field(  # --key: each row's (file, number), for messages
        default_factory=lambda: (array("q"), array("q")))
    rest_seen: bool = False


class TableSource(Source):
    """What every table format shares: column typing, the members a row becomes, the work
    store, the statistics. A format provides its files, a typing pass and typed rows.

    Constructing one reads nothing; `scan()` types the columns, computes the frozen
    `TablePlan`, and encodes every row into the work store (see open_source)."""

    def __init__(self, opts: ShardOptions):
        super().__init__(opts)
        self.spec = TableSpec.of(opts)
        self._map = dict(self.spec.fields)
        self._key_field = opts.key_field
        self._categorical = list(self.spec.categorical)
        self.options = {"fields": dict(opts.fields), "key": opts.key_field,
                        "features": [list(s) for s in opts.features] if opts.features else None,
                        "categorical": self._categorical, "fill": opts.fill}
        self._out = opts.out
        self._work_name = opts.work_name
        self._columns: dict[str, Column] = {}  # the typing pass's, in table order
        self.plan: TablePlan | None = None
        self._encoder: RowEncoder | None = None
        self._scratch: WorkDir | None = None
        self._store: _Store | None = None
        self._stat_files: dict[str, Path] = {}
        # a part of a local OUT shares its scan with the other parts (SharedScan)
        # (a fetched SRC is another local path on each machine: another key, nothing shared)
        self._share = (opts.part is not None or opts.scan_only) and not opts.src_url

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

    def check_plan(self, plan: TablePlan) -> None:
        """A format's own checks of the plan (none by default)."""

    def list_dtype(self, name: str) -> Any:
        """The numpy dtype of a list column's elements (None: let numpy choose)."""
        return None

    def label_names(self, name: str) -> list[str] | None:
        """The class names the table itself gives an integer column (a Hugging Face Parquet
        export's ClassLabel), or None."""
        return None

    def column(self, name: str) -> Column:
        col = self._columns.get(name)
        if col is None:
            col = self._columns[name] = Column(
                name, vocab=set() if name in self._categorical else None)
        return col

    # -- the scan -----------------------------------------------------------------------------
    def scan(self) -> TableSource:
        """Type every column, plan the members, encode every row into the work store under
        OUT; on any error the work store is removed and the error raised."""
        try:
            self._scan()
        except BaseException:
            self.close()
            raise
        return self

    def _scan(self) -> None:
        part_files = self._part_files(self.path)
        for files in part_files.values():
            for path in files:
                self.record_input(path)
        shared = SharedScan(self._out, self.scan_key()) if self._share else None
        if shared is not None and adopt_scan(self, shared):
            return
        for files in part_files.values():
            for path in files:
                self.type_file(path)
        if not self._columns:  # the typing pass met no row (a header alone, or nothing)
            raise UserError(f"{self.path}: no rows to shard (a header alone, or empty); "
                            "add rows, or check the file is the one meant")
        self._scratch = WorkDir(self._out, self._work_name)
        self.plan = plan_table(self._columns, self.spec, self.format, self.path)
        self.check_plan(self.plan)
        self._encoder = RowEncoder(self.plan, self.format, self.spec.fill, self.list_dtype)
        self._store = _Store(self._scratch.make() / "rows.bin", [*self.plan.exts, REST])
        rest_seen = False
        for part, files in part_files.items():
            rest_seen |= self._scan_part(part, files)
        self._store.finish()
        self.fields = {m.ext: m.kind for m in self.plan.members}
        if rest_seen:
            self.fields[REST] = "json"
        self._record_classes()
        if shared is not None:
            publish_scan(self, shared)

    def _scan_part(self, part: str, files: list[Path]) -> bool:
        """Encode one part's rows into the store and its stats file; sets self.parts[part].
        True when some row has a `json` member."""
        assert self._scratch is not None
        rows = _PartRows()
        stats_path = self._stat_files[part] = self._scratch.path / f"{part}.stats"
        with open(stats_path, "wb") as stats_out:
            for file, path in enumerate(files):
                for number, row in self.rows(path):
                    self._scan_row(part, rows, row, self.where(path, number), path, stats_out)
                    if self._key_field is not None:
                        rows.origins[0].append(file)
                        rows.origins[1].append(number)
        if not rows.sizes:
            raise UserError(f"{self.path}: no rows in {', '.join(map(str, files))}")
        if self._key_field is None:
            keys: Any = NumberedKeys(len(rows.sizes))
        else:
            keys, origins = rows.keys, rows.origins
            check_unique(keys, lambda i: self.where(files[origins[0][i]], origins[1][i]),
                         f"split {part!r}")
        labels = rows.labels
        self.parts[part] = Part(keys, int_sizes(np.frombuffer(rows.sizes, np.int64)),
                                np.frombuffer(labels, np.int64).copy() if labels else None)
        return rows.rest_seen

    def _scan_row(self, part: str, rows: _PartRows, row: dict[str, Any], where: str,
                  path: Path, stats_out: IO[bytes]) -> None:
        assert self._encoder is not None and self._store is not None
        enc = self._encoder.encode(row, where, path)
        members = enc.members
        self._store.add(part, members, enc.paths)
        rows.rest_seen |= REST in members
        rows.sizes.append(sum(member_tar_bytes(enc.sizes.get(e, len(v)))
                              for e, v in members.items()))
        if enc.numbers:
            stats_out.write(np.asarray(enc.numbers, np.float64).tobytes())
        if "cls" in members:  # class labels: a stratified val split
            rows.labels.append(int(members["cls"]))
        if self._key_field is not None:
            key = self._encoder.value(row, self._key_field, where, required=True)
            rows.keys.append(safe_key(str(key)))

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

    # -- manifest -----------------------------------------------------------------------------
    def _record_classes(self) -> None:
        """class_names (a categorical cls) and the class ids seen (manifest.classes)."""
        assert self.plan is not None
        cls = self.plan.member("cls")
        if cls is None:
            return
        counts: Counter = Counter()
        for part in self.parts.values():
            if part.labels is not None:
                counts.update(part.labels.tolist())
        if cls.columns[0] in self.plan.categorical:
            self.class_names = [str(v) for v in self.plan.vocab[cls.columns[0]]]
        else:
            self.class_names = self.label_names(cls.columns[0])
            outside = sorted(c for c in counts if not 0 <= c < len(self.class_names or ()))
            if self.class_names and outside:
                raise UserError(f"{self.path}: column {cls.columns[0]!r}: class id {outside[0]} "
                                f"is not one of its {len(self.class_names)} ClassLabel names "
                                "(-1 is a Hugging Face export's 'no label': shard only the "
                                "labelled splits)")
        self.classes = class_record(counts, len(self.class_names) if self.class_names else None)

    def column_stats(self, train: list[tuple[str, np.ndarray]]) -> dict[str, Any]:
        assert self.plan is not None and self._encoder is not None
        rows_in = {part: len(p) for part, p in self.parts.items()}
        return column_stats(self._encoder, moments(self._stat_files, rows_in,
                                                   self.plan.stats_width, train))

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
        if self._scratch is not None:
            self._scratch.remove()


def publish_scan(src: TableSource, shared: SharedScan) -> None:
    """Share this finished scan (its work folder, with what else it learned) with the other
    parts; when another part's is there first, keep this one's own."""
    assert src._scratch is not None and src._store is not None and src._encoder is not None
    work = src._scratch.path
    np.savez(work / "index.npz", **src._store.index(),
             **{f"sizes:{n}": p.sizes for n, p in src.parts.items()},
             **{f"labels:{n}": p.labels for n, p in src.parts.items() if p.labels is not None})
    facts = {"columns": [{**vars(c), "kinds": sorted(c.kinds),
                          "vocab": None if c.vocab is None else list(c.vocab)}
                         for c in src._columns.values()],
             "fields": src.fields, "class_names": src.class_names, "classes": src.classes,
             "filled": dict(src._encoder.filled), "arrays": src._encoder.arrays,
             "rows": {n: len(p) for n, p in src.parts.items()},
             "keys": None if src._key_field is None else {n: list(p.keys)
                                                          for n, p in src.parts.items()},
             "store_bytes": src._store.path.stat().st_size}
    if shared.publish(work, facts):
        src.shared = shared.path
        src._store.path = shared.path / src._store.path.name
        src._stat_files = {n: shared.path / f.name for n, f in src._stat_files.items()}


def adopt_scan(src: TableSource, shared: SharedScan) -> bool:
    """Take the shared scan of this source's key, if one is published and whole (its files'
    sizes as recorded): the plan from its columns, the rows from its store; else False."""
    facts = shared.facts()
    try:
        if facts is None or (shared.path / "rows.bin").stat().st_size != facts["store_bytes"]:
            return False
        with np.load(shared.path / "index.npz", allow_pickle=False) as z:
            index = {name: z[name] for name in z.files}
    except (OSError, ValueError, KeyError):
        return False
    for c in facts["columns"]:
        src._columns[c["name"]] = Column(**{
            **c, "kinds": set(c["kinds"]), "vocab": None if c["vocab"] is None else set(c["vocab"]),
            "first_text": None if c["first_text"] is None else tuple(c["first_text"])})
    src.plan = plan_table(src._columns, src.spec, src.format, src.path)
    src.check_plan(src.plan)
    src._encoder = RowEncoder(src.plan, src.format, src.spec.fill, src.list_dtype)
    src._encoder.filled.update(facts["filled"])
    src._encoder.arrays = {ext: (dtype, None if shape is None else tuple(shape))
                           for ext, (dtype, shape) in facts["arrays"].items()}
    src._store = _Store(shared.path / "rows.bin", [*src.plan.exts, REST])
    src._store.adopt(shared.path / "rows.bin",
                     {k: v for k, v in index.items() if k.split(":")[0] in _Store.INDEX})
    for name, rows in facts["rows"].items():
        keys = NumberedKeys(rows) if facts["keys"] is None else facts["keys"][name]
        src.parts[name] = Part(keys, index[f"sizes:{name}"], index.get(f"labels:{name}"))
        src._stat_files[name] = shared.path / f"{name}.stats"
    src.fields, src.class_names, src.classes = (facts["fields"], facts["class_names"],
                                                facts["classes"])
    src.shared = shared.path
    return True


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

"""`jsonl` and `csv`: one sample per row. `--field NAME=EXT` stores field NAME as member EXT; the
other fields of the row go, together, into a `json` member.

An EXT of an image kind (`--field path=jpg`) means the field holds an image file path, relative
to the table's folder; the member is that file's bytes. The scan records where each row starts
in its file, so a shard writer in another process reads just the rows it needs.
"""

from __future__ import annotations

import csv
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

import numpy as np

from shards.errors import UserError
from shards.keys import NumberedKeys, check_ext, check_unique, safe_key
from shards.members import encode, json_bytes, kind_of, member_tar_bytes
from shards.options import ShardOptions
from shards.sources.base import Part, Source, int_sizes, source_splits, visible

SUFFIXES = {"jsonl": (".jsonl", ".ndjson"), "csv": (".csv",)}
REST = "json"  # the member holding the fields no --field names


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


class Tabular(Source):
    def __init__(self, opts: ShardOptions):
        super().__init__(opts)
        self._map = {name: check_ext(ext.lower(), f"--field {name}={ext}")
                     for name, ext in opts.fields.items()}
        if REST in self._map.values():
            raise UserError(f"--field ...={REST}: the {REST} member holds the fields no --field "
                            "names; store this field under another name (e.g. meta.json)")
        self._key_field = opts.key_field
        self.options = {"fields": dict(opts.fields), "key": opts.key_field}
        self._files: list[str] = []
        self._rows: dict[str, np.ndarray] = {}  # part -> [[file index, offset, line], ...]
        self._header: dict[int, list[str]] = {}  # csv: file index -> column names
        self._open: dict[int, IO[bytes]] = {}  # files read by sample(), per process
        self._open_pid = os.getpid()
        rest_seen = False

        for part, files in self._part_files(opts.src).items():
            keys, sizes, rows, labels = [], [], [], []
            for path in files:
                index = len(self._files)
                self._files.append(str(path))
                self.record_input(path)
                for offset, line, row in self._scan(index, path):
                    where = f"{path}:{line}"
                    members = self._members(index, row, where)
                    rest_seen |= REST in members
                    sizes.append(sum(member_tar_bytes(v if isinstance(v, int) else len(v))
                                     for v in members.values()))
                    rows.append((index, offset, line))
                    if "cls" in members:  # class labels: a stratified val split
                        labels.append(int(members["cls"]))
                    if self._key_field is not None:
                        keys.append(safe_key(str(self._value(index, row, self._key_field, where))))
            if not rows:
                raise UserError(f"{opts.src}: no rows in {', '.join(map(str, files))}")
            if self._key_field is None:
                keys = NumberedKeys(len(rows))
            else:
                check_unique(keys, lambda i, rows=rows: f"{self._files[rows[i][0]]}:{rows[i][2]}",
                             f"split {part!r}")
            self.parts[part] = Part(keys, int_sizes(sizes),
                                    np.array(labels, dtype=np.int64) if labels else None)
            self._rows[part] = np.array(rows, dtype=np.int64)
        self.fields = {ext: kind_of(ext) for ext in self._map.values()}
        if rest_seen:
            self.fields[REST] = "json"

    def _part_files(self, src: Path) -> dict[str, list[Path]]:
        suffixes = SUFFIXES[self.format]
        if src.is_file():
            return {"train": [src]}
        splits = source_splits(src)
        if splits and all(p.is_file() for p in splits.values()):
            return {part: [p] for part, p in splits.items()}
        files = [p for p in visible(src) if p.is_file() and p.name.lower().endswith(suffixes)]
        if not files:
            raise UserError(f"{src}: no {'/'.join(suffixes)} files in this folder")
        return {"train": files}

    def _scan(self, index: int, path: Path) -> Iterator[tuple[int, int, Any]]:
        try:
            f = open(path, "rb")
        except OSError as e:
            raise UserError(f"{path}: cannot read ({e.strerror})") from None
        with f:
            if self.format == "jsonl":
                yield from _jsonl_rows(f)
                return
            rows = _csv_rows(f)
            header = next(rows, None)
            if header is None:
                raise UserError(f"{path}: empty CSV (expected a header row)")
            self._header[index] = header[2]
            for name in [*self._map, *([self._key_field] if self._key_field else [])]:
                if name not in header[2]:
                    raise UserError(f"{path}: no column {name!r} (columns: {', '.join(header[2])})")
            for offset, line, cells in rows:
                if len(cells) != len(header[2]):
                    raise UserError(f"{path}:{line}: {len(cells)} cells, the header has "
                                    f"{len(header[2])}")
                yield offset, line, cells

    def _value(self, index: int, row: Any, name: str, where: str) -> Any:
        if self.format == "csv":
            return row[self._header[index].index(name)]
        if name not in row:
            raise UserError(f"{where}: no field {name!r} (fields: {', '.join(row)})")
        return row[name]

    def _members(self, index: int, row: Any, where: str,
                 read_files: bool = False) -> dict[str, bytes | int]:
        """Member ext -> bytes. Image files named by the row: their size while scanning, their
        bytes when `read_files` (at write time)."""
        if self.format == "jsonl" and not isinstance(row, dict):
            raise UserError(f"{where}: not a JSON object (each line must be one {{...}} row)")
        members: dict[str, bytes | int] = {}
        for name, ext in self._map.items():
            value = self._value(index, row, name, where)
            if kind_of(ext) == "image":
                members[ext] = self._image(index, value, f"{where}: field {name!r}", read_files)
            else:
                members[ext] = encode(ext, value, f"{where}: field {name!r}")
        record = dict(zip(self._header[index], row, strict=True)) if self.format == "csv" else row
        rest = {k: v for k, v in record.items() if k not in self._map}
        if rest:
            members[REST] = json_bytes(rest)
        return members

    def _image(self, index: int, value: Any, where: str, read: bool) -> bytes | int:
        path = os.path.join(os.path.dirname(self._files[index]), str(value))
        try:
            if read:
                with open(path, "rb") as f:
                    return f.read()
            return os.stat(path).st_size
        except OSError as e:
            raise UserError(f"{where}: {path}: cannot read ({e.strerror})") from None

    def _row(self, index: int, offset: int) -> Any:
        if self._open_pid != os.getpid():  # a forked writer must not share file offsets
            self._open, self._open_pid = {}, os.getpid()
        f = self._open.get(index)
        if f is None:
            f = self._open[index] = open(self._files[index], "rb")
        f.seek(offset)
        _, _, row = next(_jsonl_rows(f) if self.format == "jsonl" else _csv_rows(f))
        return row

    def sample(self, part: str, index: int) -> dict[str, Any]:
        file_index, offset, line = (int(v) for v in self._rows[part][index])
        where = f"{self._files[file_index]}:{line}"
        row = self._row(file_index, offset)
        return {"__key__": self.parts[part].keys[index],
                **self._members(file_index, row, where, read_files=True)}

    def close(self) -> None:
        for f in self._open.values():
            f.close()
        self._open.clear()

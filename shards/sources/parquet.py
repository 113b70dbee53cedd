"""`parquet`: a Parquet file, or a folder of them, one sample per row (see tabular.py for what a
row becomes).

Read with pyarrow, a batch of rows at a time (`ParquetFile.iter_batches`, ~16 MB of rows), so a
table larger than memory shards in bounded memory (about one batch and one row group): the scan
keeps only what every table source keeps per row (its size, key, label, offsets), and the rows'
member bytes go to the work file under OUT.

Columns keep their schema's types: integers, floats (and decimals, as floats), booleans,
strings; list columns become arrays (`--field emb=emb.npy`, dtype of the list's values);
binary columns and Hugging Face's image struct `{bytes, path}` are images (`--field
image=jpg`: the bytes as they are, or the file `path` names, relative to the Parquet file);
dates and times go into `json` as ISO text. A folder's files may be named by split the way
Hugging Face publishes them (`train-00000-of-00002.parquet`, `test-...`), and the class names of
a Hugging Face `datasets` export's ClassLabel column (its schema's `huggingface` metadata) become
the manifest's class_names when that column is the `cls` field.

`--format text` reads a Parquet file's `--text-field` column as documents (`parquet_documents`),
a run of row groups at a time when it tokenizes a large file in pieces (`row_group_runs`).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import closing
from pathlib import Path
from typing import Any

from ringfeed.errors import UserError
from ringfeed.shards.options import ShardOptions
from ringfeed.shards.sources.tableplan import TablePlan
from ringfeed.shards.sources.tabular import TableSource

# pyarrow's default memory pool (mimalloc) keeps freed pages for a while; a scan frees a batch of
# rows every few milliseconds: reading a 300 MB table batch by batch peaked at 245 MB RSS with
# the default delay and at 116 MB with none (measured). mimalloc reads it when pyarrow loads, so
# `ringfeed shard` (shards/cli.py) sets it before anything imports pyarrow (a process that
# already has pyarrow keeps its own setting).
PYARROW_ENV = (("MIMALLOC_PURGE_DELAY", "0"),)

BATCH_ROWS = 1024  # rows per record batch read, at most
BATCH_BYTES = 16 << 20  # and about this many bytes of (uncompressed) data


def open_parquet(path: Path) -> Any:
    """A pyarrow ParquetFile, or a one-line UserError naming the file."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        # with pre_buffer (the default) a scan's reader held all the column chunks it had read:
        # the whole 300 MB file by the end (measured)
        return pq.ParquetFile(path, pre_buffer=False)
    except OSError as e:
        raise UserError(f"{path}: cannot read ({e.strerror})") from None
    except (pa.ArrowException, ValueError) as e:
        raise UserError(f"{path}: not a readable Parquet file ({str(e).splitlines()[0]})") from None


def arrow_kind(dtype: Any) -> str:
    """The column kind (tabular.Column.kind) of a pyarrow type."""
    import pyarrow as pa

    t = pa.types
    if t.is_dictionary(dtype):
        return arrow_kind(dtype.value_type)
    if t.is_boolean(dtype):
        return "bool"
    if t.is_integer(dtype):
        return "int"
    if t.is_floating(dtype) or t.is_decimal(dtype):
        return "float"
    if t.is_string(dtype) or t.is_large_string(dtype) or t.is_temporal(dtype):
        return "str"
    if t.is_list(dtype) or t.is_large_list(dtype) or t.is_fixed_size_list(dtype):
        return "list"
    if t.is_binary(dtype) or t.is_large_binary(dtype) or t.is_fixed_size_binary(dtype):
        return "binary"
    if t.is_struct(dtype) and dtype.get_field_index("bytes") >= 0:
        return "image"
    return "other"


def _merge(a: str | None, b: str) -> str:
    if a is None or a == b:
        return b
    return "float" if {a, b} <= {"int", "float"} else "other"


def batch_rows(pf: Any, columns: list[str] | None = None) -> int:
    """Rows per record batch of `columns` (None: all): BATCH_ROWS, fewer for wide rows
    (images), so that a batch holds about BATCH_BYTES whatever the row size (memory stays ~ one
    batch + one row group). Only the columns read count: a label read beside an image column
    is a few bytes a row, not the image's megabyte."""
    meta = pf.metadata
    if not meta.num_rows:
        return BATCH_ROWS
    read = range(meta.num_columns) if columns is None else [
        j for j in range(meta.num_columns)
        if any(_within(meta.schema.column(j).path, name) for name in columns)]
    size = sum(meta.row_group(i).column(j).total_uncompressed_size
               for i in range(meta.num_row_groups) for j in read)
    return max(1, min(BATCH_ROWS, BATCH_BYTES * meta.num_rows // max(size, 1)))


def _within(path: str, column: str) -> bool:
    """Whether the leaf column at dotted `path` (image.bytes) is part of top-level `column`."""
    return path == column or path.startswith(column + ".")


def _batches(pf: Any, path: Path, columns: list[str] | None = None, close: bool = False,
             row_groups: range | None = None) -> Iterator[Any]:
    """The file's record batches (of `columns`, in `row_groups`: None for all); closes the file
    at the end when `close`."""
    import pyarrow as pa

    try:
        yield from pf.iter_batches(batch_size=batch_rows(pf, columns), columns=columns,
                                   row_groups=None if row_groups is None else list(row_groups))
    except (pa.ArrowException, OSError) as e:
        raise UserError(f"{path}: not readable ({str(e).splitlines()[0]})") from None
    finally:
        if close:
            pf.close()


class Parquet(TableSource):
    format = "parquet"

    def __init__(self, opts: ShardOptions):
        self._arrow_types: dict[str, Any] = {}  # column -> pyarrow type (the last file's)
        self._label_names: dict[str, list[str]] = {}  # ClassLabel column -> its names
        super().__init__(opts)

    def type_file(self, path: Path) -> None:
        with closing(open_parquet(path)) as pf:
            schema = pf.schema_arrow
            for name, names in class_labels(schema.metadata, path).items():
                known = self._label_names.setdefault(name, names)
                if known != names:
                    raise UserError(f"{path}: column {name!r}: its ClassLabel names {names} "
                                    f"differ from the other files' {known}")
            for f in schema:
                col = self.column(f.name)
                col.kind_hint = _merge(col.kind_hint, arrow_kind(f.type))
                self._arrow_types[f.name] = f.type
            wanted = [name for name in self._categorical if name in schema.names]
            row = 0
            for batch in _batches(pf, path, wanted) if wanted else ():
                # vocabularies: one pass over just those columns
                for name, values in zip(wanted, batch.columns, strict=True):
                    for value in values.unique().to_pylist():
                        if value is not None:
                            self.column(name).see("str", value, f"{path}: row {row}")
                row += batch.num_rows

    def check_plan(self, plan: TablePlan) -> None:
        for col in self._columns.values():  # bytes have no place in the json member
            if col.kind in ("binary", "image") and col.name not in plan.used:
                raise UserError(f"{self.path}: column {col.name!r} holds binary data (images?); "
                                f"store it with --field {col.name}=jpg (or png, ..., or bin for "
                                "opaque bytes)")

    def where(self, path: Path, number: int) -> str:
        return f"{path}: row {number}"

    def rows(self, path: Path) -> Iterator[tuple[int, dict[str, Any]]]:
        import pyarrow as pa
        import pyarrow.compute as pc

        pf = open_parquet(path)
        casts = {}
        for f in pf.schema_arrow:  # what JSON cannot hold as it is: text, floats
            if pa.types.is_temporal(f.type):
                casts[f.name] = pa.string()
            elif pa.types.is_decimal(f.type):
                casts[f.name] = pa.float64()
        row = 0
        for batch in _batches(pf, path, close=True):
            if casts:
                batch = pa.RecordBatch.from_arrays(
                    [pc.cast(c, casts[n]) if n in casts else c
                     for n, c in zip(batch.schema.names, batch.columns, strict=True)],
                    names=batch.schema.names)
            for values in batch.to_pylist():
                yield row, values
                row += 1

    def label_names(self, name: str) -> list[str] | None:
        return self._label_names.get(name)

    def list_dtype(self, name: str) -> Any:
        import pyarrow as pa

        dtype = self._arrow_types.get(name)
        if dtype is None or not (pa.types.is_list(dtype) or pa.types.is_large_list(dtype)
                                 or pa.types.is_fixed_size_list(dtype)):
            return None
        try:
            return dtype.value_type.to_pandas_dtype()
        except NotImplementedError:
            return None


def class_labels(metadata: dict[bytes, bytes] | None, path: Path) -> dict[str, list[str]]:
    """{column: class names} of the ClassLabel columns a Hugging Face `datasets` Parquet
    export declares: its schema metadata's b"huggingface" key holds JSON
    {"info": {"features": {column: {"_type": "ClassLabel", "names": [...]}}}} (older exports:
    {"features": ...} at the top). Other metadata, or none, gives {}."""
    import json

    raw = (metadata or {}).get(b"huggingface")
    if raw is None:
        return {}
    try:
        info = json.loads(raw)
    except ValueError as e:
        raise UserError(f"{path}: its 'huggingface' schema metadata is not JSON ({e})") from None
    features = (info.get("info") or {}).get("features") or info.get("features") or {}
    if not isinstance(features, dict):
        return {}
    return {name: [str(n) for n in feature["names"]] for name, feature in features.items()
            if isinstance(feature, dict) and feature.get("_type") == "ClassLabel"
            and isinstance(feature.get("names"), list)}


def row_group_runs(path: Path, target: int) -> list[tuple[int, int]]:
    """A Parquet file's row groups as runs [start, stop) of about `target` bytes each
    (uncompressed), the last run what is left: pieces that `--format text` tokenizes apart."""
    with closing(open_parquet(path)) as pf:
        meta = pf.metadata
        runs, start, size = [], 0, 0
        for i in range(meta.num_row_groups):
            size += meta.row_group(i).total_byte_size
            if size >= target:
                runs.append((start, i + 1))
                start, size = i + 1, 0
        if start < meta.num_row_groups:
            runs.append((start, meta.num_row_groups))
    return runs


def parquet_documents(path: Path, column: str, row_groups: range | None = None) -> Iterator[str]:
    """The non-null values of a Parquet file's text column (in `row_groups`: None for all), in
    order (`--format text`)."""
    for batch in _text_batches(path, column, row_groups):
        for value in batch.column(0).to_pylist():
            if value is not None:
                yield value


def count_parquet_documents(path: Path, column: str) -> int:
    """How many values `parquet_documents` yields, without making them Python strings (the
    count before a val draw is read by one process)."""
    return sum(b.num_rows - b.column(0).null_count for b in _text_batches(path, column))


def _text_batches(path: Path, column: str, row_groups: range | None = None) -> Iterator[Any]:
    import pyarrow as pa

    pf = open_parquet(path)
    schema = pf.schema_arrow
    if column not in schema.names:
        raise UserError(f"{path}: no column {column!r} (columns: {', '.join(schema.names)}); "
                        "name the document column with --text-field")
    if not (pa.types.is_string(schema.field(column).type)
            or pa.types.is_large_string(schema.field(column).type)):
        raise UserError(f"{path}: column {column!r} is {schema.field(column).type}, not text "
                        "(name the document column with --text-field)")
    yield from _batches(pf, path, [column], close=True, row_groups=row_groups)

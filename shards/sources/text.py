"""`text`: documents -> tokens -> flat token shards, or fixed-length rows (`--seq-len`).

A document is a whole file, or in a `.jsonl` file one line's `--text-field`, or in a `.parquet`
file one row's `--text-field` column (read a batch of rows at a time). Documents are
tokenized in order, each followed by the end-of-document id. Without `--seq-len` the stream is
cut into shards of equal tokens, each one sample of `tokens.npy` and `docs.npy` (the layout:
ringfeed/formats/tokens.py); with it, into `--seq-len` sequences, one `tokens.npy` member each
(GPT-style packing: a sequence may span a document boundary, marked by the EOS id; the last
incomplete sequence is dropped and counted). Tokens go to a work file under OUT, so shard
writers in other processes map them instead of re-tokenizing.

With `--workers K` (K > 1) and a tokenizer other than `bytes` (which is I/O), K processes
tokenize files and pieces of large files (`Piece`: runs of a .parquet file's row groups,
line-aligned byte ranges of a .jsonl file; a plain file is one document, kept whole), and this
process writes their tokens in the files' order: the bytes do not depend on K. The parts of
one OUT (`--part`, `--scan`) share one tokenization: the first to finish publishes its token
files and counts as a SharedScan keyed on the inputs, the tokenizer (a tokenizer.json's content
hash too), the layout and the options that change the tokens; the others map those files.

`--val-fraction` draws whole documents (seeded by `--shuffle-seed`) into the val split, each
split packed on its own: no document has sequences on both sides.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ringfeed.errors import UserError
from ringfeed.formats.members import npy_bytes
from ringfeed.formats.tarblocks import END, RECORD, member_tar_bytes
from ringfeed.formats.tokens import (
    DOCS_MEMBER,
    FLAT,
    TOKENS_MEMBER,
    doc_dtype,
    document_starts,
    flat_members,
    npy_size,
)
from ringfeed.shards.keys import NumberedKeys
from ringfeed.shards.options import ShardOptions
from ringfeed.shards.parallel import parallel_map
from ringfeed.shards.sources.base import (
    WORK_DIR,
    Part,
    SharedScan,
    Source,
    WorkDir,
    int_sizes,
    source_splits,
)
from ringfeed.shards.split import draw_val
from ringfeed.shards.tokenizers import Tokenizer, load_tokenizer

MEMBER = TOKENS_MEMBER  # the row layout's one member
FLAT_OVERHEAD = 2560  # a flat shard's members' tar and .npy headers and padding, at most
READ_CHUNK = 1 << 24
# with --workers K > 1 a .jsonl or .parquet file larger than this is tokenized in pieces of
# about this size (line-aligned byte ranges, runs of row groups) that the workers share: one
# large file is not one core's work; the pieces' tokens are written in the file's order
SPLIT_BYTES = 4 << 20
__all__ = ["WORK_DIR", "Text"]


@dataclass(frozen=True)
class Piece:
    """A share of one file, tokenized as a unit: the whole file (`stop` None and `start` 0),
    a .jsonl file's lines from byte `start` (a line start) to byte `stop`, or a .parquet file's
    row groups `start` to `stop` - 1."""

    path: Path
    start: int = 0
    stop: int | None = None


def _pieces(path: Path) -> list[Piece]:
    """`path` in pieces of about SPLIT_BYTES: .parquet by runs of row groups, .jsonl by byte
    ranges cut at line starts; other files (one document each) whole."""
    try:
        size = path.stat().st_size
        if size > SPLIT_BYTES and path.suffix == ".parquet":
            from ringfeed.shards.sources.parquet import row_group_runs

            runs = row_group_runs(path, SPLIT_BYTES)
            return [Piece(path, a, b) for a, b in runs] if len(runs) > 1 else [Piece(path)]
        if size > SPLIT_BYTES and path.suffix == ".jsonl":
            starts = [0]
            with open(path, "rb") as f:
                for cut in range(SPLIT_BYTES, size, SPLIT_BYTES):
                    f.seek(max(cut, starts[-1]) - 1)
                    f.readline()  # to the end of the line holding byte cut - 1
                    if f.tell() < size and f.tell() > starts[-1]:
                        starts.append(f.tell())
            return [Piece(path, a, b) for a, b in zip(starts, [*starts[1:], None], strict=True)]
    except OSError as e:
        raise UserError(f"{path}: cannot read ({e.strerror})") from None
    return [Piece(path)]


def _jsonl_documents(path: Path, text_field: str, start: int = 0,
                     stop: int | None = None) -> Iterator[bytes]:
    """The documents of the lines from byte `start` (a line start) to byte `stop`."""
    with open(path, "rb") as f:
        f.seek(start)
        at = start
        for number, line in enumerate(f, 1):
            if stop is not None and at >= stop:
                return
            at += len(line)
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except ValueError as e:
                raise UserError(f"{path}:{_line(path, start, number)}: not valid JSON ({e})"
                                ) from None
            if not isinstance(row, dict) or not isinstance(row.get(text_field), str):
                raise UserError(f"{path}:{_line(path, start, number)}: no string field "
                                f"{text_field!r} (name the document field with --text-field)")
            yield row[text_field].encode()


def _line(path: Path, start: int, number: int) -> int:
    """The file's line number of the `number`-th line from byte `start` (counted only for an
    error message: a piece does not know the lines before it)."""
    if start == 0:
        return number
    with open(path, "rb") as f:
        return f.read(start).count(b"\n") + number


def _file_tokens(tokenizer: Tokenizer, piece: Piece, text_field: str
                 ) -> Iterator[tuple[np.ndarray, int]]:
    """(tokens, documents they end) for one piece of a file, in order; every document ends
    with EOS."""
    path = piece.path
    try:
        if path.suffix == ".jsonl":
            for doc in _jsonl_documents(path, text_field, piece.start, piece.stop):
                yield tokenizer.tokens(doc, str(path)), 1
        elif path.suffix == ".parquet":  # one document per row of the text column
            from ringfeed.shards.sources.parquet import parquet_documents

            groups = None if piece.stop is None else range(piece.start, piece.stop)
            for text in parquet_documents(path, text_field, groups):
                yield tokenizer.tokens(text.encode(), str(path)), 1
        elif tokenizer.encode is None:  # byte-level: stream, the file need not fit in memory
            with open(path, "rb") as f:
                while chunk := f.read(READ_CHUNK):
                    yield np.frombuffer(chunk, np.uint8).astype(tokenizer.dtype), 0
            yield np.array([tokenizer.eos_id], tokenizer.dtype), 1
        else:
            yield tokenizer.tokens(path.read_bytes(), str(path)), 1
    except OSError as e:
        raise UserError(f"{path}: cannot read ({e.strerror})") from None


def _tokenize_piece(shared: tuple[Tokenizer, str], piece: Piece) -> tuple[np.ndarray, np.ndarray]:
    """In a pool worker: a piece's tokens, one array (one pickle), and its documents' lengths."""
    tokenizer, text_field = shared
    arrays = [tokens for tokens, _ in _file_tokens(tokenizer, piece, text_field)]
    lengths = np.fromiter((a.size for a in arrays), np.int64, len(arrays))
    return (np.concatenate(arrays) if arrays else np.empty(0, tokenizer.dtype)), lengths


def _pooled_tokens(tokenizer: Tokenizer, files: list[Path], opts: ShardOptions,
                   by_document: bool) -> Iterator[tuple[np.ndarray, int]]:
    """(tokens, documents they end) of `files` in order, tokenized piece by piece in
    `opts.workers` processes: each piece's documents at once, or one by one (`by_document`)."""
    pieces = [piece for path in files for piece in _pieces(path)]
    for tokens, lengths in parallel_map(_tokenize_piece, pieces, opts.workers,
                                        (tokenizer, opts.text_field), 1):
        if not by_document:
            yield tokens, len(lengths)
            continue
        ends = np.cumsum(lengths)
        for a, b in zip(ends - lengths, ends, strict=True):
            yield tokens[a:b], 1


def _count_documents(path: Path, text_field: str) -> int:
    """Documents in one file, as `_file_tokens` will find them: a file, a jsonl line, or a
    parquet row."""
    if path.suffix == ".parquet":
        from ringfeed.shards.sources.parquet import count_parquet_documents

        return count_parquet_documents(path, text_field)
    if path.suffix != ".jsonl":
        return 1
    try:
        with open(path, "rb") as f:
            return sum(1 for line in f if line.strip())
    except OSError as e:
        raise UserError(f"{path}: cannot read ({e.strerror})") from None


class Text(Source):
    format = "text"

    def __init__(self, opts: ShardOptions):
        super().__init__(opts)
        if opts.seq_len is not None and opts.seq_len < 1:
            raise UserError(f"--seq-len {opts.seq_len}: must be at least 1")
        self.tokenizer = load_tokenizer(opts.tokenizer)
        self.seq_len = opts.seq_len  # None: flat token shards
        # a tokenizer.json is recorded by its resolved path, and is an input of the plan (a
        # changed file changes the tokens: a rerun does not resume the old shards)
        self.options = {"seq_len": opts.seq_len, "tokenizer": self.tokenizer.name,
                        "text_field": opts.text_field, "glob": opts.glob}
        if self.tokenizer.file is not None:
            self.record_input(self.tokenizer.file)
        self._scratch = WorkDir(opts.out, opts.work_name)
        self._work = self._scratch.path
        self._tokens: dict[str, np.ndarray] = {}
        self._shard_tokens: dict[str, int] = {}  # flat: tokens per shard of each part
        stats = {"documents": 0, "tokens": 0, "dropped_tokens": 0}
        try:
            counts = self._scan(opts)
            if self.val_drawn:
                stats["val_documents"] = counts["val"][0]
            for part, (docs, total) in counts.items():
                tokens = np.memmap(self._work / f"{part}.tokens", dtype=self.tokenizer.dtype,
                                   mode="r", shape=(total,)) if total else np.empty(0)
                self._tokens[part] = tokens
                used = self._flat(part, tokens, opts) if self.seq_len is None \
                    else self._rows(part, total, opts)
                stats["documents"] += docs
                stats["tokens"] += total
                stats["dropped_tokens"] += total - used
        except BaseException:
            self.close()
            raise
        if self.seq_len is None:
            self.fields = {TOKENS_MEMBER: "npy", DOCS_MEMBER: "npy"}
            self.text = {**self.tokenizer.describe(), "layout": FLAT,
                         "shard_tokens": self._shard_tokens, **stats}
        else:
            self.fields = {MEMBER: "npy"}
            self.text = {**self.tokenizer.describe(), "seq_len": self.seq_len, **stats}

    def _scan(self, opts: ShardOptions) -> dict[str, tuple[int, int]]:
        """Tokenize the source into work files, or take another part's (SharedScan):
        {part: (documents, tokens)}."""
        splits = source_splits(opts.src)
        listing = {part: self._files(path, opts.glob)
                   for part, path in (splits or {"train": opts.src}).items()}
        # a fetched SRC is another local path on each machine: another key, nothing shared
        shared = SharedScan(opts.out, self.scan_key(extra=self._scan_extra(opts))) if (
            opts.part is not None or opts.scan_only) and not opts.src_url else None
        if shared is not None and (adopted := self._adopt(shared)) is not None:
            return adopted
        if opts.val_fraction and not splits:  # whole documents to val
            self.val_drawn = True
            files = listing["train"]
            counts = self._tokenize(files, opts, self._val_documents(files, opts))
        else:
            counts = {}
            for part, files in listing.items():
                counts.update(self._tokenize(files, opts, part=part))
        if shared is not None and shared.publish(self._work, {
                "counts": counts, "val_drawn": self.val_drawn}):
            self._work = self.shared = shared.path
        return counts

    def _scan_extra(self, opts: ShardOptions) -> dict[str, Any]:
        """What the tokens depend on beyond `options` and the inputs' path, size and mtime:
        the tokenizer's ids and dtype, a tokenizer.json's content (edited in place, its
        size and mtime may stay), the val draw."""
        digest = None
        if self.tokenizer.file is not None:
            try:
                digest = hashlib.sha256(self.tokenizer.file.read_bytes()).hexdigest()
            except OSError as e:
                raise UserError(f"{self.tokenizer.file}: cannot read ({e.strerror})") from None
        return {**self.tokenizer.describe(), "tokenizer_sha256": digest,
                "val_fraction": opts.val_fraction, "shuffle_seed": opts.shuffle_seed}

    def _adopt(self, shared: SharedScan) -> dict[str, tuple[int, int]] | None:
        """The counts of the shared scan of this key, if published and whole (each token
        file of the size its count says), reading its token files from then on; else None."""
        facts = shared.facts()
        if facts is None:
            return None
        itemsize = np.dtype(self.tokenizer.dtype).itemsize
        try:
            counts = {str(p): (int(d), int(t)) for p, (d, t) in facts["counts"].items()}
            if any((shared.path / f"{p}.tokens").stat().st_size != t * itemsize
                   for p, (_, t) in counts.items()):
                return None
        except (OSError, ValueError, TypeError, KeyError, AttributeError):
            return None
        self.val_drawn = bool(facts.get("val_drawn"))
        self._work = self.shared = shared.path
        return counts

    def _too_few(self, part: str, total: int, need: int, opts: ShardOptions) -> UserError:
        what = f"--seq-len {need}" if self.seq_len is not None else "one token"
        if self.val_drawn:
            return UserError(f"{opts.src}: the {part} documents hold {total} tokens, fewer "
                             f"than {what}; change --val-fraction")
        where = (source_splits(opts.src) or {}).get(part, opts.src)
        return UserError(f"{where}: {total} tokens, fewer than {what}")

    def _rows(self, part: str, total: int, opts: ShardOptions) -> int:
        """The row layout's part: `total // seq_len` rows; the tokens it keeps."""
        assert self.seq_len is not None
        count = total // self.seq_len
        if count == 0:
            raise self._too_few(part, total, self.seq_len, opts)
        size = member_tar_bytes(len(npy_bytes(self._tokens[part][: self.seq_len])))
        self.parts[part] = Part(NumberedKeys(count), int_sizes(np.full(count, size)))
        return count * self.seq_len

    def _flat(self, part: str, tokens: np.ndarray, opts: ShardOptions) -> int:
        """The flat layout's part: k shards of equal tokens (the last k - 1 tokens at most
        dropped), as many as --max-size (and --max-count, in tokens) ask; the tokens it keeps.
        Equal shards make the manifest's per-shard count one number, whatever order
        --shuffle-seed puts them in."""
        total = len(tokens)
        if total == 0:
            raise self._too_few(part, total, 1, opts)
        max_size, max_count = opts.size_limits()
        itemsize = np.dtype(self.tokenizer.dtype).itemsize
        doc_bytes = doc_dtype(total).itemsize * (int(np.count_nonzero(
            tokens[:-1] == self.tokenizer.eos_id)) + 1)
        k = 1
        if max_size:  # the packing's budget (whole tar records, the end blocks), less headers
            budget = (max_size // RECORD) * RECORD - END - FLAT_OVERHEAD
            k = max(k, -(-(total * itemsize + doc_bytes) // max(budget, 1)))
        if max_count:
            k = max(k, -(-total // max_count))
        k = min(k, total)
        per = total // k
        eos, docs = self.tokenizer.eos_id, doc_dtype(per)
        sizes = [member_tar_bytes(npy_size(tokens.dtype, per)) + member_tar_bytes(npy_size(
            docs, len(document_starts(tokens, i * per, (i + 1) * per, eos)))) for i in range(k)]
        self.parts[part] = Part(NumberedKeys(k), int_sizes(sizes))
        self._shard_tokens[part] = per
        return k * per

    def _chunk(self, part: str, per: int, index: int) -> dict[str, bytes]:
        """Flat shard `index` of `part` (`per` tokens each): its members."""
        tokens = self._tokens[part]
        starts = document_starts(tokens, index * per, (index + 1) * per, self.tokenizer.eos_id)
        return flat_members(tokens[index * per:(index + 1) * per], starts)

    @staticmethod
    def _val_documents(files: list[Path], opts: ShardOptions) -> np.ndarray:
        """A mask over the documents of `files`, in order: the ones drawn into val."""
        n = sum(_count_documents(f, opts.text_field) for f in files)
        seed = opts.shuffle_seed if opts.shuffle_seed is not None else 0
        return draw_val(n, None, opts.val_fraction, seed, unit="documents",
                        why=f" in {opts.src} (text is split by document)")

    def _files(self, path: Path, pattern: str) -> list[Path]:
        if path.is_file():
            files = [path]
        else:
            files = sorted(p for p in path.rglob(pattern) if p.is_file() and not any(
                part.startswith(".") for part in p.relative_to(path).parts))
        if not files:
            raise UserError(f"{path}: no text files (matching {pattern!r})")
        for f in files:
            self.record_input(f)
        return files

    def _tokenize(self, files: list[Path], opts: ShardOptions, is_val: np.ndarray | None = None,
                  part: str = "train") -> dict[str, tuple[int, int]]:
        """Tokenize `files` in order into work files: all into `part`, or document by document
        into train and val (`is_val[i]` for the i-th document). {part: (documents, tokens)}."""
        self._work.mkdir(parents=True, exist_ok=True)
        parts = [part] if is_val is None else ["train", "val"]
        counts = {p: [0, 0] for p in parts}
        blocks: Iterator[tuple[np.ndarray, int]]
        if self.tokenizer.encode is None or opts.workers <= 1:
            blocks = (block for path in files
                      for block in _file_tokens(self.tokenizer, Piece(path), opts.text_field))
        else:  # a real tokenizer is the slow part: files and pieces of them in parallel, in order
            blocks = _pooled_tokens(self.tokenizer, files, opts, is_val is not None)
        with ExitStack() as stack:
            outs = {p: stack.enter_context(open(self._work / f"{p}.tokens", "wb")) for p in parts}
            document, target = 0, part
            for tokens, ended in blocks:
                if is_val is not None:
                    if document >= len(is_val):
                        raise UserError(f"{opts.src}: changed while sharding (more documents "
                                        "than counted); run the same command again")
                    target = "val" if is_val[document] else "train"
                outs[target].write(tokens.tobytes())
                counts[target][0] += ended
                counts[target][1] += tokens.size
                document += ended
        return {p: (docs, total) for p, (docs, total) in counts.items()}

    def sample(self, part: str, index: int) -> dict[str, Any]:
        key = self.parts[part].keys[index]
        if self.seq_len is None:
            return {"__key__": key, **self._chunk(part, self._shard_tokens[part], index)}
        start = index * self.seq_len
        tokens = self._tokens[part][start: start + self.seq_len]
        return {"__key__": key, MEMBER: npy_bytes(tokens)}

    def close(self) -> None:
        self._tokens.clear()
        self._scratch.remove()

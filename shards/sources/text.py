"""`text`: documents -> tokens -> fixed-length sequences, one `tokens.npy` member per sample.

A document is a whole file, or in a `.jsonl` file one line's `--text-field`. Documents are
tokenized in order, each followed by the end-of-document id, and the stream is cut into
`--seq-len` sequences (GPT-style packing: a sequence may span a document boundary, marked by the
EOS id; the last incomplete sequence is dropped and counted). Tokens go to a work file under
OUT, so shard writers in other processes map them instead of re-tokenizing.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from shards.errors import UserError
from shards.keys import NumberedKeys
from shards.members import member_tar_bytes, npy_bytes
from shards.options import ShardOptions
from shards.parallel import parallel_map
from shards.sources.base import Part, Source, int_sizes, source_splits
from shards.tokenizers import Tokenizer, load_tokenizer

MEMBER = "tokens.npy"
READ_CHUNK = 1 << 24
WORK_DIR = ".ringfeed-work"


def _jsonl_documents(path: Path, text_field: str) -> Iterator[bytes]:
    with open(path, "rb") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except ValueError as e:
                raise UserError(f"{path}:{number}: not valid JSON ({e})") from None
            if not isinstance(row, dict) or not isinstance(row.get(text_field), str):
                raise UserError(f"{path}:{number}: no string field {text_field!r} "
                                "(name the document field with --text-field)")
            yield row[text_field].encode()


def _file_tokens(tokenizer: Tokenizer, path: Path, text_field: str
                 ) -> Iterator[tuple[np.ndarray, int]]:
    """(tokens, documents they end) for one file, in order; every document ends with EOS."""
    try:
        if path.suffix == ".jsonl":
            for doc in _jsonl_documents(path, text_field):
                yield tokenizer.tokens(doc, str(path)), 1
        elif tokenizer.encode is None:  # byte-level: stream, the file need not fit in memory
            with open(path, "rb") as f:
                while chunk := f.read(READ_CHUNK):
                    yield np.frombuffer(chunk, np.uint8).astype(tokenizer.dtype), 0
            yield np.array([tokenizer.eos_id], tokenizer.dtype), 1
        else:
            yield tokenizer.tokens(path.read_bytes(), str(path)), 1
    except OSError as e:
        raise UserError(f"{path}: cannot read ({e.strerror})") from None


def _tokenize_file(shared: tuple[Tokenizer, str], path: Path) -> tuple[np.ndarray, int]:
    tokenizer, text_field = shared
    pieces = list(_file_tokens(tokenizer, path, text_field))
    return np.concatenate([t for t, _ in pieces]), sum(n for _, n in pieces)


class Text(Source):
    format = "text"

    def __init__(self, opts: ShardOptions):
        super().__init__(opts)
        if opts.seq_len < 1:
            raise UserError(f"--seq-len {opts.seq_len}: must be at least 1")
        self.tokenizer = load_tokenizer(opts.tokenizer)
        self.seq_len = opts.seq_len
        self.options = {"seq_len": opts.seq_len, "tokenizer": opts.tokenizer,
                        "text_field": opts.text_field, "glob": opts.glob}
        self._work = opts.out / WORK_DIR
        self._tokens: dict[str, np.ndarray] = {}
        stats = {"documents": 0, "tokens": 0, "dropped_tokens": 0}
        try:
            for part, path in (source_splits(opts.src) or {"train": opts.src}).items():
                docs, total = self._tokenize(part, self._files(path, opts.glob), opts)
                count = total // self.seq_len
                if count == 0:
                    raise UserError(f"{path}: {total} tokens, fewer than --seq-len {self.seq_len}")
                tokens = np.memmap(self._work / f"{part}.tokens", dtype=self.tokenizer.dtype,
                                   mode="r", shape=(total,))
                self._tokens[part] = tokens
                size = member_tar_bytes(len(npy_bytes(tokens[: self.seq_len])))
                self.parts[part] = Part(NumberedKeys(count), int_sizes(np.full(count, size)))
                stats["documents"] += docs
                stats["tokens"] += total
                stats["dropped_tokens"] += total - count * self.seq_len
        except BaseException:
            self.close()
            raise
        self.fields = {MEMBER: "npy"}
        self.text = {**self.tokenizer.describe(), "seq_len": self.seq_len, **stats}

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

    def _tokenize(self, part: str, files: list[Path], opts: ShardOptions) -> tuple[int, int]:
        """Tokenize `files` in order into the part's work file: (documents, tokens)."""
        self._work.mkdir(parents=True, exist_ok=True)
        docs = total = 0
        with open(self._work / f"{part}.tokens", "wb") as out:
            if self.tokenizer.encode is None or opts.workers <= 1:
                pieces = (piece for path in files
                          for piece in _file_tokens(self.tokenizer, path, opts.text_field))
            else:  # a real tokenizer is the slow part: whole files in parallel, kept in order
                pieces = parallel_map(_tokenize_file, files, opts.workers,
                                      (self.tokenizer, opts.text_field), 1)
            for tokens, n in pieces:
                out.write(tokens.tobytes())
                docs += n
                total += tokens.size
        return docs, total

    def sample(self, part: str, index: int) -> dict[str, Any]:
        start = index * self.seq_len
        tokens = self._tokens[part][start: start + self.seq_len]
        return {"__key__": self.parts[part].keys[index], MEMBER: npy_bytes(tokens)}

    def close(self) -> None:
        self._tokens.clear()
        shutil.rmtree(self._work, ignore_errors=True)

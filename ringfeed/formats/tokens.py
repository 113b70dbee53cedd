"""Flat token shards: the layout, its writer's and reader's helpers, and the names a shard's
reader, the pipeline and the trainer share.

A flat token shard is one tar sample of two members: `tokens.npy`, the shard's tokens as one
1-D array in the tokenizer's dtype (the stream cut at the shard's edges, documents running
across them), and `docs.npy`, the offsets within the shard of the documents that start in it
(ascending uint32, int64 past 2^32 tokens; a shard starting mid-document has no 0). The
manifest's `text` says `layout: flat` and `shard_tokens` (per split, the tokens of each of its
shards: a split's shards are cut equal). The context is chosen when reading: a window of
seq_len + 1 tokens (inputs t[:-1], targets t[1:]) at stride seq_len + 1, from offset 0 or,
with random windows, from an offset in [0, seq_len] drawn from (seed, epoch, shard key).
"""

from __future__ import annotations

import hashlib
import io
from dataclasses import dataclass
from typing import Any

import numpy as np

from ringfeed.formats.members import npy_bytes

# A training window's per-token document index (int32, the window's length): 0 for the
# document the window starts in, +1 at each document start inside it. Present in a batch only
# when the shards record their documents; the built-in gpt's block-causal mask reads it.
DOC_IDS = "doc_ids"
TOKENS_MEMBER = "tokens.npy"
DOCS_MEMBER = "docs.npy"
FLAT = "flat"  # manifest text["layout"]; manifests without it hold rows (one sequence a sample)


def doc_dtype(tokens: int) -> np.dtype:
    """uint32 offsets while they fit (half the bytes of int64 on corpora of short documents)."""
    return np.dtype(np.uint32 if tokens < 2**32 else np.int64)


def npy_size(dtype: np.dtype, length: int) -> int:
    """Bytes of the .npy file of a 1-D array (npy_bytes' header and data), without one."""
    header = io.BytesIO()
    np.lib.format.write_array_header_1_0(header, {
        "descr": np.lib.format.dtype_to_descr(np.dtype(dtype)), "fortran_order": False,
        "shape": (length,)})
    return header.tell() + length * np.dtype(dtype).itemsize


def flat_members(tokens: np.ndarray, starts: np.ndarray) -> dict[str, bytes]:
    """A flat shard's members: its tokens and the offsets of the documents starting in it."""
    return {TOKENS_MEMBER: npy_bytes(tokens),
            DOCS_MEMBER: npy_bytes(np.asarray(starts).astype(doc_dtype(len(tokens))))}


def document_starts(stream: np.ndarray, lo: int, hi: int, eos_id: int) -> np.ndarray:
    """Offsets within stream[lo:hi] of the documents starting there: the stream's first token
    and every token after an EOS (each document ends with one)."""
    before = np.flatnonzero(stream[max(lo - 1, 0):hi - 1] == eos_id) + (1 if lo == 0 else 0)
    return np.concatenate([[0], before]).astype(np.int64) if lo == 0 else before.astype(np.int64)


def window_count(tokens: Any, seq_len: int, random: bool) -> Any:
    """Windows of seq_len + 1 tokens in a shard of `tokens` (a number or an array of them):
    packed from 0, or (random) from an offset up to seq_len, so the count is the same in every
    epoch."""
    return np.maximum((np.asarray(tokens) - (seq_len if random else 0)) // (seq_len + 1), 0)


def window_offset(seed: int, epoch: int, shard_key: str, seq_len: int) -> int:
    """A shard's random-window offset in [0, seq_len], from (seed, epoch, shard key) only."""
    digest = hashlib.blake2b(f"{seed}/{epoch}/{shard_key}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") % (seq_len + 1)


@dataclass(slots=True)  # (one per window read: slots make it cheap to build)
class TokenSpan:
    """What a reader takes from a flat shard for window `index`: the tokens from the window's
    packed start, `seq_len + 1` of them (2 seq_len + 1 with random windows: room for any
    offset), and the offsets within them of the documents starting there. `window(offset())`
    cuts the epoch's window out."""

    tokens: np.ndarray
    starts: list[int]  # ascending, within `tokens` (a window holds few: plain ints are cheaper)
    seq_len: int
    random: bool
    shard_key: str

    def offset(self, seed: int, epoch: int) -> int:
        """Where the epoch's window starts in `tokens`."""
        return window_offset(seed, epoch, self.shard_key, self.seq_len) if self.random else 0

    def window(self, lo: int) -> tuple[np.ndarray, np.ndarray]:
        """(tokens as int64, DOC_IDS as int32) of the window from `lo` (`offset()`)."""
        size = self.seq_len + 1
        ids = np.zeros(size, dtype=np.int32)
        for start in self.starts:
            if lo < start < lo + size:
                ids[start - lo:] += 1
        return self.tokens[lo:lo + size].astype(np.int64), ids

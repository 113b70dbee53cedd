"""The binary format of manifest.bin, the compact index of manifest.json (written side; the
reading side, memory-mapped, is ringfeed/formats/manifest_index.py): flat arrays per split and
the file's layout. It imports nothing of the manifest module, not even for type hints: a shard
row is what ShardRow says the index stores, and manifest.py turns a Manifest into these arrays
when Manifest.save writes the index right after the JSON."""

from __future__ import annotations

import dataclasses
import json
import os
import struct
import zlib
from collections.abc import Sequence
from pathlib import Path
from typing import IO, Any, Protocol

import numpy as np

from ringfeed.fsutil import atomic_open

INDEX_NAME = "manifest.bin"
MAGIC = b"RFMIDX\x00\x02"  # \x01: the header had no crc32 (such files are rebuilt)
OLD_MAGICS = (b"RFMIDX\x00\x01",)
VERSION = 3  # 2: a crc32 per array; 3: and one of the header (older files are rebuilt)
HEAD = len(MAGIC) + 8 + 4  # magic, the header's size and its crc32
ALIGN = 64
HAS_SHA256, HAS_INDEX = 1, 2
_ARRAYS = ("counts", "bytes", "sha256", "flags", "name_offsets", "names", "index_offsets",
           "index_names")


class ShardRow(Protocol):
    """What the index stores of one shard (manifest.py's ShardInfo is one)."""

    name: str
    num_samples: int
    bytes: int
    sha256: str | None
    index: str | None


@dataclasses.dataclass
class SplitArrays:
    """One split's shard table as flat arrays (what the index stores)."""

    counts: np.ndarray  # int64 [S] samples per shard
    bytes: np.ndarray  # int64 [S]
    sha256: np.ndarray  # uint8 [S, 32]
    flags: np.ndarray  # uint8 [S]: HAS_SHA256 | HAS_INDEX
    name_offsets: np.ndarray  # int64 [S + 1] into `names`
    names: np.ndarray  # uint8: shard names, UTF-8, concatenated
    index_offsets: np.ndarray  # int64 [S + 1] into `index_names`
    index_names: np.ndarray  # uint8: sidecar names ("" where none)

    @classmethod
    def from_shards(cls, shards: Sequence[ShardRow]) -> SplitArrays:
        names = [s.name.encode() for s in shards]
        index_names = [(s.index or "").encode() for s in shards]
        sha = b"".join(bytes.fromhex(s.sha256) if s.sha256 else bytes(32) for s in shards)
        flags = np.array([(HAS_SHA256 if s.sha256 else 0) | (HAS_INDEX if s.index else 0)
                          for s in shards], dtype=np.uint8)
        return cls(np.array([s.num_samples for s in shards], dtype=np.int64),
                   np.array([s.bytes for s in shards], dtype=np.int64),
                   np.frombuffer(sha, dtype=np.uint8).reshape(len(shards), 32),
                   flags, *_blob(names), *_blob(index_names))


def _blob(items: list[bytes]) -> tuple[np.ndarray, np.ndarray]:
    offsets = np.zeros(len(items) + 1, dtype=np.int64)
    np.cumsum([len(x) for x in items], out=offsets[1:])
    return offsets, np.frombuffer(b"".join(items), dtype=np.uint8)


def write_index(path: str | os.PathLike, meta: dict[str, Any], splits: dict[str, SplitArrays],
                json_size: int, json_sha256: str) -> Path:
    """Write an index atomically (temp file + rename): readers see the old one or the new one."""
    with atomic_open(path, "wb") as f:
        _serialise(f, meta, splits, json_size, json_sha256)
    return Path(path)


def _serialise(f: IO[bytes], meta: dict[str, Any], splits: dict[str, SplitArrays],
               json_size: int, json_sha256: str) -> None:
    layout: dict[str, dict[str, list]] = {}
    offset = 0
    for name, arrays in splits.items():
        entry = {}
        for field in _ARRAYS:
            a = np.ascontiguousarray(getattr(arrays, field))
            entry[field] = [offset, a.dtype.newbyteorder("<").str, list(a.shape),
                            zlib.crc32(_little_endian(a))]
            offset += _aligned(a.nbytes)
        layout[name] = entry
    header = json.dumps({"version": VERSION, "json_size": json_size, "json_sha256": json_sha256,
                         "manifest": meta, "splits": layout}, sort_keys=True).encode()
    f.write(MAGIC + struct.pack("<QI", len(header), zlib.crc32(header)) + header)
    f.write(bytes(_aligned(HEAD + len(header)) - HEAD - len(header)))
    for arrays in splits.values():
        for field in _ARRAYS:
            data = _little_endian(np.ascontiguousarray(getattr(arrays, field)))
            f.write(data + bytes(_aligned(len(data)) - len(data)))


def _little_endian(a: np.ndarray) -> bytes:
    return a.astype(a.dtype.newbyteorder("<"), copy=False).tobytes()


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN

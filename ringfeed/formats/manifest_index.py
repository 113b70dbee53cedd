"""`manifest.bin`: a compact binary index of manifest.json, memory-mapped by the pipeline.

At 10^6 shards manifest.json is ~200 MB of JSON, seconds and ~1 GB of Python objects to parse
on every rank. The index holds the same shard table as flat arrays, so a rank maps it in
milliseconds, touches only the pages it reads (the sample counts, then the shards it opens),
and the ranks of a node share one copy in the page cache.

Layout (little-endian):

    magic b"RFMIDX\\x00\\x02" | uint64 H | uint32 crc32 of the header | H bytes of JSON header |
    arrays, each 64-byte aligned

The header holds the format version, the size and sha256 of the manifest.json it indexes, the
manifest's fields other than `splits` (fields, class_names, text, ...), and per split the
(offset, dtype, shape, crc32) of its arrays (every crc but the sha256 array's is checked when a
process maps the index; a mismatch means rebuilding it from the JSON, with a warning): `counts` and `bytes` (int64 [S]), `sha256` (uint8 [S, 32],
valid where `flags` bit 0), `flags` (uint8 [S]; bit 1: the shard has a tar index sidecar), and
the shard names and sidecar names as UTF-8 blobs with int64 [S + 1] offsets.

Where it comes from:
- `Manifest.save` writes it beside manifest.json, atomically, right after the JSON (so
  `ringfeed shard` and `--format wds-index` leave both). The content depends only on the
  manifest, so an interrupted and an uninterrupted run leave the same bytes.
- For a manifest without one (older shards, a JSON written by other tools, a read-only or
  remote location), `load_index` builds it once from the JSON into a cache directory, under a
  lock (one rank of a node parses, the others wait and map the result), atomically.

Freshness: an index beside manifest.json is used when it records the JSON's size and is not
older than it (the JSON is written first); otherwise the cache's copy is keyed by the JSON's
path, size and mtime (local) or its sha256 (remote bytes).
"""

from __future__ import annotations

import fcntl
import hashlib
import io
import json
import logging
import os
import struct
import zlib
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import numpy as np

from ringfeed.formats.manifest import (
    Manifest,
    ManifestError,
    ShardInfo,
    Split,
    index_contents,
    write_manifest_index,
)
from ringfeed.formats.manifest_format import (  # noqa: F401 - re-exported: the index's one namespace
    HAS_INDEX,
    HAS_SHA256,
    HEAD,
    INDEX_NAME,
    MAGIC,
    OLD_MAGICS,
    VERSION,
    SplitArrays,
    _aligned,
    _serialise,
)


class ManifestIndex:
    """An index, memory-mapped read-only from its file (pages are read, and shared between
    processes, on demand), or held in memory (`from_bytes`: when no file could be written)."""

    def __init__(self, path: str | os.PathLike | None, data: bytes | None = None) -> None:
        self.path = Path(path) if path is not None else None
        self._buffer = (np.memmap(self.path, dtype=np.uint8, mode="r") if data is None
                        else np.frombuffer(data, dtype=np.uint8))
        where = self.path or "manifest index"
        head = bytes(self._buffer[:HEAD])
        if head[:len(MAGIC)] in OLD_MAGICS:
            raise ManifestError(f"{where}: manifest index of an older ringfeed")  # rebuilt
        if len(head) < HEAD or head[:len(MAGIC)] != MAGIC:
            raise ManifestError(f"{where}: not a ringfeed manifest index")
        size, crc = struct.unpack("<QI", head[len(MAGIC):])
        header = bytes(self._buffer[HEAD:HEAD + size])
        if len(header) != size or zlib.crc32(header) != crc:
            raise ManifestError(f"{where}: damaged manifest index (header: crc32 mismatch)")
        start = HEAD
        try:
            self.header = json.loads(header)
        except ValueError as e:
            raise ManifestError(f"{where}: corrupt manifest index ({e})") from None
        if self.header.get("version") != VERSION:
            raise ManifestError(f"{where}: manifest index version "
                                f"{self.header.get('version')} (this ringfeed reads {VERSION})")
        self.data_start = _aligned(start + size)
        end = max((self.data_start + off + _aligned(np.dtype(dt).itemsize * int(np.prod(shape)))
                   for split in self.header["splits"].values()
                   for off, dt, shape, _ in split.values()), default=self.data_start)
        if end > len(self._buffer):
            raise ManifestError(f"{where}: truncated manifest index")
        for name in self.header["splits"]:
            self._check(name)

    @classmethod
    def from_bytes(cls, data: bytes) -> ManifestIndex:
        return cls(None, data)

    def __reduce__(self) -> tuple:  # loader workers map the file again
        if self.path is not None:
            return ManifestIndex, (self.path,)
        return ManifestIndex.from_bytes, (self._buffer.tobytes(),)

    @property
    def json_size(self) -> int:
        return int(self.header["json_size"])

    @property
    def split_names(self) -> list[str]:
        return list(self.header["splits"])

    def split(self, name: str) -> SplitIndex:
        if name not in self.header["splits"]:
            raise ManifestError(f"split {name!r} not in manifest "
                                f"(have: {', '.join(self.header['splits'])})")
        return SplitIndex(self, name)

    def _check(self, name: str) -> None:
        """Every array of split `name` has the crc32 the writer recorded, except the shards'
        sha256 (32 bytes a shard, and a changed one is loud: the download check fails). What
        plans and opens shards (counts, flags, names) cannot change unnoticed; crc32 runs at
        ~1.5 GB/s: 32-48 ms for a 10^6-shard index (82 MB), once per process."""
        for field, (offset, _, shape, crc) in self.header["splits"][name].items():
            if field == "sha256":
                continue
            lo = self.data_start + offset
            nbytes = int(np.prod(shape, dtype=np.int64)) * np.dtype(
                self.header["splits"][name][field][1]).itemsize
            if zlib.crc32(self._buffer[lo:lo + nbytes]) != crc:
                raise ManifestError(f"{self.path or 'manifest index'}: damaged manifest index "
                                    f"(split {name!r}, {field}: crc32 mismatch)")

    def arrays(self, name: str) -> SplitArrays:
        views = {}
        for field, (offset, dtype, shape, _) in self.header["splits"][name].items():
            dt = np.dtype(dtype)
            lo = self.data_start + offset
            count = int(np.prod(shape, dtype=np.int64))
            views[field] = self._buffer[lo:lo + count * dt.itemsize].view(dt).reshape(shape)
        return SplitArrays(**views)

    def manifest(self) -> Manifest:
        """The manifest, its shard lists read from the index as they are accessed."""
        splits = {name: Split(self.split(name)) for name in self.split_names}
        try:
            return Manifest(splits=splits, **self.header["manifest"])  # type: ignore[arg-type]
        except TypeError as e:  # written by a ringfeed with other manifest fields
            raise ManifestError(f"{self.path or 'manifest index'}: {e}") from None


class SplitIndex(Sequence[ShardInfo]):
    """One split of an index: a read-only sequence of ShardInfo made on access, plus the
    arrays themselves (`counts`: what planning needs, without a Python object per shard)."""

    def __init__(self, index: ManifestIndex, name: str) -> None:
        self.index, self.name = index, name
        self.arrays = index.arrays(name)

    def __reduce__(self) -> tuple:
        return SplitIndex, (self.index, self.name)

    @property
    def counts(self) -> np.ndarray:
        return self.arrays.counts

    def __len__(self) -> int:
        return len(self.arrays.counts)

    def __getitem__(self, i):  # type: ignore[override]
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        a = self.arrays
        i = range(len(self))[i]  # negative indices, IndexError
        flags = int(a.flags[i])
        return ShardInfo(self.shard_name(i), int(a.counts[i]), int(a.bytes[i]),
                         bytes(a.sha256[i]).hex() if flags & HAS_SHA256 else None,
                         _text(a.index_names, a.index_offsets, i) if flags & HAS_INDEX else None)

    def __iter__(self) -> Iterator[ShardInfo]:
        return (self[i] for i in range(len(self)))

    def shard_name(self, i: int) -> str:
        return _text(self.arrays.names, self.arrays.name_offsets, i)

    def names_starting_with(self, prefix: str) -> np.ndarray:
        """Indices of the shards whose name starts with `prefix`, without decoding names."""
        a, p = self.arrays, np.frombuffer(prefix.encode(), dtype=np.uint8)
        starts = a.name_offsets[:-1]
        hit = (a.name_offsets[1:] - starts) >= len(p)
        for k, byte in enumerate(p.tolist()):
            where = np.flatnonzero(hit)
            hit[where] = a.names[starts[where] + k] == byte
        return np.flatnonzero(hit)


def _text(blob: np.ndarray, offsets: np.ndarray, i: int) -> str:
    return bytes(blob[offsets[i]:offsets[i + 1]]).decode()


# -- finding or building the index of a manifest ----------------------------------------------
def beside(manifest_path: str | os.PathLike) -> Path:
    return Path(manifest_path).with_name(INDEX_NAME)


def load_index(manifest_path: str | os.PathLike, cache_dir: str | os.PathLike | None
               ) -> ManifestIndex:
    """The index of a local manifest.json: the one beside it when current, else the cache's
    copy (built from the JSON once, under a lock, when missing). Without a usable cache
    directory it is built in memory (this process only). Raises ManifestError for
    a missing or invalid manifest, as Manifest.load does."""
    path = Path(manifest_path)
    try:
        st = path.stat()
    except FileNotFoundError:
        raise ManifestError(f"{path}: no manifest.json (run `ringfeed shard` first)") from None
    index = _current(beside(path), st.st_size, st.st_mtime_ns)
    if index is not None:
        return index
    key = f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}"
    return _cached(key, cache_dir, lambda: path.read_bytes(), str(path), st.st_size)


def index_of_bytes(data: bytes, origin: str, cache_dir: str | os.PathLike | None
                   ) -> ManifestIndex:
    """The index of manifest.json bytes read from anywhere (a remote manifest), cached by
    their sha256."""
    key = "sha256:" + hashlib.sha256(data).hexdigest()
    return _cached(key, cache_dir, lambda: data, origin, len(data))


def _current(path: Path, json_size: int, json_mtime_ns: int | None) -> ManifestIndex | None:
    """The index at `path` if it is one, of a JSON of this size, and not older than it."""
    try:
        if json_mtime_ns is not None and path.stat().st_mtime_ns < json_mtime_ns:
            return None
        index = ManifestIndex(path)
    except ManifestError as e:
        if "damaged" in str(e):  # said once; the index is rebuilt from manifest.json
            logging.getLogger("ringfeed").warning("%s; using one rebuilt from manifest.json", e)
        return None
    except (OSError, ValueError):
        return None
    return index if index.json_size == json_size else None


def _cached(key: str, cache_dir: str | os.PathLike | None, read: Callable[[], bytes],
            origin: str, json_size: int) -> ManifestIndex:
    """The index cached under `key` in `cache_dir`, built from read() when missing."""
    digest = hashlib.sha256(key.encode()).hexdigest()[:32]
    if cache_dir is not None:
        target = Path(cache_dir) / f"{digest}.bin"
        index = _current(target, json_size, None)
        if index is not None:
            return index
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            with open(target.with_suffix(".lock"), "a") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX)  # one builder; the others find its result
                index = _current(target, json_size, None)
                if index is None:
                    _build(read(), origin, target)
                    index = ManifestIndex(target)
                return index
        except OSError:
            pass  # no usable cache (read-only, full, a file in the way): this process only
    data, buffer = read(), io.BytesIO()
    _serialise(buffer, *index_contents(_parse(data, origin), data))
    return ManifestIndex.from_bytes(buffer.getvalue())


def _build(data: bytes, origin: str, target: Path) -> None:
    write_manifest_index(_parse(data, origin), data, target)


def _parse(data: bytes, origin: str) -> Manifest:
    try:
        return Manifest.from_dict(json.loads(data), origin=origin)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ManifestError(f"{origin}: not valid JSON ({e})") from None

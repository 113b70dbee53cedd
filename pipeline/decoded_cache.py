"""Decoded-sample cache: a shard's decoded fixed-shape fields as memory-mapped arrays.

The first pass that opens a shard decodes all of it (Decoder.base: images after resize, as
uint8; token arrays; npy fields; numbers) into one entry file; later passes slice the arrays
instead of reading and decoding. Normalization and `transform` still run per pass on top.

An entry is keyed by the shard's identity (manifest sha256; else path, size and mtime) and the
decode settings, so a changed shard or other settings never meet an old entry. File layout:
the field arrays, each 64-byte aligned, then the heap of ragged images, then the keys (utf-8
blob + int64 ends), then a JSON footer describing them (with a crc32 of each field's bytes, of
the heap and of the keys), its length (8 bytes) and a magic (8 bytes). A ragged image field
(random augment's SourceImages: uint8 HWC of any size) is an int64 table of one row per sample,
(heap offset, h, w, c, encoded height, encoded width), with its pixels in the heap.

Integrity: a store (one per pipeline, and per loader worker) verifies an entry's checksums the
first time it maps it, and again when the file's size or mtime changes (a writer touched it);
recency for eviction is the atime, so reading leaves the mtime alone. A mismatch is
`DamagedEntry`: the entry is removed (the caller reads the shard and writes the entry again) and
never served. crc32 runs at ~7 GB/s here, so a check costs a few ms per 100 MB once per store.

Several processes share a directory (ranks and loader workers of one host): an entry is written
to a temp file under an exclusive non-blocking lock and renamed into place (one writer; the
others read the source meanwhile), readers hold a shared `flock` while they use an entry, and
least-recently-used entries no one holds are evicted above `limit` bytes. Shards whose samples
are not all fixed-shape arrays, numbers or SourceImages (text, JSON, bytes, ragged arrays), or
that hold a bad sample, are not cached.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import mmap
import os
import tempfile
import threading
import time
import zlib
from pathlib import Path
from typing import Any

import numpy as np

from ringfeed.fsutil import publish
from ringfeed.pipeline.augment_pixels import SourceImage
from ringfeed.pipeline.cache import LOCK_SUFFIX, evict_lru_sized, remove_stale_temporaries

MAGIC = b"RFDEC003"  # 003: ragged images and a heap; 002: checksums (older: never opened)
SUFFIX = ".rfd"
# How stale this process's view of the cache's size may get (other ranks and loader workers
# write entries too): the directory is scanned again at least this often while writing.
RESCAN_S = 30.0
ALIGN = 64
RAGGED_ROW = 6  # a ragged image's table row: heap offset, h, w, c, encoded height, width


class Uncacheable(Exception):
    """This shard's decoded samples cannot be stored as fixed-shape arrays."""


class DamagedEntry(Exception):
    """An entry whose bytes are not the ones written (it has been removed)."""


def _version(st: os.stat_result) -> tuple[int, int, int, int]:
    """(device, inode, size, mtime): which file, and whether a writer touched it since."""
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


def _scalar_dtype(value: Any) -> np.dtype | None:
    if isinstance(value, (bool, np.bool_)):
        return np.dtype(bool)
    if isinstance(value, (int, np.integer)):
        return np.dtype(np.int64)
    if isinstance(value, (float, np.floating)):
        return np.dtype(np.float64)
    return None


def _layout(sample: dict[str, Any]) -> dict[str, tuple[np.dtype, tuple[int, ...], Any]]:
    """field -> (dtype, shape, kind) from the first decoded sample: kind True for a Python
    number, "ragged" for a SourceImage (stored as its table row), else False."""
    fields: dict[str, tuple[np.dtype, tuple[int, ...], Any]] = {}
    for name, value in sample.items():
        if isinstance(value, SourceImage):
            fields[name] = (np.dtype(np.int64), (RAGGED_ROW,), "ragged")
        elif isinstance(value, np.ndarray) and value.dtype.kind in "biuf":
            fields[name] = (value.dtype, value.shape, False)
        elif (dtype := _scalar_dtype(value)) is not None:
            fields[name] = (dtype, (), True)
        else:
            raise Uncacheable(f"field {name!r} is {type(value).__name__}, not a number or array")
    return fields


def layout_of(sample: dict[str, Any]) -> int:
    """Bytes one sample takes in an entry (raises Uncacheable for a sample it cannot hold); a
    SourceImage's, this one's pixels."""
    return sum(dtype.itemsize * int(np.prod(shape)) for dtype, shape, _ in _layout(sample).values()
               ) + sum(v.pixels.nbytes for v in sample.values() if isinstance(v, SourceImage))


class DecodedStore:
    def __init__(self, directory: str | os.PathLike, limit: int | None,
                 settings: dict[str, Any]) -> None:
        self.directory = Path(directory)
        self.limit = limit
        text = json.dumps({"format": MAGIC.decode(), **settings}, sort_keys=True)
        self.settings_key = hashlib.sha256(text.encode()).hexdigest()[:16]
        self._bytes: int | None = None  # the entries' total at the last scan, plus writes since
        self._scanned_at = 0.0
        # (device, inode, size, mtime) of the entries verified (or written) through this store:
        # each is checked once per store (one per pipeline), not once per open; loader workers
        # start from what was known when they were made
        self._verified: set[tuple[int, int, int, int]] = set()
        self._verified_lock = threading.Lock()

    def __getstate__(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if k != "_verified_lock"}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state, _verified_lock=threading.Lock())

    def verified(self, st: os.stat_result) -> None:
        """Remember the entry of `st` as verified (its bytes are the ones written)."""
        with self._verified_lock:
            self._verified.add(_version(st))

    def path(self, identity: str, name: str) -> Path:
        stem = name.rstrip("/").rsplit("/", 1)[-1][:60]
        digest = hashlib.sha256(identity.encode()).hexdigest()[:20]
        return self.directory / f"{stem}-{digest}-{self.settings_key}{SUFFIX}"

    def open(self, path: Path) -> CachedShard | None:
        """The entry at `path`, locked for reading and verified (see the module's doc), or None
        when there is none. Raises DamagedEntry (after removing it) for an entry that is not
        what was written: unreadable, or its bytes changed."""
        try:
            f = open(path, "rb")
        except FileNotFoundError:
            return None
        try:
            fcntl.flock(f.fileno(), fcntl.LOCK_SH)
            st = os.fstat(f.fileno())
            if st.st_nlink == 0:  # evicted between open and lock
                f.close()
                return None
            shard = CachedShard(f)
            with self._verified_lock:
                known = _version(st) in self._verified
            if not known:
                shard.verify()
                self.verified(st)
        except (ValueError, OSError) as e:
            f.close()
            _unlink(path)
            raise DamagedEntry(f"{path.name}: {e}") from None
        try:
            os.utime(path, ns=(time.time_ns(), st.st_mtime_ns))  # LRU recency (the atime)
        except OSError:  # a read-only cache is still readable
            pass
        return shard

    def writer(self, path: Path, num_samples: int) -> EntryWriter | None:
        """A writer for the entry, or None when another process is writing it or the cache
        cannot be written (read-only, full): the shard is then read as it is."""
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            lock = open(path.with_name(path.name + LOCK_SUFFIX), "a+b")
        except OSError:
            return None
        try:
            fcntl.flock(lock.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            lock.close()
            return None
        if path.exists():  # written while we were deciding
            lock.close()
            return None
        return EntryWriter(self, path, num_samples, lock)

    def entries(self) -> list[Path]:
        if not self.directory.is_dir():
            return []
        return [p for p in self.directory.iterdir() if p.name.endswith(SUFFIX)]

    def evict(self, added: int = 0) -> int:
        """Keep the entries under the limit after `added` bytes were written; returns the bytes
        freed. The directory is scanned (a stat per entry) only when the running total passes
        the limit or RESCAN_S after the last scan: scanning after every entry made filling a
        cache of n entries cost O(n^2) stats."""
        if self.limit is None:
            return 0
        now = time.monotonic()
        if self._bytes is not None:
            self._bytes += added
            if self._bytes <= self.limit and now - self._scanned_at < RESCAN_S:
                return 0
        remove_stale_temporaries(self.directory)
        freed, self._bytes = evict_lru_sized(self.entries(), self.limit, by_atime=True)
        self._scanned_at = now
        return freed


class EntryWriter:
    """Fill with add(keys, columns) in tar order, then finish() (or abort()). Each call writes
    its rows of every field with one `pwrite` (cheaper than faulting in the pages of a fresh
    memory map), so memory stays bounded whatever the shard's size."""

    def __init__(self, store: DecodedStore, path: Path, num_samples: int, lock: Any) -> None:
        self.store, self.path, self.n, self._lock = store, path, num_samples, lock
        self.tmp: Path | None = None
        self.count = 0
        self.keys: list[bytes] = []
        self._fields: list[dict[str, Any]] = []
        self._layout: dict[str, tuple[np.dtype, tuple[int, ...], Any]] = {}
        self._offsets: dict[str, int] = {}
        self._crc: dict[str, int] = {}  # running crc32 of each field's bytes, in file order
        self._fd: int | None = None
        self._heap = 0  # bytes of ragged pixels written after the fixed fields
        self._heap_crc = 0

    def _start(self, first: dict[str, Any]) -> None:
        self._layout = _layout(first)
        offset, fields = 0, []
        for name, (dtype, shape, kind) in self._layout.items():
            fields.append({"name": name, "dtype": dtype.str, "shape": list(shape),
                           "offset": offset, "scalar": kind is True,
                           "ragged": kind == "ragged"})
            self._offsets[name] = offset
            offset += -(-(self.n * dtype.itemsize * int(np.prod(shape))) // ALIGN) * ALIGN
        self._data_bytes, self._fields = offset, fields
        fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=f".{self.path.name}.",
                                   suffix=".tmp")  # the temp name the stale sweep knows
        self._fd, self.tmp = fd, Path(tmp)

    def add(self, keys: list[str], columns: dict[str, list[Any]]) -> None:
        """The next len(keys) samples (tar order), one list of decoded values per field.
        Raises Uncacheable when a field is missing, extra, or changes type or shape."""
        if self._fd is None:
            self._start({name: values[0] for name, values in columns.items()})
        if columns.keys() != self._layout.keys():
            raise Uncacheable(f"fields {sorted(columns)} differ from {sorted(self._layout)}")
        rows = []
        heap: list[np.ndarray] = []
        for name, (dtype, shape, kind) in self._layout.items():
            values = columns[name]
            if kind == "ragged":
                block = self._ragged(name, values, heap)
            elif kind:
                if any(_scalar_dtype(v) != dtype for v in values):
                    raise Uncacheable(f"field {name!r} changes type")
                block = np.array(values, dtype=dtype)
            else:
                if any(not isinstance(v, np.ndarray) or v.shape != shape or v.dtype != dtype
                       for v in values):
                    raise Uncacheable(f"field {name!r} changes shape or dtype")
                block = np.stack(values)
            rows.append((name, block))
        for pixels in heap:  # the ragged images' pixels, appended to the heap
            data = memoryview(pixels).cast("B")
            self._heap_crc = zlib.crc32(data, self._heap_crc)
            self._pwrite(data, self._data_bytes + self._heap)
            self._heap += len(data)
        first = self.count
        for name, block in rows:
            data = memoryview(np.ascontiguousarray(block)).cast("B")
            self._crc[name] = zlib.crc32(data, self._crc.get(name, 0))
            self._pwrite(data, self._offsets[name] + first * (data.nbytes // len(keys)))
        self.keys.extend(key.encode() for key in keys)
        self.count += len(keys)

    def _pwrite(self, data: memoryview, at: int) -> None:
        done = 0
        while done < len(data):
            done += os.pwrite(self._fd, data[done:], at + done)

    def _ragged(self, name: str, values: list[Any], heap: list[np.ndarray]) -> np.ndarray:
        """The table rows of a column of SourceImages; their pixels queued on `heap`."""
        rows = np.empty((len(values), RAGGED_ROW), dtype=np.int64)
        at = self._heap + sum(p.nbytes for p in heap)
        for i, value in enumerate(values):
            if not isinstance(value, SourceImage) or value.pixels.dtype != np.uint8 \
                    or value.pixels.ndim != 3:
                raise Uncacheable(f"field {name!r} changes type")
            pixels = np.ascontiguousarray(value.pixels)
            rows[i] = (at, *pixels.shape, value.height, value.width)
            heap.append(pixels)
            at += pixels.nbytes
        return rows

    def finish(self) -> CachedShard | None:
        """Publish the entry (temp file, fsync, rename); the entry opened for reading."""
        if self._fd is None or self.count != self.n:
            self.abort()
            return None
        try:
            ends = np.cumsum([len(k) for k in self.keys], dtype=np.int64)
            blob = b"".join(self.keys)
            ends_bytes = ends.tobytes()
            keys_at = self._data_bytes + self._heap
            footer = {"num_samples": self.n,
                      "fields": [{**f, "crc32": self._crc[f["name"]]} for f in self._fields],
                      "heap": {"offset": self._data_bytes, "bytes": self._heap,
                               "crc32": self._heap_crc},
                      "keys": {"offset": keys_at, "bytes": len(blob),
                               "ends_offset": keys_at + len(blob),
                               "crc32": zlib.crc32(ends_bytes, zlib.crc32(blob))}}
            text = json.dumps(footer).encode()
            tail = blob + ends_bytes + text + len(text).to_bytes(8, "little") + MAGIC
            with os.fdopen(self._fd, "r+b") as f:
                self._fd = None
                f.seek(keys_at)
                f.write(tail)
            publish(self.tmp, self.path)
            # the checksums were taken of the very bytes written
            self.store.verified(os.stat(self.path))
        except OSError:
            self.abort()
            return None
        finally:
            self._lock.close()
        self.store.evict(self._data_bytes + self._heap + len(tail))  # the entry's size
        return self.store.open(self.path)

    def abort(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        if self.tmp is not None:
            _unlink(self.tmp)
        self._lock.close()


class CachedShard:
    """An entry opened for reading: `arrays[field]` (N, ...) views and `keys`."""

    def __init__(self, f: Any, url: str = "") -> None:
        self._file = f
        self.url = url  # the shard's, for messages
        size = os.fstat(f.fileno()).st_size
        if size < 16:
            raise ValueError("entry too short")
        self._mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        mm = self._mm
        if mm[size - 8:] != MAGIC:
            raise ValueError("not a decoded-cache entry")
        length = int.from_bytes(mm[size - 16:size - 8], "little")
        footer = self._footer = json.loads(mm[size - 16 - length:size - 16])
        n = self.num_samples = int(footer["num_samples"])
        self.arrays: dict[str, np.ndarray] = {}  # fixed-shape fields
        self.ragged: dict[str, np.ndarray] = {}  # ragged image fields: their tables
        self.scalars: set[str] = set()
        for field in footer["fields"]:
            dtype, shape = np.dtype(field["dtype"]), tuple(field["shape"])
            array = np.frombuffer(mm, dtype, n * int(np.prod(shape)),
                                  field["offset"]).reshape((n, *shape))
            (self.ragged if field.get("ragged") else self.arrays)[field["name"]] = array
            if field["scalar"]:
                self.scalars.add(field["name"])
        heap = footer["heap"]
        self.heap = np.frombuffer(mm, np.uint8, heap["bytes"], heap["offset"])
        keys = footer["keys"]
        blob = mm[keys["offset"]:keys["offset"] + keys["bytes"]]
        ends = np.frombuffer(mm, np.int64, n, keys["ends_offset"]).tolist()
        self.keys = [blob[a:b].decode() for a, b in zip([0, *ends[:-1]], ends, strict=True)]
        # field -> (dtype, sample shape): entries with equal layouts gather into one batch
        self.layout = {name: (a.dtype.str, a.shape[1:]) for name, a in self.arrays.items()}
        self.layout.update({name: ("ragged",) for name in self.ragged})

    def verify(self) -> None:
        """Raises ValueError naming what differs from what was written."""
        for field in self._footer["fields"]:
            array = (self.ragged if field.get("ragged") else self.arrays)[field["name"]]
            if zlib.crc32(memoryview(array).cast("B")) != field["crc32"]:
                raise ValueError(f"field {field['name']!r} changed since it was written "
                                 "(checksum)")
        if zlib.crc32(memoryview(self.heap).cast("B")) != self._footer["heap"]["crc32"]:
            raise ValueError("the ragged images changed since they were written (checksum)")
        keys = self._footer["keys"]
        n = self.num_samples
        region = self._mm[keys["offset"]:keys["ends_offset"] + 8 * n]
        if zlib.crc32(region) != keys["crc32"]:
            raise ValueError("the keys changed since they were written (checksum)")

    def sample(self, position: int) -> dict[str, Any]:
        """One decoded sample (copies, as the decoder would return: numbers as Python ones;
        a ragged image as a SourceImage viewing the entry)."""
        sample = {name: (array[position].item() if name in self.scalars
                         else np.array(array[position]))
                  for name, array in self.arrays.items()}
        sample.update({name: self.source_image(name, position) for name in self.ragged})
        return sample

    def source_image(self, name: str, position: int) -> SourceImage:
        at, h, w, c, height, width = self.ragged[name][position].tolist()
        return SourceImage(self.heap[at:at + h * w * c].reshape(h, w, c), height, width)

    def close(self) -> None:
        self.arrays.clear()
        self.ragged.clear()
        self.heap = np.empty(0, np.uint8)
        try:
            self._mm.close()
        except BufferError:  # a batch still views it: the map closes when that is dropped
            pass
        self._file.close()


def _unlink(path: Path) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass

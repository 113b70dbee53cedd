"""Small filesystem helpers shared by every layer: atomic writes, hashing, sizes."""

from __future__ import annotations

import ctypes
import functools
import hashlib
import io
import os
import re
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import IO

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?i?b?)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12,
          "ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40}


def parse_size(text: str | int) -> int:
    """'256MB' -> 256_000_000, '1GiB' -> 2**30, 1000 -> 1000. Raises ValueError."""
    if isinstance(text, int):
        return text
    m = _SIZE.match(str(text))
    if not m:
        raise ValueError(f"not a size: {text!r} (examples: 1000, 64KB, 256MB, 1GiB)")
    unit = (m.group(2) or "").lower().rstrip("b")
    return int(float(m.group(1)) * _UNITS[unit])


def sha256_file(path: str | os.PathLike, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


# A file that is fsynced once complete (a shard, a downloaded shard) starts its write-back every
# WRITE_BEHIND bytes while it is written, so that the fsync waits for the last few MiB only
# (RocksDB's bytes_per_sync). `ringfeed shard --workers 2` of 300 MB on the 2-core box, median of
# 8 runs: 0.945 -> 0.834 s (benchmarks/README.md).
WRITE_BEHIND = 4 << 20
_SYNC_FILE_RANGE_WRITE = 2


@functools.cache
def _sync_file_range() -> Callable[[int, int, int, int], int] | None:
    try:
        fn = ctypes.CDLL(None, use_errno=True).sync_file_range  # Linux only
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    return fn


def start_writeback(fd: int, offset: int, length: int) -> bool:
    """Start writing these bytes of `fd` to the disk without waiting for them (Linux's
    sync_file_range, SYNC_FILE_RANGE_WRITE); False where that call does not exist. A hint:
    durability still needs the fsync."""
    fn = _sync_file_range()
    if fn is None:
        return False
    fn(fd, offset, length, _SYNC_FILE_RANGE_WRITE)
    return True


class HashingIO(io.RawIOBase):
    """Wraps a file being read or written: sha256 and byte count of what passes through.
    A raw stream: `io.BufferedWriter(HashingIO(f), 1 << 20)` gathers many small writes (512-byte
    tar headers) into few large ones, each hashed and written in one call."""

    def __init__(self, f: IO[bytes], write_behind: int = 0):
        super().__init__()
        self._f = f
        self.sha256 = hashlib.sha256()
        self.size = 0
        self._behind = write_behind  # > 0: start the write-back every so many bytes written
        self._handed = 0  # bytes whose write-back was started

    def readable(self) -> bool:
        return self._f.readable()

    def writable(self) -> bool:
        return self._f.writable()

    def _seen(self, data: bytes) -> bytes:
        self.sha256.update(data)
        self.size += len(data)
        return data

    def read(self, n: int = -1) -> bytes:
        return self._seen(self._f.read(n))

    def write(self, data: bytes) -> int:  # type: ignore[override]
        self._f.write(self._seen(data))
        if self._behind and self.size - self._handed >= self._behind:
            if not start_writeback(self._f.fileno(), self._handed, self.size - self._handed):
                self._behind = 0
            self._handed = self.size
        return len(data)

    def tell(self) -> int:
        """Bytes passed through: the position in a file wrapped at its start (tarfile asks)."""
        return self.size

    def flush(self) -> None:
        if not self._f.closed:  # also called when this wrapper is closed or collected
            self._f.flush()

    def drain(self, chunk: int = 1 << 20) -> None:
        """Read (and hash) the rest of the file."""
        while self.read(chunk):
            pass


@contextmanager
def atomic_open(path: str | os.PathLike, mode: str = "wb") -> Iterator[IO]:
    """Write to a temp file in the same directory, fsync, then rename over `path`.

    Readers see the old file or the complete new one, never a partial one; on an exception the
    temp file is removed and `path` is untouched.
    """
    with temp_open(path, mode) as (f, tmp):
        yield f
    publish(tmp, path)


@contextmanager
def temp_open(path: str | os.PathLike, mode: str = "wb") -> Iterator[tuple[IO, Path]]:
    """(file, temp path) of a new temp file beside `path`, closed and kept on success, removed on
    an exception; `publish(temp, path)` makes it `path` (possibly later, in another thread)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, mode) as f:
            yield f, Path(tmp)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def publish(tmp: str | os.PathLike, path: str | os.PathLike) -> None:
    """fsync a finished temp file, give it open()'s permissions and rename it to `path`
    (durable: the directory is fsynced too). The temp file is removed if this fails."""
    path = Path(path)
    try:
        fsync_path(tmp)
        os.chmod(tmp, 0o666 & ~_umask())  # mkstemp makes it private (0600); as open() would
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)


def _umask() -> int:
    # os.umask can only be read by setting it; /proc avoids that race where it exists
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    with atomic_open(path, "wb") as f:
        f.write(data)


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    atomic_write_bytes(path, text.encode())


def fsync_path(path: str | os.PathLike) -> None:
    """fsync a file or directory by name (a file's dirty pages, whichever descriptor wrote
    them)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir(directory: Path) -> None:
    with suppress(OSError):  # best effort: some filesystems refuse fsync on directories
        fsync_path(directory)

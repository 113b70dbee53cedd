"""Local shard cache: remote shards are downloaded once (fsspec), checked, reused, evicted LRU.

Safe for many processes (ranks, loader workers) sharing one `cache_dir`:
  * a download goes to a temp file, is checked against the manifest's sha256 when it has one,
    and is renamed into place atomically; a per-entry lock file makes concurrent fetchers of the
    same shard wait for one download instead of repeating it;
  * a reader holds a shared `flock` on the cached file from the moment it is fetched (prefetch
    included) until it is closed; eviction takes a non-blocking exclusive lock and skips files
    it cannot lock, so a shard in use is never evicted (the limit can be exceeded while every
    cached shard is in use);
  * recency is the file's mtime, refreshed on every use, so LRU order is shared by processes.
Local shards (plain paths, file://) are read in place, never copied.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import fsspec

from ringfeed.fsutil import HashingIO, atomic_open
from ringfeed.pipeline.background import BackgroundIterator
from ringfeed.pipeline.errors import PipelineDataError
from ringfeed.pipeline.source import ShardRef, local_path

LOCK_SUFFIX = ".lock"
PART_SUFFIX = ".tmp"  # atomic_open's temp files: .<name>.<random>.tmp
# tarfile reads its stream in 10 KiB pieces; a large buffer turns those into memory copies
# instead of one read() system call each.
READ_BUFFER = 1 << 20


def default_cache_dir() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "ringfeed", "shards")


@dataclass
class ShardHandle:
    """An open, locked, local copy of a shard. Close it when done reading."""

    ref: ShardRef
    file: IO[bytes]
    cache_hit: bool | None  # None: a local shard, read in place
    downloaded: int = 0

    def close(self) -> None:
        self.file.close()  # releases the shared lock


class ShardCache:
    def __init__(self, cache_dir: str | None = None, cache_limit: int | None = None,
                 storage_options: dict[str, Any] | None = None, retries: int = 3,
                 backoff_s: float = 0.5, lock_timeout_s: float = 600.0) -> None:
        self.cache_dir = Path(cache_dir or default_cache_dir())
        self.cache_limit = cache_limit
        self.storage_options = dict(storage_options or {})
        self.retries = max(1, retries)
        self.backoff_s = backoff_s
        self.lock_timeout_s = lock_timeout_s

    # -- public -------------------------------------------------------------------------
    def open(self, ref: ShardRef) -> ShardHandle:
        """A locked local file for `ref`, downloading it first when it is remote and not cached.

        Retries (with backoff) a failed download, a checksum mismatch or a missing file, then
        raises PipelineDataError naming the URL and the last problem.
        """
        last: Exception | None = None
        for attempt in range(self.retries):
            if attempt:
                time.sleep(self.backoff_s * 2 ** (attempt - 1))
            try:
                if ref.is_local:
                    return ShardHandle(ref, open(local_path(ref.url), "rb", buffering=READ_BUFFER),
                                       cache_hit=None)
                return self._open_cached(ref)
            except _ChecksumMismatch as e:
                last = e
            except OSError as e:  # missing file, connection refused, HTTP errors (fsspec)
                last = e
        what = "checksum mismatch" if isinstance(last, _ChecksumMismatch) else "cannot read shard"
        raise PipelineDataError(
            f"{ref.url}: {what} after {self.retries} attempts ({_describe(last)})")

    def entry_path(self, ref: ShardRef) -> Path:
        digest = hashlib.sha1(ref.url.encode()).hexdigest()[:16]
        name = ref.url.rstrip("/").rsplit("/", 1)[-1] or "shard"
        return self.cache_dir / f"{digest}-{name[:80]}"

    def entries(self) -> list[Path]:
        if not self.cache_dir.is_dir():
            return []
        return [p for p in self.cache_dir.iterdir()
                if not p.name.startswith(".") and not p.name.endswith(LOCK_SUFFIX)
                and not p.is_dir()]  # index/ and decoded/ keep their own entries

    def evict(self) -> int:
        """Remove least-recently-used unlocked entries until the cache fits; returns bytes freed."""
        if self.cache_limit is None:
            return 0
        remove_stale_temporaries(self.cache_dir)
        return evict_lru(self.entries(), self.cache_limit)

    # -- internals ----------------------------------------------------------------------
    def _open_cached(self, ref: ShardRef) -> ShardHandle:
        path = self.entry_path(ref)
        handle = self._open_entry(ref, path, hit=True)
        if handle is not None:
            return handle
        self.cache_dir.mkdir(parents=True, exist_ok=True)
        with _exclusive(path.with_name(path.name + LOCK_SUFFIX), self.lock_timeout_s):
            handle = self._open_entry(ref, path, hit=True)  # another process fetched it
            if handle is not None:
                return handle
            size = self._download(ref, path)
            handle = self._open_entry(ref, path, hit=False)
        if handle is None:
            raise OSError(f"{path}: vanished right after download")
        handle.downloaded = size
        self.evict()
        return handle

    def _open_entry(self, ref: ShardRef, path: Path, hit: bool) -> ShardHandle | None:
        try:
            f = open(path, "rb", buffering=READ_BUFFER)
        except FileNotFoundError:
            return None
        fcntl.flock(f.fileno(), fcntl.LOCK_SH)
        st = os.fstat(f.fileno())
        if st.st_nlink == 0:  # evicted between open and lock
            f.close()
            return None
        if ref.bytes is not None and st.st_size != ref.bytes:
            f.close()  # a damaged entry: drop it and fetch again
            _remove_if_unused(path)
            return None
        os.utime(path)  # LRU recency
        return ShardHandle(ref, f, cache_hit=hit)

    def _download(self, ref: ShardRef, path: Path) -> int:
        """Stream the shard into a temp file (hashing as it goes) and rename it into place;
        on any error the temp file is removed and `path` untouched."""
        with atomic_open(path) as f, self._remote(ref) as src:
            out = HashingIO(f)
            shutil.copyfileobj(src, out, 1 << 20)
            digest = out.sha256.hexdigest()
            if ref.sha256 is not None and digest != ref.sha256:
                raise _ChecksumMismatch(f"expected sha256 {ref.sha256[:12]}..., "
                                        f"got {digest[:12]}...")
        return out.size

    def _remote(self, ref: ShardRef) -> IO[bytes]:
        if ref.url.startswith("pipe:"):
            from webdataset.gopen import gopen

            return gopen(ref.url, "rb")
        fs, rpath = fsspec.core.url_to_fs(ref.url, **self.storage_options)
        # plain HTTP servers may not do range requests: read http(s) as one stream
        options = {"block_size": 0} if "http" in fs.protocol else {}
        return fs.open(rpath, "rb", **options)


class Prefetcher:
    """Opens the shards a stream will read, up to `depth` ahead, in a background thread (only
    when some are remote: local shards open instantly).

    Handles come back in order; errors surface at the position they belong to; handles fetched
    but never consumed are closed on `close()`.
    """

    def __init__(self, cache: ShardCache, refs: Iterable[ShardRef], depth: int,
                 remote: bool) -> None:
        """`refs` may be lazy (it is read in order, as far ahead as `depth`); `remote`: whether
        any of them is (only then is there a thread)."""
        opened = (cache.open(ref) for ref in refs)
        self._background: BackgroundIterator | None = None
        if depth > 0 and remote:
            self._background = BackgroundIterator(opened, depth, "ringfeed-prefetch",
                                                  discard=ShardHandle.close)
        self._items: Iterator[ShardHandle] = self._background or opened

    def __iter__(self) -> Iterator[ShardHandle]:
        return self._items

    def close(self) -> None:
        """Stop fetching and close what was fetched ahead. Does not wait for a download in
        progress: the thread closes that handle itself when it sees the stop."""
        if self._background is not None:
            self._background.close()


class _ChecksumMismatch(Exception):
    pass


def _describe(e: Exception | None) -> str:
    text = str(e) or type(e).__name__
    return text.splitlines()[0][:300]


def remove_stale_temporaries(directory: Path, age_s: float = 24 * 3600) -> None:
    """Temp files left by a process that died mid-write (a live one renews its file)."""
    now = time.time()
    for p in directory.glob(f".*{PART_SUFFIX}"):
        try:
            if now - p.stat().st_mtime > age_s:
                p.unlink()
        except FileNotFoundError:
            pass


def evict_lru(entries: list[Path], limit: int) -> int:
    """Remove least-recently-used (mtime) entries no reader holds until their total fits
    `limit` bytes; returns the bytes freed."""
    return evict_lru_sized(entries, limit)[0]


def evict_lru_sized(entries: list[Path], limit: int, by_atime: bool = False
                    ) -> tuple[int, int]:
    """evict_lru, and the bytes the entries hold after it: (freed, left). `by_atime`: recency
    is the atime (for files whose mtime must say when their bytes last changed)."""
    stats = []
    for p in entries:
        try:
            st = p.stat()
        except FileNotFoundError:
            continue
        stats.append((st.st_atime if by_atime else st.st_mtime, st.st_size, p))
    total = sum(size for _, size, _ in stats)
    freed = 0
    for _, size, path in sorted(stats):
        if total <= limit:
            break
        if _remove_if_unused(path):
            total -= size
            freed += size
    return freed, total


def _remove_if_unused(path: Path) -> bool:
    try:
        f = open(path, "rb")
    except FileNotFoundError:
        return False
    with f:
        try:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False  # a reader holds it
        try:
            os.unlink(path)
        except FileNotFoundError:
            return False
    return True


class _exclusive:
    """An flock on a lock file, waiting at most `timeout_s` (a hung peer must not hang us)."""

    def __init__(self, path: Path, timeout_s: float) -> None:
        self.path, self.timeout_s = path, timeout_s

    def __enter__(self) -> None:
        self.f = open(self.path, "a+b")
        deadline = time.monotonic() + self.timeout_s
        while True:
            try:
                fcntl.flock(self.f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
                return
            except BlockingIOError:
                if time.monotonic() > deadline:
                    self.f.close()
                    raise OSError(f"{self.path}: another process held the download lock for "
                                  f"over {self.timeout_s:.0f}s") from None
                time.sleep(0.05)

    def __exit__(self, *exc) -> None:
        self.f.close()

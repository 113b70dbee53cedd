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

A compressed shard (`.tar.gz`, `.tgz`, `.tar.bz2`, `.tar.xz`; local or remote) opened with
`plain=True` is decompressed once into a plain tar entry of the cache (`<digest>-<name>.plain
.tar`, counted in `cache_limit` and evicted like a download; a remote shard's compressed download
is dropped once decompressed), which readers then index and read like any plain tar. The plain
tar is derived data: a record (`plain/<entry>.json`) holds the compressed shard's identity (its
manifest sha256, or path, size and mtime) and the plain tar's size and crc32; a process trusts
an entry only when the record names the same shard and the size matches, and checks the crc32
the first time it opens it. Anything else is decompressed again. A shard whose compressed data
is damaged gets no copy: its reader names the damage (serving the samples before it only when
the data was merely cut short).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import time
import zlib
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from ringfeed.formats.tarindex import COMPRESSED_SUFFIXES as COMPRESSED_SUFFIXES
from ringfeed.formats.tarindex import strip_compressed_suffix
from ringfeed.formats.tarread import CompressedDataError, decompress_tar
from ringfeed.fsutil import (
    atomic_write_text,
    publish,
    temp_open,
)
from ringfeed.pipeline.background import BackgroundIterator
from ringfeed.pipeline.download import ChecksumMismatch, download
from ringfeed.pipeline.errors import PipelineDataError
from ringfeed.pipeline.source import ShardRef, local_path
from ringfeed.remote import RetryCounts, RetryPolicy

log = logging.getLogger("ringfeed.pipeline")

# what webdataset reads as a compressed tar, by name (.zst included: it is refused by name
# rather than read as a plain tar): COMPRESSED_SUFFIXES, declared once in formats/tarindex.py
PLAIN_SUFFIX = ".plain.tar"  # a compressed shard's decompressed copy
PLAIN_RECORDS = "plain"  # <cache_dir>/plain/<entry>.json: what each copy was made from
LOCK_SUFFIX = ".lock"
PART_SUFFIX = ".tmp"  # atomic_open's temp files: .<name>.<random>.tmp
# tarfile reads its stream in 10 KiB pieces; a large buffer turns those into memory copies
# instead of one read() system call each.
READ_BUFFER = 1 << 20
DECOMPRESS_CHECK_CHUNK = 4 << 20  # reads of a plain copy's crc32 check


def is_compressed(url: str) -> bool:
    return url.endswith(COMPRESSED_SUFFIXES)


def shard_identity(ref: ShardRef, st: os.stat_result | None = None) -> str | None:
    """What names a shard's content for the caches built from it. A local shard is read in
    place and never re-hashed, so its path, size and mtime are part of it (a rewritten file is
    a new shard even if the manifest was not updated); a remote one is checked against the
    manifest's sha256 when it is downloaded, else known by its URL and listed size. None:
    unknown (nothing is cached for it)."""
    if ref.is_local:
        try:
            st = st or os.stat(local_path(ref.url))
        except OSError:
            return None
        path = os.path.realpath(local_path(ref.url))
        return f"{ref.sha256 or ''}|{path}|{st.st_size}|{st.st_mtime_ns}"
    if ref.sha256:
        return ref.sha256
    return f"{ref.url}|{ref.bytes}" if ref.bytes is not None else None


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
    # a compressed shard's plain copy: the identity of the shard it was decompressed from
    plain_of: str | None = None
    decompressed: int = 0  # plain bytes written by this open (0: the copy existed)
    # a compressed shard that cannot have a plain copy: what is wrong with its compressed data,
    # and whether the samples before the damage can be trusted (only when the data was cut
    # short: corrupt data may have gone wrong anywhere before its checksum failed)
    damage: str | None = None
    damage_after_samples: bool = False
    storage: RetryCounts | None = None  # what storage faults cost the download (remote only)

    def close(self) -> None:
        self.file.close()  # releases the shared lock


class ShardCache:
    def __init__(self, cache_dir: str | None = None, cache_limit: int | None = None,
                 storage_options: dict[str, Any] | None = None, retries: int = 3,
                 backoff_s: float = 0.5, lock_timeout_s: float = 600.0,
                 policy: RetryPolicy | None = None) -> None:
        """`retries`: attempts at a shard whose checksum does not match (or a local file that
        cannot be read); `policy`: how long storage faults are retried (ringfeed/remote.py)."""
        self.cache_dir = Path(cache_dir or default_cache_dir())
        self.cache_limit = cache_limit
        self.storage_options = dict(storage_options or {})
        self.retries = max(1, retries)
        self.backoff_s = backoff_s
        self.lock_timeout_s = lock_timeout_s
        self.policy = policy or RetryPolicy()
        self._checked: set[tuple[int, int, int]] = set()  # plain copies whose crc32 matched
        # shard identity -> why it cannot be decompressed, whether the data was just cut short
        self._undecompressable: dict[str, tuple[str, bool]] = {}
        self._not_copied: set[str] = set()  # shards whose copy the cache could not take

    def __getstate__(self) -> dict[str, Any]:  # loader workers check copies themselves
        return {**self.__dict__, "_checked": set(), "_undecompressable": {},
                "_not_copied": set()}

    # -- public -------------------------------------------------------------------------
    def open(self, ref: ShardRef, plain: bool = False) -> ShardHandle:
        """A locked local file for `ref`, downloading it first when it is remote and not cached.
        `plain`: for a compressed shard, its decompressed copy (`open_plain`) when it can have
        one, else the compressed file.

        Retries (with backoff) a failed download, a checksum mismatch or a missing file, then
        raises PipelineDataError naming the URL and the last problem.
        """
        if plain and is_compressed(ref.url):
            return self.open_plain(ref)
        return self._open(ref)

    def open_plain(self, ref: ShardRef) -> ShardHandle:
        """The plain tar decompressed from compressed shard `ref`, made now if there is no
        trustworthy one (see the module's docstring). The compressed file itself (with
        `plain_of` None) when its identity is unknown, its data is damaged (`damage` says how)
        or the cache cannot take the copy (no room, no permission: warned about once): a
        reader streams it."""
        identity = shard_identity(ref)
        if identity is None or identity in self._not_copied:
            return self._open(ref)
        if identity in self._undecompressable:
            handle = self._open(ref)
            handle.damage, handle.damage_after_samples = self._undecompressable[identity]
            return handle
        path = self.plain_path(ref)
        handle = self._open_plain_entry(ref, path, identity)
        if handle is not None:
            return handle
        try:
            return self._make_plain(ref, path, identity)
        except OSError as e:  # (a shard that cannot be read is a PipelineDataError)
            if not self._not_copied:
                log.warning("shard cache: cannot keep a decompressed copy of %s in %s (%s); "
                            "reading compressed shards as they are (slower)", ref.url,
                            self.cache_dir, e)
            self._not_copied.add(identity)
            return self._open(ref)

    def _make_plain(self, ref: ShardRef, path: Path, identity: str) -> ShardHandle:
        self.cache_dir.mkdir(parents=True, exist_ok=True)
        with _exclusive(path.with_name(path.name + LOCK_SUFFIX), self.lock_timeout_s):
            handle = self._open_plain_entry(ref, path, identity)  # another process made it
            if handle is not None:
                return handle
            source = self._open(ref)
            try:
                handle = self._decompress(source, path, identity)
            except CompressedDataError as e:  # the reader names the damage
                self._undecompressable[identity] = (str(e), e.cut_short)
                source.damage, source.damage_after_samples = str(e), e.cut_short
                source.file.seek(0)
                return source
            except BaseException:
                source.close()
                raise
        source.close()
        if not ref.is_local:  # the plain copy replaces the download
            _remove_if_unused(self.entry_path(ref))
        handle.cache_hit, handle.downloaded = source.cache_hit, source.downloaded
        handle.storage = source.storage
        self.evict()
        return handle

    def plain_path(self, ref: ShardRef) -> Path:
        """Where the plain copy of compressed shard `ref` goes."""
        entry = self.entry_path(ref)
        return entry.with_name(strip_compressed_suffix(entry.name) + PLAIN_SUFFIX)

    def record_path(self, plain: Path) -> Path:
        return self.cache_dir / PLAIN_RECORDS / (plain.name + ".json")

    def _open(self, ref: ShardRef) -> ShardHandle:
        """The shard, opened (a remote one downloaded first). Storage faults are retried under
        the retry policy (ringfeed/remote.py: StorageUnavailable when its budget is spent); a
        checksum mismatch or a missing local file is tried `retries` times; a missing or
        forbidden remote object is named at once."""
        counts = RetryCounts()
        last: Exception | None = None
        for attempt in range(self.retries):
            if attempt:
                time.sleep(self.backoff_s * 2 ** (attempt - 1))
            try:
                if ref.is_local:
                    return ShardHandle(ref, open(local_path(ref.url), "rb", buffering=READ_BUFFER),
                                       cache_hit=None)
                handle = self._open_cached(ref, counts)
                handle.storage = counts
                return handle
            except ChecksumMismatch as e:
                last = e
            except (FileNotFoundError, PermissionError) as e:
                last = e
                if not ref.is_local:  # the service answered: no such object, or no access
                    break
            except OSError as e:  # a local file that cannot be read (NFS hiccup, EIO)
                last = e
        what = "checksum mismatch" if isinstance(last, ChecksumMismatch) else "cannot read shard"
        tries = f"after {attempt + 1} attempt{'s' if attempt else ''}"
        raise PipelineDataError(f"{ref.url}: {what} {tries} ({_describe(last)})")

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
        freed = evict_lru(self.entries(), self.cache_limit)
        if freed:  # the records of plain copies evicted
            for record in (self.cache_dir / PLAIN_RECORDS).glob(f"*{PLAIN_SUFFIX}.json"):
                if not (self.cache_dir / record.name[: -len(".json")]).exists():
                    record.unlink(missing_ok=True)
        return freed

    # -- internals ----------------------------------------------------------------------
    def _open_cached(self, ref: ShardRef, counts: RetryCounts) -> ShardHandle:
        path = self.entry_path(ref)
        handle = self._open_entry(ref, path, hit=True)
        if handle is not None:
            return handle
        self.cache_dir.mkdir(parents=True, exist_ok=True)
        with _exclusive(path.with_name(path.name + LOCK_SUFFIX), self.lock_timeout_s):
            handle = self._open_entry(ref, path, hit=True)  # another process fetched it
            if handle is not None:
                return handle
            size = download(ref, path, self.storage_options, self.policy, counts)
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

    def _open_plain_entry(self, ref: ShardRef, path: Path, identity: str
                          ) -> ShardHandle | None:
        """The plain copy at `path`, locked, if its record says it was made from `identity`
        and it still is what was written (size always; crc32 once per process)."""
        try:
            record = json.loads(self.record_path(path).read_text())
            f = open(path, "rb", buffering=READ_BUFFER)
        except (OSError, ValueError):  # no copy or no record yet (or a damaged record)
            return None
        fcntl.flock(f.fileno(), fcntl.LOCK_SH)
        st = os.fstat(f.fileno())
        if (st.st_nlink == 0 or not isinstance(record, dict)
                or record.get("source") != identity or record.get("bytes") != st.st_size):
            f.close()  # evicted meanwhile, made from another version, or changed since
            return None
        key = (st.st_dev, st.st_ino, st.st_size)
        if key not in self._checked:
            crc = 0
            while chunk := f.read(DECOMPRESS_CHECK_CHUNK):
                crc = zlib.crc32(chunk, crc)
            f.seek(0)
            if crc != record.get("crc32"):
                f.close()
                log.warning("shard cache: %s (plain copy of %s) changed since it was written; "
                            "decompressing it again", path, ref.url)
                return None
            self._checked.add(key)
        os.utime(path)  # LRU recency
        return ShardHandle(ref, f, cache_hit=True, plain_of=identity)

    def _decompress(self, source: ShardHandle, path: Path, identity: str) -> ShardHandle:
        """Decompress `source` into a temp file, lock it for reading, record what it is, then
        rename it to `path` (locked before it has its name, so no eviction can take it before
        it is read; a reader that sees the new record beside an old file finds the size or
        crc32 differ and waits for this lock). Returns the locked handle."""
        with temp_open(path) as (out, tmp):
            size, crc = decompress_tar(source.file, out)
        f = None
        try:
            f = open(tmp, "rb", buffering=READ_BUFFER)
            fcntl.flock(f.fileno(), fcntl.LOCK_SH)
            atomic_write_text(self.record_path(path), json.dumps(
                {"source": identity, "url": source.ref.url, "bytes": size, "crc32": crc}))
            publish(tmp, path)
        except BaseException:
            if f is not None:
                f.close()
            tmp.unlink(missing_ok=True)
            raise
        st = os.fstat(f.fileno())
        self._checked.add((st.st_dev, st.st_ino, st.st_size))
        return ShardHandle(source.ref, f, cache_hit=False, plain_of=identity, decompressed=size)

class Prefetcher:
    """Opens the shards a stream will read, up to `depth` ahead, in a background thread (only
    when some are remote: local shards open instantly).

    Handles come back in order; errors surface at the position they belong to; handles fetched
    but never consumed are closed on `close()`.
    """

    def __init__(self, cache: ShardCache, refs: Iterable[ShardRef], depth: int,
                 remote: bool, plain: bool = False,
                 also: Callable[[ShardRef], object] | None = None) -> None:
        """`refs` may be lazy (it is read in order, as far ahead as `depth`); `remote`: whether
        any of them is (only then is there a thread); `plain`: compressed shards as their plain
        copies (`ShardCache.open`); `also`: what else to fetch for each shard once it is open
        (its tar index sidecar), in the same thread."""

        def fetch(ref: ShardRef) -> ShardHandle:
            handle = cache.open(ref, plain=plain)
            if also is not None:
                try:
                    also(ref)
                except BaseException:
                    handle.close()
                    raise
            return handle

        opened = (fetch(ref) for ref in refs)
        self._background: BackgroundIterator | None = None
        if depth > 0 and remote:
            self._background = BackgroundIterator(opened, depth, "ringfeed-prefetch",
                                                  discard=ShardHandle.close)
        self._items: Iterator[ShardHandle] = self._background or opened

    def __iter__(self) -> Iterator[ShardHandle]:
        return self._items

    def ready(self) -> bool:
        """Whether the next handle is here (local shards open on demand: always)."""
        return self._background is None or self._background.ready()

    def close(self) -> None:
        """Stop fetching and close what was fetched ahead. Does not wait for a download in
        progress: the thread closes that handle itself when it sees the stop."""
        if self._background is not None:
            self._background.close()


def _describe(e: Exception | None) -> str:
    """Why a shard could not be read, in a few words (fsspec's not-found errors carry only the
    URL, which the message names already)."""
    if isinstance(e, FileNotFoundError):
        return "no such file or object: check the URL and the manifest's location"
    if isinstance(e, PermissionError):
        return f"access denied ({str(e).splitlines()[0][:200] if str(e) else 'permission'})"
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

"""Random access to the samples of one open (local or cached) shard.

`open_samples(handle, ...)` gives a `ShardSamples` whose `get(position)` returns the raw sample
(`{"__key__": key, ext: bytes}`, what webdataset's tar iterator yields) or a `BadSample`:

- `IndexedSamples`: the shard's tar index (every member's data offset and size, see
  tarindex.py) turns a sample into one `pread` of its members' span, with no tar parsing; a
  sample in the middle of a shard is read without touching the ones before it. The index comes
  from the sidecar `ringfeed shard` wrote beside the shard, else from the index cache, else it
  is built from the tar once and kept in the cache (`<cache_dir>/index/`). Before use it is
  checked against the file (every member inside the file, behind a valid tar header of the
  indexed size): from the first sample that fails, the rest of the shard is bad, as with the
  tar iterator, and a stale index is rebuilt first. A compressed shard is read this way
  through its plain copy in the shard cache (`ShardCache.open(ref, plain=True)`), indexed like
  a plain tar without a sidecar; BadSamples still name the compressed shard's URL.
- `SequentialSamples`: webdataset's tar iterator, for what is not indexed (`indexed=False`, a
  compressed shard without a plain copy: its compressed data is damaged, or its identity is
  unknown). Samples wanted later are held until asked for (at most a shuffle buffer's worth).
"""

from __future__ import annotations

import functools
import hashlib
import io
import mmap
import os
import tarfile
from bisect import bisect_left
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from ringfeed.formats.tarread import header_cut
from ringfeed.formats.tokens import DOCS_MEMBER, TOKENS_MEMBER, TokenSpan
from ringfeed.fsutil import atomic_write_bytes
from ringfeed.pipeline.cache import COMPRESSED_SUFFIXES as COMPRESSED_SUFFIXES
from ringfeed.pipeline.cache import ShardHandle, is_compressed, shard_identity
from ringfeed.pipeline.decode import NPY_LOCK
from ringfeed.pipeline.source import ShardRef, Windows, is_local_url, local_path
from ringfeed.remote import RetryPolicy, StorageUnavailable, read_url, retrying

if TYPE_CHECKING:
    from ringfeed.formats.tarindex import TarIndex

# a sample's members up to this size are read in one pread and sliced; larger ones each get
# their own pread (slicing would copy megabytes a second time)
ONE_READ_BYTES = 64 << 10
RUN_READ_BYTES = 1 << 20  # consecutive small samples are read together, up to this much


@dataclass(frozen=True)
class BadSample:
    """A sample that could not be read or decoded; `key` is None when the tar lost it."""

    url: str
    position: int
    key: str | None
    reason: str

    def describe(self) -> str:
        where = f"sample {self.key!r}" if self.key else f"sample #{self.position}"
        return f"{self.url}: {where}: {self.reason}"


class ShardSamples(Protocol):
    bytes_read: int

    def get(self, position: int) -> dict[str, Any] | BadSample: ...

    def close(self) -> None: ...


# -- indexes -------------------------------------------------------------------------------
class IndexStore:
    """Where tar indexes come from: a shard's sidecar, the cache, or a build from the tar.
    What was checked is remembered per process (keyed by the file's device, inode, size and
    mtime), so reopening an unchanged shard every epoch costs no check and no reload."""

    MEMO = 256  # shards remembered

    def __init__(self, cache_dir: str | os.PathLike,
                 storage_options: dict[str, Any] | None = None,
                 policy: RetryPolicy | None = None) -> None:
        self.directory = Path(cache_dir) / "index"
        self.storage_options = dict(storage_options or {})
        self.policy = policy or RetryPolicy()
        self._memo: OrderedDict[tuple, tuple[TarIndex, int, str | None, list]] = OrderedDict()

    def __getstate__(self) -> dict[str, Any]:  # loader workers start with an empty memo
        return {**self.__dict__, "_memo": OrderedDict()}

    def opened(self, handle: ShardHandle) -> tuple[TarIndex, int, str | None, list]:
        """(index, intact samples, reason, sample spans) for an open shard, remembered."""
        st = os.fstat(handle.file.fileno())
        # (a plain copy's mtime is its recency in the cache: it changes every time it is
        # opened; the copy is rewritten only under a new inode)
        key = (handle.ref.url, handle.ref.num_samples, st.st_dev, st.st_ino, st.st_size,
               None if handle.plain_of else st.st_mtime_ns)
        hit = self._memo.get(key)
        if hit is None:
            index, intact, reason = self.index_for(handle)
            hit = (index, intact, reason, index.sample_spans())
            self._memo[key] = hit
            if len(self._memo) > self.MEMO:
                self._memo.popitem(last=False)
        else:
            self._memo.move_to_end(key)
        return hit

    def cached_path(self, handle: ShardHandle) -> Path:
        st = os.fstat(handle.file.fileno())
        if handle.plain_of:  # a compressed shard's plain copy: named by the shard it is of
            identity = f"plain|{handle.plain_of}|{st.st_size}"
        else:
            identity = shard_identity(handle.ref, st) or f"{handle.ref.url}|{st.st_size}"
        return self.directory / f"{hashlib.sha256(identity.encode()).hexdigest()[:32]}.idx"

    def index_for(self, handle: ShardHandle) -> tuple[TarIndex, int, str | None]:
        """(index, intact samples, reason the rest is unreadable or None)."""
        from ringfeed.formats.tarindex import build_index
        size = os.fstat(handle.file.fileno()).st_size
        cached = self.cached_path(handle)
        with _mapped(handle.file.fileno(), size) as buf:
            for candidate in (self.fetch_sidecar(handle.ref), cached):
                index = _load(candidate)
                if index is not None and _complete(index, handle):
                    intact = index.intact_samples(buf, size)
                    if intact == index.num_samples:
                        return index, intact, None
            handle.file.seek(0)
            index, reason = build_index(handle.file)
            intact = index.intact_samples(buf, size)
        check_listed_count(index, intact, reason, handle.ref)
        if reason is None and intact == index.num_samples and _complete(index, handle):
            try:
                index.save(cached)
            except OSError:  # a read-only cache only costs a rebuild next time
                pass
        return index, intact, reason

    def fetch_sidecar(self, ref: ShardRef) -> Path | None:
        """The shard's sidecar as a local file: in place, or fetched once into the index
        cache (a few bytes per member, against a tar scan of tens of microseconds each); the
        prefetcher fetches it with the shard, ahead of the read."""
        url = ref.index
        if not url:
            return None
        if is_local_url(url):
            return Path(local_path(url))
        path = self.directory / f"{hashlib.sha256(url.encode()).hexdigest()[:32]}.sidecar.idx"
        if not path.exists():
            try:
                data = retrying(lambda: read_url(url, self.storage_options), url,
                                "read tar index", self.policy)
                atomic_write_bytes(path, data)
            except StorageUnavailable:
                raise
            except Exception:  # missing or unreadable: build the index from the tar
                return None
        return path


def _load(path: Path | None) -> TarIndex | None:
    from ringfeed.formats.tarindex import TarIndex

    if path is None:
        return None
    try:
        return TarIndex.load(path)
    except (OSError, ValueError):
        return None


def check_listed_count(index: TarIndex, intact: int, reason: str | None, ref: ShardRef) -> None:
    """A whole shard (no damage) holding more samples than its manifest lists: the manifest is
    not this shard's (out of date, or the shard was replaced). Reading only the listed count
    would leave the rest out of training without a word, and the epoch is planned on the
    manifest's counts on every rank, so it stops the run (exit 2) naming both counts. (Fewer
    samples than listed is a damaged shard: the bad-sample policy meets the missing ones.)"""
    listed = ref.num_samples
    if reason is None and intact == index.num_samples and 0 < listed < index.num_samples:
        from ringfeed.pipeline.errors import PipelineDataError

        raise PipelineDataError(
            f"{ref.url}: holds {index.num_samples} samples (its tar index) but the "
            f"manifest.json that lists it says {listed}: the manifest is out of date (run "
            "`ringfeed shard` again, or `ringfeed verify` on the folder to list the shards "
            "that differ)")


def _complete(index: TarIndex, handle: ShardHandle) -> bool:
    """The index holds the samples the manifest lists (0: no manifest count to compare)."""
    expected = handle.ref.num_samples
    return expected == 0 or index.num_samples == expected


class _mapped:
    """The file memory-mapped for the index checks (an empty file maps to b"")."""

    def __init__(self, fd: int, size: int) -> None:
        self.fd, self.size = fd, size

    def __enter__(self) -> Any:
        self.mm = mmap.mmap(self.fd, 0, access=mmap.ACCESS_READ) if self.size else None
        return self.mm if self.mm is not None else b""

    def __exit__(self, *exc: object) -> None:
        if self.mm is not None:
            self.mm.close()


# -- access --------------------------------------------------------------------------------
def open_samples(handle: ShardHandle, indexes: IndexStore | None,
                 wanted: set[int] | None = None) -> ShardSamples:
    """Random access to `handle`'s samples: indexed when it can be (a plain tar, or the plain
    copy of a compressed one), else sequential (which holds the `wanted` positions read past
    until they are asked for). A flat token shard's samples are its windows (WindowReader),
    read indexed only."""
    if indexes is None or (is_compressed(handle.ref.url) and not handle.plain_of):
        if handle.ref.windows is not None:
            from ringfeed.pipeline.errors import PipelineDataError

            handle.close()
            raise PipelineDataError(f"{handle.ref.url}: the windows of a flat token shard are "
                                    "read through its tar index (compressed: unreadable)")
        return SequentialSamples(handle, wanted)
    samples = IndexedSamples(handle, *indexes.opened(handle))
    if handle.ref.windows is not None:
        samples.windows = window_reader(samples)
    return samples


class IndexedSamples:
    def __init__(self, handle: ShardHandle, index: TarIndex, intact: int,
                 reason: str | None, spans: list) -> None:
        self.handle, self.url = handle, handle.ref.url
        self._fd = handle.file.fileno()
        self.bytes_read = 0
        self.intact = intact
        self._spans = spans  # per sample: (start, end, [(field, lo, hi)])
        self._keys = index.keys
        expected = handle.ref.num_samples or index.num_samples
        if intact < expected:
            last = self._keys[intact - 1] if intact else None
            after = f" after sample {last!r}" if last else " at its start"
            if intact < index.num_samples:  # the header check stopped it (build_index did not)
                reason = f"corrupt or truncated tar{after} (a member header does not match)"
            elif reason is None:  # a complete tar with fewer samples than the manifest lists
                reason = (f"shard ends after {intact} samples{after}, the manifest lists "
                          f"{expected}")
            # else: build_index's own one-line reason, naming where the tar broke
        self._reason = reason
        self.windows: WindowReader | None = None  # a flat token shard's (open_samples)

    def get(self, position: int) -> dict[str, Any] | BadSample:
        if self.windows is not None:
            return self.windows.get(position)
        if position >= self.intact:
            return BadSample(self.url, position, None, self._reason or "no such sample")
        start, end, members = self._spans[position]
        sample: dict[str, Any] = {"__key__": self._keys[position]}
        if end - start <= ONE_READ_BYTES:  # small: one read of the span, sliced
            data = os.pread(self._fd, end - start, start)
            if len(data) == end - start:
                for field, lo, hi in members:
                    sample[field] = data[lo:hi]
                self.bytes_read += len(data)
                return sample
        else:  # large: each member read straight into its own bytes (no second copy)
            for field, lo, hi in members:
                data = os.pread(self._fd, hi - lo, start + lo)
                if len(data) != hi - lo:
                    break
                sample[field] = data
                self.bytes_read += hi - lo
            else:
                return sample
        return BadSample(self.url, position, self._keys[position],  # shrank since checked
                         "corrupt or truncated tar (the file is shorter than its index)")

    def get_many(self, positions: list[int]) -> list[dict[str, Any] | BadSample]:
        """get() of each position; consecutive small samples (manifest order, a resume) come
        from one pread of their joint span, sliced."""
        if self.windows is not None:
            return [self.windows.get(p) for p in positions]
        out: list[dict[str, Any] | BadSample] = []
        spans, keys, n, i = self._spans, self._keys, len(positions), 0
        while i < n:
            first = positions[i]
            j = i + 1
            if first < self.intact:
                start, end, _ = spans[first]
                while (j < n and positions[j] == positions[j - 1] + 1
                       and positions[j] < self.intact):
                    s, e, _ = spans[positions[j]]
                    if e - start > RUN_READ_BYTES or e - s > ONE_READ_BYTES:
                        break
                    end, j = e, j + 1
            if j == i + 1:
                out.append(self.get(first))
                i = j
                continue
            data = os.pread(self._fd, end - start, start)
            if len(data) != end - start:  # shrank since checked: let get() say so
                out.extend(self.get(p) for p in positions[i:j])
            else:
                self.bytes_read += len(data)
                for p in positions[i:j]:
                    s, _, members = spans[p]
                    base = s - start
                    sample: dict[str, Any] = {"__key__": keys[p]}
                    for field, lo, hi in members:
                        sample[field] = data[base + lo:base + hi]
                    out.append(sample)
            i = j
        return out

    def close(self) -> None:
        self.handle.close()


@dataclass
class WindowReader:
    """The windows of an indexed flat token shard (ringfeed/formats/tokens.py): window i is
    one pread of its tokens (from i (seq_len + 1), seq_len + 1 of them, or 2 seq_len + 1 with
    random windows: the decoder cuts the epoch's window), beside the document starts in them.
    `window_reader` reads the tokens' .npy header and the document offsets once per open."""

    samples: IndexedSamples
    windows: Windows
    key: str = ""  # the shard's one tar sample
    starts: np.ndarray | None = None  # int64 document starts in the shard
    dtype: np.dtype | None = None
    data: int = 0  # file offset of the first token
    bad: str | None = None  # why no window reads

    @functools.cached_property
    def count(self) -> int:
        return self.windows.count

    @functools.cached_property
    def start_list(self) -> list[int]:  # (bisect on a list: a window's lookup in 1 us, not 5)
        return [] if self.starts is None else self.starts.tolist()

    def get(self, position: int) -> dict[str, Any] | BadSample:
        samples, w = self.samples, self.windows
        if self.bad is not None or position >= self.count or self.starts is None \
                or self.dtype is None:
            return BadSample(samples.url, position, None, self.bad or "no such window")
        first = position * (w.seq_len + 1)
        n = min(2 * w.seq_len + 1 if w.random else w.seq_len + 1, w.tokens - first)
        size = self.dtype.itemsize
        data = os.pread(samples._fd, n * size, self.data + first * size)
        samples.bytes_read += len(data)
        if len(data) != n * size:
            return BadSample(samples.url, position, self.key,
                             "corrupt or truncated tar (the file is shorter than its index)")
        starts = self.start_list
        inside = [s - first for s in starts[bisect_left(starts, first):bisect_left(starts,
                                                                                   first + n)]]
        span = TokenSpan(np.frombuffer(data, self.dtype), inside, w.seq_len, w.random, self.key)
        return {"__key__": f"{self.key}/{position}", TOKENS_MEMBER: span}


def window_reader(samples: IndexedSamples) -> WindowReader:
    """The reader of an indexed flat token shard's windows: its members located through the
    tar index, the document offsets and the tokens' .npy header read."""
    windows = samples.handle.ref.windows
    assert windows is not None
    members = {}
    if samples.intact:
        start, _, spans = samples._spans[0]
        members = {field: (start + lo, start + hi) for field, lo, hi in spans}
    if TOKENS_MEMBER not in members or DOCS_MEMBER not in members:
        return WindowReader(samples, windows, bad=samples._reason or (
            f"not a flat token shard (no {TOKENS_MEMBER} and {DOCS_MEMBER})"))
    fd = samples._fd
    lo, hi = members[DOCS_MEMBER]
    docs = os.pread(fd, hi - lo, lo)
    lo, hi = members[TOKENS_MEMBER]
    head = io.BytesIO(os.pread(fd, min(hi - lo, 4096), lo))
    with NPY_LOCK:  # (numpy parses both headers with ast)
        starts = np.load(io.BytesIO(docs)).astype(np.int64)
        version = np.lib.format.read_magic(head)
        read = np.lib.format.read_array_header_1_0 if version == (1, 0) else \
            np.lib.format.read_array_header_2_0
        shape, _, dtype = read(head)
    samples.bytes_read += len(docs) + head.tell()
    bad = None if shape == (windows.tokens,) else (
        f"{TOKENS_MEMBER} holds {shape} tokens, the manifest says ({windows.tokens},): the "
        "manifest is out of date")
    return WindowReader(samples, windows, samples._keys[0], starts, dtype, lo + head.tell(), bad)


class SequentialSamples:
    def __init__(self, handle: ShardHandle, wanted: set[int] | None) -> None:
        self.handle, self.url = handle, handle.ref.url
        self.wanted = wanted
        self.bytes_read = 0
        self._samples = _positions(handle)
        self._held: dict[int, dict[str, Any] | BadSample] = {}

    def get(self, position: int) -> dict[str, Any] | BadSample:
        while position not in self._held:
            try:
                got, sample = next(self._samples)
            except StopIteration:
                return BadSample(self.url, position, None, "no such sample")
            if self.wanted is None or got in self.wanted or got == position:
                self._held[got] = sample
        self.bytes_read = self.handle.file.tell()
        return self._held.pop(position)

    def close(self) -> None:
        self._samples.close()
        self.handle.close()


def iter_samples(handle: ShardHandle) -> Iterator[dict[str, Any]]:
    """Every sample of the shard in tar order (raw bytes per extension, plus __key__). A plain
    tar cut inside a member header raises tarfile.ReadError after its whole samples: the tar
    iterator would end there as at the archive's end. The last sample is held until the end is
    checked (the cut header may be one of its members)."""
    # Imported here: webdataset imports torch when it is installed, and `import pipeline`
    # must stay free of torch/TF for TensorFlow-only users.
    from webdataset.handlers import reraise_exception
    from webdataset.tariterators import group_by_keys, tar_file_expander

    files = tar_file_expander([{"url": handle.ref.url, "stream": handle.file}],
                              handler=reraise_exception)
    held = None
    for sample in group_by_keys(files, handler=reraise_exception):
        if held is not None:
            yield held
        held = sample
    if not is_compressed(handle.ref.url) or handle.plain_of:
        problem = header_cut(os.fstat(handle.file.fileno()).st_size)
        if problem:
            raise tarfile.ReadError(problem)
    if held is not None:
        yield held


def _positions(handle: ShardHandle) -> Iterator[tuple[int, dict[str, Any] | BadSample]]:
    """(position, sample) in tar order; after a corrupt or truncated end, BadSamples forever.
    A compressed shard that could not be decompressed (`handle.damage`) is all BadSamples when
    its data is corrupt (garbage may have been read anywhere before the checksum failed), and
    read up to where the tar stops when its data was merely cut short; the reason is what
    decompressing it found (the tar's own error says less: tarfile checks no crc)."""
    url, position, last_key = handle.ref.url, -1, None
    if handle.damage and not handle.damage_after_samples:
        reason = _damaged(handle.damage, None)
    else:
        try:
            for position, sample in enumerate(iter_samples(handle)):
                yield position, sample
                last_key = sample["__key__"]
            after = f" after {last_key!r}" if last_key else ""
            reason = (f"shard ends after {position + 1} samples{after}, "
                      f"the manifest lists {handle.ref.num_samples}")
        except Exception as e:  # tarfile.ReadError, EOFError, duplicate names, ...
            after = f" after sample {last_key!r}" if last_key else " at its start"
            reason = f"corrupt or truncated tar{after} ({_first_arg(e)})"
        if handle.damage:
            reason = _damaged(handle.damage, last_key)
    while True:
        position += 1
        yield position, BadSample(url, position, None, reason)


def _damaged(damage: str, last_key: str | None) -> str:
    after = f" after sample {last_key!r}" if last_key else " at its start"
    return f"unreadable compressed shard{after}: {damage} (re-download or re-create the file)"


def _first_arg(e: Exception) -> str:
    text = str(e.args[0]) if e.args else type(e).__name__
    return f"{type(e).__name__}: {text.split(' @ ')[0]}"

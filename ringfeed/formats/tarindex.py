"""Tar indexes: every sample's key and every member's field, data offset and size, so a reader
slices a sample out of a memory map (or one `pread`) with no tar parsing, from any position.

Samples are exactly the ones webdataset 1.0.2's tar iterator yields (`tar_file_iterator` +
`group_by_keys`, `lcase=True`), in the same order:
- only regular members are read; `__name__`-style meta files and names matching
  `__[^/]*__($|/)` are skipped; names without an extension (`base_plus_ext` gives no key) too;
- a member's key is the path up to the first '.' of its last component, its field the rest,
  lower-cased (`dir/Key.Tokens.NPY` -> key `dir/Key`, field `tokens.npy`);
- a new sample starts whenever the key differs from the previous member's (keys that come back
  later make another sample, as in webdataset);
- a field seen twice in one sample (or a field named `__key__`/`__url__`) is the duplicate-member
  ValueError: that sample and everything after it are lost;
- a sample whose `__bad__` member is not empty is dropped (webdataset's `valid_sample`);
- a tar that ends badly loses its last, unfinished sample, as the iterator does: a sample is
  kept once a member of the next sample was read whole, or when the tar ended cleanly, or
  stopped at a header tarfile cannot read (tarfile treats that as the end of the archive).

On disk (`to_bytes`, `save`; `<shard>.idx` beside a shard written by `ringfeed shard`), version 1:

    b"ringfeed-tarindex\\n", u32 version, u32 n       little-endian
    n bytes of JSON: {"fields": [...], "key_bytes": K, "num_members": M, "num_samples": S}
    zero padding to a multiple of 8
    key_offsets int64[S+1], sample_start int64[S+1], member_offset int64[M],
    member_size int64[M], member_check uint64[M], member_field int32[M], key_blob (K bytes)
    u32 crc32 of everything before it

`member_check` is a 64-bit hash of the member's 512-byte tar header: `intact_samples` uses it
to tell an index of another shard (same sizes at the same offsets, other names) from this one's.
No pickles; anything else is a ValueError.

Pure: numpy and the standard library only (no torch, TensorFlow or webdataset).
"""

from __future__ import annotations

import hashlib
import json
import mmap
import os
import re
import struct
import tarfile
import zlib
from array import array
from dataclasses import dataclass, field
from typing import IO, Any

import numpy as np

from ringfeed.formats.tarblocks import BLOCK

MAGIC = b"ringfeed-tarindex\n"
VERSION = 1
_PREAMBLE = struct.Struct("<II")  # version, header length

# webdataset.tariterators: base_plus_ext's pattern, tar_file_iterator's skip_meta default
_BASE_PLUS_EXT = re.compile(r"^((?:.*/|)[^.]+)[.]([^/]*)$")
_SKIP_META = re.compile(r"__[^/]*__($|/)")
_ALWAYS_IN_SAMPLE = ("__key__", "__url__")  # group_by_keys starts every sample with these

_CHUNK = 4096  # members checked per vectorised step (bounds the gathered header copies)
# multipliers of the header hash: 64 odd 64-bit constants, one per 8-byte word of a header
_HASH_MULT = np.frombuffer(hashlib.shake_256(b"ringfeed tar index v1").digest(BLOCK), "<u8") | 1
_SPACES = np.array(sorted(b" \t\n\r\x0b\x0c\x1c\x1d\x1e\x1f"), np.uint8)  # what str.strip strips
_SEP_ALIGN = 8


def base_plus_ext(name: str) -> tuple[str | None, str | None]:
    """webdataset's split of a member name into (key, extensions); (None, None) if it has none."""
    m = _BASE_PLUS_EXT.match(name)
    return (m.group(1), m.group(2)) if m else (None, None)


def webdataset_reads(name: str) -> bool:
    """Whether webdataset's tar iterator hands this regular member on (meta files are skipped)."""
    if "/" not in name and name.startswith("__") and name.endswith("__"):
        return False
    return _SKIP_META.match(name) is None


@dataclass(frozen=True, eq=False, repr=False)
class TarIndex:
    """The samples of one tar, in tar order. Arrays are read-only; build with `build_index`,
    `TarIndexBuilder` or `from_bytes`/`load`.

    key_blob      the keys, utf-8 (lone surrogates of odd names kept, 'surrogatepass'), joined
    key_offsets   int64[S+1]: key i is key_blob[key_offsets[i]:key_offsets[i+1]]
    sample_start  int64[S+1]: sample i is members sample_start[i]:sample_start[i+1] (>= 1 each)
    fields        field names (lower-cased extensions), indexed by member_field
    member_field  int32[M], member_offset int64[M] (where the data starts), member_size int64[M]
    member_check  uint64[M]: hash of the 512-byte header block just before the member's data
    """

    key_blob: bytes
    key_offsets: np.ndarray
    sample_start: np.ndarray
    fields: tuple[str, ...]
    member_field: np.ndarray
    member_offset: np.ndarray
    member_size: np.ndarray
    member_check: np.ndarray
    _cache: dict[str, Any] = field(default_factory=dict, init=False, compare=False)

    def __post_init__(self) -> None:
        for name, dtype in (("key_offsets", np.int64), ("sample_start", np.int64),
                            ("member_field", np.int32), ("member_offset", np.int64),
                            ("member_size", np.int64), ("member_check", np.uint64)):
            a = np.asarray(getattr(self, name))
            if a.flags.writeable or a.dtype != dtype or a.ndim != 1:
                a = np.array(a, dtype=dtype).reshape(-1)  # our own copy, made read-only
                a.setflags(write=False)
            object.__setattr__(self, name, a)
        object.__setattr__(self, "fields", tuple(self.fields))
        object.__setattr__(self, "key_blob", bytes(self.key_blob))

    # -- sizes and keys --------------------------------------------------------------------
    @property
    def num_samples(self) -> int:
        return len(self.sample_start) - 1

    @property
    def num_members(self) -> int:
        return len(self.member_offset)

    def key(self, i: int) -> str:
        """The key of sample i (0 <= i < num_samples)."""
        if not 0 <= i < self.num_samples:
            raise IndexError(f"sample {i} of {self.num_samples}")
        lo, hi = self.key_offsets[i:i + 2].tolist()
        return self.key_blob[lo:hi].decode("utf-8", "surrogatepass")

    @property
    def keys(self) -> list[str]:
        """Every sample's key, in tar order (a list made once and kept: do not modify it)."""
        keys = self._cache.get("keys")
        if keys is None:
            blob, offs = self.key_blob, self.key_offsets.tolist()
            pairs = zip(offs[:-1], offs[1:], strict=True)
            if blob.isascii():
                text = blob.decode("ascii")
                keys = [text[a:b] for a, b in pairs]
            else:
                keys = [blob[a:b].decode("utf-8", "surrogatepass") for a, b in pairs]
            self._cache["keys"] = keys
        return keys

    # -- reading samples -------------------------------------------------------------------
    def _hot(self) -> tuple[list[str], list[int], list[str], list[int], list[int]]:
        hot = self._cache.get("hot")
        if hot is None:
            fields = self.fields
            names = [fields[j] for j in self.member_field.tolist()]
            start = self.member_offset
            hot = (self.keys, self.sample_start.tolist(), names, start.tolist(),
                   (start + self.member_size).tolist())
            self._cache["hot"] = hot
        return hot

    def sample(self, buf: Any, i: int) -> dict[str, Any]:
        """Sample i as webdataset's iterator yields it, less `__url__`: `{"__key__": key,
        field: bytes, ...}`, fields in tar order. `buf` holds the whole tar (bytes, mmap,
        memoryview); the values are its slices (bytes for bytes and mmap). Check the sample
        against the file with `intact_samples` first."""
        keys, starts, names, lo, hi = self._hot()
        if not 0 <= i < len(keys):
            raise IndexError(f"sample {i} of {len(keys)}")
        sample: dict[str, Any] = {"__key__": keys[i]}
        for j in range(starts[i], starts[i + 1]):
            sample[names[j]] = buf[lo[j]:hi[j]]
        return sample

    def sample_span(self, i: int) -> tuple[int, int]:
        """(first byte, end) of sample i's member data in the tar: one read covers it."""
        if not 0 <= i < self.num_samples:
            raise IndexError(f"sample {i} of {self.num_samples}")
        a, b = self.sample_start[i:i + 2].tolist()
        return int(self.member_offset[a]), int(self.member_offset[b - 1] + self.member_size[b - 1])

    def sample_spans(self) -> list[tuple[int, int, list[tuple[str, int, int]]]]:
        """Per sample: (start, end, [(field, lo, hi), ...]) where data[start:end] read from the
        tar holds each member's bytes at data[lo:hi]. Made once and kept."""
        spans = self._cache.get("spans")
        if spans is None:
            _, starts, names, lo, hi = self._hot()
            spans = []
            for i in range(self.num_samples):
                a, b = starts[i], starts[i + 1]
                first, end = lo[a], hi[b - 1]
                spans.append((first, end, [(names[j], lo[j] - first, hi[j] - first)
                                           for j in range(a, b)]))
            self._cache["spans"] = spans
        return spans

    # -- checking against a file -----------------------------------------------------------
    def intact_samples(self, buf: Any, file_size: int) -> int:
        """How many leading samples can be sliced from `buf` (the whole tar: bytes, mmap, ...):
        every member's data lies inside the file, and the 512-byte block before it is a valid
        tar header (checksum as tarfile computes it) whose size field is the indexed size and
        whose hash is the indexed one. Counts up to the first sample with a member that fails
        (0 for an index of another tar, unless the two agree up to some point). Octal size
        fields only: a base-256 or pax-overridden size (members over 8 GB) counts as not intact.
        """
        size = min(int(file_size), len(buf))
        m = self.num_members
        if m == 0 or size < BLOCK:
            return 0
        data = np.frombuffer(buf, np.uint8, count=size - size % BLOCK).reshape(-1, BLOCK)
        first_bad = m
        try:
            for lo in range(0, m, _CHUNK):
                hi = min(m, lo + _CHUNK)
                off, sz = self.member_offset[lo:hi], self.member_size[lo:hi]
                ok = (off >= BLOCK) & (off % BLOCK == 0) & (off + sz <= size)
                blocks = data[np.where(ok, off // BLOCK - 1, 0)]  # a copy: `buf` is let go
                ok &= header_checks(blocks) == self.member_check[lo:hi]
                ok &= _valid_headers(blocks, sz)
                if not ok.all():
                    first_bad = lo + int(np.argmin(ok))
                    break
        finally:
            del data  # an mmap cannot be closed while an array exports its buffer
        return int(np.searchsorted(self.sample_start, first_bad, side="right")) - 1

    # -- serialisation ---------------------------------------------------------------------
    def to_bytes(self) -> bytes:
        head = json.dumps({"fields": list(self.fields), "key_bytes": len(self.key_blob),
                           "num_members": self.num_members, "num_samples": self.num_samples},
                          sort_keys=True, separators=(",", ":")).encode()
        parts = [MAGIC, _PREAMBLE.pack(VERSION, len(head)), head]
        used = len(MAGIC) + _PREAMBLE.size + len(head)
        parts.append(b"\0" * (-used % _SEP_ALIGN))
        for name, dtype in _ARRAYS:
            parts.append(np.ascontiguousarray(getattr(self, name), dtype=dtype).tobytes())
        parts.append(self.key_blob)
        body = b"".join(parts)
        return body + struct.pack("<I", zlib.crc32(body))

    @classmethod
    def from_bytes(cls, data: bytes | bytearray | memoryview) -> TarIndex:
        """The index `to_bytes` wrote; ValueError for anything else (other version, garbage,
        a torn or altered file)."""
        data = memoryview(data).cast("B")
        if len(data) < len(MAGIC) + _PREAMBLE.size + 4 or bytes(data[:len(MAGIC)]) != MAGIC:
            raise ValueError("not a ringfeed tar index (bad magic)")
        version, head_len = _PREAMBLE.unpack_from(data, len(MAGIC))
        if version != VERSION:
            raise ValueError(f"tar index version {version} is not supported (this ringfeed "
                             f"reads version {VERSION})")
        (crc,) = struct.unpack_from("<I", data, len(data) - 4)
        if zlib.crc32(data[:-4]) != crc:
            raise ValueError("tar index is damaged (crc32 mismatch)")
        pos = len(MAGIC) + _PREAMBLE.size
        try:
            head = json.loads(bytes(data[pos:pos + head_len]))
            fields = head["fields"]
            s, m, k = (int(head[n]) for n in ("num_samples", "num_members", "key_bytes"))
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"tar index has a bad header ({e})") from None
        if (not isinstance(fields, list) or not all(isinstance(f, str) for f in fields)
                or min(s, m, k) < 0):
            raise ValueError("tar index has a bad header")
        pos += head_len
        pos += -pos % _SEP_ALIGN
        lengths = {"key_offsets": s + 1, "sample_start": s + 1}
        arrays = {}
        for name, dtype in _ARRAYS:
            n = lengths.get(name, m)
            nbytes = n * np.dtype(dtype).itemsize
            if pos + nbytes > len(data) - 4:
                raise ValueError("tar index is truncated")
            arrays[name] = np.frombuffer(data, dtype, count=n, offset=pos)
            pos += nbytes
        if pos + k != len(data) - 4:
            raise ValueError("tar index has the wrong length")
        blob = bytes(data[pos:pos + k])
        index = cls(key_blob=blob, fields=tuple(fields), **arrays)
        index._validate()
        return index

    def _validate(self) -> None:
        ko, ss = self.key_offsets, self.sample_start
        m = self.num_members
        if ko[0] != 0 or ko[-1] != len(self.key_blob) or np.any(np.diff(ko) < 0):
            raise ValueError("tar index has bad key offsets")
        if ss[0] != 0 or ss[-1] != m or np.any(np.diff(ss) <= 0):
            raise ValueError("tar index has bad sample starts")
        if m and (self.member_field.min() < 0 or self.member_field.max() >= len(self.fields)
                  or self.member_size.min() < 0 or self.member_offset.min() < BLOCK):
            raise ValueError("tar index has bad members")

    def save(self, path: str | os.PathLike) -> None:
        """Write atomically (temp file beside `path`, fsync, rename)."""
        from ringfeed.fsutil import atomic_write_bytes

        atomic_write_bytes(path, self.to_bytes())

    @classmethod
    def load(cls, path: str | os.PathLike) -> TarIndex:
        """Read what `save` wrote; ValueError (naming the file) if it is not a valid index."""
        with open(path, "rb") as f:
            data = f.read()
        try:
            return cls.from_bytes(data)
        except ValueError as e:
            raise ValueError(f"{os.fspath(path)}: {e}") from None

    # -- comparison ------------------------------------------------------------------------
    def __eq__(self, other: object) -> bool:
        if not isinstance(other, TarIndex):
            return NotImplemented
        return (self.key_blob == other.key_blob and self.fields == other.fields
                and all(np.array_equal(getattr(self, n), getattr(other, n)) for n, _ in _ARRAYS))

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return (f"TarIndex({self.num_samples} samples, {self.num_members} members, "
                f"fields={list(self.fields)})")


_ARRAYS = (("key_offsets", "<i8"), ("sample_start", "<i8"), ("member_offset", "<i8"),
           ("member_size", "<i8"), ("member_check", "<u8"), ("member_field", "<i4"))


# -- header checks ---------------------------------------------------------------------------
def header_checks(blocks: np.ndarray) -> np.ndarray:
    """uint64 hash of each 512-byte header block (rows of `blocks`, uint8[n, 512])."""
    words = np.ascontiguousarray(blocks).view("<u8")
    return (words * _HASH_MULT).sum(axis=1, dtype=np.uint64)


def _valid_headers(blocks: np.ndarray, sizes: np.ndarray) -> np.ndarray:
    """tarfile's checks of a header (checksum, unsigned or signed) and size field == sizes.
    Fields as tarfile and GNU tar write them are compared digit by digit; other spellings
    that tarfile accepts go through the general parser."""
    chk = blocks[:, 148:156]
    unsigned = _byte_sums(blocks) - chk.sum(axis=1, dtype=np.int64) + 256
    ok_chk = _canonical(chk, unsigned, 6, b"\0 ")
    odd = np.flatnonzero(~ok_chk)
    if len(odd):
        stored, parsed = _octal(chk[odd])
        signed = (blocks[odd].view(np.int8).sum(axis=1, dtype=np.int64)
                  - chk[odd].view(np.int8).sum(axis=1, dtype=np.int64) + 256)
        ok_chk[odd] = parsed & ((stored == unsigned[odd]) | (stored == signed))
    size = blocks[:, 124:136]
    ok_size = _canonical(size, sizes, 11, b"\0")
    odd = np.flatnonzero(~ok_size)
    if len(odd):
        value, parsed = _octal(size[odd])
        ok_size[odd] = parsed & (value == sizes[odd])
    return ok_chk & ok_size


_LANES = np.uint64(0x00FF00FF00FF00FF)


def _byte_sums(blocks: np.ndarray) -> np.ndarray:
    """int64 sum of each row's 512 bytes, 8 bytes at a time (16-bit lanes cannot overflow:
    64 words x 2 x 255 < 2**16)."""
    words = blocks.view("<u8")
    lanes = ((words & _LANES) + ((words >> np.uint64(8)) & _LANES)).sum(axis=1, dtype=np.uint64)
    mask = np.uint64(0xFFFF)
    total = (lanes & mask) + ((lanes >> np.uint64(16)) & mask) \
        + ((lanes >> np.uint64(32)) & mask) + (lanes >> np.uint64(48))
    return total.astype(np.int64)


def _canonical(f: np.ndarray, values: np.ndarray, digits: int, tail: bytes) -> np.ndarray:
    """Rows of `f` that hold `values` as `digits` zero-padded octal digits followed by `tail`
    (how tarfile writes its number fields)."""
    shifts = 3 * np.arange(digits - 1, -1, -1, dtype=np.int64)
    expected = ((values[:, None] >> shifts) & 7).astype(np.uint8) + 0x30
    ok = (f[:, :digits] == expected).all(axis=1) & (values >= 0) & (values < 8 ** digits)
    return ok & (f[:, digits:] == np.frombuffer(tail, np.uint8)).all(axis=1)


def _octal(f: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """tarfile's `nti` for octal fields, vectorised: (values, ok). The field is cut at its first
    NUL; what is left must be spaces, octal digits, spaces. Base-256 fields are not ok."""
    n, w = f.shape
    nul = f == 0
    end = np.where(nul.any(axis=1), nul.argmax(axis=1), w)
    inside = np.arange(w) < end[:, None]
    digit = (f >= 0x30) & (f <= 0x37) & inside
    space = np.isin(f, _SPACES) & inside
    runs = (digit[:, 1:] & ~digit[:, :-1]).sum(axis=1) + digit[:, 0]
    ok = ((digit | space) == inside).all(axis=1) & (runs <= 1)
    last = np.where(digit.any(axis=1), w - 1 - digit[:, ::-1].argmax(axis=1), 0)
    power = np.clip(last[:, None] - np.arange(w), 0, w)
    values = (np.where(digit, f.astype(np.int64) - 0x30, 0) << (3 * power)).sum(axis=1)
    return values, ok


# -- building --------------------------------------------------------------------------------
class TarIndexBuilder:
    """Groups members into samples as webdataset does, as they come in tar order.

    `add(name, data_offset, size, header)` for every regular member (webdataset skips the
    others); meta files are skipped here. It raises ValueError on a duplicate field (what
    webdataset raises): `abort()` then drops the sample being grouped. `end()` when the tar
    ended (the last sample is complete), then `finish()`. A writer gives `add` each member's
    512-byte header block; without them (all or none), `finish(f)` reads them from the tar.
    Storage is compact (arrays, headers hashed as they come): millions of members are fine.
    """

    def __init__(self) -> None:
        self._key_blob = bytearray()
        self._key_offsets = array("q", [0])
        self._starts = array("q", [0])
        self._field_ids: dict[str, int] = {}
        self._mfield = array("i")
        self._moff = array("q")
        self._msize = array("q")
        self._with_headers: bool | None = None
        self._pending = bytearray()  # header blocks of committed members, not yet hashed
        self._checks: list[np.ndarray] = []
        self._key: str | None = None
        self._current: list[tuple[str, int, int, bytes | None]] = []
        self._current_fields: set[str] = set()
        self._bad = False

    @property
    def num_samples(self) -> int:
        return len(self._starts) - 1

    def last_key(self) -> str | None:
        if self.num_samples == 0:
            return None
        lo, hi = self._key_offsets[-2], self._key_offsets[-1]
        return bytes(self._key_blob[lo:hi]).decode("utf-8", "surrogatepass")

    def add(self, name: str, offset: int, size: int, header: bytes | None = None) -> None:
        if self._with_headers is None:
            self._with_headers = header is not None
        elif self._with_headers != (header is not None):
            raise ValueError("give add() every member's header block, or none")
        if header is not None and len(header) != BLOCK:
            raise ValueError(f"a tar header block is {BLOCK} bytes, not {len(header)}")
        if not webdataset_reads(name):
            return
        key, ext = base_plus_ext(name)
        if key is None:
            return
        ext = ext.lower()
        if key != self._key:
            self._commit()
            self._key = key
        if ext in self._current_fields or ext in _ALWAYS_IN_SAMPLE:
            raise ValueError(f"{name}: duplicate file name in tar file {ext}")
        self._current_fields.add(ext)
        if ext == "__bad__" and size > 0:
            self._bad = True  # webdataset's valid_sample: a truthy __bad__ drops the sample
        self._current.append((ext, offset, size, header))

    def end(self) -> None:
        """The tar ended where webdataset's iterator ends it: the last sample is complete."""
        self._commit()

    def abort(self) -> None:
        """The tar failed: the sample being grouped is lost (webdataset never yields it)."""
        self._reset()

    def _commit(self) -> None:
        if self._key is not None and not self._bad:
            self._key_blob += self._key.encode("utf-8", "surrogatepass")
            self._key_offsets.append(len(self._key_blob))
            for ext, offset, size, header in self._current:
                self._mfield.append(self._field_ids.setdefault(ext, len(self._field_ids)))
                self._moff.append(offset)
                self._msize.append(size)
                if header is not None:
                    self._pending += header
            self._starts.append(len(self._moff))
            if len(self._pending) >= _CHUNK * BLOCK:
                self._hash_pending()
        self._reset()

    def _hash_pending(self) -> None:
        if self._pending:
            blocks = np.frombuffer(bytes(self._pending), np.uint8).reshape(-1, BLOCK)
            self._checks.append(header_checks(blocks))
            self._pending = bytearray()

    def _reset(self) -> None:
        self._key, self._current, self._current_fields, self._bad = None, [], set(), False

    def finish(self, f: IO[bytes] | None = None) -> TarIndex:
        """The index of the samples committed so far (a sample being grouped is left out:
        call `end()` first when the tar ended cleanly). Header blocks not given to `add` are
        read from `f` (the tar, seekable)."""
        offsets = np.frombuffer(self._moff, np.int64) if self._moff else np.zeros(0, np.int64)
        if self._with_headers or not len(offsets):
            self._hash_pending()
            checks = np.concatenate(self._checks) if self._checks else np.zeros(0, np.uint64)
        else:
            if f is None:
                raise ValueError("finish() needs the tar to read the members' header blocks")
            checks = np.concatenate([header_checks(_read_blocks(f, offsets[i:i + _CHUNK] - BLOCK))
                                     for i in range(0, len(offsets), _CHUNK)])
        return TarIndex(key_blob=bytes(self._key_blob),
                        key_offsets=np.frombuffer(self._key_offsets, np.int64),
                        sample_start=np.frombuffer(self._starts, np.int64),
                        fields=tuple(self._field_ids),
                        member_field=np.frombuffer(self._mfield, np.int32)
                        if self._mfield else np.zeros(0, np.int32),
                        member_offset=offsets,
                        member_size=np.frombuffer(self._msize, np.int64)
                        if self._msize else np.zeros(0, np.int64),
                        member_check=checks)


def _read_blocks(f: IO[bytes], starts: np.ndarray) -> np.ndarray:
    """uint8[n, 512]: the blocks of `f` at `starts` (each inside the file)."""
    out = np.empty((len(starts), BLOCK), np.uint8)
    mm = None
    try:
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    except (AttributeError, OSError, ValueError):  # not a file with a descriptor, or empty
        mm = None
    if mm is not None:
        with mm:
            data = np.frombuffer(mm, np.uint8)
            out[:] = data[starts[:, None] + np.arange(BLOCK)]
            del data
        return out
    for row, start in enumerate(starts.tolist()):
        f.seek(start)
        block = f.read(BLOCK)
        if len(block) != BLOCK:
            raise ValueError(f"tar header at {start} is outside the file")
        out[row] = np.frombuffer(block, np.uint8)
    return out


# The one declaration of the compressions a shard can carry: kind -> (its magic prefixes, the
# name suffixes that say so). gzip, bzip2 and xz are what webdataset reads (tarfile's "r|*");
# zstd is recognised only to be refused by name and by content. bzip2's magic is tested apart
# ("BZh" + level + "1AY&SY"). Everything else (tarread's COMPRESSED_TAR_SUFFIXES, the
# pipeline cache's COMPRESSED_SUFFIXES and its plain-copy names) is derived from this table.
COMPRESSIONS: dict[str, tuple[tuple[bytes, ...], tuple[str, ...]]] = {
    "gzip": ((b"\x1f\x8b\x08",), (".tar.gz", ".tgz", ".gz")),
    "bzip2": ((), (".tar.bz2", ".bz2")),
    "xz": ((b"\x5d\x00\x00\x80", b"\xfd7zXZ"), (".tar.xz", ".xz")),
    "zstd": ((b"\x28\xb5\x2f\xfd",), (".tar.zst", ".zst")),
}
READABLE_COMPRESSIONS = ("gzip", "bzip2", "xz")
# every compressed name, longest first (so stripping one takes ".tar.gz" before ".gz")
COMPRESSED_SUFFIXES = tuple(sorted((s for _, names in COMPRESSIONS.values() for s in names),
                                   key=len, reverse=True))
# the names that say "a compressed tar" and can be read: the tar-looking suffixes
COMPRESSED_TAR_SUFFIXES = tuple(s for kind in READABLE_COMPRESSIONS
                                for s in COMPRESSIONS[kind][1] if s.startswith(".t"))


def strip_compressed_suffix(name: str) -> str:
    """`name` less its compression suffix ("a.tar.gz" -> "a", "a.gz" -> "a"), if it has one."""
    for suffix in COMPRESSED_SUFFIXES:
        if name.endswith(suffix):
            return name[: -len(suffix)]
    return name


def compression_of(head: bytes) -> str | None:
    """The compression of a stream starting with `head` (its first 10 bytes or more): "gzip",
    "bzip2", "xz" or "zstd", or None. tarfile's own test (`r|*`), plus zstd."""
    for name, (magics, _) in COMPRESSIONS.items():
        if any(head.startswith(magic) for magic in magics):
            return name
    if head[0:3] == b"BZh" and head[4:10] == b"1AY&SY":
        return "bzip2"
    return None


class _Unindexable(Exception):
    pass


def build_index(f: IO[bytes]) -> tuple[TarIndex, str | None]:
    """Index the tar in the seekable binary file `f` with tarfile (pax and GNU long names
    included), grouping as webdataset does. Returns (index, None) for a tar read to its end,
    else (the index of the samples webdataset's iterator yields before it fails, a one-line
    reason: "corrupt or truncated tar after sample 'KEY' (...)"). A tar whose member data runs
    past the end of the file, that stops at a header tarfile cannot read (which tarfile takes
    for the end of the archive), or that fails webdataset's grouping has a reason; so does a
    compressed tar or one with sparse members (not indexable)."""
    f.seek(0, os.SEEK_END)
    file_size = f.tell()
    f.seek(0)
    builder = TarIndexBuilder()
    compression = compression_of(f.read(10))
    f.seek(0)
    if compression:
        return builder.finish(f), f"{compression}-compressed tar: only plain tars can be indexed"
    reason = None
    try:
        tar = tarfile.open(fileobj=f, mode="r:")
        while (info := tar.next()) is not None:
            tar.members = []  # what webdataset does: no list of every member
            if not info.isreg():
                continue
            if info.sparse is not None:
                raise _Unindexable(f"member {info.name!r} is a sparse file, which cannot be "
                                   "indexed")
            if info.offset_data + info.size > file_size:
                raise tarfile.ReadError("unexpected end of data")
            builder.add(info.name, info.offset_data, info.size)
        problem = _end_problem(f, tar.offset, file_size)
        if problem:  # the lost header may be one of the last sample's members: it is dropped
            builder.abort()
            reason = f"corrupt or truncated tar{_after(builder)} ({problem})"
        else:
            builder.end()
    except OSError:
        raise
    except _Unindexable as e:
        builder.abort()
        reason = f"corrupt or truncated tar{_after(builder)} ({e})"
    except Exception as e:  # tarfile.ReadError, EOFError, duplicate fields (ValueError), ...
        builder.abort()
        text = str(e.args[0]) if e.args else ""
        reason = f"corrupt or truncated tar{_after(builder)} ({type(e).__name__}: {text})"
    return builder.finish(f), reason


def _after(builder: TarIndexBuilder) -> str:
    key = builder.last_key()
    return f" after sample {key!r}" if key is not None else " at its start"


def _end_problem(f: IO[bytes], offset: int, file_size: int) -> str | None:
    """Why tarfile's iteration stopped at `offset`, if that was not the end of the archive (a
    zero block) or of the file."""
    if offset >= file_size:
        return None
    f.seek(offset)
    block = f.read(BLOCK)
    if len(block) < BLOCK:
        return f"the file ends inside a tar header at offset {offset}"
    if block.count(0) == BLOCK:
        return None
    return f"invalid tar header at offset {offset}"

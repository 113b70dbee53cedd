"""Reading finished shards back: samples as webdataset groups them, with the file's sha256
computed in the same pass. Shared by `verify`, `inspect` and `--format wds-index`.

A compressed tar (`.tar.gz`, `.tgz`, `.tar.bz2`, `.tar.xz`) is hashed as it is stored and
decompressed with the gzip/bz2/lzma modules (`decompress_tar`, which the pipeline's cache also
uses for its plain copies): unlike tarfile's own `r|gz` stream they check the data's checksum
and its end, so corrupt or cut-short data is an error, not fewer samples. The tar inside is read
from a temporary plain copy and checked as a plain tar is (`build_index`: a tar that stops at a
damaged or missing header is an error too, where tarfile would just stop).
"""

from __future__ import annotations

import bz2
import gzip
import io
import lzma
import os
import tarfile
import tempfile
import zlib
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import IO, Any

import fsspec

from ringfeed.formats.tarblocks import BLOCK

# Compressed tars webdataset reads (its tar iterator opens them with tarfile's "r|*"): no tar
# index for these (no random access into the stream); they are read from start to end.
# COMPRESSED_TAR_SUFFIXES is derived from tarindex.COMPRESSIONS, the one list of them.
from ringfeed.formats.tarindex import COMPRESSED_TAR_SUFFIXES as COMPRESSED_TAR_SUFFIXES
from ringfeed.formats.tarindex import base_plus_ext, build_index, compression_of, webdataset_reads
from ringfeed.fsutil import HashingIO

TAR_SUFFIXES = (".tar", *COMPRESSED_TAR_SUFFIXES)
DECOMPRESS_CHUNK = 1 << 20
# what a broken tar raises while webdataset or tarfile reads it
_TAR_ERRORS = (tarfile.TarError, ValueError, EOFError, OSError)


class TarReadError(Exception):
    """A shard that is not a readable tar (truncated, corrupt header, duplicate member, damaged
    compressed data)."""


class CompressedDataError(Exception):
    """A compressed tar whose compressed data cannot be read to its end: one line on why.
    `cut_short`: the data just ends early, so what came before it is exact (corrupt data, by
    contrast, may have gone wrong anywhere before a checksum caught it)."""

    def __init__(self, message: str, cut_short: bool = False) -> None:
        super().__init__(message)
        self.cut_short = cut_short


@dataclass
class TarScan:
    num_samples: int = 0
    bytes: int = 0
    sha256: str = ""
    fields: Counter = field(default_factory=Counter)  # member ext -> samples having it
    duplicate_keys: list[str] = field(default_factory=list)
    first: list[dict[str, Any]] = field(default_factory=list)  # the first few samples
    ints: Counter = field(default_factory=Counter)  # scan_tar's `ints_of`: value -> members
    before_last: str | None = None  # the key of the sample before the last one


def open_shard(url: str) -> IO[bytes]:
    """A local path or any fsspec URL (http://, s3://, ...), opened for reading."""
    return fsspec.open(url, "rb").open()


def is_compressed_tar(url: str) -> bool:
    return url.endswith(COMPRESSED_TAR_SUFFIXES)


def scan_tar(url: str, keep_first: int = 0, ints_of: str | None = None) -> TarScan:
    """Count the samples of one tar the way webdataset groups them, hash the whole file (as
    stored: a compressed tar's compressed bytes). `ints_of`: for a compressed tar, also what
    `read_ints(url, ints_of)` gives, from the same decompressed copy (`scan.ints`)."""
    with open_shard(url) as f:
        reader = HashingIO(f)
        if is_compressed_tar(url):
            with _plain_copy(reader) as plain:
                _check_inner_tar(plain)
                scan = _scan_samples(url, plain, keep_first)
                if ints_of is not None and ints_of in scan.fields:
                    plain.seek(0)
                    scan.ints = _read_ints(plain, ints_of)
        else:
            scan = _scan_samples(url, reader, keep_first)
        reader.drain()
    problem = None if is_compressed_tar(url) else header_cut(reader.size)
    if problem:
        # (the lost header may be one of the last sample's members)
        after = f" after sample {scan.before_last!r}" if scan.before_last else ""
        raise TarReadError(f"not a readable tar{after} ({problem})")
    scan.bytes = reader.size
    scan.sha256 = reader.sha256.hexdigest()
    return scan


def tar_samples(stream: IO[bytes], url: str) -> Iterator[dict[str, Any]]:
    """The samples webdataset's `tar_file_expander` + `group_by_keys` yield from the tar
    `stream` (the rules tarindex.py lists; ValueError on a duplicate field), without importing
    webdataset, whose package imports torch: seconds of start-up for verify, inspect and
    wds-index, which only read tars."""
    sample: dict[str, Any] | None = None
    with tarfile.open(fileobj=stream, mode="r|*") as tar:
        for info in tar:
            tar.members = []  # (as webdataset: no list of every member)
            if not info.isreg() or not webdataset_reads(info.name):
                continue
            key, ext = base_plus_ext(info.name)
            if key is None or ext is None:
                continue
            data = tar.extractfile(info).read()  # type: ignore[union-attr]
            if sample is None or key != sample["__key__"]:
                if _valid(sample):
                    yield sample  # type: ignore[misc]
                sample = {"__key__": key, "__url__": url}
            ext = ext.lower()
            if ext in sample:
                raise ValueError(f"{info.name}: duplicate file name in tar file {ext}")
            sample[ext] = data
    if _valid(sample):
        yield sample  # type: ignore[misc]


def _valid(sample: dict[str, Any] | None) -> bool:
    """webdataset's valid_sample: a sample whose `__bad__` member is not empty is dropped."""
    return sample is not None and not sample.get("__bad__")


def _scan_samples(url: str, stream: IO[bytes], keep_first: int) -> TarScan:
    scan = TarScan()
    seen: set[str] = set()
    key = None
    try:
        for sample in tar_samples(stream, url):
            scan.before_last, key = key, sample["__key__"]
            if key in seen:
                scan.duplicate_keys.append(key)
            seen.add(key)
            exts = [k for k in sample if not k.startswith("__")]
            scan.fields.update(exts)
            scan.num_samples += 1
            if len(scan.first) < keep_first:
                scan.first.append({k: sample[k] for k in ["__key__", *exts]})
    except _TAR_ERRORS as e:
        if isinstance(e, FileNotFoundError):
            raise
        after = f" after sample {key!r}" if key else ""
        raise TarReadError(f"not a readable tar{after} ({_tar_error(e)})") from None
    return scan


def header_cut(size: int) -> str | None:
    """Why a plain tar of `size` bytes that tarfile read to its end is cut short, or None. Every
    tar header starts on a 512-byte block, so a file ending off a block boundary ends inside a
    header, which tarfile (and so webdataset's iterator) takes for the end of the archive."""
    if size % BLOCK:
        return f"the file ends inside a tar header: {size} bytes is not whole 512-byte blocks"
    return None


def read_ints(url: str, ext: str) -> Counter:
    """Counts of the integer values of every `KEY.ext` member (e.g. class indices), reading
    only those members: tar headers let it seek past everything else (a compressed tar is
    decompressed to a temporary plain copy first, and checked)."""
    with open_shard(url) as f:
        if is_compressed_tar(url):
            with _plain_copy(f) as plain:
                _check_inner_tar(plain)
                return _read_ints(plain, ext)
        return _read_ints(f, ext)


def _read_ints(f: IO[bytes], ext: str) -> Counter:
    counts: Counter = Counter()
    try:
        with tarfile.open(fileobj=f, mode="r:") as tar:
            for member in tar:
                if member.isfile() and (base_plus_ext(member.name)[1] or "").lower() == ext:
                    data = tar.extractfile(member).read()
                    counts[int(data)] += 1  # (a ValueError here is the data's, not the tar's)
    except (tarfile.TarError, EOFError) as e:
        raise TarReadError(f"not a readable tar ({_tar_error(e)})") from None
    return counts


def _tar_error(e: BaseException) -> str:
    # (webdataset appends the stream and URL to an exception's args; ' @ ' is its suffix)
    text = str(e.args[0]) if e.args else type(e).__name__
    return f"{type(e).__name__}: {text.split(' @ ')[0]}"


@contextmanager
def _plain_copy(f: IO[bytes]) -> Iterator[IO[bytes]]:
    """The compressed tar `f` decompressed into a temporary file (removed on exit), at its
    start; TarReadError saying what is wrong with the compressed data."""
    with tempfile.TemporaryFile(prefix="ringfeed-plain-") as plain:
        try:
            decompress_tar(f, plain)
        except CompressedDataError as e:
            raise TarReadError(f"not a readable tar: {e}") from None
        plain.seek(0)
        yield plain  # type: ignore[misc]


def _check_inner_tar(plain: IO[bytes]) -> None:
    """TarReadError when the decompressed tar ends anywhere but at its end-of-archive marker
    (tarfile stops quietly at a missing or damaged header)."""
    plain.seek(0)
    _, reason = build_index(plain)
    plain.seek(0)
    if reason is not None:
        raise TarReadError(f"not a readable tar: the compressed data is intact, the tar inside "
                           f"is not: {reason}")


# -- decompression -------------------------------------------------------------------------
def decompress_tar(src: IO[bytes], dst: IO[bytes]) -> tuple[int, int]:
    """Write the decompressed bytes of the compressed file `src` (gzip, bzip2, xz, detected by
    their magic bytes, as tarfile's `r|*` does) into `dst`; returns (bytes written, their
    crc32). Raises CompressedDataError for an empty file, one that is not compressed, and
    compressed data that is corrupt or cut short (gzip's and xz's own checksums included)."""
    head = src.read(10)
    kind = compression_of(head)
    if not head:
        raise CompressedDataError("empty file")
    if kind is None:
        raise CompressedDataError(f"not gzip, bzip2 or xz data although its name says "
                                  f"compressed (it starts with {head[:8]!r})")
    if kind == "zstd":
        raise CompressedDataError("zstd-compressed, which webdataset cannot read (recompress "
                                  "with gzip, bzip2 or xz)")
    whole = _Replayed(head, src)  # the head read above, then the rest (no seek: a stream)
    reader: IO[bytes] = (gzip.GzipFile(fileobj=whole) if kind == "gzip"
                         else bz2.BZ2File(whole) if kind == "bzip2" else lzma.LZMAFile(whole))
    size, crc = 0, 0
    while True:
        try:
            chunk = reader.read(DECOMPRESS_CHUNK)
        except EOFError:
            raise CompressedDataError(f"the {kind} data is cut short (a truncated file)",
                                      cut_short=True) from None
        except (OSError, zlib.error, lzma.LZMAError) as e:
            raise CompressedDataError(f"corrupt {kind} data ({type(e).__name__}: {e})"
                                      ) from None
        if not chunk:
            return size, crc
        dst.write(chunk)
        size += len(chunk)
        crc = zlib.crc32(chunk, crc)


class _Replayed(io.RawIOBase):
    """`head`, then what is left of `rest`."""

    def __init__(self, head: bytes, rest: IO[bytes]) -> None:
        self.head, self.rest = head, rest

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        if self.head:
            n = min(len(buffer), len(self.head))
            buffer[:n] = self.head[:n]
            self.head = self.head[n:]
            return n
        data = self.rest.read(len(buffer))
        buffer[:len(data)] = data
        return len(data)


def shard_url(manifest_dir: str, name: str) -> str:
    """Where a manifest's shard lives: names are relative to the manifest's folder, or URLs."""
    if "://" in name or os.path.isabs(name):
        return name
    return os.path.join(manifest_dir, name)

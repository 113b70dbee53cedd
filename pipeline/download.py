"""Downloading one remote shard into a local file: streamed, hashed as it goes, checked against
the manifest, and resumed at the byte where a storage fault broke it, under the retry policy
(ringfeed/remote.py). The shard cache (cache.py) decides what to download and where to.
"""

from __future__ import annotations

from pathlib import Path
from typing import IO, Any

import fsspec

from ringfeed.fsutil import WRITE_BEHIND, HashingIO, atomic_open
from ringfeed.pipeline.source import ShardRef
from ringfeed.remote import BodyCutShort, RetryCounts, RetryPolicy, retrying, with_timeouts

# A download's reads: what a broken transfer can lose (the read under way), and, for stores
# read by ranges (not S3's one streamed GET), one GET each.
DOWNLOAD_CHUNK = 256 << 10


class ChecksumMismatch(Exception):
    """The downloaded bytes are not the manifest's (size or sha256)."""


def download(ref: ShardRef, path: Path, storage_options: dict[str, Any], policy: RetryPolicy,
             counts: RetryCounts) -> int:
    """Stream shard `ref` into a temp file (hashing as it goes) and rename it to `path`;
    returns its size. On any error the temp file is removed and `path` untouched. A transfer
    broken by a storage fault resumes where it stopped where the store allows it; the local
    disk's errors are raised as they are (not retried)."""
    with atomic_open(path) as f:
        out = HashingIO(f, write_behind=WRITE_BEHIND)

        def fetch_rest() -> None:
            nonlocal out
            if out.size and not resumable(ref.url):  # start over
                f.seek(0)
                f.truncate()
                out = HashingIO(f, write_behind=WRITE_BEHIND)
            with open_remote(ref.url, storage_options, out.size) as src:
                while chunk := src.read(DOWNLOAD_CHUNK):
                    try:
                        out.write(chunk)
                    except OSError as e:  # the local disk, not the store
                        raise _LocalWriteError(e) from e
                stored = getattr(src, "size", None)  # what the store says it holds
            if isinstance(stored, int) and out.size < stored:
                raise BodyCutShort(f"got {out.size} of {stored} bytes")

        try:
            retrying(fetch_rest, ref.url, "download", policy, counts)
        except _LocalWriteError as e:
            raise e.error from None
        if ref.bytes is not None and out.size != ref.bytes:
            raise ChecksumMismatch(f"expected {ref.bytes} bytes, the object holds {out.size}")
        digest = out.sha256.hexdigest()
        if ref.sha256 is not None and digest != ref.sha256:
            raise ChecksumMismatch(f"expected sha256 {ref.sha256[:12]}..., got {digest[:12]}...")
    return out.size


def resumable(url: str) -> bool:
    """Whether a broken transfer can go on from an offset: object stores serve ranges; plain
    HTTP servers may not, and a pipe cannot seek."""
    return not url.startswith(("pipe:", "http://", "https://"))


def open_remote(url: str, storage_options: dict[str, Any], offset: int = 0) -> IO[bytes]:
    """A stream of the object at `url` from byte `offset`."""
    if url.startswith("pipe:"):
        from webdataset.gopen import gopen

        return gopen(url, "rb")
    fs, rpath = fsspec.core.url_to_fs(url, **with_timeouts(url, storage_options))
    if "s3" in fs.protocol:
        return S3Stream(fs, rpath, offset)
    if "http" in fs.protocol:  # plain HTTP servers may not serve ranges: one stream
        options: dict[str, Any] = {"block_size": 0}
    else:  # each read one ranged GET of its size
        options = {"block_size": DOWNLOAD_CHUNK, "cache_type": "none"}
    src = fs.open(rpath, "rb", **options)
    if offset:
        src.seek(offset)
    return src


class S3Stream:
    """An S3 object from `offset` to its end as one streamed GET (one request, however large;
    s3fs's `open` would make one ranged GET per read), with the object's size from the
    response. Reads run on the filesystem's event loop."""

    def __init__(self, fs: Any, path: str, offset: int = 0) -> None:
        from fsspec.asyn import sync

        self._sync, self._loop = sync, fs.loop
        bucket, key, version = fs.split_path(path)
        extra = {"VersionId": version} if version else {}
        response = sync(fs.loop, fs._call_s3, "get_object", Bucket=bucket, Key=key,
                        **({"Range": f"bytes={offset}-"} if offset else {}), **extra)
        self._body = response["Body"]
        self.size = offset + int(response.get("ContentLength") or 0)

    def read(self, n: int) -> bytes:
        return self._sync(self._loop, self._body.read, n)

    def close(self) -> None:
        self._body.close()

    def __enter__(self) -> S3Stream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _LocalWriteError(Exception):
    """A write to the cache's disk failed during a download (carried past the retry policy,
    which retries only the store's faults)."""

    def __init__(self, error: OSError) -> None:
        super().__init__(str(error))
        self.error = error

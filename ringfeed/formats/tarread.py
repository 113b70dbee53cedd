"""Reading finished shards back: samples as webdataset groups them, with the file's sha256
computed in the same pass. Shared by `verify`, `inspect` and `--format wds-index`.
"""

from __future__ import annotations

import os
import tarfile
from collections import Counter
from dataclasses import dataclass, field
from typing import IO, Any

import fsspec

from ringfeed.fsutil import HashingIO


class TarReadError(Exception):
    """A shard that is not a readable tar (truncated, corrupt header, duplicate member)."""


@dataclass
class TarScan:
    num_samples: int = 0
    bytes: int = 0
    sha256: str = ""
    fields: Counter = field(default_factory=Counter)  # member ext -> samples having it
    duplicate_keys: list[str] = field(default_factory=list)
    first: list[dict[str, Any]] = field(default_factory=list)  # the first few samples


def open_shard(url: str) -> IO[bytes]:
    """A local path or any fsspec URL (http://, s3://, ...), opened for reading."""
    return fsspec.open(url, "rb").open()


def scan_tar(url: str, keep_first: int = 0) -> TarScan:
    """Count the samples of one tar the way webdataset groups them, hash the whole file."""
    from webdataset.tariterators import group_by_keys, tar_file_expander

    scan = TarScan()
    seen: set[str] = set()
    with open_shard(url) as f:
        reader = HashingIO(f)
        members = tar_file_expander([{"url": url, "stream": reader}])
        try:
            for sample in group_by_keys(members):
                key = sample["__key__"]
                if key in seen:
                    scan.duplicate_keys.append(key)
                seen.add(key)
                exts = [k for k in sample if not k.startswith("__")]
                scan.fields.update(exts)
                scan.num_samples += 1
                if len(scan.first) < keep_first:
                    scan.first.append({k: sample[k] for k in ["__key__", *exts]})
        except (tarfile.TarError, ValueError, EOFError, OSError) as e:
            raise TarReadError(f"not a readable tar ({type(e).__name__}: {e.args[0] if e.args else e})") from None
        reader.drain()
    scan.bytes = reader.size
    scan.sha256 = reader.sha256.hexdigest()
    return scan


# Compressed tars webdataset reads (its tar iterator opens them with tarfile's "r|*"): no tar
# index for these (no random access into the stream); they are read from start to end.
COMPRESSED_TAR_SUFFIXES = (".tar.gz", ".tgz", ".tar.bz2", ".tar.xz")
TAR_SUFFIXES = (".tar", *COMPRESSED_TAR_SUFFIXES)


def read_ints(url: str, ext: str) -> Counter:
    """Counts of the integer values of every `KEY.ext` member (e.g. class indices), reading
    only those members: in a plain tar, headers let it seek past everything else; a compressed
    one is streamed."""
    from webdataset.tariterators import base_plus_ext

    counts: Counter = Counter()
    mode = "r|*" if url.endswith(COMPRESSED_TAR_SUFFIXES) else "r:"
    with open_shard(url) as f, tarfile.open(fileobj=f, mode=mode) as tar:
        for member in tar:
            if member.isfile() and (base_plus_ext(member.name)[1] or "").lower() == ext:
                counts[int(tar.extractfile(member).read())] += 1
    return counts


def shard_url(manifest_dir: str, name: str) -> str:
    """Where a manifest's shard lives: names are relative to the manifest's folder, or URLs."""
    if "://" in name or os.path.isabs(name):
        return name
    return os.path.join(manifest_dir, name)

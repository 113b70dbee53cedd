"""Write one planned shard with the standard library's tarfile, hashed while written, to a
temporary file that the caller publishes (fsync + rename) once it is complete.

The members are what webdataset's TarWriter writes (`KEY.EXT`, in sorted EXT order, keys
starting with `_` left out), in the same tar format, but not through TarWriter:
- importing webdataset imports torch, about 2 s of CPU in every writer process;
- TarWriter opens tarfile's stream mode, which copies each member in 10 KB records. Here each
  member's bytes go to the 1 MB-buffered file in one write.

Fixed mtime, owner and mode make a shard's bytes a function of its samples alone, so any
process (and any rerun) writes the same file for the same plan.
"""

from __future__ import annotations

import io
import tarfile
from collections.abc import Callable
from pathlib import Path
from typing import IO

from shards.errors import UserError
from shards.fsutil import HashingIO, temp_open
from shards.manifest import ShardInfo
from shards.plan import PlannedShard
from shards.sources import Source

TAR_MTIME = 946684800  # 2000-01-01T00:00:00Z (1970 makes GNU tar warn on extraction)
TAR_OWNER = "ringfeed"
TAR_MODE = 0o444
WRITE_BUFFER = 1 << 20  # headers are 512 bytes: collect them into few large writes
WHOLE_MEMBER = 1 << 62  # tarfile copies a member in chunks of this size: all of it at once


class SampleTarWriter:
    """Samples (`{"__key__": KEY, EXT: bytes, ...}`) -> tar members `KEY.EXT`, fixed headers."""

    def __init__(self, stream: IO[bytes]):
        self._tar = tarfile.open(fileobj=stream, mode="w", format=tarfile.PAX_FORMAT,
                                 copybufsize=WHOLE_MEMBER)

    def write(self, sample: dict[str, bytes | str]) -> int:
        """Append one sample; the bytes of its members' data."""
        key, total = sample["__key__"], 0
        for ext in sorted(sample):
            if ext.startswith("_"):
                continue
            data = sample[ext]
            if isinstance(data, str):
                data = data.encode()
            member = tarfile.TarInfo(f"{key}.{ext}")
            member.size, member.mtime, member.mode = len(data), TAR_MTIME, TAR_MODE
            member.uname = member.gname = TAR_OWNER
            self._tar.addfile(member, io.BytesIO(data))  # whole-buffer read: no copy
            total += len(data)
        return total

    def close(self) -> None:
        self._tar.close()  # end blocks and record padding; leaves `stream` open

    def __enter__(self) -> SampleTarWriter:
        return self

    def __exit__(self, exc_type: type | None, *exc: object) -> None:
        if exc_type is None:
            self.close()  # a failed shard's temp file is removed unfinished


def write_shard(source: Source, shard: PlannedShard, out_dir: Path,
                on_sample: Callable[[int], None] | None = None) -> tuple[ShardInfo, Path]:
    """Write `shard` to a temp file in `out_dir`; (its description, the temp file) for
    `fsutil.publish(temp, out_dir / shard.name)`. Not fsynced here: publishing it in another
    thread lets the disk write back one shard while the next is built."""
    path = out_dir / shard.name
    with temp_open(path, "wb") as (f, tmp):
        out = HashingIO(f)
        # closed before `f` is: closing flushes the buffer into `out`, which leaves `f` open
        with io.BufferedWriter(out, buffer_size=WRITE_BUFFER) as buffered, \
                SampleTarWriter(buffered) as tar:
            for index in shard.indices:
                size = tar.write(source.sample(shard.part, int(index)))
                if on_sample:
                    on_sample(size)
        if out.size != shard.bytes:
            # sizes come from the scan; a difference means the input changed since
            raise UserError(f"{path}: {out.size} bytes written, {shard.bytes} planned: did "
                            f"the input under {source.path} change while sharding? Run again")
    return ShardInfo(shard.name, shard.num_samples, out.size, out.sha256.hexdigest()), tmp

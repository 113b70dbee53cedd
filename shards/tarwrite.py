"""Write one planned shard in the standard library's tar format (tarfile's own headers), hashed
while written, to a temporary file that the caller publishes (fsync + rename) once it is
complete.

The members are what webdataset's TarWriter writes (`KEY.EXT`, in sorted EXT order, keys
starting with `_` left out), in the same tar format, but not through TarWriter:
- importing webdataset imports torch, about 2 s of CPU in every writer process;
- TarWriter opens tarfile's stream mode, which copies each member in 10 KB records. Here each
  member's bytes go to the 1 MB-buffered file in one write.

Beside each shard goes its index sidecar (`train-000000.tar.idx`, `pipeline.tarindex`): every
sample's key and every member's data offset and size, recorded while the tar is written.

Fixed mtime, owner and mode make a shard's bytes a function of its samples alone, so any
process (and any rerun) writes the same file for the same plan.
"""

from __future__ import annotations

import io
import tarfile
from collections.abc import Callable
from pathlib import Path
from typing import IO

from ringfeed.pipeline.tarindex import TarIndex, TarIndexBuilder
from ringfeed.shards.manifest import INDEX_SUFFIX, ShardInfo
from ringfeed.shards.packing import PlannedShard
from ringfeed.shards.sources import Source

from ringfeed.errors import UserError
from ringfeed.fsutil import HashingIO, publish, temp_open

TAR_MTIME = 946684800  # 2000-01-01T00:00:00Z (1970 makes GNU tar warn on extraction)
TAR_OWNER = "ringfeed"
TAR_MODE = 0o444
WRITE_BUFFER = 1 << 20  # headers are 512 bytes: collect them into few large writes


class SampleTarWriter:
    """Samples (`{"__key__": KEY, EXT: bytes, ...}`) -> tar members `KEY.EXT`, fixed headers,
    and the tar's index (`pipeline.tarindex`): each member's data offset is known as it is
    written, so the index needs no second pass over the tar.

    The bytes are those of tarfile's `addfile` + `close` (the header from `TarInfo.tobuf`, the
    data, NUL padding to 512 bytes; two zero blocks and padding to a 10 KB record at the end),
    written here so that the header block of every member is at hand for the index.
    """

    def __init__(self, stream: IO[bytes]):
        self._stream = stream
        self._offset = 0
        self._index = TarIndexBuilder()
        self._closed = False

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
            header = member.tobuf(tarfile.PAX_FORMAT, tarfile.ENCODING, "surrogateescape")
            start = self._offset + len(header)
            padding = -len(data) % tarfile.BLOCKSIZE
            self._stream.write(header)
            self._stream.write(data)
            if padding:
                self._stream.write(tarfile.NUL * padding)
            self._offset = start + len(data) + padding
            try:
                self._index.add(member.name, start, len(data), header[-tarfile.BLOCKSIZE:])
            except ValueError as e:  # webdataset could not read the shard either
                raise UserError(f"sample {key!r}: {e}; webdataset would not read this "
                                "shard") from None
            total += len(data)
        return total

    def close(self) -> None:
        """End blocks and record padding, as tarfile's close writes them; `stream` stays open."""
        if self._closed:
            return
        self._closed = True
        end = 2 * tarfile.BLOCKSIZE
        end += -(self._offset + end) % tarfile.RECORDSIZE
        self._stream.write(tarfile.NUL * end)
        self._offset += end
        self._index.end()

    def index(self) -> TarIndex:
        """The index of what was written (after `close`)."""
        return self._index.finish()

    def __enter__(self) -> SampleTarWriter:
        return self

    def __exit__(self, exc_type: type | None, *exc: object) -> None:
        if exc_type is None:
            self.close()  # a failed shard's temp file is removed unfinished


def write_shard(source: Source, shard: PlannedShard, out_dir: Path,
                on_sample: Callable[[int], None] | None = None) -> tuple[ShardInfo, Path, Path]:
    """Write `shard` and its index sidecar (`index_name(shard.name)`) to temp files in
    `out_dir`; (its description, the shard's temp file, the sidecar's temp file) for
    `publish_shard`. Not fsynced here: publishing them in another thread lets the disk write
    back one shard while the next is built."""
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
        tar_index = tar.index()
        if tar_index.num_samples != shard.num_samples:
            raise UserError(f"{path}: webdataset would read {tar_index.num_samples} samples, "
                            f"{shard.num_samples} were written (keys that split or repeat)")
    sidecar = index_name(shard.name)
    try:
        with temp_open(out_dir / sidecar, "wb") as (f, index_tmp):
            f.write(tar_index.to_bytes())
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    info = ShardInfo(shard.name, shard.num_samples, out.size, out.sha256.hexdigest(), sidecar)
    return info, tmp, index_tmp


def publish_shard(out_dir: Path, info: ShardInfo, tmp: Path, index_tmp: Path) -> None:
    """Rename a written shard's temp files to their names: the sidecar first, so a shard is
    never there without its index. A failure removes the temp files left."""
    try:
        publish(index_tmp, out_dir / index_name(info.name))
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    publish(tmp, out_dir / info.name)


def index_name(shard_name: str) -> str:
    """The index sidecar of a shard: `train-000000.tar` -> `train-000000.tar.idx`."""
    return shard_name + INDEX_SUFFIX

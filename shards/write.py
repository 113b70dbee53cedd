"""Write one planned shard (packing.py) from its source, hashed while written, to temporary files
that the caller publishes (fsync + rename) once complete; the tar format itself is
ringfeed/formats/tarwrite.py."""

from __future__ import annotations

import io
from collections.abc import Callable
from pathlib import Path

from ringfeed.errors import UserError
from ringfeed.formats.manifest import ShardInfo
from ringfeed.formats.tarwrite import SampleTarWriter, index_name
from ringfeed.fsutil import WRITE_BEHIND, HashingIO, publish, temp_open
from ringfeed.shards.packing import PlannedShard
from ringfeed.shards.sources import Source

WRITE_BUFFER = 1 << 20  # headers are 512 bytes: collect them into few large writes


def write_shard(source: Source, shard: PlannedShard, out_dir: Path,
                on_sample: Callable[[int], None] | None = None) -> tuple[ShardInfo, Path, Path]:
    """Write `shard` and its index sidecar (`index_name(shard.name)`) to temp files in
    `out_dir`; (its description, the shard's temp file, the sidecar's temp file) for
    `publish_shard`. Not fsynced here: publishing them in another thread lets the disk write
    back one shard while the next is built."""
    path = out_dir / shard.name
    with temp_open(path, "wb") as (f, tmp):
        out = HashingIO(f, write_behind=WRITE_BEHIND)
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

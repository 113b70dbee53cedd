"""Write one planned shard: webdataset's TarWriter with fixed headers, hashed while written,
to a temporary file that the caller publishes (fsync + rename) once it is complete.

Fixed mtime, owner and mode make a shard's bytes a function of its samples alone, so any
process (and any rerun) writes the same file for the same plan.
"""

from __future__ import annotations

import io
from collections.abc import Callable
from pathlib import Path

from shards.errors import UserError
from shards.fsutil import HashingIO, temp_open
from shards.manifest import ShardInfo
from shards.plan import PlannedShard
from shards.sources import Source

TAR_MTIME = 946684800  # 2000-01-01T00:00:00Z (1970 makes GNU tar warn on extraction)
TAR_OWNER = "ringfeed"
TAR_MODE = 0o444
WRITE_BUFFER = 1 << 20  # tarfile's stream mode writes 10 KB records: hash and write them by MB


def write_shard(source: Source, shard: PlannedShard, out_dir: Path,
                on_sample: Callable[[int], None] | None = None) -> tuple[ShardInfo, Path]:
    """Write `shard` to a temp file in `out_dir`; (its description, the temp file) for
    `fsutil.publish(temp, out_dir / shard.name)`. Not fsynced here: publishing it in another
    thread lets the disk write back one shard while the next is built."""
    from webdataset import TarWriter  # imports torch: keep it out of `ringfeed --help`

    path = out_dir / shard.name
    with temp_open(path, "wb") as (f, tmp):
        out = HashingIO(f)
        # closed before `f` is: closing flushes the buffer into `out`, which leaves `f` open
        with io.BufferedWriter(out, buffer_size=WRITE_BUFFER) as buffered, \
                TarWriter(buffered, encoder=False, mtime=TAR_MTIME, user=TAR_OWNER,
                          group=TAR_OWNER, mode=TAR_MODE) as tar:
            for index in shard.indices:
                size = tar.write(source.sample(shard.part, int(index)))
                if on_sample:
                    on_sample(size)
        if out.size != shard.bytes:
            # sizes come from the scan; a difference means the input changed since
            raise UserError(f"{path}: {out.size} bytes written, {shard.bytes} planned: did "
                            f"the input under {source.path} change while sharding? Run again")
    return ShardInfo(shard.name, shard.num_samples, out.size, out.sha256.hexdigest()), tmp

"""The writing side of ringfeed's tar shards: samples -> tar members in the standard library's
tar format (tarfile's own headers) plus the shard's index sidecar (tarindex.py, the reading side).

The members are what webdataset's TarWriter writes (`KEY.EXT`, in sorted EXT order, keys
starting with `_` left out), in the same tar format, but not through TarWriter:
- importing webdataset imports torch, about 2 s of CPU in every writer process;
- TarWriter opens tarfile's stream mode, which copies each member in 10 KB records. Here each
  member's bytes go to the 1 MB-buffered file in one write.

Beside each shard goes its index sidecar (`train-000000.tar.idx`, `tarindex.py`): every
sample's key and every member's data offset and size, recorded while the tar is written.

Fixed mtime, owner and mode make a shard's bytes a function of its samples alone, so any
process (and any rerun) writes the same file for the same plan.
"""

from __future__ import annotations

import tarfile
from typing import IO

from ringfeed.errors import UserError
from ringfeed.formats.manifest import INDEX_SUFFIX
from ringfeed.formats.tarblocks import BLOCK, data_padding, end_bytes
from ringfeed.formats.tarindex import TarIndex, TarIndexBuilder

TAR_MTIME = 946684800  # 2000-01-01T00:00:00Z (1970 makes GNU tar warn on extraction)
TAR_OWNER = "ringfeed"
TAR_MODE = 0o444


class SampleTarWriter:
    """Samples (`{"__key__": KEY, EXT: bytes, ...}`) -> tar members `KEY.EXT`, fixed headers,
    and the tar's index (`tarindex.py`): each member's data offset is known as it is
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
            padding = data_padding(len(data))
            self._stream.write(header)
            self._stream.write(data)
            if padding:
                self._stream.write(tarfile.NUL * padding)
            self._offset = start + len(data) + padding
            try:
                self._index.add(member.name, start, len(data), header[-BLOCK:])
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
        end = end_bytes(self._offset)
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


def index_name(shard_name: str) -> str:
    """The index sidecar of a shard: `train-000000.tar` -> `train-000000.tar.idx`."""
    return shard_name + INDEX_SUFFIX

"""manifest.bin's writing side (ringfeed/formats/manifest_format.py): a split's shard rows as
flat arrays, and the file's layout (magic, header size and crc32, JSON header, 64-byte aligned
little-endian arrays each with its crc32). Reading it back through manifest_index.py:
test_manifest_index.py."""

from __future__ import annotations

import json
import struct
import zlib
from dataclasses import dataclass

import numpy as np

from ringfeed.formats.manifest_format import (
    ALIGN,
    HAS_INDEX,
    HAS_SHA256,
    HEAD,
    MAGIC,
    VERSION,
    SplitArrays,
    write_index,
)


@dataclass
class Row:
    name: str
    num_samples: int
    bytes: int
    sha256: str | None
    index: str | None


ROWS = [Row("train-000000.tar", 5, 10240, "ab" * 32, "train-000000.tar.idx"),
        Row("sub/träin-1.tar", 0, 512, None, None),
        Row("s3://b/x.tar", 7, 2**40, "0f" * 32, None)]


def test_a_splits_rows_become_flat_arrays():
    a = SplitArrays.from_shards(ROWS)
    assert a.counts.tolist() == [5, 0, 7] and a.bytes.tolist() == [10240, 512, 2**40]
    assert a.flags.tolist() == [HAS_SHA256 | HAS_INDEX, 0, HAS_SHA256]
    assert bytes(a.sha256[0]) == bytes.fromhex("ab" * 32) and not a.sha256[1].any()
    names = bytes(a.names)
    assert [names[a.name_offsets[i]:a.name_offsets[i + 1]].decode() for i in range(3)] == \
        [r.name for r in ROWS]
    assert a.index_offsets.tolist() == [0, 20, 20, 20]


def test_the_file_layout(tmp_path):
    splits = {"train": SplitArrays.from_shards(ROWS), "val": SplitArrays.from_shards([])}
    path = write_index(tmp_path / "manifest.bin", {"fields": {"cls": "int"}}, splits, 1234,
                       "cd" * 32)
    data = path.read_bytes()
    assert data[:len(MAGIC)] == MAGIC
    size, crc = struct.unpack("<QI", data[len(MAGIC):HEAD])
    header = data[HEAD:HEAD + size]
    assert zlib.crc32(header) == crc
    meta = json.loads(header)
    assert (meta["version"], meta["json_size"], meta["json_sha256"]) == (VERSION, 1234, "cd" * 32)
    assert meta["manifest"] == {"fields": {"cls": "int"}}
    start = -(-(HEAD + size) // ALIGN) * ALIGN  # the arrays begin aligned
    for name, arrays in splits.items():
        for field, (offset, dtype, shape, crc32) in meta["splits"][name].items():
            assert offset % ALIGN == 0 and dtype.startswith(("<", "|"))
            array = np.frombuffer(data, dtype, int(np.prod(shape)), start + offset)
            assert np.array_equal(array.reshape(shape), getattr(arrays, field)), (name, field)
            assert zlib.crc32(array.tobytes()) == crc32
    assert [p.name for p in tmp_path.iterdir()] == ["manifest.bin"]  # no temp file left


def test_the_bytes_depend_only_on_the_inputs(tmp_path):
    for d in ("a", "b"):
        write_index(tmp_path / d, {}, {"train": SplitArrays.from_shards(ROWS)}, 1, "")
    assert (tmp_path / "a").read_bytes() == (tmp_path / "b").read_bytes()

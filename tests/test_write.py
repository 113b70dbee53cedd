"""Writing one planned shard (shards/write.py): temp files hashed as written, the shard's size
checked against the plan, the index sidecar beside it, and publishing sidecar first; a failure
leaves no temp file and no shard without its index."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from tar_util import member_bytes

from ringfeed.errors import UserError
from ringfeed.formats.tarindex import TarIndex, build_index
from ringfeed.fsutil import sha256_file
from ringfeed.shards import write as write_module
from ringfeed.shards.keys import NumberedKeys
from ringfeed.shards.options import ShardOptions
from ringfeed.shards.packing import plan_shards
from ringfeed.shards.sources.arrays import Arrays
from ringfeed.shards.sources.base import Part, Source, int_sizes
from ringfeed.shards.write import publish_shard, write_shard


def planned(tmp_path: Path):
    np.savez(tmp_path / "d.npz", x=np.arange(30, dtype=np.float32).reshape(10, 3),
             y=np.arange(10) % 2)
    opts = ShardOptions(src=tmp_path / "d.npz", out=tmp_path / "out", format="npz",
                        fields={"y": "cls"}, max_count=4)
    source = Arrays(opts)
    return source, plan_shards(source, opts)


def test_a_shard_is_written_to_temp_files_then_published_sidecar_and_all(tmp_path):
    source, shards = planned(tmp_path)
    out = tmp_path / "out"
    out.mkdir()
    seen: list[int] = []
    info, tmp, index_tmp = write_shard(source, shards[1], out, seen.append)
    assert len(seen) == 4 and sum(seen) > 0  # a progress callback per sample: its bytes
    assert not (out / info.name).exists() and tmp.parent == index_tmp.parent == out
    publish_shard(out, info, tmp, index_tmp)
    assert sorted(p.name for p in out.iterdir()) == ["train-000001.tar", "train-000001.tar.idx"]
    path = out / "train-000001.tar"
    assert (info.num_samples, info.bytes, info.sha256, info.index) == (
        4, path.stat().st_size, sha256_file(path), "train-000001.tar.idx")
    assert info.bytes == shards[1].bytes  # the planned size
    with open(path, "rb") as f:
        assert TarIndex.from_bytes((out / info.index).read_bytes()) == build_index(f)[0]


class Grown(Source):
    """A source whose samples grew after the scan planned them (a file rewritten meanwhile)."""

    def __init__(self, opts: ShardOptions):
        super().__init__(opts)
        self.parts = {"train": Part(NumberedKeys(3), int_sizes([member_bytes(self.planned())] * 3))}
        self.fields = {"txt": "text"}

    @staticmethod
    def planned(key: str = "000000") -> dict:
        return {"__key__": key, "txt": b"x" * 100}

    def sample(self, part: str, index: int) -> dict:
        return {"__key__": self.parts[part].keys[index], "txt": b"x" * 20_000}


def test_an_input_that_changed_since_the_scan_is_refused_and_leaves_nothing(tmp_path):
    opts = ShardOptions(src=tmp_path, out=tmp_path / "out", format="txt")
    source = Grown(opts)
    [shard] = plan_shards(source, opts)
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(UserError, match=r"train-000000.tar: \d+ bytes written, \d+ planned: did "
                                        "the input under .* change while sharding\\? Run again"):
        write_shard(source, shard, out)
    assert list(out.iterdir()) == []


def test_a_failed_publish_leaves_no_shard_without_its_sidecar(tmp_path, monkeypatch):
    source, shards = planned(tmp_path)
    out = tmp_path / "out"
    out.mkdir()
    info, tmp, index_tmp = write_shard(source, shards[0], out)
    publish = write_module.publish

    def sidecar_fails(src, dst):
        if str(dst).endswith(".idx"):
            publish(src, out / "no-such-dir" / "x")  # a real failure: the folder is not there
        publish(src, dst)

    monkeypatch.setattr(write_module, "publish", sidecar_fails)
    with pytest.raises(FileNotFoundError):
        publish_shard(out, info, tmp, index_tmp)
    assert list(out.iterdir()) == []  # neither the shard nor any temp file

"""`ringfeed verify OUT` (shards/verify.py): every shard re-hashed and re-counted against the
manifest, every index sidecar rebuilt from its tar and compared, tars the manifest omits listed;
each problem is a short phrase naming what differs. The shards are written by `ringfeed
shard`'s own writer (build.py) in this process, then damaged."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import numpy as np
import pytest
from tar_util import write_tar

from ringfeed.errors import UserError
from ringfeed.formats.manifest import Manifest, ShardInfo, Split
from ringfeed.formats.tarindex import TarIndex
from ringfeed.fsutil import sha256_file
from ringfeed.shards.build import shard_dataset
from ringfeed.shards.options import ShardOptions
from ringfeed.shards.verify import load_manifest, verify


@pytest.fixture
def out(tmp_path: Path) -> Path:
    """4 train shards of 5, 5, 5 and 3 samples (x.npy, cls) written by `ringfeed shard`."""
    src = tmp_path / "data.npz"
    np.savez(src, x=np.arange(54, dtype=np.float32).reshape(18, 3), y=np.arange(18) % 3)
    opts = ShardOptions(src=src, out=tmp_path / "out", format="npz", fields={"y": "cls"},
                        max_count=5, progress=False)
    return shard_dataset(opts).out


def problems(out: Path) -> dict[str, list[str]]:
    return {c.name: c.problems for c in verify(out).checks}


def test_shards_as_written_verify_clean(out):
    result = verify(out)
    assert [(c.name, c.num_samples, c.problems) for c in result.checks] == [
        (f"train-00000{i}.tar", n, []) for i, n in enumerate([5, 5, 5, 3])]
    assert result.bad == [] and result.unlisted == []
    assert [c.bytes for c in result.checks] == [(out / c.name).stat().st_size
                                               for c in result.checks]


def test_a_missing_shard_is_reported_and_the_others_still_checked(out):
    (out / "train-000001.tar").unlink()
    found = problems(out)
    assert found["train-000001.tar"] == ["missing"]
    assert [name for name, p in found.items() if p] == ["train-000001.tar"]


def test_changed_content_of_the_same_size_is_caught_by_the_hash(out):
    path = out / "train-000002.tar"
    data = bytearray(path.read_bytes())
    data[data.index(b"\x93NUMPY") + 100] ^= 0x01  # one bit of one sample's array
    path.write_bytes(bytes(data))
    assert problems(out)["train-000002.tar"] == [
        "sha256 differs from the manifest (content changed)"]


def test_a_shard_cut_short_is_named_with_what_to_do(out):
    path = out / "train-000000.tar"
    path.write_bytes(path.read_bytes()[:700])  # inside the first member's data
    assert problems(out)["train-000000.tar"] == [
        "not a readable tar (ReadError: unexpected end of data); re-download or re-create it"]


def test_size_and_count_are_checked_against_the_manifest(out):
    manifest = Manifest.load(out)
    shard = manifest.splits["train"].shards[3]
    manifest.splits["train"].shards[3] = dataclasses.replace(
        shard, num_samples=4, bytes=shard.bytes + 512)
    manifest.save(out)
    assert problems(out)["train-000003.tar"] == [
        f"{shard.bytes} bytes, manifest says {shard.bytes + 512}",
        "3 samples, manifest says 4"]


def test_a_shard_without_a_recorded_hash_is_checked_for_size_and_count_only(out):
    manifest = Manifest.load(out)
    manifest.splits["train"].shards = [dataclasses.replace(s, sha256=None)
                                       for s in manifest.splits["train"].shards]
    manifest.save(out)
    path = out / "train-000000.tar"
    data = bytearray(path.read_bytes())
    data[data.index(b"\x93NUMPY") + 100] ^= 0x01
    path.write_bytes(bytes(data))
    assert verify(out).bad == []


@pytest.mark.parametrize("damage, problem", [
    ("remove", "index sidecar train-000001.tar.idx is missing"),
    ("garbage", "index sidecar train-000001.tar.idx is not a valid index"),
    ("another shard's", "index sidecar train-000001.tar.idx does not match the shard: it "
                        "lists 3 samples, the tar holds 5 whole ones"),
    ("a same-sized shard's", "index sidecar train-000001.tar.idx does not match the shard: it "
                             "lists other sample keys ("),
    ("moved members", "index sidecar train-000001.tar.idx does not match the shard: same 5 "
                      "sample keys, but other member names, offsets or sizes"),
])
def test_each_index_sidecar_must_be_its_shards_index(out, damage, problem):
    sidecar = out / "train-000001.tar.idx"
    if damage == "remove":
        sidecar.unlink()
    elif damage == "garbage":
        sidecar.write_bytes(b"not an index")
    elif damage == "another shard's":
        sidecar.write_bytes((out / "train-000003.tar.idx").read_bytes())
    elif damage == "a same-sized shard's":
        sidecar.write_bytes((out / "train-000002.tar.idx").read_bytes())
    else:  # the shard's own index with every member 512 bytes later
        own = TarIndex.from_bytes(sidecar.read_bytes())
        index = dataclasses.replace(own, member_offset=own.member_offset + 512)
        sidecar.write_bytes(index.to_bytes())
    [found] = problems(out)["train-000001.tar"]
    assert found.startswith(problem)


def test_a_key_twice_in_one_shard_is_a_problem(tmp_path):
    path = write_tar(tmp_path / "train-0.tar",
                     [{"__key__": key, "txt": b"x"} for key in ("a", "b", "a")])
    Manifest({"train": Split([ShardInfo(path.name, 3, path.stat().st_size,
                                        sha256_file(path))])}).save(tmp_path)
    assert problems(tmp_path)["train-0.tar"] == ["sample key 'a' appears more than once"]


def test_tars_in_out_that_the_manifest_omits_are_listed(out):
    (out / "extra-000000.tar").write_bytes((out / "train-000000.tar").read_bytes())
    (out / "notes.txt").write_text("not a shard")
    result = verify(out)
    assert result.unlisted == ["extra-000000.tar"] and result.bad == []


@pytest.mark.parametrize("content, message", [
    (None, "no manifest.json (run `ringfeed shard` first)"),
    ("{", "not valid JSON"),
    ('{"format": "something-else"}', "not a ringfeed manifest"),
])
def test_a_missing_or_foreign_manifest_is_one_user_error(tmp_path, content, message):
    if content is not None:
        (tmp_path / "manifest.json").write_text(content)
    with pytest.raises(UserError, match=re.escape(message)):
        load_manifest(tmp_path)

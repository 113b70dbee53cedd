"""`ringfeed shard SRC --format wds-index` (shards/wds_index.py): existing WebDataset tars, written
by another tool (here Python's tarfile), get a manifest: which files are shards, their split by
name, counts, hashes, fields, classes, where each index sidecar goes, and the one-line errors
for shards the pipeline could not read as they are."""

from __future__ import annotations

from pathlib import Path

import pytest
from tar_util import write_tar

from ringfeed.errors import UserError
from ringfeed.formats.manifest import Manifest
from ringfeed.formats.tarindex import TarIndex, build_index
from ringfeed.fsutil import sha256_file
from ringfeed.shards.options import ShardOptions
from ringfeed.shards.wds_index import find_tars, index_shards, sidecar_name, split_of


def labelled(prefix: str, classes: list[int]) -> list[dict[str, bytes]]:
    return [{"__key__": f"{prefix}{i:04d}", "cls": b"%d" % c, "txt": f"sample {i}".encode()}
            for i, c in enumerate(classes)]


def index(src: Path, out: Path | None = None, **options) -> tuple[Manifest, list[str]]:
    run = index_shards(ShardOptions(src=src, out=out or src, format="wds-index", **options))
    return Manifest.load(out or src), run.written


# -- which files, which split -----------------------------------------------------------------
def test_a_folders_tars_are_its_shards_in_natural_order(tmp_path):
    for name in ("shard-10.tar", "shard-2.tar", "shard-1.tar.gz", ".hidden.tar", "notes.txt"):
        (tmp_path / name).write_bytes(b"")
    assert [p.name for p in find_tars(str(tmp_path))] == ["shard-1.tar.gz", "shard-2.tar",
                                                         "shard-10.tar"]
    assert [p.name for p in find_tars(str(tmp_path / "shard-{1..2}.tar*"))] == [
        "shard-1.tar.gz", "shard-2.tar"]
    assert find_tars(str(tmp_path / "shard-10.tar")) == [tmp_path / "shard-10.tar"]


def test_no_tars_is_one_line_naming_src(tmp_path):
    (tmp_path / "a.zip").write_bytes(b"")
    with pytest.raises(UserError, match=f"{tmp_path}: no tar shards found"):
        find_tars(str(tmp_path))


@pytest.mark.parametrize("name, split", [
    ("train-000000.tar", "train"), ("val_3.tar", "val"), ("validation-1.tar.gz", "val"),
    ("dev.0.tar", "val"), ("TEST-2.tar", "test"), ("shard-000001.tar", "train"),
    ("000001.tar", "train"), ("trainval-0.tar", "train"),
])
def test_a_shards_split_comes_from_its_name(name, split):
    assert split_of(Path(name)) == split


@pytest.mark.parametrize("shard, sidecar", [
    ("train-0.tar", "train-0.tar.idx"),
    ("sub/train-0.tar", "sub/train-0.tar.idx"),
    ("../elsewhere/train-0.tar", "index/0123456789abcdef-train-0.tar.idx"),
    ("s3://bucket/train-0.tar", "index/0123456789abcdef-train-0.tar.idx"),
])
def test_a_sidecar_sits_beside_its_shard_unless_that_leaves_out(shard, sidecar):
    assert sidecar_name(shard, "0123456789abcdef" + "9" * 48) == sidecar


# -- the manifest -----------------------------------------------------------------------------
def test_the_manifest_records_each_shard_as_read_and_its_index_beside_it(tmp_path):
    write_tar(tmp_path / "train-1.tar", labelled("a", [0, 1, 1]))
    write_tar(tmp_path / "train-0.tar", labelled("b", [2, 0]))
    write_tar(tmp_path / "val-0.tar", labelled("c", [4]))
    manifest, written = index(tmp_path)
    assert list(manifest.splits) == ["train", "val"]
    shards = manifest.splits["train"].shards
    assert [(s.name, s.num_samples) for s in shards] == [("train-0.tar", 2), ("train-1.tar", 3)]
    for s in [*shards, *manifest.splits["val"].shards]:
        assert s.bytes == (tmp_path / s.name).stat().st_size
        assert s.sha256 == sha256_file(tmp_path / s.name)
        assert s.index == s.name + ".idx"
        with open(tmp_path / s.name, "rb") as f:
            assert TarIndex.from_bytes((tmp_path / s.index).read_bytes()) == build_index(f)[0]
    assert manifest.fields == {"cls": "int", "txt": "text"}
    assert manifest.classes == {"field": "cls", "ids": [0, 1, 2, 4], "counts": [2, 2, 1, 1],
                                "num_classes": 5}
    assert manifest.source["format"] == "wds-index"
    assert written == ["train-0.tar.idx", "train-1.tar.idx", "val-0.tar.idx", "manifest.json"]


def test_split_option_puts_every_shard_in_one_split(tmp_path):
    write_tar(tmp_path / "train-0.tar", labelled("a", [0]))
    write_tar(tmp_path / "val-0.tar", labelled("b", [1]))
    manifest, _ = index(tmp_path, split="test")
    assert list(manifest.splits) == ["test"]
    assert [s.name for s in manifest.splits["test"].shards] == ["train-0.tar", "val-0.tar"]


@pytest.mark.parametrize("mode, suffix", [("w:gz", ".tar.gz"), ("w:xz", ".tar.xz")])
def test_a_compressed_shard_is_counted_and_hashed_as_stored_but_gets_no_sidecar(tmp_path,
                                                                               mode, suffix):
    path = write_tar(tmp_path / f"train-0{suffix}", labelled("a", [3, 3, 1]), mode)
    manifest, written = index(tmp_path)
    [shard] = manifest.splits["train"].shards
    assert (shard.num_samples, shard.index) == (3, None)
    assert (shard.bytes, shard.sha256) == (path.stat().st_size, sha256_file(path))
    assert manifest.classes["ids"] == [1, 3] and manifest.classes["counts"] == [1, 2]
    assert written == ["manifest.json"]


def test_shards_outside_out_are_named_relative_to_it_with_sidecars_under_index(tmp_path):
    src = tmp_path / "wds"
    path = write_tar(src / "train-0.tar", labelled("a", [0, 1]))
    manifest, _ = index(src, out=tmp_path / "meta")
    [shard] = manifest.splits["train"].shards
    assert shard.name == "../wds/train-0.tar"
    assert shard.index == f"index/{sha256_file(path)[:16]}-train-0.tar.idx"
    assert (tmp_path / "meta" / shard.index).is_file()
    assert not (src / "manifest.json").exists()


# -- what stops it: one line naming the shard -------------------------------------------------
def test_a_key_twice_in_a_shard_is_refused(tmp_path):
    samples = labelled("a", [0, 1])
    write_tar(tmp_path / "train-0.tar", [*samples, samples[0]])
    with pytest.raises(UserError, match=r"train-0.tar: sample key 'a0000' appears more than once"):
        index(tmp_path)
    assert not (tmp_path / "manifest.json").exists()


@pytest.mark.parametrize("cls, message", [(b"-1", "class id -1 in a cls member"),
                                          (b"cat", "a cls member is not a class index")])
def test_a_cls_member_must_be_a_class_index(tmp_path, cls, message):
    write_tar(tmp_path / "train-0.tar", [{"__key__": "a", "cls": cls}])
    with pytest.raises(UserError, match=message):
        index(tmp_path)


@pytest.mark.parametrize("damage", ["truncated", "not a tar", "bad gzip"])
def test_a_shard_that_cannot_be_read_whole_is_named_with_what_to_do(tmp_path, damage):
    write_tar(tmp_path / "train-0.tar", labelled("a", [0]))
    if damage == "truncated":
        path = write_tar(tmp_path / "train-1.tar", labelled("b", [0] * 20))
        path.write_bytes(path.read_bytes()[:1200])
    elif damage == "not a tar":
        path = tmp_path / "train-1.tar"
        path.write_bytes(b"PK\x03\x04 this is a zip file" * 40)
    else:
        path = write_tar(tmp_path / "train-1.tar.gz", labelled("b", [0] * 20), "w:gz")
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0xFF
        path.write_bytes(bytes(data))
    with pytest.raises(UserError) as exc:
        index(tmp_path)
    line = str(exc.value)
    assert line.startswith(f"{path}: ") and "re-download or re-create it" in line
    assert "\n" not in line
    assert not (tmp_path / "manifest.json").exists()
    assert not (tmp_path / "train-0.tar.idx").exists()  # sidecars only once every shard read


def test_an_existing_manifest_is_replaced_only_with_overwrite(tmp_path):
    write_tar(tmp_path / "train-0.tar", labelled("a", [0]))
    index(tmp_path)
    write_tar(tmp_path / "train-1.tar", labelled("b", [1, 1]))
    with pytest.raises(UserError, match="manifest.json exists; pass --overwrite"):
        index(tmp_path)
    manifest, _ = index(tmp_path, overwrite=True)
    assert manifest.splits["train"].num_samples == 3


def test_out_must_be_a_folder(tmp_path):
    write_tar(tmp_path / "wds" / "train-0.tar", labelled("a", [0]))
    (tmp_path / "out").write_text("a file")
    with pytest.raises(UserError, match="out: exists and is not a folder"):
        index(tmp_path / "wds", out=tmp_path / "out")

"""`ringfeed shard --format npz|npy` (shards/sources/arrays.py): which arrays a source holds, the
member each becomes, the sample axis they must share, and each sample's planned tar bytes."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest
from tar_util import member_bytes

from ringfeed.errors import UserError
from ringfeed.shards.options import ShardOptions
from ringfeed.shards.sources.arrays import Arrays


def scan(src: Path, fmt: str = "npz", **fields: str) -> Arrays:
    return Arrays(ShardOptions(src=src, out=src.parent / "out", format=fmt, fields=fields))


def load(data: bytes) -> np.ndarray:
    return np.load(io.BytesIO(data), allow_pickle=False)


def test_an_npz_gives_one_npy_member_per_array_and_cls_for_a_class_field(tmp_path):
    x = np.arange(12, dtype=np.float32).reshape(4, 3)
    y = np.array([2, 0, 2, 1])
    np.savez(tmp_path / "d.npz", x=x, y=y, Big_Name=np.zeros((4, 2, 2), np.uint8))
    source = scan(tmp_path / "d.npz", y="cls")
    assert source.fields == {"x.npy": "npy", "cls": "int", "big_name.npy": "npy"}
    assert list(source.parts) == ["train"] and len(source.parts["train"]) == 4
    assert list(source.parts["train"].keys) == ["000000", "000001", "000002", "000003"]
    sample = source.sample("train", 2)
    assert sample["__key__"] == "000002" and sample["cls"] == b"2"
    assert np.array_equal(load(sample["x.npy"]), x[2])
    assert source.parts["train"].labels.tolist() == y.tolist()  # for a stratified val split
    assert source.classes == {"field": "cls", "ids": [0, 1, 2], "counts": [1, 1, 2],
                              "num_classes": 3}


def test_each_samples_planned_bytes_are_what_the_writer_writes(tmp_path):
    np.savez(tmp_path / "d.npz", x=np.ones((5, 7), np.float64), y=np.array([1, 22, 333, 4, 5]),
             t=np.array(["a", "bb", "c", "dddd", ""]))
    source = scan(tmp_path / "d.npz", y="cls", t="txt")
    assert [member_bytes(source.sample("train", i)) for i in range(5)] == \
        source.parts["train"].sizes.tolist()


def test_split_files_and_a_folder_of_npy_files(tmp_path):
    for split, n in (("train", 6), ("val", 2)):
        np.savez(tmp_path / f"{split}.npz", x=np.zeros((n, 2)), y=np.arange(n))
    source = scan(tmp_path)
    assert {k: len(p) for k, p in source.parts.items()} == {"train": 6, "val": 2}
    folder = tmp_path / "arrays"
    folder.mkdir()
    np.save(folder / "image.npy", np.zeros((3, 2, 2), np.uint8))
    np.save(folder / "label.npy", np.arange(3))
    (folder / "README.txt").write_text("not an array")
    assert scan(folder, "npy", label="cls").fields == {"image.npy": "npy", "cls": "int"}


@pytest.mark.parametrize("arrays, fields, message", [
    ({"x": np.zeros((3, 2)), "y": np.zeros(4)}, {},
     r"arrays must share their first \(sample\) axis: x\(3, 2\), y\(4,\)"),
    ({"x": np.zeros((0, 2))}, {}, r"the arrays hold no samples \(first axis is 0\)"),
    ({"x": np.zeros(3)}, {"y": "cls"}, r"no array 'y' \(arrays: x\)"),
    ({"x": np.zeros(3), "X": np.zeros(3)}, {}, "two arrays map to the same member"),
    ({"x": np.zeros(3)}, {"x": "Bad Ext"}, "is not a usable member extension"),
    ({"s": np.zeros(())}, {}, "arrays must share their first"),
])
def test_arrays_that_cannot_be_samples_are_one_line(tmp_path, arrays, fields, message):
    np.savez(tmp_path / "d.npz", **arrays)
    with pytest.raises(UserError, match=message):
        scan(tmp_path / "d.npz", **fields)


def test_object_arrays_and_files_that_are_not_numpys_are_refused(tmp_path):
    np.save(tmp_path / "o.npy", np.array([{"a": 1}, None], dtype=object), allow_pickle=True)
    with pytest.raises(UserError, match="not a readable .npy file"):
        scan(tmp_path / "o.npy", "npy")
    (tmp_path / "table.npy").write_text("a,b\n1,2\n")
    with pytest.raises(UserError, match=r"not a .npy or .npz file \(no numpy header; a table "
                                        "is --format csv, jsonl or parquet\\)"):
        scan(tmp_path / "table.npy", "npy")
    (tmp_path / "broken.npz").write_bytes(b"PK\x03\x04" + b"\x00" * 50)
    with pytest.raises(UserError, match="not a readable .npz file"):
        scan(tmp_path / "broken.npz")

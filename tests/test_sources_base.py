"""What every `ringfeed shard` source shares (shards/sources/base.py, and `open_source` in
shards/sources/__init__.py): a source's splits from its entries' names, the manifest's class
record, the scan's work folder, and which format reads SRC."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest

from ringfeed.errors import UserError
from ringfeed.shards.options import ShardOptions
from ringfeed.shards.sources import open_source
from ringfeed.shards.sources.base import WorkDir, class_record, source_splits, visible


def entries(root: Path, *names: str) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    for name in names:
        (root / name).mkdir() if "." not in name else (root / name).write_text("x")
    return root


@pytest.mark.parametrize("names, splits", [
    (("train", "val"), {"train": "train", "val": "val"}),
    (("Training.npz", "validation.npz", "test.npz"),
     {"train": "Training.npz", "val": "validation.npz", "test": "test.npz"}),
    (("train.jsonl", "dev.jsonl", ".DS_Store"), {"train": "train.jsonl", "val": "dev.jsonl"}),
])
def test_a_folder_whose_every_entry_is_named_like_a_split_is_split_so(tmp_path, names, splits):
    root = entries(tmp_path / "src", *names)
    assert source_splits(root) == {k: root / v for k, v in splits.items()}


@pytest.mark.parametrize("names", [("train", "cats"), ("val", "test"), ("a.npz",)])
def test_otherwise_the_whole_source_is_one_train_part(tmp_path, names):
    assert source_splits(entries(tmp_path / "src", *names)) is None


def test_a_file_is_not_split_and_two_entries_of_one_split_are_refused(tmp_path):
    assert source_splits(entries(tmp_path, "train.npz") / "train.npz") is None
    root = entries(tmp_path / "src", "train.npz", "val.npz", "valid.npz")
    with pytest.raises(UserError, match="val.npz and .*valid.npz are both split 'val'"):
        source_splits(root)


def test_hidden_entries_are_not_part_of_a_source(tmp_path):
    root = entries(tmp_path / "src", ".git", "b.txt", "a.txt")
    assert [p.name for p in visible(root)] == ["a.txt", "b.txt"]


def test_the_class_record_lists_the_ids_seen_with_their_counts():
    assert class_record(Counter()) is None
    assert class_record(Counter([3, 0, 3])) == {"field": "cls", "ids": [0, 3], "counts": [1, 2],
                                                 "num_classes": 4}
    assert class_record(Counter([1]), num_classes=10)["num_classes"] == 10


def test_the_work_folder_goes_and_takes_out_with_it_only_if_the_scan_made_out(tmp_path):
    work = WorkDir(tmp_path / "new-out")
    (work.make() / "train.tokens").write_bytes(b"t")
    work.remove()
    assert not (tmp_path / "new-out").exists()
    (tmp_path / "old-out").mkdir()
    work = WorkDir(tmp_path / "old-out")
    work.make()
    work.remove()
    assert (tmp_path / "old-out").is_dir() and not work.path.exists()


def test_open_source_refuses_a_missing_src_and_an_unknown_format(tmp_path):
    with pytest.raises(UserError, match=f"{tmp_path / 'nope'}: no such file or folder"):
        open_source(ShardOptions(src=tmp_path / "nope", out=tmp_path / "o", format="npz"))
    with pytest.raises(UserError, match="unknown --format 'tfrecord' \\(choose from: "
                                        "imagefolder, jsonl"):
        open_source(ShardOptions(src=tmp_path, out=tmp_path / "o", format="tfrecord"))

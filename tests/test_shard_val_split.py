"""`ringfeed shard VAL_FOLDER OUT --format imagefolder --split val` (issue 46): a folder of
validation images alone becomes the val split of an existing shard set, with the train split's
class ids: the same shards and manifest as one run over SRC/{train,val}; a class the train split
lacks, or a split that is there, is one line and exit 2; --overwrite replaces the split."""

from __future__ import annotations

import json
import shutil

import pytest
from shards_util import cli, make_images, manifest, tree_bytes

pytestmark = pytest.mark.integration

ARGS = ["--format", "imagefolder", "--max-count", "4"]


@pytest.mark.timeout(120)
def test_a_val_folder_becomes_the_val_split(capsys, tmp_path):
    both = tmp_path / "both"
    make_images(both / "train", {"ant": 6, "bee": 5, "cat": 7}, seed=1)
    make_images(both / "val", {"ant": 3, "cat": 6}, seed=2)  # no bee: ids still the train's
    assert cli(capsys, "shard", both, tmp_path / "one", *ARGS)[0] == 0
    out = tmp_path / "out"
    assert cli(capsys, "shard", both / "train", out, *ARGS)[0] == 0
    code, stdout, err = cli(capsys, "shard", both / "val", out, *ARGS, "--split", "val")
    assert code == 0, err
    assert "27 samples, 8 shards (train 5, val 3)" in stdout
    expected, got = tree_bytes(tmp_path / "one"), tree_bytes(out)
    assert {n: b for n, b in got.items() if not n.startswith("manifest")} == {
        n: b for n, b in expected.items() if not n.startswith("manifest")}
    m, one = manifest(out), json.loads(expected["manifest.json"])
    assert m["source"]["added_splits"]["val"]["path"] == str(both / "val")
    for key in ("source", "skipped"):
        m.pop(key), one.pop(key)
    assert m == one  # splits, fields, class names, class counts
    code, stdout, _ = cli(capsys, "verify", out)
    assert code == 0 and "all OK" in stdout

    # the split is there: refused without --overwrite, replaced with it (a smaller one)
    code, _, err = cli(capsys, "shard", both / "val", out, *ARGS, "--split", "val")
    assert code == 2 and err.count("\n") == 1
    assert f"{out} already has split 'val' (3 shards); pass --overwrite" in err
    small = make_images(tmp_path / "small", {"bee": 2}, seed=3)
    code, stdout, err = cli(capsys, "shard", small, out, *ARGS, "--split", "val", "--overwrite")
    assert code == 0, err
    m = manifest(out)
    assert [s["name"] for s in m["splits"]["val"]["shards"]] == ["val-000000.tar"]
    assert not (out / "val-000001.tar").exists() and not (out / "val-000002.tar").exists()
    assert m["splits"]["val"]["shards"][0]["num_samples"] == 2
    assert cli(capsys, "verify", out)[0] == 0


@pytest.mark.timeout(60)
def test_a_class_the_train_split_lacks_and_other_misuse(capsys, tmp_path):
    train = make_images(tmp_path / "train", {"ant": 3, "bee": 3})
    val = make_images(tmp_path / "val", {"ant": 2, "wasp": 2})
    out = tmp_path / "out"
    code, _, err = cli(capsys, "shard", val, out, *ARGS, "--split", "val")
    assert code == 2 and "no manifest.json" in err and "shard the train split first" in err
    assert cli(capsys, "shard", train, out, *ARGS)[0] == 0
    before = tree_bytes(out)
    code, _, err = cli(capsys, "shard", val, out, *ARGS, "--split", "val")
    assert code == 2 and err.count("\n") == 1
    assert f"{val / 'wasp'}: class 'wasp' is not one of the 2 classes of the train split" in err
    assert tree_bytes(out) == before  # nothing written
    code, _, err = cli(capsys, "shard", val, out, *ARGS, "--split", "val", "--val-fraction", "0.1")
    assert code == 2 and "drop --val-fraction" in err
    shutil.rmtree(val / "wasp")
    code, _, err = cli(capsys, "shard", val, out, "--format", "csv", "--split", "val")
    assert code == 2 and "--split does not apply to --format csv" in err
    assert cli(capsys, "shard", val, out, *ARGS, "--split", "holdout")[0] == 0
    assert list(manifest(out)["splits"]) == ["train", "holdout"]
    table = tmp_path / "t.csv"
    table.write_text("a,label\n1,0\n2,1\n")
    assert cli(capsys, "shard", table, tmp_path / "table", "--format", "csv",
               "--field", "label=cls")[0] == 0
    code, _, err = cli(capsys, "shard", val, tmp_path / "table", *ARGS, "--split", "val")
    assert code == 2 and "is not an image folder's shards (format 'csv')" in err

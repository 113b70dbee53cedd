"""Typed tables (issue 14), sharding side, in-process and fast: CSV/JSONL/Parquet numbers keep
their types, numeric columns become one float32 x.npy with per-feature mean/std over the train
split in the manifest, --features / --categorical / --fill, one-line errors naming row and
column, Parquet lists / images / Hugging Face split files / text columns, wds-index classes, and
the trainer reading all of that without being told (input, classes, standardisation)."""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from shards_util import cli, load_npy, manifest, split_samples, tree_bytes
from tabular_util import write_csv, write_parquet

from ringfeed.formats.manifest import Manifest


def write_rows(path: Path, header: list[str], rows: list[list]) -> Path:
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(header)
        w.writerows(rows)
    return path


def by_key(out: Path, split: str = "train") -> dict[str, dict[str, bytes]]:
    return {s["__key__"]: s for s in split_samples(out, split)}


def assert_one_error_line(code: int, err: str, *expected: str) -> None:
    assert code == 2, err
    assert err.count("\n") == 1 and err.startswith("ringfeed: error: "), err
    for text in expected:
        assert text in err, err


def png(value: int) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(np.full((4, 4, 3), value, np.uint8)).save(buf, format="PNG")
    return buf.getvalue()


# -- CSV and JSONL: typed cells, the default x.npy, statistics --------------------------------
def test_csv_cells_are_typed_and_round_trip(capsys, tmp_path):
    rows = [[f"r{i}", i * 7 - 20, 0.1 * i + 1e-7, i % 3 == 0, f"00{i}", i % 2, 1000.5 + i / 3]
            for i in range(20)]
    src = write_rows(tmp_path / "t.csv", ["id", "n", "f", "flag", "code", "label", "price"], rows)
    out = tmp_path / "out"
    code, _, err = cli(capsys, "shard", src, out, "--format", "csv", "--field", "label=cls",
                       "--field", "price=y.npy", "--field", "n=n.npy", "--key", "id",
                       "--val-fraction", "0.25", "--shuffle-seed", "1")
    assert code == 0, err
    m = manifest(out)
    assert m["fields"] == {"cls": "int", "y.npy": "npy", "n.npy": "npy", "x.npy": "npy",
                           "json": "json"}
    x = m["features"]["x.npy"]
    assert x["role"] == "features" and x["names"] == ["f", "flag"]
    assert x["dtype"] == "float32" and x["shape"] == [2]
    train = by_key(out, "train")
    assert len(train) == 15 and len(by_key(out, "val")) == 5
    for key, s in {**train, **by_key(out, "val")}.items():
        row = rows[int(key[1:])]
        y, n = load_npy(s["y.npy"]), load_npy(s["n.npy"])
        assert y.dtype == np.float64 and y == float(repr(row[6]))  # every digit back
        assert n.dtype == np.int64 and n == row[1]
        np.testing.assert_array_equal(load_npy(s["x.npy"]), np.float32([row[2], row[3]]))
        assert int(s["cls"]) == row[5]
        # text stays text ("001" is not the number 1), and the key column stays as written
        assert json.loads(s["json"]) == {"id": row[0], "code": row[4]}
    # per-feature mean/std (population) over the train split's samples, not val's
    train_x = np.stack([load_npy(s["x.npy"]) for s in train.values()]).astype(np.float64)
    np.testing.assert_allclose(x["mean"], train_x.mean(0), rtol=1e-12)
    np.testing.assert_allclose(x["std"], train_x.std(0), rtol=1e-12)
    y_stats = m["features"]["y.npy"]
    assert y_stats["dtype"] == "float64" and y_stats["shape"] == [1]
    train_y = [load_npy(s["y.npy"]) for s in train.values()]
    assert y_stats["min"] == min(train_y) and y_stats["max"] == max(train_y)
    assert m["classes"] == {"field": "cls", "ids": [0, 1], "counts": [10, 10], "num_classes": 2}


def test_jsonl_values_keep_their_json_types(capsys, tmp_path):
    rows = [{"id": f"d{i}", "n": i, "f": i / 4, "flag": i % 2 == 1, "tags": ["a", i],
             "meta": {"k": i}, "label": i % 3} for i in range(9)]
    src = tmp_path / "rows.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "out"
    code, _, err = cli(capsys, "shard", src, out, "--format", "jsonl", "--field", "label=cls",
                       "--field", "n=n.npy")
    assert code == 0, err
    assert manifest(out)["features"]["x.npy"]["names"] == ["f", "flag"]
    for i, s in enumerate(split_samples(out, "train")):
        assert load_npy(s["n.npy"]).dtype == np.int64 and load_npy(s["n.npy"]) == i
        np.testing.assert_array_equal(load_npy(s["x.npy"]), np.float32([i / 4, i % 2 == 1]))
        rest = json.loads(s["json"])
        assert rest == {"id": f"d{i}", "tags": ["a", i], "meta": {"k": i}}
        assert type(rest["tags"][1]) is int


def test_breast_cancer_csv_and_parquet_give_the_same_samples(capsys, tmp_path):
    csv_out, pq_out = tmp_path / "csv", tmp_path / "pq"
    common = ["--field", "label=cls", "--val-fraction", "0.2", "--shuffle-seed", "0"]
    assert cli(capsys, "shard", write_csv(tmp_path / "t.csv", "breast_cancer"), csv_out,
               "--format", "csv", *common)[0] == 0
    assert cli(capsys, "shard", write_parquet(tmp_path / "t.parquet", "breast_cancer"), pq_out,
               "--format", "parquet", *common)[0] == 0
    a, b = manifest(csv_out), manifest(pq_out)
    assert a["features"] == b["features"] and a["classes"] == b["classes"]
    assert a["classes"]["num_classes"] == 2 and len(a["features"]["x.npy"]["names"]) == 30
    assert a["splits"] == b["splits"]  # same sizes and bytes: same tars
    assert (csv_out / "train-000000.tar").read_bytes() == (pq_out / "train-000000.tar").read_bytes()


# -- choosing the columns ---------------------------------------------------------------------
def test_features_specs_globs_numeric_and_categorical(capsys, tmp_path):
    colors, species = ["red", "green", "blue"], ["setosa", "virginica"]
    rows = [[i, i * 2, i + 0.5, -i, i * 10, colors[i % 3], species[i % 2], f"t{i}"]
            for i in range(12)]
    src = write_rows(tmp_path / "t.csv",
                     ["a", "b", "pix_0", "pix_1", "pix_2", "color", "species", "note"], rows)
    out = tmp_path / "out"
    code, _, err = cli(capsys, "shard", src, out, "--format", "csv",
                       "--features", "a,b=ab.npy", "--features", "pix_*,color=x.npy",
                       "--categorical", "color", "--categorical", "species",
                       "--field", "species=cls")
    assert code == 0, err
    m = manifest(out)
    x = m["features"]["x.npy"]
    assert x["names"] == ["pix_0", "pix_1", "pix_2", "color=blue", "color=green", "color=red"]
    assert x["vocabulary"] == {"color": ["blue", "green", "red"]}
    assert m["class_names"] == species and m["classes"]["num_classes"] == 2
    assert m["features"]["cls"]["vocabulary"] == species
    for i, s in enumerate(split_samples(out, "train")):
        onehot = [float(c == colors[i % 3]) for c in ["blue", "green", "red"]]
        np.testing.assert_array_equal(load_npy(s["x.npy"]),
                                      np.float32([i + 0.5, -i, i * 10, *onehot]))
        np.testing.assert_array_equal(load_npy(s["ab.npy"]), np.float32([i, i * 2]))
        assert int(s["cls"]) == i % 2
        assert json.loads(s["json"]) == {"note": f"t{i}"}

    # `numeric`: every numeric column no other option names
    out2 = tmp_path / "out2"
    assert cli(capsys, "shard", src, out2, "--format", "csv", "--field", "a=cls",
               "--features", "b=b.npy", "--features", "numeric=x.npy")[0] == 0
    assert manifest(out2)["features"]["x.npy"]["names"] == ["pix_0", "pix_1", "pix_2"]

    code, _, err = cli(capsys, "shard", src, tmp_path / "o3", "--format", "csv",
                       "--features", "a,nosuch=x.npy")
    assert_one_error_line(code, err, "no column 'nosuch' named by --features a,nosuch")
    code, _, err = cli(capsys, "shard", src, tmp_path / "o4", "--format", "csv",
                       "--features", "a,note=x.npy")
    assert_one_error_line(code, err, "t.csv:2: column 'note': 't0', not numbers",
                          "--categorical note")
    code, _, err = cli(capsys, "shard", src, tmp_path / "o5", "--format", "csv",
                       "--field", "species=cls")
    assert_one_error_line(code, err, "t.csv:2: field 'species': cannot store 'setosa' as .cls",
                          "--categorical species")


def test_a_missing_or_non_numeric_cell_is_one_line_naming_row_and_column(capsys, tmp_path):
    rows = [[i, i * 2.5, i % 2] for i in range(6)]
    rows[2][1] = ""  # data row 3 = line 4 of the file
    src = write_rows(tmp_path / "t.csv", ["a", "b", "label"], rows)
    before = tree_bytes(tmp_path)
    code, stdout, err = cli(capsys, "shard", src, tmp_path / "out", "--format", "csv",
                            "--field", "label=cls")
    assert_one_error_line(code, err, "t.csv:4: column 'b' has no value", "--fill VALUE")
    assert stdout == "" and tree_bytes(tmp_path) == before  # nothing written, no OUT

    code, _, err = cli(capsys, "shard", src, tmp_path / "out", "--format", "csv",
                       "--field", "label=cls", "--fill", "-1")
    assert code == 0, err
    got = by_key(tmp_path / "out")
    np.testing.assert_array_equal(load_npy(got["000002"]["x.npy"]), np.float32([2, -1]))
    assert manifest(tmp_path / "out")["features"]["x.npy"]["filled"] == {"b": 1}

    rows[2][1] = "n/a"  # a missing marker, like pandas' NaN written out
    rows[4][1] = "4,5"  # a typo in a numeric column
    src = write_rows(tmp_path / "bad.csv", ["a", "b", "label"], rows)
    code, _, err = cli(capsys, "shard", src, tmp_path / "out2", "--format", "csv",
                       "--field", "label=cls", "--fill", "0")
    assert_one_error_line(code, err, "bad.csv:6: column 'b': '4,5' is not a number")
    assert not (tmp_path / "out2").exists()

    table = pa.table({"a": [1.0, 2.0, None, 4.0], "label": [0, 1, 0, 1]})
    pq.write_table(table, tmp_path / "t.parquet", row_group_size=2)
    code, _, err = cli(capsys, "shard", tmp_path / "t.parquet", tmp_path / "out3",
                       "--format", "parquet", "--field", "label=cls")
    assert_one_error_line(code, err, "t.parquet: row 2: column 'a' has no value")

    jsonl = tmp_path / "t.jsonl"
    jsonl.write_text('{"a": 1, "label": 0}\n{"label": 1}\n')
    code, _, err = cli(capsys, "shard", jsonl, tmp_path / "out4", "--format", "jsonl",
                       "--field", "label=cls")
    assert_one_error_line(code, err, "t.jsonl:2: column 'a' has no value")
    assert cli(capsys, "shard", jsonl, tmp_path / "out4", "--format", "jsonl",
               "--field", "label=cls", "--fill", "7")[0] == 0


# -- Parquet ---------------------------------------------------------------------------------
def test_parquet_types_lists_images_and_row_groups(capsys, tmp_path):
    n = 30
    table = pa.table({
        "image": pa.array([{"bytes": png(i), "path": f"img{i}.png"} for i in range(n)]),
        "raw": pa.array([png(255 - i) for i in range(n)], pa.binary()),
        "emb": pa.array([np.arange(4, dtype=np.float32) * i for i in range(n)],
                        pa.list_(pa.float32())),
        "count": pa.array(range(n), pa.int32()),
        "ratio": pa.array([i / 7 for i in range(n)]),
        "ok": pa.array([i % 3 == 0 for i in range(n)]),
        "name": pa.array([f"name {i}" for i in range(n)]),
        "when": pa.array(np.arange(n).astype("datetime64[s]")),
        "label": pa.array([i % 4 for i in range(n)], pa.int16()),
    })
    src = tmp_path / "t.parquet"
    pq.write_table(table, src, row_group_size=7)
    assert pq.ParquetFile(src).num_row_groups == 5
    out = tmp_path / "out"
    code, _, err = cli(capsys, "shard", src, out, "--format", "parquet", "--field", "image=png",
                       "--field", "raw=jpg", "--field", "emb=emb.npy", "--field", "label=cls",
                       "--max-count", "8")
    assert code == 0, err
    m = manifest(out)
    assert m["fields"] == {"png": "image", "jpg": "image", "emb.npy": "npy", "cls": "int",
                           "x.npy": "npy", "json": "json"}
    assert m["features"]["x.npy"]["names"] == ["count", "ratio", "ok"]
    assert m["features"]["emb.npy"]["dtype"] == "float32"
    assert m["features"]["emb.npy"]["shape"] == [4]
    assert m["classes"]["num_classes"] == 4
    for i, s in enumerate(split_samples(out, "train")):
        assert s["png"] == png(i) and s["jpg"] == png(255 - i)
        emb = load_npy(s["emb.npy"])
        assert emb.dtype == np.float32 and emb.tolist() == [0, i, 2 * i, 3 * i]
        np.testing.assert_array_equal(load_npy(s["x.npy"]), np.float32([i, i / 7, i % 3 == 0]))
        rest = json.loads(s["json"])
        assert rest["name"] == f"name {i}" and rest["when"].startswith("1970-01-01 00:00:")
    code, _, err = cli(capsys, "shard", src, tmp_path / "o2", "--format", "parquet",
                       "--field", "image=png", "--field", "label=cls")
    assert_one_error_line(code, err, "column 'raw' holds binary data", "--field raw=jpg")
    code, _, err = cli(capsys, "shard", tmp_path / "t.csv", tmp_path / "o3", "--format",
                       "parquet")
    assert_one_error_line(code, err, "t.csv: no such file or folder")
    (tmp_path / "junk.parquet").write_text("not parquet")
    code, _, err = cli(capsys, "shard", tmp_path / "junk.parquet", tmp_path / "o3",
                       "--format", "parquet")
    assert_one_error_line(code, err, "junk.parquet: not a readable Parquet file")


def test_parquet_folder_split_by_file_name_like_hugging_face(capsys, tmp_path):
    src = tmp_path / "data"
    src.mkdir()
    for name, start, count in (("train-00000-of-00002", 0, 5), ("train-00001-of-00002", 5, 4),
                               ("test-00000-of-00001", 100, 3)):
        pq.write_table(pa.table({"v": list(range(start, start + count)),
                                 "label": [0] * count}), src / f"{name}.parquet")
    out = tmp_path / "out"
    assert cli(capsys, "shard", src, out, "--format", "parquet", "--field", "label=cls")[0] == 0
    values = {split: [float(load_npy(s["x.npy"])[0]) for s in split_samples(out, split)]
              for split in ("train", "test")}
    assert values == {"train": list(range(9)), "test": [100, 101, 102]}


def test_parquet_text_column_for_the_tokenizer(capsys, tmp_path):
    docs = ["first document", None, "second, longer document", "third"]
    pq.write_table(pa.table({"content": docs, "n": [1, 2, 3, 4]}), tmp_path / "d.parquet",
                   row_group_size=2)
    out = tmp_path / "out"
    code, _, err = cli(capsys, "shard", tmp_path / "d.parquet", out, "--format", "text",
                       "--text-field", "content", "--seq-len", "8")
    assert code == 0, err
    stream = b"".join(d.encode() + b"\x00" for d in docs if d is not None)
    expected = [256 if b == 0 else b for b in stream]
    got = np.concatenate([load_npy(s["tokens.npy"]) for s in split_samples(out, "train")])
    assert got.tolist() == expected[: len(expected) // 8 * 8]
    assert manifest(out)["text"]["documents"] == 3
    code, _, err = cli(capsys, "shard", tmp_path / "d.parquet", tmp_path / "o2", "--format",
                       "text", "--text-field", "n")
    assert_one_error_line(code, err, "column 'n' is int64, not text", "--text-field")


# -- the trainer reads it all from the manifest -------------------------------------------------
class _Cfg:
    """The config fields infer_spec reads."""

    def __init__(self, normalize="auto", task="auto", num_classes=None):
        from types import SimpleNamespace

        self.data = SimpleNamespace(input_key=None, target_key=None, normalize=normalize)
        self.train = SimpleNamespace(task=task)
        self.model = SimpleNamespace(args={"num_classes": num_classes} if num_classes else {})


def _spec(out: Path, **cfg):
    from ringfeed.pipeline import ShardPipeline
    from ringfeed.train.data import infer_spec

    pipe = ShardPipeline(str(out), split="train", batch_size=4, shuffle=False)
    return infer_spec(_Cfg(**cfg), pipe), pipe


def test_trainer_infers_input_classes_task_and_scaling(capsys, tmp_path):
    from ringfeed.train.data import CLASSIFY, REGRESS, split_batch

    out = tmp_path / "bc"
    assert cli(capsys, "shard", write_csv(tmp_path / "t.csv", "breast_cancer"), out,
               "--format", "csv", "--field", "label=cls", "--val-fraction", "0.2")[0] == 0
    spec, pipe = _spec(out)
    stats = manifest(out)["features"]["x.npy"]
    assert (spec.task, spec.input_key, spec.target_key) == (CLASSIFY, "x.npy", "cls")
    assert spec.input_shape == (30,) and spec.num_classes == 2
    assert spec.input_mean == tuple(stats["mean"]) and spec.input_std == tuple(stats["std"])
    batch = pipe.example_batch()
    x, y, _ = split_batch(batch, spec)
    expected = (batch["x.npy"].astype(np.float64) - stats["mean"]) / stats["std"]
    np.testing.assert_allclose(x, expected, rtol=1e-5, atol=1e-6)
    assert x.dtype == np.float32 and y.tolist() == batch["cls"].tolist()
    assert _spec(out, normalize=None)[0].input_mean is None  # data.normalize: null

    out = tmp_path / "diabetes"
    assert cli(capsys, "shard", write_parquet(tmp_path / "d.parquet", "diabetes"), out,
               "--format", "parquet", "--field", "progression=y.npy")[0] == 0
    spec, _ = _spec(out)
    y_stats = manifest(out)["features"]["y.npy"]
    assert (spec.task, spec.target_key, spec.num_classes) == (REGRESS, "y.npy", 1)
    assert spec.target_mean == tuple(y_stats["mean"]) and spec.input_shape == (10,)
    assert _spec(out, task="classify", num_classes=400)[0].task == CLASSIFY


def test_wds_index_records_classes_and_the_trainer_infers_them(capsys, tmp_path):
    import webdataset as wds

    from ringfeed.train.data import _num_classes

    shards = tmp_path / "wds"
    shards.mkdir()
    with wds.ShardWriter(str(shards / "train-%04d.tar"), maxcount=10, verbose=0) as sink:
        for i in range(25):
            sink.write({"__key__": f"s{i:03d}", "x.npy": np.full(3, i, np.float32),
                        "cls": [0, 1, 4][i % 3]})
    assert cli(capsys, "shard", shards, "--format", "wds-index")[0] == 0
    m = manifest(shards)
    assert m["classes"] == {"field": "cls", "ids": [0, 1, 4], "counts": [9, 8, 8],
                            "num_classes": 5}
    assert _num_classes(Manifest.load(shards), "cls", {}) == 5
    spec, _ = _spec(shards)
    assert spec.num_classes == 5 and spec.input_key == "x.npy"


def test_each_error_prints_once(capsys, tmp_path):
    from ringfeed.train.cli import main

    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"data: {{train: {tmp_path / 'nowhere'}}}\n")
    assert main(["train", str(cfg)]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and err.startswith("ringfeed: error: "), (out, err)


def test_duplicate_keys_name_both_rows(capsys, tmp_path):
    src = write_rows(tmp_path / "t.csv", ["id", "a"], [["x", 1], ["y", 2], ["x", 3]])
    code, _, err = cli(capsys, "shard", src, tmp_path / "out", "--format", "csv", "--key", "id")
    assert_one_error_line(code, err, "t.csv:2 and ", "t.csv:4 both become sample key 'x'")
    pq.write_table(pa.table({"id": ["x", "y", "x"], "a": [1, 2, 3]}), tmp_path / "t.parquet")
    code, _, err = cli(capsys, "shard", tmp_path / "t.parquet", tmp_path / "out", "--format",
                       "parquet", "--key", "id")
    assert_one_error_line(code, err, "t.parquet: row 0 and ", "t.parquet: row 2 both become")

"""`ringfeed shard --format parquet` (shards/sources/parquet.py): column kinds from the Arrow
schema, rows read a bounded batch at a time, Hugging Face's ClassLabel names and image structs,
Parquet text columns as documents, and one line for a file that is not Parquet. What a row
becomes (members, stats) is the table sources' (test_tabular.py, test_tableplan.py)."""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import pytest

from ringfeed.errors import UserError
from ringfeed.shards.options import ShardOptions
from ringfeed.shards.sources.parquet import (
    BATCH_BYTES,
    BATCH_ROWS,
    Parquet,
    arrow_kind,
    batch_rows,
    class_labels,
    open_parquet,
    parquet_documents,
)

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")


def png() -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (3, 3)).save(buf, format="PNG")
    return buf.getvalue()


def hf_metadata(features: dict) -> dict[bytes, bytes]:
    return {b"huggingface": json.dumps({"info": {"features": features}}).encode()}


@pytest.mark.parametrize("dtype, kind", [
    (pa.int8(), "int"), (pa.uint64(), "int"), (pa.float16(), "float"),
    (pa.decimal128(10, 2), "float"), (pa.bool_(), "bool"), (pa.string(), "str"),
    (pa.large_string(), "str"), (pa.timestamp("ms"), "str"), (pa.date32(), "str"),
    (pa.list_(pa.float32()), "list"), (pa.list_(pa.int64(), 3), "list"),
    (pa.binary(), "binary"), (pa.large_binary(), "binary"),
    (pa.struct([("bytes", pa.binary()), ("path", pa.string())]), "image"),
    (pa.dictionary(pa.int32(), pa.string()), "str"),
    (pa.struct([("x", pa.int64())]), "other"), (pa.null(), "other"),
])
def test_each_arrow_type_is_a_column_kind(dtype, kind):
    assert arrow_kind(dtype) == kind


def test_class_names_come_from_a_hugging_face_exports_classlabel_columns(tmp_path):
    assert class_labels(None, tmp_path) == {}
    assert class_labels({b"pandas": b"{}"}, tmp_path) == {}
    features = {"label": {"_type": "ClassLabel", "names": ["cat", "dog"]},
                "text": {"_type": "Value", "dtype": "string"}}
    assert class_labels(hf_metadata(features), tmp_path) == {"label": ["cat", "dog"]}
    older = {b"huggingface": json.dumps({"features": {"y": {"_type": "ClassLabel",
                                                            "names": [0, 1]}}}).encode()}
    assert class_labels(older, tmp_path) == {"y": ["0", "1"]}
    with pytest.raises(UserError, match="its 'huggingface' schema metadata is not JSON"):
        class_labels({b"huggingface": b"{"}, tmp_path / "t.parquet")


def test_rows_are_read_in_batches_of_about_batch_bytes(tmp_path):
    narrow = tmp_path / "narrow.parquet"
    pq.write_table(pa.table({"x": np.arange(5000)}), narrow)
    wide = tmp_path / "wide.parquet"
    images = [np.random.default_rng(i).bytes(1 << 20) for i in range(20)]  # photos: distinct
    pq.write_table(pa.table({"img": images}), wide, compression="none")
    assert batch_rows(open_parquet(narrow)) == BATCH_ROWS
    rows = batch_rows(open_parquet(wide))
    assert 1 <= rows < 20 and rows * (1 << 20) <= BATCH_BYTES * 1.1


def test_batch_rows_count_only_the_columns_read(tmp_path):
    # (zeros: a small file of 40 MB of uncompressed data)
    path = tmp_path / "images.parquet"
    pq.write_table(pa.table({"image": [bytes(100_000)] * 400, "label": np.arange(400),
                             "meta": pa.array([{"bytes": bytes(50_000), "path": "p"}] * 400)}),
                   path, compression="zstd", use_dictionary=False)
    pf = open_parquet(path)
    assert batch_rows(pf, ["label"]) == BATCH_ROWS  # was 111: the images counted too
    whole = batch_rows(pf)
    assert whole < batch_rows(pf, ["image", "label"]) < batch_rows(pf, ["meta"]) < BATCH_ROWS
    batch = next(pf.iter_batches(batch_size=batch_rows(pf, ["image"]), columns=["image"]))
    assert BATCH_BYTES * 0.9 <= batch.nbytes <= BATCH_BYTES * 1.1


def test_a_hugging_face_image_dataset_shards_with_its_class_names(tmp_path):
    image = png()
    schema = pa.schema([("image", pa.struct([("bytes", pa.binary()), ("path", pa.string())])),
                        ("label", pa.int64())],
                       metadata=hf_metadata({"label": {"_type": "ClassLabel",
                                                       "names": ["cat", "dog", "eel"]}}))
    table = pa.table({"image": [{"bytes": image, "path": None}] * 3, "label": [2, 0, 2]},
                     schema=schema)
    pq.write_table(table, tmp_path / "train-00000-of-00001.parquet")
    source = Parquet(ShardOptions(src=tmp_path / "train-00000-of-00001.parquet",
                                  out=tmp_path / "out", format="parquet",
                                  fields={"image": "png", "label": "cls"})).scan()
    try:
        assert source.class_names == ["cat", "dog", "eel"]
        sample = source.sample("train", 0)
        assert sample["png"] == image and sample["cls"] == b"2"
    finally:
        source.close()


def test_binary_columns_must_be_named_as_images_or_bytes(tmp_path):
    pq.write_table(pa.table({"img": [b"\x89PNG..."], "y": [1]}), tmp_path / "t.parquet")
    with pytest.raises(UserError, match="column 'img' holds binary data \\(images\\?\\); store "
                                        "it with --field img=jpg"):
        Parquet(ShardOptions(src=tmp_path / "t.parquet", out=tmp_path / "out",
                             format="parquet")).scan()


def test_a_text_column_gives_the_documents_of_format_text(tmp_path):
    path = tmp_path / "docs.parquet"
    pq.write_table(pa.table({"text": ["a", None, "b c"], "n": [1, 2, 3]}), path)
    assert list(parquet_documents(path, "text")) == ["a", "b c"]
    with pytest.raises(UserError, match=r"no column 'body' \(columns: text, n\); name the "
                                        "document column with --text-field"):
        list(parquet_documents(path, "body"))
    with pytest.raises(UserError, match="column 'n' is int64, not text"):
        list(parquet_documents(path, "n"))


def test_a_file_that_is_not_parquet_is_one_line(tmp_path: Path):
    (tmp_path / "t.parquet").write_text("a,b\n1,2\n")
    with pytest.raises(UserError, match="t.parquet: not a readable Parquet file"):
        open_parquet(tmp_path / "t.parquet")

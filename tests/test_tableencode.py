"""Table rows -> member bytes by a plan (shards/sources/tableencode.py): features as one float32
vector (categories one-hot, a missing one all zeros), --fill for missing numbers and what it
counts, the errors naming row and column, list columns as arrays whose dtype and shape the
manifest records, and image values. The plan comes from a real scan (tabular.py)."""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import pytest

from ringfeed.errors import UserError
from ringfeed.shards.options import ShardOptions
from ringfeed.shards.sources.tableencode import RowEncoder, image_value
from ringfeed.shards.sources.tableplan import REST
from ringfeed.shards.sources.tabular import Tabular

ROWS = [{"a": 1.5, "b": 2, "color": "red", "y": 0, "emb": [1, 2], "note": "x"},
        {"a": 2.5, "b": 3, "color": "blue", "y": 1, "emb": [3, 4], "note": "y"}]


@pytest.fixture
def plan(tmp_path: Path):
    """The plan of a jsonl table: y -> cls, emb -> emb.npy, a, b and one-hot color -> x.npy."""
    (tmp_path / "d.jsonl").write_text("\n".join(json.dumps(r) for r in ROWS) + "\n")
    source = Tabular(ShardOptions(src=tmp_path / "d.jsonl", out=tmp_path / "out",
                                  format="jsonl", fields={"y": "cls", "emb": "emb.npy"},
                                  categorical=["color"])).scan()
    source.close()
    return source.plan


def encoder(plan, fill: float | None = None) -> RowEncoder:
    return RowEncoder(plan, "jsonl", fill, lambda name: None)


def npy(data: bytes) -> np.ndarray:
    return np.load(io.BytesIO(data), allow_pickle=False)


def test_a_row_becomes_its_members_and_the_rest_goes_to_json(plan, tmp_path):
    out = encoder(plan).encode(ROWS[0], "d.jsonl:1", tmp_path / "d.jsonl")
    assert out.members["cls"] == b"0"
    assert npy(out.members["emb.npy"]).tolist() == [1, 2]
    assert npy(out.members["x.npy"]).tolist() == [1.5, 2.0, 0.0, 1.0]  # a, b, blue, red
    assert npy(out.members["x.npy"]).dtype == np.float32
    assert json.loads(out.members[REST]) == {"note": "x"}
    assert out.numbers == [1.5, 2.0, 0.0, 1.0]  # what the stats rows get


def test_missing_numbers_take_fill_and_are_counted_else_name_row_and_column(plan, tmp_path):
    row = {**ROWS[0], "a": None, "b": float("nan"), "color": None}
    with pytest.raises(UserError, match="d.jsonl:3: column 'a' has no value \\(a missing "
                                        "cell\\); fill missing cells with --fill VALUE"):
        encoder(plan).encode(row, "d.jsonl:3", tmp_path)
    enc = encoder(plan, fill=-1.0)
    out = enc.encode(row, "d.jsonl:3", tmp_path)
    assert npy(out.members["x.npy"]).tolist() == [-1.0, -1.0, 0.0, 0.0]
    assert dict(enc.filled) == {"a": 1, "b": 1, "color": 1}


@pytest.mark.parametrize("change, message", [
    ({"a": "1.5x"}, "column 'a': '1.5x' is not a number"),
    ({"y": None}, "column 'y' has no value"),
    ({"emb": [1, [2, 3]]}, "field 'emb': cannot store \\[1, \\[2, 3\\]\\] as .emb.npy"),
    ({"emb": [1, None]}, "field 'emb': a ragged or mixed value cannot be an .emb.npy array"),
])
def test_values_that_cannot_be_stored_name_row_and_column(plan, tmp_path, change, message):
    with pytest.raises(UserError, match=f"d.jsonl:7: .*{message}"):
        encoder(plan).encode({**ROWS[0], **change}, "d.jsonl:7", tmp_path)


def test_a_json_row_without_a_field_the_plan_needs_names_the_fields_it_has(plan, tmp_path):
    row = {k: v for k, v in ROWS[0].items() if k != "emb"}
    with pytest.raises(UserError, match="d.jsonl:2: no field 'emb' \\(fields: a, b, color, y, "
                                        "note\\)"):
        encoder(plan).encode(row, "d.jsonl:2", tmp_path)


def test_an_array_fields_dtype_and_shape_are_recorded_and_varying_shapes_too(plan, tmp_path):
    enc = encoder(plan)
    member = next(m for m in plan.members if m.ext == "emb.npy")
    enc.encode(ROWS[0], "r1", tmp_path)
    assert enc.array_type(member) == ("int64", (2,))
    enc.encode({**ROWS[1], "emb": [1, 2, 3]}, "r2", tmp_path)
    assert enc.array_type(member) == ("int64", None)  # varies from row to row
    features = next(m for m in plan.members if m.role == "features")
    assert enc.array_type(features) == ("float32", (4,))


def test_an_image_value_is_bytes_a_file_next_to_the_table_or_a_hugging_face_struct(tmp_path):
    (tmp_path / "img").mkdir()
    (tmp_path / "img" / "a.png").write_bytes(b"\x89PNG....")
    table = tmp_path / "t.csv"
    assert image_value(b"\xff\xd8", "w", table) == (b"\xff\xd8", 2)
    assert image_value("img/a.png", "w", table) == (str(tmp_path / "img" / "a.png"), 8)
    assert image_value({"bytes": None, "path": "img/a.png"}, "w", table)[1] == 8
    assert image_value({"bytes": b"abc", "path": "x.png"}, "w", table) == (b"abc", 3)
    with pytest.raises(UserError, match="w: .*img/b.png: cannot read \\(No such file"):
        image_value("img/b.png", "w", table)
    with pytest.raises(UserError, match="w: no image \\(expected a file path or image bytes, "
                                        "got 3\\)"):
        image_value(3, "w", table)

"""Values -> tar member bytes by the member's kind (ringfeed/formats/members.py): what each kind
stores, what it refuses (one line naming the row or field), and numpy values as plain ones."""

from __future__ import annotations

import io
import json

import numpy as np
import pytest

from ringfeed.errors import UserError
from ringfeed.formats.members import encode, json_bytes, npy_bytes


def test_a_class_index_is_its_decimal_digits():
    for value in (3, np.int64(3), 3.0, np.float32(3.0), " 3\n", np.array(3)):
        assert encode("cls", value, "row 1") == b"3"


@pytest.mark.parametrize("value, reason", [
    (True, "a boolean is not a class index"), (np.bool_(False), "a boolean is not a class"),
    (2.5, "expected an integer"), ("cat", "invalid literal"), (None, "expected an integer"),
])
def test_what_is_not_a_class_index_is_one_line(value, reason):
    with pytest.raises(UserError, match=f"train.csv:4: field 'y': cannot store .* as .cls "
                                        f"\\(.*{reason}"):
        encode("cls", value, "train.csv:4: field 'y'")


def test_npy_members_round_trip_and_are_contiguous():
    array = np.arange(12, dtype=np.int16).reshape(3, 4)[:, ::2]  # not contiguous
    for ext in ("npy", "x.npy"):
        back = np.load(io.BytesIO(encode(ext, array, "w")), allow_pickle=False)
        assert np.array_equal(back, array) and back.dtype == np.int16
    assert np.load(io.BytesIO(npy_bytes([1.5, 2]))).tolist() == [1.5, 2.0]


def test_json_is_compact_utf8_and_takes_numpy_values():
    data = encode("json", {"a": np.int64(1), "b": np.array([0.5, 1.0]), "é": "ü"}, "w")
    assert data == '{"a":1,"b":[0.5,1.0],"é":"ü"}'.encode()
    assert json.loads(json_bytes([np.float32(2.0)])) == [2.0]
    with pytest.raises(UserError, match="w: cannot store .* as .json \\(set is not JSON"):
        encode("json", {1, 2}, "w")


def test_text_and_bytes_store_strings_and_bytes_as_they_are():
    assert encode("txt", "héllo", "w") == "héllo".encode()
    assert encode("txt", 2.5, "w") == b"2.5"
    assert encode("jpg", b"\xff\xd8", "w") == b"\xff\xd8"
    assert encode("bin", bytearray(b"ab"), "w") == b"ab"


@pytest.mark.parametrize("ext, value", [("jpg", 3), ("bin", [1, 2]), ("txt", {"a": 1}),
                                        ("png", np.zeros(3))])
def test_other_values_say_which_kind_to_use_instead(ext, value):
    with pytest.raises(UserError, match=f"w: cannot store a .* as .{ext} \\(map this field to "
                                        "json or npy instead\\)"):
        encode(ext, value, "w")

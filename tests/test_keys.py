"""Sample keys and member extensions every tar reader splits alike (shards/keys.py): readable
keys from names, distinct ones for names too long or not ASCII, numbered keys, and the
one-line errors for a key two samples share or an extension webdataset would split."""

from __future__ import annotations

import pytest

from ringfeed.errors import UserError
from ringfeed.formats.tarindex import base_plus_ext
from ringfeed.shards.keys import MAX_KEY_CHARS, NumberedKeys, check_ext, check_unique, safe_key


@pytest.mark.parametrize("text, key", [
    ("cat/img 01.jpeg", "cat_img_01_jpeg"), ("a..b", "a_b"), ("__x__", "x"),
    ("dir/../../etc", "dir_etc"), ("n-1_b", "n-1_b"),
])
def test_a_key_keeps_letters_digits_dash_and_underscore(text, key):
    assert safe_key(text) == key


@pytest.mark.parametrize("text", ["x" * 100, "chat/été.jpg", "日本", "...", "x" * 65])
def test_long_or_non_ascii_names_get_a_short_hash_and_stay_distinct(text):
    key = safe_key(text)
    assert len(key) <= MAX_KEY_CHARS and key.isascii()
    assert safe_key(text + "2") != key
    assert base_plus_ext(f"{key}.jpg") == (key, "jpg")  # webdataset splits it where we do


def test_numbered_keys_are_made_on_demand_and_as_wide_as_needed():
    keys = NumberedKeys(3)
    assert list(keys) == ["000000", "000001", "000002"] and keys[-1] == "000002"
    assert keys[0:3:2] == ["000000", "000002"]
    with pytest.raises(IndexError):
        keys[3]
    big = NumberedKeys(12_345_678)
    assert big[7] == "00000007" and len(big) == 12_345_678


def test_a_key_two_samples_share_names_both_sources():
    check_unique(["a", "b"], str, "x")
    with pytest.raises(UserError, match="files/1 and files/4 both become sample key 'a' in "
                                        "train.csv \\(rename one of them\\)"):
        check_unique(["a", "b", "c", "a"], lambda i: f"files/{i + 1}", "train.csv")


@pytest.mark.parametrize("ext", ["cls", "x.npy", "caption.en.txt", "seg_mask-2.png"])
def test_usable_extensions(ext):
    assert check_ext(ext, "where") == ext


@pytest.mark.parametrize("ext", ["Cls", ".npy", "x..npy", "a b", "x/y", "", "e" * 33, "_x"])
def test_extensions_webdataset_would_not_read_back_are_one_line(ext):
    with pytest.raises(UserError, match=f"data.npz: array 'y': {ext!r} is not a usable member "
                                        "extension"):
        check_ext(ext, "data.npz: array 'y'")

"""Member extension -> field kind (ringfeed/formats/kinds.py), the one table the shard writer and
the decoder read: by the extension's last part, as webdataset's decoders go."""

from __future__ import annotations

import pytest

from ringfeed.formats.kinds import KIND_BY_EXTENSION, kind_of
from ringfeed.formats.manifest import FIELD_KINDS


@pytest.mark.parametrize("ext, kind", [
    ("jpg", "image"), ("JPEG".lower(), "image"), ("webp", "image"), ("seg.png", "image"),
    ("cls", "int"), ("label.cls", "int"), ("cls2", "int"), ("id", "int"),
    ("txt", "text"), ("caption.en.txt", "text"), ("html", "text"),
    ("json", "json"), ("meta.jsn", "json"),
    ("npy", "npy"), ("x.npy", "npy"), ("tokens.npy", "npy"),
    ("bin", "bytes"), ("npz", "bytes"), ("npy.gz", "bytes"), ("txt.bak", "bytes"),
    ("cls.txt", "text"),  # the last part decides
])
def test_the_kind_follows_the_last_part_of_the_extension(ext, kind):
    assert kind_of(ext) == kind


def test_every_kind_in_the_table_is_one_a_manifest_may_name():
    assert set(KIND_BY_EXTENSION.values()) | {"bytes"} <= set(FIELD_KINDS)

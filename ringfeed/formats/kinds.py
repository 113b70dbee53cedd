"""Tar member extension -> field kind: the one table the shard writer (manifest "fields") and
the decoder both read.

The kind follows the last part of the extension, as webdataset's decoders do: `cls` is an int,
`caption.txt` is text, `x.npy` is a numpy array; anything else stays bytes.
"""

from __future__ import annotations

IMAGE_EXTENSIONS = frozenset("jpg jpeg png gif bmp webp tif tiff ppm pgm pbm pnm".split())
INT_EXTENSIONS = frozenset("cls cls2 class count index inx id".split())
TEXT_EXTENSIONS = frozenset("txt text transcript html htm".split())
JSON_EXTENSIONS = frozenset("json jsn".split())

KIND_BY_EXTENSION: dict[str, str] = {
    **dict.fromkeys(IMAGE_EXTENSIONS, "image"),
    **dict.fromkeys(INT_EXTENSIONS, "int"),
    **dict.fromkeys(TEXT_EXTENSIONS, "text"),
    **dict.fromkeys(JSON_EXTENSIONS, "json"),
    "npy": "npy",
}


def kind_of(extension: str) -> str:
    """The kind of a member `KEY.extension` (by the extension's last part)."""
    return KIND_BY_EXTENSION.get(extension.rsplit(".", 1)[-1], "bytes")

"""Tar member extensions -> field kinds (manifest "fields"), and values -> member bytes.

The kind follows the last part of the extension, as webdataset's decoders do: `cls` is an int,
`caption.txt` is text, `x.npy` is a numpy array.
"""

from __future__ import annotations

import io
import json
from typing import Any

import numpy as np

from ringfeed.errors import UserError

IMAGE_EXTS = frozenset("jpg jpeg png gif bmp webp tif tiff ppm pgm pbm".split())
INT_EXTS = frozenset("cls cls2 class count index inx id".split())
TEXT_EXTS = frozenset("txt text transcript html htm".split())
JSON_EXTS = frozenset("json jsn".split())

# One tar member = a 512-byte header + its data padded to 512; a tar ends with two zero blocks
# and is padded to whole 20-block records (Python's tarfile, which webdataset's TarWriter uses).
TAR_BLOCK = 512
TAR_END = 2 * TAR_BLOCK
TAR_RECORD = 20 * TAR_BLOCK


def kind_of(ext: str) -> str:
    last = ext.rsplit(".", 1)[-1]
    if last in IMAGE_EXTS:
        return "image"
    if last in INT_EXTS:
        return "int"
    if last in TEXT_EXTS:
        return "text"
    if last in JSON_EXTS:
        return "json"
    if last == "npy":
        return "npy"
    return "bytes"


def member_tar_bytes(data_len: int) -> int:
    """Bytes one member of `data_len` bytes takes inside a tar."""
    return TAR_BLOCK + -(-data_len // TAR_BLOCK) * TAR_BLOCK


def tar_file_bytes(members_total: int) -> int:
    """Size of a finished tar whose members take `members_total` bytes."""
    return -(-(members_total + TAR_END) // TAR_RECORD) * TAR_RECORD


def npy_bytes(array: Any) -> bytes:
    buf = io.BytesIO()
    np.save(buf, np.ascontiguousarray(array), allow_pickle=False)
    return buf.getvalue()


def json_bytes(value: Any) -> bytes:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"), default=_jsonable).encode()


def _jsonable(value: Any) -> Any:
    if isinstance(value, (np.generic, np.ndarray)):
        return value.tolist()
    raise TypeError(f"{type(value).__name__} is not JSON serializable")


def encode(ext: str, value: Any, where: str) -> bytes:
    """Member bytes for `value` stored as `KEY.ext`; `where` names the row/field in errors."""
    kind = kind_of(ext)
    if isinstance(value, np.ndarray) and value.ndim == 0:
        value = value[()]
    try:
        if kind == "int":
            return b"%d" % _as_int(value)
        if kind == "npy":
            return npy_bytes(np.asarray(value))
        if kind == "json":
            return json_bytes(value)
        if isinstance(value, (bytes, bytearray)):
            return bytes(value)
        if isinstance(value, str):
            return value.encode()
        if kind == "text" and isinstance(value, (int, float, np.number)):
            return str(value).encode()
    except (TypeError, ValueError) as e:
        raise UserError(f"{where}: cannot store {value!r} as .{ext} ({e})") from None
    raise UserError(f"{where}: cannot store a {type(value).__name__} as .{ext} "
                    "(map this field to json or npy instead)")


def _as_int(value: Any) -> int:
    if isinstance(value, (bool, np.bool_)):
        raise ValueError("a boolean is not a class index")
    if isinstance(value, (int, np.integer)):
        return int(value)
    if isinstance(value, (float, np.floating)) and float(value).is_integer():
        return int(value)
    if isinstance(value, str):
        return int(value.strip())
    raise ValueError("expected an integer")

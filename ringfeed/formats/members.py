"""Values -> tar member bytes, by the member's kind (kinds.py)."""

from __future__ import annotations

import io
import json
from typing import Any

import numpy as np

from ringfeed.errors import UserError
from ringfeed.formats.kinds import kind_of


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

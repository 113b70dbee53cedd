"""Sample keys and tar member names that every tar reader splits the same way.

webdataset splits a member name at the first '.' of its last path component: `KEY.EXT`. So a key
may hold no '.', no '/' (and hence no '..') and must be unique inside a tar. Keys are also ASCII
and `KEY.EXT` fits the 100-byte name field of a tar header, so no member needs an extra (pax)
header: each member takes exactly 512 bytes + its padded data, which lets shards be planned by
size before they are written.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Callable, Sequence

from ringfeed.errors import UserError

MAX_KEY_CHARS = 64
MAX_EXT_CHARS = 32
_UNSAFE = re.compile(r"[^A-Za-z0-9_\-]+")
_EXT = re.compile(r"^[a-z0-9][a-z0-9_\-]*(\.[a-z0-9][a-z0-9_\-]*)*$")


def safe_key(text: str) -> str:
    """A readable key derived from `text` ('cat/img 01.jpeg' -> 'cat_img_01_jpeg').

    Runs of other characters become one '_' (two names that then meet are reported by
    `check_unique`). A name that is too long or not ASCII is cut and given a short hash of the
    full name, so such names stay distinct.
    """
    key = _UNSAFE.sub("_", text).strip("_")
    if key and len(key) <= MAX_KEY_CHARS and text.isascii():
        return key
    digest = hashlib.sha1(text.encode()).hexdigest()[:10]
    head = key[: MAX_KEY_CHARS - len(digest) - 1]
    return f"{head}_{digest}" if head else digest


class NumberedKeys(Sequence[str]):
    """Keys '000000', '000001', ... made on demand: millions of samples need no list of them."""

    def __init__(self, count: int):
        self._count = count
        self._width = max(6, len(str(count - 1)))

    def __len__(self) -> int:
        return self._count

    def __getitem__(self, index):  # type: ignore[override]
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(self._count))]
        if not -self._count <= index < self._count:
            raise IndexError(index)
        return f"{index % self._count:0{self._width}d}"


def check_unique(keys: Sequence[str], origin: Callable[[int], str], what: str) -> None:
    """UserError naming both sources (`origin(i)`) of the first key two samples would share."""
    seen: dict[str, int] = {}
    for i, key in enumerate(keys):
        j = seen.setdefault(key, i)
        if j != i:
            raise UserError(
                f"{origin(j)} and {origin(i)} both become sample key {key!r} in {what} "
                "(rename one of them)"
            )


def check_ext(ext: str, where: str) -> str:
    """A member extension usable by webdataset (lower-case, dotted words) or a UserError."""
    if not _EXT.match(ext) or len(ext) > MAX_EXT_CHARS:
        raise UserError(
            f"{where}: {ext!r} is not a usable member extension (lower-case letters, digits, "
            f"'_', '-', dots between words, at most {MAX_EXT_CHARS} characters; e.g. txt, cls, x.npy)"
        )
    return ext

"""Sample keys and tar member names that every tar reader splits the same way.

webdataset splits a member name at the first '.' of its last path component: `KEY.EXT`. So a key
may hold no '.', no '/' (and hence no '..'), must be unique inside a tar, and `KEY.EXT` must fit
the 100-byte name field of a ustar header.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Sequence

from shards.errors import UserError

MAX_KEY_BYTES = 64
MAX_EXT_CHARS = 32
_UNSAFE = re.compile(r"[^\w\-]+")  # \w is Unicode-aware: non-ASCII letters survive
_EXT = re.compile(r"^[a-z0-9][a-z0-9_\-]*(\.[a-z0-9][a-z0-9_\-]*)*$")


def safe_key(text: str) -> str:
    """A readable key derived from `text` ('cat/img 01.jpeg' -> 'cat_img_01_jpeg').

    Unsafe runs become one '_'; a name too long for a tar header is cut and given a short hash of
    the full name, so long names stay distinct.
    """
    key = _UNSAFE.sub("_", text).strip("_")
    if len(key.encode()) <= MAX_KEY_BYTES and key:
        return key
    digest = hashlib.sha1(text.encode()).hexdigest()[:10]
    head = key.encode()[: MAX_KEY_BYTES - len(digest) - 1].decode(errors="ignore")
    return f"{head}_{digest}" if head else digest


def check_unique(keys: Sequence[str], origins: Sequence[str], what: str) -> None:
    """UserError naming both sources of the first key that two samples would share."""
    seen: dict[str, int] = {}
    for i, key in enumerate(keys):
        j = seen.setdefault(key, i)
        if j != i:
            raise UserError(
                f"{origins[j]} and {origins[i]} both become sample key {key!r} in {what} "
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

"""Tar's block arithmetic, written once for the writer (tarwrite.py), the sizer (members.py) and
the index (tarindex.py).

One tar member is a 512-byte header then its data padded to 512 bytes; a tar ends with two zero
blocks and is padded to whole 20-block records (Python's tarfile, which webdataset's TarWriter
uses).
"""

from __future__ import annotations

BLOCK = 512
END = 2 * BLOCK
RECORD = 20 * BLOCK


def data_padding(data_len: int) -> int:
    """NUL bytes after `data_len` bytes of member data."""
    return -data_len % BLOCK


def member_tar_bytes(data_len: int) -> int:
    """Bytes one member of `data_len` bytes takes inside a tar (one header block)."""
    return BLOCK + data_len + data_padding(data_len)


def end_bytes(offset: int) -> int:
    """Bytes a tar whose members end at `offset` needs after them: the two end blocks and the
    record padding."""
    return END + -(offset + END) % RECORD


def tar_file_bytes(members_total: int) -> int:
    """Size of a finished tar whose members take `members_total` bytes."""
    return members_total + end_bytes(members_total)

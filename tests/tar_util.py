"""Tars as another tool writes them (Python's tarfile), for the tests of what ringfeed reads."""

from __future__ import annotations

import io
import tarfile
from pathlib import Path


def write_tar(path: Path, samples: list[dict[str, bytes]], mode: str = "w") -> Path:
    """A tar as webdataset's TarWriter lays it out (`KEY.EXT` members, a sample's together, in
    the order given), written by tarfile (`mode` "w:gz", "w:xz", ... for a compressed one)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(path, mode) as tar:
        for sample in samples:
            for ext, data in sample.items():
                if ext == "__key__":
                    continue
                info = tarfile.TarInfo(f"{sample['__key__']}.{ext}")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    return path


def member_bytes(sample: dict[str, bytes]) -> int:
    """The bytes ringfeed's tar writer gives the sample's members (headers, data, padding): what
    a source's `Part.sizes` must say, for shards to be planned by size before they are written."""
    from ringfeed.formats.tarwrite import SampleTarWriter

    buf = io.BytesIO()
    SampleTarWriter(buf).write(sample)
    return buf.tell()

"""`ringfeed shard SRC [OUT] --format wds-index`: give existing WebDataset shards (written by
webdataset's ShardWriter, tarp, ...) a manifest, so the pipeline can balance and verify them.

Each tar is read once: samples counted as webdataset groups them, sha256, size, and the member
extensions seen (-> fields). A shard's split comes from its name (`train-000.tar`,
`val_3.tar`, ...), else `train`, or `--split` for all. Shard names in the manifest are relative to
OUT (OUT defaults to SRC, so the manifest sits beside the shards).
"""

from __future__ import annotations

import glob
import os
import re
import time
from pathlib import Path

import braceexpand

from shards.build import ShardRun, created_by
from shards.errors import UserError
from shards.manifest import Manifest, ShardInfo, Split
from shards.members import kind_of
from shards.options import ShardOptions
from shards.parallel import parallel_map
from shards.plan import SPLIT_ORDER
from shards.sources.base import SPLIT_NAMES
from shards.tarread import TarReadError, TarScan, scan_tar

_SPLIT_PREFIX = re.compile(r"^([a-z]+)[-_.]", re.IGNORECASE)


def find_tars(src: str) -> list[Path]:
    """SRC is a folder of .tar files, one .tar, or a brace/glob pattern of them."""
    path = Path(src)
    if path.is_dir():
        files = [p for p in path.iterdir() if p.name.endswith(".tar") and not p.name.startswith(".")]
    elif path.is_file():
        files = [path]
    else:
        files = [Path(f) for pattern in braceexpand.braceexpand(src) for f in glob.glob(pattern)]
    if not files:
        raise UserError(f"{src}: no .tar shards found (give a folder, a file or a pattern "
                        "like 'data/shard-{000000..000099}.tar')")
    return sorted(set(files), key=_natural)


def _natural(path: Path) -> list:
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", path.name)]


def split_of(path: Path) -> str:
    m = _SPLIT_PREFIX.match(path.name)
    return SPLIT_NAMES.get(m.group(1).lower(), "train") if m else "train"


def _scan(_shared: None, path: Path) -> TarScan | str:
    try:
        return scan_tar(str(path))
    except (TarReadError, OSError) as e:
        return str(e)


def index_shards(opts: ShardOptions) -> ShardRun:
    start = time.monotonic()
    tars = find_tars(str(opts.src))
    out = opts.out
    if out.exists() and not out.is_dir():
        raise UserError(f"{out}: exists and is not a folder")
    if (out / "manifest.json").exists() and not opts.overwrite:
        raise UserError(f"{out}/manifest.json exists; pass --overwrite to replace it")
    scans = list(parallel_map(_scan, tars, opts.workers, None, 1))
    splits: dict[str, Split] = {}
    fields: dict[str, str] = {}
    for path, scan in zip(tars, scans, strict=True):
        if isinstance(scan, str):
            raise UserError(f"{path}: {scan}")
        if scan.duplicate_keys:
            raise UserError(f"{path}: sample key {scan.duplicate_keys[0]!r} appears more than "
                            "once; the pipeline would see two samples")
        name = os.path.relpath(path.resolve(), out.resolve())
        split = opts.split or split_of(path)
        splits.setdefault(split, Split()).shards.append(
            ShardInfo(name, scan.num_samples, scan.bytes, scan.sha256))
        fields.update({ext: kind_of(ext) for ext in sorted(scan.fields)})
    order = sorted(splits, key=lambda s: (SPLIT_ORDER.index(s) if s in SPLIT_ORDER else 9, s))
    manifest = Manifest(splits={s: splits[s] for s in order}, fields=dict(sorted(fields.items())),
                        source={"format": "wds-index", "path": str(opts.src),
                                "options": {"split": opts.split}},
                        created_by=created_by())
    out.mkdir(parents=True, exist_ok=True)
    manifest.save(out)
    return ShardRun(manifest, out, time.monotonic() - start, written=["manifest.json"])

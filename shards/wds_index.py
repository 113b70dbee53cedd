"""`ringfeed shard SRC [OUT] --format wds-index`: give existing WebDataset shards (written by
webdataset's ShardWriter, tarp, ...) a manifest, so the pipeline can balance and verify them.

Each tar is read: samples counted as webdataset groups them, sha256, size, and the member
extensions seen (-> fields), and its tar index (`ringfeed.formats.tarindex`) built. Compressed
tars (`.tar.gz`, `.tgz`, `.tar.bz2`, `.tar.xz`, as webdataset writes and reads them) are counted
and hashed the same way (sha256 and size of the compressed file) but get no index sidecar: the
pipeline decompresses each once into its cache and indexes the plain copy. The class ids in
`cls` members are counted (-> the manifest's `classes`, so the trainer infers num_classes). A shard's split comes
from its name (`train-000.tar`, `val_3.tar`, ...), else `train`, or `--split` for all. Shard names
in the manifest are relative to OUT (OUT defaults to SRC, so the manifest sits beside the shards).

Each shard's index goes to a sidecar under OUT, named in the manifest's `index`: `<shard path
relative to OUT>.idx` (beside the shard) when that path stays inside OUT, else
`index/<sha256[:16]>-<file name>.idx`. A tar that cannot be indexed whole (corrupt, truncated,
not a tar at all; for a compressed one also corrupt or cut-short compressed data, or a file
that is not compressed at all) is one error line naming it and what is wrong. Sidecars are written (atomically) after every shard was read
and before the manifest.
"""

from __future__ import annotations

import glob
import os
import posixpath
import re
import tarfile
import tempfile
import time
from collections import Counter
from functools import partial
from pathlib import Path
from typing import Any

import braceexpand

from ringfeed.errors import UserError
from ringfeed.formats.kinds import kind_of
from ringfeed.formats.manifest import INDEX_SUFFIX, MANIFEST_NAME, Manifest, ShardInfo, Split
from ringfeed.formats.manifest_format import INDEX_NAME
from ringfeed.formats.tarindex import build_index
from ringfeed.formats.tarread import (
    COMPRESSED_TAR_SUFFIXES,
    TAR_SUFFIXES,
    TarReadError,
    TarScan,
    open_shard,
    read_ints,
    scan_tar,
)
from ringfeed.fsutil import atomic_write_bytes
from ringfeed.remote import RetryPolicy
from ringfeed.shards.build import ShardRun, created_by
from ringfeed.shards.options import ShardOptions
from ringfeed.shards.packing import SPLIT_ORDER
from ringfeed.shards.parallel import parallel_map
from ringfeed.shards.remote import Store, is_url, storage_call, storage_defaults
from ringfeed.shards.sources.base import SPLIT_NAMES, class_record

_SPLIT_PREFIX = re.compile(r"^([a-z]+)[-_.]", re.IGNORECASE)


def find_tars(src: str, storage_options: dict[str, Any] | None = None,
              policy: RetryPolicy | None = None) -> list[Path] | list[str]:
    """SRC is a folder of tar shards (.tar, or compressed: .tar.gz, .tgz, ...), one of them, or
    a brace/glob pattern of them; or the same in object storage (`s3://bucket/wds`: the
    objects directly under that prefix), as URLs."""
    if is_url(src):
        return _find_remote_tars(src, storage_options or {}, policy)
    path = Path(src)
    if path.is_dir():
        files = [p for p in path.iterdir()
                 if p.name.endswith(TAR_SUFFIXES) and not p.name.startswith(".")]
    elif path.is_file():
        files = [path]
    else:
        files = [Path(f) for pattern in braceexpand.braceexpand(src) for f in glob.glob(pattern)]
    if not files:
        raise UserError(f"{src}: no tar shards found (.tar, .tar.gz, .tgz, .tar.bz2, .tar.xz; "
                        "give a folder, a file or a pattern like "
                        "'data/shard-{000000..000099}.tar')")
    return sorted(set(files), key=_natural)


def _find_remote_tars(src: str, storage_options: dict[str, Any],
                      policy: RetryPolicy | None) -> list[str]:
    store = Store(src, storage_options, policy)
    protocol = src.split("://", 1)[0]
    if any(c in src for c in "*?[{"):
        paths = [p for pattern in braceexpand.braceexpand(src)
                 for p in store.call(partial(store.fs.glob, pattern), "", "list")]
        urls = [f"{protocol}://{p}" for p in paths]
    elif store.is_file():
        urls = [store.url]
    else:
        urls = [store.url_of(name) for name in store.list()
                if "/" not in name and name.endswith(TAR_SUFFIXES) and not name.startswith(".")]
    if not urls:
        raise UserError(f"{src}: no tar shards found (.tar, .tar.gz, .tgz, .tar.bz2, .tar.xz "
                        "objects directly under it; or give one object or a pattern like "
                        "'s3://bucket/shard-{000000..000099}.tar')")
    return sorted(set(urls), key=_natural)


def _natural(path: Path | str) -> list:
    path = Path(path)
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", path.name)]


def split_of(path: Path) -> str:
    m = _SPLIT_PREFIX.match(path.name)
    return SPLIT_NAMES.get(m.group(1).lower(), "train") if m else "train"


def _scan(policy: RetryPolicy, path: Path | str) -> tuple[TarScan, bytes | None, Counter] | str:
    """(the shard's scan, its index as bytes (None: compressed), counts of its class ids), or
    what is wrong. A remote shard is read again while storage fails transiently."""
    compressed = str(path).endswith(COMPRESSED_TAR_SUFFIXES)

    def read() -> tuple[TarScan, Counter, Any]:
        # (a compressed tar's class ids come from the scan's own decompressed copy)
        scan = scan_tar(str(path), ints_of="cls" if compressed else None)
        if compressed:
            return scan, scan.ints, None
        classes = read_ints(str(path), "cls") if "cls" in scan.fields else Counter()
        with open_shard(str(path)) as f:
            return scan, classes, build_index(f)
    try:
        scan, classes, built = storage_call(read, str(path), "index", policy)
    except (TarReadError, OSError) as e:
        return str(e)
    except tarfile.TarError as e:
        return f"not a readable tar ({e})"
    except ValueError as e:  # int() of a cls member
        return f"a cls member is not a class index ({e})"
    if built is None:
        return scan, None, classes
    index, reason = built
    if reason is not None:
        return f"cannot be indexed: {reason}"
    if index.num_samples != scan.num_samples:  # not expected: the index groups as webdataset
        return (f"cannot be indexed: {index.num_samples} samples indexed, webdataset reads "
                f"{scan.num_samples}")
    return scan, index.to_bytes(), classes


def sidecar_name(shard: str, sha256: str) -> str:
    """Where a shard's index goes, relative to OUT, for the shard at `shard` (relative to OUT,
    or a URL: a shard in other storage than OUT)."""
    if ".." in Path(shard).parts or "://" in shard:
        return f"index/{sha256[:16]}-{Path(shard).name}{INDEX_SUFFIX}"
    return shard + INDEX_SUFFIX


def index_shards(opts: ShardOptions) -> ShardRun:
    start = time.monotonic()
    src = opts.src_url or str(opts.src)
    with storage_defaults(src, opts.storage_options):
        tars = find_tars(src, opts.storage_options, opts.policy)
        out = opts.out_url or opts.out
        store = Store(out, opts.storage_options, opts.policy) if isinstance(out, str) else None
        if store is not None:
            if MANIFEST_NAME in store.list() and not opts.overwrite:
                raise UserError(f"{out}/manifest.json exists; pass --overwrite to replace it")
        else:
            if out.exists() and not out.is_dir():
                raise UserError(f"{out}: exists and is not a folder")
            if (out / MANIFEST_NAME).exists() and not opts.overwrite:
                raise UserError(f"{out}/manifest.json exists; pass --overwrite to replace it")
        scans = list(parallel_map(_scan, tars, opts.workers, opts.policy, 1))
    splits: dict[str, Split] = {}
    fields: dict[str, str] = {}
    sidecars: dict[str, bytes] = {}
    classes: Counter = Counter()
    for path, result in zip(tars, scans, strict=True):
        if isinstance(result, str):
            raise UserError(f"{path}: {result}; re-download or re-create it, or move it out of "
                            f"{src}")
        scan, index, counts = result
        if counts and min(counts) < 0:
            raise UserError(f"{path}: class id {min(counts)} in a cls member (class ids are "
                            "0, 1, ...)")
        classes.update(counts)
        if scan.duplicate_keys:
            raise UserError(f"{path}: sample key {scan.duplicate_keys[0]!r} appears more than "
                            "once; the pipeline would see two samples")
        name = _relative(path, out)
        sidecar = None if index is None else sidecar_name(name, scan.sha256)
        if sidecar is not None and sidecars.setdefault(sidecar, index) != index:
            # same sha256 prefix and file name
            raise UserError(f"{path}: its index sidecar {sidecar} would be another shard's")
        split = opts.split or split_of(Path(str(path)))
        splits.setdefault(split, Split()).shards.append(
            ShardInfo(name, scan.num_samples, scan.bytes, scan.sha256, sidecar))
        fields.update({ext: kind_of(ext) for ext in sorted(scan.fields)})
    order = sorted(splits, key=lambda s: (SPLIT_ORDER.index(s) if s in SPLIT_ORDER else 9, s))
    manifest = Manifest(splits={s: splits[s] for s in order}, fields=dict(sorted(fields.items())),
                        source={"format": "wds-index", "path": src,
                                "options": {"split": opts.split}},
                        classes=class_record(classes), created_by=created_by())
    try:
        if store is not None:
            _upload(store, sidecars, manifest)
        else:
            out.mkdir(parents=True, exist_ok=True)
            for sidecar, index in sidecars.items():
                atomic_write_bytes(out / sidecar, index)
            manifest.save(out)
    except OSError as e:  # no permission (OUT defaults to SRC), disk full: one line
        raise UserError(f"{e.filename or out}: {e.strerror or e}") from e
    return ShardRun(manifest, opts.out, time.monotonic() - start,
                    written=[*sidecars, MANIFEST_NAME])


def _relative(path: Path | str, out: Path | str) -> str:
    """A shard's name in the manifest: its path relative to OUT; a URL where OUT is in other
    storage (a local OUT for shards in a bucket)."""
    if is_url(path) or is_url(out):
        path, out = str(path), str(out)
        if not (is_url(path) and is_url(out)) or path.split("://")[0] != out.split("://")[0]:
            return path if is_url(path) else str(Path(path).resolve())
        return posixpath.relpath(path.split("://", 1)[1], out.split("://", 1)[1])
    return os.path.relpath(Path(path).resolve(), Path(out).resolve())


def _upload(store: Store, sidecars: dict[str, bytes], manifest: Manifest) -> None:
    """Sidecars, then manifest.bin, then manifest.json: whole objects, the manifest last."""
    for sidecar, index in sidecars.items():
        store.write(sidecar, index)
    with tempfile.TemporaryDirectory(prefix="ringfeed-manifest-") as tmp:
        manifest.save(tmp)
        store.write(INDEX_NAME, (Path(tmp) / INDEX_NAME).read_bytes())
        store.write(MANIFEST_NAME, (Path(tmp) / MANIFEST_NAME).read_bytes())

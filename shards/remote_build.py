"""`ringfeed shard SRC s3://bucket/prefix`: the local run of build.py, with a local staging folder
as its OUT, each finished shard uploaded as a whole object, the journal kept in the bucket and
the manifest uploaded last.

Order of effects: the bucket is listed and checked (empty, an unfinished run of ours, or
--overwrite); the source is scanned (a remote SRC was first fetched into the staging folder);
with --overwrite the old manifest.json is deleted first, then the old shards; the journal object
names the plan; each shard is written (temp file + fsync + rename) into the staging folder, then
its sidecar is uploaded, then the tar (a PUT, or a multipart upload that appears only when
complete: an object is all there or absent), each checked (size; S3's ETag, the MD5 of the
bytes or of the parts' MD5s, against the local file's), then its line, with the two objects'
ETags, goes into the journal object, and the local copies are deleted. When every shard is up, the bucket is listed once more and every shard and
sidecar the manifest names must be there with the size and ETag recorded at its upload; then
manifest.bin and, last, manifest.json are uploaded, and the journal object is deleted.

So a reader takes the presence of OUT/manifest.json as "complete": S3 has no rename, and nothing
is written after it. A rerun of the same command (after kill -9, from any machine) reads the
journal object and keeps every shard whose tar and sidecar still have the size and ETags
recorded (an object written again since has another ETag); the rest are written again,
byte-identical, since the plan decides every byte.
"""

from __future__ import annotations

import json
import shutil
import time
from contextlib import suppress
from pathlib import Path
from typing import Any

from ringfeed.errors import UserError
from ringfeed.formats.manifest import MANIFEST_NAME, Manifest, ShardInfo
from ringfeed.formats.manifest_format import INDEX_NAME
from ringfeed.remote import RetryPolicy
from ringfeed.shards.build import (
    SHARD_FILE,
    ShardRun,
    _clean_out_dir,
    _manifest,
    _own_files,
    _write_all,
    adopt_src_url,
    finish_part,
    shard_dataset,
    share_scan,
)
from ringfeed.shards.options import ShardOptions
from ringfeed.shards.packing import PlannedShard, fingerprint, plan_shards
from ringfeed.shards.parts import (
    LocalFiles,
    assemble,
    cleanup,
    is_part_file,
    journal_name,
    make_marker,
    missing_parts,
    part_shards,
)
from ringfeed.shards.remote import (
    JOURNAL,
    RemoteJournal,
    Store,
    default_staging,
    fetch_source,
    is_url,
    version_of,
)
from ringfeed.shards.sources import Source, open_source
from ringfeed.shards.sources.base import FACTS, SCAN_PREFIX

Kept = dict[str, tuple[ShardInfo, str | None, str | None]]  # name: (info, tar, sidecar ETag)
Versions = dict[str, tuple[str | None, str | None]]  # name: (tar, sidecar ETag)


def shard_remote(opts: ShardOptions) -> ShardRun:
    """`ringfeed shard` when SRC or OUT is a URL: a remote SRC is fetched into staging first,
    then shards go to the store, or to a local OUT (the fetched copy removed once done)."""
    start = time.monotonic()
    fetch_src(opts)
    if opts.out_url:
        return shard_to_store(opts, start)
    run = shard_dataset(opts, start)
    remove_staging(opts)
    return run


def fetch_src(opts: ShardOptions) -> None:
    """A remote SRC is fetched into the staging folder; `opts.src` becomes the local copy."""
    if not opts.src_url:
        return
    assert opts.staging is not None
    try:
        opts.src = fetch_source(opts.src_url, opts.storage_options, opts.staging / "src",
                                opts.policy)
    except OSError as e:
        raise UserError(f"{failure(e, opts.src_url)}; fix that and run the same command "
                        "again") from e


def shard_to_store(opts: ShardOptions, start: float) -> ShardRun:
    assert opts.out_url is not None
    store = Store(opts.out_url, opts.storage_options, opts.policy)
    try:
        return _shard_to_store(opts, store, start)
    except OSError as e:  # the staging disk full, a bucket that is not there: one line
        raise UserError(f"{failure(e, opts.out_url)}; fix that and run the same command again "
                        "(finished shards are kept)") from e


def failure(e: OSError, url: str) -> str:
    """An OSError as 'what: why', naming the file or object."""
    if e.filename:
        return f"{e.filename}: {e.strerror or e}"
    return str(e) if "://" in str(e) else f"{url}: {e}"


def remove_staging(opts: ShardOptions) -> None:
    """After a complete run: the fetched SRC, and the staging folder itself while empty
    (--staging may name a folder holding other things)."""
    if opts.staging is None:
        return
    if opts.src_url:
        shutil.rmtree(opts.staging / "src", ignore_errors=True)
    try:
        opts.staging.rmdir()
    except OSError:
        pass


def _shard_to_store(opts: ShardOptions, store: Store, start: float) -> ShardRun:
    listing = store.list()
    if not listing:
        store.check_bucket()
    check_out_store(store, listing, opts.overwrite, parts=opts.part is not None)
    staging = opts.out
    staging.mkdir(parents=True, exist_ok=True)
    _clean_out_dir(staging, fresh=True)  # local leftovers of a killed run are written again
    journal = RemoteJournal(store, journal_name(opts.part))
    if opts.part is not None:
        fetch_scans(store, listing, staging)
    source = open_source(opts)
    try:
        upload_scan(store, listing, source.shared)
        adopt_src_url(source, opts)
        shards = plan_shards(source, opts)
        plan_id = fingerprint(source, opts, shards)
        mine = part_shards(shards, opts.part)
        if opts.overwrite:
            own = _own_files(opts, mine)
            _clear(store, listing, own)
            listing = {} if own is None else {k: v for k, v in listing.items() if k not in own}
        kept = _kept(store, journal, listing, plan_id, mine)
        journal.start(plan_id, kept)
        todo = [s for s in mine if s.name not in kept]
        infos = {name: info for name, (info, _, _) in kept.items()}
        versions = {name: (tar, index) for name, (_, tar, index) in kept.items()}

        def finished(info: ShardInfo) -> None:  # in build's publishing thread, one at a time
            assert info.index is not None
            index = version_of(store.upload(staging / info.index, info.index))
            tar = version_of(store.upload(staging / info.name, info.name))
            journal.record(info, tar, index)
            infos[info.name], versions[info.name] = info, (tar, index)
            (staging / info.name).unlink()
            (staging / info.index).unlink()

        _write_all(source, todo, opts, finished, ahead=2)  # staging: <= workers + 5 shards
        manifest = _finish(store, opts, source, (shards, mine, plan_id), infos, versions)
        if manifest is not None:  # a part's journal stays until the set is complete (a rerun
            journal.remove()      # of a finished part keeps its shards)
    finally:
        source.close()
        for scan in staging.glob(f"{SCAN_PREFIX}*"):  # the bucket's copy stays for the others
            shutil.rmtree(scan, ignore_errors=True)
    remove_staging(opts)
    return ShardRun(manifest, staging, time.monotonic() - start,
                    written=[s.name for s in todo], kept=sorted(kept), part=opts.part)


def scan_for_parts(opts: ShardOptions) -> str:
    """`--scan`: the scan left in OUT for the parts (build.share_scan), in a bucket uploaded
    from the staging folder; where it is."""
    if opts.out_url is None:
        return str(share_scan(opts))
    store = Store(opts.out_url, opts.storage_options, opts.policy)
    listing = store.list()
    check_out_store(store, listing, False, parts=True)
    opts.out.mkdir(parents=True, exist_ok=True)
    fetch_scans(store, listing, opts.out)
    try:
        shared = share_scan(opts)
        upload_scan(store, listing, shared)
    finally:
        for scan in opts.out.glob(f"{SCAN_PREFIX}*"):
            shutil.rmtree(scan, ignore_errors=True)
        remove_staging(opts)
    return store.url_of(shared.name)


def fetch_scans(store: Store, listing: dict[str, Any], staging: Path) -> None:
    """The shared scans in the bucket (`.ringfeed-scan-KEY/`, whole once its facts.json is
    there: uploaded last), copied into the staging folder, where the source finds the one of
    its key as in a local OUT (sources/base.py SharedScan)."""
    for name in listing:
        folder, _, file = name.partition("/")
        if not folder.startswith(SCAN_PREFIX) or file != FACTS or (staging / folder).is_dir():
            continue
        tmp = staging / f"{folder}.download"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        for member in sorted(n for n in listing if n.startswith(f"{folder}/")):
            store.download(member, tmp / member.partition("/")[2])
        tmp.rename(staging / folder)


def upload_scan(store: Store, listing: dict[str, Any], shared: Path | None) -> None:
    """The scan this part made (published in the staging folder), into the bucket for the
    other parts: its files, then facts.json; none when the bucket has it."""
    if shared is None or f"{shared.name}/{FACTS}" in listing:
        return
    for path in sorted(shared.iterdir(), key=lambda p: p.name == FACTS):
        store.upload(path, f"{shared.name}/{path.name}")


def _finish(store: Store, opts: ShardOptions, source: Source,
            plan: tuple[list[PlannedShard], list[PlannedShard], str],
            infos: dict[str, ShardInfo], versions: Versions) -> Manifest | None:
    """The manifest, uploaded (a whole run; the last part), or a part's marker alone (None)."""
    shards, mine, plan_id = plan
    if opts.part is None:
        manifest = _manifest(source, opts, shards, infos)
    else:
        files = StoreFiles(store)
        marker = make_marker(plan_id, opts.part, len(shards), _manifest(source, opts, shards),
                             [(s.split, infos[s.name], {"version": versions[s.name][0],
                                                        "index_version": versions[s.name][1]})
                              for s in mine])
        done = finish_part(files, marker)
        if done is None:
            return None
        manifest, versions = done[0], _versions(done[1])
    upload_manifest(store, opts.out, manifest, versions)
    if opts.part is not None:
        cleanup(StoreFiles(store))
    return manifest


def _versions(extra: dict[str, dict[str, Any]]) -> Versions:
    return {name: (e.get("version"), e.get("index_version")) for name, e in extra.items()}


def upload_manifest(store: Store, staging: Path, manifest: Manifest, versions: Versions) -> None:
    """Once every shard is up, as recorded: manifest.bin, then manifest.json (the set is
    complete from then on)."""
    staging.mkdir(parents=True, exist_ok=True)
    manifest.save(staging)
    infos = {i.name: i for split in manifest.splits.values() for i in split.shards}
    _check_uploaded(store, infos, versions)
    store.upload(staging / INDEX_NAME, INDEX_NAME)
    store.upload(staging / MANIFEST_NAME, MANIFEST_NAME)  # last: the run is complete
    for name in (MANIFEST_NAME, INDEX_NAME):
        (staging / name).unlink(missing_ok=True)


def merge_parts(out: str, storage_options: dict[str, Any], policy: RetryPolicy) -> Manifest:
    """`ringfeed shard --merge OUT`: the manifest from every part's marker (or the one the last
    part wrote), or one line naming the parts that did not finish."""
    if not is_url(out):
        files: LocalFiles | StoreFiles = LocalFiles(Path(out))
        markers = missing_parts(files)
        if markers is None:
            manifest = Manifest.load(out)
        else:
            manifest = assemble(markers)[0]
            _check_local(Path(out), manifest)
            manifest.save(out)
    else:
        store = Store(out, storage_options, policy)
        files = StoreFiles(store)
        markers = missing_parts(files)
        if markers is None:
            manifest = Manifest.from_dict(json.loads(store.read(MANIFEST_NAME)),
                                          store.url_of(MANIFEST_NAME))
        else:
            manifest, extra = assemble(markers)
            staging = default_staging(out, "--merge")
            upload_manifest(store, staging, manifest, _versions(extra))
            with suppress(OSError):
                staging.rmdir()
    cleanup(files)
    return manifest


def _check_local(out: Path, manifest: Manifest) -> None:
    """Every shard the parts recorded is in OUT with its size."""
    for info in (i for split in manifest.splits.values() for i in split.shards):
        path = out / info.name
        if not path.is_file() or path.stat().st_size != info.bytes:
            raise UserError(f"{path}: missing or not {info.bytes} bytes as its part recorded; "
                            "run that part again, then --merge")


class StoreFiles:
    """parts.Files in a bucket: markers and journals as objects beside the shards."""

    def __init__(self, store: Store):
        self.store = store

    def where(self, name: str) -> str:
        return self.store.url_of(name) if name else self.store.url

    def names(self) -> list[str]:
        return list(self.store.list())

    def read(self, name: str) -> bytes | None:
        try:
            return self.store.read(name)
        except FileNotFoundError:
            return None

    def write(self, name: str, data: bytes) -> None:
        self.store.write(name, data)

    def remove(self, names: list[str]) -> None:
        self.store.remove(names)


def check_out_store(store: Store, listing: dict[str, Any], overwrite: bool,
                    parts: bool = False) -> None:
    """OUT must hold no objects, an unfinished run of ours (to resume), or --overwrite; for a
    part (`parts`), it may hold other parts' shards, journals and markers."""
    if overwrite or JOURNAL in listing:
        return
    if parts and MANIFEST_NAME not in listing:
        listing = {k: v for k, v in listing.items()
                   if not (SHARD_FILE.match(k) or is_part_file(k) or k == INDEX_NAME)}
    if MANIFEST_NAME in listing:
        raise UserError(f"{store.url} already holds shards (manifest.json); pass --overwrite to "
                        "replace them, or choose another OUT")
    if listing:
        first = sorted(listing)[0]
        raise UserError(f"{store.url} is not empty ({len(listing)} objects, e.g. {first!r}); "
                        "choose an empty or new prefix, or pass --overwrite")


def _clear(store: Store, listing: dict[str, Any], own: set[str] | None = None) -> None:
    """--overwrite: the old manifest goes first (no reader may see it without its shards);
    `own`: a part's objects alone (other parts write beside it)."""
    if MANIFEST_NAME in listing:
        store.remove([MANIFEST_NAME])
    store.remove(sorted(name for name in listing if (
        (SHARD_FILE.match(name) or name in (INDEX_NAME, JOURNAL)) if own is None
        else name in own | {INDEX_NAME})))


def _kept(store: Store, journal: RemoteJournal, listing: dict[str, Any], plan_id: str,
          shards: list[PlannedShard]) -> Kept:
    """Shards a previous run of this plan uploaded whose objects are still the ones it
    uploaded (size and ETag of the tar and of its sidecar)."""
    recorded, done = journal.read(listing)
    if recorded is None:
        return {}
    if recorded != plan_id:
        raise UserError(f"{store.url} holds an unfinished run with other input or options; run "
                        "that command again to finish it, or pass --overwrite to start over")
    planned = {s.name: s for s in shards}
    kept: Kept = {}
    for name, (info, tar, index) in done.items():
        if name not in planned or info.bytes != planned[name].bytes or info.index is None:
            continue
        if _same(listing.get(name), info.bytes, tar) and _same(listing.get(info.index), None,
                                                                index):
            kept[name] = (info, tar, index)
    return kept


def _same(info: dict[str, Any] | None, size: int | None, version: str | None,
          unversioned: bool = False) -> bool:
    """Whether a listed object has `size` (None: any) and `version`; a store that tells no
    versions counts as the same only where `unversioned` (a resume cannot trust it)."""
    if info is None or (size is not None and info.get("size") != size):
        return False
    return version_of(info) == version and (version is not None or unversioned)


def _check_uploaded(store: Store, infos: dict[str, ShardInfo], versions: Versions) -> None:
    """Before the manifest: every shard and sidecar it names is in the bucket as uploaded."""
    listing = store.list()
    for name, info in infos.items():
        tar, index = versions[name]
        if not (_same(listing.get(name), info.bytes, tar, unversioned=True)
                and _same(listing.get(info.index or ""), None, index, unversioned=True)):
            raise UserError(f"{store.url_of(name)} (or its index sidecar) is missing or was "
                            "changed since it was uploaded; run the same command again (it is "
                            "uploaded again)")

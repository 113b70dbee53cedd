"""`ringfeed shard VAL_FOLDER OUT --format imagefolder --split val`: a folder of one split alone
(`VAL_FOLDER/<class>/<image>`, e.g. ImageNet's validation images) added to an existing shard set
OUT as split `val` (or any name), its class ids those of OUT's manifest (a class folder OUT does
not have is one line naming it, exit 2).

Order of effects: OUT's manifest is read and the split refused if it is there (without
--overwrite); the folder is scanned and planned as a whole run's split would be; its shards
(`val-000000.tar`, ...) are written and journaled in `.ringfeed-journal-<split>.jsonl`, so a
killed run resumes; then manifest.json is replaced atomically with the split added (its
fields and source recorded), and with --overwrite the old split's shards
the new one does not reuse are deleted.
"""

from __future__ import annotations

import time

from ringfeed.errors import UserError
from ringfeed.formats.manifest import Manifest, ManifestError, ShardInfo, Split
from ringfeed.formats.tarwrite import index_name
from ringfeed.shards.build import ShardRun, _clean_out_dir, _resumable, write_journaled
from ringfeed.shards.journal import Journal
from ringfeed.shards.options import ShardOptions
from ringfeed.shards.packing import fingerprint, plan_shards, split_key
from ringfeed.shards.sources.imagefolder import ImageFolder


def add_split(opts: ShardOptions) -> ShardRun:
    try:
        return _add_split(opts, time.monotonic())
    except OSError as e:  # disk full, no permission: the file, the reason, resume
        raise UserError(f"{e.filename or opts.out}: {e.strerror or e}; fix that and run the same "
                        "command again (finished shards are kept)") from e


def _add_split(opts: ShardOptions, start: float) -> ShardRun:
    split, out = opts.split, opts.out
    assert split is not None
    try:
        manifest = Manifest.load(out)
    except ManifestError as e:
        raise UserError(f"{e}; --split {split} adds a split to an existing shard set: shard "
                        "the train split first") from None
    if split in manifest.splits and not opts.overwrite:
        raise UserError(f"{out} already has split {split!r} ({len(manifest.splits[split].shards)}"
                        " shards); pass --overwrite to replace it, or choose another --split")
    if manifest.source.get("format") != "imagefolder" or not manifest.class_names:
        raise UserError(f"{out}/manifest.json is not an image folder's shards (format "
                        f"{manifest.source.get('format')!r}): --split adds an image folder as a "
                        "split of an image folder's shards")
    source = ImageFolder(opts, manifest.class_names)
    shards = plan_shards(source, opts)
    journal = Journal(out, f".ringfeed-journal-{split}.jsonl")
    plan_id = fingerprint(source, opts, shards)
    kept = _resumable(journal, plan_id, shards, opts)
    own = {s.name for s in shards} | {index_name(s.name) for s in shards} | {journal.path.name}
    _clean_out_dir(out, fresh=False, only=own)
    todo = [s for s in shards if s.name not in kept]
    infos = write_journaled(source, todo, opts, journal, plan_id, kept)
    stale = [i.name for i in manifest.splits.get(split, Split()).shards if i.name not in infos]
    _with_split(manifest, source, opts, [infos[s.name] for s in shards]).save(out)
    journal.remove()
    for name in stale:
        (out / name).unlink(missing_ok=True)
        (out / index_name(name)).unlink(missing_ok=True)
    return ShardRun(manifest, out, time.monotonic() - start, written=[s.name for s in todo],
                    kept=sorted(kept))


def _with_split(manifest: Manifest, source: ImageFolder, opts: ShardOptions,
                infos: list[ShardInfo]) -> Manifest:
    """`manifest` (changed in place) with split `opts.split` of `infos` from `source`; class
    names stay the train split's (an image folder's manifest records no class counts)."""
    split = opts.split
    assert split is not None
    splits = {**manifest.splits, split: Split(infos)}
    manifest.splits = {name: splits[name] for name in sorted(splits, key=split_key)}
    images = sorted({e for e, k in (*manifest.fields.items(), *source.fields.items())
                     if k == "image"})
    manifest.fields = {e: "image" for e in images} | {
        e: k for e, k in manifest.fields.items() if k != "image"}
    manifest.skipped = [*manifest.skipped, *source.skipped]
    description = source.describe()
    description["options"] = {**description["options"], **opts.plan_options()}
    manifest.source = {**manifest.source, "added_splits": {
        **manifest.source.get("added_splits", {}), split: description}}
    return manifest

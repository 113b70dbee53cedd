"""`ringfeed shard`: scan the source, plan the shards, write them (in parallel, resumably), and
write the manifest last.

Order of effects: every input error is raised by the scan, before OUT is touched (beyond creating
it); shards appear under their final names only when complete (temp file + rename), each after
its index sidecar (`NAME.tar.idx`); each finished shard is journaled; manifest.json is written
last, atomically, and then the journal is removed. A resumed run keeps a journaled shard that
still hashes as recorded, and rewrites its sidecar if that is missing or differs from the
shard's index.
"""

from __future__ import annotations

import itertools
import re
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path

from ringfeed.errors import UserError
from ringfeed.formats.manifest import MANIFEST_NAME, Manifest, ShardInfo, Split
from ringfeed.formats.tarindex import build_index
from ringfeed.formats.tarwrite import index_name
from ringfeed.fsutil import atomic_write_bytes, sha256_file
from ringfeed.shards.journal import JOURNAL, Journal
from ringfeed.shards.options import ShardOptions
from ringfeed.shards.packing import PlannedShard, fingerprint, plan_shards
from ringfeed.shards.parallel import fork_pool, parallel_map, pool_task
from ringfeed.shards.parts import (
    Files,
    LocalFiles,
    Marker,
    all_done,
    assemble,
    cleanup,
    is_part_file,
    journal_name,
    make_marker,
    marker_name,
    part_shards,
)
from ringfeed.shards.progress import Progress
from ringfeed.shards.sources import Source, open_source
from ringfeed.shards.sources.text import WORK_DIR
from ringfeed.shards.write import publish_shard, write_shard

SHARD_FILE = re.compile(r"^\w+-\d{6}\.tar(\.idx)?$")  # a shard or its index sidecar
TEMP_FILE = re.compile(  # journals' and parts' markers' too (.ringfeed-...)
    r"^\.(manifest\.json|\.ringfeed-[\w.-]+|\w+-\d{6}\.tar(\.idx)?)\.\w+\.tmp$")


@dataclass
class ShardRun:
    manifest: Manifest | None  # None: a part whose others have not all finished
    out: Path
    seconds: float
    written: list[str] = field(default_factory=list)
    kept: list[str] = field(default_factory=list)
    part: tuple[int, int] | None = None


def created_by() -> str:
    try:
        return f"ringfeed {metadata.version('ringfeed')}"
    except metadata.PackageNotFoundError:
        return "ringfeed"


def shard_dataset(opts: ShardOptions, start: float | None = None) -> ShardRun:
    """Shard a local SRC into a local OUT (`start`: when the run began, if before this call;
    shards/remote_build.py handles URLs and calls this for a fetched SRC)."""
    start = time.monotonic() if start is None else start
    check_out_dir(opts.out, opts.overwrite, opts.src, parts=opts.part is not None)
    try:
        return _shard(opts, start)
    except OSError as e:  # disk full, no permission, input gone: the file, the reason, resume
        raise UserError(f"{e.filename or opts.out}: {e.strerror or e}; fix that and run the same "
                        "command again (finished shards are kept)") from e


def share_scan(opts: ShardOptions) -> Path:
    """`--scan`: scan SRC and leave the scan in OUT (SharedScan) for the parts to read; no
    shards. A scan already there is kept."""
    check_out_dir(opts.out, False, opts.src, parts=True)
    source = open_source(opts)
    try:
        if source.shared is None:
            raise UserError(f"{opts.src}: its scan cannot be shared (a --categorical column of "
                            "values JSON cannot hold, such as dates); run the parts without "
                            "--scan (each scans)")
        return source.shared
    finally:
        source.close()


def _shard(opts: ShardOptions, start: float) -> ShardRun:
    source = open_source(opts)
    try:
        adopt_src_url(source, opts)
        shards = plan_shards(source, opts)
        plan_id = fingerprint(source, opts, shards)
        mine = part_shards(shards, opts.part)
        journal = Journal(opts.out, journal_name(opts.part))
        kept = _resumable(journal, plan_id, mine, opts)
        _clean_out_dir(opts.out, fresh=opts.overwrite, only=_own_files(opts, mine))
        todo = [s for s in mine if s.name not in kept]
        infos = write_journaled(source, todo, opts, journal, plan_id, kept)
        if opts.part is None:
            manifest: Manifest | None = _manifest(source, opts, shards, infos)
        else:
            files = LocalFiles(opts.out)
            marker = make_marker(plan_id, opts.part, len(shards), _manifest(source, opts, shards),
                                 [(s.split, infos[s.name], {}) for s in mine])
            manifest = (finish_part(files, marker) or (None, None))[0]
        if manifest is not None:
            manifest.save(opts.out)
            journal.remove()
            if opts.part is not None:
                cleanup(LocalFiles(opts.out))
    finally:
        source.close()
    return ShardRun(manifest, opts.out, time.monotonic() - start,
                    written=[s.name for s in todo], kept=sorted(kept), part=opts.part)


def finish_part(files: Files, marker: Marker) -> tuple[Manifest, dict[str, dict]] | None:
    """A part's end: its marker, then assemble()'s manifest if every part of its plan is done
    (None while some is not, or when another part has written the manifest meanwhile)."""
    files.write(marker_name((marker.part, marker.parts)), marker.to_bytes())
    markers = all_done(files, marker.plan, marker.parts)
    return None if markers is None else assemble(markers)


def _own_files(opts: ShardOptions, mine: list[PlannedShard]) -> set[str] | None:
    """A part's files in a shared OUT (its shards, sidecars, journal and marker), which alone
    it may clean; None for a whole run (every file is its own)."""
    if opts.part is None:
        return None
    return ({s.name for s in mine} | {index_name(s.name) for s in mine}
            | {journal_name(opts.part), marker_name(opts.part), MANIFEST_NAME})


def adopt_src_url(source: Source, opts: ShardOptions) -> None:
    """A SRC fetched from a URL is recorded (manifest, plan) as that URL, not its local copy."""
    if not opts.src_url:
        return
    local = str(opts.src)
    source.path = opts.src_url  # type: ignore[assignment]
    source.inputs = [(opts.src_url + name[len(local):] if name.startswith(local) else name,
                      size, mtime) for name, size, mtime in source.inputs]


def check_out_dir(out: Path, overwrite: bool, src: Path, parts: bool = False) -> None:
    """OUT must be new, empty, an unfinished run of ours (to resume), or --overwrite; for a
    part (`parts`), it may hold other parts' shards, journals and markers."""
    if src.is_dir() and out.resolve().is_relative_to(src.resolve()):
        raise UserError(f"{out} is inside SRC {src}: the shards would be read as input; "
                        "choose an OUT outside SRC")
    if out.exists() and not out.is_dir():
        raise UserError(f"{out}: exists and is not a folder (OUT is where shards go)")
    if not out.exists() or overwrite or (out / JOURNAL).exists():
        return
    leftovers = {WORK_DIR}  # an interrupted scan leaves only this
    entries = sorted(p.name for p in out.iterdir()
                     if p.name not in leftovers and not TEMP_FILE.match(p.name))
    if parts and MANIFEST_NAME not in entries:
        entries = [e for e in entries if not (SHARD_FILE.match(e) or is_part_file(e))]
    if MANIFEST_NAME in entries:
        raise UserError(f"{out} already holds shards (manifest.json); pass --overwrite to "
                        "replace them, or choose another OUT")
    if entries:
        raise UserError(f"{out} is not empty ({len(entries)} entries, e.g. {entries[0]!r}); "
                        "choose an empty or new folder, or pass --overwrite")


def _resumable(journal: Journal, plan_id: str, shards: list[PlannedShard],
               opts: ShardOptions) -> dict[str, ShardInfo]:
    """Shards a previous run of this same plan finished and that still hash as recorded."""
    recorded, done = journal.read()
    if recorded is None or opts.overwrite:
        return {}
    if recorded != plan_id:
        raise UserError(f"{opts.out} holds an unfinished run with other input or options; run "
                        "that command again to finish it, or pass --overwrite to start over")
    planned = {s.name: s for s in shards}
    candidates = [info for name, info in done.items() if name in planned
                  and info.bytes == planned[name].bytes
                  and (opts.out / name).is_file()
                  and (opts.out / name).stat().st_size == info.bytes]
    kept = parallel_map(_keep, candidates, opts.workers, opts.out, 1)
    return {info.name: info for info in kept if info is not None}


def _keep(out: Path, info: ShardInfo) -> ShardInfo | None:
    """`info` (naming its sidecar) if the shard still hashes as recorded; its sidecar is
    rewritten if missing or not the shard's index (a journal of an older ringfeed has none)."""
    path = out / info.name
    if sha256_file(path) != info.sha256:
        return None
    with open(path, "rb") as f:
        index, reason = build_index(f)
    if reason is not None or index.num_samples != info.num_samples:
        return None
    sidecar, expected = out / index_name(info.name), index.to_bytes()
    try:
        current = sidecar.read_bytes()
    except FileNotFoundError:
        current = None
    if current != expected:
        atomic_write_bytes(sidecar, expected)
    return ShardInfo(info.name, info.num_samples, info.bytes, info.sha256, index_name(info.name))


def _clean_out_dir(out: Path, fresh: bool, only: set[str] | None = None) -> None:
    """Drop temp files of an interrupted run; on --overwrite also the old shards and manifest.
    `only`: a part's own files (and their temp files), since other parts write beside it."""
    out.mkdir(parents=True, exist_ok=True)
    for p in out.iterdir():
        temp = TEMP_FILE.match(p.name)
        if only is not None and (temp.group(1) if temp else p.name) not in only:
            continue
        if temp or (fresh and (SHARD_FILE.match(p.name) or p.name in (MANIFEST_NAME, JOURNAL)
                               or p.name in (only or ()))):
            p.unlink(missing_ok=True)


def _write_task(shared: tuple[Source, Path, Progress], shard: PlannedShard
                ) -> tuple[ShardInfo, Path, Path]:
    source, out, progress = shared
    return write_shard(source, shard, out, progress.on_sample if progress.enabled else None)


def write_journaled(source: Source, todo: list[PlannedShard], opts: ShardOptions,
                    journal: Journal, plan_id: str, kept: dict[str, ShardInfo]
                    ) -> dict[str, ShardInfo]:
    """Write `todo` with the journal started for `plan_id` (keeping `kept`), each shard
    recorded as it is published; every shard's info, the kept ones' included."""
    journal.start(plan_id, kept)
    infos = dict(kept)

    def finished(info: ShardInfo) -> None:
        journal.record(info)
        infos[info.name] = info

    _write_all(source, todo, opts, finished)
    return infos


def _write_all(source: Source, todo: list[PlannedShard], opts: ShardOptions,
               finished: Callable[[ShardInfo], None], ahead: int | None = None) -> None:
    """Write `todo` (in `opts.workers` processes); each written shard's temp files (sidecar, then
    tar) are published (fsync + rename) and then reported to `finished`, in one thread of this
    process, so waiting for the disk overlaps building the next shards. A failed publish stops
    the run at the next shard. `ahead`: at most that many shards wait for `finished` and as
    many more are being built beyond the workers' own (a slow `finished`, an upload, then bounds
    the shards on disk); None: no bound."""
    progress = Progress(sum(s.num_samples for s in todo), opts.progress)
    publishing: deque[Future] = deque()

    def publish_and_report(info: ShardInfo, tmp: Path, index_tmp: Path) -> None:
        publish_shard(opts.out, info, tmp, index_tmp)
        finished(info)

    with ThreadPoolExecutor(1, thread_name_prefix="ringfeed-publish") as publisher:
        def written(result: tuple[ShardInfo, Path, Path]) -> None:
            try:
                while publishing and publishing[0].done():
                    publishing.popleft().result()  # raises what the publish raised
            except BaseException:
                for tmp in result[1:]:  # this shard will not be published
                    tmp.unlink(missing_ok=True)
                raise
            publishing.append(publisher.submit(publish_and_report, *result))
            while ahead is not None and len(publishing) > ahead:
                publishing.popleft().result()

        try:
            workers = min(opts.workers, len(todo))
            if workers <= 1:
                for shard in todo:
                    written(_write_task((source, opts.out, progress), shard))
            else:
                _write_in_pool(workers, todo, (source, opts.out, progress), written, progress,
                               ahead)
            for future in publishing:
                future.result()
        finally:
            progress.close()


def _write_in_pool(workers: int, todo: list[PlannedShard], shared: tuple, written: Callable,
                   progress: Progress, ahead: int | None = None) -> None:
    with fork_pool(workers, shared) as pool:
        queued = iter(todo)
        unhanded: set[Future] = set()

        def submit(count: int) -> None:
            for shard in itertools.islice(queued, count):
                unhanded.add(pool.submit(pool_task(_write_task), shard))

        submit(len(todo) if ahead is None else workers + ahead)
        try:
            while unhanded:
                done, _ = wait(unhanded, timeout=Progress.REFRESH_S, return_when=FIRST_COMPLETED)
                for future in done:
                    written(future.result())
                    unhanded.discard(future)  # its temp file is the publisher's now
                    submit(1)
                progress.refresh()
        except BaseException:
            pool.shutdown(wait=True, cancel_futures=True)
            for future in unhanded:  # written while the run failed, never to be published
                if not future.cancelled() and future.exception() is None:
                    for tmp in future.result()[1:]:
                        tmp.unlink(missing_ok=True)
            raise


def _manifest(source: Source, opts: ShardOptions, shards: list[PlannedShard],
              infos: dict[str, ShardInfo] | None = None) -> Manifest:
    """The manifest of the plan `shards`, written as `infos`; without `infos`, its other
    fields alone (a part's marker)."""
    splits: dict[str, Split] = {}
    for s in shards if infos is not None else ():
        splits.setdefault(s.split, Split()).shards.append(infos[s.name])
    description = source.describe()
    description["options"] = {**description["options"], **opts.plan_options()}
    # the train split's samples: tables compute their per-feature mean/std over these
    features = source.column_stats([(s.part, s.indices) for s in shards if s.split == "train"])
    return Manifest(splits=splits, fields=source.fields, source=description,
                    class_names=source.class_names, text=source.text, skipped=source.skipped,
                    features=features, classes=source.classes, created_by=created_by())

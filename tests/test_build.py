"""`ringfeed shard` into a local OUT (shards/build.py): what OUT may hold before a run, the order
of effects (shards under their names only when complete, each after its sidecar, manifest last,
journal removed), and resuming an interrupted run (journaled shards kept while they hash as
recorded, a changed plan refused, --overwrite starting over). In one process (workers=1), on
an .npz source."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from ringfeed.errors import UserError
from ringfeed.formats.manifest import Manifest
from ringfeed.shards import build
from ringfeed.shards.build import SHARD_FILE, TEMP_FILE, check_out_dir, shard_dataset
from ringfeed.shards.journal import JOURNAL, Journal
from ringfeed.shards.options import ShardOptions


class Killed(Exception):
    """Stands for kill -9 in the middle of a run."""


def options(tmp_path: Path, **kw) -> ShardOptions:
    src = tmp_path / "data.npz"
    if not src.exists():
        np.savez(src, x=np.arange(60, dtype=np.float32).reshape(20, 3), y=np.arange(20) % 4)
    return ShardOptions(**{"src": src, "out": tmp_path / "out", "format": "npz",
                           "fields": {"y": "cls"}, "max_count": 4, "progress": False, **kw})


def files(out: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(out.iterdir())}


def interrupted(monkeypatch, opts: ShardOptions, after: int) -> None:
    """Run and stop it once `after` shards were published."""
    published = []
    publish = build.publish_shard

    def publish_then_die(out_dir, info, tmp, index_tmp):
        if len(published) == after:
            raise Killed
        publish(out_dir, info, tmp, index_tmp)
        published.append(info.name)

    with monkeypatch.context() as m:
        m.setattr(build, "publish_shard", publish_then_die)
        with pytest.raises(Killed):
            shard_dataset(opts)


# -- what OUT may hold ------------------------------------------------------------------------
def test_out_may_be_new_empty_or_hold_only_an_interrupted_runs_leftovers(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    out = tmp_path / "out"
    check_out_dir(out, False, src)
    out.mkdir()
    check_out_dir(out, False, src)
    for leftover in (".ringfeed-work", ".train-000003.tar.x1y2.tmp", ".manifest.json.ab.tmp",
                     ".train-000000.tar.idx.q.tmp"):
        (out / leftover).mkdir() if leftover == ".ringfeed-work" else \
            (out / leftover).write_bytes(b"")
    check_out_dir(out, False, src)


@pytest.mark.parametrize("present, message", [
    (["notes.txt", "a.jpg"], "is not empty (2 entries, e.g. 'a.jpg'); choose an empty or new "
                             "folder, or pass --overwrite"),
    (["manifest.json", "train-000000.tar"], "already holds shards (manifest.json); pass "
                                            "--overwrite"),
])
def test_out_with_other_files_or_finished_shards_is_refused(tmp_path, present, message):
    out = tmp_path / "out"
    out.mkdir()
    for name in present:
        (out / name).write_text("x")
    with pytest.raises(UserError) as exc:
        check_out_dir(out, False, tmp_path / "data.npz")
    assert message in str(exc.value)
    check_out_dir(out, True, tmp_path / "data.npz")  # --overwrite
    (out / JOURNAL).write_text("")
    check_out_dir(out, False, tmp_path / "data.npz")  # an unfinished run: resumed


def test_out_inside_src_or_a_file_is_refused(tmp_path):
    (tmp_path / "src").mkdir()
    with pytest.raises(UserError, match="is inside SRC"):
        check_out_dir(tmp_path / "src" / "shards", False, tmp_path / "src")
    (tmp_path / "file").write_text("x")
    with pytest.raises(UserError, match="exists and is not a folder"):
        check_out_dir(tmp_path / "file", False, tmp_path / "src")


@pytest.mark.parametrize("name, shard, temp", [
    ("train-000000.tar", True, False), ("val-000012.tar.idx", True, False),
    ("train-0.tar", False, False), ("my-000000.tar.gz", False, False),
    (".train-000000.tar.k2j3.tmp", False, True), (".manifest.json.abc.tmp", False, True),
    ("..ringfeed-journal.jsonl.x.tmp", False, True), (".notes.txt.a.tmp", False, False),
])
def test_which_names_are_a_runs_shards_and_temp_files(name, shard, temp):
    assert bool(SHARD_FILE.match(name)) is shard and bool(TEMP_FILE.match(name)) is temp


# -- a run ------------------------------------------------------------------------------------
def test_a_run_leaves_shards_sidecars_and_the_manifest_and_no_journal(tmp_path):
    run = shard_dataset(options(tmp_path))
    names = [f"train-{i:06d}.tar" for i in range(5)]
    assert run.written == names and run.kept == []
    assert sorted(files(run.out)) == sorted([*names, *(n + ".idx" for n in names),
                                             "manifest.json", "manifest.bin"])
    manifest = Manifest.load(run.out)
    assert [s.name for s in manifest.splits["train"].shards] == names
    assert manifest.source["options"]["max_count"] == 4
    assert manifest.created_by.startswith("ringfeed")


def test_a_killed_run_leaves_no_shard_without_its_sidecar_and_no_manifest(tmp_path,
                                                                         monkeypatch):
    opts = options(tmp_path)
    interrupted(monkeypatch, opts, after=2)
    left = files(opts.out)
    assert "manifest.json" not in left and JOURNAL in left
    shards = sorted(n for n in left if n.endswith(".tar"))
    assert shards == ["train-000000.tar", "train-000001.tar"]
    assert all(n + ".idx" in left for n in shards)
    # what a killed run leaves besides: temp files only (the resumed run removes them)
    assert all(TEMP_FILE.match(n) for n in left if n not in shards and not n.endswith(".idx")
               and n != JOURNAL)
    assert list(Journal(opts.out).read()[1]) == shards


def test_a_resumed_run_keeps_finished_shards_and_ends_byte_identical(tmp_path, monkeypatch):
    whole = shard_dataset(options(tmp_path, out=tmp_path / "whole"))
    opts = options(tmp_path)
    interrupted(monkeypatch, opts, after=3)
    (opts.out / "train-000001.tar.idx").unlink()  # a journal of an older ringfeed: no sidecar
    (opts.out / ".train-000003.tar.zz.tmp").write_bytes(b"half a shard")
    run = shard_dataset(opts)
    assert run.kept == ["train-000000.tar", "train-000001.tar", "train-000002.tar"]
    assert run.written == ["train-000003.tar", "train-000004.tar"]
    assert files(opts.out) == files(whole.out)


def test_a_journaled_shard_that_changed_since_is_written_again(tmp_path, monkeypatch):
    opts = options(tmp_path)
    interrupted(monkeypatch, opts, after=2)
    path = opts.out / "train-000001.tar"
    data = bytearray(path.read_bytes())
    data[data.index(b"\x93NUMPY") + 100] ^= 0x01  # same size, other bytes
    path.write_bytes(bytes(data))
    run = shard_dataset(opts)
    assert run.kept == ["train-000000.tar"]
    assert "train-000001.tar" in run.written


def test_resuming_with_other_options_is_refused_until_overwrite(tmp_path, monkeypatch):
    interrupted(monkeypatch, options(tmp_path), after=1)
    with pytest.raises(UserError, match="holds an unfinished run with other input or options"):
        shard_dataset(options(tmp_path, max_count=3))
    run = shard_dataset(options(tmp_path, max_count=3, overwrite=True))
    assert run.kept == [] and len(run.written) == 7


def test_overwrite_removes_the_old_runs_shards(tmp_path):
    shard_dataset(options(tmp_path))  # 5 shards
    (tmp_path / "out" / "notes.txt").write_text("the user's")
    run = shard_dataset(options(tmp_path, max_count=10, overwrite=True))
    left = files(run.out)
    assert sorted(n for n in left if n.endswith(".tar")) == ["train-000000.tar",
                                                              "train-000001.tar"]
    assert "notes.txt" in left  # not a name of ours: kept


def test_a_disk_error_is_one_line_naming_the_file_and_saying_run_again(tmp_path, monkeypatch):
    opts = options(tmp_path)

    def full(*_a, **_k):
        raise OSError(28, "No space left on device", str(opts.out / "train-000002.tar"))

    published = []
    publish = build.publish_shard

    def publish_until_full(out_dir, info, tmp, index_tmp):
        if len(published) == 2:
            full()
        publish(out_dir, info, tmp, index_tmp)
        published.append(info.name)

    monkeypatch.setattr(build, "publish_shard", publish_until_full)
    with pytest.raises(UserError) as exc:
        shard_dataset(opts)
    assert str(exc.value) == (f"{opts.out / 'train-000002.tar'}: No space left on device; fix "
                              "that and run the same command again (finished shards are kept)")

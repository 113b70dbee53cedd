"""`ringfeed shard SRC URL` (shards/remote_build.py), against fsspec's in-memory store
(`memory://`, a real fsspec filesystem in this process): what the prefix may hold before a
run, what is there after it (shards, sidecars, manifest last, no journal, staging gone), which
journaled objects a rerun keeps (the same size and ETag), and --overwrite's order. Against S3
(moto), with faults: test_shards_s3.py."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from ringfeed.errors import UserError
from ringfeed.formats.manifest import ShardInfo
from ringfeed.shards.build import shard_dataset
from ringfeed.shards.options import ShardOptions
from ringfeed.shards.packing import PlannedShard
from ringfeed.shards.remote import JOURNAL, RemoteJournal, Store
from ringfeed.shards.remote_build import _kept, _same, check_out_store, failure, shard_remote


@pytest.fixture
def url(tmp_path: Path):
    """A prefix of the in-memory store of its own; emptied after the test."""
    prefix = f"memory://bucket-{tmp_path.name}/ds"
    yield prefix
    store = Store(prefix, {})
    bucket = store.root.split("/")[0]
    if store.fs.exists(bucket):
        store.fs.rm(bucket, recursive=True)


def options(tmp_path: Path, url: str, **kw) -> ShardOptions:
    src = tmp_path / "data.npz"
    if not src.exists():
        np.savez(src, x=np.arange(60, dtype=np.float32).reshape(20, 3), y=np.arange(20) % 4)
    staging = tmp_path / "staging"
    return ShardOptions(**{"src": src, "out": staging, "format": "npz", "fields": {"y": "cls"},
                           "max_count": 6, "progress": False, "out_url": url,
                           "staging": staging, **kw})


def test_a_run_uploads_shards_sidecars_and_the_manifest_and_leaves_no_staging(tmp_path, url):
    run = shard_remote(options(tmp_path, url))
    names = [f"train-{i:06d}.tar" for i in range(4)]
    assert run.written == names
    store = Store(url, {})
    listing = store.list()
    assert sorted(listing) == sorted([*names, *(n + ".idx" for n in names), "manifest.bin",
                                      "manifest.json"])
    local = shard_dataset(options(tmp_path, url, out=tmp_path / "local", out_url=None))
    for name in [*names, *(n + ".idx" for n in names), "manifest.bin"]:
        assert store.read(name) == (local.out / name).read_bytes(), name  # the plan's bytes
    assert not (tmp_path / "staging").exists()


def test_a_store_that_tells_no_versions_is_written_again_on_a_rerun(tmp_path, url,
                                                                   monkeypatch):
    class Killed(Exception):
        pass

    record = RemoteJournal.record

    def record_two(self, info, tar, index):
        if len(self.lines) == 3:  # the plan and two shards
            raise Killed
        record(self, info, tar, index)

    with monkeypatch.context() as m:
        m.setattr(RemoteJournal, "record", record_two)
        with pytest.raises(Killed):
            shard_remote(options(tmp_path, url))
    store = Store(url, {})
    plan, done = RemoteJournal(store).read(store.list())
    assert plan is not None and sorted(done) == ["train-000000.tar", "train-000001.tar"]
    run = shard_remote(options(tmp_path, url))  # memory:// has no ETags: nothing is trusted
    assert run.kept == [] and len(run.written) == 4
    assert JOURNAL not in store.list()


def test_an_unfinished_run_of_another_plan_is_refused(tmp_path, url):
    RemoteJournal(Store(url, {})).start("some other plan", {})
    with pytest.raises(UserError, match="holds an unfinished run with other input or options"):
        shard_remote(options(tmp_path, url))


@pytest.mark.parametrize("listing, message", [
    ({"manifest.json": {}, "train-000000.tar": {}}, "already holds shards (manifest.json)"),
    ({"b.txt": {}, "a.jpg": {}}, "is not empty (2 objects, e.g. 'a.jpg')"),
])
def test_a_prefix_with_objects_is_refused_unless_a_run_of_ours_or_overwrite(url, listing,
                                                                          message):
    store = Store(url, {})
    check_out_store(store, {}, overwrite=False)
    with pytest.raises(UserError, match=message.replace("(", "\\(").replace(")", "\\)")):
        check_out_store(store, listing, overwrite=False)
    check_out_store(store, listing, overwrite=True)
    check_out_store(store, {**listing, JOURNAL: {}}, overwrite=False)


def test_overwrite_deletes_the_old_manifest_before_the_old_shards(tmp_path, url, monkeypatch):
    shard_remote(options(tmp_path, url))
    store = Store(url, {})
    store.write("notes.txt", b"the user's")
    removed: list[list[str]] = []
    remove = Store.remove

    def recording(self, names):
        removed.append(list(names))
        remove(self, names)

    monkeypatch.setattr(Store, "remove", recording)
    shard_remote(options(tmp_path, url, max_count=20, overwrite=True))
    assert removed[0] == ["manifest.json"]
    assert "manifest.bin" in removed[1] and "train-000003.tar" in removed[1]
    listing = store.list()
    assert "train-000003.tar" not in listing and "notes.txt" in listing
    assert "train-000000.tar" in listing and "manifest.json" in listing


@pytest.mark.parametrize("info, size, version, unversioned, same", [
    (None, 10, "e1", False, False),
    ({"size": 10, "ETag": '"e1"'}, 10, '"e1"', False, True),
    ({"size": 11, "ETag": '"e1"'}, 10, '"e1"', False, False),
    ({"size": 10, "ETag": '"e2"'}, 10, '"e1"', False, False),
    ({"size": 10, "ETag": '"e1"'}, None, '"e1"', False, True),  # a sidecar: any size
    ({"size": 10}, 10, None, False, False),  # no version told: a resume cannot trust it
    ({"size": 10}, 10, None, True, True),  # ... the check before the manifest can
])
def test_an_object_is_the_one_uploaded_while_its_size_and_etag_are(info, size, version,
                                                                   unversioned, same):
    assert _same(info, size, version, unversioned) is same


def test_a_rerun_keeps_the_journaled_shards_whose_objects_are_unchanged(url):
    store = Store(url, {})
    journal = RemoteJournal(store)
    infos = {n: ShardInfo(f"train-00000{n}.tar", 6, 10240, "ab" * 32, f"train-00000{n}.tar.idx")
             for n in range(4)}
    journal.start("plan-1", {})
    for n, info in infos.items():
        journal.record(info, f'"tar{n}"', f'"idx{n}"')
    listing = {JOURNAL: {}}
    for n, info in infos.items():
        listing[info.name] = {"size": 10240, "ETag": f'"tar{n}"'}
        listing[info.index] = {"size": 300, "ETag": f'"idx{n}"'}
    listing["train-000001.tar"]["ETag"] = '"written again"'
    del listing["train-000002.tar.idx"]
    planned = [PlannedShard("train", info.name, "train", np.arange(6), 10240)
               for info in infos.values()]
    planned[3] = PlannedShard("train", infos[3].name, "train", np.arange(6), 20480)
    kept = _kept(store, journal, listing, "plan-1", planned)
    assert kept == {infos[0].name: (infos[0], '"tar0"', '"idx0"')}
    with pytest.raises(UserError, match="holds an unfinished run with other input"):
        _kept(store, journal, listing, "plan-2", planned)


def test_a_storage_error_names_the_object():
    assert failure(OSError(28, "No space left on device", "/staging/x.tar"), "s3://b/p") == \
        "/staging/x.tar: No space left on device"
    assert failure(OSError("timed out"), "s3://b/p") == "s3://b/p: timed out"
    assert failure(OSError("s3://b/p/x.tar: forbidden"), "s3://b/p") == \
        "s3://b/p/x.tar: forbidden"

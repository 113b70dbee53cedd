"""The fast data path: indexed reads, the decoded-sample cache, batches gathered from it, and
the GPU decode option's error path. Every comparison is bit for bit against the plain path
(the tar iterator and a fresh decode) on real shards."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from pipeline_util import png_bytes, write_shards

from ringfeed.formats.manifest import Manifest
from ringfeed.fsutil import sha256_file
from ringfeed.pipeline import PipelineError, ShardPipeline

SIZES = [10, 23, 7, 14]
B = 4


@pytest.fixture()
def shard_dir(tmp_path) -> Path:
    write_shards(tmp_path / "shards", SIZES, images=True)
    return tmp_path / "shards"


def make(source, cache, **kw) -> ShardPipeline:
    kw.setdefault("batch_size", B)
    kw.setdefault("shuffle_buffer", 9)
    kw.setdefault("seed", 1)
    return ShardPipeline(source, cache_dir=cache, **kw)


def epoch(pipe: ShardPipeline, e: int) -> list[dict]:
    pipe.set_epoch(e)
    return [dict(b) for b in pipe]


def assert_same(a: list[dict], b: list[dict]) -> None:
    """Batches equal field by field: arrays by value and dtype, lists by value."""
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        assert x.keys() == y.keys()
        for name in x:
            if isinstance(x[name], np.ndarray):
                assert isinstance(y[name], np.ndarray), name
                assert x[name].dtype == y[name].dtype and x[name].shape == y[name].shape, name
                assert np.array_equal(x[name], y[name]), name
            else:
                assert x[name] == y[name], name


# -- indexed reads ------------------------------------------------------------------------
@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("shuffle", [True, False])  # (unshuffled: consecutive samples, one read)
def test_indexed_reads_equal_the_tar_iterator(shard_dir, tmp_path, workers, shuffle):
    for world, rank in ((1, 0), (3, 2)):
        fast = make(shard_dir, tmp_path / "c", num_workers=workers, rank=rank, world_size=world,
                    balance="pad", shuffle=shuffle)
        plain = make(shard_dir, tmp_path / "c", num_workers=workers, rank=rank,
                     world_size=world, balance="pad", indexed=False, shuffle=shuffle)
        assert_same(epoch(fast, 0), epoch(plain, 0))


def test_indexed_resume_from_the_middle_equals_the_uninterrupted_run(shard_dir, tmp_path):
    full = epoch(make(shard_dir, tmp_path / "c"), 0)
    first = make(shard_dir, tmp_path / "c")
    batches = iter(first)
    for _ in range(5):
        next(batches)
    state = first.state_dict()
    batches.close()
    resumed = make(shard_dir, tmp_path / "c2")
    resumed.load_state_dict(state)
    assert_same([dict(b) for b in resumed], full[5:])


def test_index_is_built_once_and_kept_in_the_cache(shard_dir, tmp_path):
    epoch(make(shard_dir, tmp_path / "c"), 0)
    kept = sorted((tmp_path / "c" / "index").glob("*.idx"))
    assert len(kept) == len(SIZES)  # the test shards have no sidecar: built and cached
    stamps = [p.stat().st_mtime_ns for p in kept]
    epoch(make(shard_dir, tmp_path / "c"), 1)
    assert [p.stat().st_mtime_ns for p in kept] == stamps  # reused, not rebuilt


def test_a_stale_index_is_rebuilt(shard_dir, tmp_path):
    reference = epoch(make(shard_dir, tmp_path / "ref", indexed=False), 0)
    epoch(make(shard_dir, tmp_path / "c"), 0)
    index_files = sorted((tmp_path / "c" / "index").glob("*.idx"))
    data = [p.read_bytes() for p in index_files]
    for p, d in zip(index_files, [data[-1], *data[:-1]], strict=True):  # every one wrong
        p.write_bytes(d)
    assert_same(epoch(make(shard_dir, tmp_path / "c"), 0), reference)


# -- decoded-sample cache -----------------------------------------------------------------
@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("normalize", [None, ((0.5, 0.4, 0.3), (0.2, 0.25, 0.3))])
def test_decoded_cache_batches_equal_a_fresh_decode(shard_dir, tmp_path, workers, normalize):
    fresh = make(shard_dir, tmp_path / "plain", num_workers=workers, normalize=normalize,
                 image_size=6)
    cached = make(shard_dir, tmp_path / "c", num_workers=workers, normalize=normalize,
                  image_size=6, decoded_cache=True)
    for e in range(3):  # epoch 0 writes the entries, 1 and 2 gather from them
        assert_same(epoch(cached, e), epoch(fresh, e))
    entries = list((tmp_path / "c" / "decoded").glob("*.rfd"))
    assert len(entries) == len(SIZES)
    if workers == 0:  # (with worker processes the counters travel with the batches too)
        stats = cached.stats()
        assert stats["decoded_cache_writes"] == len(SIZES)
        assert stats["decoded_cache_hits"] >= len(SIZES)
        assert stats["cached_samples"] > 0


@pytest.mark.system  # torch loader worker processes; importing TensorFlow starts a subprocess
def test_decoded_cache_through_torch_workers_and_tf(shard_dir, tmp_path):
    """The decoded cache filled by one epoch serves the next ones through both adapters - read
    from it (decoded_hits counted, nothing read from the tars) and equal to decoding afresh."""
    from ringfeed.pipeline.tf import make_dataset
    from ringfeed.pipeline.torch import make_loader

    def as_numpy(batch: dict) -> dict:
        return {k: (v.numpy() if hasattr(v, "numpy") else v) for k, v in batch.items()}

    plain = make(shard_dir, tmp_path / "plain", num_workers=2)
    reference = {e: epoch(plain, e) for e in (1, 2)}
    warm = make(shard_dir, tmp_path / "c", num_workers=2, decoded_cache=True)
    epoch(warm, 0)
    assert warm.stats()["decoded_cache_writes"] == len(SIZES)
    before = warm.stats()
    warm.set_epoch(1)
    assert_same([as_numpy(b) for b in make_loader(warm)], reference[1])
    hits = warm.stats()
    assert hits["decoded_cache_hits"] > before["decoded_cache_hits"]
    assert hits["samples_read"] == before["samples_read"]  # no tar read: all from the cache
    warm.set_epoch(2)
    got = []
    for batch in make_dataset(warm):
        batch = as_numpy(batch)
        batch["__key__"] = [k.decode() for k in batch["__key__"]]
        got.append(batch)
    assert_same(got, reference[2])
    after = warm.stats()
    assert after["decoded_cache_hits"] > hits["decoded_cache_hits"]
    assert after["samples_read"] == before["samples_read"]


def test_transform_runs_every_epoch_on_cached_pixels(shard_dir, tmp_path):
    def flip_by_epoch(sample):  # an augmentation: depends on something that changes
        flip_by_epoch.calls += 1
        sample["png"] = sample["png"][:, ::-1].copy() if flip_by_epoch.calls % 2 else sample["png"]
        return sample

    flip_by_epoch.calls = 0
    cached = make(shard_dir, tmp_path / "c", transform=flip_by_epoch, decoded_cache=True,
                  num_workers=0, prefetch=0)
    epoch(cached, 0)
    calls_first = flip_by_epoch.calls
    epoch(cached, 1)
    assert flip_by_epoch.calls == 2 * calls_first  # every sample again, from the cache
    assert cached.stats()["cached_samples"] > 0


def test_a_changed_byte_in_a_decoded_entry_is_never_served(shard_dir, tmp_path, caplog):
    """Bit rot or a stray writer inside an entry's arrays: the checksum taken when the entry
    was written no longer matches, so the entry is removed, counted, reported and written
    again - the batches are those of a fresh decode. Checked when a pipeline's store first maps
    an entry and whenever its size or mtime changes."""

    cache = tmp_path / "c"

    def cached_epoch(e: int) -> tuple[list[dict], dict]:
        pipe = make(shard_dir, cache, decoded_cache=True, shuffle=False, prefetch=0)
        return epoch(pipe, e), pipe.stats()

    reference = epoch(make(shard_dir, tmp_path / "plain", shuffle=False), 0)
    cached_epoch(0)  # fills the cache
    entries = sorted((cache / "decoded").glob("*.rfd"))
    assert len(entries) == len(SIZES)

    def flip(entry: Path, delta: int) -> None:  # one byte inside the images' array
        data = entry.read_bytes()
        length = int.from_bytes(data[-16:-8], "little")
        footer = json.loads(data[-16 - length:-16])
        offset = next(f["offset"] for f in footer["fields"] if f["name"] == "png") + delta
        with open(entry, "r+b") as f:
            f.seek(offset)
            byte = f.read(1)
            f.seek(offset)
            f.write(bytes([byte[0] ^ 0x5A]))

    # 1. written in place: the mtime changes, so this process checks the entry again
    flip(entries[0], 100)
    with caplog.at_level("WARNING", logger="ringfeed.pipeline"):
        got, stats = cached_epoch(0)
    assert_same(got, reference)
    assert stats["decoded_cache_damaged"] == 1 and stats["decoded_cache_writes"] == 1, stats
    assert "changed since it was written (checksum)" in caplog.text
    assert len(list((cache / "decoded").glob("*.rfd"))) == len(SIZES)  # written again
    # 2. changed behind the file's back (the mtime put back, as bit rot leaves it), met by a
    #    store that has not verified the entry yet (each pipeline's store checks afresh)
    victim = sorted((cache / "decoded").glob("*.rfd"))[1]
    st = victim.stat()
    flip(victim, 7)
    os.utime(victim, ns=(st.st_atime_ns, st.st_mtime_ns))
    got, stats = cached_epoch(0)
    assert_same(got, reference)
    assert stats["decoded_cache_damaged"] == 1, stats
    got, stats = cached_epoch(0)  # healthy again: all from the cache, nothing rewritten
    assert stats["decoded_cache_damaged"] == 0 and stats["decoded_cache_writes"] == 0, stats
    assert stats["decoded_cache_hits"] == len(SIZES)


def test_decoded_cache_is_invalidated_by_a_changed_shard_or_settings(shard_dir, tmp_path):
    cache = tmp_path / "c"
    first = epoch(make(shard_dir, cache, decoded_cache=True, shuffle=False), 0)
    assert len(list((cache / "decoded").glob("*.rfd"))) == len(SIZES)
    # other decode settings: other entries, other values
    resized = epoch(make(shard_dir, cache, decoded_cache=True, shuffle=False, image_size=4), 0)
    assert resized[0]["png"].shape[1:] == (4, 4, 3)
    assert len(list((cache / "decoded").glob("*.rfd"))) == 2 * len(SIZES)
    # a rewritten shard (same name, new content, new manifest sha256) is read afresh
    shard = shard_dir / "train-000000.tar"
    import webdataset as wds

    with wds.TarWriter(str(shard)) as sink:
        for pos in range(SIZES[0]):
            sink.write({"__key__": f"s0000_{pos:05d}", "cls": b"7",
                        "npy": np.array([pos, 2 * pos], dtype=np.int64), "png": png_bytes(99)})
    manifest = Manifest.load(shard_dir)
    info = manifest.splits["train"].shards[0]
    info.sha256, info.bytes = sha256_file(shard), shard.stat().st_size
    manifest.save(shard_dir)
    again = epoch(make(shard_dir, cache, decoded_cache=True, shuffle=False), 0)
    assert again[0]["cls"].tolist() == [7] * B and first[0]["cls"].tolist() != [7] * B
    assert np.array_equal(again[0]["png"],
                          epoch(make(shard_dir, tmp_path / "p", shuffle=False), 0)[0]["png"])


def test_decoded_cache_stays_within_the_limit(shard_dir, tmp_path):
    probe = make(shard_dir, tmp_path / "probe", decoded_cache=True)
    epoch(probe, 0)
    sizes = sorted(p.stat().st_size for p in (tmp_path / "probe" / "decoded").glob("*.rfd"))
    limit = sizes[-1] + sizes[-2]  # room for two entries of the four
    pipe = make(shard_dir, tmp_path / "c", decoded_cache=True, cache_limit=limit)
    reference = epoch(make(shard_dir, tmp_path / "plain"), 1)
    epoch(pipe, 0)
    assert_same(epoch(pipe, 1), reference)
    total = sum(p.stat().st_size for p in (tmp_path / "c" / "decoded").glob("*.rfd"))
    assert total <= limit


def test_filling_the_decoded_cache_scans_its_folder_once_while_under_the_limit(
        shard_dir, tmp_path, monkeypatch):
    from ringfeed.pipeline.decoded_cache import DecodedStore

    scans = []
    listing = DecodedStore.entries
    monkeypatch.setattr(DecodedStore, "entries", lambda self: scans.append(1) or listing(self))
    pipe = make(shard_dir, tmp_path / "c", decoded_cache=True, cache_limit=10**9)
    epoch(pipe, 0)
    written = list((tmp_path / "c" / "decoded").glob("*.rfd"))
    assert len(written) == 4  # an entry per shard, and one scan (it was one per entry)
    assert len(scans) == 1


def test_shards_that_cannot_be_cached_are_read_as_they_are(tmp_path):
    import webdataset as wds

    d = tmp_path / "shards"
    write_shards(d, [6, 6], images=True)
    with wds.TarWriter(str(d / "train-000001.tar")) as sink:  # a json field: not an array
        for pos in range(6):
            sink.write({"__key__": f"s0001_{pos:05d}", "cls": b"1",
                        "npy": np.array([6 + pos, 12 + 2 * pos], dtype=np.int64),
                        "png": png_bytes(6 + pos), "json": json.dumps({"a": pos}).encode()})
    manifest = Manifest.load(d)
    info = manifest.splits["train"].shards[1]
    info.sha256, info.bytes = sha256_file(d / "train-000001.tar"), (d / "train-000001.tar").stat().st_size
    manifest.save(d)
    kw = {"balance": "pad", "shuffle": False, "batch_size": 6}
    cached = make(d, tmp_path / "c", decoded_cache=True, **kw)
    plain = make(d, tmp_path / "p", **kw)
    for e in range(2):
        got, want = epoch(cached, e), epoch(plain, e)
        assert [b["__key__"] for b in got] == [b["__key__"] for b in want]
        assert np.array_equal(got[0]["png"], want[0]["png"])
    assert len(list((tmp_path / "c" / "decoded").glob("*.rfd"))) == 1


def test_a_bad_sample_keeps_its_shard_out_of_the_cache_and_is_skipped_as_before(tmp_path):
    import io
    import tarfile

    d = tmp_path / "shards"
    paths = write_shards(d, [8, 8], images=True)
    members = []
    with tarfile.open(paths[1]) as tar:
        for m in tar.getmembers():
            members.append((m, tar.extractfile(m).read()))
    with tarfile.open(paths[1], "w") as tar:
        for m, payload in members:
            if m.name == "s0001_00003.png":
                payload = b"not a png"
                m.size = len(payload)
            tar.addfile(m, io.BytesIO(payload))
    # (the manifest still lists the old sha256: the shard is local, read in place)
    kw = {"balance": "pad", "shuffle": False}
    for e in range(2):
        cached = make(d, tmp_path / "c", decoded_cache=True, **kw)
        plain = make(d, tmp_path / "p", indexed=False, **kw)
        assert_same(epoch(cached, e), epoch(plain, e))
        assert cached.stats()["skipped"] == plain.stats()["skipped"] == 1


@pytest.mark.system
def test_two_processes_share_one_decoded_cache(shard_dir, tmp_path):
    """Two ranks of one host fill and read the same cache directory at the same time."""
    script = tmp_path / "rank.py"
    script.write_text(f"""
import json, sys
sys.path.insert(0, {str(Path(__file__).resolve().parent.parent)!r})
from ringfeed.pipeline import ShardPipeline
rank, out = int(sys.argv[1]), sys.argv[2]
pipe = ShardPipeline({str(shard_dir)!r}, batch_size={B}, seed=1, shuffle_buffer=9, rank=rank,
                     world_size=2, balance="pad", cache_dir={str(tmp_path / "shared")!r},
                     decoded_cache=True)
seen = []
for e in range(3):
    pipe.set_epoch(e)
    seen.append([[b["__key__"], b["png"].tolist(), b["cls"].tolist()] for b in pipe])
json.dump(seen, open(out, "w"))
""")
    procs = [subprocess.Popen([sys.executable, str(script), str(r), str(tmp_path / f"{r}.json")])
             for r in (0, 1)]
    for p in procs:
        assert p.wait(timeout=120) == 0
    for r in (0, 1):
        plain = make(shard_dir, tmp_path / "plain", rank=r, world_size=2, balance="pad")
        want = [[[b["__key__"], b["png"].tolist(), b["cls"].tolist()] for b in epoch(plain, e)]
                for e in range(3)]
        assert json.loads((tmp_path / f"{r}.json").read_text()) == want
    decoded = tmp_path / "shared" / "decoded"
    assert len(list(decoded.glob("*.rfd"))) == len(SIZES)
    assert not list(decoded.glob(".*.tmp"))


def test_auto_turns_the_cache_on_only_when_it_fits(shard_dir, tmp_path):
    assert make(shard_dir, tmp_path / "a", decoded_cache="auto").decoded_cache
    assert not make(shard_dir, tmp_path / "b", decoded_cache="auto", cache_limit=100).decoded_cache
    assert not make(shard_dir, tmp_path / "c").decoded_cache  # off unless asked


# -- GPU decode ---------------------------------------------------------------------------
def test_gpu_decode_without_a_gpu_is_one_clear_error(shard_dir, tmp_path):
    with pytest.raises(PipelineError, match="decode_device") as err:
        make(shard_dir, tmp_path / "c", decode_device="cuda")
    assert "\n" not in str(err.value)
    with pytest.raises(PipelineError, match="decode_device: Input should be 'cpu' or 'cuda'"):
        make(shard_dir, tmp_path / "c", decode_device="tpu")


def test_remote_sidecars_are_fetched_once_and_used(tmp_path):
    """Shards made by `ringfeed shard` carry index sidecars: a remote reader fetches each one
    once into its index cache (no tar scan) and reads exactly what local reading gives."""
    from PIL import Image
    from pipeline_util import http_server

    from ringfeed.train.cli import main as ringfeed

    src = tmp_path / "images"
    for i in range(24):
        (src / f"c{i % 3}").mkdir(parents=True, exist_ok=True)
        Image.fromarray(np.full((5, 5, 3), i * 9, np.uint8)).save(src / f"c{i % 3}" / f"{i}.png")
    out = tmp_path / "shards"
    assert ringfeed(["shard", str(src), str(out), "--format", "imagefolder", "--max-count", "7",
                     "--no-progress"]) == 0
    sidecars = sorted(p.name for p in out.glob("*.idx"))
    assert len(sidecars) == 4
    local = epoch(make(out, tmp_path / "local"), 0)
    with http_server(out) as (url, requests):
        for _ in range(2):  # two runs sharing one cache
            assert_same(epoch(make(url, tmp_path / "cache"), 0), local)
        assert sorted(r for r in requests if r.endswith(".idx")) == sidecars
    assert len(list((tmp_path / "cache" / "index").glob("*.sidecar.idx"))) == 4
    assert not list((tmp_path / "cache" / "index").glob("*[0-9a-f].idx"))  # nothing built


def test_an_unwritable_decoded_cache_only_costs_speed(shard_dir, tmp_path):
    cache = tmp_path / "c"
    cache.mkdir()
    (cache / "decoded").write_text("a file where the cache directory should be")  # even root
    pipe = make(shard_dir, cache, decoded_cache=True)
    plain = make(shard_dir, tmp_path / "p")
    for e in range(2):
        assert_same(epoch(pipe, e), epoch(plain, e))
    assert pipe.stats()["decoded_cache_writes"] == 0


def test_decode_threads_give_the_same_batches(shard_dir, tmp_path):
    plain = make(shard_dir, tmp_path / "plain", image_size=6)
    for cached in (False, True):
        threaded = make(shard_dir, tmp_path / f"t{cached}", image_size=6, decode_threads=2,
                        decoded_cache=cached)
        for e in range(2):
            assert_same(epoch(threaded, e), epoch(plain, e))
    with pytest.raises(PipelineError, match="decode_threads"):
        make(shard_dir, tmp_path / "x", decode_threads=-1)

"""manifest.bin (ringfeed/formats/manifest_index.py): the compact binary index of manifest.json that the
pipeline memory-maps instead of parsing the JSON on every rank (issue 17)."""

from __future__ import annotations

import os
import pickle

import numpy as np
import pytest
from pipeline_util import collect, http_server, write_shards

from ringfeed.formats import manifest_index as mi
from ringfeed.formats.manifest import Manifest, ManifestError, ShardInfo, Split
from ringfeed.pipeline import PipelineError, ShardPipeline
from ringfeed.pipeline.source import ShardRefs

pytestmark = pytest.mark.integration  # real files, a server on 127.0.0.1, loader workers
SIZES = [5, 0, 7, 3]


def example_manifest() -> Manifest:
    train = [ShardInfo("train-000000.tar", 5, 1000, "ab" * 32, "train-000000.tar.idx"),
             ShardInfo("sub/tr\u00e4in-1.tar", 0, 10, None, None),
             ShardInfo("http://host/x.tar", 7, 123456789012, "0f" * 32, None)]
    return Manifest(splits={"train": Split(train), "val": Split([])},
                    fields={"png": "image", "cls": "int"}, class_names=["a", "b"],
                    text={"seq_len": 8}, created_by="tests")


def refuse_json(m: pytest.MonkeyPatch) -> None:
    """Fail any parse of manifest JSON into a Manifest (what the index exists to avoid)."""
    m.setattr(Manifest, "from_dict", lambda *a, **k: pytest.fail("manifest.json was parsed"))


def test_save_writes_the_index_beside_the_json_and_it_round_trips(tmp_path):
    manifest = example_manifest()
    manifest.save(tmp_path)
    index = mi.load_index(tmp_path / "manifest.json", None)
    assert index.path == tmp_path / mi.INDEX_NAME
    assert index.split_names == ["train", "val"]
    assert list(index.split("train")) == manifest.splits["train"].shards
    assert list(index.split("val")) == []
    assert index.split("train").counts.tolist() == [5, 0, 7]
    again = index.manifest()
    assert {k: v for k, v in vars(again).items() if k != "splits"} == \
        {k: v for k, v in vars(manifest).items() if k != "splits"}
    assert again.splits["train"].shards[-1] == manifest.splits["train"].shards[-1]
    with pytest.raises(ManifestError, match="split 'test' not in manifest"):
        index.split("test")


def test_the_index_bytes_depend_only_on_the_manifest(tmp_path):
    for d in ("a", "b"):
        example_manifest().save(tmp_path / d)
    assert (tmp_path / "a" / mi.INDEX_NAME).read_bytes() == \
        (tmp_path / "b" / mi.INDEX_NAME).read_bytes()


def test_the_pipeline_maps_the_index_and_never_parses_the_json(tmp_path, monkeypatch):
    write_shards(tmp_path / "s", SIZES)
    expected = collect(ShardPipeline(tmp_path / "s", batch_size=2, seed=1, num_workers=2))
    with monkeypatch.context() as m:
        refuse_json(m)
        pipe = ShardPipeline(tmp_path / "s", batch_size=2, seed=1, num_workers=2)
        assert isinstance(pipe.refs, ShardRefs) and len(pipe.refs) == len(SIZES)
        assert isinstance(pipe.layout.counts.base, np.memmap)  # no copy of the counts
        assert pipe.manifest.fields == {"cls": "int", "npy": "npy"}
        assert pipe.refs[2].url == str(tmp_path / "s" / "train-000002.tar")
        assert pipe.refs[2].num_samples == 7 and len(pipe.refs[2].sha256) == 64
        assert collect(pipe) == expected
        # loader workers get the refs pickled: they map the file again
        assert list(pickle.loads(pickle.dumps(pipe.refs))) == list(pipe.refs)


def test_a_manifest_without_index_gets_one_built_once_into_the_cache(tmp_path, monkeypatch):
    write_shards(tmp_path / "s", SIZES)
    (tmp_path / "s" / mi.INDEX_NAME).unlink()  # as written by an older ringfeed
    expected = Manifest.load(tmp_path / "s").splits["train"].shards
    pipe = ShardPipeline(tmp_path / "s", batch_size=2, cache_dir=tmp_path / "cache")
    built = list((tmp_path / "cache" / "manifests").glob("*.bin"))
    assert len(built) == 1 and not (tmp_path / "s" / mi.INDEX_NAME).exists()
    assert list(pipe.refs.shards) == expected
    with monkeypatch.context() as m:  # the next rank or run maps it, no JSON parse
        refuse_json(m)
        again = ShardPipeline(tmp_path / "s", batch_size=2, cache_dir=tmp_path / "cache")
        assert again.refs.shards.index.path == built[0]


def test_a_rewritten_manifest_is_never_served_a_stale_index(tmp_path):
    write_shards(tmp_path / "s", SIZES)
    ShardPipeline(tmp_path / "s", batch_size=2, cache_dir=tmp_path / "cache")
    manifest = Manifest.load(tmp_path / "s")
    manifest.splits["train"].shards.pop()
    # another tool rewrites the JSON and leaves the old index beside it
    index_bytes = (tmp_path / "s" / mi.INDEX_NAME).read_bytes()
    manifest.save(tmp_path / "s")
    (tmp_path / "s" / mi.INDEX_NAME).write_bytes(index_bytes)
    later = (tmp_path / "s" / "manifest.json").stat().st_mtime_ns + 10**9
    os.utime(tmp_path / "s" / "manifest.json", ns=(later, later))
    pipe = ShardPipeline(tmp_path / "s", batch_size=2, cache_dir=tmp_path / "cache")
    assert len(pipe.refs) == len(SIZES) - 1


def test_no_writable_cache_still_works_in_memory(tmp_path):
    write_shards(tmp_path / "s", SIZES)
    (tmp_path / "s" / mi.INDEX_NAME).unlink()
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "manifests").write_text("a file where the directory should be")
    pipe = ShardPipeline(tmp_path / "s", batch_size=2, cache_dir=cache, num_workers=2)
    assert pipe.refs.shards.index.path is None
    assert pipe.layout.counts.tolist() == SIZES
    assert list(pickle.loads(pickle.dumps(pipe.refs))) == list(pipe.refs)
    from ringfeed.pipeline.torch import make_loader

    assert collect(make_loader(pipe)) == collect(ShardPipeline(tmp_path / "s", batch_size=2,
                                                               num_workers=2))


def test_remote_manifest_index_is_cached_by_content(tmp_path, monkeypatch):
    write_shards(tmp_path / "s", SIZES)
    local = collect(ShardPipeline(tmp_path / "s", batch_size=2, cache_dir=tmp_path / "c0"))
    with http_server(tmp_path / "s") as (url, requests):
        first = ShardPipeline(url, batch_size=2, cache_dir=tmp_path / "cache")
        assert collect(first) == local
        with monkeypatch.context() as m:  # a second rank: downloads the JSON, does not parse it
            refuse_json(m)
            second = ShardPipeline(url, batch_size=2, cache_dir=tmp_path / "cache")
        assert second.refs.shards.index.path == first.refs.shards.index.path
        assert mi.INDEX_NAME not in requests  # only manifest.json and shards are fetched
        with pytest.raises(PipelineError, match="split 'test' not in manifest"):
            ShardPipeline(url, split="test", batch_size=2, cache_dir=tmp_path / "cache")


def test_a_corrupt_or_foreign_index_is_rebuilt_not_trusted(tmp_path):
    write_shards(tmp_path / "s", SIZES)
    path = tmp_path / "s" / mi.INDEX_NAME
    for damage in (b"", path.read_bytes()[:200], b"x" * 500):
        path.write_bytes(damage)
        pipe = ShardPipeline(tmp_path / "s", batch_size=2, cache_dir=tmp_path / "cache")
        assert pipe.layout.counts.tolist() == SIZES


def test_a_synthetic_million_shard_index_loads_without_tar_files(tmp_path):
    """The benchmark's way to make huge manifests: arrays straight into the index (here 10^5
    shards, no tar files); a pipeline over it plans without touching a shard."""
    import importlib.util

    from helpers import REPO

    spec = importlib.util.spec_from_file_location("plan_bench",
                                                  REPO / "benchmarks" / "plan_bench.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    counts = bench.synthetic_manifest(tmp_path, 10**5, 10**8, seed=0)
    pipe = ShardPipeline(tmp_path, batch_size=32, rank=4095, world_size=4096,
                         cache_dir=tmp_path / "cache")
    assert len(pipe.refs) == 10**5 and pipe.layout.num_samples == int(counts.sum())
    ref = pipe.refs[12345]
    assert ref.url == str(tmp_path / "train-0012345.tar") and ref.num_samples == counts[12345]
    assert pipe.refs.urls_starting_with("pipe:") == []
    plan = pipe.begin()[0]
    assert len(plan.worker(4095, 0).ids) == plan.batches * 32
    assert not list((tmp_path / "cache").glob("manifests/*.bin"))  # the index beside was used


@pytest.mark.parametrize("field", ["counts", "names", "flags"])
def test_a_changed_byte_in_the_index_is_never_trusted(tmp_path, caplog, field):
    """A byte of manifest.bin changed in place (bit rot, a stray writer) - the file still parses
    - is caught by the array's crc32: the pipeline plans from an index rebuilt from the JSON,
    and says so once. (Without the check, a flipped count silently changes the plan.)"""
    write_shards(tmp_path / "s", SIZES)
    path = tmp_path / "s" / mi.INDEX_NAME
    index = mi.ManifestIndex(path)
    offset = index.data_start + index.header["splits"]["train"][field][0]
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))
    os.utime(path, ns=(os.stat(path).st_atime_ns, os.stat(path).st_mtime_ns + 10**9))
    with pytest.raises(ManifestError, match=f"damaged manifest index .*{field}: crc32"):
        mi.ManifestIndex(path)
    pipe = ShardPipeline(tmp_path / "s", batch_size=2, cache_dir=tmp_path / "cache")
    assert pipe.layout.counts.tolist() == SIZES
    assert [r.url.rsplit("/", 1)[1] for r in pipe.refs] == [
        f"train-{i:06d}.tar" for i in range(len(SIZES))]
    assert "damaged manifest index" in caplog.text

"""pipeline/opener.py: a worker stream's open stage (ShardOpener, DecodedLookup, fill_decoded)
over real shards (tests/pipeline_util.py), a real shard cache and a real decoded cache; the
stream's read plan and context come from a real ShardPipeline."""

from __future__ import annotations

import io
import tarfile
from pathlib import Path

import numpy as np
import pytest
from pipeline_util import write_shards

from ringfeed.pipeline import ShardPipeline
from ringfeed.pipeline.decoded_cache import CachedShard
from ringfeed.pipeline.opener import DecodedLookup, ShardOpener, fill_decoded
from ringfeed.pipeline.readplan import ReadPlan
from ringfeed.pipeline.shardread import IndexedSamples, open_samples
from ringfeed.pipeline.stats import StreamCounters

SIZES = [6, 5, 7]


@pytest.fixture(scope="module")
def shard_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("opener")
    write_shards(root, SIZES, images=True)
    return root


def pipe_of(source, tmp_path, **options):
    options = {"batch_size": 3, "shuffle": False, "num_workers": 0, "prefetch": 1,
               "cache_dir": str(tmp_path / "cache"), **options}
    return ShardPipeline(source, rank=0, world_size=1, **options)


def read_plan(pipe):
    """Worker stream 0's read plan for the pipeline's current pass (all of it)."""
    plan, _, _ = pipe.begin()
    worker = plan.worker(0, 0)
    return ReadPlan(worker, worker.order, pipe.context.layout)


def open_all(pipe):
    """Every run of the pass opened: (opener, its sources by run, the counters)."""
    reads, counters = read_plan(pipe), StreamCounters()
    opener = ShardOpener(pipe.context, reads, counters)
    return opener, opener.open_through(len(reads.run_shard) - 1), counters


def keys_of(source, n):
    if isinstance(source, CachedShard):
        return list(source.keys[:n])
    return [source.get(p)["__key__"] for p in range(n)]


def test_runs_open_in_read_order_and_close_after_their_last_use(shard_dir, tmp_path):
    pipe = pipe_of(shard_dir, tmp_path)
    reads, counters = read_plan(pipe), StreamCounters()
    assert reads.run_shard.tolist() == [0, 1, 2]  # unshuffled: one run per shard, in order
    opener = ShardOpener(pipe.context, reads, counters)
    assert list(opener.open_through(1)) == [0, 1]
    assert counters.counts["shards_opened"] == 2
    assert all(type(s) is IndexedSamples for s in opener.open.values())
    assert keys_of(opener.open[1], 2) == ["s0001_00000", "s0001_00001"]
    assert opener.open[0].get(5)["__key__"] == "s0000_00005"
    opener.close_finished(int(reads.last_use[0]))  # run 0's last slot went out
    assert list(opener.open) == [1]
    assert counters.counts["bytes_read"] > 0  # booked as run 0 closed
    assert list(opener.open_through(2)) == [1, 2]
    opener.close()
    assert opener.open == {}
    assert counters.counts["shards_opened"] == 3


def test_without_indexes_shards_are_read_in_tar_order(shard_dir, tmp_path):
    opener, sources, _ = open_all(pipe_of(shard_dir, tmp_path, indexed=False))
    try:
        assert not any(isinstance(s, IndexedSamples) for s in sources.values())
        assert [keys_of(sources[r], 2) for r in sources] == [
            [f"s{s:04d}_{p:05d}" for p in range(2)] for s in range(3)]
    finally:
        opener.close()


def test_the_first_open_fills_the_decoded_cache_and_the_next_reads_it(shard_dir, tmp_path):
    pipe = pipe_of(shard_dir, tmp_path, decoded_cache=True)
    opener, sources, counters = open_all(pipe)
    try:
        assert all(isinstance(s, CachedShard) for s in sources.values())
        assert counters.counts["decoded_writes"] == len(SIZES)
        assert [s.num_samples for s in sources.values()] == SIZES
    finally:
        opener.close()
    again = pipe_of(shard_dir, tmp_path, decoded_cache=True)
    opener, sources, counters = open_all(again)
    try:
        assert counters.counts["decoded_hits"] == len(SIZES)
        assert counters.counts["decoded_writes"] == 0
        assert keys_of(sources[2], 7) == [f"s0002_{p:05d}" for p in range(7)]
        first = sources[0].sample(0)
        assert np.array_equal(first["npy"], [0, 0]) and first["png"].shape == (8, 8, 3)
    finally:
        opener.close()


def test_a_damaged_entry_is_removed_counted_and_written_again(shard_dir, tmp_path):
    opener, _, _ = open_all(pipe_of(shard_dir, tmp_path, decoded_cache=True))
    opener.close()
    entries = sorted((tmp_path / "cache" / "decoded").glob("train-000001*.rfd"))
    assert len(entries) == 1
    data = bytearray(entries[0].read_bytes())
    data[len(data) // 3] ^= 0xFF  # inside the arrays: its crc32 no longer matches
    entries[0].write_bytes(bytes(data))
    opener, sources, counters = open_all(pipe_of(shard_dir, tmp_path, decoded_cache=True))
    try:
        assert counters.counts["decoded_damaged"] == 1
        assert counters.counts["decoded_hits"] == 2
        assert counters.counts["decoded_writes"] == 1  # shard 1 read and cached again
        assert keys_of(sources[1], 5) == [f"s0001_{p:05d}" for p in range(5)]
    finally:
        opener.close()


def test_decoded_lookup_decides_runs_only_as_far_as_asked(shard_dir, tmp_path):
    pipe = pipe_of(shard_dir, tmp_path, decoded_cache=True)
    run_shard = np.array([2, 0, 1], dtype=np.int64)
    lookup = DecodedLookup(pipe.context.decoded, pipe.refs, run_shard)
    lookup.decide_through(0)
    assert list(lookup.paths) == [0] and "train-000002" in lookup.paths[0].name
    assert not lookup.cached.any()  # nothing written yet
    lookup.decide_through(2)
    assert sorted(lookup.paths) == [0, 1, 2]
    off = DecodedLookup(None, pipe.refs, run_shard)
    off.decide_through(2)
    assert off.paths == {0: None, 1: None, 2: None} and not off.cached.any()


def with_bad_member(src: Path, dst: Path, name: str) -> Path:
    """A copy of tar `src` with member `name`'s bytes replaced by junk."""
    with tarfile.open(src) as tin, tarfile.open(dst, "w") as tout:
        for member in tin.getmembers():
            body = tin.extractfile(member).read()
            if member.name == name:
                body = b"not an npy file"
            info = tarfile.TarInfo(member.name)
            info.size, info.mtime = len(body), member.mtime
            tout.addfile(info, io.BytesIO(body))
    return dst


def test_a_shard_with_a_bad_sample_is_not_cached_and_leaves_no_entry(shard_dir, tmp_path):
    bad = with_bad_member(shard_dir / "train-000000.tar", tmp_path / "bad.tar",
                          "s0000_00004.npy")
    pipe = pipe_of([str(bad)], tmp_path, decoded_cache=True,
                   fields={"cls": "int", "npy": "npy", "png": "image"})
    ref, store = pipe.refs[0], pipe.context.decoded
    path = store.directory / "bad-entry.rfd"
    counters = StreamCounters()
    samples = open_samples(pipe.cache.open(ref), pipe.indexes)
    try:
        assert type(samples) is IndexedSamples
        assert fill_decoded(store, path, samples, ref, pipe.context.decoder, counters) is None
    finally:
        samples.close()
    assert counters.counts["decoded_writes"] == 0
    assert not path.exists() and not list(store.directory.glob(".*.tmp"))

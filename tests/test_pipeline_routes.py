"""pipeline/routes.py: the read -> decode -> batch routes of a worker stream (DecodedBatches,
ColumnBatches, SampleBatches, with GoodSamples) over real shards (tests/pipeline_util.py) opened
by the real open stage. Sample g's `npy` is [g, 2g] and `cls` is g % 10, so every value names
its sample."""

from __future__ import annotations

import io
import tarfile
from pathlib import Path

import numpy as np
import pytest
from pipeline_util import write_shards

from ringfeed.pipeline import ShardPipeline
from ringfeed.pipeline.errors import PipelineDataError
from ringfeed.pipeline.opener import ShardOpener
from ringfeed.pipeline.readplan import ReadPlan
from ringfeed.pipeline.routes import (
    ColumnBatches,
    DecodedBatches,
    Fallback,
    GoodSamples,
    SampleBatches,
)
from ringfeed.pipeline.stats import StreamCounters

SIZES = [8, 8]
B = 4
FIELDS = {"cls": "int", "npy": "npy"}


@pytest.fixture(scope="module")
def shard_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("routes")
    write_shards(root, SIZES)
    return root


class Stream:
    """A pipeline's worker stream 0, opened: its chunks and the sources they read."""

    def __init__(self, source, tmp_path, **options):
        options = {"batch_size": B, "shuffle": False, "num_workers": 0, "prefetch": 1,
                   "cache_dir": str(tmp_path / "cache"), **options}
        self.pipe = ShardPipeline(source, rank=0, world_size=1, **options)
        plan, _, _ = self.pipe.begin()
        worker = plan.worker(0, 0)
        self.reads = ReadPlan(worker, worker.order, self.pipe.context.layout)
        self.counters, self.good = StreamCounters(), GoodSamples()
        self.opener = ShardOpener(self.pipe.context, self.reads, self.counters)
        self.chunks = list(self.reads.chunks())
        self.sources = self.opener.open_through(len(self.reads.run_shard) - 1)
        self.decoder = self.pipe.context.decoder

    def route(self, kind, **kw):
        return kind(self.decoder, self.reads, self.good, self.counters, **kw)

    def samples(self, on_error="skip"):
        return self.route(SampleBatches, on_error=on_error, stream_name="stream 0")

    def close(self):
        self.opener.close()


@pytest.fixture
def open_streams():
    made = []

    def make(source, tmp_path, **options):
        made.append(Stream(source, tmp_path, **options))
        return made[-1]

    yield make
    for stream in made:
        stream.close()


def assert_names_its_samples(assembled, ids):
    assert assembled.ids.tolist() == ids
    assert np.asarray(assembled.fields["npy"]).tolist() == [[g, 2 * g] for g in ids]
    assert np.asarray(assembled.fields["cls"]).tolist() == [g % 10 for g in ids]


def with_bad_npy(src: Path, dst: Path, keys: set[str]) -> Path:
    """A copy of tar `src` whose samples `keys` have junk for their npy member."""
    with tarfile.open(src) as tin, tarfile.open(dst, "w") as tout:
        for member in tin.getmembers():
            body = tin.extractfile(member).read()
            if member.name.endswith(".npy") and member.name.split(".")[0] in keys:
                body = b"not an npy file"
            info = tarfile.TarInfo(member.name)
            info.size, info.mtime = len(body), member.mtime
            tout.addfile(info, io.BytesIO(body))
    return dst


def test_column_batches_read_indexed_shards_a_field_at_a_time(shard_dir, tmp_path,
                                                              open_streams):
    s = open_streams(shard_dir, tmp_path)
    columns = s.route(ColumnBatches)
    chunk = s.chunks[1]
    assert columns.applies(chunk, s.sources)
    assembled = columns.read(chunk, s.sources)
    assert_names_its_samples(assembled, [4, 5, 6, 7])
    assert assembled.keys == [f"s0000_{p:05d}" for p in range(4, 8)]
    assert assembled.valid.all()
    assert s.counters.counts["samples_read"] == B
    assert s.good.last[1] == "s0000_00007"  # the latest good sample, for a bad one to repeat


def test_sample_batches_give_what_column_batches_give(shard_dir, tmp_path, open_streams):
    s = open_streams(shard_dir, tmp_path)
    samples = s.samples()
    for chunk in s.chunks:
        want = s.route(ColumnBatches).read(chunk, s.sources)
        (got,) = list(samples.add(chunk, s.sources))
        assert got.keys == want.keys and np.array_equal(got.ids, want.ids)
        for name in ("npy", "cls"):
            assert np.array_equal(got.fields[name], want.fields[name])
    assert samples.idle
    samples.finish()


def test_a_user_transform_or_unindexed_shards_take_the_sample_route(shard_dir, tmp_path,
                                                                    open_streams):
    hooked = open_streams(shard_dir, tmp_path / "a", transform=lambda sample: sample)
    assert not hooked.route(ColumnBatches).applies(hooked.chunks[0], hooked.sources)
    plain = open_streams(shard_dir, tmp_path / "b", indexed=False)
    assert not plain.route(ColumnBatches).applies(plain.chunks[0], plain.sources)
    (batch,) = list(plain.samples().add(plain.chunks[0], plain.sources))
    assert_names_its_samples(batch, [0, 1, 2, 3])


def test_a_bad_sample_falls_back_and_is_repeated_under_skip(shard_dir, tmp_path, open_streams):
    bad = with_bad_npy(shard_dir / "train-000000.tar", tmp_path / "bad.tar", {"s0000_00002"})
    s = open_streams([str(bad)], tmp_path, fields=FIELDS)
    with pytest.raises(Fallback):
        s.route(ColumnBatches).read(s.chunks[0], s.sources)
    (batch,) = list(s.samples().add(s.chunks[0], s.sources))
    assert batch.valid.tolist() == [True, True, False, True]
    assert batch.ids.tolist() == [0, 1, 2, 3]  # the slot keeps its id
    assert np.asarray(batch.fields["npy"]).tolist() == [[0, 0], [1, 2], [1, 2], [3, 6]]
    assert batch.keys == ["s0000_00000", "s0000_00001", "s0000_00001", "s0000_00003"]
    assert s.counters.counts["skipped"] == 1
    assert s.counters.skipped_by_shard == {bad.as_posix(): 1}


def test_a_bad_sample_under_fail_names_the_shard_and_key(shard_dir, tmp_path, open_streams):
    bad = with_bad_npy(shard_dir / "train-000000.tar", tmp_path / "bad.tar", {"s0000_00002"})
    s = open_streams([str(bad)], tmp_path, fields=FIELDS)
    with pytest.raises(PipelineDataError, match=r"bad\.tar.*s0000_00002"):
        list(s.samples(on_error="fail").add(s.chunks[0], s.sources))


def test_bad_samples_before_the_first_good_one_wait_for_it(shard_dir, tmp_path, open_streams):
    bad = with_bad_npy(shard_dir / "train-000000.tar", tmp_path / "bad.tar",
                       {"s0000_00000", "s0000_00001"})
    s = open_streams([str(bad)], tmp_path, fields=FIELDS)
    samples = s.samples()
    (batch,) = list(samples.add(s.chunks[0], s.sources))
    assert batch.valid.tolist() == [False, False, True, True]
    assert np.asarray(batch.fields["npy"]).tolist() == [[2, 4], [2, 4], [2, 4], [3, 6]]
    assert samples.idle


def test_a_stream_with_no_good_sample_ends_in_one_error(shard_dir, tmp_path, open_streams):
    bad = with_bad_npy(shard_dir / "train-000000.tar", tmp_path / "bad.tar",
                       {f"s0000_{p:05d}" for p in range(8)})
    s = open_streams([str(bad)], tmp_path, fields=FIELDS)
    samples = s.samples()
    for chunk in s.chunks:
        assert list(samples.add(chunk, s.sources)) == []  # held back: nothing to repeat
    assert not samples.idle
    with pytest.raises(PipelineDataError, match="no decodable sample in stream 0"):
        samples.finish()


def test_samples_with_other_fields_than_the_first_are_bad(shard_dir, tmp_path, open_streams):
    pics = tmp_path / "pics"
    write_shards(pics, [4], images=True, manifest=False)
    s = open_streams([str(shard_dir / "train-000000.tar"), str(pics / "train-000000.tar")],
                     tmp_path, fields={**FIELDS, "png": "image"})
    samples = s.samples()
    batches = [b for chunk in s.chunks[:3] for b in samples.add(chunk, s.sources)]
    assert [b.valid.all() for b in batches] == [True, True, False]
    assert s.counters.counts["skipped"] == 4  # the png shard's samples, repeats in their place


def test_decoded_batches_gather_what_the_columns_decode(shard_dir, tmp_path, open_streams):
    plain = open_streams(shard_dir, tmp_path / "plain")
    want = [plain.route(ColumnBatches).read(c, plain.sources) for c in plain.chunks]
    filling = open_streams(shard_dir, tmp_path, decoded_cache=True)  # opening fills entries
    assert filling.counters.counts["decoded_writes"] == len(SIZES)
    cached = open_streams(shard_dir, tmp_path, decoded_cache=True)
    decoded = cached.route(DecodedBatches)
    assert cached.counters.counts["decoded_hits"] == len(SIZES)
    for chunk, expected in zip(cached.chunks, want, strict=True):
        assert decoded.applies(chunk, cached.sources)
        got = decoded.read(chunk, cached.sources)
        assert got.keys == expected.keys
        for name in ("npy", "cls"):
            assert np.array_equal(got.fields[name], expected.fields[name])
    assert cached.counters.counts["cached_samples"] == sum(SIZES)
    assert not cached.route(ColumnBatches).applies(cached.chunks[0], cached.sources)

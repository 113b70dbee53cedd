"""The shard cache against real servers on 127.0.0.1: Python's http.server (in a thread) and a
moto S3 server, through fsspec (http via aiohttp, s3 via s3fs). No mocks of either."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest
from pipeline_util import collect, http_server, write_shards
from s3_proxy import start_moto

from ringfeed.pipeline import PipelineDataError, ShardPipeline
from ringfeed.pipeline.cache import ShardCache
from ringfeed.pipeline.source import ShardRef
from ringfeed.remote import StorageUnavailable

# servers on 127.0.0.1 / loader worker processes (tests/conftest.py: tiers)
pytestmark = pytest.mark.integration

SIZES = [6, 9, 4, 7, 5]


@pytest.fixture(scope="module")
def shard_dir(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("served")
    write_shards(d, SIZES, images=True)
    return d


def make(source, cache_dir, **kw) -> ShardPipeline:
    kw.setdefault("batch_size", 4)
    return ShardPipeline(source, cache_dir=str(cache_dir), seed=2, shuffle_buffer=5, **kw)


def tar_requests(requests: list[str]) -> list[str]:
    return [r for r in requests if r.endswith(".tar")]


def test_http_downloads_once_and_reuses_across_epochs_and_runs(shard_dir, tmp_path):
    local = collect(make(shard_dir, tmp_path / "unused"))
    with http_server(shard_dir) as (url, requests):
        pipe = make(url, tmp_path / "cache")
        assert collect(pipe) == local  # same batches as reading the files in place
        cold = pipe.stats()
        assert cold["cache_misses"] == len(SIZES) and cold["cache_hits"] == 0
        assert cold["bytes_downloaded"] == sum(p.stat().st_size for p in shard_dir.glob("*.tar"))
        collect(pipe)  # epoch 1
        again = make(url, tmp_path / "cache")  # a new run
        collect(again)
        assert sorted(tar_requests(requests)) == sorted(p.name for p in shard_dir.glob("*.tar"))
        assert again.stats()["cache_hit_rate"] == 1.0
    assert not list((tmp_path / "cache").glob(".*.tmp")), "a temp download was left behind"


def test_http_with_torch_workers_sharing_the_cache(shard_dir, tmp_path):
    from ringfeed.pipeline.torch import make_loader

    local = collect(make(shard_dir, tmp_path / "unused", num_workers=2))
    with http_server(shard_dir) as (url, requests):
        pipe = make(url, tmp_path / "cache", num_workers=2)
        assert collect(make_loader(pipe)) == local
        # two workers share partial shards at their boundary: one download each all the same
        assert len(tar_requests(requests)) == len(SIZES)


def test_eviction_keeps_cache_under_limit_lru(shard_dir, tmp_path):
    sizes = sorted(p.stat().st_size for p in shard_dir.glob("*.tar"))
    limit = sizes[-1] + sizes[-2] + 10  # room for two shards
    with http_server(shard_dir) as (url, requests):
        pipe = make(url, tmp_path / "cache", cache_limit=limit, shuffle=False, prefetch=0)
        collect(pipe)
        cache = ShardCache(str(tmp_path / "cache"))
        entries = cache.entries()
        assert sum(p.stat().st_size for p in entries) <= limit
        assert len(entries) <= 2
        # the survivors are the most recently used: the last shards read
        assert any(p.name.endswith("-train-000004.tar") for p in entries)
        collect(pipe)  # evicted shards are fetched again
        assert len(tar_requests(requests)) > len(SIZES)


def test_a_shard_in_use_is_never_evicted(shard_dir, tmp_path):
    with http_server(shard_dir) as (url, _):
        refs = [ShardRef(f"{url}/train-{i:06d}.tar", n) for i, n in enumerate(SIZES)]
        cache = ShardCache(str(tmp_path / "cache"), cache_limit=1)  # evict everything possible
        held = cache.open(refs[0])
        for ref in refs[1:]:
            cache.open(ref).close()
        assert cache.entry_path(refs[0]).exists(), "evicted while a reader held it"
        # each eviction ran while the shard just fetched was open: the last one survived too
        assert sorted(cache.entries()) == sorted([cache.entry_path(refs[0]),
                                                  cache.entry_path(refs[-1])])
        data = held.file.read()
        held.close()
        assert len(data) == (shard_dir / "train-000000.tar").stat().st_size
        cache.evict()
        assert cache.entries() == []


def test_corrupted_download_fails_checksum_after_retries(shard_dir, tmp_path):
    with http_server(shard_dir, corrupt=["train-000002.tar"]) as (url, requests):
        pipe = make(url, tmp_path / "cache", shuffle=False, retries=3)
        with pytest.raises(PipelineDataError,
                           match=r"train-000002\.tar: checksum mismatch after 3 attempts"):
            collect(pipe)
        assert tar_requests(requests).count("train-000002.tar") == 3
    names = os.listdir(tmp_path / "cache")
    assert not any("000002" in n and not n.endswith(".lock") for n in names), names


def test_missing_and_unreachable_urls_are_clear_errors(shard_dir, tmp_path):
    with http_server(shard_dir) as (url, _):
        with pytest.raises(PipelineDataError, match=r"train-000009\.tar: cannot read shard after "
                                                    r"1 attempt \(no such file or object"):
            make([f"{url}/train-000009.tar"], tmp_path / "cache", retries=2)
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"
    # nobody answers: a storage outage, retried for the budget, then the restartable error
    with pytest.raises(StorageUnavailable, match=r"train-000000\.tar: download failed for "
                                                 r"1\.\ds, the retry budget \(1\.0s\)"):
        make(f"{dead}/train-000000.tar", tmp_path / "cache", retries=2, retry_budget_s=1)


@pytest.fixture
def s3_server(monkeypatch):
    pytest.importorskip("moto.server")
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.setenv(name, "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    server, endpoint = start_moto(set_env=False)
    yield endpoint
    server.stop()


def test_s3_through_moto_server(shard_dir, tmp_path, s3_server):
    import s3fs

    options = {"endpoint_url": s3_server, "key": "testing", "secret": "testing"}
    fs = s3fs.S3FileSystem(**options)
    fs.makedirs("bucket", exist_ok=True)  # (moto keeps one store per process)
    for path in shard_dir.iterdir():
        fs.put_file(str(path), f"bucket/shards/{path.name}")
    local = collect(make(shard_dir, tmp_path / "unused", rank=1, world_size=2))
    pipe = make("s3://bucket/shards", tmp_path / "cache", rank=1, world_size=2,
                storage_options=options)
    assert pipe.manifest is not None
    assert collect(pipe) == local
    assert pipe.stats()["cache_misses"] > 0
    again = make("s3://bucket/shards", tmp_path / "cache", rank=1, world_size=2,
                 storage_options=options)
    assert collect(again) == local
    assert again.stats()["cache_hit_rate"] == 1.0
    # a corrupted object fails its checksum, as over http
    fs.pipe_file("bucket/shards/train-000001.tar", b"\0" * 10240)
    other = make("s3://bucket/shards", tmp_path / "cache2", shuffle=False, retries=2,
                 storage_options=options)
    with pytest.raises(PipelineDataError, match="train-000001.tar: (checksum|cannot read)"):
        collect(other)

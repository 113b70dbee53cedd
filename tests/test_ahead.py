"""The decode-ahead stage (pipeline/ahead.py): samples decoded while a shard downloads are the
same values as those decoded when their batch is assembled, and the stage does work only while
a stream waits. Shards served by Python's http.server in a thread, throttled, so every stream
waits for its shards."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from pipeline_util import http_server, write_shards

from ringfeed.pipeline import ShardPipeline

pytestmark = pytest.mark.integration  # a server on 127.0.0.1

SIZES = [9, 7, 8, 6, 9, 8]
AUGMENT = ["random_resized_crop", "horizontal_flip"]


@pytest.fixture(scope="module")
def shard_dir(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("served")
    write_shards(d, SIZES, images=True)
    return d


def make(source, cache_dir: Path, **kw) -> ShardPipeline:
    return ShardPipeline(source, cache_dir=str(cache_dir), batch_size=4, seed=3,
                         shuffle_buffer=12, augment=AUGMENT, image_size=(6, 6), **kw)


def batches(pipe: ShardPipeline, epoch: int) -> list[dict[str, np.ndarray]]:
    pipe.set_epoch(epoch)
    return [{k: np.asarray(v) for k, v in b.items() if k != "__key__"} for b in pipe]


def assert_same(got: list[dict], want: list[dict]) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        assert g.keys() == w.keys()
        for name in w:
            np.testing.assert_array_equal(g[name], w[name], err_msg=name)


def test_decoded_while_downloading_equals_decoded_in_place(shard_dir, tmp_path):
    local = make(shard_dir, tmp_path / "unused")
    want = [batches(local, e) for e in (0, 1)]
    assert local.stats()["decoded_ahead"] == 0  # local shards never keep a stream waiting
    size = sum(p.stat().st_size for p in shard_dir.glob("*.tar")) / len(SIZES)
    with http_server(shard_dir, rate=size / 0.15) as (url, _):  # ~0.15 s a shard
        remote = make(url, tmp_path / "cache")
        assert_same(batches(remote, 0), want[0])
        ahead = remote.stats()["decoded_ahead"]
        assert 0 < ahead <= sum(SIZES)
        assert_same(batches(remote, 1), want[1])  # cached now: nothing to wait for


def test_loader_workers_decode_ahead_too(shard_dir, tmp_path):
    from ringfeed.pipeline.torch import make_loader

    want = batches(make(shard_dir, tmp_path / "unused", num_workers=2), 0)
    size = sum(p.stat().st_size for p in shard_dir.glob("*.tar")) / len(SIZES)
    with http_server(shard_dir, rate=size / 0.15) as (url, _):
        pipe = make(url, tmp_path / "cache", num_workers=2)
        got = [{k: np.asarray(v) for k, v in b.items() if k != "__key__"}
               for b in make_loader(pipe)]
        assert_same(got, want)
        assert pipe.stats()["decoded_ahead"] > 0

"""pipeline/core.py's construction (issue 37): the sources resolve into one frozen value
(`resolve_sources`), the constructor reads no sample data for a single source, and the
decoded-cache decision is one step (`prepare`) the first pass takes. Real shards served over
HTTP by tests/pipeline_util.py, so every download is seen."""

from __future__ import annotations

import dataclasses

import pytest
from pipeline_util import http_server, write_shards

from ringfeed.pipeline import ShardPipeline
from ringfeed.pipeline.cache import ShardCache
from ringfeed.pipeline.config import PipelineConfig
from ringfeed.pipeline.core import ResolvedSources, resolve_sources

SIZES = [6, 5, 7]


@pytest.fixture(scope="module")
def shard_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("core")
    write_shards(root, SIZES, images=True)
    return root


def shards_fetched(requests):
    return [name for name in requests if name.endswith(".tar")]


def test_resolve_sources_is_one_frozen_value(shard_dir, tmp_path):
    config = PipelineConfig(cache_dir=str(tmp_path))
    one = resolve_sources(str(shard_dir), config, ShardCache(str(tmp_path)), None)
    assert isinstance(one, ResolvedSources)
    assert one.names == (str(shard_dir),) and one.mixture is None
    assert one.manifest is not None and one.layout.num_samples == sum(SIZES)
    assert [len(part) for part in one.parts] == [3]
    assert one.field_kinds() == {"cls": "int", "npy": "npy", "png": "image"}
    with pytest.raises(dataclasses.FrozenInstanceError):
        one.mixture = None  # type: ignore[misc]
    mixed = resolve_sources([{"path": str(shard_dir), "weight": 2, "name": "a"},
                             {"path": str(shard_dir), "weight": 1}], config,
                            ShardCache(str(tmp_path)), None)
    assert mixed.names[0] == "a" and len(mixed.names) == 2
    assert [len(part) for part in mixed.parts] == [3, 3] and len(mixed.refs) == 6
    assert mixed.mixture.weights == (2.0, 1.0)
    assert mixed.layout.num_samples == 2 * sum(SIZES)


def test_the_constructor_downloads_nothing_and_the_first_pass_decides_the_decoded_cache(
        shard_dir, tmp_path):
    with http_server(shard_dir) as (url, requests):
        pipe = ShardPipeline(url, batch_size=3, shuffle=False, cache_dir=str(tmp_path),
                             decoded_cache="auto", rank=0, world_size=1)
        assert shards_fetched(requests) == []  # the manifest only
        assert pipe.batches_per_epoch == 6 and pipe.source_names == [url]
        context = pipe.prepare()  # "auto" decodes the first sample: its shard is fetched
        assert shards_fetched(requests) == ["train-000000.tar"]
        assert pipe.prepare() is context and pipe.context is context  # once
        assert pipe.decoded_cache  # 18 small samples fit
        batches = list(pipe)
    assert len(batches) == 6 and batches[0]["__key__"][0] == "s0000_00000"


def test_without_prepare_the_first_pass_prepares(shard_dir, tmp_path):
    pipe = ShardPipeline(str(shard_dir), batch_size=3, shuffle=False, cache_dir=str(tmp_path),
                         decoded_cache=True, rank=0, world_size=1)
    assert not (tmp_path / "decoded").exists()
    assert len(list(pipe)) == 6
    assert pipe.decoded_cache and list((tmp_path / "decoded").glob("*.rfd"))

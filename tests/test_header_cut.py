"""A shard cut inside a member's 512-byte tar header is a truncated shard on every read path,
in `ringfeed verify` and in `ringfeed shard --format wds-index` (tarfile, and so webdataset's
tar iterator, take a short header for the end of the archive: the samples after it would be
lost without a word)."""

from __future__ import annotations

import io
import tarfile
from pathlib import Path

import pytest
from pipeline_util import http_server

from ringfeed.pipeline import PipelineDataError, ShardPipeline
from ringfeed.train.cli import main as ringfeed_main

CUT = "ends inside a tar header"


def tar_of(samples: int) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        for i in range(samples):
            for ext, data in (("txt", b"x" * 600), ("cls", str(i).encode())):
                info = tarfile.TarInfo(f"s{i}.{ext}")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def header_offsets(data: bytes) -> list[int]:
    return [m.offset for m in tarfile.open(fileobj=io.BytesIO(data))]


@pytest.fixture
def cut_shards(tmp_path: Path) -> tuple[Path, list[bytes]]:
    """A wds-indexed folder of one 5-sample shard, then the shard cut 100 bytes into the header
    of s4's first member, and the same cut inside the header of s4's last member."""
    data = tar_of(5)
    (tmp_path / "train-0.tar").write_bytes(data)
    assert ringfeed_main(["shard", str(tmp_path), "--format", "wds-index"]) == 0
    offsets = header_offsets(data)
    return tmp_path, [data[:offsets[8] + 100], data[:offsets[9] + 100]]


@pytest.mark.parametrize("indexed", [True, False])
@pytest.mark.parametrize("which", [0, 1])
def test_pipeline_reports_the_cut(cut_shards, tmp_path, indexed, which):
    folder, cuts = cut_shards
    (folder / "train-0.tar").write_bytes(cuts[which])
    shard = str(folder / "train-0.tar")
    for source in (str(folder), shard):  # with the manifest, and the bare tar (counted)
        with pytest.raises(PipelineDataError, match="train-0.tar") as err:
            list(ShardPipeline(source, batch_size=1, shuffle=False, indexed=indexed,
                               cache_dir=str(tmp_path / "c"), on_error="fail"))
        assert CUT in str(err.value) or "manifest lists 5" in str(err.value), err.value
        if source == shard:  # no manifest count to fall short of: only the cut says it
            assert CUT in str(err.value)
    skip = ShardPipeline(str(folder), batch_size=1, shuffle=False, indexed=indexed,
                         cache_dir=str(tmp_path / "c"), on_error="skip")
    keys = [b["__key__"][0] for b in skip if b["__valid__"][0]]  # (a bad one repeats a good)
    assert keys in (["s0", "s1", "s2", "s3"], ["s0", "s1", "s2"])
    assert skip.stats()["skipped"] == 5 - len(keys)


@pytest.mark.integration
def test_cached_remote_shard_reports_the_cut(cut_shards, tmp_path):
    folder, cuts = cut_shards
    (folder / "train-0.tar").write_bytes(cuts[0])
    with http_server(folder) as (url, _):
        for indexed in (True, False):
            with pytest.raises(PipelineDataError, match=f"train-0.tar: cannot count samples.*{CUT}"):
                list(ShardPipeline(f"{url}/train-0.tar", batch_size=1, shuffle=False,
                                   indexed=indexed, cache_dir=str(tmp_path / f"c{indexed}")))


def test_verify_and_wds_index_report_the_cut(cut_shards, tmp_path, capsys):
    folder, cuts = cut_shards
    # (the sample before the last one: the lost header may be one of the last one's members)
    for cut, after in zip(cuts, ["s2", "s3"], strict=True):
        (folder / "train-0.tar").write_bytes(cut)
        assert ringfeed_main(["verify", str(folder)]) == 2
        out = capsys.readouterr()
        assert f"train-0.tar: not a readable tar after sample {after!r} (the file {CUT}" in out.out
        bare = tmp_path / "bare"
        bare.mkdir(exist_ok=True)
        (bare / "train-0.tar").write_bytes(cut)
        assert ringfeed_main(["shard", str(bare), "--format", "wds-index", "--overwrite"]) == 2
        err = capsys.readouterr().err
        assert "train-0.tar: " in err and CUT in err and "Traceback" not in err

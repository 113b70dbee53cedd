"""Compressed WebDataset shards (.tar.gz, .tgz, .tar.bz2, .tar.xz), issue 23: `ringfeed shard
--format wds-index`, `verify`, `inspect`, the pipeline and `ringfeed train` read them, alone and
mixed with plain tars. The pipeline decompresses each once into its shard cache (a plain copy,
checked before it is trusted, counted in cache_limit) and reads that indexed, with the same
samples as streaming the compressed file. Malformed archives (corrupt gzip data, a cut gzip
stream, a truncated tar inside intact gzip, a .tgz that is no gzip, an empty file) are one line
naming the file and what to do from every command, and are skipped or fatal in the pipeline as a
damaged plain tar is.
"""

from __future__ import annotations

import bz2
import gzip
import io
import json
import logging
import lzma
import os
from pathlib import Path

import numpy as np
import pytest
from helpers import ringfeed
from pipeline_util import collect, http_server, valid_ids
from shards_util import cli, manifest

from ringfeed.formats.tarread import CompressedDataError, decompress_tar
from ringfeed.pipeline import PipelineDataError, ShardPipeline
from ringfeed.pipeline.cache import PLAIN_SUFFIX, ShardCache

COMPRESSORS = {".tar.gz": lambda b: gzip.compress(b, mtime=0),
               ".tgz": lambda b: gzip.compress(b, mtime=0),
               ".tar.bz2": bz2.compress, ".tar.xz": lzma.compress, ".tar": lambda b: b}


def tar_bytes(first: int, count: int, shard: int) -> bytes:
    """A webdataset tar of samples first..first+count-1 (pipeline_util's layout: key
    s{shard}_{pos}, cls = g % 10, npy = [g, 2g], so a decoded value names its sample; x.npy is
    a feature vector for training)."""
    import webdataset as wds

    buf = io.BytesIO()
    with wds.TarWriter(buf, mtime=0) as sink:  # (same bytes every run)
        for pos in range(count):
            g = first + pos
            sink.write({"__key__": f"s{shard:04d}_{pos:05d}", "cls": str(g % 10).encode(),
                        "npy": np.array([g, 2 * g], dtype=np.int64),
                        "x.npy": np.array([g % 10, 1.0], dtype=np.float32)})
    return buf.getvalue()


def write_shards(directory: Path, shards: list[tuple[str, int]]) -> list[Path]:
    """`shards`: (file name, samples), written in this order (global ids follow it; give names
    that sort the same way, as the manifest lists them)."""
    directory.mkdir(parents=True, exist_ok=True)
    paths, g = [], 0
    for s, (name, count) in enumerate(shards):
        suffix = next(x for x in COMPRESSORS if name.endswith(x))
        path = directory / name
        path.write_bytes(COMPRESSORS[suffix](tar_bytes(g, count, s)))
        paths.append(path)
        g += count
    return paths


MIXED = [("train-0000.tar.gz", 13), ("train-0001.tgz", 11), ("train-0002.tar", 9),
         ("train-0003.tar.bz2", 7), ("train-0004.tar.xz", 8)]
TOTAL = sum(n for _, n in MIXED)


@pytest.fixture
def mixed(tmp_path, capsys) -> Path:
    """Plain and compressed shards in one folder, with their wds-index manifest."""
    shards = tmp_path / "mixed"
    write_shards(shards, MIXED)
    code, _, err = cli(capsys, "shard", shards, "--format", "wds-index", "--no-progress")
    assert code == 0, err
    return shards


def pipe(source, cache: Path, **options) -> ShardPipeline:
    return ShardPipeline(source, batch_size=4, balance="pad", cache_dir=cache, seed=5,
                         shuffle_buffer=16, **options)


def batches(p: ShardPipeline) -> list[dict]:
    """Every batch, as plain lists (keys, ids, validity, npy values)."""
    return [{"key": list(b["__key__"]), "index": b["__index__"].tolist(),
             "valid": b["__valid__"].tolist(), "npy": np.asarray(b["npy"]).tolist()} for b in p]


def plain_copies(cache: Path) -> list[Path]:
    return sorted(cache.glob(f"*{PLAIN_SUFFIX}"))


# -- the fast path ------------------------------------------------------------------------------
def test_compressed_shards_are_decompressed_once_and_read_indexed(mixed, tmp_path):
    """Each compressed shard gets one plain copy in the cache; its samples are those streaming
    the compressed file gives, batch for batch; the decoded cache is filled from the indexed
    copy (only indexed shards are) and serves the next epoch."""
    cache = tmp_path / "cache"
    streamed = batches(pipe(mixed, tmp_path / "stream-cache", indexed=False))
    assert not plain_copies(tmp_path / "stream-cache")  # indexed=False: streamed, no copy
    fast = pipe(mixed, cache, decoded_cache=True)
    assert batches(fast) == streamed
    assert sorted(valid_ids(collect_of(streamed))) == list(range(TOTAL))
    copies = plain_copies(cache)
    assert sorted(p.name.split("-", 1)[1] for p in copies) == [
        "train-0000.plain.tar", "train-0001.plain.tar", "train-0003.plain.tar",
        "train-0004.plain.tar"]
    assert len(list((cache / "index").glob("*.idx"))) == 4  # indexes built for the copies
    stats = fast.stats()
    assert stats["decoded_cache_writes"] == 5 and stats["skipped"] == 0
    inodes = {p.name: p.stat().st_ino for p in copies}
    fast.set_epoch(1)
    again = batches(fast)
    assert sorted(valid_ids(collect_of(again))) == list(range(TOTAL))
    assert fast.stats()["decoded_cache_hits"] == 5  # every shard, from its decoded entry

    # a new pipeline (a new process: nothing remembered) reads the copies as they are
    later = pipe(mixed, cache)
    assert batches(later) == streamed
    assert {p.name: p.stat().st_ino for p in plain_copies(cache)} == inodes


def collect_of(records: list[dict]) -> list[dict]:
    for r in records:  # every valid sample's npy names its id
        for g, v, npy in zip(r["index"], r["valid"], r["npy"], strict=True):
            assert not v or npy == [g, 2 * g]
    return [{"index": r["index"], "valid": r["valid"]} for r in records]


def test_threads_sharing_the_cache_make_each_copy_once(mixed, tmp_path):
    streamed = batches(pipe(mixed, tmp_path / "stream-cache", indexed=False, num_workers=3))
    cache = tmp_path / "cache"
    assert batches(pipe(mixed, cache, num_workers=3)) == streamed
    assert len(plain_copies(cache)) == 4 and not list(cache.glob(".*.tmp"))


@pytest.mark.integration
def test_loader_worker_processes_share_the_copies(mixed, tmp_path):
    from ringfeed.pipeline.torch import make_loader

    cache = tmp_path / "cache"
    loader = make_loader(pipe(mixed, cache, num_workers=2))
    try:
        ids = [int(g) for b in loader for g, v in zip(b["__index__"], b["__valid__"],
                                                       strict=True) if v]
    finally:  # its worker processes and threads must not outlive the test: later tests fork
        loader.close()
    assert sorted(ids) == list(range(TOTAL))
    assert len(plain_copies(cache)) == 4 and not list(cache.glob(".*.tmp"))


def test_a_cache_that_cannot_take_copies_streams_them_with_one_warning(mixed, tmp_path,
                                                                        caplog):
    from ringfeed.pipeline.shardread import IndexStore, SequentialSamples, open_samples

    refs = [r for r in pipe(mixed, tmp_path / "cache").refs if not r.url.endswith(".tar")]
    blocked = tmp_path / "a-file"
    blocked.write_text("the cache folder cannot be made under a file")
    cache = ShardCache(str(blocked / "cache"))
    caplog.set_level(logging.WARNING, logger="ringfeed.pipeline")
    for ref in refs:
        handle = cache.open(ref, plain=True)
        assert handle.plain_of is None and handle.damage is None
        samples = open_samples(handle, IndexStore(tmp_path / "index"))
        assert isinstance(samples, SequentialSamples)
        keys = [samples.get(i)["__key__"] for i in range(ref.num_samples)]
        assert keys == sorted(keys) and len(keys) == ref.num_samples
        samples.close()
    warned = [r.getMessage() for r in caplog.records if "cannot keep a decompressed" in
              r.getMessage()]
    assert len(warned) == 1 and str(blocked / "cache") in warned[0]


def test_a_list_of_compressed_shards_without_manifest_is_counted_through_its_copies(
        tmp_path):
    paths = write_shards(tmp_path / "gz", [("a-0.tar.gz", 6), ("a-1.tgz", 5)])
    cache = tmp_path / "cache"
    p = pipe([str(x) for x in paths], cache, shuffle=False)
    assert p.layout.num_samples == 11
    assert len(plain_copies(cache)) == 2  # made while counting, then read by the epoch
    assert sorted(valid_ids(collect(p))) == list(range(11))


@pytest.mark.parametrize("damage", ["flip", "truncate", "record", "source"])
def test_a_plain_copy_is_checked_before_it_is_trusted(mixed, tmp_path, damage, caplog):
    """A copy whose bytes changed (same size: crc32), whose size changed, whose record is gone,
    or whose compressed shard was rewritten is decompressed again, never read."""
    cache = tmp_path / "cache"
    expected = batches(pipe(mixed, cache))
    copy = next(p for p in plain_copies(cache) if p.name.endswith("-train-0000.plain.tar"))
    if damage == "flip":
        data = bytearray(copy.read_bytes())
        data[700] ^= 0xFF  # inside the first member's data: the tar headers stay valid
        copy.write_bytes(bytes(data))
    elif damage == "truncate":
        copy.write_bytes(copy.read_bytes()[:-1024])
    elif damage == "record":
        (cache / "plain" / f"{copy.name}.json").unlink()
    else:  # the same bytes written again: another mtime, so another shard for the cache
        source = mixed / "train-0000.tar.gz"
        os.utime(source, ns=(source.stat().st_atime_ns, source.stat().st_mtime_ns + 10**9))
    before = copy.stat().st_ino
    caplog.set_level(logging.WARNING, logger="ringfeed.pipeline")
    assert batches(pipe(mixed, cache)) == expected
    assert copy.stat().st_ino != before  # made again (a new file renamed into place)
    record = json.loads((cache / "plain" / f"{copy.name}.json").read_text())
    assert record["bytes"] == copy.stat().st_size
    warned = any("changed since it was written" in r.getMessage() for r in caplog.records)
    assert warned == (damage == "flip")


def test_plain_copies_count_in_cache_limit_and_are_evicted(mixed, tmp_path):
    """A copy is a cache entry like a download: with no room, each new one evicts the copies
    no reader holds (and their records); the one being read stays."""
    cache_dir = tmp_path / "cache"
    refs = list(pipe(mixed, cache_dir).refs)  # (reads nothing: the manifest has the counts)
    compressed = [r for r in refs if not r.url.endswith(".tar")]
    cache = ShardCache(str(cache_dir), cache_limit=1)
    held = cache.open(compressed[0], plain=True)
    assert held.plain_of and held.decompressed > 0
    for ref in compressed[1:]:
        handle = cache.open(ref, plain=True)
        assert handle.plain_of and handle.file.read(512)  # (readable: not evicted under us)
        handle.close()
    held.close()
    # left: the copy held throughout, and the last one (no later copy evicted it)
    left = sorted(p.name for p in plain_copies(cache_dir))
    assert left == sorted(cache.plain_path(r).name for r in (compressed[0], compressed[-1]))
    assert sorted(x.name for x in (cache_dir / "plain").iterdir()) == [
        f"{name}.json" for name in left]  # the evicted copies' records went with them
    assert all(x.name.endswith(PLAIN_SUFFIX) for x in cache.entries())

    p = pipe(mixed, cache_dir, cache_limit=1)  # the pipeline: copies made again as needed
    assert sorted(valid_ids(collect(p))) == list(range(TOTAL))


@pytest.mark.integration
def test_remote_compressed_shards_are_downloaded_checked_and_kept_as_plain_copies(
        mixed, tmp_path):
    cache = tmp_path / "cache"
    expected = batches(pipe(mixed, tmp_path / "local-cache"))
    with http_server(mixed) as (url, requests):
        p = pipe(url, cache)
        assert batches(p) == expected
        stats = p.stats()
        assert stats["cache_misses"] == 5 and stats["bytes_downloaded"] > 0
        # the compressed downloads were replaced by the copies; the plain tar is kept as is
        names = sorted(x.name.split("-", 1)[1] for x in ShardCache(str(cache)).entries())
        assert names == ["train-0000.plain.tar", "train-0001.plain.tar", "train-0002.tar",
                         "train-0003.plain.tar", "train-0004.plain.tar"]
        shard_requests = sorted(r for r in requests if "train-" in r)
        assert len(shard_requests) == 6  # 5 shards, the plain tar's index sidecar
        again = pipe(url, cache)
        assert batches(again) == expected
        assert sorted(r for r in requests if "train-" in r) == shard_requests  # nothing again
        assert again.stats()["cache_hits"] == 5


# -- malformed archives ------------------------------------------------------------------------
MALFORMED = {
    # (what the file becomes from its good gzip bytes, what each command says about it)
    "corrupt": "corrupt gzip data",
    "cut": "the gzip data is cut short (a truncated file)",
    "inner": "the compressed data is intact, the tar inside is not: corrupt or truncated tar",
    "not-gzip": "not gzip, bzip2 or xz data although its name says compressed",
    "empty": "empty file",
}


def malformed(good: bytes, how: str) -> bytes:
    raw = gzip.decompress(good)
    if how == "corrupt":  # 64 bytes garbled mid-stream
        mid = len(good) // 2
        return good[:mid] + bytes(b ^ 0x5A for b in good[mid:mid + 64]) + good[mid + 64:]
    if how == "cut":  # the gzip stream ends halfway
        return good[: len(good) // 2]
    if how == "inner":  # valid gzip of half a tar
        return gzip.compress(raw[: len(raw) // 2 + 100], mtime=0)
    if how == "not-gzip":
        return b"this is not gzip at all\n" * 40
    return b""


def compressible_shards(directory: Path) -> list[Path]:
    """Three .tgz shards; the middle one has samples large and repetitive enough that gzip
    codes them (so garbled bytes break the stream instead of just changing stored data)."""
    return write_shards(directory, [("train-0000.tgz", 12), ("train-0001.tgz", 40),
                                    ("train-0002.tgz", 12)])


@pytest.fixture
def damaged(tmp_path, capsys, request) -> tuple[Path, Path, str]:
    """(shard folder with its manifest, the shard damaged after indexing, how)."""
    shards = tmp_path / "shards"
    paths = compressible_shards(shards)
    assert cli(capsys, "shard", shards, "--format", "wds-index", "--no-progress")[0] == 0
    victim = paths[1]
    victim.write_bytes(malformed(victim.read_bytes(), request.param))
    return shards, victim, request.param


def one_line(text: str) -> str:
    lines = [line for line in text.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in text, text
    return lines[0]


@pytest.mark.parametrize("how", list(MALFORMED))
def test_decompression_names_what_is_wrong(how):
    """gzip's own checks: corrupt data fails even where tarfile's stream reads on (its r|gz
    checks no crc), a cut stream fails even where the tar inside ends at a member."""
    raw = tar_bytes(12, 40, 1)
    bad = malformed(gzip.compress(raw, mtime=0), how)
    if how == "inner":  # the gzip stream is whole; the tar inside is not
        assert decompress_tar(io.BytesIO(bad), io.BytesIO())[0] == len(raw) // 2 + 100
        return
    with pytest.raises(CompressedDataError) as err:
        decompress_tar(io.BytesIO(bad), io.BytesIO())
    assert str(err.value).startswith(MALFORMED[how])


@pytest.mark.integration
@pytest.mark.parametrize("how", list(MALFORMED))
def test_wds_index_of_a_malformed_archive_is_one_line(tmp_path, capsys, how):
    shards = tmp_path / "shards"
    paths = compressible_shards(shards)
    paths[1].write_bytes(malformed(paths[1].read_bytes(), how))
    code, out, err = cli(capsys, "shard", shards, "--format", "wds-index", "--no-progress")
    line = one_line(err)
    assert code == 2 and out == ""
    assert line.startswith(f"ringfeed: error: {paths[1]}: not a readable tar")
    assert MALFORMED[how] in line and "re-download or re-create it" in line
    assert not (shards / "manifest.json").exists()


@pytest.mark.integration
@pytest.mark.parametrize("damaged", list(MALFORMED), indirect=True)
def test_verify_and_inspect_of_a_malformed_archive(damaged, capsys):
    shards, victim, how = damaged
    code, out, err = cli(capsys, "verify", shards)
    bad = [line for line in out.splitlines() if line.startswith("BAD")]
    assert code == 2 and "Traceback" not in out + err
    assert len(bad) == 1 and bad[0].startswith(f"BAD train/{victim.name}: ")
    assert MALFORMED[how] in bad[0] and "re-download or re-create it" in bad[0], bad[0]
    assert "1 BAD" in out

    code, out, err = cli(capsys, "inspect", shards)
    line = one_line(err)
    assert code == 2 and line.startswith(f"ringfeed: error: {victim}: ")
    assert MALFORMED[how] in line and "re-download or re-create it" in line
    assert f"ringfeed verify {shards}" in line


@pytest.mark.parametrize("damaged", list(MALFORMED), indirect=True)
def test_pipeline_skips_a_malformed_archive_as_it_does_a_damaged_tar(damaged, tmp_path,
                                                                      caplog):
    """on_error=skip: the same batches as with the healthy shard, the lost samples counted
    against the shard and repeated good ones in their place (flagged invalid), one warning
    naming the file; samples before the damage are still read."""
    shards, victim, how = damaged
    healthy = len(pipe(shards, tmp_path / "c0"))  # batches the manifest's counts give
    caplog.set_level(logging.WARNING, logger="ringfeed.pipeline")
    p = pipe(shards, tmp_path / "c1", shuffle=False)
    records = collect(p)  # (checks every valid sample's value against its id)
    stats = p.stats()
    assert len(records) == healthy
    assert set(stats["skipped_by_shard"]) == {str(victim)}
    ids = valid_ids(records)
    lost = {g for g in range(64) if g not in ids}
    assert set(range(12)) | set(range(52, 64)) <= set(ids)  # the other shards: whole
    assert stats["skipped"] == len(lost)
    if how in ("cut", "inner"):  # the samples before the cut are exact: read
        assert lost and min(lost) > 12 and lost == set(range(min(lost), 52))
    else:  # corrupt data may have gone wrong anywhere: none of it is read
        assert lost == set(range(12, 52))
    warnings = [r.getMessage() for r in caplog.records if victim.name in r.getMessage()]
    assert len(warnings) == 1 and "skipping bad data" in warnings[0]  # once per stream
    if how != "inner":  # what decompressing it found, and what to do
        assert MALFORMED[how] in warnings[0] and "re-download or re-create" in warnings[0]
        assert len(plain_copies(tmp_path / "c1")) == 2  # none for the damaged shard


@pytest.mark.parametrize("damaged", list(MALFORMED), indirect=True)
def test_pipeline_fails_on_a_malformed_archive_with_one_line(damaged, tmp_path):
    shards, victim, how = damaged
    p = pipe(shards, tmp_path / "cache", shuffle=False, on_error="fail")
    with pytest.raises(PipelineDataError) as err:
        collect(p)
    text = str(err.value)
    assert text.startswith(f"{victim}: sample") and "\n" not in text
    if how != "inner":  # (inner: the sample the cut tar ends in may be the first one named)
        assert MALFORMED[how] in text and "re-download or re-create the file" in text


# -- mixed folders, training -------------------------------------------------------------------
@pytest.mark.integration
def test_a_folder_mixing_plain_and_compressed_shards_indexes_verifies_inspects(mixed, capsys):
    m = manifest(mixed)
    listed = m["splits"]["train"]["shards"]
    assert [(s["name"], s["num_samples"], s.get("index")) for s in listed] == [
        ("train-0000.tar.gz", 13, None), ("train-0001.tgz", 11, None),
        ("train-0002.tar", 9, "train-0002.tar.idx"), ("train-0003.tar.bz2", 7, None),
        ("train-0004.tar.xz", 8, None)]
    assert listed[0]["bytes"] == (mixed / "train-0000.tar.gz").stat().st_size  # compressed
    expected = np.bincount(np.arange(TOTAL) % 10).tolist()  # cls = g % 10, from every shard
    assert m["classes"]["ids"] == list(range(10)) and m["classes"]["counts"] == expected
    code, out, _ = cli(capsys, "verify", mixed)
    assert code == 0 and f"5 shards, {TOTAL} samples" in out and "all OK" in out
    (mixed / "stray.tgz").write_bytes((mixed / "train-0001.tgz").read_bytes())
    code, out, _ = cli(capsys, "verify", mixed)
    assert code == 0 and "(e.g. stray.tgz)" in out  # a compressed file it does not list
    code, out, _ = cli(capsys, "inspect", mixed)
    assert code == 0 and f"total: {TOTAL} samples in 5 shards" in out
    assert "classes in train (10)" in out and "s0000_00000" in out


def train_config(tmp_path: Path, shards: Path, name: str, **data) -> Path:
    cfg = tmp_path / f"{name}.yaml"
    cfg.write_text(json.dumps({  # (JSON is YAML)
        "model": {"name": "mlp"},
        "data": {"train": str(shards), "batch_size": 8, "input_key": "x.npy", **data},
        "train": {"max_steps": 4}, "output": {"dir": str(tmp_path / name)}}))
    return cfg


@pytest.mark.system  # `ringfeed train` in its own process: Horovod must not start in this one
def test_train_on_mixed_shards_and_a_malformed_one(mixed, tmp_path):
    res = ringfeed("train", str(train_config(tmp_path, mixed, "mixed")), timeout=180)
    assert res.returncode == 0, res.output[-3000:]
    done = json.loads((tmp_path / "mixed" / "summary.json").read_text())
    assert done["step"] == 4

    victim = mixed / "train-0001.tgz"
    victim.write_bytes(malformed(victim.read_bytes(), "cut"))
    res = ringfeed("train", str(train_config(tmp_path, mixed, "cut", on_error="fail",
                                             cache_dir=str(tmp_path / "cut-cache"))),
                   timeout=180)
    code, err = res.returncode, res.stderr
    line = [x for x in err.splitlines() if x.startswith("ringfeed: error:")]
    assert code == 2 and "Traceback" not in err, err
    assert len(line) == 1 and str(victim) in line[0] and MALFORMED["cut"] in line[0]

"""Flat token shards (issue 49): `ringfeed shard --format text` without --seq-len writes each
shard's tokens as one array with its documents' start offsets, and the pipeline reads windows
of `seq_len` + 1 tokens chosen at train time (packed, or at a random offset per (seed, epoch,
shard)), each with its doc_ids. Checked against the token stream built here by hand (byte-level:
each file's bytes, then EOS 256)."""

from __future__ import annotations

import io
import json
import shutil
import sysconfig
from pathlib import Path

import numpy as np
import pytest
from helpers import horovodrun, ringfeed
from train_util import write_config

from ringfeed.formats.manifest import Manifest
from ringfeed.formats.tokens import DOC_IDS, window_offset
from ringfeed.pipeline import ShardPipeline
from ringfeed.pipeline.errors import PipelineDataError, PipelineError

EOS = 256
STDLIB = Path(sysconfig.get_paths()["stdlib"])  # a real corpus: Python's own sources


def corpus(root: Path, packages: tuple[str, ...] = ("json", "email")) -> Path:
    """A folder of some of the standard library's .py files."""
    src = root / "src"
    for name in packages:
        shutil.copytree(STDLIB / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
    return src


def stream_of(src: Path) -> np.ndarray:
    """The byte-level token stream `ringfeed shard` makes of `src`'s .py files, by hand."""
    files = sorted(p for p in src.rglob("*.py"))
    parts = [np.append(np.frombuffer(f.read_bytes(), np.uint8).astype(np.int64), EOS)
             for f in files]
    return np.concatenate(parts)


def shard(src: Path, out: Path, *extra: str) -> dict:
    res = ringfeed("shard", str(src), str(out), "--format", "text", "--glob", "*.py",
                   "--no-progress", *extra, timeout=300)
    assert res.returncode == 0, res.output[-3000:]
    return json.loads((out / "manifest.json").read_text())


@pytest.fixture(scope="module")
def flat(tmp_path_factory) -> tuple[Path, Path, dict]:
    root = tmp_path_factory.mktemp("flat")
    src = corpus(root)
    return src, root / "out", shard(src, root / "out", "--max-size", "200KB")


def all_windows(out: Path, seq_len: int, **options) -> dict[str, dict[str, np.ndarray]]:
    """Every window of the train split in one epoch, by key ('shard/position')."""
    pipe = ShardPipeline(str(out), batch_size=1, seq_len=seq_len, rank=0, world_size=1,
                         **options)
    got = {}
    for batch in pipe:
        got[batch["__key__"][0]] = {k: batch[k][0] for k in ("tokens.npy", DOC_IDS)}
    pipe.close()
    return got


def doc_ids_by_hand(stream: np.ndarray, start: int, size: int) -> np.ndarray:
    """0 for the document the window starts in, +1 at each document start inside it."""
    starts = np.flatnonzero(stream[:-1] == EOS) + 1
    inside = starts[(starts > start) & (starts < start + size)] - start
    ids = np.zeros(size, np.int32)
    ids[inside] = 1
    return np.cumsum(ids)


@pytest.mark.system
def test_flat_shards_hold_the_stream_once_and_windows_slice_it(flat):
    src, out, manifest = flat
    stream = stream_of(src)
    text = manifest["text"]
    assert text["layout"] == "flat" and "seq_len" not in text
    per, shards = text["shard_tokens"]["train"], manifest["splits"]["train"]["shards"]
    assert len(shards) > 3 and text["dropped_tokens"] == len(stream) - per * len(shards) < 5
    tar_bytes = sum(s["bytes"] for s in shards)
    assert tar_bytes <= 1.05 * 2 * per * len(shards)  # uint16 tokens
    for seq_len in (31, 100):  # the same shards at two context lengths
        windows = all_windows(out, seq_len, shuffle=False)
        size = seq_len + 1
        assert len(windows) == len(shards) * (per // size)
        for key, w in windows.items():
            shard_index, position = map(int, key.split("/"))
            start = shard_index * per + position * size
            np.testing.assert_array_equal(w["tokens.npy"], stream[start:start + size])
            np.testing.assert_array_equal(w[DOC_IDS], doc_ids_by_hand(stream, start, size))
    assert sum(w[DOC_IDS][-1] for w in windows.values()) > 10  # documents do start inside
    import webdataset as wds  # a WebDataset reader opens the shards: one sample each

    first = next(iter(wds.WebDataset(str(out / shards[0]["name"]), shardshuffle=False)))
    np.testing.assert_array_equal(np.load(io.BytesIO(first["tokens.npy"])), stream[:per])


@pytest.mark.system
def test_random_windows_move_per_epoch_and_shard_and_keep_their_count(flat):
    src, out, manifest = flat
    stream, per = stream_of(src), manifest["text"]["shard_tokens"]["train"]
    seq_len, size = 40, 41
    pipe = ShardPipeline(str(out), batch_size=1, seq_len=seq_len, random_windows=True, seed=3,
                         rank=0, world_size=1)
    counts = []
    for epoch in (0, 1):
        pipe.set_epoch(epoch)
        seen = 0
        for batch in pipe:
            key = batch["__key__"][0]
            shard_index, position = map(int, key.split("/"))
            lo = window_offset(3, epoch, f"{shard_index:06d}", seq_len)
            start = shard_index * per + position * size + lo
            np.testing.assert_array_equal(batch["tokens.npy"][0], stream[start:start + size])
            np.testing.assert_array_equal(batch[DOC_IDS][0], doc_ids_by_hand(stream, start, size))
            seen += 1
        counts.append(seen)
    pipe.close()
    assert counts[0] == counts[1] == len(manifest["splits"]["train"]["shards"]) * (
        (per - seq_len) // size)
    offsets = {window_offset(3, e, f"{s:06d}", seq_len) for e in (0, 1) for s in range(4)}
    assert len(offsets) > 1  # (a test that could not tell random from packed would be moot)


@pytest.mark.system
def test_resume_continues_exactly_as_the_uninterrupted_run(flat):
    _, out, _ = flat
    options = dict(batch_size=4, seq_len=24, random_windows=True, seed=1, shuffle_buffer=64,
                   rank=0, world_size=1)
    whole = ShardPipeline(str(out), **options)
    expected = [b["tokens.npy"] for b in whole]
    whole.set_epoch(1)
    expected += [b["tokens.npy"] for b in whole]
    whole.close()
    first = ShardPipeline(str(out), **options)
    got = []
    for batch in first:
        got.append(batch["tokens.npy"])
        if len(got) == len(expected) // 5:
            break
    state = json.loads(json.dumps(first.state_dict()))
    first.close()
    resumed = ShardPipeline(str(out), **options)
    resumed.load_state_dict(state)
    got += [b["tokens.npy"] for b in resumed]
    resumed.set_epoch(1)
    got += [b["tokens.npy"] for b in resumed]
    resumed.close()
    assert len(got) == len(expected)
    for a, b in zip(got, expected, strict=True):
        np.testing.assert_array_equal(a, b)


@pytest.mark.system
def test_a_resume_on_more_ranks_yields_every_window_once(flat):
    """2 ranks stop mid-epoch, 3 finish it: every window of the epoch exactly once."""
    _, out, _ = flat
    options = dict(batch_size=8, seq_len=20, random_windows=True, seed=2, balance="pad")
    seen: list[str] = []

    def take(pipe: ShardPipeline, stop: int | None = None) -> None:
        for t, batch in enumerate(pipe):
            seen.extend(k for k, ok in zip(batch["__key__"], batch["__valid__"], strict=True)
                        if ok)
            if t + 1 == stop:
                break

    first = [ShardPipeline(str(out), rank=r, world_size=2, **options) for r in range(2)]
    for pipe in first:
        take(pipe, stop=5)
    state = json.loads(json.dumps(first[0].state_dict()))
    for pipe in first:
        pipe.close()
    for r in range(3):
        pipe = ShardPipeline(str(out), rank=r, world_size=3, **options)
        pipe.load_state_dict(state)
        take(pipe)
        pipe.close()
    assert len(seen) == len(set(seen)) == len(all_windows(out, 20, random_windows=True, seed=2))


@pytest.mark.system
def test_a_weighted_mixture_of_flat_sets_draws_windows_by_weight(flat, tmp_path):
    _, out, _ = flat
    other = tmp_path / "logging"
    shard(corpus(tmp_path, ("logging",)), other, "--max-size", "100KB")
    pipe = ShardPipeline([{"path": str(out), "weight": 0.7}, {"path": str(other), "weight": 0.3}],
                         epoch_samples=400, batch_size=8, seq_len=32, rank=0, world_size=1)
    ids = np.concatenate([batch["__index__"] for batch in pipe])
    pipe.close()
    sources, _ = pipe.source_of(ids)
    assert len(ids) == 400 and np.bincount(sources).tolist() == [280, 120]


@pytest.mark.system
def test_row_shards_still_read_and_refuse_seq_len(tmp_path):
    src = corpus(tmp_path, ("json",))
    manifest = shard(src, tmp_path / "rows", "--seq-len", "33")
    assert manifest["text"]["seq_len"] == 33 and manifest["fields"] == {"tokens.npy": "npy"}
    pipe = ShardPipeline(str(tmp_path / "rows"), batch_size=2, shuffle=False, rank=0,
                         world_size=1)
    batch = next(iter(pipe))
    pipe.close()
    np.testing.assert_array_equal(batch["tokens.npy"], stream_of(src)[:66].reshape(2, 33))
    assert DOC_IDS not in batch
    with pytest.raises(PipelineError, match=r"^seq_len 32: .*rows holds rows of 33 tokens"):
        ShardPipeline(str(tmp_path / "rows"), batch_size=2, seq_len=32, rank=0, world_size=1)


@pytest.mark.system
def test_flat_shards_need_a_seq_len_and_one_that_fits(flat):
    _, out, manifest = flat
    with pytest.raises(PipelineError, match="flat token shards: set seq_len"):
        ShardPipeline(str(out), batch_size=2, rank=0, world_size=1)
    per = manifest["text"]["shard_tokens"]["train"]
    with pytest.raises(PipelineError, match=f"no window of seq_len \\+ 1 = {per + 1} tokens"):
        ShardPipeline(str(out), batch_size=2, seq_len=per, rank=0, world_size=1)


@pytest.mark.system
def test_a_manifest_that_miscounts_a_shards_tokens_is_named(flat, tmp_path):
    _, out, _ = flat
    stale = tmp_path / "stale"
    shutil.copytree(out, stale)
    manifest = Manifest.load(stale)
    assert manifest.text is not None
    manifest.text["shard_tokens"]["train"] -= 1
    manifest.save(stale)
    pipe = ShardPipeline(str(stale), batch_size=2, seq_len=8, on_error="fail", rank=0,
                         world_size=1)
    with pytest.raises(PipelineDataError, match="tokens.npy holds .* tokens, the manifest says "
                                                ".*: the manifest is out of date"):
        next(iter(pipe))
    pipe.close()


@pytest.mark.system
def test_storage_is_within_5_percent_of_the_raw_tokens(tmp_path):
    """The default --max-size (one shard here), and 1 MB shards with a val split (a tar is
    whole 10 KB records: smaller shards pay more for the padding)."""
    src = corpus(tmp_path, ("json", "email", "logging", "unittest"))
    raw = 2 * len(stream_of(src))  # uint16
    for name, extra in (("one", ()), ("many", ("--max-size", "1MB", "--val-fraction", "0.1",
                                               "--shuffle-seed", "0"))):
        manifest = shard(src, tmp_path / name, *extra)
        stored = sum((tmp_path / name / s["name"]).stat().st_size
                     for split in manifest["splits"].values() for s in split["shards"])
        assert stored <= 1.05 * raw, (name, stored / raw)


@pytest.mark.system
def test_bytes_do_not_depend_on_workers_or_parts(tmp_path):
    src = corpus(tmp_path, ("json",))
    common = ("--max-size", "40KB", "--val-fraction", "0.2", "--shuffle-seed", "1")
    shard(src, tmp_path / "w1", *common, "--workers", "1")
    reference = sorted(p.name for p in (tmp_path / "w1").glob("*.tar"))
    assert len(reference) > 3
    shard(src, tmp_path / "w2", *common, "--workers", "2")
    for n in (1, 2, 3):
        for i in range(n):
            res = ringfeed("shard", str(src), str(tmp_path / f"p{n}"), "--format", "text",
                           "--glob", "*.py", "--no-progress", *common, "--part", f"{i}/{n}",
                           timeout=300)
            assert res.returncode == 0, res.output[-3000:]
    for other in ("w2", "p1", "p2", "p3"):
        assert sorted(p.name for p in (tmp_path / other).glob("*.tar")) == reference
        for name in reference:
            assert (tmp_path / other / name).read_bytes() == (tmp_path / "w1" / name).read_bytes()


@pytest.mark.system
def test_torch_and_tf_give_the_same_windows(flat):
    pytest.importorskip("tensorflow")
    from ringfeed.pipeline.tf import make_dataset
    from ringfeed.pipeline.torch import make_loader

    _, out, _ = flat
    options = dict(batch_size=8, seq_len=16, random_windows=True, num_workers=2, rank=0,
                   world_size=1)
    reference = [b["tokens.npy"] for b in ShardPipeline(str(out), **options)]
    torch_batches = list(make_loader(ShardPipeline(str(out), **options)))
    dataset = make_dataset(ShardPipeline(str(out), **options))
    tf_batches = [{k: v.numpy() for k, v in b.items()} for b in dataset]
    assert len(reference) == len(torch_batches) == len(tf_batches) > 5
    for ref, t, f in zip(reference, torch_batches, tf_batches, strict=True):
        np.testing.assert_array_equal(t["tokens.npy"].numpy(), ref)
        np.testing.assert_array_equal(f["tokens.npy"], ref)
        np.testing.assert_array_equal(t[DOC_IDS].numpy(), f[DOC_IDS])


@pytest.mark.system
def test_the_same_shards_train_the_gpt_at_two_context_lengths_on_two_ranks(flat, tmp_path):
    _, out, _ = flat
    for seq_len in (16, 48):
        cfg = write_config(tmp_path / f"lm{seq_len}.yaml", model={"name": "gpt", "args": {
            "n_layer": 1, "n_head": 2, "d_model": 32}},
            data={"train": str(out), "batch_size": 4, "seq_len": seq_len,
                  "random_windows": True, "val_split": None},
            train={"max_steps": 4, "log_every": 2},
            output={"dir": str(tmp_path / f"lm{seq_len}"), "loggers": []})
        res = horovodrun(2, ["ringfeed", "train", cfg], timeout=300)
        assert res.returncode == 0, res.output[-3000:]
        done = json.loads((tmp_path / f"lm{seq_len}" / "summary.json").read_text())
        assert done["status"] == "finished" and np.isfinite(done["final_loss"])
        assert done["throughput"]["tokens_per_s"] > 0

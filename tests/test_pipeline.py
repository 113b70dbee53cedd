"""ShardPipeline: rank balance, determinism, exact resume, resume across world sizes, decoding,
bad data, inputs. Ranks run in-process with explicit rank/world_size (the horovodrun test is in
test_pipeline_hvd.py); shards are real webdataset tars written by tests/pipeline_util.py."""

from __future__ import annotations

import io
import json
import logging
import tarfile
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import webdataset as wds
from pipeline_util import collect, valid_ids, write_shards

from ringfeed.pipeline import PipelineConfig, PipelineDataError, PipelineError, ShardPipeline

UNEVEN = [1, 23, 3, 17, 2, 9, 5]  # 60 samples; one shard far bigger than the others
B = 4


@pytest.fixture(scope="module")
def uneven(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("uneven")
    write_shards(d, UNEVEN)
    return d


def make(source, **kw) -> ShardPipeline:
    kw.setdefault("batch_size", B)
    kw.setdefault("shuffle_buffer", 7)
    kw.setdefault("seed", 5)
    return ShardPipeline(source, **kw)


def run_ranks(source, world: int, **kw) -> list[list[dict]]:
    return [collect(make(source, rank=r, world_size=world, **kw)) for r in range(world)]


# -- rank balance ----------------------------------------------------------------------------
@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("balance", ["drop", "pad"])
def test_every_rank_same_batch_count_and_samples_once(uneven, world, balance):
    n = sum(UNEVEN)
    per_rank = run_ranks(uneven, world, balance=balance, num_workers=2 if world == 2 else 0)
    expected = make(uneven, rank=0, world_size=world, balance=balance).batches_per_epoch
    assert [len(r) for r in per_rank] == [expected] * world
    assert all(len(b["index"]) == B for r in per_rank for b in r)
    ids = [g for r in per_rank for g in valid_ids(r)]
    assert len(ids) == len(set(ids)), "a sample was seen twice in one epoch"
    missing = set(range(n)) - set(ids)
    if balance == "drop":
        assert expected == (n // world) // B
        assert len(missing) == n - world * expected * B < world * B
    else:
        assert not missing
        invalid = sum(not v for r in per_rank for b in r for v in b["valid"])
        assert invalid == world * expected * B - n


def test_balance_is_by_samples_not_shards(uneven):
    # 7 shards over 3 ranks: by shard count one rank would get the 23-sample shard and others
    # far less; by sample count every rank reads 20 of the 60 samples.
    per_rank = run_ranks(uneven, 3, balance="pad", batch_size=5)
    assert [len(valid_ids(r)) for r in per_rank] == [20, 20, 20]


def test_drop_with_no_full_batch_is_a_clear_error(tmp_path):
    write_shards(tmp_path, [3, 2])
    with pytest.raises(PipelineError, match="balance='pad'"):
        make(tmp_path, world_size=2, rank=0, batch_size=4)
    assert make(tmp_path, world_size=2, rank=1, batch_size=4, balance="pad").batches_per_epoch == 1


# -- determinism -----------------------------------------------------------------------------
def test_same_seed_same_batches_other_epoch_other_order(uneven):
    first = collect(make(uneven, rank=1, world_size=2))
    assert first == collect(make(uneven, rank=1, world_size=2))
    other_epoch = make(uneven, rank=1, world_size=2)
    other_epoch.set_epoch(1)
    second = collect(other_epoch)
    assert [b["index"] for b in second] != [b["index"] for b in first]
    other_seed = collect(make(uneven, rank=1, world_size=2, seed=6))
    assert [b["index"] for b in other_seed] != [b["index"] for b in first]


def test_no_shuffle_is_manifest_order(uneven):
    batches = collect(make(uneven, shuffle=False))
    assert valid_ids(batches) == list(range((sum(UNEVEN) // B) * B))


def test_iterating_again_moves_to_next_epoch(uneven):
    pipe = make(uneven)
    first, second = collect(pipe), collect(pipe)
    assert pipe.epoch == 1
    fresh = make(uneven)
    fresh.set_epoch(1)
    assert second == collect(fresh) != first


# -- exact resume ----------------------------------------------------------------------------
def resumed(source, k: int, loader, **kw) -> tuple[list[dict], list[dict]]:
    """(uninterrupted epoch, first k batches + the rest after a JSON state round trip)."""
    full = collect(loader(make(source, **kw)))
    pipe = make(source, **kw)
    head = []
    for batch in loader(pipe):
        head += collect([batch])
        if len(head) == k:
            break
    state = json.loads(json.dumps(pipe.state_dict()))
    again = make(source, **kw)
    again.load_state_dict(state)
    assert again.batches_remaining == len(full) - k
    return full, head + collect(loader(again))


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("k", [1, 4])
def test_exact_resume_torch_loader(uneven, workers, k):
    from ringfeed.pipeline.torch import make_loader

    full, stitched = resumed(uneven, k, make_loader, rank=1, world_size=2, num_workers=workers)
    assert stitched == full


def test_exact_resume_in_process_threads(uneven):
    full, stitched = resumed(uneven, 3, iter, rank=0, world_size=1, num_workers=3)
    assert stitched == full


def test_resume_skips_consumed_shards_and_does_not_decode_consumed_samples(tmp_path):
    write_shards(tmp_path, [8, 8, 8, 8])
    decoded = Counter()

    def count_decode(sample):
        decoded["n"] += 1
        return sample

    pipe = make(tmp_path, shuffle=False, decode=count_decode)
    it = iter(pipe)
    for _ in range(5):  # 20 samples: shards 0 and 1 complete, shard 2 half
        next(it)
    state = pipe.state_dict()
    it.close()  # stops its read-ahead thread
    decoded.clear()
    again = make(tmp_path, shuffle=False, decode=count_decode)
    again.load_state_dict(state)
    rest = collect(again)
    assert valid_ids(rest) == list(range(20, 32))
    assert again.stats()["shards_opened"] == 2
    assert again.stats()["samples_read"] == 12
    assert decoded["n"] == 12


@pytest.mark.parametrize("workers", [0, 2])
def test_read_ahead_yields_the_same_epochs_and_yields_to_a_loaded_state(uneven, workers):
    """The next epoch read ahead (started when an epoch's last batch goes out) is the epoch a
    fresh pass would read; after load_state_dict the read-ahead pass is not the one asked for
    and is dropped."""
    def epochs(pipe, n):
        return [collect(pipe) for _ in range(n)]

    plain = epochs(make(uneven, num_workers=workers), 3)
    ahead = make(uneven, num_workers=workers, read_ahead=True)
    assert epochs(ahead, 3) == plain
    assert ahead._ahead is not None  # epoch 3 under way
    ahead.close()
    assert ahead._ahead is None

    # epoch 0 read fully (epoch 1 now read ahead), then back to 2 batches into epoch 0
    partial = make(uneven, num_workers=workers)
    it = iter(partial)
    next(it), next(it)
    state = partial.state_dict()
    it.close()
    again = make(uneven, num_workers=workers, read_ahead=True)
    collect(again)
    again.load_state_dict(state)
    assert collect(again) == plain[0][2:]
    assert epochs(again, 2) == plain[1:]
    again.close()


@pytest.mark.parametrize("prefetch", [0, 2])
def test_convert_runs_where_batches_are_read_and_the_read_ahead_keeps_it(uneven, prefetch):
    """iterate(convert=f): f applied to every batch in the thread that reads it (the reader
    thread, or the consumer's with prefetch=0, which reads nothing ahead); the next epoch,
    read ahead with an equal f (a bound method made again), is kept; another f starts the
    pass afresh."""
    import threading

    class Converter:
        def __init__(self):
            self.threads = set()

        def convert(self, batch):
            self.threads.add(threading.current_thread().name)
            return {**batch, "converted": True}

    reference = make(uneven, prefetch=prefetch)
    plain = [collect(reference) for _ in range(2)]
    pipe = make(uneven, prefetch=prefetch, read_ahead=True)
    converter = Converter()
    epochs = []
    for _ in range(2):
        epochs.append([b.batch for b in pipe.iterate(convert=converter.convert)])
        ahead = pipe._ahead
    assert all(b.pop("converted") for epoch in epochs for b in epoch)
    assert [collect(epoch) for epoch in epochs] == plain
    reader = [name for name in converter.threads if name.startswith("ringfeed-stream")]
    assert converter.threads == ({threading.current_thread().name} if prefetch == 0
                                 else set(reader)) and (prefetch == 0 or reader)
    if prefetch:  # epoch 2, read ahead with this converter: kept for an equal one
        assert ahead is not None and list(pipe.iterate(convert=converter.convert))
        assert pipe._ahead is not ahead  # (epoch 3's, started as epoch 2 ended)
        ahead = pipe._ahead
        other = next(pipe.iterate(convert=None))
        assert ahead[1]._streams[0]._stop.is_set()  # dropped: it converts differently
        assert "converted" not in other.batch
    else:  # everything is read in the consumer's thread: nothing read ahead to be dropped
        assert ahead is None
    pipe.close()


def test_state_of_another_dataset_is_refused(uneven, tmp_path):
    write_shards(tmp_path, [4, 4])
    with pytest.raises(PipelineError, match="num_samples"):
        make(tmp_path).load_state_dict(make(uneven).state_dict())


# -- resume on another world size ------------------------------------------------------------
def run_segment(source, world: int, state: dict | None, stop_after: int | None, **kw):
    """All ranks of one segment in lockstep; returns (valid ids seen, state, batches per rank)."""
    pipes = [make(source, rank=r, world_size=world, **kw) for r in range(world)]
    if state is not None:
        for p in pipes:
            p.load_state_dict(json.loads(json.dumps(state)))
    remaining = pipes[0].batches_remaining
    counts, seen = [], []
    for p in pipes:
        got = []
        for batch in p:
            got += collect([batch])
            if stop_after is not None and len(got) == stop_after:
                break
        counts.append(len(got))
        seen += valid_ids(got)
    states = [p.state_dict() for p in pipes]
    assert all(s == states[0] for s in states), "ranks disagree on the state"
    assert len(set(counts)) == 1, f"ranks yielded different batch counts: {counts}"
    if stop_after is None:
        assert counts[0] == remaining
    return seen, states[0]


@pytest.mark.parametrize("balance", ["drop", "pad"])
@pytest.mark.parametrize("sizes", [[2, 3], [3, 2], [3, 2, 3]], ids=["2to3", "3to2", "3to2to3"])
def test_resume_on_other_world_size_sees_every_sample_once(uneven, sizes, balance):
    seen, state = [], None
    for i, world in enumerate(sizes):
        last = i == len(sizes) - 1
        ids, state = run_segment(uneven, world, state, None if last else 2, balance=balance,
                                 num_workers=i % 2)
        seen += ids
    n, final_world = sum(UNEVEN), sizes[-1]
    assert len(seen) == len(set(seen)), "a consumed sample was repeated after the resize"
    missing = set(range(n)) - set(seen)
    if balance == "pad":
        assert not missing
    else:  # only the final segment's tail is dropped
        assert len(missing) < final_world * B
    assert len(state["segments"]) == len(sizes)


def test_resize_then_resize_back_before_consuming_keeps_one_segment(uneven):
    _, state = run_segment(uneven, 2, None, 2)
    three = make(uneven, rank=0, world_size=3)
    three.load_state_dict(state)
    back = make(uneven, rank=0, world_size=2)
    back.load_state_dict(three.state_dict())
    assert back.state_dict()["segments"] == state["segments"]


# -- decoding --------------------------------------------------------------------------------
def write_mixed(directory: Path, n: int = 6) -> None:
    with wds.TarWriter(str(directory / "mixed-000000.tar")) as sink:
        for i in range(n):
            rgb = np.zeros((6, 10, 3), dtype=np.uint8) + i * 10
            gray = io.BytesIO()
            from PIL import Image

            Image.fromarray(np.full((6, 10), 200, dtype=np.uint8)).save(gray, format="PNG")
            sink.write({"__key__": f"k{i}", "jpg": _jpeg(rgb), "gray.png": gray.getvalue(),
                        "cls": str(i).encode(), "json": json.dumps({"i": i}).encode(),
                        "txt": f"text {i}".encode(),
                        "tokens.npy": np.arange(i, i + 5, dtype=np.uint16),
                        "raw": b"\x00\x01"})


def _jpeg(array: np.ndarray) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(array).save(buf, format="JPEG", quality=100)
    return buf.getvalue()


def test_decoding_of_each_field_kind(tmp_path):
    write_mixed(tmp_path)
    pipe = ShardPipeline(str(tmp_path / "mixed-000000.tar"), batch_size=3, shuffle=False,
                         image_size=(4, 5), normalize=(0.5, 0.25))
    batch = next(iter(pipe))
    assert batch["jpg"].shape == (3, 4, 5, 3) and batch["jpg"].dtype == np.float32
    assert batch["gray.png"].shape == (3, 4, 5, 1)
    np.testing.assert_allclose(batch["gray.png"], (200 / 255 - 0.5) / 0.25, rtol=1e-5)
    assert batch["cls"].tolist() == [0, 1, 2] and batch["cls"].dtype == np.int64
    assert batch["json"] == [{"i": 0}, {"i": 1}, {"i": 2}]
    assert batch["txt"] == ["text 0", "text 1", "text 2"]
    assert batch["tokens.npy"].dtype == np.int64 and batch["tokens.npy"][2].tolist() == [2, 3, 4, 5, 6]
    assert batch["raw"] == [b"\x00\x01"] * 3
    assert batch["__key__"] == ["k0", "k1", "k2"]
    plain = next(iter(ShardPipeline(str(tmp_path / "mixed-000000.tar"), batch_size=3,
                                    shuffle=False)))
    assert plain["jpg"].shape == (3, 6, 10, 3) and plain["jpg"].dtype == np.uint8


def test_user_decode_and_transform(tmp_path):
    write_mixed(tmp_path)

    def decode(sample):
        sample["raw"] = len(sample["raw"])
        return sample

    def transform(sample):
        return {"label": sample["cls"] * 2, "size": sample["raw"]}

    batch = next(iter(ShardPipeline(str(tmp_path / "mixed-000000.tar"), batch_size=2,
                                    shuffle=False, decode=decode, transform=transform)))
    assert batch["label"].tolist() == [0, 2] and batch["size"].tolist() == [2, 2]


# -- bad data --------------------------------------------------------------------------------
def damage(path: Path, how: str) -> None:
    data = path.read_bytes()
    if how == "truncate":
        path.write_bytes(data[: len(data) // 2])
    elif how == "corrupt":  # garbage over the middle member headers
        mid = len(data) // 2
        path.write_bytes(data[:mid] + b"\xde\xad" * 1024 + data[mid + 2048:])
    elif how == "image":  # one undecodable png
        members = []
        with tarfile.open(path) as tar:
            for m in tar.getmembers():
                members.append((m, tar.extractfile(m).read()))
        with tarfile.open(path, "w") as tar:
            for m, payload in members:
                if m.name == "s0001_00002.png":
                    payload = b"not a png at all"
                    m.size = len(payload)
                tar.addfile(m, io.BytesIO(payload))


@pytest.mark.parametrize("how", ["truncate", "corrupt", "image"])
def test_skip_policy_keeps_batch_counts_counts_and_warns_once(tmp_path, how, caplog):
    paths = write_shards(tmp_path, [10, 12, 10], images=True)
    healthy = collect(make(tmp_path, rank=1, world_size=2))
    damage(paths[1], how)
    caplog.set_level(logging.WARNING, logger="ringfeed.pipeline")
    counts = []
    skipped = 0
    for rank in (0, 1):
        pipe = make(tmp_path, rank=rank, world_size=2)
        batches = collect(pipe)
        counts.append(len(batches))
        skipped += pipe.stats()["skipped"]
        for url in pipe.stats()["skipped_by_shard"]:
            assert url.endswith("train-000001.tar")
    assert counts == [len(healthy)] * 2
    assert skipped >= 1 if how == "image" else skipped > 2
    assert how != "image" or skipped == 1
    warnings = [r for r in caplog.records if "train-000001.tar" in r.getMessage()]
    assert 1 <= len(warnings) <= 2  # once per shard per rank that reads it


@pytest.mark.parametrize("how", ["truncate", "corrupt", "image"])
def test_fail_policy_names_shard_and_key(tmp_path, how):
    paths = write_shards(tmp_path, [10, 12, 10], images=True)
    damage(paths[1], how)
    pipe = make(tmp_path, on_error="fail", shuffle=False)
    with pytest.raises(PipelineDataError, match=r"train-000001\.tar: sample") as err:
        collect(pipe)
    if how == "image":
        assert "'s0001_00002'" in str(err.value)


def test_fail_policy_through_torch_workers_is_one_clear_error(tmp_path):
    from ringfeed.pipeline.torch import make_loader

    paths = write_shards(tmp_path, [10, 12, 10], images=True)
    damage(paths[1], "image")
    # unshuffled, the damaged sample (id 12) is in worker 0's 4th batch: the first one is good
    pipe = make(tmp_path, on_error="fail", num_workers=2, shuffle=False)
    loader = make_loader(pipe)
    batches = iter(loader)
    next(batches)
    workers = list(loader.loader._iterator._workers)
    with pytest.raises(PipelineDataError) as err:
        collect(batches)
    assert "s0001_00002" in str(err.value) and "Traceback" not in str(err.value)
    # the failed pass stopped its workers before raising (not later, when the garbage
    # collector finds the iterator: torch's shutdown then waited out its join timeouts)
    assert loader.loader._iterator is None
    assert not any(w.is_alive() for w in workers)


@pytest.mark.integration
def test_missing_shard_is_an_error_after_retries(tmp_path):
    """Promise: Errors a restart cannot fix (train/RECOVERY.md)."""
    paths = write_shards(tmp_path, [6, 6])
    paths[1].unlink()
    pipe = make(tmp_path, shuffle=False, retries=2)
    with pytest.raises(PipelineDataError, match=r"train-000001\.tar: cannot read shard after 2"):
        collect(pipe)


# -- inputs ----------------------------------------------------------------------------------
def test_shard_list_without_manifest_counts_samples(uneven):
    pattern = str(uneven / "train-{000000..000006}.tar")
    from_list = make(pattern, rank=1, world_size=2)
    assert from_list.manifest is None
    assert collect(from_list) == collect(make(uneven, rank=1, world_size=2))


@pytest.mark.system
def test_pipe_urls_refused_unless_allowed(uneven):
    urls = [f"pipe:cat {p}" for p in sorted(uneven.glob("*.tar"))]
    with pytest.raises(PipelineError, match="allow_pipe=True"):
        make(urls, cache_dir=uneven / "cache")
    allowed = make(urls, allow_pipe=True, cache_dir=uneven.parent / "pipe-cache", shuffle=False)
    assert valid_ids(collect(allowed)) == list(range(sum(UNEVEN) // B * B))


def test_a_config_and_keywords_build_the_same_pipeline(uneven):
    config = PipelineConfig(batch_size=B, shuffle_buffer=7, seed=5, balance="pad")
    from_config = ShardPipeline(uneven, config, rank=1, world_size=2)
    assert from_config.config is config  # taken as it is, not copied
    assert collect(from_config) == collect(make(uneven, balance="pad", rank=1, world_size=2))
    # keywords override the config's values; the config itself is left as it was
    over = ShardPipeline(uneven, config, rank=0, world_size=1, batch_size=3)
    assert (over.config.batch_size, over.config.balance, config.batch_size) == (3, "pad", B)
    with pytest.raises(PipelineError, match="batch_sise: Extra inputs are not permitted"):
        ShardPipeline(uneven, batch_sise=3)
    with pytest.raises(PipelineError, match="decode: decode must be an import path"):
        make(uneven, decode="not a path")
    with pytest.raises(ValueError, match="decode must be an import path"):  # pydantic's own
        PipelineConfig(decode="not a path")
    with pytest.raises(PipelineError, match="batch_size: Input should be greater than 0"):
        make(uneven, batch_size=0)


def test_rank_out_of_range_and_bad_options(uneven):
    with pytest.raises(PipelineError, match="rank 2"):
        make(uneven, rank=2, world_size=2)
    with pytest.raises(PipelineError, match="balance"):
        make(uneven, balance="even")
    with pytest.raises(PipelineError, match="split 'val'"):
        make(uneven, split="val")


# -- runs: the shard stretches a stream opens ----------------------------------------------------
def _runs_by_definition(needed, shard_of, pos_of):
    """Maximal stretches of one shard with rising positions holding a needed slot, in order."""
    runs, lo = [], 0
    for i in range(1, len(shard_of) + 1):
        if i == len(shard_of) or shard_of[i] != shard_of[i - 1] or pos_of[i] <= pos_of[i - 1]:
            idx = [j for j in range(lo, i) if j in set(needed.tolist())]
            if idx:
                runs.append((int(shard_of[lo]), idx))
            lo = i
    return runs


@pytest.mark.parametrize("seed", range(20))
def test_vectorised_runs_match_their_definition(seed):
    from ringfeed.pipeline.readplan import _runs

    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 60))
    shard_of = np.sort(rng.integers(0, 6, n)) if seed % 2 else rng.integers(0, 4, n)
    pos_of = rng.integers(0, 5, n)  # positions that fall back start a new run (a resume)
    needed = rng.permutation(n)[:int(rng.integers(1, n + 1))]
    run_shard, run_of, slots, bounds = _runs(needed, shard_of, pos_of)
    got = [(int(run_shard[r]), slots[bounds[r]:bounds[r + 1]].tolist())
           for r in range(len(run_shard))]
    assert got == _runs_by_definition(needed, shard_of, pos_of)
    for r, (_, idx) in enumerate(got):
        assert (run_of[idx] == r).all()
    assert (run_of[np.setdiff1d(np.arange(n), needed)] == -1).all()

"""The torch DataLoader and tf.data adapters yield the in-process iterator's batches, in the
same order, and count consumption where the caller receives batches."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from helpers import REPO
from pipeline_util import collect, write_shards

from ringfeed.pipeline import ShardPipeline

# servers on 127.0.0.1 / loader worker processes (tests/conftest.py: tiers)
pytestmark = pytest.mark.integration

SIZES = [3, 14, 5, 9, 2, 11]


@pytest.fixture(scope="module")
def shard_dir(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("adapters")
    write_shards(d, SIZES, images=True)
    return d


def make(source, **kw) -> ShardPipeline:
    return ShardPipeline(source, batch_size=4, seed=9, shuffle_buffer=6, rank=1, world_size=2,
                         **kw)


def tf_batches(dataset) -> list[dict]:
    return [{k: v.numpy() for k, v in batch.items()} for batch in dataset]


@pytest.mark.system
def test_import_pipeline_loads_neither_torch_nor_tf():
    code = ("import sys; from ringfeed.pipeline import ShardPipeline, PipelineConfig; "
            "bad = [m for m in ('torch', 'tensorflow') if m in sys.modules];"
            " print(bad); sys.exit(1 if bad else 0)")
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.system
def test_torch_and_tf_yield_the_same_samples_in_the_same_order(shard_dir, workers):
    import torch

    from ringfeed.pipeline.tf import make_dataset
    from ringfeed.pipeline.torch import make_loader

    reference = make(shard_dir, num_workers=workers)
    expected = collect(reference)
    loader = make_loader(make(shard_dir, num_workers=workers))
    torch_batches = list(loader)
    assert collect(torch_batches) == expected
    assert isinstance(torch_batches[0]["png"], torch.Tensor)
    assert torch_batches[0]["png"].dtype == torch.uint8
    assert isinstance(torch_batches[0]["__key__"], list)
    tf_pipe = make(shard_dir, num_workers=workers)
    dataset = make_dataset(tf_pipe)
    spec = dataset.element_spec
    assert spec["png"].shape == (4, 8, 8, 3) and spec["png"].dtype.name == "uint8"
    assert spec["cls"].dtype.name == "int64" and spec["__key__"].dtype.name == "string"
    got = tf_batches(dataset)
    assert collect(got) == expected
    assert [k.decode() for k in got[0]["__key__"]] == list(torch_batches[0]["__key__"])
    np.testing.assert_array_equal(got[-1]["png"], torch_batches[-1]["png"].numpy())
    assert tf_pipe.state_dict() == reference.state_dict()


@pytest.mark.parametrize("adapter", ["make_dataset", "TensorLoader"])
@pytest.mark.system
def test_tf_counts_batches_the_caller_pulled_and_resumes(shard_dir, adapter):
    """Both TF adapters: the tf.data.Dataset (counted in a map after its prefetch) and the
    trainer's TensorLoader (counted in Python as the loop takes a batch)."""
    from ringfeed.pipeline import tf as tf_adapter

    make_batches = getattr(tf_adapter, adapter)
    expected = collect(make(shard_dir, num_workers=2))
    pipe = make(shard_dir, num_workers=2)
    head = []
    for batch in make_batches(pipe):
        head.append({k: v.numpy() for k, v in batch.items()})
        assert pipe.state_dict()["segments"][0]["batches_consumed"] == len(head)
        if len(head) == 2:
            break
    again = make(shard_dir, num_workers=2)
    again.load_state_dict(json.loads(json.dumps(pipe.state_dict())))
    assert collect(head) + collect(tf_batches(make_batches(again))) == expected


@pytest.mark.system
def test_worker_batches_cross_as_uint8_and_are_normalized_bit_for_bit_in_the_trainer(shard_dir):
    """Loader workers ship images uint8 (a quarter of the bytes through shared memory); the
    training process normalizes them to exactly the floats the pipeline's own pass makes."""
    import torch

    from ringfeed.pipeline.torch import _worker_context, make_loader

    normalize = ((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))
    expected = list(make(shard_dir, num_workers=2, normalize=normalize))  # (in threads)
    loader = make_loader(make(shard_dir, num_workers=2, normalize=normalize), pin_memory=False)
    assert loader.normalize_here
    got = list(loader)
    assert len(got) == len(expected)
    for ours, theirs in zip(got, expected, strict=True):
        assert ours["png"].dtype == torch.float32
        assert np.array_equal(ours["png"].numpy(), theirs["png"])  # bit for bit
        assert list(ours["__key__"]) == list(theirs["__key__"])
    # not when a transform must see normalized samples, nor for batches pinned for CUDA
    with_transform = make(shard_dir, normalize=normalize, transform=lambda sample: sample)
    assert not _worker_context(with_transform.context, {}).decoder.normalize_later
    assert not _worker_context(loader.pipe.context, {"pin_memory": True}).decoder.normalize_later


def test_torch_persistent_workers_follow_epochs(shard_dir):
    from ringfeed.pipeline.torch import make_loader

    pipe = make(shard_dir, num_workers=2)
    loader = make_loader(pipe)
    epochs = [collect(loader) for _ in range(2)]
    pipe.set_epoch(5)
    epochs.append(collect(loader))
    for epoch, got in zip((0, 1, 5), epochs, strict=True):
        fresh = make(shard_dir, num_workers=2)
        fresh.set_epoch(epoch)
        assert got == collect(fresh), f"epoch {epoch}"
    assert pipe.stats()["batches"] == 3 * pipe.batches_per_epoch
    assert pipe.stats()["samples_per_s"] > 0 and pipe.stats()["data_wait_s"] > 0


def test_worker_processes_read_ahead_and_the_trainer_process_does_not(shard_dir):
    """With DataLoader workers the next epoch is theirs to read: threads in the training
    process reading it too would decode an epoch nobody takes."""
    import threading

    from ringfeed.pipeline.torch import make_loader

    def stream_threads() -> set[threading.Thread]:
        return {t for t in threading.enumerate() if t.name.startswith("ringfeed-stream")}

    earlier = stream_threads()  # other tests' pipelines on this test worker may still be reading
    pipe = make(shard_dir, num_workers=2, read_ahead=True)
    loader = make_loader(pipe)
    first = collect(loader)
    assert pipe._ahead is None
    assert not stream_threads() - earlier
    fresh = make(shard_dir, num_workers=2)
    fresh.set_epoch(1)
    assert collect(loader) == collect(fresh) and first
    loader.close()


def test_torch_loader_stopped_mid_epoch_continues_where_it_stopped(shard_dir):
    from ringfeed.pipeline.torch import make_loader

    expected = collect(make(shard_dir, num_workers=2))
    pipe = make(shard_dir, num_workers=2)
    loader = make_loader(pipe)
    head = []
    for batch in loader:  # persistent workers: the next pass resumes them at batch 3
        head += collect([batch])
        if len(head) == 3:
            break
    assert head + collect(loader) == expected
    assert pipe.batches_remaining == 0


BOOKKEEPING = ("__batch__", "__stats__", "__error__")


def _every_path(shard_dir, path: str):
    """(pipe, its batches as the caller receives them) for one read path."""
    if path == "consumer thread":
        pipe = make(shard_dir, num_workers=0, prefetch=0)
        return pipe, list(pipe)
    if path == "reader threads":
        pipe = make(shard_dir, num_workers=2, prefetch=2)
        return pipe, list(pipe)
    if path.startswith("torch"):
        from ringfeed.pipeline.torch import make_loader

        pipe = make(shard_dir, num_workers=2 if path == "torch workers" else 0)
        loader = make_loader(pipe)
        try:
            return pipe, list(loader)
        finally:
            loader.close()
    from ringfeed.pipeline.tf import make_dataset

    pipe = make(shard_dir, num_workers=2)
    return pipe, tf_batches(make_dataset(pipe))


@pytest.mark.parametrize("path", [
    "consumer thread", "reader threads", "torch thread", "torch workers",
    pytest.param("tf.data", marks=pytest.mark.system)])
def test_bookkeeping_travels_beside_batches_and_is_counted_once(shard_dir, path):
    """The tag and counter increments travel beside a batch (stream.Booked), not as keys in
    it, and every path counts a batch consumed exactly once (in ShardPipeline)."""
    pipe, batches = _every_path(shard_dir, path)
    assert len(batches) == pipe.batches_per_epoch
    for batch in batches:
        assert not set(BOOKKEEPING) & set(batch), sorted(batch)
        assert {"__key__", "__index__", "__valid__"} <= set(batch)
    stats = pipe.stats()
    assert stats["batches"] == len(batches)
    assert stats["samples"] == len(batches) * pipe.batch_size
    assert pipe.state_dict()["segments"][0]["batches_consumed"] == len(batches)
    # the counters crossed over once too: every sample read was read for a batch handed out
    assert stats["samples_read"] + stats["cached_samples"] == stats["samples"]
    assert collect(batches) == collect(make(shard_dir, num_workers=pipe.config.num_workers))


def test_uncounted_iteration_yields_batches_beside_their_tags(shard_dir):
    """What the adapters read: Booked(batch, tag, stats), counted only when the caller says."""
    from ringfeed.pipeline.stream import Booked

    pipe = make(shard_dir, num_workers=2)
    booked = list(pipe.iterate(count=False))
    assert all(isinstance(b, Booked) and not set(BOOKKEEPING) & set(b.batch) for b in booked)
    assert [b.tag for b in booked] == [(0, 0, t) for t in range(pipe.batches_per_epoch)]
    assert pipe.stats()["batches"] == 0 and pipe.stats()["samples_read"] > 0
    for b in booked:
        assert pipe.mark_consumed(b.tag, len(b.batch["__index__"]), strict=True)
    assert pipe.stats()["batches"] == len(booked) and pipe.batches_remaining == 0


def test_booked_survives_dataloader_conversion_and_pinning(monkeypatch):
    """What DataLoader does to each item (default_convert, then pin_memory with CUDA) keeps a
    Booked a Booked and a worker error a worker error (Tensor.pin_memory stubbed: no GPU)."""
    import torch
    from torch.utils.data._utils.collate import default_convert
    from torch.utils.data._utils.pin_memory import pin_memory

    from ringfeed.pipeline import PipelineDataError
    from ringfeed.pipeline.stream import Booked
    from ringfeed.pipeline.torch import _WorkerError

    pinned = []
    monkeypatch.setattr(torch.Tensor, "pin_memory",
                        lambda self, *a, **k: pinned.append(self) or self)
    stats = {"counts": {"samples_read": 2}, "skipped_by_shard": {"s.tar": 1}}
    booked = Booked({"png": np.zeros((2, 4, 4, 3), np.uint8), "__key__": ["a", "b"],
                     "__index__": [4, 5]}, (1, 0, 3), stats)
    out = pin_memory(default_convert(booked))
    assert isinstance(out, Booked) and isinstance(out.batch["png"], torch.Tensor)
    assert [p.shape for p in pinned] == [(2, 4, 4, 3)]
    assert list(out.tag) == [1, 0, 3] and out.stats == stats
    assert out.batch["__key__"] == ["a", "b"] and out.batch["__index__"] == [4, 5]
    error = pin_memory(default_convert(_WorkerError.of(PipelineDataError("x.tar: sample 3"))))
    assert isinstance(error, _WorkerError) and list(error.args) == ["x.tar: sample 3"]
    assert error.error is PipelineDataError  # raised as the same type in the trainer
    try:
        raise KeyError("mine")
    except KeyError as e:
        other = pin_memory(default_convert(_WorkerError.of(e)))
    raised = other.error(*other.args)  # anything else: carried with its traceback and frames
    assert (raised.type_name, raised.message) == ("KeyError", "'mine'")
    assert "Traceback" in raised.text and any(name == "test_booked_survives_dataloader_"
                                              "conversion_and_pinning" for _, name in raised.frames)

"""The trainer's framework-free parts, in-process: schedule, checkpoint files and policy, config
loading, metrics files, micro-batch grouping, data spec inference on real shards."""

from __future__ import annotations

import json
import math
import os
import struct
from pathlib import Path

import pytest
import yaml
from train_util import toy_config, write_config, write_toy_shards

from ringfeed.errors import UserError
from ringfeed.train.backends.base import StepResult, choose_gpu, gpu_for_rank
from ringfeed.train.checkpoint.files import (
    find_resume_point,
    list_checkpoints,
    remove_stale_temporaries,
    verify,
    write_checkpoint,
)
from ringfeed.train.cli import main
from ringfeed.train.config import load_config
from ringfeed.train.data import LM, infer_spec, make_pipeline, split_batch
from ringfeed.train.loop import micro_batch_groups
from ringfeed.train.observe.metrics import RunLogger, bottleneck_line
from ringfeed.train.schedule import LRSchedule, scaled_peak_lr


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> Path:
    return write_toy_shards(tmp_path_factory.mktemp("toy") / "shards")


# -- schedule -----------------------------------------------------------------------------
def test_warmup_then_cosine_to_the_floor():
    s = LRSchedule(peak=0.4, total_steps=110, warmup_steps=10, kind="cosine", min_lr_ratio=0.1)
    assert [s(i) for i in range(3)] == pytest.approx([0.04, 0.08, 0.12])
    assert s(9) == pytest.approx(0.4)  # warmup reaches the peak
    assert s(10) == pytest.approx(0.4)
    assert s(60) == pytest.approx(0.04 + 0.36 * 0.5)  # half way down
    assert s(110) == pytest.approx(0.04) and s(500) == pytest.approx(0.04)
    assert LRSchedule(peak=0.1, total_steps=5)(3) == 0.1  # constant


def test_linear_scaling_rule():
    assert scaled_peak_lr(0.1, world_size=4, accumulate=2, scale=True) == pytest.approx(0.8)
    assert scaled_peak_lr(0.1, world_size=4, accumulate=2, scale=False) == 0.1


# -- checkpoint files ---------------------------------------------------------------------
def _payload(text: str):
    return lambda d: (d / "state.bin").write_text(text)


def test_checkpoints_are_atomic_verified_and_pruned(tmp_path):
    for step in (10, 20, 30):
        write_checkpoint(tmp_path, step, {"epoch": 0}, _payload(f"s{step}"), keep=2)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["ckpt-000000020", "ckpt-000000030"]
    meta = verify(tmp_path / "ckpt-000000030")
    assert meta["step"] == 30 and set(meta["files"]) == {"state.bin"}
    with pytest.raises(RuntimeError):  # a failing payload leaves nothing behind
        write_checkpoint(tmp_path, 40, {}, lambda d: (_ for _ in ()).throw(RuntimeError()), 2)
    assert not (tmp_path / "ckpt-000000040").exists() and not list(tmp_path.glob(".ckpt-*"))


def test_resume_auto_skips_a_corrupt_newest_checkpoint(tmp_path):
    """Promise: Checkpoints that survive being killed (train/RECOVERY.md)."""
    for step in (10, 20):
        write_checkpoint(tmp_path, step, {}, _payload(f"state at {step}"), keep=5)
    (tmp_path / "ckpt-000000020" / "state.bin").write_text("state at 2")  # truncated
    (tmp_path / ".ckpt-000000030.tmp-99").mkdir()  # a save killed half-way
    messages: list[str] = []
    found = find_resume_point("auto", tmp_path, messages.append)
    assert found.path.name == "ckpt-000000010" and found.meta["step"] == 10
    assert "ckpt-000000020: state.bin is corrupt or truncated" in messages[0]
    with pytest.raises(UserError, match="corrupt or truncated"):  # named explicitly: an error
        find_resume_point(str(tmp_path / "ckpt-000000020"), tmp_path, messages.append)
    assert find_resume_point("none", tmp_path, messages.append) is None
    remove_stale_temporaries(tmp_path)
    assert not (tmp_path / ".ckpt-000000030.tmp-99").exists()
    assert find_resume_point("auto", tmp_path / "empty", messages.append) is None


# -- config ---------------------------------------------------------------------------------
def test_set_values_are_yaml_and_global_batch_is_split(tmp_path, shards, monkeypatch):
    monkeypatch.setenv("HOROVOD_SIZE", "2")  # as under horovodrun -np 2
    cfg_file = write_config(tmp_path / "c.yaml", **toy_config(shards, tmp_path / "out"))
    cfg = load_config(cfg_file, ["data.global_batch_size=24", "train.accumulate=3",
                                 "data.image_size=[16, 12]", "train.grad_clip=null"])
    assert cfg.data.batch_size == 4 and cfg.data.image_size == (16, 12)
    assert cfg.train.grad_clip is None
    with pytest.raises(UserError, match=r"not divisible by ranks \(2\) x train.accumulate"):
        load_config(cfg_file, ["data.global_batch_size=9"])
    with pytest.raises(UserError, match=r"optim.nme: unknown key \(did you mean 'name'\?\)"):
        load_config(cfg_file, ["optim.nme=adam"])


def test_validation_is_off_without_a_val_split_unless_asked_for(tmp_path, shards):
    manifest = json.loads((shards / "manifest.json").read_text())
    del manifest["splits"]["val"]
    lone = tmp_path / "lone"
    lone.mkdir()
    for name in [s["name"] for s in manifest["splits"]["train"]["shards"]]:
        (lone / name).symlink_to(shards / name)
    (lone / "manifest.json").write_text(json.dumps(manifest))
    cfg_file = write_config(tmp_path / "c.yaml", **toy_config(lone, tmp_path / "out"))
    assert load_config(cfg_file).val_source is None
    with pytest.raises(UserError, match="split 'val' not in manifest"):
        load_config(cfg_file, ["data.val_split=val"])


def test_decoded_cache_and_decode_device_reach_the_pipeline(tmp_path, shards):
    cfg_file = write_config(tmp_path / "c.yaml", **toy_config(
        shards, tmp_path / "out", data={"train": str(shards), "batch_size": 4,
                                        "cache_dir": str(tmp_path / "cache")}))
    cfg = load_config(cfg_file)
    assert cfg.data.decoded_cache == "auto" and cfg.data.decode_device == "cpu"
    assert make_pipeline(cfg, "train", 0, 1).decoded_cache  # auto: the toy split fits
    off = load_config(cfg_file, ["data.decoded_cache=false"])
    assert off.data.decoded_cache is False
    assert not make_pipeline(off, "train", 0, 1).decoded_cache
    with pytest.raises(UserError, match=r"data.decode_device: 'cuda' .* needs framework torch"):
        load_config(cfg_file, ["framework=tensorflow", "data.decode_device=cuda"])
    with pytest.raises(UserError, match="data.decode_device"):
        load_config(cfg_file, ["data.decode_device=gpu"])
    with pytest.raises(UserError, match="data.decoded_cache"):
        load_config(cfg_file, ["data.decoded_cache=''"])


def test_print_config_without_a_file_lists_every_key(capsys):
    assert main(["train", "--print-config"]) == 0
    out = capsys.readouterr().out
    for key in ("framework:", "accumulate:", "fp16_allreduce:", "save_on_signal:", "resume:"):
        assert key in out


# -- metrics --------------------------------------------------------------------------------
def _events(path: Path) -> list:
    from tensorboard.compat.proto import event_pb2

    data, events, pos = path.read_bytes(), [], 0
    while pos < len(data):
        (length,) = struct.unpack("<Q", data[pos:pos + 8])
        events.append(event_pb2.Event.FromString(data[pos + 12:pos + 12 + length]))
        pos += 12 + length + 4
    return events


def test_logger_writes_jsonl_and_tensorboard_and_a_resume_rewrites_history(tmp_path):
    from ringfeed.train.observe.trackers import TensorBoardSink

    tensorboard = TensorBoardSink(tmp_path / "tensorboard").start()
    logger = RunLogger(tmp_path, True, total_steps=6, global_batch=8, log_every=2,
                       sinks=[tensorboard]).open()
    for step in range(1, 7):
        logger.train_step(step, 0, loss=1.0 / step, lr=0.1, step_s=0.1, data_wait_s=0.025)
    logger.validation(6, 0, {"accuracy": 0.5})
    logger.close()
    tensorboard.close()
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").open()]
    assert [r["step"] for r in records] == [2, 4, 6, 6]
    assert records[0]["loss"] == pytest.approx(0.75) and records[0]["data_wait"] == 0.25
    assert records[0]["samples_per_s"] == pytest.approx(80.0)
    events = _events(next((tmp_path / "tensorboard").glob("events.out.tfevents.*")))
    scalars = {(e.step, v.tag): v.simple_value for e in events for v in e.summary.value}
    assert scalars[(4, "loss")] == pytest.approx((1 / 3 + 1 / 4) / 2)
    assert scalars[(6, "val_accuracy")] == 0.5

    resumed = RunLogger(tmp_path, True, total_steps=6, global_batch=8, log_every=2,
                        start_step=4).open()
    resumed.close()
    kept = [json.loads(x) for x in (tmp_path / "metrics.jsonl").open()]
    assert [r["step"] for r in kept] == [2, 4, 4]  # the later records dropped, an event added
    assert kept[-1]["event"] == "resumed" and kept[-1]["steps_redone"] == 2  # 6 - 4
    assert (resumed.rewound.steps, resumed.rewound.earlier) == (2, 0)
    again = RunLogger(tmp_path, True, total_steps=6, global_batch=8, log_every=2,
                      start_step=4).open()  # a second relaunch from the same checkpoint
    again.close()
    assert (again.rewound.steps, again.rewound.total) == (0, 2)  # the first one's, kept


def test_logger_asks_for_per_step_extras_only_on_log_steps(tmp_path):
    asked: list[int] = []

    def extras(step: int):
        return lambda: asked.append(step) or {"grad_norm": 0.5}

    logger = RunLogger(tmp_path, True, total_steps=5, global_batch=8, log_every=2).open()
    for step in range(1, 6):
        logger.train_step(step, 0, loss=1.0, lr=0.1, step_s=0.1, data_wait_s=0.0,
                          extra=extras(step))
    logger.close()
    assert asked == [2, 4, 5]  # log steps and the last step
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").open()]
    assert [r["grad_norm"] for r in records] == [0.5, 0.5, 0.5]


def test_step_result_reads_framework_scalars_when_asked():
    class Scalar:  # a device tensor: converting it is the host sync
        reads = 0

        def __init__(self, value):
            self.value = value

        def __float__(self):
            Scalar.reads += 1
            return float(self.value)

        def __bool__(self):
            Scalar.reads += 1
            return bool(self.value)

    result = StepResult.from_stats([1.5, 0.0, 1.0], applied=Scalar(0), grad_norm=Scalar(2),
                                   loss_scale=Scalar(4))
    assert Scalar.reads == 0 and result.finite and result.stop_requested
    assert not result.save_requested
    assert (result.applied, result.grad_norm, result.loss_scale) == (False, 2.0, 4.0)
    assert (result.applied, result.grad_norm, result.loss_scale) == (False, 2.0, 4.0)
    assert Scalar.reads == 3  # once each
    assert not StepResult.from_stats([float("nan"), 0.0, 0.0], applied=False).finite


def test_bottleneck_line():
    assert bottleneck_line(0.31).startswith("input IS the bottleneck")
    assert bottleneck_line(0.08).startswith("input is a minor cost")
    assert bottleneck_line(0.01).startswith("input is not the bottleneck")


# -- loop helpers and data ------------------------------------------------------------------
def test_micro_batch_groups_drop_a_short_last_group():
    groups = [g for g, _waited in micro_batch_groups(range(7), 3)]
    assert groups == [[0, 1, 2], [3, 4, 5]]


def test_data_spec_inferred_from_manifest_and_a_sample(tmp_path, shards):
    cfg = load_config(write_config(tmp_path / "c.yaml", **toy_config(shards, tmp_path / "o")))
    spec = infer_spec(cfg, make_pipeline(cfg, "train", 0, 1))
    assert (spec.input_key, spec.target_key, spec.input_shape, spec.num_classes) == \
        ("x.npy", "y.npy", (8,), 3)


def test_token_shards_give_a_language_model_spec(tmp_path):
    (tmp_path / "text").mkdir()
    (tmp_path / "text" / "a.txt").write_text("hello ringfeed " * 200)
    assert main(["shard", str(tmp_path / "text"), str(tmp_path / "tok"), "--format", "text",
                 "--seq-len", "33", "--no-progress"]) == 0
    cfg = load_config(write_config(tmp_path / "c.yaml", **toy_config(
        tmp_path / "tok", tmp_path / "o", model={"name": "gpt", "args": {}})))
    pipe = make_pipeline(cfg, "train", 0, 1)
    spec = infer_spec(cfg, pipe)
    assert spec.task == LM and spec.input_shape == (32,) and spec.vocab_size == 257
    x, y, _ = split_batch(next(iter(pipe)), spec)
    assert (x[:, 1:] == y[:, :-1]).all() and not math.isnan(float(x.sum()))


@pytest.mark.parametrize(("views", "share", "expected"), [
    # horovodrun on one 4-GPU host: local rank i -> GPU i
    ([(0, None, 4)] * 4, False, [0, 1, 2, 3]),
    # two hosts, two GPUs each
    ([(0, None, 2), (0, None, 2), (1, None, 2), (1, None, 2)], False, [0, 1, 0, 1]),
    # Slurm --gpus-per-task=1: each rank sees only its own GPU (its own UUID), as device 0
    ([(0, ("GPU-a",), 1), (0, ("GPU-b",), 1), (0, ("GPU-c",), 1)], False, [0, 0, 0]),
    # explicit sharing: 3 ranks round-robin on 2 GPUs
    ([(0, None, 2)] * 3, True, [0, 1, 0]),
    # no GPU: the CPU
    ([(0, None, 0)] * 2, False, [None, None]),
])
def test_gpu_for_rank(views, share, expected):
    assert [gpu_for_rank(r, views, share) for r in range(len(views))] == expected


def test_more_ranks_than_gpus_is_one_line_on_every_rank():
    # host 1 is over-subscribed; host 0 is fine but must stop too (no rank left waiting)
    views = [(0, None, 1), (1, "0", 1), (1, "0", 1)]
    for rank in range(3):
        with pytest.raises(UserError) as err:
            gpu_for_rank(rank, views, share=False)
        assert err.value.exit_code == 2
        message = str(err.value)
        assert "\n" not in message
        assert "2 ranks on one host share 1 visible GPU(s) (CUDA_VISIBLE_DEVICES=0)" in message
        assert "train.share_gpus" in message


def test_choose_gpu_gathers_except_in_elastic_runs():
    """Elastic runs gather nothing before Horovod's sync (a joining worker would hang the
    others): each rank assumes its host's ranks see what it sees."""
    def gather(view):
        return [view, (0, ("GPU-b",), 1)]

    assert choose_gpu((0, ("GPU-a",), 1), 0, 0, 2, False, gather) == 0
    assert choose_gpu((0, ("GPU-a", "GPU-b"), 2), 1, 1, 2, False, None) == 1
    with pytest.raises(UserError, match="2 ranks on one host share 1 visible GPU"):
        choose_gpu((0, ("GPU-a",), 1), 1, 1, 2, False, None)


def test_the_data_section_is_the_pipelines_config(tmp_path, shards):
    """The pipeline's options are declared once (PipelineConfig); the data section adds a run's
    keys, and a key the run sets elsewhere is one line naming where."""
    from ringfeed.pipeline import PipelineConfig
    from ringfeed.train.config import RUN_OWNED_DATA_KEYS, DataSection, template

    assert issubclass(DataSection, PipelineConfig)
    cfg_file = write_config(tmp_path / "c.yaml", **toy_config(
        shards, tmp_path / "out", data={"train": str(shards), "batch_size": 4,
                                        "cache_dir": str(tmp_path / "cache")}))
    cfg = load_config(cfg_file, ["data.retries=5", "data.shuffle_buffer=9", "train.seed=7"])
    pipe = make_pipeline(cfg, "train", 0, 1)
    assert (pipe.config.retries, pipe.config.shuffle_buffer, pipe.config.seed) == (5, 9, 7)
    assert pipe.config.read_ahead and not make_pipeline(cfg, "val", 0, 1).config.read_ahead
    for key in RUN_OWNED_DATA_KEYS:
        with pytest.raises(UserError, match=f"data.{key}: not a key of a run's data section"):
            load_config(cfg_file, [f"data.{key}=1"])
        assert key not in yaml.safe_load(template())["data"]
    with pytest.raises(UserError, match=r"data.retriez: unknown key \(did you mean 'retries'\?\)"):
        load_config(cfg_file, ["data.retriez=1"])


def test_cpu_threads_split_the_hosts_cores_between_its_ranks(monkeypatch):
    from ringfeed.train.backends.base import cpu_threads_per_rank

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: 16)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)))
    assert cpu_threads_per_rank(4) == 4 and cpu_threads_per_rank(32) == 1
    assert cpu_threads_per_rank(1) is None  # one rank: torch's default, every core
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    assert cpu_threads_per_rank(4) is None  # bound by its launcher: torch follows the binding
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)))
    assert cpu_threads_per_rank(4) is None  # the user's choice

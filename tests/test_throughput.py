"""Throughput accounting and profiles (issue 24): FLOPs per sample counted by torch's
FlopCounterMode and from TensorFlow's traced step against analytic counts written here, the peak
table and its override, MFU/achieved FLOP/s in summary.json, metrics.jsonl and TensorBoard of
real 2-rank runs (torch and TensorFlow), counting that changes no weight, and profiler traces
holding the named ranges plus Horovod's timeline.

Worker: `python tests/test_throughput.py weights --framework torch --out OUT.json` trains the
built-in cnn (dropout on) three ways under Horovod - plain, with rank 0 counting FLOPs first,
plain again - and writes each way's final weights digest.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from helpers import BIN, horovodrun, run, test_env  # noqa: E402
from train_util import toy_config, write_config, write_toy_shards  # noqa: E402

from ringfeed.train.observe.throughput import (  # noqa: E402
    PEAK_TFLOPS,
    Accounting,
    FlopCount,
    Peak,
    device_row,
    resolve_peak,
    summary_lines,
)

RINGFEED = BIN / "ringfeed"


# -- analytic counts, written independently of train/observe/throughput.py -------------------------
def cnn_training_flops(h: int, w: int, c: int, width: int, hidden: int, classes: int) -> int:
    """train/models' cnn: conv3x3(c->width), conv3x3(width->width), pool, conv3x3(width->2w),
    pool, dense(2w*(h/4)*(w/4) -> hidden), dense(hidden -> classes). A product of m x k by k x n
    costs 2mkn; training = forward + the weight gradient of every layer + the input gradient of
    every layer but the first (the input needs none)."""
    layers = [9 * c * width * h * w, 9 * width * width * h * w,
              9 * width * 2 * width * (h // 2) * (w // 2),
              2 * width * (h // 4) * (w // 4) * hidden, hidden * classes]  # multiply-adds
    forward = 2 * sum(layers)
    return forward + forward + (forward - 2 * layers[0])


def gpt_training_flops(seq: int, vocab: int, n_layer: int, d: int) -> int:
    """train/models' gpt: per token and layer the q/k/v, output and two MLP projections (12 d^2
    multiply-adds), the logits (d x vocab); per layer attention QK^T and AV (2 x seq^2 x d per
    sample, causal masking does not skip work). Every product's input gradient is needed (the
    embeddings below train), so training = 3 x forward."""
    per_token = n_layer * 12 * d * d + d * vocab
    forward = 2 * (seq * per_token + n_layer * 2 * seq * seq * d)
    return 3 * forward


def mlp_training_flops(features: int, hidden: int, classes: int) -> int:
    return 2 * features * hidden * 2 + 2 * hidden * classes * 3  # first layer: no input grad


# -- peak table and accounting ---------------------------------------------------------------
@pytest.mark.parametrize("name, row", [
    ("NVIDIA H100 80GB HBM3", "H100 SXM"), ("NVIDIA H100 PCIe", "H100 PCIe"),
    ("NVIDIA H100 NVL", "H100 NVL"), ("NVIDIA H200", "H200 SXM"), ("NVIDIA H200 NVL", "H200 NVL"),
    ("NVIDIA GH200 480GB", "GH200"), ("NVIDIA A100-SXM4-80GB", "A100"),
    ("NVIDIA A100 80GB PCIe", "A100"), ("NVIDIA A100-PCIE-40GB", "A100"), ("NVIDIA A30", "A30"),
    ("NVIDIA A10", "A10"), ("NVIDIA L4", "L4"), ("NVIDIA L40S", "L40S"), ("NVIDIA L40", "L40"),
    ("Tesla V100-SXM2-16GB", "V100 SXM2"), ("Tesla V100-PCIE-32GB", "V100 PCIe"),
    ("Tesla V100S-PCIE-32GB", "V100S PCIe"), ("Tesla T4", "T4"),
    ("NVIDIA GeForce RTX 4090", "RTX 4090"), ("NVIDIA GeForce RTX 3090", "RTX 3090"),
    # variants with other clocks or units match nothing rather than a neighbour
    ("NVIDIA A10G", None), ("NVIDIA GeForce RTX 3090 Ti", None), ("NVIDIA A40", None),
])
def test_device_names_match_their_table_row(name: str, row: str | None) -> None:
    assert device_row(name) == row


def test_peak_lookup_by_dtype_and_override() -> None:
    assert resolve_peak("NVIDIA H100 80GB HBM3", "bf16", None).tflops == 989.5
    assert resolve_peak("NVIDIA H100 80GB HBM3", "tf32", None).tflops == 494.5
    assert resolve_peak("NVIDIA A100-SXM4-40GB", "fp32", None).tflops == 19.5
    v100_bf16 = resolve_peak("Tesla V100-SXM2-16GB", "bf16", None)
    assert v100_bf16.tflops is None and "no bf16 peak" in v100_bf16.source
    cpu = resolve_peak(None, "fp32", None)
    assert cpu.tflops is None and "CPU" in cpu.source
    assert resolve_peak("Some Future GPU", "bf16", None).tflops is None
    for device in (None, "NVIDIA H100 80GB HBM3", "Some Future GPU"):  # the option wins
        assert resolve_peak(device, "bf16", 123.0) == Peak(123.0, "train.peak_tflops")
    # every row has the four dtypes; bf16/fp16 at least the fp32 rate where present
    for row, peaks in PEAK_TFLOPS.items():
        assert set(peaks) == {"fp32", "tf32", "bf16", "fp16"}, row
        assert all(v is None or v >= peaks["fp32"] for v in peaks.values()), row


def test_accounting_rates_and_summary() -> None:
    acc = Accounting(FlopCount(2e9, "counted"), Peak(100.0, "table"), devices=4,
                     tokens_per_sample=256)
    rates = acc.rates(1000.0)
    assert rates["tflops"] == pytest.approx(2.0)
    assert rates["mfu"] == pytest.approx(2e12 / (4 * 100e12))
    assert rates["tokens_per_s"] == pytest.approx(256_000)
    summary = acc.summary(1000.0)
    assert summary["flops_per_sample"] == 2e9 and summary["devices"] == 4
    assert "MFU 0.5% of 4 x 100 TFLOP/s" in summary_lines(summary)[0]
    # no peak: achieved FLOP/s but no MFU; unknown FLOPs: neither, and said so
    no_peak = Accounting(FlopCount(2e9, "counted"), Peak(None, "CPU: no peak"), devices=2)
    assert set(no_peak.rates(10.0)) == {"tflops"}
    assert "no MFU: CPU" in summary_lines(no_peak.summary(10.0))[0]
    unknown = Accounting(FlopCount(None, "unknown: why"), Peak(100.0, "table"), devices=2)
    assert unknown.rates(10.0) == {} and unknown.summary(10.0)["mfu"] is None
    assert "FLOPs unknown (unknown: why)" in summary_lines(unknown.summary(10.0))[0]


def test_profile_option_and_its_cli_shortcut(tmp_path: Path, capsys) -> None:
    import yaml

    from ringfeed.train.cli import main

    cfg = write_config(tmp_path / "c.yaml", **toy_config(tmp_path / "shards", tmp_path / "o"))
    assert main(["train", str(cfg), "--print-config"]) == 0
    assert yaml.safe_load(capsys.readouterr().out)["train"]["profile"] is None  # off
    assert main(["train", str(cfg), "--profile", "--print-config"]) == 0
    shown = yaml.safe_load(capsys.readouterr().out)["train"]
    assert shown["profile"] == {"start_step": 5, "steps": 5, "ranks": [0]}
    assert shown["peak_tflops"] is None
    # the config's own window wins over the shortcut's defaults; a bad one is one line
    assert main(["train", str(cfg), "--profile", "--print-config",
                 "--set", "train.profile={start_step: 2, steps: 1, ranks: [1]}"]) == 0
    assert yaml.safe_load(capsys.readouterr().out)["train"]["profile"]["ranks"] == [1]
    assert main(["train", str(cfg), "--print-config", "--set", "train.profile.steps=0"]) == 2
    err = capsys.readouterr().err
    assert "train.profile.steps" in err and len(err.strip().splitlines()) == 1


# -- counting the built-in models --------------------------------------------------------------
@pytest.mark.integration
def test_torch_counts_builtin_models_like_the_analytic_count() -> None:
    import torch

    from ringfeed.train.data import CLASSIFY, LM, DataSpec
    from ringfeed.train.models.torch_models import build
    from ringfeed.train.observe.throughput import count_torch_flops

    torch.manual_seed(0)
    cnn = build("cnn", DataSpec(CLASSIFY, "png", "cls", (8, 8, 1), num_classes=10), width=32,
                hidden=128, dropout=0.5)
    before = [p.detach().clone() for p in cnn.parameters()]
    rng = torch.get_rng_state()
    counted = count_torch_flops(cnn, (16, 1, 8, 8), torch.uint8)  # NCHW
    expected = cnn_training_flops(8, 8, 1, 32, 128, 10)
    assert counted.per_sample == pytest.approx(expected, rel=0.05), counted
    assert "FlopCounterMode" in counted.method
    # nothing of the model or the RNG moved; no gradient reached the real parameters
    assert torch.equal(rng, torch.get_rng_state())
    assert all(torch.equal(a, b) and b.grad is None
               for a, b in zip(before, cnn.parameters(), strict=True))
    gpt = build("gpt", DataSpec(LM, "tokens", None, (32,), vocab_size=64), n_layer=2, n_head=4,
                d_model=128, dropout=0.1)  # attention dropout draws random numbers
    rng = torch.get_rng_state()
    counted = count_torch_flops(gpt, (4, 32), torch.int64)
    assert counted.per_sample == pytest.approx(gpt_training_flops(32, 64, 2, 128), rel=0.05)
    assert torch.equal(rng, torch.get_rng_state())


@pytest.mark.integration
def test_torch_model_that_needs_real_values_is_unknown() -> None:
    import torch

    from ringfeed.train.observe.throughput import count_torch_flops

    class Peeking(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = torch.nn.Linear(4, 2)

        def forward(self, x):
            if x.abs().max().item() > 100:  # data-dependent: needs real values
                x = x / 100
            return self.fc(x)

    counted = count_torch_flops(Peeking(), (3, 4), torch.float32)
    assert counted.per_sample is None and counted.method.startswith("unknown: "), counted


@pytest.mark.integration
def test_a_token_model_that_needs_real_values_is_estimated_as_counted() -> None:
    """A gpt whose forward checks its token ids (`.item()`: no meta device) gets 6 N T plus
    the attention term from its `config`: the meta count of the same gpt, exactly; without a
    config the attention term is left out and the method says so."""
    import types

    import torch

    from ringfeed.train.data import LM, DataSpec
    from ringfeed.train.models.torch_models import build
    from ringfeed.train.observe.throughput import count_torch_flops

    spec = DataSpec(LM, "tokens", None, (32,), vocab_size=64)
    gpt = build("gpt", spec, n_layer=2, n_head=4, d_model=128, tie_embeddings=True)

    class Checking(torch.nn.Module):
        def __init__(self, config: object | None) -> None:
            super().__init__()
            self.gpt, self.config = gpt, config

        def forward(self, idx):
            if idx.max().item() >= 64:
                raise ValueError("token id out of range")
            return self.gpt(idx)

    counted = count_torch_flops(gpt, (4, 32), torch.int64).per_sample
    config = types.SimpleNamespace(n_layer=2, n_embd=128)
    estimate = count_torch_flops(Checking(config), (4, 32), torch.int64, tokens=True)
    assert estimate.per_sample == counted, estimate
    assert estimate.method.startswith("estimate: 6 x ") and "meta device" in estimate.method
    partial = count_torch_flops(Checking(None), (4, 32), torch.int64, tokens=True)
    assert count_torch_flops(Checking(None), (4, 32), torch.int64).per_sample is None
    assert partial.per_sample == counted - 12 * 2 * 128 * 32 * 32
    assert "attention not counted" in partial.method


@pytest.mark.system  # importing TensorFlow runs `uname -p`
def test_tensorflow_counts_builtin_models_like_the_analytic_count() -> None:
    import keras
    import numpy as np

    from ringfeed.train.data import CLASSIFY, LM, DataSpec
    from ringfeed.train.models.keras_models import build
    from ringfeed.train.observe.throughput import count_tf_flops

    keras.utils.set_random_seed(0)
    cnn = build("cnn", DataSpec(CLASSIFY, "png", "cls", (8, 8, 1), num_classes=10), width=32,
                hidden=128, dropout=0.5)
    before = [v.numpy().copy() for v in cnn.variables]  # weights and the dropout seed state
    counted = count_tf_flops(cnn, (16, 8, 8, 1), "uint8")
    assert counted.per_sample == pytest.approx(cnn_training_flops(8, 8, 1, 32, 128, 10),
                                               rel=0.05), counted
    assert all(np.array_equal(a, v.numpy()) for a, v in zip(before, cnn.variables, strict=True))
    gpt = build("gpt", DataSpec(LM, "tokens", None, (32,), vocab_size=64), n_layer=2, n_head=4,
                d_model=128, dropout=0.1)
    counted = count_tf_flops(gpt, (4, 32), "int64")
    assert counted.per_sample == pytest.approx(gpt_training_flops(32, 64, 2, 128), rel=0.05)
    # a recurrent layer's loop hides its work from the count: unknown, not a guess
    rnn = keras.Sequential([keras.Input((5, 3)), keras.layers.LSTM(4), keras.layers.Dense(2)])
    counted = count_tf_flops(rnn, (2, 5, 3), "float32")
    assert counted.per_sample is None and "While" in counted.method, counted


@pytest.mark.integration
def test_profile_window_opens_and_closes_at_its_steps(tmp_path: Path) -> None:
    """The torch profiler runs for steps 2-3 only: a range inside the window is in the trace,
    ranges before and after are not; a run that starts past the window profiles nothing."""
    import torch

    from ringfeed.train.config import ProfileSection
    from ringfeed.train.observe.profiler import NO_SPAN, StepProfiler

    said: list[str] = []
    section = ProfileSection(start_step=2, steps=2, ranks=[0])
    profiler = StepProfiler("torch", section, 0, 1, tmp_path, said.append)
    for step in range(1, 6):
        profiler.at(step)
        assert profiler.active == (step in (2, 3))
        with profiler.span(f"ringfeed.test_step{step}"):
            torch.ones(4, 4) @ torch.ones(4, 4)
    assert profiler.span("after") is NO_SPAN and not (tmp_path / "profile" / "rank1").exists()
    (trace,) = (tmp_path / "profile" / "rank0").glob("rank0.*.pt.trace.json")
    names = {e.get("name") for e in json.loads(trace.read_text())["traceEvents"]}
    assert {"ringfeed.test_step2", "ringfeed.test_step3"} <= names
    assert not names & {"ringfeed.test_step1", "ringfeed.test_step4"}
    assert any("profile: steps 2-3 of rank 0" in line for line in said), said
    # (no Horovod here: the timeline is reported missing, not a crash)
    assert any("no Horovod timeline" in line for line in said), said

    late = StepProfiler("torch", section, 0, 1, tmp_path / "late", said.append)
    late.at(7)  # resumed at step 7
    late.at(8)
    assert not late.active and not (tmp_path / "late" / "profile").exists()
    assert "past train.profile.start_step 2: nothing profiled" in said[-1]


# -- accounting changes no weights ---------------------------------------------------------------
def weights_main(framework: str, out: Path) -> None:
    """Three runs of the cnn (dropout 0.5) on 2 ranks: plain, rank 0 counting FLOPs and asking
    for its device first (as the loop does), plain again; each run's weights digest."""
    from train_util import _backend, _dist, toy_images

    from ringfeed.train.data import CLASSIFY, DataSpec

    spec = DataSpec(CLASSIFY, "x.npy", "y.npy", (4, 4, 2), num_classes=3)
    rank, size = _dist(framework)
    digests = {}
    for name, count in (("plain", False), ("counted", True), ("plain_again", False)):
        backend = _backend(framework, 1, 4, spec=spec, model={
            "name": "cnn", "args": {"width": 4, "hidden": 8, "dropout": 0.5}})
        x, y = toy_images(4 * size * 3, seed=3)
        if count and rank == 0:
            flops = backend.count_flops({"x.npy": x[:4], "y.npy": y[:4]})
            assert flops.per_sample, flops
            backend.accounting_device()
        for step in range(3):
            rows = slice((step * size + rank) * 4, (step * size + rank + 1) * 4)
            backend.train_step([{"x.npy": x[rows], "y.npy": y[rows]}], lr=0.1)
        h = hashlib.sha256()
        for w in backend.weights():
            h.update(np.ascontiguousarray(w).tobytes())
        digests[name] = h.hexdigest()
    if framework == "torch":
        import horovod.torch as hvd
    else:
        import horovod.tensorflow as hvd
    gathered = hvd.allgather_object(digests)
    if rank == 0:
        out.write_text(json.dumps(gathered))


@pytest.mark.system
@pytest.mark.parametrize("framework", ["torch", "tensorflow"])
def test_counting_flops_changes_no_weights(tmp_path: Path, framework: str) -> None:
    out = tmp_path / "digests.json"
    res = horovodrun(2, [sys.executable, __file__, "weights", "--framework", framework,
                         "--out", out], timeout=240)
    assert res.returncode == 0, res.output[-3000:]
    ranks = json.loads(out.read_text())
    assert len(ranks) == 2
    for digests in ranks:
        assert digests["plain"] == digests["plain_again"]  # the scenario is deterministic
        assert digests["counted"] == digests["plain"]  # and counting changed nothing
    assert ranks[0] == ranks[1]  # the replicas agree


# -- real runs: the numbers in every output, and a profile ------------------------------------
@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> Path:
    return write_toy_shards(tmp_path_factory.mktemp("toy") / "shards")


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def tensorboard_tags(logdir: Path) -> set[str]:
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

    tags = set()
    for events in logdir.glob("events.out.tfevents.*"):
        for event in EventFileLoader(str(events)).Load():
            tags.update(v.tag for v in event.summary.value)
    return tags


def trace_names(framework: str, rank_dir: Path) -> set[str]:
    """The names of the events in a rank's profiler trace (TensorFlow: and their string
    arguments, where an asynchronous kernel's op name and type are)."""
    if framework == "torch":
        traces = list(rank_dir.glob("*.pt.trace.json"))
        assert len(traces) == 1, traces
        return {e.get("name") for e in json.loads(traces[0].read_text())["traceEvents"]}
    from tensorflow.tsl.profiler.protobuf import xplane_pb2

    planes = list(rank_dir.glob("plugins/profile/*/*.xplane.pb"))
    assert len(planes) == 1, planes
    space = xplane_pb2.XSpace()
    space.ParseFromString(planes[0].read_bytes())
    names = set()
    for plane in space.planes:
        names.update(m.name for m in plane.event_metadata.values())
        names.update(stat.str_value for line in plane.lines for event in line.events
                     for stat in event.stats if stat.str_value)
        names.update(m.name for m in plane.stat_metadata.values())  # (interned string values)
    return names


@pytest.mark.system
@pytest.mark.parametrize("framework", ["torch", "tensorflow"])
def test_two_rank_run_reports_flops_mfu_and_profiles(tmp_path: Path, shards: Path,
                                                     framework: str) -> None:
    out = tmp_path / "run"
    cfg = write_config(tmp_path / "run.yaml", **toy_config(
        shards, out, framework,
        train={"epochs": 1, "log_every": 5, "peak_tflops": 0.002,
               "profile": {"start_step": 3, "steps": 2, "ranks": [0, 1]}}))
    res = horovodrun(2, [RINGFEED, "train", cfg], timeout=300)
    assert res.returncode == 0, res.output[-4000:]
    summary = json.loads((out / "summary.json").read_text())
    t = summary["throughput"]
    # the toy mlp [8 -> 16 -> 3]: counted exactly
    assert t["flops_per_sample"] == pytest.approx(mlp_training_flops(8, 16, 3)), t
    assert t["achieved_tflops"] == pytest.approx(
        t["flops_per_sample"] * summary["samples_per_s"] / 1e12)
    assert t["peak_source"] == "train.peak_tflops" and t["devices"] == 2
    assert t["mfu"] == pytest.approx(t["achieved_tflops"] / (2 * 0.002))
    assert 0 < t["mfu"] < 1 and t["tokens_per_s"] is None
    assert "  compute            800 FLOP/sample, " in res.stdout
    rows = [r for r in read_jsonl(out / "metrics.jsonl") if "loss" in r]
    assert rows and all(r["tflops"] > 0 and 0 < r["mfu"] < 1 for r in rows), rows
    assert all(r["tflops"] == pytest.approx(800 * r["samples_per_s"] / 1e12) for r in rows)
    assert {"tflops", "mfu", "samples_per_s"} <= tensorboard_tags(out / "tensorboard")
    # steps 3-4 traced on both ranks; the timeline of the same steps from rank 0
    ranges = {"ringfeed.data_wait", "ringfeed.step"} | (
        {"ringfeed.forward", "ringfeed.backward", "ringfeed.allreduce", "ringfeed.optimizer_step"}
        if framework == "torch" else set())
    for rank in (0, 1):
        names = trace_names(framework, out / "profile" / f"rank{rank}")
        assert ranges <= names, sorted(n for n in names if n and "ringfeed" in n)
        if framework == "tensorflow":  # the step's graph ops, by name scope, and Horovod's
            assert any(n.startswith("ringfeed_forward/") for n in names), sorted(names)[:50]
            assert any(n.startswith("gradient_tape/ringfeed_forward/") for n in names)
            assert any("/ringfeed_optimizer_step/" in n for n in names)
            assert {"HorovodGroupedAllreduce", "HorovodAllreduce"} <= names  # kernel types
    timeline = (out / "profile" / "horovod_timeline.json").read_text()
    assert "ALLREDUCE" in timeline and "ringfeed" in timeline, timeline[:2000]
    assert "profile: steps 3-4 of rank 0" in res.stdout


@pytest.mark.system
def test_run_without_peak_or_profile_has_flops_and_no_mfu(tmp_path: Path, shards: Path) -> None:
    out = tmp_path / "run"
    cfg = write_config(tmp_path / "run.yaml", **toy_config(shards, out, "torch",
                                                         train={"max_steps": 6}))
    env = test_env()
    del env["OMP_NUM_THREADS"]  # (also: each of the 2 ranks takes its share of the cores)
    res = horovodrun(2, [RINGFEED, "train", cfg], timeout=300, env=env)
    assert res.returncode == 0, res.output[-4000:]
    done = json.loads((out / "summary.json").read_text())
    assert done["cpu_threads"] == max(1, len(os.sched_getaffinity(0)) // 2)
    t = done["throughput"]
    assert t["flops_per_sample"] == 800 and t["achieved_tflops"] > 0
    assert t["mfu"] is None and "CPU" in t["peak_source"]
    rows = [r for r in read_jsonl(out / "metrics.jsonl") if "loss" in r]
    assert rows and all("tflops" in r and "mfu" not in r for r in rows)
    assert not (out / "profile").exists()  # off: nothing profiled, nothing written


@pytest.mark.system
def test_token_run_reports_tokens_per_second(tmp_path: Path) -> None:
    """One process, the built-in gpt on byte-level token shards (seq_len 32, vocabulary 257)."""
    from ringfeed.train.cli import main

    (tmp_path / "text").mkdir()
    (tmp_path / "text" / "a.txt").write_text("hello ringfeed " * 400)
    assert main(["shard", str(tmp_path / "text"), str(tmp_path / "tok"), "--format", "text",
                 "--seq-len", "33", "--no-progress"]) == 0
    out = tmp_path / "run"
    cfg = write_config(tmp_path / "run.yaml", **toy_config(
        tmp_path / "tok", out, model={"name": "gpt",
                                      "args": {"n_layer": 1, "d_model": 32, "n_head": 2}},
        train={"max_steps": 6, "log_every": 3}))
    res = run([RINGFEED, "train", cfg], timeout=240)
    assert res.returncode == 0, res.output[-4000:]
    summary = json.loads((out / "summary.json").read_text())
    t = summary["throughput"]
    assert t["flops_per_sample"] == pytest.approx(gpt_training_flops(32, 257, 1, 32), rel=0.05)
    assert t["tokens_per_sample"] == 32
    assert t["tokens_per_s"] == pytest.approx(32 * summary["samples_per_s"])
    rows = [r for r in read_jsonl(out / "metrics.jsonl") if "loss" in r]
    assert rows and all(r["tokens_per_s"] == pytest.approx(32 * r["samples_per_s"])
                        for r in rows)
    assert "  tokens             " in res.stdout
    for r in rows:  # the step line says tokens/s beside samples/s
        assert re.search(rf"step {r['step']}/6 .* {r['samples_per_s']:.0f} samples/s  "
                         rf"{r['tokens_per_s']:.0f} tokens/s  data-wait", res.output), res.output


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["weights"])
    parser.add_argument("--framework", required=True)
    parser.add_argument("--out", required=True, type=Path)
    args = parser.parse_args()
    weights_main(args.framework, args.out)

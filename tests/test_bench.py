"""Smoke test for benchmarks/: `ringfeed bench --quick` runs every benchmark end to end (real
horovodrun, torchrun, `ringfeed train`, webdataset peers), so the benchmarks cannot rot.
Timings are not asserted; that every benchmark ran and produced finite ratios and its files is."""

from __future__ import annotations

import json
import math
import sys

import pytest
from helpers import REPO, ringfeed

# Every benchmark runs here, once; the quick run is each one's smoke test.
BENCHMARKS = {"shards", "pipeline", "trainer", "allreduce", "scaling", "stall", "decode", "plan",
              "local_sgd", "startup", "augment", "input_bound", "tokens"}
NOT_MEASURED_IN_QUICK = ("pending:", "full mode only")


@pytest.mark.system
@pytest.mark.timeout(500)  # (local_sgd's quick mode: ~1 min of it)
def test_every_benchmark_runs_in_quick_mode(tmp_path):
    readme = REPO / "benchmarks" / "README.md"
    readme_before = readme.read_text()

    r = ringfeed("bench", "--quick", "--results", str(tmp_path), timeout=480)

    assert r.returncode == 0, r.output[-4000:]
    summary = json.loads((tmp_path / "summary_quick.json").read_text())
    assert summary["quick"] is True
    assert set(summary["benchmarks"]) == BENCHMARKS
    for name, bench in summary["benchmarks"].items():
        assert bench["status"] == "ok", (name, bench["status"])
        assert bench["rows"], name
        for row in bench["rows"]:
            if row["ratio"] is None:  # only allowed with the reason it was not measured
                assert row["note"].startswith(NOT_MEASURED_IN_QUICK), row
            else:
                assert math.isfinite(row["ratio"]) and row["ratio"] > 0, row
    for stem in ("trainer_quick", "allreduce_quick", "scaling_quick", "stall_quick"):
        result = json.loads((tmp_path / f"{stem}.json").read_text())
        assert result["rows"] and result["machine"]["cpus"] >= 1
    for stem in ("trainer_quick", "allreduce_quick", "scaling_quick"):
        assert (tmp_path / f"{stem}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # Every trainer-overhead peer really ran: a step time for each contender.
    trainer = json.loads((tmp_path / "trainer_quick.json").read_text())
    assert {"horovod torch loop", "torch DDP (gloo)"} <= set(trainer["data"]["best_step_s"])
    allreduce = json.loads((tmp_path / "allreduce_quick.json").read_text())["data"]
    assert allreduce["horovod"]["ranks"] == allreduce["gloo"]["ranks"] == 2
    # local SGD on two network-namespace hosts over a tc-shaped link, H=1 and H=4 ("pending"
    # rows where namespaces cannot be made)
    local_sgd = summary["benchmarks"]["local_sgd"]
    if not any(row["note"].startswith("pending:") for row in local_sgd["rows"]):
        data = json.loads((tmp_path / "local_sgd_quick.json").read_text())["data"]
        assert set(data["step_ms"]) == {"H=1", "H=4"}
        for run in data["summaries"].values():
            assert run["status"] == "finished" and run["step"] == data["steps"]
            assert run["world_size"] == 2
        assert (tmp_path / "local_sgd_quick.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    check_shards(tmp_path)
    check_pipeline(tmp_path)
    check_decode(tmp_path)
    check_plan(tmp_path)
    check_startup(tmp_path)
    check_augment(tmp_path)
    # The closing table is printed, and a quick run leaves the committed README alone.
    assert "met?" in r.stdout and "allreduce" in r.stdout
    assert readme.read_text() == readme_before


# What each benchmark's quick run must show beyond finite ratios (each runs once, above).
def check_shards(results):
    shard = json.loads((results / "shard_bench_quick.json").read_text())
    assert set(shard["mb_per_s"]) == {"ShardWriter (1 proc)", "ringfeed K=1", "ringfeed K=2",
                                      "ShardWriter, then fsynced"}
    seconds = shard["seconds"]  # the same ShardWriter runs, then their shards fsynced
    assert all(synced >= plain for plain, synced in zip(
        seconds["ShardWriter (1 proc)"], seconds["ShardWriter, then fsynced"], strict=True))
    assert all(v > 0 for v in shard["mb_per_s"].values()) and shard["files"] > 0
    assert shard["k1_k2_identical_shards"] is True


def check_pipeline(results):
    pipeline = json.loads((results / "pipeline_bench_quick.json").read_text())
    assert len(pipeline["ratios"]) == len(pipeline["rows"]) == 18
    assert len({r["metric"] for r in pipeline["rows"] if r["goal"]}) == 7
    assert all(run["cache_hit_rate"] == 0.5 for run in pipeline["data"]["cold_warm"]["runs"])


def check_decode(results):
    table = json.loads((results / "decode_bench_quick.json").read_text())["data"]["speed"]["table"]
    assert set(table) == {"JPEG 32px", "JPEG 64px", "PNG 32px", "PNG 64px"}
    for entry in table.values():  # ringfeed's decode is PIL's, pixel for pixel
        assert entry["ringfeed"]["max_diff"] == 0 and entry["PIL"]["max_diff"] == 0


def check_plan(results):
    plan = json.loads((results / "plan_bench_quick.json").read_text())
    points = plan["data"]["points"]  # every point in a process of its own
    assert not [p for p in points if "error" in p]
    assert plan["data"]["identical_to_old"] is True  # the old and new planners agree
    assert sum("same" in p for p in points) == 8  # 2 sizes x 2 world sizes x fresh/resume
    assert {p["kind"] for p in points} == {"fresh", "resume", "load"}
    assert len(plan["ratios"]) == 6
    assert {r["note"] for r in plan["rows"] if r["ratio"] is None} == {"full mode only"}


def check_startup(results):
    runs = json.loads((results / "startup_quick.json").read_text())["data"]["runs"]
    assert len(runs) == 2 and "10000" in runs  # the real shards' own count, and 10^4
    assert all(run["wall_s"] > 0 and run["bin_mb"] > 0 for run in runs.values())


def check_augment(results):
    augment = json.loads((results / "augment_bench_quick.json").read_text())
    data = augment["data"]
    # ImageNet-like: ~110 KB JPEGs cut from real photos, some of them grayscale
    assert 80 <= data["photos"]["mean_kb"] <= 140 and data["photos"]["grayscale"] > 0
    core = data["one_core"]["passes"]  # every contender went through every image
    for name in ("torchvision PIL", "ringfeed cold", "ringfeed cached"):
        assert core[name][0]["images"] == data["photos"]["images"], name
    for name in ("ringfeed cold", "ringfeed cached"):  # 3 channels, grayscale JPEGs too
        assert core[name][0]["shape"] == [64, 224, 224, 3], name
    assert core["ringfeed cached"][0]["cached_samples"] > 0  # served from the decoded cache
    for name, passes in data["two_cores"]["passes"].items():  # NCHW float, normalized
        assert passes[0]["shape"] == [32, 3, 224, 224], name
        assert passes[0]["dtype"] == "torch.float32", name
    goals = [r for r in augment["rows"] if r["goal"]]
    assert len(goals) == 5


GPU_FEED_CONTENDERS = {"in_memory", "webdataset", "ringfeed_off", "ringfeed_warm"}
GPU_FEED_S3_CONTENDERS = {"webdataset_s3", "ringfeed_s3_cold", "ringfeed_s3_warm"}


@pytest.mark.system
@pytest.mark.timeout(420)
def test_gpu_feed_bench_runs_on_cpu(tmp_path):
    """benchmarks/gpu_feed_bench.py is run by `make gpu-check` on GPU machines only; its CPU
    smoke mode keeps it from rotting here: every contender trains and gets a row, and the
    markdown table that gpu-check pastes into benchmarks/README.md is in the JSON."""
    from helpers import run, test_env

    out = tmp_path / "gpu.json"
    r = run([sys.executable, str(REPO / "benchmarks" / "gpu_feed_bench.py"), "--device", "cpu",
             "--quick", "--out", str(out)], timeout=400, env=test_env())

    assert r.returncode == 0 and not r.timed_out, r.output[-4000:]
    result = json.loads(out.read_text())
    assert result["device"]["type"] == "cpu" and result["machine"]["cpus"] >= 1
    rows = {row["contender"]: row for row in result["rows"]}
    assert set(rows) == GPU_FEED_CONTENDERS
    for row in rows.values():
        assert row["error"] is None, row
        assert math.isfinite(row["samples_per_s"]) and row["samples_per_s"] > 0, row
        assert row["ratio_to_in_memory"] > 0, row
    # the warm row's epochs really came from the decoded cache the first epoch wrote
    assert result["ringfeed_first_epoch_filling_cache"]["1"][0]["decoded_entries"] > 0
    assert rows["ringfeed_warm"]["pipeline_stats"]["cached_samples"] > 0
    assert rows["ringfeed_off"]["pipeline_stats"]["cached_samples"] == 0
    assert "samples_per_s" in result["small_model"]["plain"]
    ring = result["small_model"]["ringfeed"]  # needs Horovod: measured, or says why not
    assert ring.get("samples_per_s", 0) > 0 or ring["error"].startswith("not measured"), ring
    table = result["table_md"]
    assert "| contender |" in table and all(row["label"] in table for row in rows.values())
    assert table.strip() in r.stdout
    # MFU's numerator: resnet18's training FLOPs at 32x32, counted analytically (2 per
    # multiply-add; backward 2x forward, the first conv without an input gradient)
    assert result["flops"]["per_sample"] == pytest.approx(resnet18_training_flops(32), rel=0.05)
    assert result["flops"]["peak_tflops"] is None  # CPU: no peak, no MFU
    for row in rows.values():
        assert row["achieved_tflops"] == pytest.approx(
            row["samples_per_s"] * result["flops"]["per_sample"] / 1e12) and row["mfu"] is None
        # where each step's time went: the host's share of the wall time is inside it
        assert 0 < row["host_step_ms"] <= row["step_ms"] and row["gpu_span_ms"] is None, row
    assert result["compile"]["on"] is False  # compiled rows: on CUDA, or --compile on


@pytest.mark.system
@pytest.mark.timeout(300)
def test_gpu_feed_bench_reads_s3_on_cpu(tmp_path):
    """--s3 (issue 36): the same shards from moto's S3 server behind tests/s3_proxy.py (a child
    process): ringfeed cold (the first epoch downloads every shard into the empty cache) and
    warm (nothing more through the proxy), bare webdataset via fsspec, each with its ratio to
    the in-memory bound and the proxy's counters; the table lists them."""
    from helpers import run, test_env

    out = tmp_path / "gpu.json"
    r = run([sys.executable, str(REPO / "benchmarks" / "gpu_feed_bench.py"), "--device", "cpu",
             "--quick", "--s3", "--no-small-model", "--out", str(out)], timeout=280,
            env=test_env())

    assert r.returncode == 0 and not r.timed_out, r.output[-4000:]
    result = json.loads(out.read_text())
    rows = {row["contender"]: row for row in result["rows"]}
    assert set(rows) == GPU_FEED_CONTENDERS | GPU_FEED_S3_CONTENDERS
    assert result["s3"]["bandwidth_bytes_per_s"] == 50e6
    assert result["s3"]["connect_latency_s"] == 0.02
    uploaded = result["s3"]["bytes_uploaded"]
    shards = result["settings"]["shards"]
    for name in GPU_FEED_S3_CONTENDERS:
        row = rows[name]
        assert row["error"] is None, row
        assert row["workers"] == rows["ringfeed_off"]["workers"] == 1, row
        assert math.isfinite(row["samples_per_s"]) and row["samples_per_s"] > 0, row
        assert row["ratio_to_in_memory"] > 0, row
        assert row["label"] in result["table_md"]
    cold, warm = rows["ringfeed_s3_cold"], rows["ringfeed_s3_warm"]
    # cold: every shard came through the proxy once (tars, their indexes, the manifest)
    assert cold["proxy"]["requests"] >= shards and cold["proxy"]["bytes_down"] >= 0.5 * uploaded
    assert cold["shards_cached"] == shards and cold["epoch_wall_s"] > 0
    # warm: read from the shard cache, nothing through the proxy
    assert warm["proxy"]["bytes_down"] == 0 and warm["pipeline_stats"]["samples_read"] > 0
    assert rows["webdataset_s3"]["proxy"]["bytes_down"] > 0
    assert result["s3_proxy_total"]["bytes_down"] >= cold["proxy"]["bytes_down"]
    assert "S3 rows:" in result["table_md"] and result["table_md"].strip() in r.stdout


def resnet18_training_flops(side: int) -> float:
    """torchvision's resnet18 (10 classes) on side x side: conv1 7x7/2, max-pool /2, four
    stages of two BasicBlocks (64..512 channels, stride 2 and a 1x1 projection from stage 2)."""
    def conv(cin: int, cout: int, k: int, out: int) -> float:
        return 2.0 * cin * cout * k * k * out * out

    first = conv(3, 64, 7, side // 2)
    forward, size = first + 4 * conv(64, 64, 3, side // 4), side // 4
    for cin, cout in ((64, 128), (128, 256), (256, 512)):
        size //= 2
        forward += conv(cin, cout, 3, size) + 3 * conv(cout, cout, 3, size)
        forward += conv(cin, cout, 1, size)
    forward += 2.0 * 512 * 10
    return 3 * forward - first


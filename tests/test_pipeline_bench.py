"""Smoke test of benchmarks/pipeline_bench.py (--quick): it runs end to end and writes its
JSON and plot. The ratios themselves are measured by the full run, not asserted here."""

from __future__ import annotations

import importlib.util
import json

import pytest
from helpers import REPO

pytestmark = pytest.mark.system  # each test starts processes (tests/conftest.py)


def test_pipeline_bench_quick(tmp_path):
    spec = importlib.util.spec_from_file_location(
        "pipeline_bench", REPO / "benchmarks" / "pipeline_bench.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    result = bench.main(["--quick", "--out", str(tmp_path)])
    saved = json.loads((tmp_path / "pipeline_bench_quick.json").read_text())
    assert saved["ratios"] == result["ratios"]
    assert len(result["ratios"]) == len(result["rows"]) == 16
    assert all(r > 0 for r in result["ratios"].values())
    goals = {r["metric"] for r in result["rows"] if r["goal"]}
    assert len(goals) == 7
    assert all(run["cache_hit_rate"] == 0.5 for run in result["data"]["cold_warm"]["runs"])
    assert (tmp_path / "pipeline_bench_quick.png").stat().st_size > 0

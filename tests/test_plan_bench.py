"""Smoke test of benchmarks/plan_bench.py (--quick): every point runs in its own process and the
old and new planners agree on each; the JSON and plot are written. Timings are not asserted."""

from __future__ import annotations

import importlib.util
import json

import pytest
from helpers import REPO

pytestmark = pytest.mark.system  # every point runs in a process of its own


def test_plan_bench_quick(tmp_path):
    spec = importlib.util.spec_from_file_location("plan_bench",
                                                  REPO / "benchmarks" / "plan_bench.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    result = bench.main(["--quick", "--results", str(tmp_path)])
    saved = json.loads((tmp_path / "plan_bench_quick.json").read_text())
    assert saved["ratios"] == result["ratios"]
    points = result["data"]["points"]
    assert not [p for p in points if "error" in p]
    assert result["data"]["identical_to_old"] is True
    assert sum("same" in p for p in points) == 8  # 2 sizes x 2 world sizes x fresh/resume
    assert {p["kind"] for p in points} == {"fresh", "resume", "load"}
    assert all(r > 0 for r in result["ratios"].values()) and len(result["ratios"]) == 6
    assert {r["note"] for r in result["rows"] if r["ratio"] is None} == {"full mode only"}
    assert (tmp_path / "plan_bench_quick.png").stat().st_size > 0

"""Foundation: the build matrix, and real 2-rank Horovod runs (Gloo, MPI) that must not hang."""

from __future__ import annotations

import json
import shutil
import subprocess

import pytest
from helpers import BIN, REPO, horovodrun, ringfeed, run, test_env

pytestmark = pytest.mark.system  # each test starts processes (tests/conftest.py)

SMOKE = REPO / "tests" / "scripts" / "hvd_smoke.py"


@pytest.fixture(scope="module")
def info() -> dict:
    res = ringfeed("info", "--json", timeout=180)
    assert res.returncode == 0, res.output
    return json.loads(res.stdout)


def test_info_reports_both_frameworks_and_gloo(info):
    assert info["frameworks"]["torch"]["built"], info["frameworks"]["torch"]
    assert info["frameworks"]["tensorflow"]["built"], info["frameworks"]["tensorflow"]
    assert info["controllers"]["gloo"]
    assert info["versions"]["horovod"] == "0.28.1"
    assert info["versions"]["torch"].startswith("2.13.0")
    if shutil.which("mpicxx"):  # make setup builds MPI wherever an MPI compiler exists
        assert info["controllers"]["mpi"]


def test_info_human_output_lists_matrix(info):
    from ringfeed.train.info import render  # what `ringfeed info` prints without --json

    for line in ("[X] torch", "[X] tensorflow", "[X] Gloo"):
        assert line in render(info)


def _check_smoke(out_dir, size=2):
    ranks = [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(size)]
    base = [float(i) for i in range(4)]
    expect_sum = [sum(b + 10 * r for r in range(size)) for b in base]
    for r in ranks:
        assert r["size"] == size
        assert r["torch_allreduce_sum"] == expect_sum
        assert r["torch_allreduce_avg"] == [s / size for s in expect_sum]
        assert r["tf_allreduce_sum"] == expect_sum
        assert r["torch_broadcast"] == [1.0, 1.0, 1.0]
        assert r["tf_broadcast"] == [1.0, 1.0, 1.0]
    assert ranks[0]["torch_params"] == ranks[1]["torch_params"]


def test_two_rank_gloo_allreduce_and_broadcast(tmp_path):
    res = horovodrun(2, ["python", str(SMOKE), str(tmp_path)], timeout=180)
    assert res.returncode == 0, res.output[-3000:]
    _check_smoke(tmp_path)


def test_failing_rank_ends_job_instead_of_hanging(tmp_path):
    """Promise: Errors a restart cannot fix (train/RECOVERY.md)."""
    res = horovodrun(2, ["python", str(SMOKE), str(tmp_path), "1"], timeout=150)
    assert not res.timed_out, "horovodrun hung after a rank failed"
    assert res.returncode != 0
    assert "deliberate failure" in res.output


@pytest.mark.skipif(not shutil.which("mpirun"), reason="no mpirun (install openmpi-bin)")
def test_two_rank_mpirun(tmp_path, info):
    if not info["controllers"]["mpi"]:
        pytest.skip("Horovod was built without MPI (no mpicxx at setup time)")
    cmd = ["mpirun", "--allow-run-as-root", "--oversubscribe", "-np", "2",
           "-x", "PYTHONPATH", "-x", "OMP_NUM_THREADS", "-x", "TF_CPP_MIN_LOG_LEVEL",
           str(BIN / "python"), str(SMOKE), str(tmp_path)]
    res = run(cmd, timeout=180)
    assert res.returncode == 0, res.output[-3000:]
    _check_smoke(tmp_path)


def test_ruff_clean():
    res = subprocess.run([str(BIN / "ruff"), "check", str(REPO)], capture_output=True, text=True,
                         env=test_env(), timeout=120)
    assert res.returncode == 0, res.stdout[-4000:]

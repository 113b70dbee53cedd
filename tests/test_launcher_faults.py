"""Faults of the exit-code table under `ringfeed run -- horovodrun ...` and `ringfeed run --
mpirun ...`: the status a rank ends with reaches the caller (3 and 2 not relaunched, a killed
rank relaunched until the run finishes), and no rank or launcher prints a traceback. (A rank
killed and a hang under horovodrun: tests/test_fault.py, tests/test_hang.py.)"""

from __future__ import annotations

import shutil
import signal

import pytest
from fault_util import corrupt_one_sample, logged_step, wait_for, worker_processes
from helpers import BIN, run, test_env
from train_util import finish, start, toy_config, write_config, write_toy_shards

from ringfeed.errors import EXIT_CONFIG, EXIT_DIVERGED

pytestmark = [pytest.mark.system,
              pytest.mark.skipif(not shutil.which("mpirun"), reason="no mpirun (openmpi-bin)")]

RINGFEED = BIN / "ringfeed"
LAUNCHERS = {
    "horovodrun": [BIN / "horovodrun", "-np", "2", "-H", "localhost:2", "--gloo"],
    "mpirun": ["mpirun", "--allow-run-as-root", "--oversubscribe", "-np", "2", "-x", "PATH",
               "-x", "PYTHONPATH", "-x", "OMP_NUM_THREADS"],
}


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    return write_toy_shards(tmp_path_factory.mktemp("launcher_faults") / "shards", n_train=160,
                            n_val=8, per_shard=20)


def job(tmp_path, shards, name, **overrides):
    sections = {"train": {"max_steps": 20, "log_every": 2},
                "data": {"val_split": None, "num_workers": 1},
                "checkpoint": {"every_steps": 4, "keep": 2}}
    for section, values in overrides.items():
        sections[section] = {**sections.get(section, {}), **values}
    return write_config(tmp_path / f"{name}.yaml",
                        **toy_config(shards, tmp_path / name, **sections))


def supervised(launcher: str, cfg, restarts: int = 2) -> list:
    return [RINGFEED, "run", "--max-restarts", str(restarts), "--backoff", "0", "--",
            *LAUNCHERS[launcher], RINGFEED, "train", cfg]


@pytest.mark.parametrize("launcher", sorted(LAUNCHERS))
def test_a_diverged_run_ends_with_its_status_and_is_not_relaunched(tmp_path, shards, launcher):
    cfg = job(tmp_path, shards, "nan", optim={"lr": 1e30})
    res = run(supervised(launcher, cfg), timeout=240, env=test_env())
    assert res.returncode == EXIT_DIVERGED, res.output[-4000:]
    assert "ringfeed: error: loss is nan at step" in res.output
    assert "ringfeed run: job failed with an error a restart cannot fix (exit 3); not " \
           "restarting" in res.output
    assert "restart 1/" not in res.output and "Traceback" not in res.output, res.output[-4000:]


def test_bad_data_under_mpirun_ends_with_status_2_and_no_traceback(tmp_path):
    shards = write_toy_shards(tmp_path / "bad", n_train=160, n_val=8, per_shard=20)
    corrupt_one_sample(shards, "train-000003.tar", 5)
    cfg = job(tmp_path, shards, "corrupt", data={"on_error": "fail"})
    res = run(supervised("mpirun", cfg), timeout=240, env=test_env())
    assert res.returncode == EXIT_CONFIG, res.output[-4000:]
    assert "train-000003.tar" in res.output and "restart 1/" not in res.output
    assert "Traceback" not in res.output, res.output[-4000:]


def test_a_rank_killed_under_mpirun_is_relaunched_and_the_run_finishes(tmp_path, shards):
    cfg = job(tmp_path, shards, "killed")
    proc = start(supervised("mpirun", cfg), env=test_env())
    try:
        assert wait_for(lambda: logged_step(tmp_path / "killed") >= 8, timeout=240)
        (victim,) = worker_processes(proc.pid, OMPI_COMM_WORLD_RANK="1")
        victim.send_signal(signal.SIGKILL)
    finally:
        code, output = finish(proc, timeout=400)
    assert code == 0, output[-4000:]
    assert "ringfeed run: job failed (exit 137); restart 1/2" in output, output[-4000:]
    assert "ringfeed run: job finished after 1 restart(s)" in output
    assert "Traceback" not in output, output[-4000:]

"""The hang watchdog and the per-rank figures (issue 40): the rule that decides a hang (unit),
three watchdogs talking over their real UDP channel in one process (integration), and a real
3-rank job under `ringfeed run` with one rank stopped by SIGSTOP and another slowed on purpose
(system): the live ranks' stacks on disk, one line naming the stopped rank, exit 76, the
relaunch finishing the job, and the slow rank named in the log and in summary.json.

Promise: Hangs: the watchdog (train/RECOVERY.md)."""

from __future__ import annotations

import contextlib
import json
import re
import signal
import time

import psutil
import pytest
from fault_util import logged_step, wait_for, worker_processes
from helpers import BIN, test_env
from train_util import finish, start, toy_config, write_config, write_toy_shards
from watchdog_util import Job

from ringfeed.train.backends.horovod_env import apply_horovod_env, watchdog_env
from ringfeed.train.observe.ranks import RankTimes, per_rank, straggler
from ringfeed.train.resilience.watchdog import (
    EXIT_HANG,
    HANG_LINE,
    Limits,
    Seen,
    gloo_timeout_s,
    judge,
)

LIMITS = Limits(timeout=10.0, grace=100.0, data=50.0)


def seen(heard: float, step: int, phase: str, moved: float) -> Seen:
    return Seen(heard_at=heard, step=step, phase=phase, moved_at=moved)


# -- the rule (unit) ----------------------------------------------------------------------
def test_a_silent_rank_is_named_once_nothing_moved_for_the_timeout():
    table = {0: seen(100, 7, "step", 89), 1: seen(90, 6, "data", 89.5), 2: seen(100, 7, "step", 89)}
    assert judge(99, table, LIMITS, 0, beat_s=1, out_dir="out") is None  # stalled 9.5 s
    verdict = judge(100, table, LIMITS, 0, beat_s=1, out_dir="out")
    assert verdict is not None and verdict.named == verdict.silent == (1,)
    assert verdict.line.startswith(f"{HANG_LINE} rank 1 stopped responding (no heartbeat for "
                                   "10 s; last heard at step 7, waiting for data)")
    assert "; the others wait: ranks 0, 2 at step 8, in the step" in verdict.line
    assert "rank(s) 0, 2 in out/hang/" in verdict.line
    assert f"exit {EXIT_HANG} (restartable" in verdict.line and "\n" not in verdict.line


def test_a_live_rank_behind_the_others_is_named_with_its_place():
    table = {0: seen(100, 7, "step", 80), 1: seen(100, 6, "report", 80), 2: seen(100, 7, "step", 80)}
    verdict = judge(100, table, LIMITS, 0, beat_s=1, out_dir="out")
    assert verdict is not None and verdict.named == (1,) and verdict.silent == ()
    assert "rank 1 is stuck after step 6, reporting" in verdict.line


def test_every_rank_at_the_same_place_is_a_collective_that_never_completes():
    table = {r: seen(100, 7, "step", 80) for r in range(3)}
    verdict = judge(100, table, LIMITS, 0, beat_s=1, out_dir="out")
    assert verdict is not None and verdict.named == (0, 1, 2)
    assert "every rank is stuck at step 8, in the step" in verdict.line


@pytest.mark.parametrize(("step", "phase", "allowed"), [
    (5, "checkpoint", 110), (5, "validate", 110), (5, "start", 110), (5, "end", 110),
    (3, "step", 110), (3, "data", 110),  # the first step (first_step=3): tracing, compiling
    (5, "data", 60),  # a storage outage is the pipeline's to end (data.retry_budget_s)
    (5, "step", 10), (5, "report", 10),
])
def test_allowances_of_the_phase_the_rank_furthest_behind_is_in(step, phase, allowed):
    def table(now: float) -> dict[int, Seen]:  # both ranks beating; rank 0 behind rank 1
        return {0: seen(now, step, phase, 0), 1: seen(now, step + 1, "step", 0)}

    assert judge(allowed - 0.1, table(allowed - 0.1), LIMITS, 3, beat_s=1, out_dir="o") is None
    verdict = judge(allowed + 0.1, table(allowed + 0.1), LIMITS, 3, beat_s=1, out_dir="o")
    assert verdict is not None and verdict.named == (0,)


def test_a_silent_rank_gets_no_allowance_even_in_a_checkpoint():
    table = {0: seen(0, 5, "checkpoint", 0), 1: seen(10.5, 5, "checkpoint", 0)}
    verdict = judge(10.5, table, LIMITS, 0, beat_s=1, out_dir="o")
    assert verdict is not None and verdict.silent == (0,)


def test_a_rank_never_heard_from_is_not_judged():
    never = Seen(heard_at=0, step=0, phase="start", moved_at=0, heard=False)
    # rank 1 cannot reach the hub; rank 0 writes a long checkpoint: its grace holds
    table = {0: seen(50, 5, "checkpoint", 0), 1: never}
    assert judge(50, table, LIMITS, 0, beat_s=1, out_dir="o") is None
    verdict = judge(111, {0: seen(111, 5, "checkpoint", 0), 1: never}, LIMITS, 0, beat_s=1,
                    out_dir="o")
    assert verdict is not None and verdict.named == (0,)
    assert verdict.line.endswith("(rank(s) 1 never reached the hub: not judged)")


def test_watchdog_env_raises_gloos_timeout_past_the_watchdog_and_never_lowers_it():
    assert watchdog_env(None, {}) == {}
    assert watchdog_env(300, {}) == {"HOROVOD_GLOO_TIMEOUT_SECONDS": "360",
                                     "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": "0"}
    assert watchdog_env(5, {"HOROVOD_GLOO_TIMEOUT_SECONDS": "30"})[
        "HOROVOD_GLOO_TIMEOUT_SECONDS"] == str(gloo_timeout_s(5)) == "65"
    assert watchdog_env(5, {"HOROVOD_GLOO_TIMEOUT_SECONDS": "900"})[
        "HOROVOD_GLOO_TIMEOUT_SECONDS"] == "900"
    from ringfeed.train.config import HorovodSection

    environ = {"HOROVOD_GLOO_TIMEOUT_SECONDS": "30", "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": "20"}
    apply_horovod_env(HorovodSection(), environ, hang_timeout_s=300)
    assert environ == {"HOROVOD_GLOO_TIMEOUT_SECONDS": "360",
                       "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": "0"}


def test_the_straggler_is_the_rank_whose_own_work_exceeds_the_others_median_by_the_margin():
    assert straggler([0.01, 0.05, 0.012], step_s=0.1, margin=0.2) == (1, pytest.approx(0.039))
    assert straggler([0.01, 0.025, 0.012], step_s=0.1, margin=0.2) is None  # 13% of the step
    assert straggler([0.01, 0.05], step_s=0.1, margin=0.2) == (1, pytest.approx(0.04))
    assert straggler([0.5], step_s=1.0, margin=0.2) is None
    assert straggler([0.0, 0.0, 0.0], step_s=0.0, margin=0.2) is None


def test_per_rank_figures_travel_in_one_sum_each_rank_in_its_own_slots():
    ranks = [{"step_s": 0.1 + r, "busy_s": 0.01 * r} for r in range(3)]
    calls = []

    def total(slots: dict[str, float]) -> dict[str, float]:  # the sum over ranks, as Horovod
        calls.append(slots)
        everyone = [{f"{r}/{k}": (v if r == rank else 0.0) for r in range(3)
                     for k, v in ranks[rank].items()} for rank in range(3)]
        assert slots == everyone[len(calls) - 1]
        return {k: sum(e[k] for e in everyone) for k in slots}

    for rank in range(3):
        got = per_rank(ranks[rank], rank, 3, total)
        assert got == {"step_s": [0.1, 1.1, 2.1], "busy_s": [0.0, 0.01, 0.02]}
    assert len(calls) == 3  # one allreduce per rank


def test_rank_times_windows_and_percentiles():
    times = RankTimes()
    assert times.percentiles() == [0.0] * 9
    for i in range(1, 11):
        times.add(step_s=0.1 * i, data_wait_s=0.01, collective_s=0.05 * i)
    step, wait, busy, storage = times.take_window(storage_wait_s=2.0)
    assert step == pytest.approx(0.55) and wait == pytest.approx(0.01)
    assert busy == pytest.approx(0.275) and storage == 2.0
    assert times.take_window(storage_wait_s=2.5)[3] == pytest.approx(0.5)  # the window's share
    p = times.percentiles()
    assert p[:3] == pytest.approx([0.55, 0.91, 1.0]) and p[6:] == pytest.approx([0.275, 0.455, 0.5])


# -- three watchdogs over their real channel, in one process (integration) ------------------
@pytest.mark.integration
def test_a_rank_that_stops_beating_is_named_and_the_live_ranks_write_their_stacks(tmp_path):
    job = Job(tmp_path, Limits(timeout=1.0))
    try:
        for dog in job.dogs:
            dog.at(4, "step")
        time.sleep(2 * job.dogs[0].beat_s)  # the hub heard of step 5
        job.dogs[1]._stop.set()  # rank 1 falls silent, as a stopped process does
        assert wait_for(lambda: set(job.exits) == {0, 2}, timeout=15), job.exits
    finally:
        job.stop()
    assert job.exits == {0: EXIT_HANG, 2: EXIT_HANG}
    (line,) = job.lines
    assert line.startswith(f"{HANG_LINE} rank 1 stopped responding") and "at step 5" in line
    assert sorted(p.name for p in (tmp_path / "hang").iterdir()) == [
        "hang.json", "rank-0.stacks", "rank-2.stacks"]
    stacks = (tmp_path / "hang" / "rank-2.stacks").read_text()
    assert stacks.startswith("rank 2 of 3") and line in stacks and " in _beat" in stacks
    record = json.loads((tmp_path / "hang" / "hang.json").read_text())
    assert record["named"] == record["silent"] == [1] and record["line"] == line
    assert record["ranks"]["2"]["stacks_written"] and not record["ranks"]["1"]["stacks_written"]


@pytest.mark.integration
def test_rank_0_stopped_the_others_decide_alone(tmp_path):
    job = Job(tmp_path, Limits(timeout=1.0))
    try:
        for dog in job.dogs:
            dog.at(2, "data")
        time.sleep(2 * job.dogs[0].beat_s)
        job.dogs[0]._stop.set()  # the hub and rank 0's heartbeats gone (no goodbye)
        assert wait_for(lambda: set(job.exits) == {1, 2}, timeout=15), job.exits
    finally:
        job.stop()
    assert job.exits == {1: EXIT_HANG, 2: EXIT_HANG}
    assert len(job.lines) == 2 and all(
        re.match(rf"{HANG_LINE} rank 0 stopped responding .* seen by rank [12], itself stuck at "
                 "step 3, waiting for data", line) for line in job.lines)
    assert {p.name for p in (tmp_path / "hang").iterdir()} == {"rank-1.stacks", "rank-2.stacks"}


@pytest.mark.integration
def test_progress_and_the_checkpoint_grace_keep_the_watchdog_quiet(tmp_path):
    job = Job(tmp_path, Limits(timeout=0.6, grace=30.0))
    try:
        for step in range(1, 4):  # steps of 0.3 s: the job moves
            for dog in job.dogs:
                dog.at(step, "step")
            time.sleep(0.3)
        job.dogs[0].at(4, "checkpoint")  # rank 0 writes a checkpoint, the others wait
        for dog in job.dogs[1:]:
            dog.at(4, "checkpoint")
        time.sleep(1.5)  # 2.5 x hang_timeout_s
        assert job.exits == {} and not (tmp_path / "hang").exists()
    finally:
        job.stop()


# -- a real job: SIGSTOP one of 3 ranks, a slow rank, `ringfeed run` (system) ----------------
SLOW_RANK, STOPPED_RANK, SLOW_S = 2, 1, 0.03
HANG_TIMEOUT_S = 5


@pytest.mark.system
def test_a_stopped_rank_ends_the_job_with_its_name_and_ringfeed_run_finishes_it(tmp_path):
    """Promise: Hangs: the watchdog (train/RECOVERY.md)."""
    shards = write_toy_shards(tmp_path / "shards", n_train=360, n_val=12, per_shard=60)
    run_dir = tmp_path / "run"
    cfg = write_config(tmp_path / "run.yaml", **toy_config(
        shards, run_dir, data={"batch_size": 4, "val_split": None},
        train={"epochs": 2, "log_every": 5, "hang_timeout_s": HANG_TIMEOUT_S,
               "silent_timeout_s": HANG_TIMEOUT_S - 1},  # (it must be below hang_timeout_s)
        checkpoint={"every_steps": 10, "keep": 2},
        output={"dir": str(run_dir), "tensorboard": False}))
    job = start([BIN / "ringfeed", "run", "--max-restarts", "1", "--backoff", "0.2", "--",
                 BIN / "horovodrun", "-np", "3", "-H", "localhost:3", "--gloo",
                 BIN / "ringfeed", "train", cfg],
                env=test_env(RINGFEED_SLOW_RANK=f"{SLOW_RANK}:{SLOW_S}"))
    victim = None
    try:
        assert wait_for(lambda: logged_step(run_dir) >= 12, timeout=120), "never got there"
        (victim,) = worker_processes(job.pid, HOROVOD_RANK=str(STOPPED_RANK))
        victim.send_signal(signal.SIGSTOP)
        stopped_at = time.time()
        assert wait_for(lambda: (run_dir / "hang" / "hang.json").exists(), timeout=60)
        fired_s = (run_dir / "hang" / "hang.json").stat().st_mtime - stopped_at
        assert wait_for(lambda: not psutil.pid_exists(victim.pid)
                        or psutil.Process(victim.pid).status() == psutil.STATUS_ZOMBIE,
                        timeout=HANG_TIMEOUT_S + 30)  # the launcher killed it
        ended_s = time.time() - stopped_at
    finally:
        code, output = finish(job, timeout=240)
        if victim is not None:  # never left behind, whatever failed
            with contextlib.suppress(psutil.NoSuchProcess):
                victim.kill()
    print(f"[test_hang] STOP -> hang.json {fired_s:.1f} s, -> stopped rank gone "
          f"{ended_s:.1f} s")
    assert code == 0, output[-5000:]
    hang_lines = [line for line in output.splitlines() if HANG_LINE in line]
    assert len(hang_lines) == 1, hang_lines
    assert f"rank {STOPPED_RANK} stopped responding" in hang_lines[0]
    assert f"Process 0 exit with status code {EXIT_HANG}" in output
    # the ranks print nothing else: no traceback, no Horovod or Gloo error
    assert not re.search(r"\[\d\]<stderr>:.*(Traceback|Error|error)", output), output[-5000:]
    # horovodrun's traceback is one line, and the ranks' status (76) the job's
    assert "Traceback" not in output, output[-5000:]
    assert "ringfeed run: job failed (exit 76); restart 1/1" in output
    assert "ringfeed run: job finished after 1 restart(s)" in output
    hang = run_dir / "hang"
    assert {p.name for p in hang.iterdir()} == {"hang.json", "rank-0.stacks", "rank-2.stacks"}
    assert "File " in (hang / "rank-0.stacks").read_text()  # a Python stack
    assert json.loads((hang / "hang.json").read_text())["silent"] == [STOPPED_RANK]
    # the slowed rank: named in the log and in summary.json
    assert re.search(rf"straggler: rank {SLOW_RANK} is behind at step \d+", output), output[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    ranks = summary["ranks"]
    assert summary["status"] == "finished" and ranks["straggler"]["rank"] == SLOW_RANK
    named = ranks["named_in_log"]
    assert max(named, key=named.get) == str(SLOW_RANK), named
    for field in ("step_s", "data_wait_s", "busy_s"):
        assert all(len(ranks[field][p]) == 3 for p in ("p50", "p90", "max"))
    assert ranks["busy_s"]["p50"][SLOW_RANK] >= SLOW_S

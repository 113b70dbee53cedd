"""docker/slurm/requeue.sh, the time-limit handling of the sbatch scripts, run by bash.

tests/test_slurm.py runs both sbatch scripts on a real Slurm: the time-limit signal, SIGTERM to
horovodrun (launcher mode) and through `scancel --signal=TERM` to srun's steps (steps mode), the
checkpoint, `scontrol requeue` and the resumed run. What stays here are the timings a real run
cannot force, with `scancel` and `scontrol` as small stand-ins on PATH that record their
arguments (and, like Slurm, deliver scancel's signal to the job step): a step that has ended
before scancel returns, a step that never ends (the grace period), and a launcher's failing
exit status passed on.

Promise: Restarting a job: `ringfeed run` (train/RECOVERY.md).
"""
from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
from helpers import REPO

pytestmark = pytest.mark.system  # each test starts processes (tests/conftest.py)

REQUEUE_SH = REPO / "docker" / "slurm" / "requeue.sh"

# A rank: writes its pid, and on SIGTERM "checkpoints" (a file) and exits 143 like
# `ringfeed train`, or, with SAVE_EXITS=0, saves and hangs on (a stuck launcher).
STEP = """#!/bin/bash
echo $$ > "$WORK/step.pid"
trap 'echo saved > "$WORK/saved"; [ "$SAVE_EXITS" = 1 ] && exit 143' TERM
for _ in $(seq 600); do sleep 0.05; [ -n "${EXIT_WITH:-}" ] && exit "$EXIT_WITH"; done
"""
SCANCEL = """#!/bin/bash
echo "scancel $*" >> "$WORK/calls"
if [ "$1" = --signal=TERM ]; then
  pid=$(cat "$WORK/step.pid"); kill -TERM "$pid"
  # The hardest timing for the script: the step has ended before scancel returns.
  [ "$SAVE_EXITS" = 1 ] && while kill -0 "$pid" 2>/dev/null; do sleep 0.01; done
fi
exit 0
"""
SCONTROL = """#!/bin/bash
echo "scontrol $*" >> "$WORK/calls"
"""


def _start(tmp_path: Path, mode: str, **env: str) -> subprocess.Popen:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for name, text in (("step", STEP), ("scancel", SCANCEL), ("scontrol", SCONTROL)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    full_env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "WORK": str(tmp_path),
                "SLURM_JOB_ID": "4242", "SLURM_JOB_NUM_NODES": "2", "SAVE_EXITS": "1",
                "RINGFEED_SAVE_GRACE_S": "2", **env}
    script = f'source "{REQUEUE_SH}"; ringfeed_run_requeueable {mode} step'
    proc = subprocess.Popen(["bash", "-c", script], env=full_env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    deadline = time.monotonic() + 20
    while not (tmp_path / "step.pid").exists():
        assert time.monotonic() < deadline and proc.poll() is None, "the step did not start"
        time.sleep(0.05)
    return proc


def _finish(proc: subprocess.Popen) -> tuple[int, str]:
    try:
        out, _ = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    return proc.returncode, out


def _calls(tmp_path: Path) -> list[str]:
    calls = tmp_path / "calls"
    return calls.read_text().splitlines() if calls.exists() else []


def test_no_signal_returns_the_launchers_status_and_does_not_requeue(tmp_path: Path) -> None:
    proc = _start(tmp_path, "steps", EXIT_WITH="3")
    rc, out = _finish(proc)
    assert rc == 3, out
    assert _calls(tmp_path) == []


def test_steps_that_end_before_scancel_returns_still_requeue_with_their_status(
        tmp_path: Path) -> None:
    # The stand-in scancel returns only once the step has saved and exited: the script's
    # `wait` has then nothing left to wait for and must still requeue and report 143.
    proc = _start(tmp_path, "steps")
    proc.send_signal(signal.SIGUSR1)  # what `#SBATCH --signal=B:USR1@120` delivers
    rc, out = _finish(proc)
    assert (tmp_path / "saved").exists(), out
    assert _calls(tmp_path) == ["scancel --signal=TERM 4242", "scontrol requeue 4242"]
    assert rc == 143, out


def test_a_step_that_keeps_running_is_requeued_after_the_grace_period(tmp_path: Path) -> None:
    proc = _start(tmp_path, "steps", SAVE_EXITS="0")
    started = time.monotonic()
    proc.send_signal(signal.SIGUSR1)
    deadline = time.monotonic() + 20
    while "scontrol requeue 4242" not in _calls(tmp_path):
        assert time.monotonic() < deadline, f"no requeue: {_calls(tmp_path)}"
        time.sleep(0.1)
    # Only after the step had its grace period (RINGFEED_SAVE_GRACE_S=2) to finish.
    assert time.monotonic() - started >= 2
    assert (tmp_path / "saved").exists()
    os.killpg(proc.pid, signal.SIGKILL)  # what the requeue does to the job in Slurm
    proc.wait(timeout=10)


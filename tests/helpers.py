"""Shared test helpers: real subprocesses (horovodrun, the ringfeed CLI) with hard timeouts.

Every multi-process run goes through `run()`, which kills the whole process group when the
timeout expires, so a hung allreduce fails the test instead of hanging the suite.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent  # the venv's bin: horovodrun, ringfeed


@dataclass
class Result:
    returncode: int
    stdout: str
    stderr: str
    timed_out: bool

    @property
    def output(self) -> str:
        return self.stdout + self.stderr


def test_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        PYTHONPATH=str(REPO) + os.pathsep + env.get("PYTHONPATH", ""),
        PYTHONUNBUFFERED="1",
        TF_CPP_MIN_LOG_LEVEL="2",
        OMP_NUM_THREADS="1",  # 2 cores shared by all ranks
        CUDA_VISIBLE_DEVICES="",
        PATH=str(BIN) + os.pathsep + env.get("PATH", ""),
    )
    env.update(extra)
    return env


def run(cmd: list[str], timeout: float, cwd: str | Path | None = None,
        env: dict[str, str] | None = None, input: str | None = None) -> Result:
    """Run `cmd` in its own process group; on timeout kill the group and report it."""
    proc = subprocess.Popen(
        [str(c) for c in cmd], cwd=cwd, env=env or test_env(), text=True,
        stdin=subprocess.PIPE if input is not None else subprocess.DEVNULL,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
    )
    try:
        out, err = proc.communicate(input=input, timeout=timeout)
        return Result(proc.returncode, out, err, False)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        return Result(-9, out, err, True)


def horovodrun(np: int, args: list[str], timeout: float = 120, extra: list[str] | None = None,
               **kw) -> Result:
    """`horovodrun -np N -H localhost:N --gloo <args>` on this machine, bounded by `timeout`."""
    cmd = [str(BIN / "horovodrun"), "-np", str(np), "-H", f"localhost:{np}", "--gloo",
           *(extra or []), *args]
    return run(cmd, timeout=timeout, **kw)


def ringfeed(*args: str, timeout: float = 120, **kw) -> Result:
    return run([str(BIN / "ringfeed"), *args], timeout=timeout, **kw)


test_env.__test__ = False  # a helper, not a test (pytest collects test_* names it imports)


def read_timeline(path: Path) -> list[dict]:
    """Horovod's timeline (Chrome trace JSON), written as it goes: the array may be unclosed."""
    text = path.read_text().strip().rstrip(",")
    return json.loads(text if text.endswith("]") else text + "]")

"""One trial of `ringfeed tune`: a multi-rank training job launched as a subprocess, watched
through the metrics.jsonl it writes, stopped (its whole process tree) when pruned, interrupted or
out of time.

The trainer is not changed for tuning: rank 0 already appends one JSON line per log step and
per validation to `<output.dir>/metrics.jsonl`, flushed as it goes. A resumed run rewrites that
file (atomically, a new inode) without the records after its checkpoint, so the tail starts
over when the file is replaced or shrinks.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ringfeed.train.checkpoint.files import PREFIX, CheckpointError, list_checkpoints, verify
from ringfeed.train.observe.runfiles import METRICS_FILE, checkpoint_dir
from ringfeed.train.resilience.supervise import die_with_parent

POLL_S = 0.25
TERM_GRACE_S = 10.0  # SIGTERM first (srun cancels its step, ringfeed saves), then SIGKILL


class MetricsTail:
    """New complete JSON records of a growing metrics.jsonl, across rewrites of the file."""

    def __init__(self, path: Path):
        self.path = path
        self._inode: int | None = None
        self._offset = 0
        self._partial = b""

    def poll(self) -> list[dict[str, Any]]:
        try:
            st = self.path.stat()
        except FileNotFoundError:
            return []
        if st.st_ino != self._inode or st.st_size < self._offset:
            self._inode, self._offset, self._partial = st.st_ino, 0, b""
        if st.st_size == self._offset:
            return []
        try:
            with open(self.path, "rb") as f:
                f.seek(self._offset)
                data = f.read()
        except FileNotFoundError:
            return []
        self._offset += len(data)
        lines = (self._partial + data).split(b"\n")
        self._partial = lines.pop()  # an unfinished line waits for its end
        records = []
        for line in lines:
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if isinstance(record, dict):
                records.append(record)
        return records


@dataclass
class Outcome:
    returncode: int | None
    wall_s: float
    records: list[dict[str, Any]] = field(default_factory=list)
    stopped: str | None = None  # "pruned" | "interrupted" | "timeout"
    error: str | None = None


def owner() -> dict[str, Any]:
    """Who runs a trial: lets a later `ringfeed tune` on this host tell a dead worker's trials
    from a live one's."""
    import psutil

    me = psutil.Process()
    return {"host": socket.gethostname(), "pid": me.pid, "started": me.create_time()}


def process_alive(pid: int, started: float) -> bool:
    import psutil

    try:
        return abs(psutil.Process(pid).create_time() - started) < 1e-3
    except (psutil.NoSuchProcess, psutil.AccessDenied, ValueError):
        return False


def kill_tree(pid: int, started: float | None = None, grace_s: float = TERM_GRACE_S,
              proc: subprocess.Popen | None = None) -> None:
    """Stop a launched job: SIGTERM to its process group, then SIGKILL to the group and every
    descendant still there. Descendants are collected first because launchers put ranks in
    their own sessions (horovodrun's per-rank middlemen)."""
    import psutil

    if started is not None and not process_alive(pid, started):
        return
    try:
        descendants = psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        descendants = []
    _signal_group(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        done = proc.poll() is not None if proc is not None else not psutil.pid_exists(pid)
        if done and not any(_running(d) for d in descendants):
            break
        time.sleep(0.1)
    _signal_group(pid, signal.SIGKILL)
    for d in descendants:
        try:
            d.kill()
        except psutil.NoSuchProcess:
            pass
    if proc is not None:
        proc.wait()


def _running(p) -> bool:
    import psutil

    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def run_job(cmd: list[str], log_path: Path, metrics_path: Path, env: dict[str, str],
            on_start: Callable[[subprocess.Popen], None],
            on_records: Callable[[list[dict[str, Any]]], bool],
            stop: threading.Event, timeout_s: float | None = None) -> Outcome:
    """Run `cmd` (its output to `log_path`), passing each batch of new metric records to
    `on_records` (True = prune it). Returns when the job exits or has been stopped."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    tail = MetricsTail(metrics_path)
    records: list[dict[str, Any]] = []
    t0 = time.monotonic()
    with open(log_path, "ab") as log:
        log.write(f"$ {' '.join(cmd)}\n".encode())
        log.flush()
        try:
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, start_new_session=True,
                                    env={**os.environ, **env},
                                    preexec_fn=functools.partial(die_with_parent, os.getpid()))
        except OSError as e:
            return Outcome(127, time.monotonic() - t0, error=f"cannot launch {cmd[0]}: {e}")
    on_start(proc)
    stopped = None
    while True:
        exited = proc.poll() is not None
        new = tail.poll()  # (read once more after the exit: the last records)
        records.extend(new)
        if new and on_records(new) and not exited:
            stopped = "pruned"
        elif stop.is_set() and not exited:
            stopped = "interrupted"
        elif timeout_s is not None and time.monotonic() - t0 > timeout_s and not exited:
            stopped = "timeout"
        if stopped:
            kill_tree(proc.pid, proc=proc)
            break
        if exited:
            break
        time.sleep(POLL_S)
    outcome = Outcome(proc.returncode, time.monotonic() - t0, records, stopped)
    if stopped is None and proc.returncode != 0:
        outcome.error = error_line(log_path)
    return outcome


def error_line(log_path: Path) -> str:
    """The line of a job's log that says why it failed: ringfeed's own one-line error, else the
    last exception line of a traceback, else the last line."""
    try:
        lines = [_strip_rank(x) for x in log_path.read_text(errors="replace").splitlines()]
    except OSError:
        return "no log"
    lines = [x for x in lines if x.strip()]
    for marker in ("ringfeed: error:", "ringfeed: not restartable:"):
        hits = [x for x in lines if marker in x]
        if hits:
            return hits[-1][hits[-1].index(marker):][:300]
    errors = [x for x in lines if not x.startswith(" ") and
              (x.split(":")[0].endswith(("Error", "Exception", "Interrupt")))]
    return (errors[0] if errors else lines[-1] if lines else "no output")[:300]


def _strip_rank(line: str) -> str:
    # horovodrun prefixes every rank's line with `[r]<stdout>:` / `[r]<stderr>:`
    if line.startswith("[") and "]<std" in line[:12]:
        return line.split(">:", 1)[-1]
    return line


def metric_value(records: list[dict[str, Any]], metric: str,
                 at_step: int | None = None) -> float | None:
    """The last value of `metric` (at `at_step`, if given)."""
    values = [r[metric] for r in records if metric in r and isinstance(r[metric], (int, float))
              and (at_step is None or r.get("step") == at_step)]
    return float(values[-1]) if values else None


def read_records(metrics_path: Path) -> list[dict[str, Any]]:
    return MetricsTail(metrics_path).poll()


def newest_checkpoint(run_dir: Path, step: int | None = None) -> Path | None:
    """The newest complete checkpoint of a run dir (the one at `step`, if given)."""
    for path in reversed(list_checkpoints(Path(checkpoint_dir(run_dir)))):
        if step is not None and int(path.name[len(PREFIX):]) != step:
            continue
        try:
            verify(path)
        except CheckpointError:
            continue
        return path
    return None


def adopt_checkpoint(source: Path, run_dir: Path, metrics_from: Path | None = None) -> Path:
    """Make checkpoint `source` the one `--resume auto` finds in `run_dir`: the run dir's own
    checkpoints are removed and `source` is copied in under a temporary name the trainer
    cleans up, then renamed (a copy killed halfway is never taken for a checkpoint). With
    `metrics_from`, that run's metrics.jsonl comes along, so the run's history is the history
    of the weights it continues (the trainer drops records after the checkpoint's step)."""
    ckpt_dir = Path(checkpoint_dir(run_dir))
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    for old in list_checkpoints(ckpt_dir):
        shutil.rmtree(old)
    tmp = ckpt_dir / f".{source.name}.tmp-tune"
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(source, tmp)
    final = ckpt_dir / source.name
    os.replace(tmp, final)
    if metrics_from is not None and metrics_from.is_file():
        staged = run_dir / f"{METRICS_FILE}.tmp-tune"
        shutil.copyfile(metrics_from, staged)
        os.replace(staged, run_dir / METRICS_FILE)
    return final

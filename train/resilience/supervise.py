"""`ringfeed run -- <launcher ...>`: relaunch a non-elastic job after a crash, from its checkpoint.

    ringfeed run --max-restarts 3 -- horovodrun -np 8 -H a:4,b:4 ringfeed train cfg.yaml

If the job exits non-zero, it is started again with `--resume auto` added to its `ringfeed train`
command (replacing any --resume; so it continues from the newest complete checkpoint), up to
--max-restarts times with exponential backoff; RINGFEED_RESTART_COUNT tells the job which
attempt it is (the trainer reports it). Which endings are relaunched is ringfeed/errors.py's
exit-code table (`relaunches`), decided from the job's exit code and the lines it printed
(horovodrun does not pass a rank's exit code on: `LauncherOutput` turns its traceback into one
line and takes the first failed rank's status from it; a rank's line counts as much):
errors a restart cannot fix stop it at once (bad config or data, a NaN loss, a checkpoint or
output that cannot be written, the user's code failing before the first step); a crash, a lost
rank, storage that stayed unreachable for the retry budget (exit 75) and a hang the watchdog
ended (`ringfeed: hang:`, exit 76) are relaunched.
SIGTERM/SIGINT to the supervisor are forwarded to the job and end supervision (a scheduler asked
the job to stop). The job dies with the supervisor: it gets SIGTERM if the supervisor is killed
(even by SIGKILL), so no launcher or rank is left running without it.
"""

from __future__ import annotations

import argparse
import functools
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from typing import IO

from ringfeed.errors import markers_in, relaunches

RESTART_ENV = "RINGFEED_RESTART_COUNT"


def with_resume_auto(cmd: list[str]) -> list[str]:
    """The launcher command with its `ringfeed train` part resuming from the newest complete
    checkpoint: `--resume auto` replaces any --resume it had (a restart must not start over,
    nor reload a fixed older checkpoint)."""
    if not any(a.endswith("ringfeed") for a in cmd) or "train" not in cmd:
        return list(cmd)
    kept: list[str] = []
    skip = False
    for arg in cmd:
        if skip:
            skip = False
        elif arg == "--resume":
            skip = True
        elif not arg.startswith("--resume="):
            kept.append(arg)
    return [*kept, "--resume", "auto"]


class Supervisor:
    def __init__(self, cmd: list[str], max_restarts: int, backoff: float, backoff_max: float):
        self.cmd = cmd
        self.max_restarts = max_restarts
        self.backoff = backoff
        self.backoff_max = backoff_max
        self.proc: subprocess.Popen | None = None
        self.stopping = False

    def _forward(self, signum: int, _frame) -> None:
        self.stopping = True
        if self.proc and self.proc.poll() is None:
            os.killpg(self.proc.pid, signum)

    def _attempt(self, cmd: list[str], restarts: int) -> tuple[int, set[str]]:
        """Run once, streaming output; return (exit code, the exit-code table's lines seen)."""
        env = dict(os.environ, **{RESTART_ENV: str(restarts)})
        try:
            self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                         text=True, bufsize=1, env=env, start_new_session=True,
                                         preexec_fn=functools.partial(die_with_parent,
                                                                      os.getpid()))
        except OSError as e:  # no such launcher, not executable: no relaunch can help
            from ringfeed.errors import UserError

            raise UserError(f"ringfeed run: cannot start {cmd[0]!r} ({e.strerror}; check the "
                            "launcher's name and PATH)") from None
        markers: set[str] = set()
        assert self.proc.stdout is not None
        output = LauncherOutput(sys.stdout)
        for line in self.proc.stdout:
            output.feed(line)
            markers |= markers_in(line)
        output.close()
        code = self.proc.wait()
        if code == 1 and output.first_status:  # horovodrun's own 1: the rank's status instead
            code = output.first_status
        # a job killed by signal N: the status a shell gives it (128 + N), which is what this
        # process exits with (Popen's -N would become 256 - N)
        return (128 - code if code < 0 else code), markers

    def run(self) -> int:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._forward)
        cmd, restarts, delay = self.cmd, 0, self.backoff
        while True:
            code, markers = self._attempt(cmd, restarts)
            if code == 0:
                print(f"ringfeed run: job finished after {restarts} restart(s)", flush=True)
                return 0
            if self.stopping:
                print(f"ringfeed run: stopped by signal; job exited {code}", flush=True)
                return code
            if not relaunches(code, markers):
                print(f"ringfeed run: job failed with an error a restart cannot fix (exit {code}); "
                      "not restarting", flush=True)
                return code
            if restarts >= self.max_restarts:
                print(f"ringfeed run: job failed (exit {code}); giving up after {restarts} "
                      "restart(s)", flush=True)
                return code
            restarts += 1
            cmd = with_resume_auto(self.cmd)
            print(f"ringfeed run: job failed (exit {code}); restart {restarts}/{self.max_restarts} "
                  f"in {delay:.0f}s with --resume auto", flush=True)
            time.sleep(delay)
            delay = min(delay * 2, self.backoff_max)


class LauncherOutput:
    """A job's output passed on line by line, except horovodrun's own traceback when a rank
    fails (`RuntimeError: Horovod detected that one or more processes exited with non-zero
    status ...`, 20 lines, exit 1): one line naming the rank that ended first and its status,
    which `first_status` keeps for the job's exit code (so 75, 76 or 2 reach Slurm and a
    wrapper, not horovodrun's 1). A traceback without a launcher's rank prefix is held until
    its last line, then passed on as it was unless it is that one (a rank's own traceback under
    a plain launch is the user's to see)."""

    HOROVODRUN_FAILED = "RuntimeError: Horovod detected that one or more processes exited"

    def __init__(self, out: IO[str]) -> None:
        self.out = out
        self.held: list[str] = []
        self.replacing = False  # inside horovodrun's "The first process to do so was:" lines
        self.first_rank: str | None = None
        self.first_status: int | None = None

    def feed(self, line: str) -> None:
        if self.replacing:
            key, _, value = line.partition(":")
            if key.strip() == "Process name":
                self.first_rank = value.strip()
                return
            if key.strip() == "Exit code":
                status = value.strip()
                self.first_status = int(status) if status.isdigit() and 0 < int(status) < 256 \
                    else None
                self._replaced(status)
                return
            self._replaced("unknown")  # horovodrun's message ended otherwise than expected
        if not self.held and line.startswith("Traceback (most recent call last):"):
            self.held = [line]
            return
        if self.held:
            self.held.append(line)
            if line[:1].isspace():  # a frame of the traceback
                return
            if line.startswith(self.HOROVODRUN_FAILED):
                self.held, self.replacing = [], True
                return
            line, self.held = "".join(self.held), []
        self._write(line)

    def close(self) -> None:
        if self.replacing:
            self._replaced("unknown")
        if self.held:
            self._write("".join(self.held))
            self.held = []

    def _replaced(self, status: str) -> None:
        """The one line in place of horovodrun's traceback."""
        self._write(f"ringfeed run: horovodrun ended the job: rank {self.first_rank or '?'} "
                    f"exited first, with status {status}\n")
        self.replacing = False

    def _write(self, text: str) -> None:
        self.out.write(text)
        self.out.flush()


def die_with_parent(parent: int) -> None:
    """In a job's process, before it execs (Popen's preexec_fn): SIGTERM when process `parent`
    (ringfeed run, ringfeed tune) dies, even by SIGKILL (Linux's PR_SET_PDEATHSIG), which a
    launcher passes on to its ranks and a trainer answers by saving and stopping. Jobs run in
    their own session (out of a terminal's signals), so without it they would run on, alone."""
    import ctypes

    pr_set_pdeathsig = 1
    try:
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM, 0, 0, 0)
    except (OSError, AttributeError):  # not Linux: the job outlives a killed supervisor
        return
    if os.getppid() != parent:  # the supervisor died before the death signal was armed
        os.kill(os.getpid(), signal.SIGTERM)


def run(args: argparse.Namespace) -> int:
    cmd = list(args.cmd)
    if cmd and cmd[0] == "--":
        cmd = cmd[1:]
    if not cmd:
        from ringfeed.errors import UserError

        raise UserError("ringfeed run: no command given (usage: ringfeed run -- horovodrun ... ringfeed train CFG)")
    return Supervisor(cmd, args.max_restarts, args.backoff, args.backoff_max).run()


def _at_least_zero(kind: type) -> Callable[[str], int | float]:
    """An argparse type: a number of `kind` >= 0 (argparse's one-line error otherwise)."""

    def parse(text: str) -> int | float:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        if value < 0:
            raise argparse.ArgumentTypeError(f"must be 0 or more, got {text}")
        return value

    return parse


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("run", help="supervise a launch: relaunch with --resume auto after a crash")
    p.add_argument("--max-restarts", type=_at_least_zero(int), default=3,
                   help="relaunches before giving up (%(default)d)")
    p.add_argument("--backoff", type=_at_least_zero(float), default=5.0,
                   help="first wait before a relaunch, s (%(default)g)")
    p.add_argument("--backoff-max", type=_at_least_zero(float), default=300.0,
                   help="longest wait, s (%(default)g)")
    p.add_argument("cmd", nargs=argparse.REMAINDER, help="-- LAUNCHER ARGS...")
    p.set_defaults(func=run)

"""`ringfeed run` (train/resilience/supervise.py): which endings are relaunched, the restart
accounting (count, --resume auto, backoff), and what the supervisor reads from the launcher's
output. The launcher is scripted here (a Supervisor whose `_attempt` replays endings) except in
the two system tests, which run `sh` as the launcher; real horovodrun jobs under `ringfeed run`
are in test_fault.py and test_promises.py."""

from __future__ import annotations

import argparse
import signal
import sys
from types import SimpleNamespace

import pytest

from ringfeed.errors import EXIT_HANG, EXIT_STORAGE_UNAVAILABLE, USER_CODE_LINE, UserError
from ringfeed.train.resilience import supervise
from ringfeed.train.resilience.supervise import RESTART_ENV, Supervisor, with_resume_auto

JOB = ["horovodrun", "-np", "2", "ringfeed", "train", "cfg.yaml"]


# -- the command a relaunch runs --------------------------------------------------------------
@pytest.mark.parametrize("cmd, expected", [
    (JOB, [*JOB, "--resume", "auto"]),
    ([*JOB, "--resume", "/ckpt/ckpt-000000010"], [*JOB, "--resume", "auto"]),
    ([*JOB, "--resume=none", "--set", "a=1"], [*JOB, "--set", "a=1", "--resume", "auto"]),
    (["srun", "/venv/bin/ringfeed", "train", "c.yaml"],
     ["srun", "/venv/bin/ringfeed", "train", "c.yaml", "--resume", "auto"]),
])
def test_a_relaunch_resumes_from_the_newest_checkpoint_whatever_resume_it_had(cmd, expected):
    assert with_resume_auto(cmd) == expected


@pytest.mark.parametrize("cmd", [["sh", "-c", "exit 1"], ["ringfeed", "shard", "a", "b"],
                                 ["python", "train.py", "--resume", "x"]])
def test_a_command_without_ringfeed_train_is_relaunched_unchanged(cmd):
    assert with_resume_auto(cmd) == cmd


# -- the restart loop, with scripted endings --------------------------------------------------
class Scripted(Supervisor):
    """A Supervisor whose launches end as `endings` say: (exit code, lines the job printed)."""

    def __init__(self, endings: list[tuple[int, list[str]]], max_restarts: int = 3,
                 backoff: float = 5.0, backoff_max: float = 300.0, stop_at: int | None = None):
        super().__init__(list(JOB), max_restarts, backoff, backoff_max)
        self.endings = list(endings)
        self.launched: list[tuple[list[str], int]] = []
        self.stop_at = stop_at

    def _attempt(self, cmd: list[str], restarts: int) -> tuple[int, set[str]]:
        self.launched.append((cmd, restarts))
        if self.stop_at == len(self.launched):  # SIGTERM reaches the supervisor meanwhile
            self._forward(signal.SIGTERM, None)
        code, lines = self.endings.pop(0)
        markers: set[str] = set()
        for line in lines:
            markers |= supervise.markers_in(line)
        return code, markers


@pytest.fixture
def waits(monkeypatch) -> list[float]:
    """The backoff sleeps the supervisor asks for (none is slept); its signal handlers are
    put back after the test."""
    slept: list[float] = []
    monkeypatch.setattr(supervise, "time", SimpleNamespace(sleep=slept.append))
    saved = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    yield slept
    for s, handler in saved.items():
        signal.signal(s, handler)


def test_a_crash_is_relaunched_with_resume_auto_and_the_restart_count(waits, capsys):
    sup = Scripted([(1, ["Traceback ..."]), (1, []), (0, [])])
    assert sup.run() == 0
    assert sup.launched == [(JOB, 0), ([*JOB, "--resume", "auto"], 1),
                            ([*JOB, "--resume", "auto"], 2)]
    assert waits == [5.0, 10.0]
    assert "job finished after 2 restart(s)" in capsys.readouterr().out


def test_backoff_doubles_up_to_its_cap_and_the_last_failure_is_the_exit_code(waits, capsys):
    sup = Scripted([(1, [])] * 4 + [(EXIT_STORAGE_UNAVAILABLE, [])], max_restarts=4,
                   backoff=2.0, backoff_max=5.0)
    assert sup.run() == EXIT_STORAGE_UNAVAILABLE
    assert waits == [2.0, 4.0, 5.0, 5.0]
    assert [r for _, r in sup.launched] == [0, 1, 2, 3, 4]
    assert "giving up after 4 restart(s)" in capsys.readouterr().out


def test_no_restarts_allowed_means_one_launch(waits):
    sup = Scripted([(1, [])], max_restarts=0)
    assert sup.run() == 1 and len(sup.launched) == 1 and waits == []


@pytest.mark.parametrize("code, lines", [
    (2, []),  # bad config or data
    (3, []),  # NaN loss
    (4, []),  # a checkpoint cannot be written
    (1, ["[1]<stderr>:ringfeed: error: data.train: no manifest.json"]),  # rank's line, code 1
    (1, [f"[0,1]<stderr>:{USER_CODE_LINE} (model.name=m:f): ValueError: x"]),
    (130, ["ringfeed: interrupted"]),
])
def test_an_error_a_restart_cannot_fix_stops_at_once(waits, capsys, code, lines):
    sup = Scripted([(code, lines)])
    assert sup.run() == code
    assert len(sup.launched) == 1 and waits == []
    assert "a restart cannot fix" in capsys.readouterr().out


@pytest.mark.parametrize("code, lines", [
    (1, [f"[1]<stderr>:{USER_CODE_LINE} at step 12 (train.loss=m:f): KeyError: 'y'"]),
    (EXIT_STORAGE_UNAVAILABLE, ["ringfeed: storage unavailable: s3://b/x: timed out"]),
    (EXIT_HANG, ["ringfeed: hang: rank 1 made no progress for 300 s"]),
    (137, []),  # a rank killed by SIGKILL (out of memory): not in the table, a crash
    (143, []),  # preempted
])
def test_crashes_hangs_lost_storage_and_preemption_are_relaunched(waits, code, lines):
    sup = Scripted([(code, lines), (0, [])])
    assert sup.run() == 0 and len(sup.launched) == 2


def test_a_signal_to_the_supervisor_ends_supervision_with_the_jobs_status(waits, capsys):
    sup = Scripted([(1, []), (143, [])], stop_at=2)
    assert sup.run() == 143
    assert len(sup.launched) == 2 and waits == [5.0]
    assert "stopped by signal; job exited 143" in capsys.readouterr().out


# -- the command line -------------------------------------------------------------------------
def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="ringfeed")
    supervise.register(parser.add_subparsers())
    return parser.parse_args(["run", *argv])


def test_the_options_and_the_job_command_are_parsed():
    args = parse("--max-restarts", "0", "--backoff", "0.5", "--", *JOB, "--set", "x=1")
    assert (args.max_restarts, args.backoff, args.backoff_max) == (0, 0.5, 300.0)
    assert args.cmd == ["--", *JOB, "--set", "x=1"]


@pytest.mark.parametrize("argv", [["--max-restarts", "-1"], ["--backoff", "soon"],
                                  ["--backoff-max", "-3"]])
def test_a_negative_or_non_numeric_option_is_argparses_one_line_error(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        parse(*argv, "--", "sh")
    assert exc.value.code == 2
    assert argv[0] in capsys.readouterr().err


def test_no_job_command_is_a_user_error():
    with pytest.raises(UserError, match="no command given"):
        supervise.run(parse("--"))


# -- the launcher's output and status, from a real process ------------------------------------
@pytest.mark.system
def test_the_launchers_lines_are_streamed_and_read_for_the_tables_lines(capsys):
    script = (f'echo "restart ${{{RESTART_ENV}}}"; '
              'echo "[1]<stderr>:ringfeed: error: data.train: bad"; kill -TERM $$')
    code, markers = Supervisor([], 0, 0, 0)._attempt(["sh", "-c", script], 2)
    assert code == 128 + signal.SIGTERM  # a shell's status, not Popen's -15
    assert markers == {"ringfeed: error:"}
    out = capsys.readouterr().out
    assert "restart 2\n" in out and "[1]<stderr>:ringfeed: error: data.train: bad" in out


@pytest.mark.system
def test_a_launcher_that_cannot_start_is_one_line_not_a_relaunch():
    with pytest.raises(UserError, match="cannot start 'no-such-launcher-x'"):
        Supervisor([], 3, 0, 0)._attempt(["no-such-launcher-x", sys.executable], 0)


# -- the launcher's own traceback --------------------------------------------------------------
HOROVODRUN_TAIL = """\
[1]<stderr>:ringfeed: hang: rank 0 stopped responding
Traceback (most recent call last):
  File "/venv/bin/horovodrun", line 8, in <module>
    sys.exit(run_commandline())
             ^^^^^^^^^^^^^^^^^
  File "/venv/lib/python3.11/site-packages/horovod/runner/gloo_run.py", line 284, in launch_gloo
    raise RuntimeError('Horovod detected that one or more processes exited with non-zero '
RuntimeError: Horovod detected that one or more processes exited with non-zero status, thus \
causing the job to be terminated. The first process to do so was:
Process name: 1
Exit code: 76
"""


def test_horovodruns_traceback_becomes_one_line_and_the_ranks_status_the_jobs():
    import io

    out = io.StringIO()
    output = supervise.LauncherOutput(out)
    for line in HOROVODRUN_TAIL.splitlines(keepends=True):
        output.feed(line)
    output.close()
    assert out.getvalue() == ("[1]<stderr>:ringfeed: hang: rank 0 stopped responding\n"
                              "ringfeed run: horovodrun ended the job: rank 1 exited first, "
                              "with status 76\n")
    assert output.first_status == EXIT_HANG


def test_horovodruns_traceback_cut_short_still_leaves_its_line():
    import io

    cut = HOROVODRUN_TAIL.split("Process name")[0]  # the job's output ends before the rank
    out = io.StringIO()
    output = supervise.LauncherOutput(out)
    for line in cut.splitlines(keepends=True):
        output.feed(line)
    output.close()
    assert out.getvalue().endswith("ringfeed run: horovodrun ended the job: rank ? exited "
                                   "first, with status unknown\n")
    assert "Traceback" not in out.getvalue() and output.first_status is None


def test_any_other_traceback_passes_as_it_was():
    import io

    crash = ('Traceback (most recent call last):\n  File "train.py", line 3, in <module>\n'
             '    main()\nValueError: a bug\nnext line\n')
    chained = crash.replace("next line\n", "\nDuring handling of the above exception, another "
                                           "exception occurred:\n\n") + crash
    for text in (crash, chained, crash[:60]):  # the last: a job that died mid-traceback
        out = io.StringIO()
        output = supervise.LauncherOutput(out)
        for line in text.splitlines(keepends=True):
            output.feed(line)
        output.close()
        assert out.getvalue() == text and output.first_status is None

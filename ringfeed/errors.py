"""What a ringfeed command's failure looks like: one line, `ringfeed: <label>: <what> (<what to
do>)`, and an exit code that says whether a restart can help.

`EXIT_STATUSES` is the one table of exit codes: the CLI exits with them (train/cli.py's
`exit_status`, the one place an exception becomes an exit code), `ringfeed run` decides from
them what it relaunches (`relaunches`), and train/RECOVERY.md's exit-code table is checked
against it by a test. This module imports nothing of ringfeed: every other one may import it.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

EXIT_CRASH = 1
EXIT_CONFIG = 2
EXIT_DIVERGED = 3
EXIT_WRITE = 4
EXIT_STORAGE_UNAVAILABLE = 75  # sysexits.h EX_TEMPFAIL: "try again later"
EXIT_HANG = 76  # the hang watchdog (train/resilience/watchdog.py) ended a job no rank moved in
EXIT_INTERRUPTED = 130  # 128 + SIGINT
EXIT_PREEMPTED = 143  # 128 + SIGTERM: what a shell reports for a job ended by SIGTERM

# The line that says the user's code raised; before the process's first step it is followed by
# " (" (and not relaunched: the relaunch would run the same code on the same state), after it
# by " at step N (".
USER_CODE_LINE = "ringfeed: error in your code"


@dataclass(frozen=True)
class ExitStatus:
    """One row of the exit-code table: a process's exit code, the line it prints last on stderr
    ("" when it prints none of its own), what it means, and whether `ringfeed run` relaunches a
    job that ends so."""

    code: int
    line: str
    meaning: str
    relaunch: bool


EXIT_STATUSES: tuple[ExitStatus, ...] = (
    ExitStatus(0, "", "finished", False),
    ExitStatus(EXIT_CRASH, f"{USER_CODE_LINE} (", "your code (model.name, train.loss, "
               "train.metrics, data.decode, data.transform) raised before this process's first step: a relaunch would run "
               "it again on the same state; its traceback comes first", False),
    ExitStatus(EXIT_CRASH, f"{USER_CODE_LINE} at step", "your code raised during training; its "
               "traceback comes first", True),
    ExitStatus(EXIT_CRASH, "ringfeed: lost rank:", "another rank of the job died or left, and "
               "Horovod shut down under this one (the launcher names the rank that ended "
               "first)", True),
    ExitStatus(EXIT_CRASH, "", "a crash: a rank killed, or a bug in ringfeed (a traceback)",
               True),
    ExitStatus(EXIT_CONFIG, "ringfeed: error:", "bad config, arguments or data", False),
    ExitStatus(EXIT_DIVERGED, "ringfeed: error:", "the loss became NaN/inf", False),
    ExitStatus(EXIT_WRITE, "ringfeed: error:", "a checkpoint or a file under output.dir cannot be "
               "written (disk full, read-only, not a directory)", False),
    ExitStatus(EXIT_STORAGE_UNAVAILABLE, "ringfeed: storage unavailable:", "object storage "
               "failed for the whole data.retry_budget_s", True),
    ExitStatus(EXIT_HANG, "ringfeed: hang:", "no rank made progress for train.hang_timeout_s, "
               "a rank was silent for train.silent_timeout_s, or a process did not end (the "
               "line names the rank(s) and where; Python stacks are in <output.dir>/hang/)",
               True),
    ExitStatus(EXIT_INTERRUPTED, "ringfeed: interrupted", "SIGINT (Ctrl-C)", False),
    ExitStatus(EXIT_PREEMPTED, "", "stopped by SIGTERM (after saving a checkpoint once "
               "training started)", True),
)


def exit_codes_help() -> str:
    """The table as one paragraph of a command's help (`ringfeed train --help`): each code with
    what it means, and which of them `ringfeed run` relaunches."""
    meanings: dict[int, list[str]] = {}
    for s in EXIT_STATUSES:
        meanings.setdefault(s.code, []).append(s.meaning + ("*" if s.relaunch else ""))
    return "Exit codes (*: `ringfeed run` relaunches): " + " | ".join(
        f"{code}: {' / '.join(texts)}" for code, texts in meanings.items())


class UserError(Exception):
    """Bad input (config, path, data) the user can fix. The CLI prints it on one line and exits
    with `exit_code` (2 by default), without a traceback."""

    exit_code = EXIT_CONFIG
    label = "error"  # the CLI prints `ringfeed: <label>: <message>`

    def __init__(self, message: str, exit_code: int | None = None):
        super().__init__(message)
        if exit_code is not None:
            self.exit_code = exit_code


def markers_in(line: str) -> set[str]:
    """The exit-code table's lines that `line` of a job's output carries (a launcher may put a
    prefix such as `[1,0]<stderr>:` before them)."""
    return {s.line for s in EXIT_STATUSES if s.line and s.line in line}


def relaunches(code: int, markers: Collection[str]) -> bool:
    """Whether `ringfeed run` relaunches a job that exited with `code` after printing lines
    carrying `markers` (launchers such as horovodrun do not pass a rank's exit code on, so a
    rank's not-restartable line decides as much as the code). Exit codes outside the table (a
    rank killed by a signal, a launcher's own failure) are crashes: relaunched."""
    if code == 0:
        return False
    if any(not s.relaunch for s in EXIT_STATUSES if s.line and s.line in markers):
        return False
    rows = [s for s in EXIT_STATUSES if s.code == code]
    return not rows or any(s.relaunch for s in rows)


# What Horovod raises in a rank whose peer died (torch: HorovodInternalError; TensorFlow's
# ops: an error carrying the same sentence)
HOROVOD_SHUT_DOWN = "Horovod has been shut down"


def is_lost_rank(exc: BaseException) -> bool:
    """Whether `exc` is Horovod ending this rank's collective because another rank is gone."""
    return type(exc).__name__ == "HorovodInternalError" or HOROVOD_SHUT_DOWN in str(exc)


def one_line(text: str) -> str:
    """`text` on one line, whatever it held: a library's multi-line message folded, and control
    characters (a file name with a carriage return) shown escaped rather than acted on."""
    if "\n" in text:
        text = " ".join(text.split())
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def model_mismatch(checkpoint: object, differences: list[str]) -> UserError:
    """A checkpoint whose weights do not fit the configured model (model.name or model.args
    changed since it was written): one line naming the first differences and what to do,
    instead of the framework's list of every tensor. No relaunch changes that: exit 2."""
    shown = "; ".join(differences[:3])
    more = f" (and {len(differences) - 3} more)" if len(differences) > 3 else ""
    return UserError(f"checkpoint {checkpoint} holds another model than the config's: {shown}"
                     f"{more} (resume with the model.name/model.args it was written with, or "
                     "start afresh with --resume none or another checkpoint.dir)")


def optimizer_mismatch(checkpoint: object, error: Exception) -> UserError:
    """A checkpoint whose optimizer state does not fit the configured optimizer's parameter
    groups (optim changed since it was written, or a built-in gpt checkpoint from before its
    weight decay skipped norms, biases and embeddings): one line, exit 2."""
    return UserError(f"checkpoint {checkpoint}: its optimizer state does not fit the config's "
                     f"optimizer ({one_line(str(error))}); resume with the optim settings and "
                     "ringfeed version it was written with, or start afresh with --resume none "
                     "or another checkpoint.dir")


def state_dict_differences(saved: dict[str, tuple[int, ...]],
                           live: dict[str, tuple[int, ...]]) -> list[str]:
    """What differs between a checkpoint's tensors and the model's, by name and shape:
    missing names first, then extra ones, then shapes."""
    missing = [k for k in live if k not in saved]
    extra = [k for k in saved if k not in live]
    shapes = [f"{k}: {tuple(saved[k])} in the checkpoint, {tuple(live[k])} in the model"
              for k in live if k in saved and tuple(saved[k]) != tuple(live[k])]
    return ([f"not in the checkpoint: {', '.join(missing[:4])}"] if missing else []) + \
        ([f"only in the checkpoint: {', '.join(extra[:4])}"] if extra else []) + shapes

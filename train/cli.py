"""The `ringfeed` console script. Each package registers its own subcommands.

A module in COMMAND_MODULES exposes `register(subparsers)`, which adds parsers whose default
`func(args) -> int` runs the command. Heavy imports (torch, TF, Horovod) happen inside `func`,
so `ringfeed --help` stays fast.
"""

from __future__ import annotations

import argparse
import errno
import importlib
import signal
import sys
import time
from typing import IO, NoReturn

from ringfeed.errors import (
    EXIT_CONFIG,
    EXIT_CRASH,
    EXIT_INTERRUPTED,
    EXIT_WRITE,
    USER_CODE_LINE,
    UserError,
    is_lost_rank,
    one_line,
)
from ringfeed.userhooks import UserCode, described

LOST_RANK_EXIT_DELAY_S = 10.0

COMMAND_MODULES = [
    "ringfeed.train.info",                  # ringfeed info
    "ringfeed.shards.cli",                  # ringfeed shard | verify | inspect
    "ringfeed.train.main",                  # ringfeed train
    "ringfeed.train.resilience.supervise",  # ringfeed run -- <launcher ...>
    "ringfeed.train.bench",                 # ringfeed bench
    "ringfeed.train.tune",                  # ringfeed tune SEARCH.yaml
    "ringfeed.train.replay",                # ringfeed replay RUN_DIR --steps A:B
    "ringfeed.train.generate",              # ringfeed generate RUN_DIR --prompt TEXT
    "ringfeed.train.export",                # ringfeed export RUN_DIR OUT_DIR
]


class Parser(argparse.ArgumentParser):
    """argparse's parser whose error line is one line, like every other (an argument holding a
    carriage return or newline is shown escaped); its subcommands' parsers are Parsers too."""

    def error(self, message: str) -> NoReturn:
        self.print_usage(sys.stderr)
        self.exit(EXIT_CONFIG, f"{self.prog}: error: {one_line(message)}\n")


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="ringfeed",
        description="WebDataset shards -> local cache -> Horovod ring-allreduce (PyTorch, TensorFlow).",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for name in COMMAND_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as e:
            if e.name == name:  # not built yet in this checkout
                continue
            raise
        module.register(sub)
    return parser


# Write errors no restart fixes: the CLI names the file and exits EXIT_WRITE.
WRITE_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EROFS}


def exit_status(exc: BaseException, stream: IO[str] | None = None,
                user_code: UserCode | None = None) -> int:
    """The one place a command's exception becomes its exit code: prints the line (and, for the
    user's code, which `user_code` tells apart, its traceback first) on `stream` (stderr) and
    returns the code. Anything else is re-raised: a crash, with Python's traceback and exit 1."""
    stream = stream or sys.stderr
    if isinstance(exc, UserError):
        line, code = f"ringfeed: {exc.label}: {exc}", exc.exit_code
    elif isinstance(exc, KeyboardInterrupt):
        line, code = "ringfeed: interrupted", EXIT_INTERRUPTED
    elif is_lost_rank(exc):
        line, code = (f"ringfeed: lost rank: another rank of this job ended and Horovod shut "
                      f"down ({type(exc).__name__}; the launcher's output names that rank; a "
                      "relaunch resumes from the newest checkpoint)"), EXIT_CRASH
    elif isinstance(exc, OSError) and exc.errno in WRITE_ERRNOS:
        where = f"cannot write {exc.filename}" if exc.filename else "a write failed"
        line, code = (f"ringfeed: error: {where} ({exc.strerror}; free space or choose another "
                      "directory; what was written before is kept)"), EXIT_WRITE
    else:
        culprit = user_code.culprit(exc) if user_code is not None else None
        if culprit is None:
            raise exc
        text, name, message = described(exc)  # (a loader worker's: as raised there)
        print(text, end="", file=stream)
        line, code = f"{USER_CODE_LINE}{culprit}: {name}: {message}", EXIT_CRASH
    print(one_line(line), file=stream, flush=True)
    return code


def main(argv: list[str] | None = None) -> int:
    """Run one command; its exit code (ringfeed/errors.py's table, decided by exit_status:
    one line, no traceback, for everything but a crash and the user's own code). The
    command's user code (`args.user_code`) is the command's own: filled by what reads its
    config, nothing kept from an earlier command in this process. `argv` None: the process's
    own command line (the console script, `python -m`), whose exit the command may bound
    (`args.owns_process`); a caller's list runs it as a function."""
    args = build_parser().parse_args(argv)
    args.user_code = user_code = UserCode()
    args.owns_process = argv is None
    try:
        return int(args.func(args) or 0)
    except (Exception, KeyboardInterrupt) as e:
        code = exit_status(e, sys.stderr, user_code)
        if is_lost_rank(e) and args.owns_process:
            # A launcher passes on the status of the rank that exits first: the one whose
            # own error ended the job (2, 3, 4, 75 ...) must beat the peers it took down. The
            # launcher's SIGTERM meanwhile just ends this one (the run is over, nothing to save).
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            time.sleep(LOST_RANK_EXIT_DELAY_S)
        return code


if __name__ == "__main__":
    sys.exit(main())

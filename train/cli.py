"""The `ringfeed` console script. Each package registers its own subcommands.

A module in COMMAND_MODULES exposes `register(subparsers)`, which adds parsers whose default
`func(args) -> int` runs the command. Heavy imports (torch, TF, Horovod) happen inside `func`,
so `ringfeed --help` stays fast.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import NoReturn

from ringfeed.errors import exit_status, one_line

COMMAND_MODULES = [
    "ringfeed.train.info",                  # ringfeed info
    "ringfeed.shards.cli",                  # ringfeed shard | verify | inspect
    "ringfeed.train.main",                  # ringfeed train
    "ringfeed.train.resilience.supervise",  # ringfeed run -- <launcher ...>
    "ringfeed.train.bench",                 # ringfeed bench
    "ringfeed.train.tune",                  # ringfeed tune SEARCH.yaml
    "ringfeed.train.replay",                # ringfeed replay RUN_DIR --steps A:B
]


class Parser(argparse.ArgumentParser):
    """argparse's parser whose error line is one line, like every other (an argument holding a
    carriage return or newline is shown escaped); its subcommands' parsers are Parsers too."""

    def error(self, message: str) -> NoReturn:
        self.print_usage(sys.stderr)
        self.exit(2, f"{self.prog}: error: {one_line(message)}\n")


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


def main(argv: list[str] | None = None) -> int:
    """Run one command; its exit code (ringfeed/errors.py's table, decided by exit_status:
    one line, no traceback, for everything but a crash and the user's own code)."""
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except (Exception, KeyboardInterrupt) as e:
        return exit_status(e, sys.stderr)


if __name__ == "__main__":
    sys.exit(main())

"""`ringfeed bench [--quick] [NAME ...]`: the benchmarks of benchmarks/run_all.py from the CLI.

benchmarks/ is not an installed package: it lives next to train/ in a source checkout, and is
loaded from there by path.
"""

from __future__ import annotations

import argparse
import importlib.util
import shlex
import sys
from pathlib import Path

from ringfeed.errors import UserError

BENCH_DIR = Path(__file__).resolve().parents[1] / "benchmarks"


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "bench",
        help="run the benchmarks against their peers (results under benchmarks/results/)",
        description="Run ringfeed's benchmarks side by side with the tools users would pick "
                    "instead, print one table of ratios with their goals, and save JSON and "
                    "PNG results. Needs a source checkout (benchmarks/ next to train/).",
    )
    p.add_argument("names", nargs="*", metavar="NAME",
                   help="benchmarks to run (default: all): shards, pipeline, trainer, "
                        "allreduce, scaling, stall (benchmarks/README.md)")
    p.add_argument("--quick", action="store_true", help="small, fast runs (smoke test)")
    p.add_argument("--results", metavar="DIR", help="output directory (default "
                                                    "benchmarks/results)")
    p.add_argument("--no-readme", action="store_true",
                   help="do not rewrite the results section of benchmarks/README.md")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    script = BENCH_DIR / "run_all.py"
    if not script.exists():
        raise UserError(f"bench: {script} not found: the benchmarks ship with the source "
                        "checkout, not the installed package (clone the repo and run "
                        "`make bench` there)")
    spec = importlib.util.spec_from_file_location("ringfeed_bench_run_all", script)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    unknown = [n for n in args.names if n not in module.NAMES]
    if unknown:
        raise UserError(f"bench: unknown benchmark {', '.join(unknown)} "
                        f"(have: {', '.join(module.NAMES)})")
    argv = [*args.names, *(["--quick"] if args.quick else []),
            *(["--results", args.results] if args.results else []),
            *(["--no-readme"] if args.no_readme else [])]
    return module.main(argv, command=shlex.join(["ringfeed", "bench", *argv]))

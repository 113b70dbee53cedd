"""Run every benchmark (or the named ones), print one table of ratios against the peers with
each goal marked met or not, and (full mode) rewrite the results section of
benchmarks/README.md.

    .venv/bin/python benchmarks/run_all.py              # `make bench`: full mode
    .venv/bin/python benchmarks/run_all.py --quick      # the smoke test's mode
    .venv/bin/python benchmarks/run_all.py allreduce trainer
    ringfeed bench [--quick] [NAME ...]                 # the same from the CLI

Each benchmark is a module here with `main(argv) -> dict`, loaded by path; one that is not
there is reported as "missing", one that raises as "failed" (the others still run). Exit code:
0 when every selected benchmark ran (goals met or not: benchmarks measure, they do not
assert), 1 when one failed or is missing.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shlex
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from common import (  # noqa: E402
    REPO,
    RESULTS,
    Row,
    format_table,
    machine,
    save_json,
    table_cells,
)

from ringfeed.fsutil import atomic_write_text  # noqa: E402


@dataclass(frozen=True)
class Bench:
    name: str
    file: str
    item: str  # the numbering
    results_flag: str = "--results"  # how its main() is told where to write
    goals: tuple[tuple[str, str, float], ...] = ()  # for modules that return bare "ratios"


BENCHES = [
    Bench("shards", "shard_bench.py", "1. sharding",
          goals=(("ringfeed K=2 / ShardWriter", ">=", 1.7),)),
    Bench("pipeline", "pipeline_bench.py", "2-3. pipeline read, cache", results_flag="--out"),
    Bench("trainer", "trainer_bench.py", "4. trainer overhead"),
    Bench("allreduce", "allreduce_bench.py", "5. allreduce"),
    Bench("scaling", "scaling_bench.py", "6. scaling with work"),
    Bench("stall", "stall_bench.py", "7. data stall"),
    Bench("decode", "decode_bench.py", "fast data path: decode"),
    Bench("plan", "plan_bench.py", "issue 17: plans at scale"),
    Bench("local_sgd", "local_sgd_bench.py", "issue 16: local SGD on a slow link"),
    Bench("startup", "startup_bench.py", "issue 17: a real run on 10^6 shards"),
    Bench("augment", "augment_bench.py", "issue 45: train-time augmentation"),
    Bench("input_bound", "input_bound_bench.py", "issue 46: shards vs synthetic data"),
    Bench("tokens", "token_bench.py", "issue 49: token windows vs LitData"),
]
NAMES = [b.name for b in BENCHES]
README = HERE / "README.md"
BEGIN, END = "<!-- results:begin -->", "<!-- results:end -->"


def load(bench: Bench) -> ModuleType | None:
    path = HERE / bench.file
    if not path.exists():
        return None
    spec = importlib.util.spec_from_file_location(f"ringfeed_bench_{bench.name}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def goals_of(bench: Bench, module: ModuleType) -> dict[str, tuple[str, float]]:
    goals = {name: (op, bound) for name, op, bound in bench.goals}
    declared = getattr(module, "GOALS", None)  # {ratio name: lower bound}
    if isinstance(declared, dict):
        goals.update({k: (">=", float(v)) for k, v in declared.items()
                      if isinstance(v, (int, float))})
    return goals


def rows_of(bench: Bench, module: ModuleType, result: dict[str, Any]) -> list[Row]:
    """The module's own rows, or rows made from its bare {"ratios": {name: value}}."""
    if isinstance(result.get("rows"), list):
        return [Row.from_dict(r) for r in result["rows"]]
    goals = goals_of(bench, module)
    return [Row(bench.name, name, None, ratio=float(value), goal=goals.get(name))
            for name, value in (result.get("ratios") or {}).items()]


def run_one(bench: Bench, quick: bool, results_dir: Path) -> tuple[str, list[Row], float]:
    """(status, rows, seconds): status is "ok", "missing" or "failed: <why>"."""
    start = time.perf_counter()
    module = load(bench)
    if module is None:
        return "missing", [Row(bench.name, bench.item, None, note="missing")], 0.0
    argv = ["--quick"] if quick else []
    argv += [bench.results_flag, str(results_dir)]
    print(f"\n=== {bench.item}: {bench.file} {' '.join(argv)}", flush=True)
    try:
        result = module.main(argv)
        rows = rows_of(bench, module, result or {})
        status = "ok"
    except Exception as e:
        traceback.print_exc()
        why = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        status = f"failed: {why[:120]}"
        rows = [Row(bench.name, bench.item, None, note="FAILED (see log)")]
    return status, rows, time.perf_counter() - start


def markdown_tables(rows: list[Row]) -> str:
    """One small table per benchmark (metric, ours, peer, ratio, goal), a missed goal's ratio
    in bold: what a reader scans for, nothing else."""
    out: list[str] = []
    for bench in dict.fromkeys(r.bench for r in rows):
        out += [f"**{bench}**", "", "| metric | ringfeed | peer | ratio | goal |",
                "|---|---|---|---|---|"]
        for r in (r for r in rows if r.bench == bench):
            _, metric, value, peer, ratio, goal, _ = table_cells(r)
            if r.met is False:
                ratio = f"**{ratio}**"
            if r.value is None and r.ratio is None and r.note:
                ratio = r.note  # why it was not measured
            out.append(f"| {metric} | {value} | {peer} | {ratio} | {goal} |")
        out.append("")
    return "\n".join(out).rstrip()


def readme_section(summary: dict[str, Any], rows: list[Row]) -> str:
    """The README's results: the machine, the command and a table per benchmark."""
    m = summary["machine"]
    return "\n".join([
        BEGIN,
        f"Latest full run: {m['date'][:10]} on {m['cpus']} x {m['cpu_model']}, "
        f"{m['memory_gb']} GB RAM, Python {m['python']}; {summary['seconds']:.0f} s in all. "
        f"Command: `{summary['command']}`. Goals missed are in **bold**.",
        "",
        markdown_tables(rows),
        END,
    ])


def rewrite_readme(section: str) -> None:
    text = README.read_text() if README.exists() else ""
    if BEGIN in text and END in text:
        head, rest = text.split(BEGIN, 1)
        text = head + section + rest.split(END, 1)[1]
    else:
        text = text.rstrip() + "\n\n## Results\n\n" + section + "\n"
    atomic_write_text(README, text)


def main(argv: list[str] | None = None, command: str | None = None) -> int:
    ap = argparse.ArgumentParser(prog="run_all.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("names", nargs="*", metavar="NAME",
                    help=f"benchmarks to run (default all): {', '.join(NAMES)}")
    ap.add_argument("--quick", action="store_true", help="small, fast runs (the smoke test)")
    ap.add_argument("--results", type=Path, default=RESULTS,
                    help="where JSON and PNG files go (default benchmarks/results)")
    ap.add_argument("--no-readme", action="store_true",
                    help="do not rewrite benchmarks/README.md (only a full run of all "
                         "benchmarks into benchmarks/results does)")
    args = ap.parse_args(argv)
    unknown = [n for n in args.names if n not in NAMES]
    if unknown:
        ap.error(f"unknown benchmark(s) {', '.join(unknown)} (have: {', '.join(NAMES)})")
    selected = [b for b in BENCHES if not args.names or b.name in args.names]
    args.results.mkdir(parents=True, exist_ok=True)
    python = os.path.relpath(sys.executable, REPO)  # as run: `make bench` uses .venv/bin/python
    command = command or shlex.join([python, "benchmarks/run_all.py",
                                     *(sys.argv[1:] if argv is None else argv)])

    start = time.perf_counter()
    summary: dict[str, Any] = {"command": command, "quick": args.quick, "machine": machine(),
                               "benchmarks": {}}
    rows: list[Row] = []
    for bench in selected:
        status, bench_rows, seconds = run_one(bench, args.quick, args.results)
        rows += bench_rows
        summary["benchmarks"][bench.name] = {"status": status, "seconds": round(seconds, 1),
                                             "rows": [r.to_dict() for r in bench_rows]}
    summary["seconds"] = time.perf_counter() - start

    print("\n" + format_table(rows))
    missed = [r for r in rows if r.met is False]
    print(f"\n{len(selected)} benchmark(s) in {summary['seconds']:.0f} s; goals met "
          f"{sum(r.met is True for r in rows)}, missed {len(missed)}, "
          f"not measured {sum(r.goal is not None and r.met is None for r in rows)}")
    save_json(args.results, "summary_quick" if args.quick else "summary", summary)
    # The README shows a complete full run whose plots sit in benchmarks/results.
    if not (args.quick or args.no_readme or args.names) and args.results.resolve() == RESULTS:
        rewrite_readme(readme_section(summary, rows))
        print(f"rewrote the results section of {README.relative_to(REPO)}")
    bad = {n: s["status"] for n, s in summary["benchmarks"].items() if s["status"] != "ok"}
    for name, status in bad.items():
        print(f"{name}: {status}", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())

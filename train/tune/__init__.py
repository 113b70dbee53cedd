"""`ringfeed tune SEARCH.yaml [--report]`: hyperparameter search where every trial is itself a
multi-rank Horovod job.

- Search: Optuna. `algorithm: tpe` samples with TPESampler and stops bad trials early with
  optuna's SuccessiveHalvingPruner (ASHA) or MedianPruner from the values each trial streams to
  its metrics.jsonl (tpe.py); `algorithm: pbt` is Population-Based Training (pbt.py).
- Trials: the search file's `launch` template (`horovodrun -np K ... ringfeed train {config}`,
  `mpirun ...`, `srun ...`) run as a subprocess in its own process group, with the trial's config
  written as YAML into its own run dir `<output>/trials/trial-NNNN/` (trial.yaml, train.log, and
  what `ringfeed train` writes there: metrics.jsonl, summary.json, checkpoints/).
- Durable: the study lives in an RDB (SQLite file `<output>/study.db` by default, any SQLAlchemy
  URL). Rerunning the same command continues the study: finished trials stay, trials that were
  running in a `ringfeed tune` that died are marked failed and retried (from their newest
  checkpoint), and the budget counts what is already done. A trial that crashes is marked failed
  with its log and the study goes on.
- Output (`<output>/`): results.csv and results.json (trial, state, metric, parameters, wall
  time), best.yaml (a runnable trainer config with the best parameters), plot.png.

Modules of this package, each importing only modules listed after it:

    __init__.py  the command: register(), run() (signals, exit codes, the final report)
    tpe.py       the TPE search loop (worker threads, pruning, retries from checkpoints)
    pbt.py       Population-Based Training (intervals, exploit/explore)
    launch.py    one trial as a job: config check, launch, metric streamed to optuna, result
    study.py     open, count and recover the study; TrialFailed, TuneInterrupted, say
    report.py    results.csv/json, best.yaml, plot.png and the printed table
    trial.py     the job's process tree, its metrics.jsonl tail, its checkpoints
    spec.py      the search file, its space syntax and the trial configs made from it
"""

from __future__ import annotations

import argparse
import signal
import threading
from typing import Any

from ringfeed.errors import UserError


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "tune",
        help="hyperparameter search (TPE + ASHA/median pruning, or PBT) over multi-rank jobs",
        description="Run the trials of a search file, each a `ringfeed train` job launched by "
                    "its `launch` template, in an Optuna study that survives being killed: run "
                    "the same command again to continue it.",
        epilog="Exit codes: 0 study done (some trials may have failed: see the table), 1 no "
               "trial finished, 2 bad search file, 130/143 stopped by SIGINT/SIGTERM (rerun "
               "to continue).",
    )
    p.add_argument("search", help="search file (YAML: base, space, metric, direction, launch)")
    p.add_argument("--report", action="store_true",
                   help="run nothing: write and print the results of the study so far")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    # (imported here, not at the top: every `ringfeed` command builds this parser)
    from ringfeed.train.tune.spec import load_search
    from ringfeed.train.tune.study import TuneInterrupted, open_study, say

    search = load_search(args.search)
    study = open_study(search)
    from ringfeed.train.tune.report import report

    if args.report:
        return report(search, study)
    stop = threading.Event()
    caught: list[int] = []

    def on_signal(signum: int, _frame: Any) -> None:
        caught.append(signum)
        stop.set()

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        if search.spec.algorithm == "pbt":
            from ringfeed.train.tune.pbt import run_pbt

            run_pbt(search, study, stop)
        else:
            from ringfeed.train.tune.tpe import run_tpe

            run_tpe(search, study, stop)
    except TuneInterrupted:
        pass
    except UserError:
        report(search, study)  # what did finish, before the one-line error
        raise
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    code = report(search, study)
    if caught:
        say(f"ringfeed tune: stopped by signal {caught[0]}; run the same command to continue "
            f"the study ({search.storage_url})")
        return 128 + caught[0]
    return code

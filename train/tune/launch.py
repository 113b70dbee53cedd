"""One trial of the study run as a job, for the TPE loop (tpe.py) and PBT (pbt.py) alike: its
config checked as the trainer would, the search file's `launch` template run (trial.py watches
the job), the metric it streams reported to optuna, and its result read from metrics.jsonl. A
trial that cannot give a result is failed with the reason in its user attrs (TrialFailed).
"""

from __future__ import annotations

import math
import threading
from pathlib import Path
from typing import Any

from ringfeed.errors import UserError
from ringfeed.train.config import load_config
from ringfeed.train.observe.runfiles import METRICS_FILE
from ringfeed.train.tune.spec import Search
from ringfeed.train.tune.study import TrialFailed, say
from ringfeed.train.tune.trial import Outcome, metric_value, owner, read_records, run_job


def launch_trial(search: Search, trial, config: Path, run_dir: Path, stop: threading.Event,
                 report: bool, log_name: str = "train.log", at_least_step: int = 0) -> Outcome:
    """Check the trial's config, launch it, stream its metric into optuna (`report`), and
    record what a later reader needs (run dir, log, owner, launcher pid). Returns the Outcome;
    raises TrialFailed for a config the trainer would refuse."""
    import psutil

    log = run_dir / log_name
    trial.set_user_attr("run_dir", str(run_dir))
    trial.set_user_attr("log", str(log))
    trial.set_user_attr("owner", owner())
    try:
        load_config(config, check_paths=False)
    except UserError as e:  # a combination of values the trainer refuses: no launch needed
        fail(trial, "config", str(e), 0.0)
    shown = ", ".join(f"{k}={_short(v)}" for k, v in search.config_values(trial.params).items())
    say(f"trial {trial.number}: started  {shown}  (log {_rel(log)})")
    reported: set[int] = set()

    def on_start(proc) -> None:
        started = psutil.Process(proc.pid).create_time() if psutil.pid_exists(proc.pid) else 0
        trial.set_user_attr("launcher", {"pid": proc.pid, "started": started})

    def on_records(records: list[dict[str, Any]]) -> bool:
        new = False
        for r in records:
            value, step = r.get(search.spec.metric), r.get("step")
            if isinstance(value, (int, float)) and isinstance(step, int) \
                    and step > at_least_step and step not in reported and math.isfinite(value):
                reported.add(step)
                trial.report(float(value), step)
                new = True
        return report and new and trial.should_prune()

    env = {"RINGFEED_TUNE_STUDY": search.study_name, "RINGFEED_TUNE_TRIAL": str(trial.number),
           "RINGFEED_TUNE_RUN_DIR": str(run_dir)}
    outcome = run_job(search.command(config, run_dir, trial.number), log,
                      run_dir / METRICS_FILE, env, on_start, on_records, stop,
                      search.spec.trial_timeout_s)
    trial.set_user_attr("wall_s", round(outcome.wall_s, 3))
    if outcome.stopped == "pruned":
        trial.set_user_attr("pruned_at_step", max(reported, default=0))
    if outcome.stopped == "timeout":
        fail(trial, "timeout", f"ran past trial_timeout_s={search.spec.trial_timeout_s}",
             outcome.wall_s)
    if outcome.stopped is None and outcome.returncode != 0:
        fail(trial, "crash", f"exit {outcome.returncode}: {outcome.error}", outcome.wall_s)
    return outcome


def outcome_value(search: Search, trial, outcome: Outcome, run_dir: Path,
                  at_step: int | None = None) -> float:
    """The trial's result: the last value of the metric (at `at_step`) in its metrics.jsonl."""
    metric = search.spec.metric
    records = read_records(run_dir / METRICS_FILE)  # the final file, after any rewrites
    value = metric_value(records, metric, at_step)
    if value is None:
        keys = sorted({k for r in records for k in r if k not in ("step", "epoch", "time")})
        hint = " (validation metrics need a val split)" if metric.startswith("val_") else ""
        where = f" at step {at_step}" if at_step is not None else ""
        fail(trial, "no_metric", f"finished without {metric}{where} in metrics.jsonl{hint}; "
             f"it has: {', '.join(keys) or 'nothing'}", outcome.wall_s)
    if not math.isfinite(value):
        fail(trial, "crash", f"{metric} is {value}", outcome.wall_s)
    return value


def fail(trial, failure: str, error: str, wall_s: float) -> None:
    trial.set_user_attr("failure", failure)
    trial.set_user_attr("error", error[:500])
    trial.set_user_attr("wall_s", round(wall_s, 3))
    raise TrialFailed(error)


def _short(value: Any) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def _rel(path: Path) -> str:
    try:
        return str(path.relative_to(Path.cwd()))
    except ValueError:
        return str(path)

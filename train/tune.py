"""`ringfeed tune SEARCH.yaml [--report]`: hyperparameter search where every trial is itself a
multi-rank Horovod job.

- Search: Optuna. `algorithm: tpe` samples with TPESampler and stops bad trials early with
  optuna's SuccessiveHalvingPruner (ASHA) or MedianPruner from the values each trial streams to
  its metrics.jsonl; `algorithm: pbt` is Population-Based Training (train/tune_pbt.py).
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
"""

from __future__ import annotations

import argparse
import math
import signal
import threading
import time
import warnings
from pathlib import Path
from typing import Any

from ringfeed.train.tune_spec import Search, load_search

from ringfeed.errors import UserError

INTERRUPTED = (None, "interrupted")  # FAIL trials whose `failure` is one of these get retried
_retry_lock = threading.Lock()


class TrialFailed(Exception):
    """A trial that crashed, timed out or reported no metric (its user attrs say which)."""


class TuneInterrupted(Exception):
    """`ringfeed tune` was asked to stop (SIGINT/SIGTERM); running trials were stopped."""


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
    search = load_search(args.search)
    study = open_study(search)
    from ringfeed.train import tune_report

    if args.report:
        return tune_report.report(search, study)
    stop = threading.Event()
    caught: list[int] = []

    def on_signal(signum: int, _frame: Any) -> None:
        caught.append(signum)
        stop.set()

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        if search.spec.algorithm == "pbt":
            from ringfeed.train.tune_pbt import run_pbt

            run_pbt(search, study, stop)
        else:
            run_tpe(search, study, stop)
    except TuneInterrupted:
        pass
    except UserError:
        tune_report.report(search, study)  # what did finish, before the one-line error
        raise
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    code = tune_report.report(search, study)
    if caught:
        say(f"ringfeed tune: stopped by signal {caught[0]}; run the same command to continue "
            f"the study ({search.storage_url})")
        return 128 + caught[0]
    return code


def say(message: str) -> None:
    print(message, flush=True)


# -- the study --------------------------------------------------------------------------------
def open_study(search: Search):  # -> optuna.Study
    """Create or load the study; refuse one made for another algorithm or metric."""
    import optuna
    from optuna.exceptions import ExperimentalWarning

    optuna.logging.set_verbosity(optuna.logging.ERROR)  # ringfeed tune prints its own lines
    warnings.filterwarnings("ignore", category=ExperimentalWarning)
    # (TPELoop records heartbeats itself, as study.optimize would)
    warnings.filterwarnings("ignore", message="Heartbeat of storage is supposed to be used")
    search.out_dir.mkdir(parents=True, exist_ok=True)
    spec = search.spec
    heartbeat = spec.study.heartbeat_s if spec.algorithm == "tpe" else None
    try:
        storage = optuna.storages.RDBStorage(
            search.storage_url, heartbeat_interval=heartbeat,
            grace_period=4 * heartbeat if heartbeat else None,
            heartbeat_stale_trial_callback=(lambda study, _t: retry_interrupted(
                study, spec.retries)) if heartbeat else None)
    except Exception as e:  # noqa: BLE001 - SQLAlchemy's many error types, one line
        raise UserError(f"{search.path}: study.storage: cannot open {search.storage_url} "
                        f"({' '.join(str(e).split())[:200]})") from None
    if spec.algorithm == "tpe":
        sampler = optuna.samplers.TPESampler(seed=spec.seed)
    else:  # PBT's first population is drawn at random; later ones come from exploit/explore
        sampler = optuna.samplers.RandomSampler(seed=spec.seed)
    study = optuna.create_study(storage=storage, sampler=sampler, pruner=make_pruner(search),
                                study_name=search.study_name, direction=spec.direction,
                                load_if_exists=True)
    made_for = {"algorithm": spec.algorithm, "metric": spec.metric}
    for key, value in made_for.items():
        old = study.user_attrs.get(key)
        if old is None:
            study.set_user_attr(key, value)
        elif old != value:
            raise UserError(f"{search.path}: {key}: study {search.study_name!r} in "
                            f"{search.storage_url} was made with {key} {old!r}, not {value!r} "
                            "(set study.name to start another study)")
    if study.direction.name.lower() != spec.direction:
        raise UserError(f"{search.path}: direction: study {search.study_name!r} was made to "
                        f"{study.direction.name.lower()} (set study.name to start another)")
    return study


def make_pruner(search: Search):
    import optuna

    p = search.spec.pruner
    if search.spec.algorithm == "pbt" or p.name == "none":
        return optuna.pruners.NopPruner()
    if p.name == "asha":
        return optuna.pruners.SuccessiveHalvingPruner(min_resource=p.min_resource,
                                                      reduction_factor=p.reduction_factor)
    return optuna.pruners.MedianPruner(n_startup_trials=p.startup_trials,
                                       n_warmup_steps=p.warmup_steps)


def counted(study) -> int:
    """Trials that use up the budget: complete, pruned, and failed by their own fault
    (crash, bad config, timeout, no metric); not those interrupted by a dead worker."""
    from optuna.trial import TrialState

    return sum(1 for t in study.get_trials(deepcopy=False)
               if t.state in (TrialState.COMPLETE, TrialState.PRUNED)
               or (t.state == TrialState.FAIL and t.user_attrs.get("failure") not in INTERRUPTED))


def recover(study) -> None:
    """Trials left RUNNING by a `ringfeed tune` on this host that is gone: stop what is left
    of their jobs and mark them failed (they are then retried). Trials of live workers, or of
    other hosts, are left to the heartbeat (optuna fails them once their heartbeat is stale)."""
    import socket

    from optuna.trial import TrialState
    from ringfeed.train.tune_trial import kill_tree, process_alive

    for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        who = t.user_attrs.get("owner")
        if not who or who.get("host") != socket.gethostname() \
                or process_alive(who["pid"], who["started"]):
            continue
        job = t.user_attrs.get("launcher")
        if job and process_alive(job["pid"], job["started"]):
            kill_tree(job["pid"], job["started"])  # an orphaned job still training
        study.tell(t.number, state=TrialState.FAIL, skip_if_finished=True)
        say(f"trial {t.number}: was running in a ringfeed tune that is gone (pid {who['pid']}); "
            "marked failed, to be retried")


def retry_interrupted(study, retries: int) -> list[int]:
    """Enqueue a retry (same parameters) of every interrupted trial not retried yet, up to
    `retries` times per original trial. Returns the trial numbers retried."""
    from optuna.trial import TrialState

    with _retry_lock:
        trials = study.get_trials(deepcopy=False)
        by_number = {t.number: t for t in trials}
        retried = {t.user_attrs.get("retry_of") for t in trials}
        done = []
        for t in trials:
            if t.state != TrialState.FAIL or t.user_attrs.get("failure") not in INTERRUPTED \
                    or t.number in retried or "member" in t.user_attrs:  # PBT reruns its own
                continue
            depth, n = 0, t.number
            while by_number[n].user_attrs.get("retry_of") is not None:
                depth, n = depth + 1, by_number[n].user_attrs["retry_of"]
            if depth < retries:
                study.enqueue_trial(t.params, user_attrs={"retry_of": t.number})
                done.append(t.number)
        return done


# -- TPE --------------------------------------------------------------------------------------
def run_tpe(search: Search, study, stop: threading.Event) -> None:
    spec = search.spec
    recover(study)
    for n in retry_interrupted(study, spec.retries):
        say(f"trial {n}: interrupted earlier; retrying it with the same parameters")
    if spec.initial and not study.user_attrs.get("initial_enqueued"):
        for i, point in enumerate(spec.initial):
            study.enqueue_trial(point, user_attrs={"initial": i})
        study.set_user_attr("initial_enqueued", True)
    remaining = spec.trials - counted(study)
    if remaining <= 0:
        say(f"ringfeed tune: study {search.study_name!r} already has {counted(study)} finished "
            f"trial(s) (trials: {spec.trials}); raise trials to search further")
        return
    say(f"ringfeed tune: study {search.study_name!r} ({search.storage_url}): {remaining} more "
        f"trial(s) of {spec.trials}, {spec.parallel} at a time, {spec.metric} "
        f"({spec.direction}), pruner {spec.pruner.name}")
    TPELoop(search, study, stop).run()


class TPELoop:
    """`parallel` worker threads, each asking optuna for a trial, running it and telling the
    result. Not study.optimize: its threads pop enqueued trials (retries, `initial`) without a
    lock, and SQLite does not honour SELECT ... FOR UPDATE, so two threads could take the same
    trial; here asking is serialized, and an unexpected error fails one trial, not the study."""

    def __init__(self, search: Search, study, stop: threading.Event):
        self.search, self.study, self.stop = search, study, stop
        self.lock = threading.Lock()
        self.running = 0  # trials of this process between ask and tell
        spec = search.spec
        self.deadline = time.monotonic() + spec.hours * 3600 if spec.hours else None

    def run(self) -> None:
        workers = [threading.Thread(target=self.worker, name=f"tune-{i}", daemon=True)
                   for i in range(self.search.spec.parallel)]
        for w in workers:
            w.start()
        for w in workers:
            while w.is_alive():  # (join with a timeout: the main thread keeps taking signals)
                w.join(0.5)
        if self.stop.is_set():
            raise TuneInterrupted

    def next_trial(self):
        """A new trial, or None when the budget (counted over every worker sharing the
        study, plus this process's running ones) or the time is used up."""
        from optuna.storages import fail_stale_trials

        with self.lock:
            if self.stop.is_set() or (self.deadline and time.monotonic() > self.deadline):
                return None
            fail_stale_trials(self.study)  # dead workers' trials (heartbeat): failed, retried
            if counted(self.study) + self.running >= self.search.spec.trials:
                return None
            self.running += 1
            return self.study.ask()

    def worker(self) -> None:
        import optuna
        from optuna.trial import TrialState
        from ringfeed.train import tune_report

        while (trial := self.next_trial()) is not None:
            beat = heartbeat(self.study, trial)
            try:
                value = run_tpe_trial(self.search, self.study, trial, self.stop)
                self.study.tell(trial, value)
            except optuna.TrialPruned:
                self.study.tell(trial, state=TrialState.PRUNED)
            except (TrialFailed, TuneInterrupted):
                self.study.tell(trial, state=TrialState.FAIL)
            except Exception as e:  # noqa: BLE001 - one trial fails, the study goes on
                trial.set_user_attr("failure", "error")
                trial.set_user_attr("error", f"ringfeed tune: {type(e).__name__}: {e}"[:500])
                self.study.tell(trial, state=TrialState.FAIL)
            finally:
                beat.set()
                with self.lock:
                    self.running -= 1
            frozen = next(t for t in self.study.get_trials(deepcopy=False)
                          if t.number == trial.number)
            say(tune_report.trial_line(frozen, self.search.spec.metric))
            with self.lock:
                tune_report.write_tables(self.search, self.study)


def heartbeat(study, trial) -> threading.Event:
    """Record the trial's heartbeat until the returned event is set (what study.optimize
    does), so workers sharing the database can tell when this one died."""
    done = threading.Event()
    storage = study._storage  # the RDBStorage open_study made
    interval = storage.get_heartbeat_interval()
    if interval:
        def beat() -> None:
            while True:
                storage.record_heartbeat(trial._trial_id)
                if done.wait(interval):
                    return

        threading.Thread(target=beat, name=f"heartbeat-{trial.number}", daemon=True).start()
    return done


def suggest(trial, search: Search) -> dict[str, Any]:
    for p in search.params:
        if p.kind == "choice":
            trial.suggest_categorical(p.key, p.distribution().choices)
        elif p.kind == "int":
            trial.suggest_int(p.key, int(p.low), int(p.high))
        else:
            trial.suggest_float(p.key, p.low, p.high, log=p.kind == "loguniform")
    return dict(trial.params)


def run_tpe_trial(search: Search, study, trial, stop: threading.Event) -> float:
    import optuna
    from ringfeed.train.tune_trial import adopt_checkpoint

    if stop.is_set():
        raise TuneInterrupted
    params = suggest(trial, search)
    run_dir = fresh_dir(search.out_dir / "trials" / f"trial-{trial.number:04d}")
    trial.set_user_attr("run_dir", str(run_dir))
    resume = "none"
    found = carried_over(study, trial.user_attrs.get("retry_of"))
    if found is not None:  # the interrupted run's progress is not lost
        ckpt, old_dir = found
        resume = "auto"
        trial.set_user_attr("resumed_from", str(adopt_checkpoint(
            ckpt, run_dir, metrics_from=old_dir / "metrics.jsonl")))
    raw = search.trial_config(params, run_dir, resume)
    header = f"# ringfeed tune: trial {trial.number} of study {search.study_name}\n"
    config = search.write_trial_config(run_dir / "trial.yaml", raw, header)
    outcome = launch_trial(search, trial, config, run_dir, stop, report=True)
    if outcome.stopped == "pruned":
        raise optuna.TrialPruned()
    if outcome.stopped == "interrupted":
        raise TuneInterrupted
    return outcome_value(search, trial, outcome, run_dir)


def carried_over(study, retry_of: int | None) -> tuple[Path, Path] | None:
    """The newest complete checkpoint (and its run dir) along the chain of interrupted trials
    that a retry replaces, nearest first."""
    from ringfeed.train.tune_trial import newest_checkpoint

    by_number = {t.number: t for t in study.get_trials(deepcopy=False)}
    while retry_of is not None and retry_of in by_number:
        old = by_number[retry_of]
        old_dir = Path(old.user_attrs["run_dir"]) if "run_dir" in old.user_attrs else None
        ckpt = newest_checkpoint(old_dir) if old_dir is not None else None
        if ckpt is not None:
            return ckpt, old_dir
        retry_of = old.user_attrs.get("retry_of")
    return None


def fresh_dir(run_dir: Path) -> Path:
    """A run dir that is new for this trial number; one left by a study whose database was
    deleted is moved aside rather than mixed in (the trainer refuses foreign checkpoints)."""
    if run_dir.exists():
        run_dir.rename(run_dir.with_name(f"{run_dir.name}.old-{time.time():.0f}"))
    run_dir.mkdir(parents=True)
    return run_dir


def launch_trial(search: Search, trial, config: Path, run_dir: Path, stop: threading.Event,
                 report: bool, log_name: str = "train.log", at_least_step: int = 0):
    """Check the trial's config, launch it, stream its metric into optuna (`report`), and
    record what a later reader needs (run dir, log, owner, launcher pid). Returns the Outcome;
    raises TrialFailed for a config the trainer would refuse."""
    import psutil
    from ringfeed.train.config import load_config
    from ringfeed.train.tune_trial import owner, run_job

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
                      run_dir / "metrics.jsonl", env, on_start, on_records, stop,
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


def outcome_value(search: Search, trial, outcome, run_dir: Path,
                  at_step: int | None = None) -> float:
    """The trial's result: the last value of the metric (at `at_step`) in its metrics.jsonl."""
    from ringfeed.train.tune_trial import metric_value, read_records

    metric = search.spec.metric
    records = read_records(run_dir / "metrics.jsonl")  # the final file, after any rewrites
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

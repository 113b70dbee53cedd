"""The TPE search of `ringfeed tune` (`algorithm: tpe`): `parallel` worker threads ask optuna's
TPESampler for trials, run each as a job (launch.py) in a fresh run dir, and tell the result;
the pruner (ASHA or median, set on the study) stops bad trials from the values they stream.
A retry of an interrupted trial starts from that trial's newest checkpoint.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

from ringfeed.train.observe.runfiles import METRICS_FILE
from ringfeed.train.tune.launch import launch_trial, outcome_value
from ringfeed.train.tune.report import trial_line, write_tables
from ringfeed.train.tune.spec import Search
from ringfeed.train.tune.study import (
    TrialFailed,
    TuneInterrupted,
    counted,
    recover,
    retry_interrupted,
    say,
)
from ringfeed.train.tune.trial import adopt_checkpoint, newest_checkpoint


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
            say(trial_line(frozen, self.search.spec.metric))
            with self.lock:
                write_tables(self.search, self.study)


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
            ckpt, run_dir, metrics_from=old_dir / METRICS_FILE)))
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

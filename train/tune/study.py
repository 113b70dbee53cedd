"""The Optuna study behind `ringfeed tune`, shared by the TPE loop (tpe.py) and PBT (pbt.py):
opening it (and refusing one made for another algorithm or metric), counting the budget, and
recovering trials left running by a `ringfeed tune` that died (marked failed, then retried).

Also the two ways a trial ends early (TrialFailed, TuneInterrupted) and `say`, the one place
the tuner prints its progress lines.
"""

from __future__ import annotations

import threading
import warnings

from ringfeed.errors import UserError
from ringfeed.train.tune.spec import Search

INTERRUPTED = (None, "interrupted")  # FAIL trials whose `failure` is one of these get retried
_retry_lock = threading.Lock()


class TrialFailed(Exception):
    """A trial that crashed, timed out or reported no metric (its user attrs say which)."""


class TuneInterrupted(Exception):
    """`ringfeed tune` was asked to stop (SIGINT/SIGTERM); running trials were stopped."""


def say(message: str) -> None:
    print(message, flush=True)


def open_study(search: Search):  # -> optuna.Study
    """Create or load the study; refuse one made for another algorithm or metric."""
    import optuna
    from optuna.exceptions import ExperimentalWarning

    optuna.logging.set_verbosity(optuna.logging.ERROR)  # ringfeed tune prints its own lines
    warnings.filterwarnings("ignore", category=ExperimentalWarning)
    # (tpe.py's TPELoop records heartbeats itself, as study.optimize would)
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

    from ringfeed.train.tune.trial import kill_tree, process_alive

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

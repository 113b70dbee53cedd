"""Population-Based Training for `ringfeed tune` (`algorithm: pbt`), on ringfeed's checkpoints.

A population of `pbt.population` members trains in intervals of `pbt.interval` steps up to
`train.max_steps`. Member m lives in `<output>/pbt/member-MM/` (one run dir for its whole life:
checkpoints/, metrics.jsonl, and per interval gen-GGG.yaml and gen-GGG.log). Each interval of
each member is one `ringfeed train` job with `train.max_steps` = the interval's end and
`--resume auto` semantics (checkpoint.resume: auto), recorded as one Optuna trial (user attrs:
member, generation, start/end step, parent member and trial, exploited), so the database holds
the whole history and the lineage.

After every interval, once all members have reached it:
- exploit: each member in the bottom `quantile` (and any member whose interval crashed) takes a
  random top-`quantile` member's checkpoint of that step, copied into its own run dir (model,
  optimizer, RNG and data position: the whole checkpoint), so ringfeed's normal resume continues
  from it; the donor's metrics.jsonl comes along, with a `pbt_exploit` record;
- explore: its parameters become the donor's, each scaled by one of `pbt.perturb` (x0.8/x1.2 by
  default; choices move to a neighbour) or, with `pbt.resample_probability`, drawn afresh.

Durable: the plan of every interval (who copies whom, with which parameters) is stored in the
study before any checkpoint is copied, and marked done after; a rerun redoes an unfinished copy
and reruns the intervals that did not finish (each member resumes from its newest checkpoint).
One `ringfeed tune` at a time drives a PBT study (a lock file in the output dir).
"""

from __future__ import annotations

import fcntl
import json
import math
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from ringfeed.errors import EXIT_CRASH, UserError
from ringfeed.train.observe.runfiles import METRICS_FILE
from ringfeed.train.tune.launch import launch_trial, outcome_value
from ringfeed.train.tune.report import trial_line, write_tables
from ringfeed.train.tune.spec import Search, get_dotted
from ringfeed.train.tune.study import TrialFailed, TuneInterrupted, say
from ringfeed.train.tune.trial import adopt_checkpoint, kill_tree, newest_checkpoint, process_alive


def run_pbt(search: Search, study, stop: threading.Event) -> None:
    with _lock(search.out_dir / "pbt.lock", search):
        PBT(search, study, stop).run()


class _lock:
    """An exclusive lock on a file for the life of one PBT controller."""

    def __init__(self, path: Path, search: Search):
        self.path, self.search = path, search

    def __enter__(self) -> None:
        self.file = open(self.path, "a")  # noqa: SIM115 - closed in __exit__
        try:
            fcntl.flock(self.file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            self.file.close()
            raise UserError(f"{self.search.path}: another ringfeed tune is running this PBT "
                            f"study (lock {self.path}); one controller per PBT study") from None

    def __exit__(self, *exc: Any) -> None:
        fcntl.flock(self.file, fcntl.LOCK_UN)
        self.file.close()


class PBT:
    def __init__(self, search: Search, study, stop: threading.Event):
        self.search, self.study, self.stop = search, study, stop
        self.cfg = search.spec.pbt
        total = get_dotted(search.trial_config({}, Path("unused")), "train.max_steps")
        self.ends = [min(total, (g + 1) * self.cfg.interval)
                     for g in range(math.ceil(total / self.cfg.interval))]
        self.ask_lock = threading.Lock()
        self.deadline = time.monotonic() + search.spec.hours * 3600 if search.spec.hours \
            else None
        self.maximize = search.spec.direction == "maximize"

    def member_dir(self, m: int) -> Path:
        return self.search.out_dir / "pbt" / f"member-{m:02d}"

    def run(self) -> None:
        self.fail_leftovers()
        population = self.cfg.population
        say(f"ringfeed tune: PBT study {self.search.study_name!r} ({self.search.storage_url}): "
            f"{population} members, {len(self.ends)} intervals of {self.cfg.interval} steps "
            f"up to step {self.ends[-1]}, {self.search.spec.parallel} job(s) at a time, "
            f"{self.search.spec.metric} ({self.search.spec.direction})")
        for g in range(len(self.ends)):
            todo = [m for m in range(population) if m not in self.finished(g)]
            if todo:
                say(f"pbt: interval {g} (steps {self.start(g)}-{self.ends[g]}): "
                    f"members {', '.join(map(str, todo))}")
                with ThreadPoolExecutor(self.search.spec.parallel) as pool:
                    list(pool.map(lambda m, g=g: self.segment(m, g), todo))
            write_tables(self.search, self.study)
            if self.stop.is_set():
                raise TuneInterrupted
            if len(self.finished(g)) < population:  # out of time before every member ran
                say("ringfeed tune: time budget (hours) used up; run again to continue")
                return
            if not any(t.value is not None for t in self.finished(g).values()):
                raise UserError(f"pbt: every member failed in interval {g}; see "
                                f"{self.member_dir(0)}/gen-{g:03d}.log", exit_code=EXIT_CRASH)
            if g + 1 < len(self.ends):
                self.prepare(g + 1)

    def start(self, g: int) -> int:
        return self.ends[g - 1] if g else 0

    def fail_leftovers(self) -> None:
        """Intervals left RUNNING by a killed controller (this one holds the lock, so no live
        controller owns them): stop what is left of their jobs, mark them failed; the loop
        reruns them."""
        from optuna.trial import TrialState

        for t in self.study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
            job = t.user_attrs.get("launcher")
            if job and process_alive(job["pid"], job["started"]):
                kill_tree(job["pid"], job["started"])
            self.study.tell(t.number, state=TrialState.FAIL, skip_if_finished=True)
            say(f"trial {t.number}: member {t.user_attrs.get('member')} interval "
                f"{t.user_attrs.get('generation')} was running when ringfeed tune stopped; "
                "it runs again")

    def segments(self, g: int) -> dict[int, Any]:
        """member -> its newest trial of interval g (any state)."""
        found: dict[int, Any] = {}
        for t in self.study.get_trials(deepcopy=False):
            if t.user_attrs.get("generation") == g and "member" in t.user_attrs:
                found[t.user_attrs["member"]] = t
        return found

    def finished(self, g: int) -> dict[int, Any]:
        """member -> its interval-g trial that completed or failed by its own fault."""
        from optuna.trial import TrialState

        return {m: t for m, t in self.segments(g).items()
                if t.state == TrialState.COMPLETE
                or (t.state == TrialState.FAIL and t.user_attrs.get("failure"))}

    def plan(self, g: int) -> dict[str, Any] | None:
        return self.study.user_attrs.get(f"pbt_plan_{g}")

    # -- one member, one interval -------------------------------------------------------------
    def segment(self, m: int, g: int) -> None:
        from optuna.trial import TrialState

        if self.stop.is_set() or (self.deadline and time.monotonic() > self.deadline):
            return
        attrs: dict[str, Any] = {"member": m, "generation": g, "start_step": self.start(g),
                                 "end_step": self.ends[g]}
        if g == 0:
            earlier = self.segments(0).get(m)  # an interrupted first interval: same values
            params = dict(earlier.params) if earlier is not None else None
            attrs.update(parent_member=None, parent_trial=None, exploited=False)
        else:
            entry = self.plan(g)["members"][str(m)]
            params = entry["params"]
            attrs.update({k: entry[k] for k in ("parent_member", "parent_trial", "exploited")})
        with self.ask_lock:  # enqueue + ask must pair up
            if params is not None:
                self.study.enqueue_trial(params, user_attrs=attrs)
                trial = self.study.ask(self.search.distributions())
            else:
                trial = self.study.ask(self.search.distributions())
                for k, v in attrs.items():
                    trial.set_user_attr(k, v)
        run_dir = self.member_dir(m)
        raw = self.search.trial_config(trial.params, run_dir, resume="auto",
                                       extra={"train.max_steps": self.ends[g]})
        header = (f"# ringfeed tune: PBT member {m}, interval {g} (steps {self.start(g)}-"
                  f"{self.ends[g]}), trial {trial.number} of study {self.search.study_name}\n")
        config = self.search.write_trial_config(run_dir / f"gen-{g:03d}.yaml", raw, header)
        try:
            outcome = launch_trial(self.search, trial, config, run_dir, self.stop, report=False,
                                   log_name=f"gen-{g:03d}.log", at_least_step=self.start(g))
            if outcome.stopped == "interrupted":
                self.study.tell(trial, state=TrialState.FAIL)
                return
            value = outcome_value(self.search, trial, outcome, run_dir, at_step=self.ends[g])
            self.study.tell(trial, value)
        except TrialFailed:
            self.study.tell(trial, state=TrialState.FAIL)
        frozen = next(t for t in self.study.get_trials(deepcopy=False)
                      if t.number == trial.number)
        say(f"member {m} interval {g}: " + trial_line(frozen, self.search.spec.metric))

    # -- exploit and explore ------------------------------------------------------------------
    def prepare(self, g: int) -> None:
        """Decide (once, stored in the study) and carry out the exploit/explore step before
        interval g: weak members take a strong member's checkpoint at the interval boundary."""
        plan = self.plan(g)
        if plan is None:
            plan = {"members": self.decide(g), "copied": False}
            self.study.set_user_attr(f"pbt_plan_{g}", plan)
        if plan["copied"]:
            return
        step = self.start(g)
        metric = self.search.spec.metric
        for m, entry in sorted(plan["members"].items(), key=lambda kv: int(kv[0])):
            if not entry["exploited"]:
                continue
            donor = entry["parent_member"]
            donor_dir = self.member_dir(donor)
            ckpt = newest_checkpoint(donor_dir, step=step)
            if ckpt is None:
                raise UserError(f"pbt: member {donor} has no complete checkpoint of step {step} "
                                f"in {donor_dir}/checkpoints to hand to member {m}",
                                exit_code=EXIT_CRASH)
            member_dir = self.member_dir(int(m))
            copied = adopt_checkpoint(ckpt, member_dir, metrics_from=donor_dir / METRICS_FILE)
            with open(member_dir / METRICS_FILE, "a") as f:
                f.write(json.dumps({"step": step, "event": "pbt_exploit", "from_member": donor,
                                    "from_trial": entry["parent_trial"],
                                    "time": round(time.time(), 3)}) + "\n")
            shown = ", ".join(f"{k}={_fmt(v)}" for k, v in
                              self.search.config_values(entry["params"]).items())
            say(f"pbt: member {m} ({metric}={_fmt(entry.get('value'))}) takes member {donor}'s "
                f"checkpoint {copied.name} ({metric}={_fmt(entry.get('donor_value'))}) and "
                f"continues with {shown}")
        plan["copied"] = True
        self.study.set_user_attr(f"pbt_plan_{g}", plan)

    def decide(self, g: int) -> dict[str, dict[str, Any]]:
        """Who copies whom before interval g, and with which parameters."""
        done = self.finished(g - 1)
        values = {m: t.value for m, t in done.items() if t.value is not None}
        ranked = sorted(values, key=lambda m: values[m], reverse=self.maximize)  # best first
        n = max(1, int(len(done) * self.cfg.quantile))
        top = ranked[:n]
        weak = {m for m in ranked[-n:] if m not in top} | (set(done) - set(values))
        rng = random.Random(f"{self.search.spec.seed}-pbt-{g}")  # a rerun decides the same
        members = {}
        for m in sorted(done):
            t = done[m]
            if m in weak:
                donor = rng.choice(top)
                members[str(m)] = {
                    "params": self.explore(done[donor].params, rng), "exploited": True,
                    "parent_member": donor, "parent_trial": done[donor].number,
                    "value": values.get(m), "donor_value": values[donor]}
            else:
                members[str(m)] = {"params": dict(t.params), "exploited": False,
                                   "parent_member": m, "parent_trial": t.number,
                                   "value": values.get(m)}
        return members

    def explore(self, params: dict[str, Any], rng: random.Random) -> dict[str, Any]:
        out = {}
        for p in self.search.params:
            if rng.random() < self.cfg.resample_probability:
                out[p.key] = p.sample(rng)
            else:
                out[p.key] = p.perturb(params[p.key], rng.choice(self.cfg.perturb), rng)
        return out


def _fmt(v: Any) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)

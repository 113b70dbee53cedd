"""What `ringfeed tune` leaves in its output dir: results.csv / results.json (one row per trial:
number, state, metric, parameters, wall time; for PBT also member, generation and parent),
best.yaml (a runnable trainer config with the best parameters), plot.png (the metric over
trials; for PBT also the lineage), and the same table printed."""

from __future__ import annotations

import csv
import io
import json
import math
import shlex
from pathlib import Path
from typing import Any

import yaml

from ringfeed.errors import EXIT_CRASH
from ringfeed.fsutil import atomic_write_text
from ringfeed.train.tune.spec import Search

PBT_COLUMNS = ("member", "generation", "start_step", "end_step", "parent_member",
               "parent_trial", "exploited")


def state_of(t) -> str:
    """complete | pruned | running | waiting | crash | config | timeout | no_metric |
    interrupted (the FAIL kinds say why)."""
    name = t.state.name.lower()
    if name == "fail":
        return t.user_attrs.get("failure") or "interrupted"
    return name


def value_of(t) -> float | None:
    if t.value is not None:
        return t.value
    if t.intermediate_values:  # a pruned or failed trial: its last streamed value
        return t.intermediate_values[max(t.intermediate_values)]
    return None


def wall_of(t) -> float | None:
    if "wall_s" in t.user_attrs:
        return t.user_attrs["wall_s"]
    if t.datetime_start and t.datetime_complete:
        return (t.datetime_complete - t.datetime_start).total_seconds()
    return None


def rows(search: Search, study) -> list[dict[str, Any]]:
    out = []
    pbt = search.spec.algorithm == "pbt"
    for t in study.get_trials(deepcopy=False):
        row: dict[str, Any] = {"trial": t.number, "state": state_of(t),
                               search.spec.metric: value_of(t), "wall_s": wall_of(t)}
        values = search.config_values(t.params)
        row.update({p.key: values.get(p.key) for p in search.params})
        if pbt:
            row.update({k: t.user_attrs.get(k) for k in PBT_COLUMNS})
        row["retry_of"] = t.user_attrs.get("retry_of")
        row["pruned_at_step"] = t.user_attrs.get("pruned_at_step")
        row["error"] = t.user_attrs.get("error")
        row["run_dir"] = t.user_attrs.get("run_dir")
        row["log"] = t.user_attrs.get("log")
        out.append(row)
    return out


def best_trial(search: Search, study):
    """TPE: optuna's best complete trial. PBT: the best member at the end of the last
    generation that finished (its weights are the trained result)."""
    from optuna.trial import TrialState

    complete = study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
    if search.spec.algorithm == "pbt" and complete:
        last = max(t.user_attrs.get("generation", 0) for t in complete)
        complete = [t for t in complete if t.user_attrs.get("generation", 0) == last]
    if not complete:
        return None
    pick = max if search.spec.direction == "maximize" else min
    return pick(complete, key=lambda t: t.value)


def write_tables(search: Search, study) -> list[dict[str, Any]]:
    table = rows(search, study)
    out = search.out_dir
    buf = io.StringIO()
    if table:
        writer = csv.DictWriter(buf, fieldnames=list(table[0]))
        writer.writeheader()
        writer.writerows(table)
    atomic_write_text(out / "results.csv", buf.getvalue())
    best = best_trial(search, study)
    doc = {"study": search.study_name, "storage": search.storage_url,
           "algorithm": search.spec.algorithm, "metric": search.spec.metric,
           "direction": search.spec.direction,
           "best": None if best is None else {
               "trial": best.number, search.spec.metric: best.value,
               "params": search.config_values(best.params)},
           "trials": table}
    atomic_write_text(out / "results.json", json.dumps(doc, indent=1, default=str) + "\n")
    return table


def write_best(search: Search, study) -> Path | None:
    """best.yaml: the base config with the best parameters, runnable as is with
    `ringfeed train` (its output goes to <output>/best)."""
    best = best_trial(search, study)
    if best is None:
        return None
    raw = search.trial_config(best.params, search.out_dir / "best")
    lines = [f"ringfeed tune: best trial {best.number} of study {search.study_name}: "
             f"{search.spec.metric} = {best.value:.6g} ({search.spec.direction})"]
    if search.spec.algorithm == "pbt":
        lines.append("PBT: these are the member's last parameters; the schedule it followed:")
        for t in lineage_of(study, best):
            shown = ", ".join(f"{k}={_fmt(v)}" for k, v in
                              search.config_values(t.params).items())
            lines.append(f"  steps {t.user_attrs.get('start_step')}-"
                         f"{t.user_attrs.get('end_step')}: {shown} (trial {t.number}, member "
                         f"{t.user_attrs.get('member')})")
        lines.append(f"its trained weights: {best.user_attrs.get('run_dir')}/checkpoints")
    path = search.out_dir / "best.yaml"
    lines.append(f"run: {shlex.join(search.command(path, search.out_dir / 'best', best.number))}")
    header = "".join(f"# {line}\n" for line in lines)
    return search.write_trial_config(path, raw, header)


def lineage_of(study, trial) -> list:
    """The segments whose weights `trial` continued, oldest first (PBT)."""
    by_number = {t.number: t for t in study.get_trials(deepcopy=False)}
    chain = [trial]
    while chain[-1].user_attrs.get("parent_trial") is not None:
        chain.append(by_number[chain[-1].user_attrs["parent_trial"]])
    return chain[::-1]


def plot(search: Search, study, path: Path) -> Path | None:
    """The metric over trials (complete, pruned at their last value, failed at the axis),
    the best so far, and for PBT the lineage: each member's metric at the end of every
    interval, with a dashed edge where a member took over another's checkpoint."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        import matplotlib.ticker
    except ImportError:
        return None
    table = rows(search, study)
    metric, pbt = search.spec.metric, search.spec.algorithm == "pbt"
    fig, axes = plt.subplots(1, 2 if pbt else 1, figsize=(13 if pbt else 7, 4.5), squeeze=False)
    ax = axes[0][0]
    styles = {"complete": ("tab:blue", "o"), "pruned": ("tab:orange", "x")}
    finite = [r[metric] for r in table if r[metric] is not None and math.isfinite(r[metric])]
    floor = min(finite) if finite else 0.0
    for state in sorted({r["state"] for r in table}):
        pts = [r for r in table if r["state"] == state]
        color, marker = styles.get(state, ("tab:red", "v"))
        ys = [r[metric] if r[metric] is not None else floor for r in pts]
        ax.scatter([r["trial"] for r in pts], ys, c=color, marker=marker, label=state)
    best, best_line = None, []
    for r in table:
        v = r[metric]
        if r["state"] == "complete" and v is not None:
            better = best is None or (v > best if search.spec.direction == "maximize"
                                      else v < best)
            best = v if better else best
        best_line.append(best)
    if any(b is not None for b in best_line):
        ax.step([r["trial"] for r in table], best_line, where="post", c="k", lw=1,
                label="best so far")
    ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
    ax.set_xlabel("trial")
    ax.set_ylabel(metric)
    ax.set_title(f"{search.study_name}: {metric} over trials ({search.spec.algorithm})")
    ax.legend(fontsize=8)
    if pbt:
        _plot_lineage(axes[0][1], table, metric)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _plot_lineage(ax, table: list[dict[str, Any]], metric: str) -> None:
    done = [r for r in table if r["state"] == "complete" and r["member"] is not None]
    by_trial = {r["trial"]: r for r in done}
    cmap = __import__("matplotlib").colormaps["tab10"]
    for m in sorted({r["member"] for r in done}):
        pts = [r for r in done if r["member"] == m]
        ax.scatter([r["end_step"] for r in pts], [r[metric] for r in pts], c=[cmap(m % 10)],
                   s=18, label=f"member {m}", zorder=3)
    for r in done:  # each interval: from the point whose weights it continued
        parent = by_trial.get(r["parent_trial"])
        if parent is None:
            continue
        ax.annotate("", xy=(r["end_step"], r[metric]),
                    xytext=(parent["end_step"], parent[metric]),
                    arrowprops={"arrowstyle": "->", "color": cmap(r["member"] % 10),
                                "ls": "--" if r.get("exploited") else "-"})
    ax.set_xlabel("step")
    ax.set_ylabel(metric)
    ax.set_title("PBT lineage (dashed: took over another member's checkpoint)")
    ax.legend(fontsize=8)


def format_table(search: Search, table: list[dict[str, Any]]) -> str:
    metric = search.spec.metric
    cols = ["trial", "state", metric, "wall_s", *[p.key for p in search.params]]
    if search.spec.algorithm == "pbt":
        cols += ["member", "generation", "parent_member"]
    cells = [[_fmt(r.get(c)) for c in cols] for r in table]
    widths = [max(len(c), *(len(row[i]) for row in cells)) if cells else len(c)
              for i, c in enumerate(cols)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(cols, widths, strict=True))]
    lines += ["  ".join(v.ljust(w) for v, w in zip(row, widths, strict=True)) for row in cells]
    return "\n".join(lines)


def trial_line(t, metric: str) -> str:
    """One line when a trial ends."""
    state, value, wall = state_of(t), value_of(t), wall_of(t)
    took = f" ({wall:.1f} s)" if wall is not None else ""
    if state == "complete":
        return f"trial {t.number}: complete  {metric}={_fmt(value)}{took}"
    if state == "pruned":
        return (f"trial {t.number}: pruned at step {t.user_attrs.get('pruned_at_step')}  "
                f"{metric}={_fmt(value)}{took}")
    return (f"trial {t.number}: FAILED ({state}){took}: {t.user_attrs.get('error', '')}; "
            f"log {t.user_attrs.get('log')}")


def report(search: Search, study) -> int:
    """Write every output, print the table and where things are; 1 if no trial finished."""
    table = write_tables(search, study)
    best_file = write_best(search, study)
    plot_file = plot(search, study, search.out_dir / "plot.png")
    print(f"\n== ringfeed tune: study {search.study_name!r}, {len(table)} trial(s)")
    if table:
        print(format_table(search, table))
    out = search.out_dir
    best = best_trial(search, study)
    if best is not None:
        shown = ", ".join(f"{k}={_fmt(v)}" for k, v in search.config_values(best.params).items())
        print(f"best: trial {best.number}, {search.spec.metric}={_fmt(best.value)}: {shown}")
        print(f"  best config   {best_file}")
    print(f"  results       {out / 'results.csv'}, {out / 'results.json'}")
    if plot_file is not None:
        print(f"  plot          {plot_file}")
    else:
        print("  plot          (not drawn: matplotlib is not installed)")
    print(f"  study         {search.storage_url} (name {search.study_name!r})", flush=True)
    if best is None:
        print("ringfeed tune: no trial has finished yet (see the logs of the failed ones)",
              flush=True)
        return EXIT_CRASH
    return 0


def _fmt(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.4g}"
    if isinstance(v, (list, dict)):
        return yaml.safe_dump(v, default_flow_style=True).strip()
    return str(v)

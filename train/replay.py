"""`ringfeed replay RUN_DIR --steps A:B [--out DIR] [--set KEY=VALUE ...]`: retrain steps A..B
of a finished (or stopped) run from its newest checkpoint before A, on this launch's world size
(1 process, or N under horovodrun), and print each step's loss beside the run's metrics.jsonl.

The replay is `ringfeed train` on the run's config.yaml with: checkpoint.resume = that
checkpoint, output.dir = DIR (default RUN_DIR/replay-A-B; checkpoints there too, the run's are
never written), train.log_every 1, train.stop_after_step B (the lr schedule still plans the
whole run). `--set` adds overrides (e.g. data.skip_steps=[A], or data.skip=ids.txt). With
data.order: global the replay trains on the run's global batches at any world size; with the
rank order only at the run's world size and num_workers (a warning says so).
"""

from __future__ import annotations

import argparse
import json
import math
import os
from pathlib import Path
from typing import Any

from ringfeed.errors import UserError
from ringfeed.train.observe.runfiles import CONFIG_FILE, METRICS_FILE, checkpoint_dir
from ringfeed.userhooks import UserCode


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "replay",
        help="retrain steps A..B of a run from the checkpoint before A; losses beside the "
             "run's",
        description="Retrain steps A..B of a ringfeed train run (its output.dir) from its "
                    "newest checkpoint before step A, on 1 process or N under horovodrun, and "
                    "print each step's loss beside the run's metrics.jsonl.")
    p.add_argument("run_dir", help="the run's output.dir (config.yaml, metrics.jsonl)")
    p.add_argument("--steps", required=True, metavar="A:B", help="optimizer steps, inclusive")
    p.add_argument("--out", default=None, help="the replay's output.dir "
                                               "(default RUN_DIR/replay-A-B)")
    p.add_argument("--set", dest="overrides", action="append", default=[],
                   metavar="KEY=VALUE", help="override a key of the run's config")
    p.set_defaults(func=run)


def parse_steps(text: str) -> tuple[int, int]:
    """"A:B" -> (A, B), 1 <= A <= B: UserError (one line) otherwise."""
    first, sep, last = text.partition(":")
    try:
        a, b = int(first), int(last if sep else first)
    except ValueError:
        a = b = 0
    if not 1 <= a <= b:
        raise UserError(f"--steps {text!r}: expected A:B, optimizer steps with 1 <= A <= B")
    return a, b


def checkpoint_before(directory: Path, step: int) -> tuple[Path | None, int]:
    """The newest complete checkpoint of `directory` at or before `step` (None, 0: none)."""
    from ringfeed.train.checkpoint.files import list_checkpoints

    found: tuple[Path | None, int] = (None, 0)
    for path in list_checkpoints(directory) if directory.is_dir() else []:
        at = int(path.name.rsplit("-", 1)[-1])
        if at <= step and at >= found[1]:
            found = (path, at)
    return found


def run(args: argparse.Namespace) -> int:
    from ringfeed.train.config import load_config

    first, last = parse_steps(args.steps)
    run_dir = Path(args.run_dir)
    config = run_dir / CONFIG_FILE
    if not config.is_file():
        raise UserError(f"{run_dir}: no config.yaml here (give the output.dir of a ringfeed "
                        "train run)")
    original = load_config(config, args.overrides, check_paths=False)
    checkpoints = Path(checkpoint_dir(run_dir, original.checkpoint.dir))
    start, at = checkpoint_before(checkpoints, first - 1)
    if start is None and first > 1:
        raise UserError(f"{checkpoints}: no checkpoint at or before step {first - 1} (the "
                        "replay starts from one; keep more with checkpoint.every_steps/keep)")
    out = Path(args.out or run_dir / f"replay-{first}-{last}")
    overrides = [*args.overrides, f"output.dir={out}", f"checkpoint.dir={checkpoint_dir(out)}",
                 f"checkpoint.resume={start or 'none'}", "train.log_every=1",
                 f"train.stop_after_step={last}"]
    code = _train(config, overrides, args.user_code)
    if code or not _is_rank_0():
        return code
    if original.data.order != "global":
        print("ringfeed replay: warning: data.order is 'rank': the batches are the run's only "
              "at its world size and data.num_workers (data.order: global makes them the same "
              "at any)")
    print(f"ringfeed replay: steps {at + 1}-{last} from {start.name if start else 'scratch'}, "
          f"log in {out}")
    print(compare(read_losses(run_dir / METRICS_FILE), read_losses(out / METRICS_FILE),
                  first, last, original.train.log_every))
    return 0


def _train(config: Path, overrides: list[str], user_code: UserCode) -> int:
    """`ringfeed train CONFIG --set ...` in this process (its user code is this command's)."""
    from ringfeed.train.main import run as train

    return int(train(argparse.Namespace(config=str(config), overrides=overrides, resume=None,
                                        elastic=False, profile=False, print_config=False,
                                        user_code=user_code, owns_process=False))
               or 0)


def _is_rank_0() -> bool:
    from ringfeed.pipeline.core import horovod_rank_and_size

    return horovod_rank_and_size()[0] == 0 and os.environ.get("HOROVOD_RANK", "0") == "0"


def read_losses(path: Path) -> dict[int, float]:
    """Each logged step's loss in a metrics.jsonl (a resumed run's later record wins)."""
    losses: dict[int, float] = {}
    if not path.is_file():
        return losses
    for line in path.read_text().splitlines():
        try:
            record: dict[str, Any] = json.loads(line)
        except json.JSONDecodeError:
            continue
        if "loss" in record and "event" not in record:
            losses[int(record["step"])] = float(record["loss"])
    return losses


def compare(original: dict[int, float], replay: dict[int, float], first: int, last: int,
            log_every: int) -> str:
    """A table: each step's replay loss beside the run's. The run logged a mean over its
    log_every window; where it logged step s, the replay's mean over the same window is
    compared (when the replay has every step of it)."""
    rows = [f"{'step':>8}  {'replay':>12}  {'original':>12}  {'difference':>10}"]
    worst = 0.0
    for step in range(first, last + 1):
        mine = replay.get(step)
        theirs = original.get(step)
        window = [replay.get(s) for s in range(step - log_every + 1, step + 1)]
        if theirs is not None and log_every > 1 and None not in window:
            mine = sum(window) / len(window)  # type: ignore[arg-type]
        diff = abs(mine - theirs) if mine is not None and theirs is not None else None
        if diff is not None and not math.isnan(diff):
            worst = max(worst, diff)
        rows.append(f"{step:>8}  {_cell(mine):>12}  {_cell(theirs):>12}  "
                    f"{'' if diff is None else f'{diff:.3g}':>10}")
    rows.append(f"max |difference| {worst:.3g}")
    return "\n".join(rows)


def _cell(value: float | None) -> str:
    return "" if value is None else f"{value:.6f}"

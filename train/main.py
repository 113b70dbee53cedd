"""`ringfeed train CONFIG [--set key=value ...] [--resume auto|none|PATH] [--elastic]
[--profile] [--print-config]`.

The config is loaded and validated here, before torch, TensorFlow or Horovod is imported, so a
bad config fails in about a second with one line on every rank.

An error is one line on stderr (train/cli.py prints it) and an exit code, both from the one
table in ringfeed/errors.py (EXIT_STATUSES), which `--help` shows: the line is also what
`ringfeed run` decides a relaunch on (launchers such as horovodrun do not pass a rank's exit
code on). This is also the entry point that prepares the process for a run: the environment
Horovod reads when it loads, the user code the config names, the test-only fault plan.
"""

from __future__ import annotations

import argparse
import atexit
import gc
import os
from typing import Any

from ringfeed.errors import UserError, exit_codes_help
from ringfeed.userhooks import IMPORT_PATH


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "train",
        help="train a model on shards with Horovod (PyTorch or TensorFlow)",
        description="Train on 1 process, or on N under `horovodrun -np N` / `mpirun`. "
                    "One YAML config drives either framework (framework: torch|tensorflow).",
        epilog=f"{exit_codes_help()}. Recovery (restarts, elastic): train/RECOVERY.md.",
    )
    p.add_argument("config", nargs="?", help="YAML config (see --print-config for all keys)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config key, e.g. --set train.max_steps=100 (YAML values)")
    p.add_argument("--resume", default=None, metavar="auto|none|PATH",
                   help="auto: newest complete checkpoint in checkpoint.dir; none; or a "
                        "checkpoint directory (overrides checkpoint.resume)")
    p.add_argument("--elastic", action="store_true",
                   help="Horovod Elastic: run under `horovodrun --min-np N --max-np M "
                        "--host-discovery-script SCRIPT`; workers may leave and join "
                        "(sets elastic.enabled)")
    p.add_argument("--profile", action="store_true",
                   help="profile a few steps (train.profile's defaults unless the config sets "
                        "it): a torch/TF profiler trace and Horovod's timeline in "
                        "<output.dir>/profile/")
    p.add_argument("--print-config", action="store_true",
                   help="print the resolved config (all defaults filled in) and exit")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ringfeed.train.runstate import StartupSignals

    startup = StartupSignals().install()  # before anything slow: a SIGTERM may come any time
    from ringfeed.train.config import load_config, template

    if args.config is None:
        if args.print_config:
            print(template(), end="")
            return 0
        raise UserError("train: a CONFIG file is required (`ringfeed train --print-config` "
                        "shows every key with its default)")
    cfg = load_config(args.config, args.overrides, resume=args.resume,
                      check_paths=not args.print_config, elastic=args.elastic)
    if args.profile and cfg.train.profile is None:
        from ringfeed.train.config import ProfileSection

        cfg.train.profile = ProfileSection()
    if args.print_config:
        print(cfg.to_yaml(), end="")
        return 0
    if cfg.elastic.enabled and os.environ.get("HOROVOD_ELASTIC") != "1":
        raise UserError("elastic.enabled needs an elastic launch: horovodrun --min-np N "
                        "--max-np M --host-discovery-script SCRIPT ... ringfeed train CONFIG "
                        "--elastic (train/RECOVERY.md)")
    from ringfeed.train.backends.horovod_env import apply_horovod_env
    from ringfeed.train.resilience.watchdog import hang_timeout_s

    # Before anything loads Horovod's library: it reads the autotuner's sample settings when it
    # loads, the rest in hvd.init() (the backends apply the section again right before it).
    apply_horovod_env(cfg.horovod, hang_timeout_s=hang_timeout_s(cfg))
    from ringfeed.train.observe.profiler import dynamic_timeline_env
    from ringfeed.train.resilience.faults import FaultPlan

    for name, value in dynamic_timeline_env(cfg).items():
        os.environ.setdefault(name, value)
    faults = FaultPlan.from_env(os.environ)  # tests only: RINGFEED_FAULT, RINGFEED_SLOW_RANK
    args.user_code.named.extend(user_code_named(cfg))
    from ringfeed.train.loop import train
    from ringfeed.train.resilience.exit_bound import bound_exit

    try:
        return train(cfg, user_code=args.user_code, faults=faults, startup=startup)
    finally:  # (what runs after this, at the process's exit, gets train.hang_timeout_s)
        if args.owns_process:
            # At exit the interpreter's finalisation traces every object for cycles: ~1 CPU-s
            # of torch's/TensorFlow's heap a rank. Frozen (gc.freeze, before the exit handlers
            # registered so far) they are still freed by their reference counts; only cycles
            # already unreachable are left, whose finalizers Python does not promise at exit.
            atexit.register(gc.freeze)
        limit = hang_timeout_s(cfg)
        if limit is not None and args.owns_process:
            rank = os.environ.get("HOROVOD_RANK", os.environ.get("OMPI_COMM_WORLD_RANK", "0"))
            bound_exit(limit, cfg.output.dir, int(rank))


def user_code_named(cfg: Any) -> list[tuple[str, str]]:
    """The user code `cfg` names, as (field, "module:function"): model.name unless built in,
    train.loss, train.metrics, and the data hooks by the pipeline's names (decode,
    transform), which its errors have always used."""
    fields = {"model.name": cfg.model.name, "train.loss": cfg.train.loss,
              "train.metrics": cfg.train.metrics, "decode": cfg.data.decode,
              "transform": cfg.data.transform}
    return [(field, path) for field, path in fields.items()
            if isinstance(path, str) and IMPORT_PATH.match(path)]

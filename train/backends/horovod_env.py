"""The `horovod:` config section as Horovod's environment variables.

Horovod reads its knobs (fusion threshold, cycle time, autotuning, timeline, controller) from
the environment once, in hvd.init() (horovod/common/operations.cc) - the autotuner's warm-up and
steps per sample even earlier, when its library is loaded (ParameterManager's constructor runs
for a static object); horovodrun's flags only set the same variables for the ranks it starts.
So `ringfeed train` applies the section before anything imports Horovod, and each backend again
right before hvd.init() on every rank (the same values: for code that builds a backend itself,
where only the knobs read in init() are sure to count). Precedence: a key set in the config wins over the launcher's
flags and the inherited environment (the config is what output.dir records about the run, and
it holds on every launcher); a key left null leaves them alone. Rank 0 prints one line for
each variable the config replaced with another value.

No Horovod import here: the config module checks the launch (`launch_problem`) before any
framework is imported.
"""

from __future__ import annotations

import os
from collections.abc import Callable, MutableMapping
from pathlib import Path
from typing import Any

from ringfeed.errors import UserError

MIB = 1024 * 1024
# Set by horovodrun's Gloo launch (horovod/runner/gloo_run.py); absent under mpirun.
GLOO_RENDEZVOUS = "HOROVOD_GLOO_RENDEZVOUS_ADDR"
MPI_LAUNCH = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK")


def _flag(value: bool) -> str:
    return "1" if value else "0"


def horovod_env(section: Any) -> dict[str, str]:
    """{variable: value} for the keys the section sets (null keys: nothing)."""
    env: dict[str, str] = {}
    if section.fusion_threshold_mb is not None:
        env["HOROVOD_FUSION_THRESHOLD"] = str(int(section.fusion_threshold_mb * MIB))
    if section.cycle_time_ms is not None:
        env["HOROVOD_CYCLE_TIME"] = f"{section.cycle_time_ms:g}"
    if section.hierarchical_allreduce is not None:
        env["HOROVOD_HIERARCHICAL_ALLREDUCE"] = _flag(section.hierarchical_allreduce)
    if section.autotune is not None:
        env["HOROVOD_AUTOTUNE"] = _flag(section.autotune)
    for key, var in (("autotune_log", "HOROVOD_AUTOTUNE_LOG"),
                     ("timeline", "HOROVOD_TIMELINE")):
        if getattr(section, key) is not None:
            env[var] = str(Path(getattr(section, key)).absolute())  # ranks may cd elsewhere
    for key, var in (("autotune_warmup_samples", "HOROVOD_AUTOTUNE_WARMUP_SAMPLES"),
                     ("autotune_steps_per_sample", "HOROVOD_AUTOTUNE_STEPS_PER_SAMPLE")):
        if getattr(section, key) is not None:
            env[var] = str(getattr(section, key))
    if section.controller != "auto":
        # horovodrun sets both to the same library; so does this
        env["HOROVOD_CONTROLLER"] = env["HOROVOD_CPU_OPERATIONS"] = section.controller
    return env


def launch_problem(section: Any, environ: MutableMapping[str, str]) -> str | None:
    """Why this launch cannot give what the section asks for (a config error), or None.

    A controller the launcher did not set up would not fail cleanly: Gloo without horovodrun's
    rendezvous server, or MPI in a process horovodrun started without mpirun, makes every rank
    a world of its own."""
    if section.autotune is not True:
        for key in ("autotune_log", "autotune_warmup_samples", "autotune_steps_per_sample"):
            if getattr(section, key) is not None:
                return f"horovod.{key}: takes effect only with horovod.autotune: true"
    gloo_launch = GLOO_RENDEZVOUS in environ
    mpi_launch = any(var in environ for var in MPI_LAUNCH)
    if section.controller == "mpi" and gloo_launch:
        return ("horovod.controller: mpi, but horovodrun started this process with Gloo; "
                "launch with `horovodrun --mpi ...` or `mpirun ...`, or set controller: auto")
    if section.controller == "gloo" and mpi_launch and not gloo_launch:
        return ("horovod.controller: gloo, but mpirun started this process (Gloo needs "
                "horovodrun's rendezvous); launch with `horovodrun --gloo ...`, or set "
                "controller: auto")
    if section.op == "adasum" and (
            gloo_launch or section.controller == "gloo"):
        # Horovod 0.28.1 builds Adasum for MPI only (operations.cc: AdasumMPIAllreduceOp);
        # under Gloo its background thread fails with "No Adasum operation enabled"
        return ("horovod.op: adasum needs Horovod's MPI controller (Horovod 0.28.1 has no "
                "Gloo Adasum); launch with `mpirun ...` or `horovodrun --mpi ...` and "
                "controller auto or mpi, or use op: average")
    return None


def watchdog_env(hang_timeout_s: float | None, environ: MutableMapping[str, str]
                 ) -> dict[str, str]:
    """What the hang watchdog (train/resilience/watchdog.py, `hang_timeout_s`; None: off) needs from
    Horovod: the hang is the watchdog's to end, with its line and the stacks, so nothing of
    Horovod's may end the job first. Gloo's receive timeout (30 s by default: a stopped rank
    ends the others with HorovodInternalError tracebacks) is raised to hang_timeout_s + 60 s
    where it is lower, and the stall shutdown is off (HOROVOD_STALL_SHUTDOWN_TIME_SECONDS 0,
    Horovod's default; only a launcher's or user's value can set it). The stall check's warning
    (HOROVOD_STALL_CHECK_TIME_SECONDS, 60 s), which names the ranks a collective waits for,
    stays as it is. MPI and NCCL have no timeout of their own to raise."""
    if hang_timeout_s is None:
        return {}
    from ringfeed.train.resilience.watchdog import gloo_timeout_s

    gloo = gloo_timeout_s(hang_timeout_s)
    try:
        before = int(environ.get("HOROVOD_GLOO_TIMEOUT_SECONDS", "0"))
    except ValueError:
        before = 0
    return {"HOROVOD_GLOO_TIMEOUT_SECONDS": str(max(gloo, before)),
            "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": "0"}


def apply_horovod_env(section: Any, environ: MutableMapping[str, str] | None = None,
                      say: Callable[[str], None] = print,
                      hang_timeout_s: float | None = None) -> dict[str, str]:
    """Set the section's variables (before hvd.init()), and those the hang watchdog needs
    (`watchdog_env`; `hang_timeout_s` None: it is off); returns the section's. The timeline's and
    autotune log's directories are created, a failure naming the field."""
    environ = os.environ if environ is None else environ
    environ.update(watchdog_env(hang_timeout_s, environ))
    env = horovod_env(section)
    for key in ("timeline", "autotune_log"):
        value = getattr(section, key)
        if value is not None:
            try:
                Path(value).absolute().parent.mkdir(parents=True, exist_ok=True)
            except OSError as e:
                raise UserError(f"horovod.{key}: cannot create the directory of {value} "
                                f"({e.strerror or e})") from None
    root = environ.get("HOROVOD_RANK", environ.get("OMPI_COMM_WORLD_RANK", "0")) == "0"
    for var, value in env.items():
        before = environ.get(var)
        if root and before is not None and before != value and var != "HOROVOD_CPU_OPERATIONS":
            say(f"ringfeed: horovod config sets {var}={value} (the launcher or environment "
                f"had {before})")
        environ[var] = value
    return env


def check_controller(section: Any, mpi_enabled: bool, gloo_enabled: bool) -> None:
    """After hvd.init(): the controller asked for is the one Horovod runs."""
    running = "mpi" if mpi_enabled else "gloo" if gloo_enabled else "none"
    if section.controller != "auto" and running != section.controller:
        raise UserError(f"horovod.controller: {section.controller} asked for, but Horovod "
                        f"runs {running} (launch with horovodrun --{section.controller})")

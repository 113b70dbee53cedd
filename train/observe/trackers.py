"""Where rank 0's scalars go besides metrics.jsonl: `output.loggers`, any of TensorBoard, MLflow
and Weights & Biases, each one `ScalarSink`.

Every sink gets what metrics.jsonl gets - every scalar of every log record (loss, lr,
throughput, data wait, MFU, validation, mixture shares) at its step - plus the run's resolved
config as parameters at the start and the summary at the end. Rank 0 only.

The trackers are configured their own way, by their environment variables: MLflow's
MLFLOW_TRACKING_URI and MLFLOW_EXPERIMENT_NAME (or _ID), W&B's WANDB_MODE, WANDB_PROJECT,
WANDB_ENTITY, WANDB_DIR (default: output.dir) and WANDB_API_KEY. Nothing of theirs is in the
config, which stays the same for any tracker setup.

A resumed run (checkpoint.resume auto or a path) continues the tracker runs it started: their
ids are kept in `output.dir/trackers.json` (written atomically when a tracker run is created),
so a run killed and resumed is one MLflow run and one W&B run with continuous steps. Points
that the interrupted run logged after its last checkpoint stay in the tracker (their history
cannot be rewritten, unlike metrics.jsonl); the resumed run logs those steps again.

A tracker that cannot start its run is one line, exit 2 (before training). One that fails
later (its server gone) is one warning line and dropped for the rest of the run (Guarded):
training and metrics.jsonl go on.
"""

from __future__ import annotations

import importlib.util
import json
import math
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Protocol

from ringfeed.errors import UserError
from ringfeed.fsutil import atomic_write_text

TRACKERS_FILE = "trackers.json"
# output.loggers entry -> (the module it imports, what to install)
PACKAGES = {"tensorboard": ("tensorboard", "tensorboard"), "mlflow": ("mlflow", "mlflow"),
            "wandb": ("wandb", "wandb")}


class ScalarSink(Protocol):
    """One place rank 0's scalars go."""

    name: str  # the output.loggers entry

    def params(self, params: dict[str, str]) -> None:
        """The run's resolved config, flattened (flat_config), at the start."""

    def scalars(self, step: int, values: dict[str, float]) -> None:
        """One record's finite scalars at optimizer step `step`."""

    def summary(self, step: int, summary: dict[str, Any]) -> None:
        """summary.json's content at the end of the run."""

    def describe(self) -> str:
        """Where to look: one line for the run's summary."""

    def close(self) -> None:
        """Flush and let go (idempotent)."""


def missing_package(loggers: list[str]) -> str | None:
    """A one-line problem for the first logger whose package is not installed, else None
    (checked with the config, before Horovod or any framework starts)."""
    for name in loggers:
        module, package = PACKAGES[name]
        if importlib.util.find_spec(module) is None:
            return (f"output.loggers: {name} needs the {package!r} package, which is not "
                    f"installed (pip install {package}, or take {name} out of output.loggers)")
    return None


def flat_config(tree: dict[str, Any], prefix: str = "") -> dict[str, str]:
    """The config as {"optim.lr": "0.01", ...}: nested mappings joined with dots, values as
    text (lists and None as JSON)."""
    out: dict[str, str] = {}
    for key, value in tree.items():
        name = f"{prefix}.{key}" if prefix else str(key)
        if isinstance(value, dict) and value:
            out.update(flat_config(value, name))
        else:
            out[name] = value if isinstance(value, str) else json.dumps(value)
    return out


def finite_scalars(record: dict[str, Any], skip: tuple[str, ...] = ("step", "epoch", "time")
                   ) -> dict[str, float]:
    """The numbers of a log record that a tracker can plot (not the step, epoch or time)."""
    return {k: float(v) for k, v in record.items() if k not in skip
            and isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)}


def summary_scalars(summary: dict[str, Any], prefix: str = "summary") -> Iterator[tuple[str,
                                                                                       float]]:
    """summary.json's numbers, nested keys joined with "/" under `prefix`."""
    for key, value in summary.items():
        name = f"{prefix}/{key}"
        if isinstance(value, dict):
            yield from summary_scalars(value, name)
        elif isinstance(value, (int, float)) and not isinstance(value, bool) \
                and math.isfinite(value):
            yield name, float(value)


class RunIds:
    """output.dir/trackers.json: {tracker: {"id": ..., ...}} of the tracker runs this run
    logs to, read to continue them after a resume and written atomically when one starts."""

    def __init__(self, out_dir: Path):
        self.path = Path(out_dir) / TRACKERS_FILE

    def read(self) -> dict[str, dict[str, Any]]:
        try:
            data = json.loads(self.path.read_text())
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as e:
            raise UserError(f"{self.path}: cannot read the tracker run ids ({e}; delete it to "
                            "start new tracker runs)") from None
        return data if isinstance(data, dict) else {}

    def record(self, name: str, entry: dict[str, Any]) -> None:
        data = self.read()
        data[name] = entry
        atomic_write_text(self.path, json.dumps(data, indent=2) + "\n")


# -- TensorBoard ----------------------------------------------------------------------------
class TensorBoardSink:
    """Scalars into `<output.dir>/tensorboard/` (runfiles.EventWriter: tensorboard's own record
    writer, no framework); the params and the summary are in config.yaml and summary.json."""

    name = "tensorboard"

    def __init__(self, logdir: Path):
        self.logdir = Path(logdir)
        self._events: Any = None

    def start(self) -> TensorBoardSink:
        from ringfeed.train.observe.runfiles import EventWriter

        self._events = EventWriter(self.logdir)
        return self

    def params(self, params: dict[str, str]) -> None:
        pass

    def scalars(self, step: int, values: dict[str, float]) -> None:
        self._events.scalars(step, values)

    def summary(self, step: int, summary: dict[str, Any]) -> None:
        pass

    def describe(self) -> str:
        return str(self.logdir)

    def close(self) -> None:
        if self._events is not None:
            self._events.close()
            self._events = None


# -- MLflow ---------------------------------------------------------------------------------
_MLFLOW_KEY = re.compile(r"[^\w\-. /]")  # MLflow's allowed key characters


class MlflowSink:
    """An MLflow run on the tracking server of MLFLOW_TRACKING_URI (MlflowClient's default),
    in MLFLOW_EXPERIMENT_NAME / MLFLOW_EXPERIMENT_ID (else MLflow's default experiment),
    named after output.dir. Metrics go in asynchronous batches (a slow server does not hold
    up the steps); close() waits for them and ends the run: FINISHED, KILLED (stopped by a
    signal) or FAILED (an error, no summary); a resume sets it RUNNING again."""

    name = "mlflow"

    def __init__(self, run_name: str):
        self.run_name = run_name
        self.client: Any = None
        self.run_id: str | None = None
        self._pending: list[Any] = []
        self._status = "FAILED"  # until the summary says how the run ended

    def start(self, ids: RunIds, resume: bool) -> MlflowSink:
        import os

        from mlflow import MlflowClient

        self.client = MlflowClient()
        uri = self.client.tracking_uri
        previous = ids.read().get(self.name) if resume else None
        try:
            if previous:
                self.run_id = previous["id"]
                self.client.update_run(self.run_id, status="RUNNING")
            else:
                experiment = os.environ.get("MLFLOW_EXPERIMENT_ID")
                name = os.environ.get("MLFLOW_EXPERIMENT_NAME")
                if experiment is None and name:
                    found = self.client.get_experiment_by_name(name)
                    experiment = (found.experiment_id if found is not None
                                  else self.client.create_experiment(name))
                run = self.client.create_run(experiment or "0", run_name=self.run_name)
                self.run_id = run.info.run_id
        except Exception as e:  # noqa: BLE001 - any failure of the tracker is one line
            raise UserError(f"output.loggers: mlflow: cannot {'continue' if previous else 'start'}"
                            f" a run at {uri} ({_first_line(e)}); check MLFLOW_TRACKING_URI"
                            ) from None
        if not previous:
            ids.record(self.name, {"id": self.run_id, "tracking_uri": uri})
        return self

    def params(self, params: dict[str, str]) -> None:
        from mlflow.entities import Param
        from mlflow.utils.validation import MAX_PARAM_VAL_LENGTH, MAX_PARAMS_TAGS_PER_BATCH

        # MLflow's params cannot change once logged: a resumed run adds only new keys
        logged = self.client.get_run(self.run_id).data.params
        items = [Param(_mlflow_key(k), v[:MAX_PARAM_VAL_LENGTH]) for k, v in params.items()
                 if _mlflow_key(k) not in logged]
        for i in range(0, len(items), MAX_PARAMS_TAGS_PER_BATCH):
            self.client.log_batch(self.run_id, params=items[i:i + MAX_PARAMS_TAGS_PER_BATCH])

    def scalars(self, step: int, values: dict[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(_mlflow_key(k), v, now, step) for k, v in values.items()]
        self._pending.append(self.client.log_batch(self.run_id, metrics=metrics,
                                                   synchronous=False))

    def summary(self, step: int, summary: dict[str, Any]) -> None:
        self.scalars(step, dict(summary_scalars(summary)))
        self._wait()
        self.client.set_tag(self.run_id, "ringfeed.status", str(summary.get("status")))
        self._status = "FINISHED" if summary.get("status") == "finished" else "KILLED"

    def describe(self) -> str:
        return f"{self.client.tracking_uri} run {self.run_id}"

    def _wait(self) -> None:
        pending, self._pending = self._pending, []
        for operation in pending:
            if operation is not None:
                operation.wait()

    def close(self) -> None:
        if self.run_id is None:
            return
        try:
            self._wait()
            self.client.set_terminated(self.run_id, self._status)
        finally:
            self.run_id = None


def _mlflow_key(key: str) -> str:
    return _MLFLOW_KEY.sub("_", key)[:250]


# -- Weights & Biases -----------------------------------------------------------------------
class WandbSink:
    """A W&B run (wandb.init: WANDB_MODE online/offline, WANDB_PROJECT - default "ringfeed" -,
    WANDB_ENTITY, WANDB_DIR - default output.dir -), named after output.dir, the config as its
    config, every record with `step=` the optimizer step, the summary in the run's summary."""

    name = "wandb"

    def __init__(self, out_dir: Path, run_name: str):
        self.out_dir, self.run_name = Path(out_dir), run_name
        self.run: Any = None
        self._exit_code = 1  # a run that ends without its summary ended in an error

    def start(self, ids: RunIds, resume: bool) -> WandbSink:
        import os

        import wandb

        previous = ids.read().get(self.name) if resume else None
        try:
            self.run = wandb.init(
                project=os.environ.get("WANDB_PROJECT") or "ringfeed",
                dir=os.environ.get("WANDB_DIR") or str(self.out_dir),
                name=self.run_name, id=previous["id"] if previous else None,
                resume="allow" if previous else None, reinit="create_new")
        except Exception as e:  # noqa: BLE001 - any failure of the tracker is one line
            raise UserError(f"output.loggers: wandb: cannot start a run ({_first_line(e)}); "
                            "check WANDB_MODE, WANDB_API_KEY, WANDB_PROJECT") from None
        if not previous:
            ids.record(self.name, {"id": self.run.id, "project": self.run.project})
        return self

    def params(self, params: dict[str, str]) -> None:
        self.run.config.update(params, allow_val_change=True)

    def scalars(self, step: int, values: dict[str, float]) -> None:
        self.run.log(values, step=step)

    def summary(self, step: int, summary: dict[str, Any]) -> None:
        self.run.summary.update(dict(summary_scalars(summary)))
        self.run.summary["summary/status"] = str(summary.get("status"))
        self._exit_code = 0

    def describe(self) -> str:
        return f"run {self.run.id} ({self.run.dir})"

    def close(self) -> None:
        if self.run is not None:
            run, self.run = self.run, None
            run.finish(exit_code=self._exit_code)


class Guarded:
    """A tracker sink whose failures after its start do not stop training: the first one is
    one warning line on rank 0 (the tracker and why), and the sink is dropped for the rest of
    the run (metrics.jsonl and the other sinks keep everything)."""

    def __init__(self, sink: ScalarSink):
        self.sink, self.name = sink, sink.name
        self.failed = False

    def _call(self, what: str, *args: Any) -> None:
        if self.failed:
            return
        try:
            getattr(self.sink, what)(*args)
        except Exception as e:  # noqa: BLE001 - a tracker outage must not stop training
            self.failed = True
            print(f"ringfeed: warning: output.loggers: {self.name} failed ({_first_line(e)}); "
                  "nothing more goes to it in this run (metrics.jsonl has everything)",
                  flush=True)

    def params(self, params: dict[str, str]) -> None:
        self._call("params", params)

    def scalars(self, step: int, values: dict[str, float]) -> None:
        self._call("scalars", step, values)

    def summary(self, step: int, summary: dict[str, Any]) -> None:
        self._call("summary", step, summary)

    def describe(self) -> str:
        return f"{self.sink.describe()}{' (failed, see above)' if self.failed else ''}"

    def close(self) -> None:
        self._call("close")


def open_sinks(loggers: list[str], out_dir: Path, resume: bool, config: dict[str, Any]
               ) -> list[ScalarSink]:
    """Rank 0: the sinks of `loggers` started (tracker runs created, or continued when
    `resume` and trackers.json has their ids), each given the flattened `config`."""
    out_dir = Path(out_dir)
    ids, name = RunIds(out_dir), out_dir.resolve().name
    sinks: list[ScalarSink] = []
    try:
        for logger in loggers:
            if logger == "tensorboard":
                sinks.append(TensorBoardSink(out_dir / "tensorboard").start())
            elif logger == "mlflow":
                sinks.append(Guarded(MlflowSink(name).start(ids, resume)))
            else:
                sinks.append(Guarded(WandbSink(out_dir, name).start(ids, resume)))
        params = flat_config(config)
        for sink in sinks:
            sink.params(params)
    except BaseException:
        close_sinks(sinks)
        raise
    return sinks


def close_sinks(sinks: list[ScalarSink]) -> None:
    """Close every sink, the others too when one fails (its error is raised after)."""
    error: BaseException | None = None
    for sink in sinks:
        try:
            sink.close()
        except Exception as e:  # noqa: BLE001 - close the rest first
            error = error or e
    if error is not None:
        raise error


def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0]}" if text else type(error).__name__

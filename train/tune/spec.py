"""The `ringfeed tune` search file: schema, the space syntax, and the trial configs made from it.

    base: examples/configs/digits.yaml        # a trainer config (path, or an inline mapping)
    set: {train.max_steps: 200}               # fixed overrides for every trial
    space:                                    # dotted keys into the trainer config
      optim.lr: loguniform(1e-4, 1e-1)
      train.accumulate: choice(1, 2, 4)
    metric: val_accuracy                      # a key of the trial's metrics.jsonl
    direction: maximize
    launch: horovodrun -np 2 -H localhost:2 ringfeed train {config}

Everything is checked before any trial starts, like the trainer's own config: the file against
its schema, every space key against the trainer's schema, the base config with the fixed
overrides (shards exist, ...) and every bound or choice of the space as a config value. Any
problem is one line naming the field (UserError, exit 2).

Relative paths (`base`, `output`, and the paths inside the trainer config) are resolved against
the current directory, as `ringfeed train` does.
"""

from __future__ import annotations

import copy
import difflib
import math
import re
import shlex
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    NonNegativeInt,
    PositiveFloat,
    PositiveInt,
    ValidationError,
    field_validator,
)

from ringfeed.errors import UserError
from ringfeed.fsutil import atomic_write_text
from ringfeed.train.config import read_yaml_mapping

# Keys the tuner owns: every trial gets its own run dir, checkpoints inside it, and its resume.
MANAGED_KEYS = ("output.dir", "checkpoint.dir", "checkpoint.resume")
# What a PBT member may change when it continues from a checkpoint: keys that do not change what
# a checkpoint holds (model shapes) or what its data position means (batch sizes, shards).
PBT_PREFIXES = ("optim.", "train.grad_clip")
PLACEHOLDERS = re.compile(r"\{(config|run_dir|trial)\}")
SPACE_SYNTAX = "loguniform(a, b), uniform(a, b), int(a, b) or choice(x, y, ...)"
_CALL = re.compile(r"^\s*(loguniform|uniform|int|choice)\s*\((.*)\)\s*$", re.DOTALL)
_NUMBER = re.compile(r"^[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?$")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class PrunerSection(_Strict):
    """Stops bad trials early from the values they stream (TPE only)."""

    name: Literal["asha", "median", "none"] = "none"
    # asha (optuna's SuccessiveHalvingPruner): the first rung, in the metric's steps
    min_resource: PositiveInt | Literal["auto"] = "auto"
    reduction_factor: int = Field(3, ge=2)
    # median (MedianPruner): compare only after this many trials finished / steps were reported
    startup_trials: NonNegativeInt = 3
    warmup_steps: NonNegativeInt = 0


class PBTSection(_Strict):
    population: int = Field(4, ge=2)
    interval: PositiveInt = 100  # steps between exploit/explore decisions
    quantile: float = Field(0.25, gt=0.0, le=0.5)  # bottom quantile copies from the top one
    perturb: tuple[PositiveFloat, PositiveFloat] = (0.8, 1.2)
    resample_probability: float = Field(0.25, ge=0.0, le=1.0)


class StudySection(_Strict):
    name: str | None = None  # default: the search file's name without .yaml
    storage: str | None = None  # any SQLAlchemy URL; default sqlite:///<output>/study.db
    # Workers sharing a database notice a dead worker's trials by their heartbeat
    # (a trial is failed and retried after grace = 4 heartbeats without one).
    heartbeat_s: PositiveInt = 30


class SearchFile(_Strict):
    base: str | dict[str, Any]
    set: dict[str, Any] = Field(default_factory=dict)
    space: dict[str, str]
    metric: str
    direction: Literal["minimize", "maximize"]
    algorithm: Literal["tpe", "pbt"] = "tpe"
    trials: PositiveInt = 20  # TPE: finished trials (complete, pruned or crashed)
    hours: PositiveFloat | None = None  # wall-clock budget of one `ringfeed tune` invocation
    parallel: PositiveInt = 1  # trials (each a multi-rank job) at a time
    seed: int = 0
    launch: str | list[str]
    pruner: PrunerSection = Field(default_factory=PrunerSection)
    pbt: PBTSection = Field(default_factory=PBTSection)
    study: StudySection = Field(default_factory=StudySection)
    output: str | None = None  # default: runs/tune-<search file name>
    initial: list[dict[str, Any]] = Field(default_factory=list)  # points to try first (TPE)
    trial_timeout_s: PositiveFloat | None = None
    retries: NonNegativeInt = 2  # reruns of a trial interrupted by a dead worker

    @field_validator("space")
    @classmethod
    def _space_not_empty(cls, v: dict[str, str]) -> dict[str, str]:
        if not v:
            raise ValueError("no keys to search (e.g. optim.lr: loguniform(1e-4, 1e-1))")
        return v

    @field_validator("metric")
    @classmethod
    def _metric_name(cls, v: str) -> str:
        if not re.fullmatch(r"loss|val_\w+", v):
            raise ValueError("expected loss (training) or val_<name> (validation), e.g. "
                             "val_accuracy, val_loss")
        return v

    @field_validator("launch")
    @classmethod
    def _launch(cls, v: str | list[str]) -> str | list[str]:
        tokens = shlex.split(v) if isinstance(v, str) else v
        if not tokens or not any("{config}" in t for t in tokens):
            raise ValueError("the command must contain {config} (where the trial's config "
                             "goes), e.g. horovodrun -np 2 ringfeed train {config}")
        return v


# -- the space --------------------------------------------------------------------------------
@dataclass
class Param:
    """One searched key: `kind` is loguniform | uniform | int | choice."""

    key: str
    kind: str
    low: float = 0.0
    high: float = 0.0
    choices: list[Any] = field(default_factory=list)

    @property
    def _encoded(self) -> list[Any]:
        # optuna's categorical values are scalars; lists/mappings travel as their YAML text
        return [c if _scalar(c) else _flow_yaml(c) for c in self.choices]

    def distribution(self):  # -> optuna.distributions.BaseDistribution
        from optuna.distributions import (
            CategoricalDistribution,
            FloatDistribution,
            IntDistribution,
        )

        if self.kind == "choice":
            return CategoricalDistribution(self._encoded)
        if self.kind == "int":
            return IntDistribution(int(self.low), int(self.high))
        return FloatDistribution(self.low, self.high, log=self.kind == "loguniform")

    def decode(self, value: Any) -> Any:
        """The config value of an optuna parameter value."""
        if self.kind == "choice" and value in self._encoded:
            return self.choices[self._encoded.index(value)]
        return value

    def extremes(self) -> list[Any]:
        """The values that must each be valid in the trainer config."""
        if self.kind == "choice":
            return list(self.choices)
        if self.kind == "int":
            return [int(self.low), int(self.high)]
        return [self.low, self.high]

    def sample(self, rng) -> Any:
        """A fresh draw (optuna parameter value), for PBT's resample."""
        if self.kind == "choice":
            return self._encoded[rng.randrange(len(self.choices))]
        if self.kind == "int":
            return rng.randint(int(self.low), int(self.high))
        if self.kind == "loguniform":
            return math.exp(rng.uniform(math.log(self.low), math.log(self.high)))
        return rng.uniform(self.low, self.high)

    def perturb(self, value: Any, factor: float, rng) -> Any:
        """PBT's explore step: a number scaled by `factor` (kept inside the range); a choice
        moves to a neighbouring one."""
        if self.kind == "choice":
            i = self._encoded.index(value) if value in self._encoded else 0
            j = min(len(self.choices) - 1, max(0, i + (1 if factor > 1 else -1)))
            return self._encoded[j]
        if self.kind == "int":
            new = int(round(value * factor))
            if new == value:  # small ints would never move
                new = value + (1 if factor > 1 else -1)
            return int(min(self.high, max(self.low, new)))
        return float(min(self.high, max(self.low, value * factor)))


def parse_param(key: str, text: Any) -> Param:
    """`loguniform(1e-4, 1e-1)` etc. -> Param; ValueError with the reason."""
    match = _CALL.match(text) if isinstance(text, str) else None
    if not match:
        raise ValueError(f"expected {SPACE_SYNTAX} (got {text!r})")
    kind, inner = match.groups()
    try:
        args = yaml.safe_load(f"[{inner}]")
    except yaml.YAMLError:
        raise ValueError(f"cannot read the arguments of {text!r}") from None
    args = [_number(a) for a in args]
    if kind == "choice":
        if not args:
            raise ValueError("choice() needs at least one value")
        return Param(key, kind, choices=args)
    if len(args) != 2 or not all(isinstance(a, (int, float)) and not isinstance(a, bool)
                                 for a in args):
        raise ValueError(f"{kind}() takes two numbers, low and high (got {text!r})")
    low, high = args
    if kind == "int" and not all(float(a).is_integer() for a in args):
        raise ValueError(f"int() takes two integers (got {text!r})")
    if not low < high:
        raise ValueError(f"low must be below high (got {text!r})")
    if kind == "loguniform" and low <= 0:
        raise ValueError(f"loguniform() needs 0 < low (got {text!r})")
    return Param(key, kind, float(low), float(high))


def _number(value: Any) -> Any:
    # YAML 1.1 reads 1e-4 (no dot) as a string; the space syntax means a number
    if isinstance(value, str) and _NUMBER.match(value):
        return float(value) if any(c in value for c in ".eE") else int(value)
    return value


def _scalar(value: Any) -> bool:
    return value is None or isinstance(value, (bool, int, float, str))


def _flow_yaml(value: Any) -> str:
    return yaml.safe_dump(value, default_flow_style=True, sort_keys=False).strip()


def check_config_key(key: str) -> str | None:
    """Why `key` (dotted) is not a leaf key of the trainer config, or None if it is one."""
    from pydantic import BaseModel as _Model

    from ringfeed.train.config import RunConfig

    model: type[_Model] | None = RunConfig
    parts = key.split(".")
    for i, part in enumerate(parts):
        if model is None:  # inside a free-form mapping (model.args): anything goes
            return None
        fields = model.model_fields
        if part not in fields:
            close = difflib.get_close_matches(part, list(fields), n=1)
            prefix = ".".join(parts[:i])
            hint = (f" (did you mean {'.'.join([*parts[:i], close[0]])!r}?)" if close
                    else f" (keys of {prefix or 'the config'}: {', '.join(fields)})")
            return f"not a key of the trainer config{hint}"
        kind, sub = _field_kind(fields[part].annotation)
        last = i == len(parts) - 1
        if kind == "section":
            if last:
                return "is a section; name one of its keys"
            model = sub
        elif kind == "mapping":
            model = None
        elif not last:
            return f"{'.'.join(parts[:i + 1])} is a value, not a section"
    return None


def _field_kind(annotation: Any) -> tuple[str, Any]:
    """("section", model) | ("mapping", None) | ("value", None) for a pydantic annotation."""
    options = (typing.get_args(annotation)
               if typing.get_origin(annotation) in (typing.Union, types.UnionType)
               else (annotation,))
    for option in options:
        if isinstance(option, type) and issubclass(option, BaseModel):
            return "section", option
        if option is dict or typing.get_origin(option) is dict:
            return "mapping", None
    return "value", None


# -- loading and checking ---------------------------------------------------------------------
@dataclass
class Search:
    """A checked search file, ready to run."""

    path: Path
    spec: SearchFile
    base_raw: dict[str, Any]
    params: list[Param]
    out_dir: Path
    study_name: str
    storage_url: str

    @property
    def param(self) -> dict[str, Param]:
        return {p.key: p for p in self.params}

    def distributions(self) -> dict[str, Any]:
        return {p.key: p.distribution() for p in self.params}

    def config_values(self, params: dict[str, Any]) -> dict[str, Any]:
        """optuna parameter values -> trainer config values (dotted keys)."""
        return {k: self.param[k].decode(v) if k in self.param else v for k, v in params.items()}

    def trial_config(self, params: dict[str, Any], run_dir: Path, resume: str = "none",
                     extra: dict[str, Any] | None = None) -> dict[str, Any]:
        """The base config with the fixed overrides, these (optuna) parameter values and the
        trial's own run dir; checkpoints go to <run_dir>/checkpoints."""
        raw = copy.deepcopy(self.base_raw)
        values = {**self.spec.set, **self.config_values(params), **(extra or {})}
        for key, value in values.items():
            set_dotted(raw, key, value)
        set_dotted(raw, "output.dir", str(run_dir))
        checkpoint = raw.setdefault("checkpoint", {})
        checkpoint.pop("dir", None)
        checkpoint["resume"] = resume
        return raw

    def write_trial_config(self, path: Path, raw: dict[str, Any], header: str = "") -> Path:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(path, header + yaml.safe_dump(raw, sort_keys=False))
        return path

    def command(self, config: Path, run_dir: Path, trial: int) -> list[str]:
        """The launch template with its placeholders filled in (split first, so paths with
        spaces stay one argument; no shell)."""
        launch = self.spec.launch
        tokens = shlex.split(launch) if isinstance(launch, str) else list(launch)
        values = {"config": str(config), "run_dir": str(run_dir), "trial": str(trial)}
        return [PLACEHOLDERS.sub(lambda m: values[m.group(1)], t) for t in tokens]


def set_dotted(raw: dict[str, Any], key: str, value: Any) -> None:
    node = raw
    parts = key.split(".")
    for part in parts[:-1]:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise UserError(f"{key}: {part} is not a section in the base config")
    node[parts[-1]] = value


def get_dotted(raw: dict[str, Any], key: str, default: Any = None) -> Any:
    node: Any = raw
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            return default
        node = node[part]
    return node


def load_search(path: str | Path) -> Search:
    """Read and check a search file; UserError (one line naming the field) on any problem."""
    path = Path(path)
    data = read_yaml_mapping(path, "search file", "a mapping (base, space, metric, direction, launch)")
    try:
        spec = SearchFile.model_validate(data)
    except ValidationError as e:
        raise UserError(f"{path}: {_describe(e)}") from None

    params = []
    for key, text in spec.space.items():
        _check_key(path, "space", key, pbt=spec.algorithm == "pbt")
        try:
            params.append(parse_param(key, text))
        except ValueError as e:
            raise UserError(f"{path}: space.{key}: {e}") from None
    for key in spec.set:
        _check_key(path, "set", key, pbt=False)
    for i, point in enumerate(spec.initial):
        for key, value in point.items():
            if key not in spec.space:
                raise UserError(f"{path}: initial[{i}].{key}: not a key of space")
            if not _contains(params[list(spec.space).index(key)], value):
                raise UserError(f"{path}: initial[{i}].{key}: {value!r} is outside the space "
                                f"({spec.space[key]})")

    base_raw = _read_base(path, spec.base)
    name = spec.study.name or path.stem
    out_dir = Path(spec.output or f"runs/tune-{path.stem}").resolve()
    storage = spec.study.storage or f"sqlite:///{out_dir / 'study.db'}"
    search = Search(path, spec, base_raw, params, out_dir, name, storage)
    _check_configs(search)
    if spec.algorithm == "pbt":
        _check_pbt(search)
    return search


def _check_key(path: Path, section: str, key: str, pbt: bool) -> None:
    if key in MANAGED_KEYS:
        raise UserError(f"{path}: {section}.{key}: set by ringfeed tune for every trial "
                        "(each trial has its own run dir under output)")
    why = check_config_key(key)
    if why:
        raise UserError(f"{path}: {section}.{key}: {why}")
    if pbt and not key.startswith(PBT_PREFIXES):
        raise UserError(f"{path}: space.{key}: PBT continues members from checkpoints, so it "
                        f"can only tune keys a resumed run may change ({', '.join(PBT_PREFIXES)}"
                        "...); use algorithm: tpe for this key")


def _contains(param: Param, value: Any) -> bool:
    if param.kind == "choice":
        return value in param.choices
    return isinstance(value, (int, float)) and param.low <= value <= param.high


def _read_base(path: Path, base: str | dict[str, Any]) -> dict[str, Any]:
    if isinstance(base, dict):
        return copy.deepcopy(base)
    try:
        raw = yaml.safe_load(Path(base).read_text())
    except FileNotFoundError:
        raise UserError(f"{path}: base: {base} not found (a trainer config; relative paths "
                        "are from the current directory)") from None
    except yaml.YAMLError as e:
        raise UserError(f"{path}: base: {base} is not valid YAML "
                        f"({' '.join(str(e).split())})") from None
    if not isinstance(raw, dict):
        raise UserError(f"{path}: base: {base} is not a trainer config (a mapping)")
    return raw


def _check_configs(search: Search) -> None:
    """The base config with the fixed overrides must load (shards found, ...), and so must every
    bound and choice of every searched key: a typo fails here, not after an hour of trials."""
    from ringfeed.train.config import load_config

    path, scratch = search.path, search.out_dir / ".check"
    check_file = scratch / "config.yaml"

    def check(params: dict[str, Any], where: str, check_paths: bool) -> None:
        raw = search.trial_config({}, scratch / "run", extra=params)
        search.write_trial_config(check_file, raw)
        try:
            load_config(check_file, check_paths=check_paths)
        except UserError as e:
            reason = str(e).removeprefix(f"{check_file}: ")
            raise UserError(f"{path}: {where}: {reason}") from None

    try:
        base_where = "base" if not search.spec.set else "base + set"
        check({}, base_where, check_paths=True)
        for p in search.params:
            for value in p.extremes():
                check({p.key: value}, f"space.{p.key}: with {p.key}={value!r}", False)
    finally:
        import shutil

        shutil.rmtree(scratch, ignore_errors=True)


def _check_pbt(search: Search) -> None:
    path, raw = search.path, search.trial_config({}, Path("unused"))
    total = get_dotted(raw, "train.max_steps")
    if not isinstance(total, int) or total <= 0:
        raise UserError(f"{path}: pbt: needs train.max_steps in the base config (or in set:): "
                        "the members train in intervals of pbt.interval steps up to it")
    if search.spec.pbt.interval >= total:
        raise UserError(f"{path}: pbt.interval: {search.spec.pbt.interval} is not below "
                        f"train.max_steps ({total}): there would be nothing to exploit")
    if get_dotted(raw, "optim.schedule", "constant") != "constant":
        raise UserError(f"{path}: set.optim.schedule: PBT runs each interval as a run to its "
                        "end step, so a decaying schedule would restart every interval; use "
                        "optim.schedule: constant (and let PBT move optim.lr)")


def _describe(error: ValidationError) -> str:
    """pydantic's first error as `field: message`, with a hint for unknown keys."""
    err = error.errors()[0]
    loc = ".".join(str(p) for p in err["loc"])
    if err["type"] == "extra_forbidden":
        fields = _fields_at(err["loc"][:-1])
        close = difflib.get_close_matches(str(err["loc"][-1]), fields, n=1)
        hint = f"did you mean {close[0]!r}?" if close else f"valid keys: {', '.join(fields)}"
        return f"{loc}: unknown key ({hint})"
    if err["type"] == "missing":
        return f"{loc}: required key is missing"
    got = err.get("input")
    shown = "" if isinstance(got, (dict, type(None))) else f" (got {got!r})"
    return f"{loc}: {err['msg'].removeprefix('Value error, ')}{shown}"


def _fields_at(loc: tuple) -> list[str]:
    model: type[BaseModel] = SearchFile
    for part in loc:
        field_info = model.model_fields.get(str(part))
        kind, sub = _field_kind(field_info.annotation if field_info else None)
        if kind != "section":
            return []
        model = sub
    return list(model.model_fields)

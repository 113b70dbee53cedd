"""Studies and search files for the direct tests of train/tune/ (no trial is launched): a
checked `Search` built from fields, optuna trials with the user attrs the tuner writes, and
checkpoints as the trainer publishes them."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ringfeed.train.tune.spec import Search, SearchFile, parse_param

BASE = {"framework": "torch", "model": {"name": "mlp", "args": {"num_classes": 3}},
        "data": {"train": "shards", "batch_size": 4}, "optim": {"name": "sgd", "lr": 0.1},
        "train": {"max_steps": 30}}


def make_search(out_dir: Path, **fields: Any) -> Search:
    """A Search as load_search makes it (without its config checks, which need shards)."""
    data = {"base": BASE, "space": {"optim.lr": "loguniform(1e-4, 1e-1)"},
            "metric": "val_accuracy", "direction": "maximize",
            "launch": "horovodrun -np 2 ringfeed train {config}", **fields}
    spec = SearchFile.model_validate(data)
    params = [parse_param(key, text) for key, text in spec.space.items()]
    storage = spec.study.storage or f"sqlite:///{out_dir / 'study.db'}"
    return Search(out_dir / "search.yaml", spec, dict(spec.base), params, out_dir,
                  spec.study.name or "search", storage)


def memory_study(direction: str = "maximize"):
    import optuna

    optuna.logging.set_verbosity(optuna.logging.ERROR)
    return optuna.create_study(direction=direction)


def add_trial(study, search: Search, state: str = "COMPLETE", value: float | None = None,
              params: dict[str, Any] | None = None, steps: dict[int, float] | None = None,
              **attrs: Any):
    """A finished trial in `study` (optuna's create_trial): its state, value, parameters,
    streamed values and user attrs. Returns its FrozenTrial, numbered."""
    import optuna
    from optuna.trial import TrialState

    params = params or {p.key: p.distribution().choices[0] if p.kind == "choice" else p.low
                        for p in search.params}
    trial = optuna.trial.create_trial(
        state=TrialState[state], value=value if state == "COMPLETE" else None,
        params=params, distributions={k: search.param[k].distribution() for k in params},
        user_attrs=attrs, intermediate_values=steps or {})
    study.add_trial(trial)
    return study.get_trials(deepcopy=False)[-1]


def write_checkpoint_dir(run_dir: Path, step: int) -> Path:
    """ckpt-<step> under run_dir/checkpoints, published as the trainer does (payload, then
    meta.json with its hashes)."""
    from ringfeed.train.checkpoint.files import write_checkpoint

    def payload(tmp: Path) -> None:
        (tmp / "state.pt").write_bytes(json.dumps({"step": step}).encode())

    return Path(write_checkpoint(run_dir / "checkpoints", step, {"epoch": 0}, payload, keep=100))

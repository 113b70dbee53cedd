"""model.sync_batchnorm (issue 46): BatchNorm over the global batch.

With it, 2 ranks x batch b end with the weights and BatchNorm running statistics of 1 rank x
batch 2b (an MLP with BatchNorm1d and a convnet with BatchNorm2d, a few SGD steps through the
real backend step and Horovod's allreduce); without it the same comparison differs, since
each rank normalises with its own half. A tensorflow run asking for it is one config line.

This file is also the worker: `python tests/test_recipe_sync_bn.py OUT` runs the scenarios at
the launch's world size and rank 0 writes every rank's weights to OUT.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from helpers import BIN, REPO, horovodrun, run, test_env
from train_util import (
    CLASSES,
    FEATURES,
    IMAGE,
    bn_mlp,
    toy_arrays,
    toy_config,
    toy_images,
    write_config,
    write_toy_shards,
)

WORKER = Path(__file__).resolve()
GLOBAL_BATCH, STEPS = 16, 4
MODELS = {"mlp": "train_util:bn_mlp", "cnn": "test_recipe_sync_bn:bn_convnet"}

pytestmark = pytest.mark.system  # starts processes (tests/conftest.py)


def bn_convnet(spec: Any, num_classes: int):
    """A conv layer, BatchNorm2d, a linear head (NCHW input)."""
    from torch import nn

    channels = spec.input_shape[-1]
    return nn.Sequential(nn.Conv2d(channels, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(),
                         nn.Flatten(), nn.Linear(4 * spec.input_shape[0] * spec.input_shape[1],
                                                 num_classes))


def _train(model: str, sync: bool) -> dict[str, Any]:
    """STEPS steps on fixed global batches; rank r of N feeds rows [r*G/N, (r+1)*G/N). Rank 1's
    half is shifted, so the halves' BatchNorm statistics differ clearly."""
    from ringfeed.train.backends.select import make_backend
    from ringfeed.train.config import RunConfig
    from ringfeed.train.data import CLASSIFY, DataSpec

    image = model == "cnn"
    shape = IMAGE if image else (FEATURES,)
    cfg = RunConfig.model_validate({
        "framework": "torch",
        "model": {"name": MODELS[model], "args": {"num_classes": CLASSES},
                  "sync_batchnorm": sync},
        "data": {"train": "unused", "batch_size": GLOBAL_BATCH},
        "optim": {"name": "sgd", "lr": 0.1, "momentum": 0.9, "scale_lr_with_world_size": False},
        "train": {"seed": 7, "average_bn_stats": False}})
    backend = make_backend(cfg)
    backend.build(DataSpec(CLASSIFY, "x.npy", "y.npy", shape, num_classes=CLASSES))
    backend.sync_from_root(resumed=False)
    rank, size = backend.dist.rank, backend.dist.size
    per_rank = GLOBAL_BATCH // size
    x, y = (toy_images if image else toy_arrays)(GLOBAL_BATCH * STEPS, seed=5)
    x = x.reshape(STEPS, GLOBAL_BATCH, *shape).copy()
    x[:, GLOBAL_BATCH // 2:] += 1.5
    y = y.reshape(STEPS, GLOBAL_BATCH)
    for s in range(STEPS):
        rows = slice(rank * per_rank, (rank + 1) * per_rank)
        backend.train_step([{"x.npy": x[s, rows], "y.npy": y[s, rows]}], lr=0.1)
    state = backend.model.state_dict()
    kinds = {name: type(m).__name__ for name, m in backend.model.named_modules()}
    return {"names": list(state), "layers": sorted(set(kinds.values())),
            "weights": [v.double().ravel().tolist() for v in state.values()]}


def worker(out: Path) -> None:
    import horovod.torch as hvd

    results = {f"{model}-{'sync' if sync else 'plain'}": _train(model, sync)
               for model in MODELS for sync in (False, True)}
    gathered = hvd.allgather_object(results)
    if hvd.rank() == 0:
        out.write_text(json.dumps({"size": hvd.size(), "ranks": gathered}))


if __name__ == "__main__":
    worker(Path(sys.argv[1]))
    sys.exit(0)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("sync-bn")
    env = test_env(PYTHONPATH=f"{REPO}:{REPO / 'tests'}")
    one = run([BIN / "python", WORKER, tmp / "one.json"], timeout=240, env=env)
    assert one.returncode == 0, one.output[-4000:]
    two = horovodrun(2, [BIN / "python", WORKER, tmp / "two.json"], timeout=300, env=env)
    assert two.returncode == 0, two.output[-4000:]
    return {"one": json.loads((tmp / "one.json").read_text()),
            "two": json.loads((tmp / "two.json").read_text())}


def rel_diff(a: dict, b: dict) -> float:
    """Max over the state dict's tensors of max|a - b| / max|b|."""
    return max(float(np.max(np.abs(np.subtract(x, y))) / max(np.max(np.abs(y)), 1e-30))
               for x, y in zip(a["weights"], b["weights"], strict=True))


@pytest.mark.parametrize("model", list(MODELS))
def test_sync_batchnorm_two_ranks_equal_one_rank_with_double_batch(runs, model):
    assert runs["one"]["size"] == 1 and runs["two"]["size"] == 2
    ref = runs["one"]["ranks"][0][f"{model}-plain"]  # plain BatchNorm on the whole batch
    assert any("running_var" in name for name in ref["names"])
    for rank in runs["two"]["ranks"]:
        synced, plain = rank[f"{model}-sync"], rank[f"{model}-plain"]
        assert "CpuSyncBatchNorm" in synced["layers"] and synced["names"] == ref["names"]
        assert rel_diff(synced, ref) <= 1e-5  # weights, running mean/var, batches tracked
        assert rel_diff(plain, ref) > 1e-3  # each rank's own statistics: another result
    ranks = runs["two"]["ranks"]
    assert rel_diff(ranks[0][f"{model}-sync"], ranks[1][f"{model}-sync"]) == 0.0


def test_sync_batchnorm_on_one_rank_is_plain_batchnorm(runs):
    one = runs["one"]["ranks"][0]
    for model in MODELS:
        assert rel_diff(one[f"{model}-sync"], one[f"{model}-plain"]) == 0.0


def test_sync_batchnorm_under_tensorflow_is_one_config_line(tmp_path, capsys):
    from ringfeed.train.cli import main

    cfg = write_config(tmp_path / "tf.yaml", framework="tensorflow",
                       model={"name": "mlp", "sync_batchnorm": True},
                       data={"train": str(tmp_path)}, train={"max_steps": 1})
    assert main(["train", str(cfg)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "model.sync_batchnorm: torch only" in err[0], err



def test_ringfeed_train_with_sync_batchnorm_validates_and_checkpoints(tmp_path):
    """The key through `ringfeed train` under horovodrun: training, validation (running
    statistics, no collective in eval mode) and a checkpoint that loads as a plain model's."""
    import torch

    from ringfeed.train.data import CLASSIFY, DataSpec

    shards = write_toy_shards(tmp_path / "shards")
    cfg = write_config(tmp_path / "run.yaml", **toy_config(
        shards, tmp_path / "run", model={"name": "train_util:bn_mlp",
                                         "args": {"num_classes": CLASSES},
                                         "sync_batchnorm": True},
        train={"max_steps": 10, "val_every": 5, "log_every": 5},
        checkpoint={"every_steps": 10}))
    res = horovodrun(2, [BIN / "ringfeed", "train", cfg], timeout=300,
                     env=test_env(PYTHONPATH=f"{REPO}:{REPO / 'tests'}"))
    assert res.returncode == 0, res.output[-4000:]
    done = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert done["world_size"] == 2 and done["step"] == 10
    records = [json.loads(line) for line in
               (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "val_accuracy" in r] == [5, 10]
    state = torch.load(tmp_path / "run" / "checkpoints" / "ckpt-000000010" / "state.pt",
                       weights_only=True)["model"]
    plain = bn_mlp(DataSpec(CLASSIFY, "x.npy", "y.npy", (FEATURES,), num_classes=CLASSES),
                   CLASSES)
    plain.load_state_dict(state)  # the same keys as a plain BatchNorm model's

"""`model.init_from` (train/backends/init_weights.py): a run starts from the weights of a file the
user has (a torch state_dict, or one under "model" as Horovod's examples and ringfeed's own
state.pt hold it; a Keras .weights.h5), and a file that does not fit is one line, exit 2."""

from __future__ import annotations

import pytest
from fault_util import torch_final
from helpers import BIN, run
from train_util import toy_config, write_config, write_toy_shards

from ringfeed.errors import UserError
from ringfeed.train.backends.init_weights import load_torch, mismatch, torch_state_dict

RINGFEED = BIN / "ringfeed"


def test_a_state_dict_under_model_or_module_prefixes_loads_and_a_misfit_names_its_keys(
        tmp_path):
    import torch

    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
    weights = {k: torch.randn_like(v.float()).to(v.dtype) for k, v in model.state_dict().items()}
    torch.save({"model": {f"module.{k}": v for k, v in weights.items()}, "epoch": 3},
               tmp_path / "ckpt.pt")
    load_torch(model, str(tmp_path / "ckpt.pt"))
    for k, v in model.state_dict().items():
        assert torch.equal(v, weights[k]), k

    torch.save({"0.weight": torch.zeros(5, 3), "extra": torch.zeros(1)}, tmp_path / "bad.pt")
    with pytest.raises(UserError) as e:
        load_torch(model, str(tmp_path / "bad.pt"))
    assert "bad.pt does not fit" in str(e.value)
    assert "missing in the file (6): 0.bias, 1.weight, 1.bias, ..." in str(e.value)
    assert "not in the model (1): extra" in str(e.value)
    assert "0.weight (5, 3) in the file, (4, 3) in the model" in str(e.value)
    (tmp_path / "text.pt").write_text("not torch")
    for path, says in [(tmp_path / "none.pt", "is not a file"),
                       (tmp_path / "text.pt", "is not a torch state_dict file")]:
        with pytest.raises(UserError, match=says):
            torch_state_dict(str(path))
    assert mismatch({"a": (1,)}, {"a": (1,)}) is None


@pytest.mark.system
@pytest.mark.timeout(300)
def test_a_run_starts_from_another_runs_checkpoint_and_a_misfit_is_one_line(tmp_path):
    """Run A trains 2 steps; run B (same seed, lr 1e-9: its weights stay where they start)
    starts from A's state.pt: B's weights are A's, not the seed's initialisation."""
    import torch

    shards = write_toy_shards(tmp_path / "shards", n_train=64, n_val=16, per_shard=16)

    def train(run_name: str, lr: float, **model) -> tuple:
        cfg = toy_config(shards, tmp_path / run_name,
                         model={"name": "mlp", "args": {"num_classes": 3, "hidden": [16]},
                                **model},
                         optim={"name": "sgd", "lr": lr}, train={"max_steps": 2},
                         checkpoint={"every_steps": 2})
        res = run([RINGFEED, "train", write_config(tmp_path / f"{run_name}.yaml", **cfg)],
                  timeout=240)
        return res, tmp_path / run_name

    res, first = train("a", 0.5)
    assert res.returncode == 0, res.stderr[-3000:]
    trained = torch_final(first, 2)["model"]
    source = first / "checkpoints" / "ckpt-000000002" / "state.pt"
    res, second = train("b", 1e-9, init_from=str(source))
    assert res.returncode == 0, res.stderr[-3000:]
    started = torch_final(second, 2)["model"]
    res, plain = train("c", 1e-9)
    untouched = torch_final(plain, 2)["model"]
    assert all(torch.allclose(started[k].float(), trained[k].float(), atol=1e-6)
               for k in trained)
    # without init_from the same run keeps the seed's weights, which lr 0.5 moved far from
    assert max(float((untouched[k].float() - trained[k].float()).abs().max())
               for k in trained) > 1e-3

    res, _ = train("d", 1e-9, args={"num_classes": 3, "hidden": [8]},
                   init_from=str(source))
    assert res.returncode == 2 and res.stderr.count("\n") == 1, res.stderr[-3000:]
    assert "ringfeed: error: model.init_from:" in res.stderr and "other shapes" in res.stderr


@pytest.mark.system  # TensorFlow's import
def test_a_keras_weights_file_loads_and_a_misfit_is_one_line(tmp_path):
    import keras
    import numpy as np

    from ringfeed.train.backends.init_weights import load_keras

    def mlp(hidden: int):
        return keras.Sequential([keras.Input((3,)), keras.layers.Dense(hidden),
                                 keras.layers.Dense(2)])

    source = mlp(4)
    source.save_weights(tmp_path / "a.weights.h5")
    model = mlp(4)
    load_keras(model, str(tmp_path / "a.weights.h5"))
    for got, want in zip(model.get_weights(), source.get_weights(), strict=True):
        assert np.array_equal(got, want)
    with pytest.raises(UserError, match="a.weights.h5 does not fit"):
        load_keras(mlp(5), str(tmp_path / "a.weights.h5"))
    (tmp_path / "a.h5").write_bytes(b"")
    with pytest.raises(UserError, match="ending in .weights.h5"):
        load_keras(model, str(tmp_path / "a.h5"))

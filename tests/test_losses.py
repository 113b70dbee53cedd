"""The regression objective (train/losses.py), PyTorch's side: the loss compares the output with
the target standardised by the train split's mean/std (0 and 1 when unknown), per sample; the
metrics are errors of `output * std + mean`, in the target's units. (The TensorFlow side is
the same arithmetic; its import costs ~8 s, so it is exercised by the TF training tests.)"""

from __future__ import annotations

import numpy as np
import pytest

from ringfeed.train.data import DataSpec
from ringfeed.train.losses import regression_fns

torch = pytest.importorskip("torch")


def spec(mean=None, std=None, width: int = 1) -> DataSpec:
    return DataSpec("regress", "x.npy", "y.npy", (3,), num_classes=width, target_mean=mean,
                    target_std=std)


def test_the_loss_is_per_sample_squared_error_to_the_standardised_target():
    loss, _ = regression_fns("torch", spec(mean=(100.0,), std=(10.0,)))
    out = torch.tensor([[0.0], [1.0], [-2.0]])
    y = torch.tensor([100.0, 100.0, 90.0])  # standardised: 0, 0, -1
    assert loss(out, y).tolist() == pytest.approx([0.0, 1.0, 1.0])


def test_the_metrics_are_in_the_targets_units():
    _, metrics = regression_fns("torch", spec(mean=(100.0,), std=(10.0,)))
    out = torch.tensor([[0.5], [-1.0]])  # predictions 105 and 90
    m = metrics(out, torch.tensor([100.0, 100.0]))
    assert m["mae"].tolist() == pytest.approx([5.0, 10.0])
    assert m["mse"].tolist() == pytest.approx([25.0, 100.0])


def test_without_recorded_statistics_the_target_is_used_as_it_is():
    loss, metrics = regression_fns("torch", spec())
    out, y = torch.tensor([[2.0]]), torch.tensor([[5.0]])
    assert loss(out, y).tolist() == [9.0] and metrics(out, y)["mae"].tolist() == [3.0]


def test_several_targets_are_averaged_per_sample_each_with_its_statistics():
    loss, metrics = regression_fns("torch", spec(mean=(0.0, 10.0), std=(1.0, 2.0), width=2))
    out = torch.tensor([[1.0, 1.0], [0.0, 0.0]], dtype=torch.float16)
    y = torch.tensor([[1.0, 12.0], [2.0, 10.0]], dtype=torch.float64)
    assert loss(out, y).dtype == torch.float32
    assert loss(out, y).tolist() == pytest.approx([0.0, 2.0])  # ((0-2)^2 + 0) / 2
    assert metrics(out, y)["mae"].tolist() == pytest.approx([0.0, 1.0])
    assert np.isfinite(metrics(out, y)["mse"].numpy()).all()

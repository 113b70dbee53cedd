"""The regression objective, for both frameworks: chosen when the target is a float (a table's
`--field price=y.npy`) or `train.task: regress`.

The loss is the per-sample mean squared error between the model's output and the target
standardised with the train split's mean/std (recorded in the manifest; 0 and 1 when unknown),
so the default optimizer settings suit a target in any units; the validation loss is then about
1 - R^2. The metrics are in the target's own units, for the prediction `output * std + mean`:
`mse` (mean squared error) and `mae` (mean absolute error).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from ringfeed.train.data import DataSpec

Fn = Callable[[Any, Any], Any]


def _target_stats(spec: DataSpec) -> tuple[np.ndarray, np.ndarray]:
    mean = np.asarray(spec.target_mean if spec.target_mean is not None else 0.0, np.float32)
    std = np.asarray(spec.target_std if spec.target_std is not None else 1.0, np.float32)
    return mean, std


def regression_fns(framework: str, spec: DataSpec) -> tuple[Fn, Fn]:
    """(loss, metrics) for `framework` ("torch" or "tensorflow"): loss(outputs, targets) -> one
    value per sample; metrics(outputs, targets) -> {"mse", "mae"}, one value per sample each."""
    mean, std = _target_stats(spec)
    if framework == "torch":
        return _torch_fns(mean, std)
    return _tf_fns(mean, std)


def _torch_fns(mean: np.ndarray, std: np.ndarray) -> tuple[Fn, Fn]:
    import torch

    def parts(out: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, Any]:
        out = out.float().reshape(out.shape[0], -1)
        y = y.float().reshape(out.shape)
        return out, y, (torch.from_numpy(mean).to(out.device), torch.from_numpy(std).to(out.device))

    def loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        out, y, (m, s) = parts(out, y)
        return ((out - (y - m) / s) ** 2).mean(1)

    def metrics(out: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
        out, y, (m, s) = parts(out, y)
        err = out * s + m - y
        return {"mse": (err ** 2).mean(1), "mae": err.abs().mean(1)}

    return loss, metrics


def _tf_fns(mean: np.ndarray, std: np.ndarray) -> tuple[Fn, Fn]:
    import tensorflow as tf

    def parts(out: tf.Tensor, y: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
        out = tf.reshape(tf.cast(out, tf.float32), [tf.shape(out)[0], -1])
        return out, tf.reshape(tf.cast(y, tf.float32), tf.shape(out))

    def loss(out: tf.Tensor, y: tf.Tensor) -> tf.Tensor:
        out, y = parts(out, y)
        return tf.reduce_mean(tf.square(out - (y - mean) / std), axis=1)

    def metrics(out: tf.Tensor, y: tf.Tensor) -> dict[str, tf.Tensor]:
        out, y = parts(out, y)
        err = out * std + mean - y
        return {"mse": tf.reduce_mean(tf.square(err), axis=1),
                "mae": tf.reduce_mean(tf.abs(err), axis=1)}

    return loss, metrics

"""MixUp and CutMix (train/mixing.py, train.mixup_alpha / cutmix_alpha): torchvision's v2
rules written out here (torchvision does not load on this box) against the draws, the mixed
pixels and the loss on soft targets (label smoothing applied as CrossEntropyLoss applies it to
probability targets), both backends in process, the config errors, and that the draws are a
pure function of (seed, epoch, step, micro-batch, rank)."""

from __future__ import annotations

import math
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from ringfeed.errors import UserError
from ringfeed.train.mixing import (
    MixDraw,
    check_mixing,
    mix_draw,
    mixed_loss,
    mixed_torch,
    spatial_axes,
)

torch = pytest.importorskip("torch")
F = torch.nn.functional


def cfg(mixup: float = 0.0, cutmix: float = 0.0, seed: int = 7):
    return SimpleNamespace(mixup_alpha=mixup, cutmix_alpha=cutmix, seed=seed)


# -- the draws ---------------------------------------------------------------------------------
def test_off_draws_nothing_and_draws_are_pure():
    assert mix_draw(cfg(), 0, 0, 0, 0, 8, 8) is None
    both = cfg(0.2, 1.0)
    d = mix_draw(both, 1, 5, 0, 0, 32, 24)
    assert mix_draw(both, 1, 5, 0, 0, 32, 24) == d
    others = {mix_draw(both, *args, 32, 24) for args in
              [(2, 5, 0, 0), (1, 6, 0, 0), (1, 5, 1, 0), (1, 5, 0, 1)]}
    others.add(mix_draw(cfg(0.2, 1.0, seed=8), 1, 5, 0, 0, 32, 24))
    assert d not in others and len(others) == 5


def test_both_on_choose_one_of_the_two_half_the_time():
    draws = [mix_draw(cfg(0.2, 1.0), 0, s, 0, 0, 32, 32) for s in range(2000)]
    cut = [d for d in draws if d.box is not None]
    assert 0.45 < len(cut) / len(draws) < 0.55
    mixup = [d for d in draws if d.box is None]
    assert all(d.weight == d.lam for d in mixup)
    # Beta(0.2, 0.2): mean 1/2, mass near 0 and 1
    lams = np.array([d.lam for d in mixup])
    assert abs(lams.mean() - 0.5) < 0.05 and ((lams < 0.1) | (lams > 0.9)).mean() > 0.5


def torchvision_cutmix_box(lam: float, r_x: int, r_y: int, height: int, width: int):
    """v2.CutMix._get_params after its draws (lam, r_x, r_y): box and adjusted lam."""
    r = 0.5 * math.sqrt(1.0 - lam)
    r_w_half, r_h_half = int(r * width), int(r * height)
    x1, y1 = int(np.clip(r_x - r_w_half, 0, None)), int(np.clip(r_y - r_h_half, 0, None))
    x2, y2 = int(np.clip(r_x + r_w_half, None, width)), int(np.clip(r_y + r_h_half, None, height))
    return (y1, y2, x1, x2), float(1.0 - (x2 - x1) * (y2 - y1) / (width * height))


def test_cutmix_box_is_torchvisions_rule():
    """torchvision's _get_params over the same draws (the stream's words, in its order: lam,
    r_x, r_y) gives the same box and lam."""
    from ringfeed.train.mixing import MIX_STREAM

    h, w = 30, 40
    areas, centres = [], []
    for s in range(2000):
        d = mix_draw(cfg(cutmix=1.0), 0, s, 0, 0, h, w)
        rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence(
            [MIX_STREAM, 7, 0, s, 0, 0])))
        lam = float(rng.beta(1.0, 1.0))
        r_x, r_y = int(rng.integers(w)), int(rng.integers(h))
        box, kept = torchvision_cutmix_box(lam, r_x, r_y, h, w)
        assert (d.weight, d.box) == (1.0, box) and d.lam == pytest.approx(kept, abs=1e-12)
        top, bottom, left, right = box
        areas.append(1 - d.lam)
        if bottom - top < h and right - left < w:
            centres.append((top + bottom) / 2 / h)
    # Beta(1, 1): lam uniform; the box's share (sides sqrt(1 - lam), clipped) has mean < 1/2
    assert 0.2 < np.mean(areas) < 0.5
    assert abs(np.mean(centres) - 0.5) < 0.05


# -- pixels and loss ---------------------------------------------------------------------------
def test_mixup_and_cutmix_pixels_are_torchvisions():
    x = torch.rand(6, 3, 10, 12)  # NCHW
    d = mix_draw(cfg(mixup=0.4), 0, 3, 0, 0)
    assert d.box is None
    # v2.MixUp: inpt.roll(1, 0).mul_(1.0 - lam).add_(inpt.mul(lam))
    want = x.roll(1, 0).mul_(1.0 - d.lam).add_(x.mul(d.lam))
    assert torch.equal(mixed_torch(x, d, spatial_axes(4, True)), want)
    c = mix_draw(cfg(cutmix=1.0), 0, 4, 0, 0, 10, 12)
    top, bottom, left, right = c.box
    want = x.clone()
    want[..., top:bottom, left:right] = x.roll(1, 0)[..., top:bottom, left:right]
    assert torch.equal(mixed_torch(x, c, (2, 3)), want)
    nhwc = x.permute(0, 2, 3, 1)  # the same images as NHWC: the same box on H and W
    assert torch.equal(mixed_torch(nhwc, c, spatial_axes(4, False)), want.permute(0, 2, 3, 1))


@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_loss_is_cross_entropy_on_the_mixed_soft_targets(smoothing):
    """torchvision's reference: one-hot targets mixed (lam, rolled by one), then
    CrossEntropyLoss(label_smoothing=s) on them (s spread over the classes)."""
    from ringfeed.train.backends.torch import cross_entropy

    logits, y = torch.randn(8, 5), torch.tensor([0, 1, 2, 3, 4, 0, 1, 2])
    lam = 0.3
    onehot = F.one_hot(y, 5).float()
    soft = onehot.roll(1, 0).mul_(1.0 - lam).add_(onehot.mul(lam))
    want = F.cross_entropy(logits, soft, reduction="none", label_smoothing=smoothing)
    smoothed = soft * (1 - smoothing) + smoothing / 5  # (and by hand)
    assert torch.allclose(want, -(smoothed * logits.log_softmax(1)).sum(1), atol=1e-6)

    def loss_fn(out, target):
        return cross_entropy(out, target, smoothing)

    got = mixed_loss(loss_fn, logits, y, MixDraw(lam, lam, None))
    assert torch.allclose(got, want, atol=1e-6)


def test_mixing_is_for_classification_and_cutmix_for_images():
    check_mixing(cfg(), "regress", False)  # off: anything goes
    with pytest.raises(UserError, match="train.mixup_alpha: MixUp and CutMix are for "
                                        "classification, and this run's task is regress"):
        check_mixing(cfg(mixup=0.2), "regress", False)
    with pytest.raises(UserError, match="train.cutmix_alpha: .* task is lm"):
        check_mixing(cfg(cutmix=1.0), "lm", False)
    with pytest.raises(UserError, match="train.cutmix_alpha: CutMix pastes boxes of images"):
        check_mixing(cfg(cutmix=1.0), "classify", False)
    check_mixing(cfg(0.2, 1.0), "classify", True)
    assert UserError("x").exit_code == 2


# -- the backends, in process ------------------------------------------------------------------
def train_weights(framework: str, steps: list[tuple[int, int]], start=None, **train):
    """Weights after train_step at the (epoch, step) positions `steps`, from `start` (weights
    and optimizer state of another backend) or the seed's initial weights."""
    from train_util import IMAGE, _backend, toy_images

    from ringfeed.train.data import CLASSIFY, DataSpec

    spec = DataSpec(CLASSIFY, "x.npy", "y.npy", IMAGE, num_classes=4)
    backend = _backend(framework, 2, 4, spec=spec, model={"name": "cnn", "args": {
        "width": 4, "hidden": 8}}, **train)
    if start is not None:
        start(backend)
    x, y = toy_images(8 * 40, seed=3)
    for epoch, step in steps:
        rows = slice(8 * step, 8 * step + 8)
        batches = [{"x.npy": x[rows][i * 4:(i + 1) * 4], "y.npy": y[rows][i * 4:(i + 1) * 4]}
                   for i in range(2)]
        backend.train_step(batches, lr=0.1, at=(epoch, step))
    return backend


def torch_state(backend):
    model = {k: v.clone() for k, v in backend.model.state_dict().items()}
    optimizer = backend.optimizer.state_dict()

    def load(other):
        other.model.load_state_dict(model)
        other.optimizer.load_state_dict(optimizer)
    return load


def tf_state(backend):
    model = [v.numpy() for v in backend.model.variables]
    optimizer = [v.numpy() for v in backend.optimizer.variables]

    def load(other):
        for variable, value in zip(other.model.variables, model, strict=True):
            variable.assign(value)
        for variable, value in zip(other.optimizer.variables, optimizer, strict=True):
            variable.assign(value)
    return load


def resume_check(framework: str) -> None:
    """Micro-batches mixed at (epoch, step) positions: steps 2-4 from a copy of the state
    after steps 0-1 end where the uninterrupted run does; unmixed, or mixed at another
    position, they do not."""
    state = torch_state if framework == "torch" else tf_state
    train = {"mixup_alpha": 0.2, "cutmix_alpha": 1.0, "label_smoothing": 0.1}
    steps = [(0, 0), (0, 1), (0, 2), (1, 3), (1, 4)]
    whole = train_weights(framework, steps, **train).weights()
    first = train_weights(framework, steps[:2], **train)
    resumed = train_weights(framework, steps[2:], start=state(first), **train).weights()
    for a, b in zip(whole, resumed, strict=True):
        np.testing.assert_array_equal(a, b)
    plain = train_weights(framework, steps).weights()
    assert any(not np.array_equal(a, b) for a, b in zip(whole, plain, strict=True))
    # another position mixes otherwise: the draws follow (epoch, step), not a counter
    shifted = train_weights(framework, [*steps[:4], (2, 4)], **train).weights()
    assert any(not np.array_equal(a, b) for a, b in zip(whole, shifted, strict=True))


@pytest.mark.integration
def test_torch_a_resumed_run_mixes_as_the_uninterrupted_one():
    resume_check("torch")


@pytest.mark.system  # its own process: Horovod's torch and TensorFlow halves do not share one
def test_tensorflow_a_resumed_run_mixes_as_the_uninterrupted_one():
    from helpers import run

    pytest.importorskip("tensorflow")
    res = run([sys.executable, "-c", "import test_mixing; test_mixing.resume_check('tensorflow')"],
              timeout=400, cwd=Path(__file__).parent)
    assert res.returncode == 0, res.output[-4000:]


@pytest.mark.system  # TensorFlow's import starts a process
def test_tensorflow_mixes_as_torch_does():
    """The TF graph's mixing (mixed_tf) and loss equal the torch path's on the same batch."""
    pytest.importorskip("tensorflow")
    import tensorflow as tf

    from ringfeed.train.backends.tf import cross_entropy as tf_cross_entropy
    from ringfeed.train.backends.torch import cross_entropy as torch_cross_entropy
    from ringfeed.train.mixing import mixed_tf

    x = np.random.default_rng(0).random((6, 10, 12, 3), np.float32)  # NHWC
    for d in (mix_draw(cfg(mixup=0.4), 0, 3, 0, 0, 10, 12),
              mix_draw(cfg(cutmix=1.0), 0, 4, 0, 0, 10, 12)):
        want = mixed_torch(torch.from_numpy(x), d, (1, 2)).numpy()
        got = mixed_tf(tf.constant(x), tf.constant(d.vector()), (1, 2)).numpy()
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-6)
        nchw = np.ascontiguousarray(x.transpose(0, 3, 1, 2))
        got = mixed_tf(tf.constant(nchw), tf.constant(d.vector()), (2, 3)).numpy()
        np.testing.assert_allclose(got, want.transpose(0, 3, 1, 2), rtol=0, atol=1e-6)
    logits = np.random.default_rng(1).normal(size=(8, 5)).astype(np.float32)
    y = np.array([0, 1, 2, 3, 4, 0, 1, 2])
    for s in (0.0, 0.1):
        mix = MixDraw(0.3, 0.3, None)
        want = mixed_loss(lambda o, t, s=s: torch_cross_entropy(o, t, s),
                          torch.from_numpy(logits), torch.from_numpy(y), mix).numpy()
        got = mixed_loss(lambda o, t, s=s: tf_cross_entropy(o, t, s), tf.constant(logits),
                         tf.constant(y), tf.constant(mix.vector())).numpy()
        np.testing.assert_allclose(got, want, rtol=1e-5)


@pytest.mark.integration
def test_a_backend_refuses_mixing_for_regression():
    from train_util import _backend

    from ringfeed.train.data import REGRESS, DataSpec

    spec = DataSpec(REGRESS, "x.npy", "y.npy", (6,), num_classes=1)
    with pytest.raises(UserError, match="train.mixup_alpha: MixUp and CutMix are for "
                                        "classification, and this run's task is regress"):
        _backend("torch", 1, 4, spec=spec, mixup_alpha=0.2)


# -- through ringfeed train ----------------------------------------------------------------------
def _final_weights(run, step: int) -> dict[str, np.ndarray]:
    state = torch.load(run / "checkpoints" / f"ckpt-{step:09d}" / "state.pt", weights_only=True)
    return {k: v.numpy() for k, v in state["model"].items()}


@pytest.mark.system  # horovodrun
@pytest.mark.timeout(900)
def test_a_launched_run_resumed_mid_way_mixes_as_the_uninterrupted_one(tmp_path):
    """2 ranks, accumulate 2, MixUp on the toy table: resumed from its step-4 checkpoint, the
    run ends with the uninterrupted run's weights; without MixUp the weights differ."""
    import json

    from helpers import horovodrun
    from train_util import toy_config, write_config, write_toy_shards

    shards = write_toy_shards(tmp_path / "shards", n_train=160, n_val=16)

    def train(name: str, mixup: float, *extra: str) -> None:
        cfg = toy_config(shards, tmp_path / name,
                         train={"max_steps": 8, "epochs": None, "accumulate": 2,
                                "mixup_alpha": mixup, "label_smoothing": 0.1},
                         checkpoint={"every_steps": 4, "keep": 5})
        res = horovodrun(2, ["ringfeed", "train", write_config(tmp_path / f"{name}.yaml", **cfg),
                             *extra], timeout=400)
        assert res.returncode == 0, res.output[-4000:]
        assert json.loads((tmp_path / name / "summary.json").read_text())["step"] == 8

    train("whole", 0.4)
    train("resumed", 0.4, "--resume", str(tmp_path / "whole" / "checkpoints" / f"ckpt-{4:09d}"))
    train("plain", 0.0)
    whole, resumed = _final_weights(tmp_path / "whole", 8), _final_weights(tmp_path / "resumed", 8)
    for name in whole:
        np.testing.assert_array_equal(resumed[name], whole[name], err_msg=name)
    plain = _final_weights(tmp_path / "plain", 8)
    assert any(not np.array_equal(plain[n], whole[n]) for n in whole)

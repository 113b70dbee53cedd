"""The distributed math, proved numerically (CPU, fp32, relative tolerance 1e-6), for PyTorch and
TensorFlow, through the real backend step functions and Horovod's real allreduce:

(a) 2 ranks x batch b      == 1 rank x batch 2b
(b) k micro-batches of b   == one batch of k*b   (1 rank, k = 2, 4; and 2 ranks x 2)
plus Adam with gradient clipping, an fp16 overflow on ONE rank skipping the step on BOTH,
bf16 really running in bf16, and the built-in cnn/gpt learning a fixed batch.

One plain process and one `horovodrun -np 2` per framework run every scenario
(tests/train_util.py) and write their weights; the tests here compare them.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from helpers import BIN, REPO, horovodrun, run
from train_util import FIXED_LOGITS, FIXED_TARGETS, INJECT_STEP, SMOOTHING, STEPS, TOPK

WORKER = REPO / "tests" / "train_util.py"
RTOL = 1e-6

pytestmark = pytest.mark.system


@pytest.fixture(scope="module", params=["torch", "tensorflow"])
def runs(request, tmp_path_factory) -> dict:
    framework = request.param
    tmp = tmp_path_factory.mktemp(f"steps-{framework}")
    cmd = [BIN / "python", WORKER, "steps", "--framework", framework, "--out"]
    one = run([*cmd, tmp / "one.json"], timeout=240)
    assert one.returncode == 0, one.output[-4000:]
    two = horovodrun(2, [*cmd, tmp / "two.json"], timeout=300)
    assert two.returncode == 0, two.output[-4000:]
    one_rank = json.loads((tmp / "one.json").read_text())
    two_ranks = json.loads((tmp / "two.json").read_text())
    assert one_rank["size"] == 1 and two_ranks["size"] == 2
    return {"framework": framework, "one": one_rank["ranks"][0], "two": two_ranks["ranks"]}


def rel_diff(a: dict, b: dict, key_a: str = "weights", key_b: str = "weights") -> float:
    """Max over tensors of max|a - b| / max|b|."""
    return max(float(np.max(np.abs(np.subtract(x, y))) / max(np.max(np.abs(y)), 1e-30))
               for x, y in zip(a[key_a], b[key_b], strict=True))


def test_training_moved_the_weights(runs):
    # Otherwise the equalities below would hold trivially.
    assert rel_diff(runs["one"]["ref"], runs["one"]["ref"], "weights", "initial") > 1e-2


def test_two_ranks_equal_one_rank_with_double_batch(runs):
    ref = runs["one"]["ref"]
    for rank in runs["two"]:
        assert rel_diff(rank["dp"], ref) <= RTOL, rank["rank"]
    assert rel_diff(runs["two"][0]["dp"], runs["two"][1]["dp"]) == 0.0  # replicas identical


@pytest.mark.parametrize("scenario", ["acc2", "acc4"])
def test_accumulated_micro_batches_equal_one_big_batch(runs, scenario):
    assert rel_diff(runs["one"][scenario], runs["one"]["ref"]) <= RTOL


def test_two_ranks_with_accumulation_equal_one_big_batch(runs):
    for rank in runs["two"]:
        assert rel_diff(rank["dp_acc2"], runs["one"]["ref"]) <= RTOL


def test_adam_with_grad_clipping_data_parallel(runs):
    for rank in runs["two"]:
        assert rel_diff(rank["adam_dp"], runs["one"]["adam_ref"]) <= RTOL


def test_fp16_allreduce_compression_is_close_but_lossy(runs):
    for rank in runs["two"]:
        diff = rel_diff(rank["dp_fp16_allreduce"], runs["one"]["ref"])
        assert 0 < diff < 1e-2, diff


def test_fp16_overflow_on_one_rank_skips_the_step_on_all_ranks(runs):
    per_rank = [rank["fp16_inject"]["steps"] for rank in runs["two"]]
    for steps in per_rank:
        assert len(steps) == STEPS
        for s, step in enumerate(steps):
            if s == INJECT_STEP:
                assert not step["applied"] and not step["weights_changed"], step
            else:
                assert step["applied"] and step["weights_changed"], (s, step)
        # GradScaler / LossScaleOptimizer halve the scale after the skipped step.
        assert steps[INJECT_STEP + 1]["loss_scale"] == steps[INJECT_STEP]["loss_scale"] / 2
    assert per_rank[0] == per_rank[1]
    assert rel_diff(runs["two"][0]["fp16_inject"], runs["two"][1]["fp16_inject"]) == 0.0


def test_bf16_runs_in_reduced_precision_close_to_fp32(runs):
    diff = rel_diff(runs["one"]["bf16"], runs["one"]["ref"])
    assert 1e-5 < diff < 0.1, diff  # not fp32 (it differs), not broken (it is close)


@pytest.mark.parametrize("model", ["cnn", "gpt"])
def test_builtin_models_fit_a_fixed_batch(runs, model):
    losses = runs["one"]["overfit"][model]
    assert all(np.isfinite(losses))
    assert losses[-1] < 0.97 * losses[0], losses


def test_channels_last_conv_model_two_ranks_equal_one_rank_with_double_batch(runs):
    """A channels_last model (NHWC weights, NHWC gradients) through Horovod's broadcast and
    allreduce, which take only contiguous tensors: 2 ranks x b == 1 rank x 2b, with and without
    accumulation, and the weights are still channels_last afterwards."""
    if runs["framework"] != "torch":
        pytest.skip("channels_last is a torch memory format (Keras convolutions are NHWC)")
    ref = runs["one"]["cl_ref"]
    assert ref["channels_last"] and all(ref["channels_last"])
    assert runs["one"]["conv_ref"]["channels_last"] == [False] * len(ref["channels_last"])
    assert rel_diff(ref, ref, "weights", "initial") > 1e-2  # it trained
    # the same model in the default layout: the same numbers up to the kernels' rounding
    assert rel_diff(ref, runs["one"]["conv_ref"]) <= 1e-4
    for rank in runs["two"]:
        for scenario in ("cl_dp", "cl_dp_acc2"):
            assert all(rank[scenario]["channels_last"]), scenario
            assert rel_diff(rank[scenario], ref) <= RTOL, (rank["rank"], scenario)
    assert rel_diff(runs["two"][0]["cl_dp"], runs["two"][1]["cl_dp"]) == 0.0


# -- local SGD (train.sync_every) ---------------------------------------------------------------
SYNC_STEPS = [s for s in range(STEPS) if (s + 1) % 2 == 0]  # sync_every: 2 averages after these


def test_local_sgd_sync_every_1_is_the_synchronous_path_bit_for_bit(runs):
    for rank in runs["two"]:
        assert rel_diff(rank["lsgd_h1"], rank["dp"]) == 0.0
        assert rank["lsgd_h1"]["comm"] == rank["dp"]["comm"]


def test_local_sgd_on_one_rank_is_plain_training_bit_for_bit(runs):
    # (Averaging over one rank changes nothing; the local step is the same update.)
    one = runs["one"]
    assert rel_diff(one["lsgd_h4"], one["ref"]) == 0.0
    assert rel_diff(one["lsgd_acc2_h3"], one["acc2"]) == 0.0


@pytest.mark.parametrize("prefix", ["lsgd", "lsgd_adam"])
def test_local_sgd_sync_averages_the_replicas(runs, prefix):
    """2 ranks, 3 local steps, then the sync == the mean of two single processes each training
    3 steps on one rank's rows (Adam: with accumulation and clipping)."""
    one = runs["one"]
    replicas = [one[f"{prefix}_replica{r}"] for r in (0, 1)]
    assert rel_diff(replicas[0], replicas[1]) > 1e-2  # the replicas really drifted apart
    mean = {"weights": [np.mean(pair, axis=0) for pair in
                        zip(replicas[0]["weights"], replicas[1]["weights"], strict=True)]}
    for rank in runs["two"]:
        assert rel_diff(rank[f"{prefix}_window"], mean) <= RTOL


@pytest.mark.parametrize("scenario, optimizer_too", [
    ("lsgd_h2", True), ("lsgd_adam_h2", True), ("lsgd_h2_params", False), ("lsgd_cl_h2", True)])
def test_local_sgd_ranks_identical_after_every_sync_only(runs, scenario, optimizer_too):
    if scenario not in runs["two"][0]:
        pytest.skip("channels_last is a torch memory format")
    steps = [rank[scenario]["steps"] for rank in runs["two"]]
    same = [a["weights_digest"] == b["weights_digest"] for a, b in zip(*steps, strict=True)]
    assert same == [s in SYNC_STEPS for s in range(STEPS)]
    same_state = [a["optimizer_digest"] == b["optimizer_digest"]
                  for a, b in zip(*steps, strict=True)]
    # sync_optimizer_state: false leaves each rank its own moments
    assert same_state == [optimizer_too and s in SYNC_STEPS for s in range(STEPS)]


def test_local_sgd_fp16_keeps_a_loss_scaler_per_rank(runs):
    """An overflow on rank 1 in a local step skips the step on rank 1 only (its scaler halves,
    rank 0's does not); the next sync makes the weights identical again."""
    r0, r1 = (rank["lsgd_fp16_inject"]["steps"] for rank in runs["two"])
    assert r0[INJECT_STEP]["applied"] and not r1[INJECT_STEP]["applied"]
    assert not r1[INJECT_STEP]["weights_changed"]
    assert r1[INJECT_STEP + 1]["loss_scale"] == r1[INJECT_STEP]["loss_scale"] / 2
    assert r0[INJECT_STEP + 1]["loss_scale"] == r0[INJECT_STEP]["loss_scale"]
    assert [a["weights_digest"] == b["weights_digest"] for a, b in zip(r0, r1, strict=True)] \
        == [s in SYNC_STEPS for s in range(STEPS)]


def test_allreduce_bytes_per_sample(runs):
    """comm_stats(): gradient bytes per step (synchronous), parameter (+ moment) bytes per sync
    (local SGD), over the samples this rank trained on (8 per step here)."""
    two = runs["two"][0]
    params = sum(len(w) for w in two["dp"]["weights"])
    per_sample = {name: two[name]["comm"]["allreduce_bytes_per_sample"]
                  for name in ("dp", "dp_fp16_allreduce", "lsgd_h2", "lsgd_h2_params",
                               "lsgd_adam_h2")}
    sync = params * 4 / 8
    assert per_sample == {"dp": sync, "dp_fp16_allreduce": sync / 2,
                          "lsgd_h2": sync,  # parameters + momentum, every 2nd step
                          "lsgd_h2_params": sync / 2, "lsgd_adam_h2": sync * 1.5}
    assert two["lsgd_h2"]["comm"]["syncs"] == STEPS / 2


# -- the recipe's loss and metrics (issue 46) ------------------------------------------------
def test_train_metrics_are_the_steps_own_averaged_over_ranks(runs):
    """StepResult.metrics, the train accuracy and top-k of metrics.jsonl: on one rank those of
    the step's own batch as the model was before it (its validation metrics, taken apart);
    on 2 ranks x 8 the same numbers, on both ranks (averaged in the agreement allreduce)."""
    ref = runs["one"]["ref"]["steps"]
    for step in ref:
        assert set(step["metrics"]) == {"accuracy", "top2"}  # (train.topk 2 of 3 classes)
        assert step["metrics"] == pytest.approx(step["expected_metrics"], abs=1e-6)
    assert len({tuple(step["metrics"].values()) for step in ref}) > 1  # they move
    for rank in runs["two"]:
        for mine, one_rank in zip(rank["dp"]["steps"], ref, strict=True):
            assert mine["metrics"] == pytest.approx(one_rank["metrics"], abs=1e-6)


def test_label_smoothing_and_top_k_are_the_formulas_on_fixed_logits(runs):
    """train.label_smoothing s: (1 - s) x NLL + s x the mean over classes of -log p (torch's
    CrossEntropyLoss and Keras' CategoricalCrossentropy with label_smoothing=s: both
    frameworks are held to the same numbers); train.topk k: fewer than k classes score
    higher than the target."""
    got = runs["one"]["builtin_fns"]
    logits, targets, rows = FIXED_LOGITS.astype(np.float64), FIXED_TARGETS, len(FIXED_TARGETS)
    top = logits.max(1, keepdims=True)
    log_p = logits - top - np.log(np.exp(logits - top).sum(1, keepdims=True))
    nll = -log_p[np.arange(rows), targets]
    assert got["loss"] == pytest.approx((1 - SMOOTHING) * nll - SMOOTHING * log_p.mean(1),
                                        rel=1e-5)
    higher = (logits > logits[np.arange(rows), targets][:, None]).sum(1)
    assert got["accuracy"] == (higher == 0).astype(float).tolist()
    assert got[f"top{TOPK}"] == (higher < TOPK).astype(float).tolist()
    assert sum(got["accuracy"]) < sum(got[f"top{TOPK}"]) < rows  # neither trivial


def test_the_keras_models_own_losses_are_part_of_its_training_loss(runs):
    """A Keras model's kernel_regularizer and add_loss (an activity regularizer) are in the
    loss it trains on and reports, as Keras' fit adds model.losses: the step's loss is the
    data loss + sum(model.losses) of that forward, and L2 10 trains other weights than L2 0
    from the same start."""
    if runs["framework"] != "tensorflow":
        pytest.skip("model.losses is Keras'")
    strong, none = runs["one"]["own_losses"]["10.0"], runs["one"]["own_losses"]["0.0"]
    assert strong["own"] > 10 * strong["data_loss"] and 0 < none["own"] < 0.1
    for one_step in (strong, none):
        assert one_step["loss"] == pytest.approx(one_step["data_loss"] + one_step["own"],
                                                 rel=1e-5)
    assert strong["data_loss"] == pytest.approx(none["data_loss"], rel=1e-6)  # the same start
    assert rel_diff(strong, none) > 1e-2

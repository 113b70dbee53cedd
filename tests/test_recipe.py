"""The recipe of Horovod's ImageNet examples as ringfeed keys (issue 46), in-process: the lr
schedule (warmup in epochs from one rank's rate, multistep decay at epochs), checked against
Horovod's own adjust_learning_rate written out here; the config keys and their errors. The
backends' parts (label smoothing, train accuracy and top-k, the Keras model's own losses) are
checked in the step worker of test_train_equivalence.py, BatchNorm statistics over a resume in
test_train.py."""

from __future__ import annotations

import io
import json
from types import SimpleNamespace

import pytest

from ringfeed.train.config import DataSection, OptimSection
from ringfeed.train.feed import plan_steps
from ringfeed.train.observe.metrics import RunLogger
from ringfeed.train.schedule import LRSchedule, make_schedule


def horovod_imagenet_lr(epoch: int, batch_idx: int, batches: int, size: int, base_lr: float,
                        batches_per_allreduce: int, warmup_epochs: float) -> float:
    """examples/pytorch/pytorch_imagenet_resnet50.py's adjust_learning_rate (horovod/horovod),
    as written there: the rate of batch `batch_idx` (one optimizer step) of `epoch`, for
    `batches` steps per epoch."""
    if epoch < warmup_epochs:
        epoch += float(batch_idx + 1) / batches
        lr_adj = 1. / size * (epoch * (size - 1) / warmup_epochs + 1)
    elif epoch < 30:
        lr_adj = 1.
    elif epoch < 60:
        lr_adj = 1e-1
    elif epoch < 80:
        lr_adj = 1e-2
    else:
        lr_adj = 1e-3
    return base_lr * size * batches_per_allreduce * lr_adj


HOROVOD_RECIPE = {"lr": 0.0125, "momentum": 0.9, "warmup_epochs": 5, "warmup_start": "one_rank",
                  "schedule": "multistep", "milestones": [30, 60, 80], "gamma": 0.1}


@pytest.mark.parametrize("size, k", [(4, 1), (3, 2), (1, 1)])
def test_horovods_imagenet_schedule_at_every_step_of_90_epochs(size, k):
    spe = 7  # optimizer steps per epoch
    schedule = make_schedule(OptimSection(**HOROVOD_RECIPE), size, k, 90 * spe, spe)
    for epoch in range(90):
        for batch in range(spe):
            expected = horovod_imagenet_lr(epoch, batch, spe, size, 0.0125, k, 5)
            assert schedule(epoch * spe + batch) == pytest.approx(expected, rel=1e-12), \
                (epoch, batch)
    assert schedule.peak == pytest.approx(0.0125 * size * k)


def test_multistep_counts_epochs_from_0_as_torchs_multisteplr():
    import torch

    spe, milestones = 3, [2, 5]
    schedule = make_schedule(OptimSection(lr=0.1, schedule="multistep", milestones=milestones,
                                          gamma=0.5), 1, 1, 8 * spe, spe)
    param = torch.zeros(1, requires_grad=True)
    opt = torch.optim.SGD([param], lr=0.1)
    torch_lr = torch.optim.lr_scheduler.MultiStepLR(opt, milestones, gamma=0.5)
    for epoch in range(8):  # torch steps its scheduler once an epoch
        for i in range(spe):
            assert schedule(epoch * spe + i) == pytest.approx(opt.param_groups[0]["lr"])
        opt.step()
        torch_lr.step()


def test_warmup_in_steps_or_epochs_is_one_rule():
    """warmup_epochs E at S steps per epoch is warmup_steps E x S; a fractional end caps at
    the peak; from zero the first step already trains at peak / warmup (as before)."""
    in_epochs = make_schedule(OptimSection(lr=0.1, warmup_epochs=2), 2, 1, 100, 5)
    in_steps = make_schedule(OptimSection(lr=0.1, warmup_steps=10), 2, 1, 100, 5)
    assert [in_epochs(i) for i in range(12)] == [in_steps(i) for i in range(12)]
    assert in_steps(0) == pytest.approx(0.02) and in_steps(9) == pytest.approx(0.2)
    half = make_schedule(OptimSection(lr=0.1, warmup_epochs=0.5, warmup_start="one_rank"),
                         2, 1, 100, 5)  # 2.5 steps: 0.1 -> 0.2
    assert [half(i) for i in range(4)] == pytest.approx([0.14, 0.18, 0.2, 0.2])
    assert LRSchedule(peak=0.4, total_steps=10, warmup_steps=4, warmup_start=0.2)(1) == \
        pytest.approx(0.3)


def test_epochs_follow_the_pipelines_epoch_after_a_world_size_change():
    """A run resumed at another world size: epoch 1 ends where its pipeline says (after the
    steps left in it), not at epoch x the new steps per epoch; at the same world size that is
    the same thing."""
    cfg = SimpleNamespace(train=SimpleNamespace(max_steps=None, epochs=4),
                          data=SimpleNamespace(order="rank", batch_size=4, global_batch_size=None),
                          optim=OptimSection(lr=0.1, schedule="multistep", milestones=[2, 3],
                                             scale_lr_with_world_size=False))
    # 3 ranks made 40 steps an epoch; 50 done (epoch 1), now 2 ranks: 60 an epoch, 45 left
    resized = SimpleNamespace(epoch=1, batches_remaining=45)
    total, _, schedule = plan_steps(cfg, resized, 50, 60, 2, 1)
    assert total == 50 + 45 + 2 * 60
    assert [schedule(s) for s in (94, 95, 154, 155)] == pytest.approx([0.1, 0.01, 0.01, 1e-3])
    same = SimpleNamespace(epoch=1, batches_remaining=30)  # 40 an epoch, 10 done in epoch 1
    _, _, schedule = plan_steps(cfg, same, 50, 40, 3, 1)
    assert [schedule(s) for s in (79, 80, 119, 120)] == pytest.approx([0.1, 0.01, 0.01, 1e-3])
    fresh = SimpleNamespace(epoch=0, batches_remaining=40)
    assert plan_steps(cfg, fresh, 0, 40, 3, 1)[2] == schedule


@pytest.mark.parametrize("keys, message", [
    ({"warmup_steps": 5, "warmup_epochs": 1}, "set warmup_steps or warmup_epochs, not both"),
    ({"schedule": "multistep"}, "multistep needs optim.milestones"),
    ({"milestones": [30]}, "milestones are for schedule: multistep only"),
    ({"schedule": "multistep", "milestones": [30, 30]}, "milestones must increase"),
    ({"warmup_start": "lr"}, "Input should be 'zero' or 'one_rank'"),
])
def test_schedule_keys_that_do_not_go_together(keys, message):
    with pytest.raises(ValueError, match=message):
        OptimSection(**keys)


def test_val_batch_size_reaches_the_val_pipeline_only():
    data = DataSection(train="shards", batch_size=4, val_batch_size=32)
    assert data.to_pipeline_config("train").batch_size == 4
    assert data.to_pipeline_config("val").batch_size == 32
    assert DataSection(train="shards", batch_size=4).to_pipeline_config("val").batch_size == 4


def test_training_metrics_are_logged_as_window_means_like_the_loss(tmp_path):
    """StepResult.metrics go into metrics.jsonl as the mean over the log window (Horovod's
    examples print the epoch's running mean), and the last window's into the summary."""
    logger = RunLogger(tmp_path, True, total_steps=4, global_batch=8, log_every=2,
                       stream=io.StringIO()).open()
    for step, acc in enumerate([0.25, 0.75, 0.5, 1.0], 1):
        logger.train_step(step, 0, 1.0, 0.1, 0.01, 0.0, means={"accuracy": acc, "top5": 1.0})
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["accuracy"], r["top5"]) for r in records] == [(2, 0.5, 1.0),
                                                                       (4, 0.75, 1.0)]
    assert logger.train_metrics == {"accuracy": 0.75, "top5": 1.0}
    assert "accuracy 0.7500  top5 1.0000" in logger.stream.getvalue()

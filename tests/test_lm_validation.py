"""LM validation: perplexity is exp of the token-weighted mean loss over the whole val split,
exact over ranks (2 ranks, uneven last batches: a mean of per-batch or per-rank means differs),
in the log line, metrics.jsonl and summary.json; train.val_steps caps every validation at the
split's first batches."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from helpers import horovodrun
from lm_util import lm_config, load_gpt, token_rows, token_shards
from train_util import write_config

pytestmark = [pytest.mark.system, pytest.mark.timeout(600)]  # (each test trains a gpt)


def token_losses(model, rows: list[np.ndarray]) -> torch.Tensor:
    """Every next-token loss of `rows`, (rows, positions), computed here from the weights."""
    tokens = torch.as_tensor(np.stack(rows).astype(np.int64))
    with torch.no_grad():
        logits = model(tokens[:, :-1])
    return F.cross_entropy(logits.transpose(1, 2), tokens[:, 1:], reduction="none").double()


def records(run_dir: Path) -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if "val_loss" in r]


def test_perplexity_is_exact_over_two_ranks_with_uneven_batches(tmp_path):
    shards = token_shards(tmp_path)
    val_rows = token_rows(shards, "val")
    assert len(val_rows) % 10  # batches of 5 on 2 ranks: the last ones are part padding
    out = tmp_path / "run"
    config = write_config(tmp_path / "run.yaml", **lm_config(
        shards, out, train={"max_steps": 4, "val_every": 2}))
    res = horovodrun(2, ["ringfeed", "train", config], timeout=500)
    assert res.returncode == 0, res.output[-4000:]

    losses = token_losses(load_gpt(out), val_rows)
    expected = math.exp(float(losses.mean()))  # every val token once, each weighing the same
    summary = json.loads((out / "summary.json").read_text())["val"]
    assert summary["perplexity"] == pytest.approx(expected, rel=1e-5)
    assert summary["perplexity"] == pytest.approx(math.exp(summary["loss"]), rel=1e-12)
    last = records(out)[-1]
    assert last["step"] == 4 and last["val_perplexity"] == summary["perplexity"]
    assert "perplexity" in res.stdout.split("validation at step 4:")[1].splitlines()[0]
    # the tolerance tells the exact mean from a mean of the batches' means
    row_means = losses.mean(1)
    batch_means = torch.stack([b.mean() for b in row_means.split(5)])
    assert abs(math.exp(float(batch_means.mean())) - expected) > 1e-4 * expected


def test_val_steps_caps_every_validation_at_the_first_batches(tmp_path):
    from ringfeed.train.config import load_config
    from ringfeed.train.data import make_pipeline

    shards = token_shards(tmp_path)
    out = tmp_path / "run"
    # loader workers: a validation left unfinished must not disturb the next one
    config = write_config(tmp_path / "run.yaml", **lm_config(
        shards, out, train={"max_steps": 4, "val_every": 2, "val_steps": 2},
        data={"num_workers": 2}))
    res = horovodrun(1, ["ringfeed", "train", config], timeout=500)
    assert res.returncode == 0, res.output[-4000:]

    pipe = make_pipeline(load_config(config, check_paths=False), "val", 0, 1)
    batches = iter(pipe)
    first = [row for _ in range(2) for row in np.asarray(next(batches)["tokens.npy"])]
    pipe.close()
    assert len(first) == 10 < len(token_rows(shards, "val"))
    losses = token_losses(load_gpt(out), first)
    summary = json.loads((out / "summary.json").read_text())["val"]
    assert summary["perplexity"] == pytest.approx(math.exp(float(losses.mean())), rel=1e-5)
    whole = token_losses(load_gpt(out), token_rows(shards, "val"))
    assert abs(float(whole.mean()) - float(losses.mean())) > 1e-4
    assert [r["step"] for r in records(out)] == [2, 4]

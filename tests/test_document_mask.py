"""The built-in gpt's document (block-causal) mask, `model.args.document_mask`: in a window
packing several documents, each document is computed as it would be alone (its logits and its
gradients), positions restarting at its first token; without doc ids the model is the causal
one; a run whose shards record no documents is refused in one line."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import pytest
import torch
from helpers import BIN, horovodrun, run
from lm_util import WORDS, lm_config, newest_checkpoint, token_shards
from train_util import write_config

from ringfeed.train.data import LM, DataSpec
from ringfeed.train.models import build_model
from ringfeed.train.models.torch_models import block_causal

T = 16
SPEC = DataSpec(LM, "tokens", None, (T,), vocab_size=50)
# two windows of T tokens: three documents (5 + 7 + 4), and two (9 + 7)
LENGTHS = [(5, 7, 4), (9, 7)]


def gpt(**args) -> torch.nn.Module:
    torch.manual_seed(0)
    return build_model("torch", "gpt", {"n_layer": 2, "n_head": 2, "d_model": 32, **args},
                       SPEC).eval()


def packed() -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens, doc_ids) of the windows LENGTHS describes, built by hand as DOC_IDS says:
    0 for the document the window starts in, +1 at each document start."""
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 50, (len(LENGTHS), T), generator=gen)
    doc_ids = torch.tensor([[d for d, n in enumerate(lengths) for _ in range(n)]
                            for lengths in LENGTHS], dtype=torch.int32)
    return tokens, doc_ids


def documents(row: int):
    """(start, end) of each document of window `row`."""
    start = 0
    for n in LENGTHS[row]:
        yield start, start + n
        start += n


def test_block_causal_mask_and_positions():
    mask, positions = block_causal(torch.tensor([[0, 0, 1, 1, 1, 2]]))
    assert positions.tolist() == [[0, 1, 0, 1, 2, 0]]
    assert mask.shape == (1, 1, 6, 6)
    assert mask[0, 0].int().tolist() == [[1, 0, 0, 0, 0, 0],
                                         [1, 1, 0, 0, 0, 0],
                                         [0, 0, 1, 0, 0, 0],
                                         [0, 0, 1, 1, 0, 0],
                                         [0, 0, 1, 1, 1, 0],
                                         [0, 0, 0, 0, 0, 1]]


@torch.no_grad()
def test_each_document_of_a_window_has_the_logits_it_has_alone():
    model = gpt(document_mask=True)
    tokens, doc_ids = packed()
    logits = model(tokens, doc_ids)
    for row in range(len(LENGTHS)):
        for start, end in documents(row):
            alone = model(tokens[row:row + 1, start:end])[0]
            torch.testing.assert_close(logits[row, start:end], alone, rtol=1e-5, atol=1e-5)
    # without the mask a later document sees the earlier ones: its logits differ
    plain = model(tokens)
    assert not torch.allclose(plain[0, 5:12], model(tokens[0:1, 5:12])[0], atol=1e-3)


@torch.no_grad()
def test_without_documents_the_model_is_the_causal_one():
    """One document per window (all ids 0), or no doc ids at all (ringfeed generate, export):
    the gpt without the option, bit for bit."""
    tokens, _ = packed()
    masked, plain = gpt(document_mask=True), gpt()
    expected = plain(tokens)
    torch.testing.assert_close(masked(tokens), expected, rtol=0, atol=0)
    torch.testing.assert_close(masked(tokens, torch.zeros_like(tokens, dtype=torch.int32)),
                               expected, rtol=1e-5, atol=1e-5)


def test_a_documents_gradients_are_those_it_has_alone():
    """Backward through the mask: the loss of the middle document of a packed window gives the
    weights the gradients that document gives alone (the others contribute nothing)."""
    tokens, doc_ids = packed()
    start, end = list(documents(0))[1]

    def grads(logits: torch.Tensor, model: torch.nn.Module) -> dict[str, torch.Tensor]:
        logits.float().square().mean().backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    model = gpt(document_mask=True).train()
    packed_grads = grads(model(tokens, doc_ids)[0, start:end], model)
    model = gpt(document_mask=True).train()
    alone_grads = grads(model(tokens[0:1, start:end])[0], model)
    assert packed_grads.keys() == alone_grads.keys() and "blocks.0.qkv.weight" in packed_grads
    for name, grad in packed_grads.items():
        torch.testing.assert_close(grad, alone_grads[name], rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.system
@pytest.mark.timeout(600)
def test_shards_without_documents_are_refused_in_one_line(tmp_path: Path):
    """Row token shards (a member per window) record no documents: the option is one line,
    exit 2, not a traceback."""
    shards = token_shards(tmp_path, documents=3, words=120)
    config = write_config(tmp_path / "run.yaml", **lm_config(
        shards, tmp_path / "run", {"document_mask": True}, train={"max_steps": 1}))
    res = run([BIN / "ringfeed", "train", config], timeout=300)
    assert res.returncode == 2, res.output[-3000:]
    assert "Traceback" not in res.output
    lines = [line for line in res.output.splitlines() if "ringfeed: error:" in line]
    assert lines == ["ringfeed: error: model.args.document_mask: the batches have no doc_ids "
                     "field (the shards do not record documents: shard the text again with "
                     "`ringfeed shard --format text`, or leave document_mask false)"], res.output


def flat_shards(root: Path) -> Path:
    """Flat token shards (no --seq-len) of 80 short word documents, byte-level: a window of
    32 tokens holds two or three of them."""
    rng = random.Random(0)
    text = root / "text"
    text.mkdir(parents=True)
    for d in range(80):
        (text / f"d{d:02d}.txt").write_text(" ".join(rng.choice(WORDS)
                                                     for _ in range(rng.randint(2, 5))))
    out = root / "flat"
    res = run([BIN / "ringfeed", "shard", text, out, "--format", "text", "--val-fraction",
               "0.25", "--shuffle-seed", "0", "--no-progress"], timeout=120)
    assert res.returncode == 0, res.output[-3000:]
    return out


@pytest.mark.system
@pytest.mark.timeout(900)
def test_two_ranks_train_on_flat_shards_with_the_document_mask(tmp_path: Path):
    """2 ranks, data.seq_len 32, windows packing several documents: the run (training and
    validation) takes the batches' doc_ids, and its weights are not those of the same run
    without the mask."""
    shards = flat_shards(tmp_path)
    weights = {}
    for masked in (True, False):
        name = "masked" if masked else "plain"
        config = write_config(tmp_path / f"{name}.yaml", **lm_config(
            shards, tmp_path / name, {"document_mask": masked},
            data={"seq_len": 32, "batch_size": 4}, train={"max_steps": 4, "val_every": 2}))
        res = horovodrun(2, ["ringfeed", "train", config], timeout=400)
        assert res.returncode == 0, res.output[-4000:]
        summary = json.loads((tmp_path / name / "summary.json").read_text())
        assert summary["world_size"] == 2 and math.isfinite(summary["val"]["loss"]), summary
        weights[name] = torch.load(newest_checkpoint(tmp_path / name) / "state.pt",
                                   weights_only=True)["model"]
    assert not torch.allclose(weights["masked"]["blocks.0.qkv.weight"],
                              weights["plain"]["blocks.0.qkv.weight"], atol=1e-6)

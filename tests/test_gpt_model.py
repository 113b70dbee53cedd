"""The built-in gpt as nanoGPT sets it up: nanoGPT's argument names, one line for an unknown
one (listing the valid names), bias and tied embeddings as options, weight decay on the Linear
layers' matrices only (in the optimizer a real run builds)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from helpers import run
from lm_util import newest_checkpoint, token_shards, train_gpt
from torch import nn

from ringfeed.errors import UserError
from ringfeed.train.data import LM, DataSpec
from ringfeed.train.models import build_model

SPEC = DataSpec(LM, "tokens", None, (16,), vocab_size=50)


def gpt(framework: str = "torch", **args):
    return build_model(framework, "gpt", args, SPEC)


def test_nanogpt_names_build_the_same_model():
    ours = gpt(n_layer=1, n_head=2, d_model=32)
    theirs = gpt(n_layer=1, n_head=2, n_embd=32, block_size=16, vocab_size=50, dropout=0.0,
                 bias=True)
    assert {k: v.shape for k, v in ours.state_dict().items()} == \
        {k: v.shape for k, v in theirs.state_dict().items()}
    # nanoGPT pads its vocabulary and may hold more positions than the data's context
    padded = gpt(n_embd=32, n_head=2, vocab_size=64, block_size=24)
    assert padded.tok.num_embeddings == 64 and padded.pos.num_embeddings == 24
    assert padded(torch.zeros(2, 16, dtype=torch.long)).shape == (2, 16, 64)


@pytest.mark.parametrize(("args", "expected"), [
    ({"n_embdd": 32}, "model.args.n_embdd: not an argument of the built-in gpt (valid: n_layer, "
                      "n_head, d_model, dropout, bias, tie_embeddings, document_mask, block_size, "
                      "vocab_size, "
                      "n_embd (= d_model))"),
    ({"n_embd": 32, "d_model": 64}, "model.args: n_embd and d_model are the same argument"),
    ({"block_size": 8}, "model.args.block_size: 8 is less than the data's 16"),
    ({"vocab_size": 10}, "model.args.vocab_size: 10 is less than the data's 50"),
    ({"n_head": 3}, "model.args: n_head 3 does not divide d_model 128"),
])
def test_a_wrong_argument_is_one_line(args, expected):
    with pytest.raises(UserError, match="^" + expected.replace("(", r"\(").replace(")", r"\)")):
        gpt(**args)


def test_tied_embeddings_share_one_matrix_that_learns_from_both_ends():
    model = gpt(n_layer=1, n_head=2, d_model=32, tie_embeddings=True)
    assert model.head.weight is model.tok.weight
    assert len(list(model.parameters())) == len(list(gpt(n_layer=1, n_head=2,
                                                          d_model=32).parameters())) - 1
    model(torch.randint(0, 50, (2, 16))).sum().backward()
    assert model.tok.weight.grad is not None and model.tok.weight.grad.abs().sum() > 0


def test_without_bias_no_linear_or_layernorm_has_one():
    model = gpt(n_layer=2, n_head=2, d_model=32, bias=False)
    assert not [n for n, _ in model.named_parameters() if n.endswith("bias")]
    assert model(torch.randint(0, 50, (2, 16))).shape == (2, 16, 50)


def test_weight_decay_falls_on_the_linear_matrices_only():
    model = gpt(n_layer=2, n_head=2, d_model=32, tie_embeddings=True)
    decay, rest = model.param_groups(0.1)
    assert decay["weight_decay"] == 0.1 and rest["weight_decay"] == 0.0
    names = {id(p): n for n, p in model.named_parameters()}
    decayed = {names[id(p)] for p in decay["params"]}
    linears = {f"{n}.weight" for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    assert decayed == (linears - {"head.weight"}) | {"tok.weight"}  # the tied head: tok.weight
    assert all(p.dim() == 2 for p in decay["params"])
    assert {names[id(p)] for p in rest["params"]} == {
        n for n, p in model.named_parameters() if names[id(p)] not in decayed}
    assert not any(n.startswith(("ln", "pos")) or "ln" in n.split(".")[-2] for n in decayed)
    assert len(decay["params"]) + len(rest["params"]) == len(list(model.parameters()))
    # no decay: one group, as the optimizer of a gpt run before these groups had
    assert [len(g["params"]) for g in model.param_groups(0.0)] == [len(list(model.parameters()))]


@pytest.mark.system
@pytest.mark.timeout(600)
def test_a_run_of_the_gpt_decays_only_its_matrices(tmp_path: Path):
    """The optimizer a real `ringfeed train` builds holds the model's two groups (its
    checkpoint says so), and the tied run trains."""
    run_dir = train_gpt(tmp_path, token_shards(tmp_path), model_args={"tie_embeddings": True},
                        train={"max_steps": 2})
    state = torch.load(newest_checkpoint(run_dir) / "state.pt", weights_only=True)
    groups = state["optimizer"]["param_groups"]
    assert [g["weight_decay"] for g in groups] == [0.1, 0.0]
    weights = state["model"]
    assert len(groups[0]["params"]) == 1 + 4  # tied head/embedding + 4 Linear matrices a block
    assert torch.equal(weights["head.weight"], weights["tok.weight"])


@pytest.mark.system  # (TensorFlow starts a subprocess when it loads)
def test_keras_gpt_takes_the_same_names_and_refuses_tying_and_document_masks():
    model = gpt("tensorflow", n_layer=1, n_head=2, n_embd=16, bias=False)
    assert model.output_shape == (None, 16, 50)
    assert not [w for w in model.weights if "bias" in w.path or "beta" in w.path]
    with pytest.raises(UserError, match="tie_embeddings: the built-in gpt ties its head to the "
                                        "token embedding under framework: torch only"):
        gpt("tensorflow", tie_embeddings=True)
    with pytest.raises(UserError, match="^model.args.document_mask: the built-in gpt masks "
                                        "documents under framework: torch only"):
        gpt("tensorflow", document_mask=True)


@pytest.mark.system
@pytest.mark.parametrize("framework", ["torch", "tensorflow"])
def test_one_adamw_step_decays_the_matrices_only(framework):
    """One step with weight decay 0.5 against the same step with 0.1: only the Linear/Dense
    (and attention) kernels differ; embeddings, LayerNorms and biases do not."""
    code = ("import json, sys; sys.path.insert(0, sys.argv[2]); from lm_util import "
            "changed_by_weight_decay as f; print(json.dumps(f(sys.argv[1])))")
    res = run([sys.executable, "-c", code, framework, str(Path(__file__).parent)], timeout=240)
    assert res.returncode == 0, res.output[-3000:]
    changed = json.loads(res.stdout.strip().splitlines()[-1])
    if framework == "torch":
        assert sorted(changed) == sorted(["blocks.0.qkv.weight", "blocks.0.proj.weight",
                                          "blocks.0.mlp.0.weight", "blocks.0.mlp.2.weight",
                                          "head.weight"])
    else:
        assert changed and all(n.endswith("kernel") for n in changed)
        assert len(changed) == 4 + 2 + 1  # query/key/value/output, the MLP's two, the head

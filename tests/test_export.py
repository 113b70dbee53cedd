"""`ringfeed export`: the built-in gpt as a Hugging Face GPT2LMHeadModel directory that
transformers loads, with the checkpoint's logits and greedy generations (untied with biases,
and tied without); any torch model as a plain state_dict; what it refuses is one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers import BIN, run
from lm_util import load_gpt, token_shards, train_gpt
from train_util import toy_config, write_config, write_toy_shards

from ringfeed.train.generate import sample

pytestmark = [pytest.mark.system, pytest.mark.timeout(600)]  # (a module fixture trains)
VARIANTS = {"nanogpt": {"tie_embeddings": True, "bias": False}, "default": {}}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("lm")
    shards = token_shards(root)
    return {name: train_gpt(root, shards, name, model_args=args)
            for name, args in VARIANTS.items()}


def export(*args: object) -> tuple[int, str]:
    res = run([BIN / "ringfeed", "export", *map(str, args)], timeout=180)
    assert not res.timed_out
    return res.returncode, res.output


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_transformers_loads_the_export_with_the_checkpoints_logits(runs, variant, tmp_path):
    from transformers import GPT2LMHeadModel

    code, out = export(runs[variant], tmp_path / "hf")
    assert code == 0, out
    assert sorted(p.name for p in (tmp_path / "hf").iterdir()) == ["config.json",
                                                                  "model.safetensors"]
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["tie_word_embeddings"] is (variant == "nanogpt") and config["eos_token_id"] == 256
    hf = GPT2LMHeadModel.from_pretrained(tmp_path / "hf").eval()
    ours = load_gpt(runs[variant], VARIANTS[variant])
    tokens = torch.randint(0, 257, (3, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected, got = ours(tokens), hf(tokens).logits
    assert got.shape == expected.shape
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    # transformers' greedy generation continues a prompt as ringfeed's sampling does
    prompt = list(b"the quick ")
    with torch.no_grad():
        generated = hf.generate(torch.tensor([prompt]), max_new_tokens=20, do_sample=False,
                                pad_token_id=256)[0, len(prompt):].tolist()
    mine = sample(ours, prompt, 20, temperature=0, stop_id=256)
    assert generated[:len(mine)] == mine and len(mine) > 0


def test_a_torch_model_exports_as_its_state_dict(tmp_path):
    shards = write_toy_shards(tmp_path / "toy", n_train=64, n_val=16)
    config = write_config(tmp_path / "mlp.yaml", **toy_config(
        shards, tmp_path / "mlp", train={"max_steps": 2}, output={"dir": str(tmp_path / "mlp"),
                                                                    "loggers": []}))
    res = run([BIN / "ringfeed", "train", config], timeout=240)
    assert res.returncode == 0, res.output[-3000:]
    checkpoint = sorted((tmp_path / "mlp" / "checkpoints").glob("ckpt-*"))[-1]
    code, out = export(tmp_path / "mlp", tmp_path / "sd", "--format", "state_dict")
    assert code == 0, out
    exported = torch.load(tmp_path / "sd" / "state_dict.pt", weights_only=True)
    held = torch.load(checkpoint / "state.pt", weights_only=True)["model"]
    assert exported.keys() == held.keys() and all(torch.equal(exported[k], held[k]) for k in held)
    # the Hugging Face format is the built-in gpt's: one line saying so
    code, out = export(tmp_path / "mlp", tmp_path / "hf")
    assert code == 2 and "model.name is 'mlp'" in out and "--format state_dict" in out
    assert "Traceback" not in out and not (tmp_path / "hf").exists()


def test_an_existing_directory_is_never_overwritten(runs, tmp_path):
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "mine.txt").write_text("keep")
    code, out = export(runs["default"], tmp_path / "taken")
    assert code == 2 and "already exists" in out and out.count("\n") == 1
    assert [p.name for p in (tmp_path / "taken").iterdir()] == ["mine.txt"]
    assert [p.name for p in tmp_path.iterdir()] == ["taken"]  # no temporary left either

"""A tiny language-model run for the LM tests (test_generate, test_export, test_lm_validation,
test_gpt_model): word soup sharded as byte-level token rows, the built-in gpt trained a few
steps by `ringfeed train`, and its weights read back as the model the checkpoint holds."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import numpy as np
from helpers import BIN, run
from train_util import write_config

WORDS = "the quick brown fox jumps over lazy dog ring feed shard token".split()
GPT_ARGS = {"n_layer": 1, "n_head": 2, "n_embd": 32}  # nanoGPT's name for d_model on purpose


def token_shards(root: Path, documents: int = 6, words: int = 300, seq_len: int = 33,
                 val_fraction: float = 0.34) -> Path:
    """Byte-level token shards of `documents` random word documents (rows of seq_len ids)."""
    rng = random.Random(0)
    text = root / "text"
    text.mkdir(parents=True)
    for d in range(documents):
        (text / f"d{d}.txt").write_text(" ".join(rng.choice(WORDS) for _ in range(words)))
    out = root / "tok"
    res = run([BIN / "ringfeed", "shard", text, out, "--format", "text", "--seq-len",
               str(seq_len), "--val-fraction", str(val_fraction), "--shuffle-seed", "0",
               "--no-progress"], timeout=120)
    assert res.returncode == 0, res.output[-3000:]
    return out


def lm_config(shards: Path, out: Path, model_args: dict[str, Any] | None = None,
              framework: str = "torch", **sections: dict[str, Any]) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "framework": framework,
        "model": {"name": "gpt", "args": {**GPT_ARGS, **(model_args or {})}},
        "data": {"train": str(shards), "batch_size": 8, "val_batch_size": 5},
        "optim": {"name": "adamw", "lr": 0.01, "weight_decay": 0.1},
        "train": {"max_steps": 6, "log_every": 3},
        "checkpoint": {"every_steps": 3},
        "output": {"dir": str(out), "loggers": []},
    }
    for name, values in sections.items():
        cfg.setdefault(name, {}).update(values)
    return cfg


def train_gpt(root: Path, shards: Path, name: str = "run", timeout: float = 300,
              model_args: dict[str, Any] | None = None, framework: str = "torch",
              **sections: dict[str, Any]) -> Path:
    """One process of `ringfeed train` on `shards`; its output.dir."""
    out = root / name
    config = write_config(root / f"{name}.yaml", **lm_config(shards, out, model_args, framework,
                                                             **sections))
    res = run([BIN / "ringfeed", "train", config], timeout=timeout)
    assert res.returncode == 0, res.output[-4000:]
    return out


def newest_checkpoint(run_dir: Path) -> Path:
    return sorted((run_dir / "checkpoints").glob("ckpt-*"))[-1]


def load_gpt(run_dir: Path, model_args: dict[str, Any] | None = None):
    """The built-in gpt with the newest checkpoint's weights, built here from the model code
    (not through ringfeed generate/export)."""
    import torch

    from ringfeed.train.data import LM, DataSpec
    from ringfeed.train.models.torch_models import build

    state = torch.load(newest_checkpoint(run_dir) / "state.pt", weights_only=True)["model"]
    vocab, _ = state["tok.weight"].shape
    spec = DataSpec(LM, "tokens", None, (state["pos.weight"].shape[0],), vocab_size=vocab)
    model = build("gpt", spec, **{**GPT_ARGS, **(model_args or {})})
    model.load_state_dict(state)
    return model.eval()


def token_rows(shards: Path, split: str) -> list[np.ndarray]:
    """Every token row of `split`, in shard and member order, read with tarfile."""
    import io
    import tarfile

    rows = []
    for tar in sorted(shards.glob(f"{split}-*.tar")):
        with tarfile.open(tar) as f:
            for member in f.getmembers():
                if member.name.endswith(".npy"):
                    rows.append(np.load(io.BytesIO(f.extractfile(member).read())))
    return rows


def changed_by_weight_decay(framework: str) -> list[str]:
    """The gpt's variables that one AdamW step with weight decay 0.5 leaves other than the
    same step with 0.1 (the Adam part is the same, so only decayed ones differ; 0 would be
    refused by Keras' AdamW); run in a process of its own (it starts Horovod)."""
    from ringfeed.train.backends.select import make_backend
    from ringfeed.train.config import RunConfig
    from ringfeed.train.data import LM, DataSpec

    spec = DataSpec(LM, "tokens.npy", None, (8,), vocab_size=20)
    batch = {"tokens.npy": np.random.default_rng(0).integers(0, 20, (4, 9))}
    after = []
    for decay in (0.1, 0.5):
        cfg = RunConfig.model_validate({
            "framework": framework, "data": {"train": "unused", "batch_size": 4},
            "model": {"name": "gpt", "args": {"n_layer": 1, "n_head": 2, "d_model": 8}},
            "optim": {"name": "adamw", "lr": 0.1, "weight_decay": decay},
            "train": {"seed": 3}})
        backend = make_backend(cfg)
        backend.build(spec)
        backend.sync_from_root(resumed=False)
        backend.train_step([batch], lr=0.1)
        after.append(backend.weights())
    if framework == "torch":
        names = list(backend.model.state_dict())
    else:
        names = [v.path for v in backend.model.variables]
    return [n for n, a, b in zip(names, *after, strict=True) if not np.array_equal(a, b)]

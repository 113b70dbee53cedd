"""Built-in PyTorch models: `mlp`, `cnn` (small image classifier), `gpt` (small causal
transformer, nanoGPT-style). No batch norm: per-rank batch statistics would make 2 ranks x b
differ from 1 rank x 2b, and the equivalence tests hold the trainer to that."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from ringfeed.train.data import DataSpec
from ringfeed.train.models.gpt_args import gpt_args


class MLP(nn.Module):
    def __init__(self, in_features: int, num_classes: int, hidden: Sequence[int] = (256, 128),
                 dropout: float = 0.0):
        super().__init__()
        layers: list[nn.Module] = [nn.Flatten()]
        width = in_features
        for h in hidden:
            layers += [nn.Linear(width, h), nn.ReLU(), nn.Dropout(dropout)]
            width = h
        layers.append(nn.Linear(width, num_classes))
        self.net = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 4:
            # images come as (N, C, H, W), a view of NHWC memory: flattened in (H, W, C)
            # order, as Keras' Flatten does - the batch's own memory order, so no copy
            x = x.permute(0, 2, 3, 1)
        return self.net(x)


class CNN(nn.Module):
    """Three 3x3 conv stages (two 2x2 max-pools), then a dense head; takes (N, C, H, W), as
    torch.nn's convolutions do (the trainer hands images over as a channels_last view)."""

    def __init__(self, input_shape: Sequence[int], num_classes: int, width: int = 32,
                 hidden: int = 128, dropout: float = 0.0):
        super().__init__()
        h, w, c = input_shape
        self.features = nn.Sequential(
            nn.Conv2d(c, width, 3, padding=1), nn.ReLU(),
            nn.Conv2d(width, width, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(width, 2 * width, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Flatten(),
        )
        self.head = nn.Sequential(
            nn.Linear(2 * width * (h // 4) * (w // 4), hidden), nn.ReLU(), nn.Dropout(dropout),
            nn.Linear(hidden, num_classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))


class Block(nn.Module):
    def __init__(self, d_model: int, n_head: int, dropout: float, bias: bool = True):
        super().__init__()
        self.n_head, self.dropout = n_head, dropout
        self.ln1 = nn.LayerNorm(d_model, bias=bias)
        self.qkv = nn.Linear(d_model, 3 * d_model, bias=bias)
        self.proj = nn.Linear(d_model, d_model, bias=bias)
        self.ln2 = nn.LayerNorm(d_model, bias=bias)
        self.mlp = nn.Sequential(nn.Linear(d_model, 4 * d_model, bias=bias), nn.GELU(),
                                 nn.Linear(4 * d_model, d_model, bias=bias), nn.Dropout(dropout))

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        """`mask`: (batch, 1, t, t) booleans, True where a token may attend (block_causal);
        None: causal over the whole window."""
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None,
                                           dropout_p=self.dropout if self.training else 0.0)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, c))
        return x + self.mlp(self.ln2(x))


def block_causal(doc_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(mask, positions) of windows whose tokens carry document indexes (batch, t), as
    ringfeed.formats.tokens.DOC_IDS gives them (non-decreasing along a window): the mask
    (batch, 1, t, t) lets a token attend to earlier tokens of its own document only
    (torchtitan's block_causal); positions count from 0 at each document's first token, so a
    document packed after another is computed as it would be alone (and as `ringfeed
    generate` feeds a prompt, from position 0)."""
    t = doc_ids.shape[1]
    index = torch.arange(t, device=doc_ids.device)
    same = doc_ids[:, :, None] == doc_ids[:, None, :]
    mask = (same & (index[:, None] >= index[None, :]))[:, None]
    starts = torch.ones_like(doc_ids, dtype=torch.bool)
    starts[:, 1:] = doc_ids[:, 1:] != doc_ids[:, :-1]
    first = torch.where(starts, index, 0).cummax(dim=1).values  # each token's document start
    return mask, index - first


class GPT(nn.Module):
    """GPT-2's architecture as nanoGPT builds it (pre-LayerNorm blocks, GELU, learned
    positions, GPT-2's init); `block_size` positions (the longest input), `bias` in every
    Linear and LayerNorm, the head tied to the token embedding with `tie_embeddings`,
    `document_mask`: a token attends within its own document only (block_causal; the torch
    backend then passes the batch's doc_ids). Layer names are kept across these options, so
    checkpoints and `ringfeed export` read every variant alike."""

    def __init__(self, vocab_size: int, block_size: int, n_layer: int = 2, n_head: int = 4,
                 d_model: int = 128, dropout: float = 0.0, bias: bool = True,
                 tie_embeddings: bool = False, document_mask: bool = False):
        super().__init__()
        self.document_mask = document_mask  # the backend's cue to pass doc_ids
        self.tok = nn.Embedding(vocab_size, d_model)
        self.pos = nn.Embedding(block_size, d_model)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(Block(d_model, n_head, dropout, bias) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(d_model, bias=bias)
        self.head = nn.Linear(d_model, vocab_size, bias=False)
        self.apply(self._init)
        for name, p in self.named_parameters():  # GPT-2's scaled init of residual projections
            if name.endswith(("proj.weight", "mlp.2.weight")):
                nn.init.normal_(p, std=0.02 / math.sqrt(2 * n_layer))
        if tie_embeddings:  # one matrix: nanoGPT's `wte.weight = lm_head.weight`
            self.head.weight = self.tok.weight

    @staticmethod
    def _init(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=0.02)
            if getattr(module, "bias", None) is not None:
                nn.init.zeros_(module.bias)

    def forward(self, idx: torch.Tensor, doc_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Logits of `idx` (batch, t); with `doc_ids` (batch, t) block-causal (block_causal),
        without them causal over the window (one document)."""
        mask = None
        positions = torch.arange(idx.shape[1], device=idx.device)
        if doc_ids is not None:
            mask, positions = block_causal(doc_ids)
        x = self.drop(self.tok(idx) + self.pos(positions))
        for block in self.blocks:
            x = block(x, mask)
        return self.head(self.ln_f(x))

    def param_groups(self, weight_decay: float) -> list[dict]:
        """The optimizer's groups: weight decay on the Linear layers' weight matrices only
        (the head's included, so a tied embedding decays, as nanoGPT's does); none on
        embeddings, LayerNorm weights and biases, whose decay pulls them toward zero for no
        regularising gain (minGPT's and nanoGPT's rule). The backend builds its optimizer
        from these when a model has this method. Without decay, one group: the optimizer a
        gpt had before these groups, so its checkpoints (those without decay) still resume."""
        params = list(self.parameters())  # (a tied matrix once)
        if not weight_decay:
            return [{"params": params, "weight_decay": 0.0}]
        decayed = {id(m.weight) for m in self.modules() if isinstance(m, nn.Linear)}
        return [{"params": [p for p in params if id(p) in decayed], "weight_decay": weight_decay},
                {"params": [p for p in params if id(p) not in decayed], "weight_decay": 0.0}]


def build(name: str, spec: DataSpec, **args) -> nn.Module:
    if name == "gpt":
        return GPT(**gpt_args(args, spec.require("vocab_size"), spec.input_shape[0]))
    num_classes = args.pop("num_classes", None) or spec.require("num_classes")
    if name == "mlp":
        return MLP(math.prod(spec.input_shape), num_classes, **args)
    return CNN(spec.input_shape, num_classes, **args)

"""`ringfeed generate RUN_DIR_or_CHECKPOINT --prompt TEXT [--max-new-tokens N --temperature T
--top-k K --seed S]`: text sampled from a run's built-in gpt, as nanoGPT's sample.py samples.

The checkpoint is found as `ringfeed export` finds it (train/export.py: a run's newest complete
one, local or in a bucket, or the one named). The tokenizer is the one the run's token shards
record (manifest.json `text.tokenizer`: `bytes`, or the `module:attr` ringfeed shard was given),
or `--tokenizer`. Each new token: the logits of the last position over at most the model's
positions (the context cropped from the left), divided by the temperature, all but the top k
set to -inf, one draw from their softmax; temperature 0 takes the argmax (greedy). The draws
come from a generator seeded with --seed, so a seed gives the same text every time on the same
machine. Sampling stops after N tokens or at the end-of-document id, which is not printed. An
empty prompt starts a new document (the end-of-document id as context).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import Any

from ringfeed.errors import UserError
from ringfeed.train.export import add_source_arguments, build_gpt, read_checkpoint, shards_text

Decode = Callable[[list[int]], str]


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "generate", help="sample text from a run's built-in gpt",
        description="Sample text from the newest complete checkpoint of a run (or the "
                    "checkpoint named) of the built-in gpt, as nanoGPT's sample.py does.")
    add_source_arguments(p)
    p.add_argument("--prompt", default="", help="the text to continue (default: a new document)")
    p.add_argument("--max-new-tokens", type=int, default=200, metavar="N")
    p.add_argument("--temperature", type=float, default=0.8, metavar="T",
                   help="0: greedy (the most likely token each time)")
    p.add_argument("--top-k", type=int, default=200, metavar="K",
                   help="draw from the K most likely tokens only; 0: from all")
    p.add_argument("--seed", type=int, default=1337, metavar="S")
    p.add_argument("--tokenizer", default=None, metavar="SPEC",
                   help="bytes or module:attr (default: the one the run's shards record)")
    p.set_defaults(func=run)


def sample(model: Any, ids: list[int], max_new_tokens: int, temperature: float = 0.8,
           top_k: int | None = 200, seed: int = 1337, stop_id: int | None = None) -> list[int]:
    """The ids `model` appends to `ids` (rules in the module doc)."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    block = model.pos.num_embeddings
    idx = torch.tensor([ids], dtype=torch.long)
    new: list[int] = []
    with torch.no_grad():
        for _ in range(max_new_tokens):
            logits = model(idx[:, -block:])[0, -1, :].float()
            if temperature == 0:
                token = int(logits.argmax())
            else:
                logits = logits / temperature
                if top_k:
                    kth = torch.topk(logits, min(top_k, logits.numel())).values[-1]
                    logits[logits < kth] = -float("inf")
                token = int(torch.multinomial(torch.softmax(logits, -1), 1, generator=generator))
            if token == stop_id:
                break
            new.append(token)
            idx = torch.cat([idx, torch.tensor([[token]])], dim=1)
    return new


def text_codec(spec: str) -> tuple[Callable[[str], list[int]], Decode, int]:
    """(encode, decode, end-of-document id) of a tokenizer as `ringfeed shard --tokenizer`
    names it (shards/tokenizers.py loads it; decode is its object's own `decode`)."""
    from ringfeed.shards.tokenizers import BYTES, load_tokenizer

    tokenizer = load_tokenizer(spec)
    if spec == BYTES or tokenizer.encode is None:
        return (lambda text: list(text.encode())), _decode_bytes, tokenizer.eos_id
    decode = getattr(getattr(tokenizer.encode, "__self__", None), "decode", None)
    if not callable(decode):
        raise UserError(f"tokenizer {spec}: has no decode(ids) method to turn the sampled ids "
                        "into text (give --tokenizer one that has)")
    return (lambda text: list(tokenizer.encode(text))), (lambda ids: str(decode(ids))), \
        tokenizer.eos_id


def _decode_bytes(ids: list[int]) -> str:
    return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


def run(args: argparse.Namespace) -> int:
    if args.max_new_tokens < 0 or args.temperature < 0 or args.top_k < 0:
        raise UserError("--max-new-tokens, --temperature and --top-k must be >= 0")
    checkpoint = read_checkpoint(args.source, args.storage_option)
    model = build_gpt(checkpoint, "generate")
    spec = args.tokenizer or (shards_text(checkpoint.config) or {}).get("tokenizer")
    if spec is None:
        raise UserError(f"{args.source}: the run's token shards (data.train) cannot be read "
                        "for their tokenizer; give --tokenizer bytes or module:attr")
    encode, decode, eos = text_codec(str(spec))
    ids = encode(args.prompt) if args.prompt else [eos]
    vocab = model.tok.num_embeddings
    if any(not 0 <= i < vocab for i in ids):
        raise UserError(f"--prompt: tokenizer {spec} gives ids outside the model's vocabulary "
                        f"of {vocab} (is it the run's tokenizer?)")
    new = sample(model, ids, args.max_new_tokens, args.temperature, args.top_k or None,
                 args.seed, stop_id=eos)
    sys.stdout.write(args.prompt + decode(new) + "\n")
    sys.stdout.flush()
    return 0

"""The built-in gpt's `model.args`, in ringfeed's names or nanoGPT's.

nanoGPT's GPTConfig names (n_layer, n_head, n_embd, block_size, bias, dropout, vocab_size) are
accepted as they are, so a nanoGPT config's numbers carry over; `n_embd` is `d_model`. The data
decides the vocabulary and the context, so `vocab_size` and `block_size` may only make them
larger (nanoGPT pads GPT-2's 50,257 tokens to 50,304; a larger block_size leaves positions for
`ringfeed generate`). Anything else is one line listing the valid names, before any model is
built (it was a TypeError naming GPT.__init__).
"""

from __future__ import annotations

from types import MappingProxyType
from typing import Any

from ringfeed.errors import UserError

# ringfeed's name -> (default, what it is); the model builders take these keywords
GPT_ARGS: MappingProxyType[str, tuple[Any, str]] = MappingProxyType({
    "n_layer": (2, "transformer blocks"),
    "n_head": (4, "attention heads (must divide d_model)"),
    "d_model": (128, "width (nanoGPT: n_embd)"),
    "dropout": (0.0, "dropout after embeddings, attention and MLP"),
    "bias": (True, "biases in Linear and LayerNorm layers (nanoGPT's bias)"),
    # Off by default: a run's checkpoints must resume into the model they came from, and an
    # untied run resumed as a tied one would silently load the head over the embedding; the
    # Keras gpt (framework: tensorflow) has no tied head. nanoGPT's setting: true.
    "tie_embeddings": (False, "the output head shares the token embedding (nanoGPT: true)"),
    # Needs shards that record documents (the batch's doc_ids); torch only.
    "document_mask": (False, "a token attends only to earlier tokens of its own document "
                             "(block-causal), positions restarting at each document"),
    "block_size": (None, "positions (nanoGPT's name; >= the data's context)"),
    "vocab_size": (None, "tokens (>= the data's vocabulary)"),
})
ALIASES = MappingProxyType({"n_embd": "d_model"})


def gpt_args(args: dict[str, Any], vocab_size: int, seq_len: int) -> dict[str, Any]:
    """`model.args` as the builders' keywords: aliases resolved, defaults filled, vocab_size and
    block_size decided (at least the data's). UserError (one line) for an unknown name, a name
    given twice, or a size the data does not fit."""
    out: dict[str, Any] = {}
    given_as: dict[str, str] = {}
    for name, value in args.items():
        key = ALIASES.get(name, name)
        if key not in GPT_ARGS:
            valid = ", ".join([*GPT_ARGS, *(f"{a} (= {k})" for a, k in ALIASES.items())])
            raise UserError(f"model.args.{name}: not an argument of the built-in gpt (valid: "
                            f"{valid})")
        if key in out:
            raise UserError(f"model.args: {given_as[key]} and {name} are the same argument; "
                            "give one")
        out[key], given_as[key] = value, name
    out = {key: out.get(key, default) for key, (default, _) in GPT_ARGS.items()}
    for key, data_value in (("vocab_size", vocab_size), ("block_size", seq_len)):
        given = out[key]
        if given is None:
            out[key] = data_value
        elif not isinstance(given, int) or given < data_value:
            raise UserError(f"model.args.{key}: {given!r} is less than the data's {data_value} "
                            f"(leave it out to take the data's)")
    if out["d_model"] % out["n_head"]:
        raise UserError(f"model.args: n_head {out['n_head']} does not divide d_model "
                        f"{out['d_model']}")
    return out

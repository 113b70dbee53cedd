"""What a model returns, as the built-in loss and metrics need it: the logits.

Libraries return their outputs in a few shapes, and ringfeed takes each as it comes:
- a tensor: the logits themselves (ringfeed's built-ins, torchvision, timm, Keras);
- a mapping or a dataclass with a `logits` entry (Hugging Face's `ModelOutput`, e.g.
  `ImageClassifierOutput`, which is both);
- a tuple or list whose first element is a tensor (`return_dict=False`, models returning
  `(logits, aux)`).
Anything else is a UserError naming the factory (model.name), what came back and what is
expected. A user's own train.loss / train.metrics get the output exactly as the model returned
it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

Fn = Callable[[Any, Any], Any]

EXPECTED = ("a tensor of logits, a mapping or ModelOutput/dataclass with 'logits', or a tuple "
            "whose first element is the logits")


def logits_of(out: Any, is_tensor: Callable[[Any], bool], model_name: str) -> Any:
    """The logits in `out`, a model's output (rules above); `is_tensor` is the framework's
    test. Raises UserError for an output none of the rules fits."""
    if is_tensor(out):
        return out
    if isinstance(out, Mapping):
        if "logits" in out and is_tensor(out["logits"]):
            return out["logits"]
        return _unusable(out, model_name, f"keys {', '.join(map(str, out)) or 'none'}")
    if dataclasses.is_dataclass(out) and not isinstance(out, type):
        logits = getattr(out, "logits", None)
        if is_tensor(logits):
            return logits
        names = [f.name for f in dataclasses.fields(out)]
        return _unusable(out, model_name, f"fields {', '.join(names) or 'none'}")
    if isinstance(out, (tuple, list)):
        if out and is_tensor(out[0]):
            return out[0]
        first = type(out[0]).__name__ if out else "nothing"
        return _unusable(out, model_name, f"{len(out)} element(s), the first {first}")
    return _unusable(out, model_name, None)


def _unusable(out: Any, model_name: str, detail: str | None) -> Any:
    from ringfeed.errors import UserError

    shown = type(out).__name__ + (f" ({detail})" if detail else "")
    raise UserError(f"model.name {model_name}: the model returned {shown}; the built-in loss "
                    f"and metrics expect {EXPECTED} (return one of these from the model, or "
                    "set train.loss and train.metrics to functions that take this output)")


def on_logits(fn: Fn, is_tensor: Callable[[Any], bool], model_name: str) -> Fn:
    """`fn(outputs, targets)` applied to the logits in the model's outputs (logits_of)."""

    def call(out: Any, targets: Any) -> Any:
        return fn(logits_of(out, is_tensor, model_name), targets)

    return call

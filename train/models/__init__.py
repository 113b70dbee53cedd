"""Model registry: the built-ins (`mlp`, `cnn`, `gpt`, one file per framework) and user models
named "module:function".

A user factory is called with the config's `model.args` as keywords, plus `spec` (the DataSpec:
input shape, number of classes, vocabulary, sequence length) and `framework` if its signature
asks for them. It returns a `torch.nn.Module` or a Keras model. Every model receives the batch's
input field: images (samples of shape height x width x channels) as float in [0, 1] or
normalized, laid out (N, C, H, W) for torch - a channels_last view of the pipeline's NHWC batch -
and (N, H, W, C) for Keras (`model.input_layout` picks the other); tokens as int64 ids; table
rows as float vectors. It returns logits, (batch, classes) or (batch, seq, vocab), as a tensor
or in the forms outputs.py accepts (a ModelOutput with `logits`, a tuple led by the logits).
"""

from __future__ import annotations

from typing import Any

from ringfeed.errors import UserError
from ringfeed.train.config import BUILTIN_MODELS
from ringfeed.train.data import LM, DataSpec
from ringfeed.userhooks import call_with_optional, load_callable


def build_model(framework: str, name: str, args: dict[str, Any], spec: DataSpec) -> Any:
    if name == "cnn":
        check_cnn_input(spec.input_shape)
    if name in BUILTIN_MODELS:
        if framework == "torch":
            from ringfeed.train.models import torch_models as builders
        else:
            from ringfeed.train.models import keras_models as builders
        try:
            return builders.build(name, spec, **args)
        except TypeError as e:  # an unknown model.args key
            raise UserError(f"model.args for {name!r}: {e}") from None
    factory = load_callable(name, "model.name")
    model = call_with_optional(factory, args, {"spec": spec, "framework": framework})
    _check_type(framework, name, model)
    return model


def channels_first(framework: str, layout: str, spec: DataSpec) -> bool:
    """Whether the model gets its image batches as (N, C, H, W): model.input_layout, where
    `auto` is the framework's convention (torch: NCHW, what torch.nn, torchvision, timm and
    Hugging Face expect; TensorFlow/Keras: NHWC). Only image inputs (samples of shape
    height x width x channels) are laid out; tokens and table rows pass as they are."""
    if spec.task == LM or len(spec.input_shape) != 3:
        return False
    if layout == "auto":
        return framework == "torch"
    return layout == "nchw"


def check_cnn_input(shape: tuple[int, ...]) -> None:
    """The built-in cnn takes (height, width, channels) images of at least 4 x 4 pixels (it
    halves them twice); anything else is a config error, found before the first step (it was
    a shape error from inside the model, which a restart would repeat)."""
    if len(shape) != 3 or min(shape[:2]) < 4:
        raise UserError(f"model.name cnn needs images of at least 4 x 4 pixels (height, width, "
                        f"channels), got samples of shape {tuple(shape)} (set data.image_size, "
                        "or use model.name mlp)")


def _check_type(framework: str, name: str, model: Any) -> None:
    if framework == "torch":
        import torch

        ok, expected = isinstance(model, torch.nn.Module), "a torch.nn.Module"
    else:
        import keras

        ok, expected = isinstance(model, keras.Model), "a keras.Model"
    if not ok:
        raise UserError(f"model.name: {name} returned {type(model).__name__}, expected {expected} "
                        f"(framework: {framework})")

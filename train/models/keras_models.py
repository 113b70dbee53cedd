"""Built-in Keras 3 models, the same architectures as torch_models.py (`mlp`, `cnn`, `gpt`).
Logits come out in float32 even under a mixed precision policy (Keras' advice for stable
softmax/loss)."""

from __future__ import annotations

from collections.abc import Sequence

import keras
from keras import layers

from ringfeed.errors import UserError
from ringfeed.train.data import DataSpec
from ringfeed.train.models.gpt_args import gpt_args


def mlp(spec: DataSpec, num_classes: int, hidden: Sequence[int] = (256, 128),
        dropout: float = 0.0) -> keras.Model:
    inputs = keras.Input(spec.input_shape)
    x = layers.Flatten()(inputs)
    for h in hidden:
        x = layers.Dropout(dropout)(layers.Dense(h, activation="relu")(x))
    return keras.Model(inputs, _logits(x, num_classes), name="mlp")


def cnn(spec: DataSpec, num_classes: int, width: int = 32, hidden: int = 128,
        dropout: float = 0.0) -> keras.Model:
    inputs = keras.Input(spec.input_shape)  # NHWC, as the pipeline yields it
    x = layers.Conv2D(width, 3, padding="same", activation="relu")(inputs)
    x = layers.Conv2D(width, 3, padding="same", activation="relu")(x)
    x = layers.MaxPooling2D(2)(x)
    x = layers.Conv2D(2 * width, 3, padding="same", activation="relu")(x)
    x = layers.MaxPooling2D(2)(x)
    x = layers.Dense(hidden, activation="relu")(layers.Flatten()(x))
    return keras.Model(inputs, _logits(layers.Dropout(dropout)(x), num_classes), name="cnn")


def gpt(spec: DataSpec, vocab_size: int, block_size: int, n_layer: int = 2, n_head: int = 4,
        d_model: int = 128, dropout: float = 0.0, bias: bool = True,
        tie_embeddings: bool = False, document_mask: bool = False) -> keras.Model:
    if document_mask:  # (the TensorFlow backend does not pass the batch's doc_ids)
        raise UserError("model.args.document_mask: the built-in gpt masks documents under "
                        "framework: torch only (leave it false for framework: tensorflow)")
    if tie_embeddings:
        raise UserError("model.args.tie_embeddings: the built-in gpt ties its head to the "
                        "token embedding under framework: torch only (leave it false for "
                        "framework: tensorflow)")
    seq_len = spec.input_shape[0]
    init = keras.initializers.RandomNormal(stddev=0.02)
    tokens = keras.Input((seq_len,), dtype="int32")
    x = layers.Embedding(vocab_size, d_model, embeddings_initializer=init)(tokens)
    positions = layers.Embedding(block_size, d_model, embeddings_initializer=init)(
        keras.ops.arange(seq_len))
    x = layers.Dropout(dropout)(x + positions)
    for _ in range(n_layer):
        h = layers.LayerNormalization(epsilon=1e-5, center=bias)(x)
        h = layers.MultiHeadAttention(n_head, d_model // n_head, dropout=dropout, use_bias=bias,
                                      kernel_initializer=init)(h, h, use_causal_mask=True)
        x = x + h
        h = layers.LayerNormalization(epsilon=1e-5, center=bias)(x)
        h = layers.Dense(4 * d_model, activation="gelu", use_bias=bias,
                         kernel_initializer=init)(h)
        h = layers.Dense(d_model, use_bias=bias, kernel_initializer=init)(h)
        x = x + layers.Dropout(dropout)(h)
    x = layers.LayerNormalization(epsilon=1e-5, center=bias)(x)
    model = keras.Model(tokens, _logits(x, vocab_size, use_bias=False, init=init), name="gpt")
    # weight decay on the Dense and attention kernels only (torch_models.GPT.param_groups'
    # rule): the TensorFlow backend exempts what this returns from the optimizer's decay
    model.no_weight_decay = lambda: [v for v in model.trainable_variables
                                     if not v.path.endswith("kernel")]
    return model


def _logits(x, units: int, use_bias: bool = True, init="glorot_uniform"):
    return layers.Dense(units, use_bias=use_bias, kernel_initializer=init, dtype="float32")(x)


def build(name: str, spec: DataSpec, **args) -> keras.Model:
    if name == "gpt":
        return gpt(spec, **gpt_args(args, spec.require("vocab_size"), spec.input_shape[0]))
    num_classes = args.pop("num_classes", None) or spec.require("num_classes")
    return (mlp if name == "mlp" else cnn)(spec, num_classes, **args)

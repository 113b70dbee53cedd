"""tf.data adapter: `make_dataset(pipe)` -> tf.data.Dataset of dict batches.

Batches come from the pipeline's own in-process iterator (worker streams in threads, the same
order as `iter(pipe)` and the torch loader), so all three yield identical samples in identical
order. Shapes are fixed ([batch_size, ...], every batch is full under both balance policies)
and taken from the first decodable sample: variable-size fields need `image_size=` or a
`transform` that fixes their shape. Strings, bytes and JSON values (serialised) become
tf.string. Every pass over the dataset continues the current epoch (the next one once it is
complete), like `iter(pipe)`.

Consumption is counted when a batch leaves the dataset's last stage (a map after the prefetch),
so `pipe.state_dict()` counts batches the caller pulled: the batch's tag travels beside it as
the generator's second element (its own TensorSpec) up to that map, which counts and drops it.
Anything that buffers further ahead (Keras `fit` adds its own prefetch) makes the count run
ahead by that buffer.

`TensorLoader(pipe)` is for a Python loop (ringfeed's trainer): the pipeline's own pass (read
ahead in its threads), each batch made tensors in the reader thread and counted as the loop
takes it. It has no tf.data in between: on the 2-core box tf.data cost the demo's TF step
5.0-5.4% of data wait against 2.0-2.9% without it (a new tf.data iterator per pass took 20-90
ms to give its first batch; each later batch ~2.3 ms against ~1.2 ms), with identical training.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import numpy as np
import tensorflow as tf

from ringfeed.pipeline.core import ShardPipeline
from ringfeed.pipeline.errors import PipelineError

_TAG_SPEC = tf.TensorSpec((3,), tf.int64)  # a batch's (epoch, segment, t): see Booked


def _spec(name: str, value: Any, batch_size: int) -> tf.TensorSpec:
    if isinstance(value, np.ndarray):
        if value.dtype.kind in "OUS":
            return tf.TensorSpec((batch_size,), tf.string)
        return tf.TensorSpec(value.shape, tf.as_dtype(value.dtype))
    first = value[0]
    if isinstance(first, np.ndarray):
        raise PipelineError(f"field {name!r} has arrays of different shapes (e.g. {first.shape});"
                            " tf.data needs fixed shapes: pass image_size= or a transform")
    return tf.TensorSpec((batch_size,), tf.string)


def signature(pipe: ShardPipeline) -> dict[str, tf.TensorSpec]:
    example = pipe.example_batch()
    return {name: _spec(name, value, pipe.batch_size) for name, value in example.items()}


def _to_tf(batch: dict[str, Any], spec: dict[str, tf.TensorSpec]) -> dict[str, Any]:
    out = {}
    for name, value in batch.items():
        want = spec.get(name)
        if want is None:
            raise PipelineError(f"field {name!r} appeared after the first sample (fields must "
                                "be the same in every sample)")
        if want.dtype == tf.string and not isinstance(value, np.ndarray):
            value = [v if isinstance(v, (str, bytes)) else json.dumps(v) for v in value]
        elif isinstance(value, list) or tuple(value.shape) != tuple(want.shape):
            shape = getattr(value, "shape", None) or [getattr(v, "shape", None) for v in value]
            raise PipelineError(f"field {name!r}: batch shape {shape} differs from the first "
                                f"sample's {want.shape}; tf.data needs fixed shapes (pass "
                                "image_size= or a transform)")
        out[name] = value
    return out


def _require_cpu_decoding(pipe: ShardPipeline) -> None:
    if pipe.config.decode_device != "cpu":
        raise PipelineError("decode_device='cuda' decodes on the GPU in the torch adapter; "
                            "TensorFlow needs decode_device='cpu'")


class TensorLoader:
    """For a Python loop (ringfeed's trainer): every `iter()` is the pipeline's next pass as
    dicts of tensors shaped as `make_dataset`'s, each batch counted as consumed when it is
    handed out."""

    def __init__(self, pipe: ShardPipeline):
        _require_cpu_decoding(pipe)
        self.pipe = pipe
        self.spec = signature(pipe)  # a field tensors cannot carry fails here, before training

    def __iter__(self) -> Iterator[dict[str, tf.Tensor]]:
        for booked in self.pipe.iterate(count=True, convert=self._tensors):
            yield booked.batch

    def _tensors(self, batch: dict[str, Any]) -> dict[str, tf.Tensor]:
        # (runs in the pipeline's reader thread: the loop takes batches already tensors)
        return {name: tf.convert_to_tensor(value, self.spec[name].dtype)
                for name, value in _to_tf(batch, self.spec).items()}


def make_dataset(pipe: ShardPipeline, prefetch: int | None = None) -> tf.data.Dataset:
    """A tf.data.Dataset over the pipeline; `prefetch` batches (default tf.data.AUTOTUNE)."""
    _require_cpu_decoding(pipe)
    spec = signature(pipe)

    def generate() -> Iterator[tuple[dict[str, Any], tuple[int, int, int]]]:
        for booked in pipe.iterate(count=False):
            yield _to_tf(booked.batch, spec), booked.tag

    def count(batch: dict[str, tf.Tensor], tag: tf.Tensor) -> dict[str, tf.Tensor]:
        done = tf.py_function(_mark, [tag, tf.shape(batch["__index__"])[0]], tf.bool)
        with tf.control_dependencies([done]):
            return {k: tf.identity(v) for k, v in batch.items()}

    def _mark(tag: tf.Tensor, samples: tf.Tensor) -> bool:
        return pipe.mark_consumed(tag.numpy().tolist(), int(samples.numpy()))

    dataset = tf.data.Dataset.from_generator(generate, output_signature=(spec, _TAG_SPEC))
    dataset = dataset.prefetch(tf.data.AUTOTUNE if prefetch is None else prefetch)
    # tf.data would otherwise add a prefetch after the counting map (inject_prefetch) and so
    # count batches nobody has pulled yet.
    options = tf.data.Options()
    options.experimental_optimization.inject_prefetch = False
    options.experimental_optimization.map_parallelization = False
    return dataset.map(count).with_options(options)

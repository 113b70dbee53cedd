"""From config to batches: the pipelines a run reads, and what the model is fed.

`DataSpec` says what the model sees (task, input field and shape, classes or vocabulary);
it is inferred from the manifest and one peeked sample, so a config rarely has to name fields.
`split_batch` turns a pipeline batch into (inputs, targets, valid mask); it only slices, so it
works on numpy arrays, torch tensors and tf tensors alike.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from shards.errors import UserError
from train.userhooks import load_callable

CLASSIFY, LM = "classify", "lm"
TARGET_NAMES = ("y", "label", "labels", "target", "targets", "cls")


@dataclass(frozen=True)
class DataSpec:
    task: str  # "classify" (input -> class) or "lm" (tokens -> next tokens)
    input_key: str
    target_key: str | None  # None for lm: targets are the inputs shifted by one
    input_shape: tuple[int, ...]  # one sample, as the model sees it
    num_classes: int | None = None
    vocab_size: int | None = None

    def require(self, name: str) -> int:
        value = getattr(self, name)
        if value is None:
            hint = ("set model.args.num_classes, or shard with class names"
                    if name == "num_classes" else "shard text with `ringfeed shard --format text`")
            raise UserError(f"model: cannot infer {name} from the data ({hint})")
        return int(value)


def make_pipeline(cfg, split: str, rank: int, world_size: int):
    """The ShardPipeline for `split` ("train" or "val") of this rank."""
    from pipeline import ShardPipeline

    d = cfg.data
    training = split == "train"
    hooks = {name: load_callable(getattr(d, name), f"data.{name}") if getattr(d, name) else None
             for name in ("decode", "transform")}
    return ShardPipeline(
        d.train if training else cfg.val_source,
        split=d.train_split if training else d.val_split,
        batch_size=d.batch_size,
        seed=cfg.train.seed,
        shuffle=d.shuffle and training,
        shuffle_buffer=d.shuffle_buffer,
        rank=rank,
        world_size=world_size,
        num_workers=d.num_workers,
        # Validation pads instead of dropping: every sample is scored once, the padding is
        # masked out by __valid__, and all ranks still run the same number of batches.
        balance=d.balance if training else "pad",
        image_size=d.image_size,
        normalize=(d.normalize.mean, d.normalize.std) if d.normalize else None,
        on_error=d.on_error,
        cache_dir=d.cache_dir,
        cache_limit=d.cache_limit,
        prefetch=d.prefetch,
        allow_pipe=d.allow_pipe,
        read_ahead=training,  # the loop turns it off for the last epoch
        decoded_cache=d.decoded_cache,
        decode_device=d.decode_device,
        decode_threads=d.decode_threads,
        **hooks,
    )


def infer_spec(cfg, pipe) -> DataSpec:
    """Fields from the config or the manifest; shapes from the pipeline's first sample."""
    manifest = pipe.manifest
    batch = pipe.example_batch()
    fields = {k: v for k, v in batch.items() if not k.startswith("__")}
    kinds = dict(manifest.fields) if manifest is not None else {}
    text = manifest.text if manifest is not None else None
    input_key = cfg.data.input_key or _guess_input(fields, kinds, text)
    if input_key not in fields:
        raise UserError(f"data.input_key: {input_key!r} is not in the batches "
                        f"(fields: {', '.join(fields)})")
    sample_shape = tuple(np.asarray(fields[input_key]).shape[1:])
    if text is not None and cfg.data.target_key is None and input_key.startswith("tokens"):
        # Token rows hold seq_len + 1 ids (or seq_len): inputs t[:-1] predict targets t[1:].
        return DataSpec(LM, input_key, None, (sample_shape[0] - 1,),
                        vocab_size=int(text["vocab_size"]))
    target_key = cfg.data.target_key or _guess_target(fields, kinds, input_key)
    class_names = manifest.class_names if manifest is not None else None
    num_classes = cfg.model.args.get("num_classes") or (len(class_names) if class_names else None)
    return DataSpec(CLASSIFY, input_key, target_key, sample_shape, num_classes=num_classes)


def _guess_input(fields: dict[str, Any], kinds: dict[str, str], text) -> str:
    if text is not None:
        tokens = [k for k in fields if k.startswith("tokens")]
        if tokens:
            return tokens[0]
    for k in fields:
        if kinds.get(k) == "image" or (np.asarray(fields[k]).ndim == 4 and k not in kinds):
            return k
    for k in fields:
        stem = k.split(".")[0]
        if stem not in TARGET_NAMES and np.asarray(fields[k]).dtype != object:
            return k
    raise UserError(f"data.input_key: cannot infer the input field from {', '.join(fields)} "
                    "(set data.input_key)")


def _guess_target(fields: dict[str, Any], kinds: dict[str, str], input_key: str) -> str:
    for k in fields:
        if k != input_key and (kinds.get(k) == "int" or k.split(".")[0] in TARGET_NAMES):
            return k
    raise UserError(f"data.target_key: cannot infer the target field from {', '.join(fields)} "
                    "(set data.target_key)")


def split_batch(batch: dict[str, Any], spec: DataSpec) -> tuple[Any, Any, Any]:
    """(inputs, targets, valid) from one pipeline batch; valid is None when absent."""
    valid = batch.get("__valid__")
    x = batch[spec.input_key]
    if spec.task == LM:
        return x[:, :-1], x[:, 1:], valid
    y = batch[spec.target_key]
    if len(y.shape) == 2 and y.shape[1] == 1:  # per-sample labels stored as shape (1,)
        y = y[:, 0]
    return x, y, valid

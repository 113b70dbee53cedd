"""`PipelineConfig`: every option of a `ShardPipeline`, declared once.

`ShardPipeline(source, PipelineConfig(...))` or `ShardPipeline(source, **options)` (the keywords
fill a PipelineConfig); `ringfeed train`'s `data:` section is a subclass of it, so the YAML keys
are these names. A new option is a field here plus the one stage that reads it.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    NonNegativeFloat,
    NonNegativeInt,
    PositiveFloat,
    PositiveInt,
    ValidationError,
    field_validator,
    model_validator,
)

from ringfeed.fsutil import parse_size
from ringfeed.pipeline.augment import (
    as_size,
    default_val_augment,
    parse_augment,
)
from ringfeed.pipeline.errors import PipelineError
from ringfeed.userhooks import IMPORT_PATH

SampleFn = Callable[[dict[str, Any]], dict[str, Any]]
IMPORT_PATH_HELP = "a function, or an import path 'module:function'"


def _fspath(value: Any) -> Any:
    return os.fspath(value) if isinstance(value, os.PathLike) else value


PathStr = Annotated[str, BeforeValidator(_fspath)]


class PipelineConfig(BaseModel):
    """How a pipeline reads, decodes and batches; see pipeline/README.md for the guarantees."""

    # Unknown keys are errors: a typo must not silently fall back to a default.
    model_config = ConfigDict(extra="forbid", validate_assignment=True,
                              arbitrary_types_allowed=True)

    split: str = Field("train", description="the manifest's split to read")
    batch_size: PositiveInt = Field(32, description="samples per batch, per rank")
    seed: int = Field(0, description="shuffle seed: the order is a function of (seed, epoch)")
    shuffle: bool = Field(True, description="shuffle shards and samples each epoch")
    shuffle_buffer: NonNegativeInt = Field(1000, description="samples in the shuffle buffer")
    num_workers: NonNegativeInt = Field(0, description="worker streams (DataLoader workers)")
    balance: Literal["drop", "pad"] = Field(
        "drop", description="the epoch's tail: drop it, or pad with repeats (__valid__ False)")
    decode: SampleFn | str | None = Field(
        None, description=f"user decode of each raw sample dict: {IMPORT_PATH_HELP}")
    transform: SampleFn | str | None = Field(
        None, description=f"user transform of each decoded sample: {IMPORT_PATH_HELP}")
    image_size: PositiveInt | tuple[PositiveInt, PositiveInt] | None = Field(
        None, description="resize images to (height, width)")
    normalize: tuple[Any, Any] | None = Field(
        None, description="(mean, std) per channel of x / 255; None: uint8 pixels")
    augment: list[Any] | None = Field(
        None, description="this split's image augmentation, torchvision's stages in order: "
                          "random_resized_crop, horizontal_flip, resize, center_crop, "
                          "color_jitter, random_erasing (a name, or {name: {args}}; "
                          "pipeline/README.md)")
    val_augment: list[Any] | None = Field(
        None, description="the validation split's stages (default: torchvision's eval preset "
                          "when augment crops at random); ShardPipeline reads `augment` only: "
                          "a validation pipeline gets augment=augment_for(config, False)")
    channels: Literal[1, 3] | None = Field(
        None, description="image channels: 3 (RGB) or 1 (L) for every image; default 3 with "
                          "augment, else as decoded (1 for grayscale)")
    cache_short_side: PositiveInt | None = Field(
        None, description="random augment with the decoded cache: cached images' shorter side "
                          "at most this (default int(max(image_size) / 0.875): 256 for 224)")
    on_error: Literal["skip", "fail"] = Field(
        "skip", description="a bad sample: replaced by a repeat and counted, or an error")
    cache_dir: PathStr | None = Field(None, description="local shard cache (default: a temp dir)")
    cache_limit: int | str | None = Field(None, description="cache bound, bytes or '20GB'")
    prefetch: NonNegativeInt = Field(2, description="batches each stream reads ahead")
    allow_pipe: bool = Field(False, description="allow `pipe:` shard URLs (runs a command)")
    storage_options: dict[str, Any] = Field(
        default_factory=dict, description="fsspec options for remote shards")
    fields: dict[str, str] | None = Field(
        None, description="extension -> kind, over the manifest's")
    retries: NonNegativeInt = Field(
        3, description="attempts at a shard whose checksum does not match")
    retry_budget_s: NonNegativeFloat = Field(
        600.0, description="seconds a storage outage is retried before the job exits 75 "
                           "(restartable)")
    read_ahead: bool = Field(
        False, description="start reading the next epoch when the last batch of one goes out")
    decoded_cache: bool | PathStr = Field(
        False, description='cache decoded samples: true, false, a directory or "auto"')
    decode_device: Literal["cpu", "cuda"] = Field(
        "cpu", description="cuda: JPEGs decoded on the GPU by the torch adapter")
    decode_threads: NonNegativeInt = Field(
        0, description="> 1: a batch's images decode in this many threads")
    indexed: bool = Field(True, description="read shards through their tar index")
    epoch_samples: PositiveInt | None = Field(
        None, description="samples per epoch of a weighted mixture (default: all its sources')")
    order: Literal["rank", "global"] = Field(
        "rank", description="rank: each rank's batches depend on the world size and workers; "
                            "global: the global batches are the same at any world size and "
                            "worker count (needs global_batch_size)")
    global_batch_size: PositiveInt | None = Field(
        None, description="samples per batch over all ranks (order: global; each rank's batch "
                          "is this / world_size, batch_size is not read); ringfeed train: per "
                          "optimizer step, batch_size = this / (ranks x train.accumulate)")
    canonical_streams: PositiveInt | Literal["auto"] = Field(
        "auto", description="order: global: the epoch is dealt into this many streams; it must "
                            "divide global_batch_size (per batch) and be divisible by every "
                            "world size the run uses; auto: gcd(global batch, 192), so every "
                            "world size dividing both works (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, "
                            "48, 64, 96, 192 ranks)")
    seq_len: PositiveInt | None = Field(
        None, description="flat token shards (ringfeed shard --format text without --seq-len): "
                          "tokens a sample feeds the model; each sample is a window of "
                          "seq_len + 1 tokens (inputs t[:-1], targets t[1:]) with its doc_ids; "
                          "needed for them, refused for other shards")
    random_windows: bool = Field(
        False, description="with seq_len: windows start at an offset in [0, seq_len] drawn "
                           "per (seed, epoch, shard) instead of 0 (one window fewer per shard "
                           "at most; ringfeed train: training only, validation stays packed)")
    skip: list[NonNegativeInt] | PathStr | None = Field(
        None, description="sample ids (__index__) left out of every epoch: a list, or a file "
                          "of ids (whitespace/comma separated, or samples.jsonl lines)")

    @field_validator("decode", "transform")
    @classmethod
    def _hook(cls, v: SampleFn | str | None, info) -> SampleFn | str | None:
        if isinstance(v, str) and not IMPORT_PATH.match(v):
            raise ValueError(f"{info.field_name} must be an import path 'module:function', "
                             f"got {v!r}")
        return v

    @field_validator("augment", "val_augment", mode="before")
    @classmethod
    def _augment(cls, v: Any, info) -> Any:
        parse_augment(v, None, info.field_name, sized=False)  # image_size: _augment_size
        return v

    @model_validator(mode="after")
    def _augment_size(self) -> PipelineConfig:
        for name in ("augment", "val_augment"):
            parse_augment(getattr(self, name), as_size(self.image_size), name)
        return self

    @model_validator(mode="after")
    def _windows_indexed(self) -> PipelineConfig:
        if self.seq_len is not None and not self.indexed:
            raise ValueError("seq_len: windows of flat token shards are read through the tar "
                             "index; set indexed: true")
        return self

    @field_validator("decoded_cache")
    @classmethod
    def _decoded_cache(cls, v: bool | str) -> bool | str:
        if isinstance(v, str) and not v.strip():
            raise ValueError('expected true, false, "auto" or a directory')
        return v

    @field_validator("cache_limit")
    @classmethod
    def _size(cls, v: int | str | None) -> int | None:
        return None if v is None else parse_size(v)


# canonical_streams: auto divides the global batch by as much of this as it can: 192 = 2^6 x 3
# holds the world sizes people launch (powers of two to 64, and 3 x them) as divisors
AUTO_STREAMS_BOUND = 192


def resolved_streams(streams: int | str, global_batch: int) -> int:
    """The canonical stream count: `streams`, or for "auto" gcd(global_batch, 192), which every
    world size dividing both the global batch and 192 divides (and which, the global batch
    being fixed for a run, a resume at any world size finds again)."""
    return math.gcd(global_batch, AUTO_STREAMS_BOUND) if streams == "auto" else int(streams)


def canonical_rule_error(global_batch: int, streams: int | str, world_size: int,
                         field: str = "", batch_label: str | None = None) -> str | None:
    """What breaks order: global's rules for `global_batch` samples per (micro-)batch over all
    ranks, `streams` canonical streams (or "auto") and `world_size` ranks, or None. `field`
    prefixes the option names (train's "data."); `batch_label` says where `global_batch` comes
    from."""
    count = resolved_streams(streams, global_batch)
    if count % world_size:
        shown = f"auto (gcd({global_batch}, {AUTO_STREAMS_BOUND}) = {count})" \
            if streams == "auto" else str(count)
        return (f"{field}canonical_streams={shown} is not divisible by the world size "
                f"{world_size}: set {field}canonical_streams to a multiple of every world size "
                "the run will use that divides the global batch (it must stay the same for "
                "the whole run)")
    streams = count
    if global_batch % streams:
        label = batch_label or f"{field}global_batch_size={global_batch}"
        return (f"{label} is not divisible by {field}canonical_streams={streams}: each stream "
                "gives the same share of every global batch")
    return None


class WeightedSource(BaseModel):
    """One source of a weighted mixture (pipeline/mixture.py): `{path: shards/web, weight: 0.7}`."""

    model_config = ConfigDict(extra="forbid")

    path: PathStr = Field(description="a shard dir/URL with manifest.json, or shard URLs/pattern")
    weight: PositiveFloat | None = Field(
        None, description="share of the mixture's samples (relative); left out in every entry: "
                          "each source's size (the sources concatenated, every sample once)")
    name: str | None = Field(None, description="how reports name it (default: the path's "
                                               "last part)")


def pipeline_config(config: PipelineConfig | None, options: dict[str, Any]) -> PipelineConfig:
    """`config` with `options` over it (ShardPipeline's keywords); a bad value is one
    PipelineError line naming the option."""
    try:
        if config is None:
            return PipelineConfig(**options)
        if not options and type(config) is PipelineConfig:
            return config
        # (a subclass, such as the train config's data section, carries keys of its own)
        base = {k: getattr(config, k) for k in PipelineConfig.model_fields}
        return PipelineConfig(**{**base, **options})
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        message = first["msg"].removeprefix("Value error, ")
        if where and not message.startswith((f"{where}:", f"{where}[")):  # (augment's name it)
            message = f"{where}: {message}"
        raise PipelineError(message) from None


def augment_for(config: PipelineConfig, training: bool) -> list[Any] | None:
    """The stages a pipeline of `config` takes as its `augment`: the train split's
    (`augment`), or the validation split's (`val_augment`, else default_val_augment)."""
    if training:
        return config.augment
    if config.val_augment is not None:
        return config.val_augment
    return default_val_augment(config.augment, config.image_size)

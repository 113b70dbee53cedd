"""Sample decoding: raw tar members (bytes per extension) -> arrays and Python values.

The kind of a field comes from the manifest's `fields` (extension -> kind) when it names the
extension, else from the member name's last extension:
  image (png, jpg, jpeg, ...) -> uint8 array, **HWC** (channels last, C=1 for grayscale, 3 for
        colour); with `image_size=(h, w)` resized (bilinear); with `normalize=(mean, std)`
        float32 HWC computed as (x / 255 - mean) / std. The same layout for torch and TF;
        `ringfeed train` hands torch models a (N, C, H, W) view of the NHWC batch
        (model.input_layout).
  npy   -> np.load (no pickles); token fields (extension starting with "tokens") -> int64
  a flat token shard's window (a TokenSpan, read by shardread.py) -> its seq_len + 1 tokens
        (int64) and DOC_IDS (int32), the offset drawn from (seed, epoch, shard key) when random
  int   (cls, ...) -> int (batched as int64)
  json  -> object (batched as a list)
  text  (txt) -> str (batched as a list)
  bytes / anything unknown -> bytes, untouched
With `augment` (augment.py) an image is decoded, cropped, resized, flipped and jittered in one
pass (augment_pixels.py) from (seed, epoch, its key); `channels` 3 or 1 converts every image
(PIL's convert("RGB") / ("L")). A batch's images of one field stack into one array: 1 and 3
channels mixed are promoted to 3 (grey replicated), other shapes that differ are a
PipelineDataError naming the samples.
A user `decode(sample) -> sample` runs first on the raw sample (bytes values; what it turns into
something else is left alone); `transform(sample) -> sample` runs last on the decoded sample.
An exception from either is the user's (UserCodeError), never a bad sample.
"""

from __future__ import annotations

import io
import json
import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np

from ringfeed.formats.kinds import kind_of
from ringfeed.formats.tokens import DOC_IDS, TOKENS_MEMBER, TokenSpan
from ringfeed.pipeline.augment import Augment
from ringfeed.pipeline.augment_pixels import (
    SourceImage,
    augment_source,
    decode_augmented,
    decode_source,
    resizer,
)
from ringfeed.pipeline.codecs import decode_image
from ringfeed.pipeline.errors import PipelineDataError

# numpy parses a .npy header with ast.literal_eval, and CPython 3.11's AST construction is not
# thread-safe (python/cpython#106905): two decode threads at once sporadically raised
# "SystemError: AST constructor recursion depth mismatch", and the sample was skipped as bad.
NPY_LOCK = threading.Lock()

SampleFn = Callable[[dict[str, Any]], dict[str, Any]]


class DecodeError(ValueError):
    """One field of one sample could not be decoded."""


class UserCodeError(Exception):
    """The user's decode or transform raised `error`: the routes raise it as it is (its
    traceback names the user's code), never count it as bad data."""

    def __init__(self, error: BaseException) -> None:
        super().__init__(str(error))
        self.error = error


@dataclass
class Decoder:
    fields: dict[str, str]  # extension -> kind, from the manifest (or the user)
    image_size: tuple[int, int] | None = None
    normalize: tuple[Any, Any] | None = None
    decode: SampleFn | None = None
    transform: SampleFn | None = None
    decode_images: bool = True  # False: images stay bytes (decoded on the GPU by the adapter)
    threads: int = 0  # > 1: a batch's images decode in this many threads (simplejpeg and
    # PIL's decoders release the GIL, so threads can stand in for loader processes)
    augment: Augment | None = None  # this split's stages (augment.parse_augment)
    seed: int = 0  # with the epoch and the key, decides a sample's augmentation
    channels: int | None = None  # 3 or 1: every image converted; None: as decoded
    source_side: int | None = None  # random augment: cached images' shorter side at most this
    # random augment with the decoded cache on: a sample missing from the cache is cropped from
    # the same reduced copy the cache keeps, so its pixels do not depend on which process
    # wrote the entry (loader workers race for it) or on whether it was written yet
    via_source: bool = False
    # finish_batch leaves images uint8 (no transform): the torch adapter's loader workers, whose
    # batches cross to the training process in shared memory, a quarter of the bytes, and are
    # normalized there (`normalized_tensor`)
    normalize_later: bool = False

    def __post_init__(self) -> None:
        self.image_size = as_pair(self.image_size)
        self._kinds: dict[str, str] = {}  # extension -> kind, looked up once
        # An image folder of mixed formats gives samples with `jpg` or `png` members. Decoded
        # they are the same thing, so each sample's one image goes under the manifest's first
        # image field: every batch then has the same fields.
        image_fields = [name for name, kind in self.fields.items() if kind == "image"]
        self._image_field = image_fields[0] if len(image_fields) > 1 else None
        # (x / 255 - mean) / std == x * scale - shift, float32 per channel: the one definition
        # of normalized pixels, on the CPU (finish, finish_batch) and the GPU (the torch adapter)
        self.pixel_scale: np.ndarray | None = None
        self.pixel_shift: np.ndarray | None = None
        if self.normalize is not None:
            mean, std = (np.asarray(v, dtype=np.float32) for v in self.normalize)
            self.pixel_scale, self.pixel_shift = 1.0 / (255.0 * std), mean / std

    def kind(self, extension: str) -> str:
        kind = self._kinds.get(extension)
        if kind is None:
            kind = self.fields.get(extension) or kind_of(extension)
            self._kinds[extension] = kind
        return kind

    def __call__(self, raw: dict[str, Any], epoch: int = 0) -> dict[str, Any]:
        """The sample as batches of `epoch` carry it: base() then finish()."""
        return self.finish(self.base(raw, epoch), normalize=True)

    @property
    def augments_per_epoch(self) -> bool:
        """Whether images differ by epoch (random stages): the cache then keeps SourceImages."""
        return self.augment is not None and self.augment.random

    def base(self, raw: dict[str, Any], epoch: int | None = None) -> dict[str, Any]:
        """The user's decode, every field decoded (images uint8, not normalized), the image
        field renamed. `epoch` None: what the decoded-sample cache stores (random augment:
        SourceImages); else the images of that epoch."""
        key = raw.get("__key__", "")
        sample = {k: v for k, v in raw.items() if not k.startswith("__")}
        if self.decode is not None:
            sample = self.user(self.decode, sample)
        for name, value in list(sample.items()):
            if isinstance(value, (bytes, bytearray)):
                try:
                    sample[name] = self.decode_field(name, value, key, epoch)
                except Exception as e:
                    raise DecodeError(f"field {name!r}: {type(e).__name__}: {e}") from e
            elif isinstance(value, TokenSpan):
                sample[name], sample[DOC_IDS] = value.window(value.offset(self.seed, epoch or 0))
        return self.renamed(sample)

    @staticmethod
    def user(fn: SampleFn, sample: dict[str, Any]) -> dict[str, Any]:
        """The user's hook on `sample`; what it raises comes out as UserCodeError."""
        try:
            return fn(sample)
        except Exception as e:
            raise UserCodeError(e) from e

    def realize(self, sample: dict[str, Any], key: str, epoch: int) -> dict[str, Any]:
        """A cached sample's SourceImages augmented for `epoch`."""
        for name, value in sample.items():
            if isinstance(value, SourceImage):
                sample[name] = augment_source(value, self.augment, self.seed, epoch, key)
        return sample

    def realize_columns(self, columns: dict[str, Any], keys: list[str], epoch: int
                        ) -> dict[str, Any]:
        """realize() over a batch's columns (lists of SourceImages), in the decode threads."""
        for name, values in columns.items():
            if isinstance(values, list) and values and isinstance(values[0], SourceImage):
                def one(image: SourceImage, key: str) -> np.ndarray:
                    return augment_source(image, self.augment, self.seed, epoch, key)
                columns[name] = self._map(one, values, keys)
        return columns

    def renamed(self, sample: dict[str, Any]) -> dict[str, Any]:
        """A sample's (or a batch's) one image field under the manifest's first image field."""
        if self._image_field is not None:
            images = [name for name in sample if self.kind(name) == "image"]
            if len(images) == 1 and images[0] != self._image_field:
                sample[self._image_field] = sample.pop(images[0])
        return sample

    def columns(self, raws: list[dict[str, Any]], epoch: int | None = None
                ) -> dict[str, list[Any]] | None:
        """base(raw, epoch) a field at a time ({field: values}, no per-sample dict; windows: tokens
        and DOC_IDS); None when fields differ. Raises on a bad value (base() names the sample)."""
        names = raws[0].keys()
        if any(raw.keys() != names for raw in raws):
            return None
        if type(raws[0].get(TOKENS_MEMBER)) is TokenSpan:  # (WindowReader's: tokens alone)
            return windows([raw[TOKENS_MEMBER] for raw in raws], self.seed, epoch or 0)
        keys = [raw.get("__key__", "") for raw in raws]
        return self.renamed({name: self.decode_column(name, [raw[name] for raw in raws],
                                                      keys, epoch)
                             for name in names if name != "__key__"})

    def decode_column(self, name: str, values: list[bytes], keys: list[str] | None = None,
                      epoch: int | None = None) -> list[Any]:
        """decode_field over one field of a batch of raw samples (raises on a bad value)."""
        kind = self.kind(name)
        if kind == "bytes" or (kind == "image" and not self.decode_images):
            return values
        if kind == "image":
            return self._map(self.image_decoder(epoch), values, keys or [""] * len(values))
        return [self.decode_field(name, v) for v in values]

    def _map(self, fn: Callable[[Any, str], Any], values: list[Any], keys: list[str]
             ) -> list[Any]:
        """fn(value, key) over a column, in the decode threads when there are some."""
        if self.threads > 1 and len(values) > 1:
            return list(_pool(self.threads).map(fn, values, keys))
        return [fn(v, k) for v, k in zip(values, keys, strict=True)]

    def image_decoder(self, epoch: int | None) -> Callable[[bytes, str], Any]:
        """(encoded image, sample key) -> what base(raw, epoch) holds for it."""
        augment, channels, seed = self.augment, self.channels, self.seed
        if augment is None:
            size = self.image_size
            return lambda data, key: decode_image(data, size, channels=channels)
        if not augment.random:  # the same every epoch: decoded once, cached as it is
            return lambda data, key: decode_augmented(data, augment, seed, 0, key, channels)
        side = self.source_side
        if epoch is None:
            return lambda data, key: decode_source(data, side, channels)
        if self.via_source:
            return lambda data, key: augment_source(decode_source(data, side, channels), augment,
                                                    seed, epoch, key)
        return lambda data, key: decode_augmented(data, augment, seed, epoch, key, channels)

    def finish(self, sample: dict[str, Any], normalize: bool | None = None) -> dict[str, Any]:
        """After base(): normalize the images and run the transform. Without a transform the
        normalization is left to finish_batch (`normalize=None`), which does it for a whole
        batch at once with the same float32 arithmetic, so the values are identical."""
        if normalize is None:
            normalize = self.transform is not None
        if normalize and self.normalize is not None:
            for name in self.image_fields(sample):
                sample[name] = self.normalized(sample[name])
        if self.transform is not None:
            sample = self.user(self.transform, sample)
        return sample

    def finish_batch(self, batch: dict[str, Any], keys: list[str] | None = None
                     ) -> dict[str, Any]:
        """Stack a batch's images (stack_images) and normalize them when finish() left it (no
        transform)."""
        self.stack_images(batch, keys)
        if self.normalize is None or self.transform is not None or not self.decode_images \
                or self.normalize_later:
            return batch
        for name in self.image_fields(batch):
            value = batch[name]
            batch[name] = (self.normalized(value) if isinstance(value, np.ndarray)
                           else [self.normalized(v) for v in value])
        return batch

    def stack_images(self, batch: dict[str, Any], keys: list[str] | None) -> None:
        """Image fields left as lists of arrays (shapes differ) become one array: 1 and 3
        channels of one size are promoted to 3 (grey replicated, as convert("RGB")); other
        differences are a PipelineDataError naming the first samples of each shape."""
        for name in self.image_fields(batch):
            values = batch[name]
            if not (isinstance(values, list) and values
                    and all(isinstance(v, np.ndarray) for v in values)):
                continue
            if {v.shape[:2] for v in values} == {values[0].shape[:2]} and \
                    {v.shape[2:] for v in values} == {(1,), (3,)}:
                values = [np.repeat(v, 3, axis=2) if v.shape[2:] == (1,) else v
                          for v in values]
            shapes: dict[tuple, str] = {}
            for i, v in enumerate(values):
                shapes.setdefault((v.shape, v.dtype.str), keys[i] if keys else f"#{i}")
            if len(shapes) > 1:
                seen = ", ".join(f"{k!r} is {s[0]}" for s, k in list(shapes.items())[:3])
                raise PipelineDataError(
                    f"field {name!r}: the images of one batch differ in shape ({seen}): set "
                    "image_size or augment (a crop) so they come out alike, or channels: 3")
            batch[name] = np.stack(values)

    def image_fields_encoded(self, batch: dict[str, Any]) -> list[str]:
        """Image fields of a batch still holding encoded bytes (decode_images=False)."""
        return [name for name, value in batch.items() if self.kind(name) == "image"
                and isinstance(value, list) and value and isinstance(value[0], (bytes, bytearray))]

    def image_fields(self, sample: dict[str, Any]) -> list[str]:
        return [name for name in sample if self.kind(name) == "image"
                and not isinstance(sample[name], (bytes, bytearray))]

    def normalized(self, pixels: np.ndarray) -> np.ndarray:
        # into one float32 array, no temporaries (the same floats as `astype * scale - shift`):
        # a 128 x 224 x 224 x 3 batch in 71 ms on one core instead of 90
        out = np.empty(pixels.shape, np.float32)
        np.multiply(pixels, self.pixel_scale, out=out, dtype=np.float32)
        out -= self.pixel_shift
        return out

    def decode_field(self, name: str, data: bytes, key: str = "", epoch: int | None = None
                     ) -> Any:
        kind = self.kind(name)
        if kind == "image":
            return self.image_decoder(epoch)(data, key) if self.decode_images else data
        if kind == "npy":
            with NPY_LOCK:
                array = np.load(io.BytesIO(data), allow_pickle=False)
            return array.astype(np.int64) if name.startswith("tokens") else array
        if kind == "int":
            return int(data.decode().strip())
        if kind == "json":
            return json.loads(data)
        if kind == "text":
            return data.decode("utf-8")
        return data

    def decode_image(self, data: bytes) -> np.ndarray:
        """uint8 HWC (C = 1 or 3), resized to image_size when given; never normalized here."""
        return decode_image(data, self.image_size, channels=self.channels)

    def settings(self) -> dict[str, Any]:
        """What decides base()'s output besides the bytes (keys the decoded-sample cache)."""
        settings = {"fields": dict(sorted(self.fields.items())), "image_size": self.image_size,
                    "image_field": self._image_field, "decode_images": self.decode_images}
        if self.channels is not None:
            settings["channels"] = self.channels
        if self.augment is not None:  # deterministic lists are cached augmented
            settings.update(augment="random" if self.augment.random else repr(self.augment),
                            source_side=self.source_side, resizer=resizer())
        return settings


def windows(spans: list[TokenSpan], seed: int, epoch: int) -> dict[str, list[Any]]:
    """The windows of `spans` for `epoch` as columns: their tokens and their DOC_IDS (each
    shard's offset drawn once)."""
    offsets: dict[str, int] = {}
    for span in spans:
        if span.shard_key not in offsets:
            offsets[span.shard_key] = span.offset(seed, epoch)
    cut = [span.window(offsets[span.shard_key]) for span in spans]
    return {TOKENS_MEMBER: [tokens for tokens, _ in cut], DOC_IDS: [ids for _, ids in cut]}


_pools: dict[tuple[int, int], ThreadPoolExecutor] = {}


def _pool(threads: int) -> ThreadPoolExecutor:
    """This process's decode threads (a forked loader worker makes its own)."""
    key = (os.getpid(), threads)
    pool = _pools.get(key)
    if pool is None:
        pool = _pools[key] = ThreadPoolExecutor(threads, thread_name_prefix="ringfeed-decode")
    return pool


def as_pair(value: int | Sequence[int] | None) -> tuple[int, int] | None:
    if value is None:
        return None
    if isinstance(value, int):
        return (value, value)
    h, w = value
    return (int(h), int(w))

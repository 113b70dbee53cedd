"""Sample decoding: raw tar members (bytes per extension) -> arrays and Python values.

The kind of a field comes from the manifest's `fields` (extension -> kind) when it names the
extension, else from the member name's last extension:
  image (png, jpg, jpeg, ...) -> uint8 array, **HWC** (channels last, C=1 for grayscale, 3 for
        colour); with `image_size=(h, w)` resized (bilinear); with `normalize=(mean, std)`
        float32 HWC computed as (x / 255 - mean) / std. The same layout for torch and TF;
        `ringfeed train` hands torch models a (N, C, H, W) view of the NHWC batch
        (model.input_layout).
  npy   -> np.load (no pickles); token fields (extension starting with "tokens") -> int64
  int   (cls, ...) -> int (batched as int64)
  json  -> object (batched as a list)
  text  (txt) -> str (batched as a list)
  bytes / anything unknown -> bytes, untouched
A user `decode(sample) -> sample` runs first on the raw sample (bytes values; what it turns into
something else is left alone); `transform(sample) -> sample` runs last on the decoded sample.
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
from ringfeed.pipeline.codecs import decode_image

# numpy parses a .npy header with ast.literal_eval, and CPython 3.11's AST construction is not
# thread-safe (python/cpython#106905): two decode threads at once sporadically raised
# "SystemError: AST constructor recursion depth mismatch", and the sample was skipped as bad.
_NPY_LOCK = threading.Lock()

SampleFn = Callable[[dict[str, Any]], dict[str, Any]]


class DecodeError(ValueError):
    """One field of one sample could not be decoded."""


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

    def __call__(self, raw: dict[str, Any]) -> dict[str, Any]:
        """The sample as batches carry it: base() then finish()."""
        return self.finish(self.base(raw), normalize=True)

    def base(self, raw: dict[str, Any]) -> dict[str, Any]:
        """The user's decode, every field decoded (images uint8, not normalized), the image
        field renamed: what the decoded-sample cache stores."""
        sample = {k: v for k, v in raw.items() if not k.startswith("__")}
        if self.decode is not None:
            sample = self.decode(sample)
        for name, value in sample.items():
            if isinstance(value, (bytes, bytearray)):
                try:
                    sample[name] = self.decode_field(name, value)
                except Exception as e:
                    raise DecodeError(f"field {name!r}: {type(e).__name__}: {e}") from e
        return self.renamed(sample)

    def renamed(self, sample: dict[str, Any]) -> dict[str, Any]:
        """A sample's (or a batch's) one image field under the manifest's first image field."""
        if self._image_field is not None:
            images = [name for name in sample if self.kind(name) == "image"]
            if len(images) == 1 and images[0] != self._image_field:
                sample[self._image_field] = sample.pop(images[0])
        return sample

    def columns(self, raws: list[dict[str, Any]]) -> dict[str, list[Any]] | None:
        """base() of raw samples one field at a time: {field: decoded values}, with no
        per-sample dict; None when the samples do not all have the same fields. Raises on a
        value that does not decode (without saying which sample: base() does that)."""
        names = raws[0].keys()
        if any(raw.keys() != names for raw in raws):
            return None
        return self.renamed({name: self.decode_column(name, [raw[name] for raw in raws])
                             for name in names if name != "__key__"})

    def decode_column(self, name: str, values: list[bytes]) -> list[Any]:
        """decode_field over one field of a batch of raw samples (raises on a bad value)."""
        kind = self.kind(name)
        if kind == "bytes" or (kind == "image" and not self.decode_images):
            return values
        if kind == "image":
            size = self.image_size
            if self.threads > 1 and len(values) > 1:
                return list(_pool(self.threads).map(decode_image, values, [size] * len(values)))
            return [decode_image(v, size) for v in values]
        return [self.decode_field(name, v) for v in values]

    def finish(self, sample: dict[str, Any], normalize: bool | None = None) -> dict[str, Any]:
        """After base(): normalize the images and run the transform. Without a transform the
        normalization is left to finish_batch (`normalize=None`), which does it for a whole
        batch at once with the same float32 arithmetic, so the values are identical."""
        if normalize is None:
            normalize = self.transform is not None
        if normalize and self.normalize is not None:
            for name in self.image_fields(sample):
                sample[name] = self._normalized(sample[name])
        if self.transform is not None:
            sample = self.transform(sample)
        return sample

    def finish_batch(self, batch: dict[str, Any]) -> dict[str, Any]:
        """Normalize a batch's images when finish() left it (no transform)."""
        if self.normalize is None or self.transform is not None or not self.decode_images:
            return batch
        for name in self.image_fields(batch):
            value = batch[name]
            batch[name] = (self._normalized(value) if isinstance(value, np.ndarray)
                           else [self._normalized(v) for v in value])
        return batch

    def image_fields_encoded(self, batch: dict[str, Any]) -> list[str]:
        """Image fields of a batch still holding encoded bytes (decode_images=False)."""
        return [name for name, value in batch.items() if self.kind(name) == "image"
                and isinstance(value, list) and value and isinstance(value[0], (bytes, bytearray))]

    def image_fields(self, sample: dict[str, Any]) -> list[str]:
        return [name for name in sample if self.kind(name) == "image"
                and not isinstance(sample[name], (bytes, bytearray))]

    def _normalized(self, pixels: np.ndarray) -> np.ndarray:
        return pixels.astype(np.float32) * self.pixel_scale - self.pixel_shift

    def decode_field(self, name: str, data: bytes) -> Any:
        kind = self.kind(name)
        if kind == "image":
            return self.decode_image(data) if self.decode_images else data
        if kind == "npy":
            with _NPY_LOCK:
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
        return decode_image(data, self.image_size)

    def settings(self) -> dict[str, Any]:
        """What decides base()'s output besides the bytes (keys the decoded-sample cache)."""
        return {"fields": dict(sorted(self.fields.items())), "image_size": self.image_size,
                "image_field": self._image_field, "decode_images": self.decode_images}


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

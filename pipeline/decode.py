"""Sample decoding: raw tar members (bytes per extension) -> arrays and Python values.

The kind of a field comes from the manifest's `fields` (extension -> kind) when it names the
extension, else from the member name's last extension:
  image (png, jpg, jpeg, ...) -> uint8 array, **HWC** (channels last, C=1 for grayscale, 3 for
        colour); with `image_size=(h, w)` resized (bilinear); with `normalize=(mean, std)`
        float32 HWC computed as (x / 255 - mean) / std. The same layout for torch and TF:
        torch users permute to CHW in the model or a transform.
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
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

IMAGE_EXTENSIONS = {"png", "jpg", "jpeg", "ppm", "pgm", "pbm", "pnm", "bmp", "gif", "tif",
                    "tiff", "webp"}
KIND_BY_EXTENSION = {
    **dict.fromkeys(IMAGE_EXTENSIONS, "image"),
    "npy": "npy",
    "cls": "int", "cls2": "int", "index": "int", "inx": "int", "id": "int",
    "json": "json", "jsn": "json",
    "txt": "text", "text": "text",
}

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

    def __post_init__(self) -> None:
        self.image_size = as_pair(self.image_size)
        # An image folder of mixed formats gives samples with `jpg` or `png` members. Decoded
        # they are the same thing, so each sample's one image goes under the manifest's first
        # image field: every batch then has the same fields.
        image_fields = [name for name, kind in self.fields.items() if kind == "image"]
        self._image_field = image_fields[0] if len(image_fields) > 1 else None
        if self.normalize is not None:  # (x / 255 - mean) / std == x * scale - shift
            mean, std = (np.asarray(v, dtype=np.float32) for v in self.normalize)
            self._scale = 1.0 / (255.0 * std)
            self._shift = mean / std

    def kind(self, extension: str) -> str:
        if extension in self.fields:
            return self.fields[extension]
        return KIND_BY_EXTENSION.get(extension.rsplit(".", 1)[-1], "bytes")

    def __call__(self, raw: dict[str, Any]) -> dict[str, Any]:
        sample = {k: v for k, v in raw.items() if not k.startswith("__")}
        if self.decode is not None:
            sample = self.decode(sample)
        for name, value in sample.items():
            if isinstance(value, (bytes, bytearray)):
                try:
                    sample[name] = self.decode_field(name, value)
                except Exception as e:
                    raise DecodeError(f"field {name!r}: {type(e).__name__}: {e}") from e
        if self._image_field is not None:
            images = [name for name in sample if self.kind(name) == "image"]
            if len(images) == 1 and images[0] != self._image_field:
                sample[self._image_field] = sample.pop(images[0])
        if self.transform is not None:
            sample = self.transform(sample)
        return sample

    def decode_field(self, name: str, data: bytes) -> Any:
        kind = self.kind(name)
        if kind == "image":
            return self.decode_image(data)
        if kind == "npy":
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
        from PIL import Image  # Pillow is a core dependency; imported where used

        with Image.open(io.BytesIO(data)) as img:
            if img.mode not in ("L", "RGB"):
                img = img.convert("L" if img.mode in ("1", "I", "I;16", "F", "LA") else "RGB")
            if self.image_size is not None:
                h, w = self.image_size
                if img.size != (w, h):
                    img = img.resize((w, h), Image.BILINEAR)
            array = np.asarray(img)
        if array.ndim == 2:
            array = array[:, :, None]
        if self.normalize is None:
            return array
        return array.astype(np.float32) * self._scale - self._shift


def as_pair(value: int | Sequence[int] | None) -> tuple[int, int] | None:
    if value is None:
        return None
    if isinstance(value, int):
        return (value, value)
    h, w = value
    return (int(h), int(w))

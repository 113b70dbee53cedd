"""Tokenizers for `--format text`: byte-level by default, or one from an installed package.

`--tokenizer module:attr` names an object (or a class / no-argument factory making one) with
`encode(str) -> list[int]`, an end-of-document id (`eos_id`, `eos_token_id` or `eot_token`) and a
vocabulary size (`vocab_size`, `n_vocab` or `len()`, the largest when several: a Hugging Face
tokenizer's `len()` counts the added special tokens its `vocab_size` leaves out); e.g. a tiktoken
Encoding or a Hugging Face tokenizer already on disk. `encode_ordinary` is used where it exists
(tiktoken): text that merely contains `<|endoftext|>` is text, not a special token. Nothing is
downloaded: the import must work offline.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from ringfeed.errors import UserError

BYTES = "bytes"
_EOS_ATTRS = ("eos_id", "eos_token_id", "eot_token")
_VOCAB_ATTRS = ("vocab_size", "n_vocab")


@dataclass
class Tokenizer:
    name: str
    eos_id: int
    vocab_size: int
    encode: Callable[[str], list[int]] | None  # None: byte-level

    @property
    def dtype(self) -> np.dtype:
        return np.dtype(np.uint16 if self.vocab_size <= 2**16 else np.uint32)

    def tokens(self, document: bytes, where: str) -> np.ndarray:
        """The document's ids followed by the end-of-document id."""
        if self.encode is None:
            ids = np.frombuffer(document, dtype=np.uint8)
        else:
            try:
                text = document.decode("utf-8")
            except UnicodeDecodeError as e:
                raise UserError(f"{where}: not UTF-8 text ({e}); the byte-level tokenizer "
                                "(--tokenizer bytes) takes any bytes") from None
            try:
                ids = np.asarray(self.encode(text), dtype=np.int64)
            except Exception as e:  # the tokenizer's own error, tied to the document
                raise UserError(f"{where}: tokenizer {self.name} failed ({type(e).__name__}: "
                                f"{str(e).splitlines()[0] if str(e) else ''})") from None
            if ids.size and (ids.min() < 0 or ids.max() >= self.vocab_size):
                raise UserError(f"{where}: tokenizer {self.name} returned id {int(ids.max())} "
                                f"outside its vocabulary of {self.vocab_size}")
        out = np.empty(ids.size + 1, dtype=self.dtype)
        out[:-1] = ids
        out[-1] = self.eos_id
        return out

    def describe(self) -> dict:
        return {"tokenizer": self.name, "dtype": self.dtype.name, "eos_id": self.eos_id,
                "vocab_size": self.vocab_size}


def load_tokenizer(spec: str) -> Tokenizer:
    if spec == BYTES:
        return Tokenizer(BYTES, eos_id=256, vocab_size=257, encode=None)
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise UserError(f"--tokenizer {spec!r}: expected 'bytes' or 'module:attribute'")
    try:
        obj = getattr(importlib.import_module(module_name), attr)
    except ImportError as e:
        raise UserError(f"--tokenizer {spec}: cannot import {module_name} ({e})") from None
    except AttributeError:
        raise UserError(f"--tokenizer {spec}: module {module_name} has no {attr!r}") from None
    if isinstance(obj, type) or (callable(obj) and not hasattr(obj, "encode")):
        try:
            obj = obj()  # a class or a factory
        except Exception as e:
            raise UserError(f"--tokenizer {spec}: creating it failed ({type(e).__name__}: {e})") from None
    if not callable(getattr(obj, "encode", None)):
        raise UserError(f"--tokenizer {spec}: has no encode(str) method")
    eos = _first_int(obj, _EOS_ATTRS)
    sizes = [getattr(obj, name, None) for name in _VOCAB_ATTRS] + [
        len(obj) if hasattr(obj, "__len__") else None]
    vocab = max((int(v) for v in sizes if _is_int(v)), default=None)
    if eos is None or vocab is None:
        missing = " or ".join(_EOS_ATTRS if eos is None else _VOCAB_ATTRS)
        raise UserError(f"--tokenizer {spec}: no {missing} attribute")
    if not 0 <= eos < vocab:
        raise UserError(f"--tokenizer {spec}: end-of-document id {eos} is outside its vocabulary ({vocab})")
    encode = getattr(obj, "encode_ordinary", None)
    return Tokenizer(spec, eos_id=eos, vocab_size=vocab,
                     encode=encode if callable(encode) else obj.encode)


def _is_int(value: object) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def _first_int(obj: object, names: tuple[str, ...]) -> int | None:
    for name in names:
        value = getattr(obj, name, None)
        if _is_int(value):
            return int(value)
    return None

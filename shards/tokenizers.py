"""Tokenizers for `--format text`: byte-level by default, or one the user has.

`--tokenizer SPEC` is one of:
- `bytes`: ids 0..255, end-of-document id 256.
- a Hugging Face `tokenizer.json` file (`tokenizers.Tokenizer.from_file`), or a folder holding
  one (a `save_pretrained` folder; its tokenizer_config.json's `eos_token` names the
  end-of-document token).
- `module:attr` naming an object (or a class / no-argument factory making one), or
  `module:attr(arg, key=value)` calling a factory with arguments, e.g.
  `tiktoken:get_encoding(gpt2)` or `transformers:AutoTokenizer.from_pretrained(./tok)`: each
  argument a Python literal, else taken as text (so paths and names need no quotes).
Any of them may end in `#eos=TOKEN`, naming the end-of-document token by its text.

The object needs `encode(str) -> list[int]`, an end-of-document id (`eos_id`, `eos_token_id` or
`eot_token`, else `#eos=TOKEN`) and a vocabulary size (`vocab_size`, `n_vocab` or `len()`, the
largest when several: a Hugging Face tokenizer's `len()` counts the added special tokens its
`vocab_size` leaves out); e.g. a tiktoken Encoding or a transformers tokenizer. A
`tokenizers.Tokenizer` (or a transformers tokenizer built on one) is read through its own API
(`HFTokenizer`): its end-of-document token is the first of EOS_TOKENS among its special tokens.
Text that merely contains a special token's text (`<|endoftext|>`) is text, never the special
token: tiktoken's `encode_ordinary` is used where it exists, and a `tokenizers.Tokenizer` encodes
special tokens as text. Nothing is downloaded: the import must work offline.
"""

from __future__ import annotations

import ast
import importlib
import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ringfeed.errors import UserError

BYTES = "bytes"
EOS_SUFFIX = "#eos="
_EOS_ATTRS = ("eos_id", "eos_token_id", "eot_token")
_VOCAB_ATTRS = ("vocab_size", "n_vocab")
# the special tokens that end a text in common vocabularies (GPT-2 and most BPEs, Llama 3,
# Llama 2 / T5 / sentencepiece, Gemma, BERT's separator last), the first present wins
EOS_TOKENS = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|eos|>", "[EOS]", "[SEP]")
# how an object looks a token's id up by its text: tokenizers, transformers, tiktoken
_TOKEN_LOOKUPS = ("token_to_id", "convert_tokens_to_ids", "encode_single_token")
_CALL = re.compile(r"^([A-Za-z_][\w.]*):([A-Za-z_][\w.]*)(?:\((.*)\))?$", re.S)


@dataclass
class Tokenizer:
    name: str
    eos_id: int
    vocab_size: int
    encode: Callable[[str], list[int]] | None  # None: byte-level
    file: Path | None = None  # the tokenizer.json it was read from (an input of the plan)

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


class HFTokenizer:
    """A Hugging Face `tokenizers.Tokenizer` with the attributes `load_tokenizer` reads. It
    works on a copy whose special tokens' text inside a document is encoded as text (the
    user's object is left as it was), adds no special tokens of its own (a BOS, BERT's
    [CLS]/[SEP]: the documents' boundaries are the EOS ids ringfeed puts), and decodes ids
    back into text for `ringfeed generate`."""

    def __init__(self, tokenizer: Any, eos_id: int):
        self._tokenizer = tokenizer
        self.eos_id = eos_id
        self.vocab_size = int(tokenizer.get_vocab_size(with_added_tokens=True))

    def encode(self, text: str) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(list(ids), skip_special_tokens=False)


def load_tokenizer(spec: str) -> Tokenizer:
    if spec == BYTES:
        return Tokenizer(BYTES, eos_id=256, vocab_size=257, encode=None)
    base, has_eos, eos_token = spec.partition(EOS_SUFFIX)
    if has_eos and not eos_token:
        raise UserError(f"--tokenizer {spec!r}: no token after {EOS_SUFFIX!r} (e.g. "
                        f"{base}{EOS_SUFFIX}</s>)")
    file = _tokenizer_file(base, spec)
    if file is not None:  # named by its resolved path: the manifest's record works from anywhere
        spec = str(Path(base).expanduser().resolve()) + spec[len(base):]
        obj: Any = _hf_from_file(file, spec, eos_token or _config_eos(file.parent))
    else:
        obj = _hugging_face(_from_module(base, spec), spec, eos_token or None)
    if not callable(getattr(obj, "encode", None)):
        raise UserError(f"--tokenizer {spec}: has no encode(str) method")
    if isinstance(obj, HFTokenizer):
        eos: int | None = obj.eos_id
    else:
        eos = _token_id(obj, eos_token, spec) if eos_token else _first_int(obj, _EOS_ATTRS)
    sizes = [getattr(obj, name, None) for name in _VOCAB_ATTRS] + [
        len(obj) if hasattr(obj, "__len__") else None]
    vocab = max((int(v) for v in sizes if _is_int(v)), default=None)
    if eos is None:
        raise UserError(f"--tokenizer {spec}: no {' or '.join(_EOS_ATTRS)} attribute; name its "
                        f"end-of-document token: --tokenizer '{spec}{EOS_SUFFIX}TOKEN'")
    if vocab is None:
        raise UserError(f"--tokenizer {spec}: no {' or '.join(_VOCAB_ATTRS)} attribute or len()")
    if not 0 <= eos < vocab:
        raise UserError(f"--tokenizer {spec}: end-of-document id {eos} is outside its vocabulary ({vocab})")
    encode = getattr(obj, "encode_ordinary", None)
    return Tokenizer(spec, eos_id=eos, vocab_size=vocab,
                     encode=encode if callable(encode) else obj.encode, file=file)


def _tokenizer_file(base: str, spec: str) -> Path | None:
    """The tokenizer.json a spec names (a file, or a folder holding one); None for a
    module spec."""
    path = Path(base).expanduser()
    if path.is_dir():
        if not (path / "tokenizer.json").is_file():
            raise UserError(f"--tokenizer {spec}: folder {path} holds no tokenizer.json (save "
                            "a Hugging Face tokenizer there, or name module:attr)")
        return (path / "tokenizer.json").resolve()
    if path.is_file():
        return path.resolve()
    if _CALL.match(base.strip()) is None and (base.endswith(".json") or "/" in base):
        raise UserError(f"--tokenizer {spec}: no such file or folder")
    return None


def _from_module(base: str, spec: str) -> Any:
    """The object `module:attr` names, made by calling it when it is a class, a factory
    without `encode`, or given arguments (`module:attr(arg, key=value)`)."""
    match = _CALL.match(base.strip())
    if match is None:
        raise UserError(f"--tokenizer {spec!r}: expected 'bytes', a tokenizer.json file or "
                        "folder, or 'module:attribute' (with arguments: 'module:function(a, k=v)')")
    module_name, attr, arguments = match.groups()
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError as e:
        raise UserError(f"--tokenizer {spec}: cannot import {module_name} ({e})") from None
    for name in attr.split("."):
        if not hasattr(obj, name):
            raise UserError(f"--tokenizer {spec}: module {module_name} has no {attr!r}")
        obj = getattr(obj, name)
    args, kwargs = _arguments(arguments, spec) if arguments is not None else ([], {})
    if arguments is not None or isinstance(obj, type) or (
            callable(obj) and not hasattr(obj, "encode")):
        try:
            obj = obj(*args, **kwargs)  # a class or a factory
        except Exception as e:
            raise UserError(f"--tokenizer {spec}: creating it failed ({type(e).__name__}: "
                            f"{str(e).splitlines()[0] if str(e) else ''})") from None
    return obj


def _arguments(text: str, spec: str) -> tuple[list[Any], dict[str, Any]]:
    """`a, 'b,c', k=3` -> (["a", "b,c"], {"k": 3}): Python literals, else the text itself."""
    args: list[Any] = []
    kwargs: dict[str, Any] = {}
    for item in _split_commas(text):
        key, eq, value = item.partition("=")
        if eq and key.strip().isidentifier():
            kwargs[key.strip()] = _literal(value.strip())
        elif kwargs:
            raise UserError(f"--tokenizer {spec}: argument {item.strip()!r} follows a keyword "
                            "argument (put positional arguments first)")
        elif item.strip():
            args.append(_literal(item.strip()))
    return args, kwargs


def _split_commas(text: str) -> list[str]:
    """`text` split at the commas outside quotes and brackets."""
    items, depth, quote, start = [], 0, "", 0
    for i, c in enumerate(text):
        if quote:
            quote = "" if c == quote and text[i - 1] != "\\" else quote
        elif c in "'\"":
            quote = c
        elif c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
        elif c == "," and depth == 0:
            items.append(text[start:i])
            start = i + 1
    return [*items, text[start:]]


def _literal(text: str) -> Any:
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text  # a bare word or path: the text


def _hf_from_file(file: Path, spec: str, eos_token: str | None) -> HFTokenizer:
    try:
        import tokenizers
    except ImportError:
        raise UserError(f"--tokenizer {spec}: reading a tokenizer.json needs Hugging Face "
                        "tokenizers (pip install tokenizers)") from None
    try:
        tokenizer = tokenizers.Tokenizer.from_file(str(file))
    except Exception as e:  # tokenizers raises plain Exceptions for a bad file
        raise UserError(f"--tokenizer {spec}: not a Hugging Face tokenizer.json "
                        f"({str(e).splitlines()[0] if str(e) else type(e).__name__})") from None
    return _adapted(tokenizer, spec, eos_token)


def _hugging_face(obj: Any, spec: str, eos_token: str | None) -> Any:
    """A `tokenizers.Tokenizer`, or a transformers tokenizer built on one, as an HFTokenizer
    (transformers' own eos_token named when it has one); any other object as it is."""
    backend = getattr(obj, "backend_tokenizer", None)  # a transformers "fast" tokenizer
    if backend is not None:
        named = getattr(obj, "eos_token", None)
        return _adapted(backend, spec, eos_token or (named if isinstance(named, str) else None))
    if type(obj).__module__.startswith("tokenizers") and hasattr(obj, "get_added_tokens_decoder"):
        return _adapted(obj, spec, eos_token)
    return obj


def _adapted(tokenizer: Any, spec: str, eos_token: str | None) -> HFTokenizer:
    """An HFTokenizer over a copy of `tokenizer`, whose EOS is `eos_token` or the first of
    EOS_TOKENS among its special tokens."""
    copy = type(tokenizer).from_str(tokenizer.to_str())
    if hasattr(copy, "encode_special_tokens"):  # tokenizers >= 0.15
        copy.encode_special_tokens = True
    if eos_token:
        return HFTokenizer(copy, _token_id(copy, eos_token, spec))
    special = {t.content: i for i, t in tokenizer.get_added_tokens_decoder().items() if t.special}
    for name in EOS_TOKENS:
        if name in special:
            return HFTokenizer(copy, special[name])
    raise UserError(f"--tokenizer {spec}: none of its special tokens "
                    f"({', '.join(sorted(special)) or 'none'}) is one of {', '.join(EOS_TOKENS)}; "
                    f"name its end-of-document token: --tokenizer '{spec}{EOS_SUFFIX}TOKEN'")


def _config_eos(folder: Path) -> str | None:
    """The `eos_token` of a `save_pretrained` folder's tokenizer_config.json, if any."""
    try:
        config = json.loads((folder / "tokenizer_config.json").read_text())
    except (OSError, ValueError):
        return None
    eos = config.get("eos_token") if isinstance(config, dict) else None
    eos = eos.get("content") if isinstance(eos, dict) else eos
    return eos if isinstance(eos, str) and eos else None


def _token_id(obj: Any, token: str, spec: str) -> int:
    """The id of the token whose text is `token`, by the object's own lookup."""
    for name in _TOKEN_LOOKUPS:
        lookup = getattr(obj, name, None)
        if not callable(lookup):
            continue
        try:
            found = lookup(token)
        except Exception:  # tiktoken raises KeyError for an unknown token
            found = None
        if _is_int(found):
            return int(found)
        break
    else:
        raise UserError(f"--tokenizer {spec}: cannot look {token!r} up (it has no "
                        f"{', '.join(_TOKEN_LOOKUPS)}); give an object with an eos_id")
    raise UserError(f"--tokenizer {spec}: no token {token!r} in its vocabulary (name the "
                    "end-of-document token as the tokenizer spells it)")


def _is_int(value: object) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def _first_int(obj: object, names: tuple[str, ...]) -> int | None:
    for name in names:
        value = getattr(obj, name, None)
        if _is_int(value):
            return int(value)
    return None

"""`--tokenizer` of `ringfeed shard --format text` (shards/tokenizers.py): byte-level by default, or
`module:attr` naming a tokenizer object, class or factory; which attributes give its
end-of-document id and vocabulary size; each document's ids followed by that id. The
tokenizers here are this module's own classes (named `test_tokenizers:...`)."""

from __future__ import annotations

import numpy as np
import pytest

from ringfeed.errors import UserError
from ringfeed.shards.tokenizers import load_tokenizer


class Words:
    """A word-level tokenizer with Hugging Face's attribute names: `len()` counts an added
    special token that `vocab_size` leaves out."""

    vocab_size = 4
    eos_token_id = 4
    words = {"a": 0, "b": 1, "c": 2, "<|endoftext|>": 3}

    def encode(self, text: str) -> list[int]:
        return [self.words[w] for w in text.split()]

    def __len__(self) -> int:
        return 5


class Tiktokenish:
    """tiktoken's names: `n_vocab`, `eot_token`, and `encode_ordinary` beside `encode`."""

    n_vocab = 70_000
    eot_token = 69_999

    def encode(self, text: str) -> list[int]:
        return [69_999]  # what encode makes of a special token's text

    def encode_ordinary(self, text: str) -> list[int]:
        return [ord(c) for c in text]


def make_words() -> Words:
    return Words()


words = Words()


class NoEos:
    vocab_size = 10

    def encode(self, text: str) -> list[int]:
        return []


class EosOutside(NoEos):
    eos_id = 10


class OutOfRange(Words):
    def encode(self, text: str) -> list[int]:
        return [7]


class Failing(Words):
    def encode(self, text: str) -> list[int]:
        raise ValueError("unknown word\nsecond line")


def test_bytes_is_the_default_byte_level_tokenizer():
    t = load_tokenizer("bytes")
    assert (t.eos_id, t.vocab_size, t.dtype) == (256, 257, np.dtype(np.uint16))
    out = t.tokens("hé".encode(), "doc")
    assert out.tolist() == [104, 0xC3, 0xA9, 256] and out.dtype == np.uint16
    assert t.describe() == {"tokenizer": "bytes", "dtype": "uint16", "eos_id": 256,
                            "vocab_size": 257}


@pytest.mark.parametrize("spec", ["test_tokenizers:words", "test_tokenizers:Words",
                                  "test_tokenizers:make_words"])
def test_an_object_a_class_or_a_factory_names_a_tokenizer(spec):
    t = load_tokenizer(spec)
    assert (t.name, t.eos_id, t.vocab_size) == (spec, 4, 5)  # the larger of len() and vocab_size
    assert t.tokens(b"a c  b", "doc").tolist() == [0, 2, 1, 4]


def test_encode_ordinary_is_preferred_and_a_large_vocabulary_takes_uint32():
    t = load_tokenizer("test_tokenizers:Tiktokenish")
    out = t.tokens(b"<|endoftext|>", "doc")
    assert out.dtype == np.uint32 and len(out) == len("<|endoftext|>") + 1
    assert out[-1] == 69_999


@pytest.mark.parametrize("spec, message", [
    ("gpt2", "expected 'bytes', a tokenizer.json file or folder, or 'module:attribute'"),
    ("no_such_module_x:T", "cannot import no_such_module_x"),
    ("test_tokenizers:Missing", "module test_tokenizers has no 'Missing'"),
    ("test_tokenizers:NoEos", "no eos_id or eos_token_id or eot_token attribute"),
    ("test_tokenizers:EosOutside", "end-of-document id 10 is outside its vocabulary \\(10\\)"),
    ("numpy:pi", "has no encode\\(str\\) method"),
])
def test_a_tokenizer_that_cannot_be_used_is_one_line(spec, message):
    with pytest.raises(UserError, match=message):
        load_tokenizer(spec)


def test_a_documents_own_problems_name_it():
    t = load_tokenizer("test_tokenizers:Words")
    with pytest.raises(UserError, match="d.txt: not UTF-8 text .*--tokenizer bytes"):
        t.tokens(b"\xff\xfe", "d.txt")
    with pytest.raises(UserError, match="d.txt: tokenizer test_tokenizers:Words failed "
                                        "\\(KeyError: 'z'\\)"):
        t.tokens(b"a z", "d.txt")
    with pytest.raises(UserError, match="returned id 7 outside its vocabulary of 5"):
        load_tokenizer("test_tokenizers:OutOfRange").tokens(b"a", "d.txt")
    with pytest.raises(UserError) as exc:  # its first line only: the error stays one line
        load_tokenizer("test_tokenizers:Failing").tokens(b"a", "d.txt")
    assert str(exc.value).endswith("failed (ValueError: unknown word)")

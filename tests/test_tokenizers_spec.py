"""`--tokenizer` as users have them (shards/tokenizers.py): a Hugging Face `tokenizers.Tokenizer`
object, its tokenizer.json file or a `save_pretrained` folder, a transformers fast tokenizer, a
factory called with arguments (`module:function(arg, key=value)`), and `#eos=TOKEN` naming the
end-of-document token. The BPEs are trained here with `tokenizers` (nothing is downloaded); the
factories are this module's own (`test_tokenizers_spec:...`)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from shards_util import cli, load_npy, manifest, split_samples

from ringfeed.errors import UserError
from ringfeed.shards.tokenizers import load_tokenizer

CORPUS = ["def add(a, b):\n    return a + b\n", "hello world, hello tokens\n",
          "import os\nprint(os.getcwd())\n"] * 30


def train_bpe(special: list[str]):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=special, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer)
    return tok


bpe = train_bpe(["<pad>", "<|endoftext|>"])  # as `tokenizers` returns it: no eos attribute
odd = train_bpe(["<|end|>"])  # an end token ringfeed cannot guess


def from_file(path: str):
    from tokenizers import Tokenizer

    return Tokenizer.from_file(path)


class Scaled:
    """A factory taking arguments: ids are `scale` * the byte, EOS `eos`."""

    def __init__(self, scale: int, eos: int = 0, note: str = ""):
        self.scale, self.eos_id, self.note = scale, eos, note
        self.vocab_size = 256 * scale + 1

    def encode(self, text: str) -> list[int]:
        return [self.scale * b for b in text.encode()]


class Tiktokenish:
    """tiktoken's names: `n_vocab`, `encode_single_token`, no end-of-text attribute."""

    n_vocab = 10

    def encode(self, text: str) -> list[int]:
        return [1]

    def encode_single_token(self, token: str) -> int:
        return {"<|fim|>": 7}[token]


def test_a_tokenizers_object_finds_its_end_of_text_token():
    t = load_tokenizer("test_tokenizers_spec:bpe")
    eos = bpe.token_to_id("<|endoftext|>")
    assert (t.eos_id, t.vocab_size, t.dtype) == (eos, bpe.get_vocab_size(True), np.uint16)
    text = "hello world, <|endoftext|> tokens"
    ids = t.tokens(text.encode(), "doc").tolist()
    assert ids[-1] == eos and eos not in ids[:-1]  # the special token's text inside is text
    assert bpe.decode(ids[:-1]) == text  # and nothing else is added or lost
    assert bpe.encode_special_tokens is False  # the user's object is left as it was


def test_a_tokenizer_json_file_or_folder(tmp_path):
    bpe.save(str(tmp_path / "tokenizer.json"))
    t = load_tokenizer(str(tmp_path / "tokenizer.json"))
    assert t.name == str(tmp_path / "tokenizer.json") and t.file == tmp_path / "tokenizer.json"
    assert t.eos_id == bpe.token_to_id("<|endoftext|>")
    assert t.tokens(b"def add", "d").tolist()[:-1] == bpe.encode("def add").ids
    # a save_pretrained folder: its tokenizer_config.json's eos_token wins
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": "<pad>"}}))
    t = load_tokenizer(str(tmp_path))
    assert (t.name, t.eos_id) == (str(tmp_path), bpe.token_to_id("<pad>"))


def test_eos_suffix_names_the_end_token():
    with pytest.raises(UserError, match=r"none of its special tokens \(<\|end\|>\) is one of "
                       r"<\|endoftext\|>, .*--tokenizer 'test_tokenizers_spec:odd#eos=TOKEN'"):
        load_tokenizer("test_tokenizers_spec:odd")
    t = load_tokenizer("test_tokenizers_spec:odd#eos=<|end|>")
    assert t.eos_id == odd.token_to_id("<|end|>") and t.name.endswith("#eos=<|end|>")
    t = load_tokenizer("test_tokenizers_spec:Tiktokenish#eos=<|fim|>")  # a token lookup
    assert t.eos_id == 7
    with pytest.raises(UserError, match="cannot look 'x' up \\(it has no token_to_id, "):
        load_tokenizer("test_tokenizers:Words#eos=x")
    with pytest.raises(UserError, match="no token '<nope>' in its vocabulary"):
        load_tokenizer("test_tokenizers_spec:bpe#eos=<nope>")


def test_a_factory_with_arguments(tmp_path):
    t = load_tokenizer("test_tokenizers_spec:Scaled(3, eos=2, note='a, b')")
    assert (t.eos_id, t.vocab_size) == (2, 769) and t.tokens(b"A", "d").tolist() == [195, 2]
    bpe.save(str(tmp_path / "tok.json"))  # a bare path is its text: no quotes needed
    t = load_tokenizer(f"test_tokenizers_spec:from_file({tmp_path / 'tok.json'})")
    assert t.eos_id == bpe.token_to_id("<|endoftext|>")


def test_a_transformers_fast_tokenizer_adds_no_special_tokens():
    from transformers import PreTrainedTokenizerFast

    fast = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<pad>", bos_token="<pad>")
    import test_tokenizers_spec as me

    me.fast = fast
    t = load_tokenizer("test_tokenizers_spec:fast")
    assert t.eos_id == bpe.token_to_id("<pad>")  # transformers' eos_token
    assert t.tokens(b"hello", "d").tolist() == bpe.encode("hello").ids + [t.eos_id]


@pytest.mark.parametrize("spec, message", [
    ("missing/tokenizer.json", "no such file or folder"),
    ("test_tokenizers_spec:Scaled(k=1, 2)", "argument '2' follows a keyword argument"),
    ("test_tokenizers_spec:Scaled(1, bad=2)", "creating it failed \\(TypeError: "),
    ("test_tokenizers_spec:bpe#eos=", "no token after '#eos='"),
    ("test_tokenizers:NoEos", "no eos_id or eos_token_id or eot_token attribute; name its "
                              "end-of-document token: --tokenizer 'test_tokenizers:NoEos#eos=TOKEN'"),
])
def test_bad_specs_are_one_line(spec, message):
    with pytest.raises(UserError, match=message) as exc:
        load_tokenizer(spec)
    assert "\n" not in str(exc.value) and str(exc.value).startswith("--tokenizer ")


def test_a_bad_file_and_a_folder_without_one(tmp_path):
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(UserError, match="bad.json: not a Hugging Face tokenizer.json"):
        load_tokenizer(str(tmp_path / "bad.json"))
    with pytest.raises(UserError, match="holds no tokenizer.json"):
        load_tokenizer(str(tmp_path))


def test_shard_with_a_tokenizer_json_records_it(capsys, tmp_path, monkeypatch):
    """Through `ringfeed shard`: a relative path is recorded resolved, so `ringfeed verify`
    and generate's codec (which loads the manifest's tokenizer) work from anywhere."""
    from ringfeed.train.generate import text_codec

    monkeypatch.chdir(tmp_path)
    bpe.save("tokenizer.json")
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in CORPUS))
    code, _, err = cli(capsys, "shard", "docs.jsonl", "out", "--format", "text", "--seq-len",
                       "16", "--tokenizer", "tokenizer.json", "--workers", "2")
    assert code == 0, err
    m = manifest(tmp_path / "out")
    eos = bpe.token_to_id("<|endoftext|>")
    assert m["text"]["tokenizer"] == str(tmp_path / "tokenizer.json")
    assert m["source"]["options"]["tokenizer"] == str(tmp_path / "tokenizer.json")
    assert (m["text"]["eos_id"], m["text"]["vocab_size"]) == (eos, bpe.get_vocab_size(True))
    expected = np.concatenate([bpe.encode(t).ids + [eos] for t in CORPUS])
    got = np.concatenate([load_npy(s["tokens.npy"]) for s in split_samples(tmp_path / "out",
                                                                            "train")])
    assert got.tolist() == expected[: len(got)].tolist() and len(expected) - len(got) < 16
    assert cli(capsys, "verify", "out")[0] == 0
    encode, decode, codec_eos = text_codec(m["text"]["tokenizer"])
    assert codec_eos == eos and decode(encode("def add(a, b)")) == "def add(a, b)"


def test_a_part_rerun_resumes_and_a_changed_tokenizer_file_is_another_plan(capsys, tmp_path,
                                                                           monkeypatch):
    """The tokenizer.json is an input of the plan: the same command again keeps the part's
    shards; after the file changes, the run is refused as another plan (one line, exit 2)."""
    monkeypatch.chdir(tmp_path)
    bpe.save("tokenizer.json")
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in CORPUS))
    args = ["shard", "docs.jsonl", "out", "--format", "text", "--seq-len", "16", "--max-count",
            "20", "--tokenizer", "tokenizer.json", "--part", "0/2"]
    assert cli(capsys, *args)[0] == 0
    code, out, err = cli(capsys, *args)
    assert code == 0 and "kept" in out, err
    train_bpe(["<|endoftext|>"]).save("tokenizer.json")  # another vocabulary: other tokens
    code, _, err = cli(capsys, *args)
    assert code == 2 and err.count("\n") == 1 and "other input or options" in err
    code, _, err = cli(capsys, *[a if a != "tokenizer.json" else "tokenizer.json#eos=<x>"
                                 for a in args])
    assert code == 2 and err.count("\n") == 1 and "--tokenizer " in err and "Traceback" not in err

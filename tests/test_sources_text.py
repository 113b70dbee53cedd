"""`ringfeed shard --format text` (shards/sources/text.py): documents (files, jsonl lines) ->
tokens, each document ending in the end-of-document id, packed into --seq-len sequences with the
tail dropped and counted; --val-fraction draws whole documents; the scan's work files live under
OUT only while the source is open. Byte-level tokens here (tokenizers: test_tokenizers.py)."""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import pytest
from tar_util import member_bytes

from ringfeed.errors import UserError
from ringfeed.formats.tokens import DOCS_MEMBER, TOKENS_MEMBER
from ringfeed.shards.options import ShardOptions
from ringfeed.shards.sources.text import MEMBER, Text

EOS = 256  # the byte-level tokenizer's end-of-document id


def scan(src: Path, **kw) -> Text:
    return Text(ShardOptions(src=src, out=src.parent / "out", format="text", **kw))


def sequences(source: Text, part: str = "train") -> list[list[int]]:
    return [np.load(io.BytesIO(source.sample(part, i)[MEMBER])).tolist()
            for i in range(len(source.parts[part]))]


def write(folder: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_text(text)
    return folder


def test_documents_are_packed_in_order_with_eos_and_the_tail_dropped(tmp_path):
    src = write(tmp_path / "src", {"b.txt": "cde", "a.txt": "ab", ".hidden/x.txt": "zzzz"})
    source = scan(src, seq_len=3)
    try:
        assert sequences(source) == [[97, 98, EOS], [99, 100, 101]]
        assert source.text == {"tokenizer": "bytes", "dtype": "uint16", "eos_id": EOS,
                               "vocab_size": 257, "seq_len": 3, "documents": 2, "tokens": 7,
                               "dropped_tokens": 1}
        assert source.fields == {MEMBER: "npy"}
        assert [member_bytes(source.sample("train", i)) for i in range(2)] == \
            source.parts["train"].sizes.tolist()
    finally:
        source.close()


def test_flat_shards_cut_the_stream_equally_and_record_true_document_starts(tmp_path):
    """Without --seq-len: k shards of equal tokens (--max-count counts tokens), each one sample
    of the tokens and the offsets of the documents starting in it (none at 0 mid-document)."""
    src = write(tmp_path / "src", {"a.txt": "abcdef", "b.txt": "gh", "c.txt": "ijklm"})
    source = scan(src, max_count=5)  # 16 tokens: 4 shards of 4, none dropped
    try:
        members = [source.sample("train", i) for i in range(len(source.parts["train"]))]
        tokens = [np.load(io.BytesIO(m[TOKENS_MEMBER])).tolist() for m in members]
        starts = [np.load(io.BytesIO(m[DOCS_MEMBER])) for m in members]
        assert tokens == [[97, 98, 99, 100], [101, 102, EOS, 103], [104, EOS, 105, 106],
                          [107, 108, 109, EOS]]
        assert [s.tolist() for s in starts] == [[0], [3], [2], []]
        assert {s.dtype for s in starts} == {np.dtype(np.uint32)}
        assert source.text == {"tokenizer": "bytes", "dtype": "uint16", "eos_id": EOS,
                               "vocab_size": 257, "layout": "flat",
                               "shard_tokens": {"train": 4}, "documents": 3, "tokens": 16,
                               "dropped_tokens": 0}
        assert source.fields == {TOKENS_MEMBER: "npy", DOCS_MEMBER: "npy"}
        assert [member_bytes(m) for m in members] == source.parts["train"].sizes.tolist()
    finally:
        source.close()
    source = scan(src, max_count=6)  # 3 shards of 5, the last token dropped
    try:
        assert source.text["shard_tokens"] == {"train": 5} and len(source.parts["train"]) == 3
        assert source.text["dropped_tokens"] == 1
    finally:
        source.close()


def test_a_jsonl_line_is_a_document_and_glob_picks_the_files(tmp_path):
    src = write(tmp_path / "src", {
        "docs.jsonl": "\n".join(json.dumps({"body": t, "id": i})
                                for i, t in enumerate(["xy", "", "z"])) + "\n\n",
        "skip.txt": "not matched"})
    source = scan(src, seq_len=2, text_field="body", glob="*.jsonl")
    try:
        assert sequences(source) == [[120, 121], [EOS, EOS], [122, EOS]]
        assert source.text["documents"] == 3
    finally:
        source.close()


@pytest.mark.parametrize("line, message", [
    ("{not json", r"docs.jsonl:2: not valid JSON"),
    ('{"title": "x"}', r"docs.jsonl:2: no string field 'text' \(name the document field "
                       "with --text-field\\)"),
    ('["text"]', r"docs.jsonl:2: no string field 'text'"),
])
def test_a_bad_jsonl_line_is_named_by_file_and_number(tmp_path, line, message):
    src = write(tmp_path / "src", {"docs.jsonl": '{"text": "fine"}\n' + line + "\n"})
    with pytest.raises(UserError, match=message):
        scan(src, seq_len=2)
    assert not (tmp_path / "out").exists()  # the failed scan's work files are gone


def test_val_fraction_draws_whole_documents_and_packs_each_split_alone(tmp_path):
    letters = "abcdefghij"
    src = write(tmp_path / "src", {f"{c}.txt": c * 5 for c in letters})
    source = scan(src, seq_len=4, val_fraction=0.3, shuffle_seed=7)
    try:
        assert source.val_drawn and source.text["val_documents"] == 3
        docs = {}
        for part in ("train", "val"):
            seen = {t for seq in sequences(source, part) for t in seq if t != EOS}
            docs[part] = {chr(t) for t in seen}
        assert not docs["train"] & docs["val"]  # no document on both sides
        assert len(docs["val"]) == 3 and len(docs["train"]) == 7
    finally:
        source.close()


def test_split_folders_are_packed_as_they_are(tmp_path):
    src = write(tmp_path / "src", {"train/a.txt": "abcdef", "val/b.txt": "gh"})
    source = scan(src, seq_len=3)
    try:
        assert sequences(source, "val") == [[103, 104, EOS]]
        assert len(source.parts["train"]) == 2
    finally:
        source.close()


def test_closing_the_source_removes_its_work_files_and_the_out_it_made(tmp_path):
    src = write(tmp_path / "src", {"a.txt": "abcdef"})
    source = scan(src, seq_len=2)
    assert (tmp_path / "out" / ".ringfeed-work" / "train.tokens").stat().st_size == 7 * 2
    source.close()
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("files, kw, message", [
    ({"a.txt": "ab"}, {"seq_len": 4}, "3 tokens, fewer than --seq-len 4"),
    ({"a.txt": "ab"}, {"seq_len": 0}, "--seq-len 0: must be at least 1"),
    ({"a.md": "ab"}, {"seq_len": 1, "glob": "*.txt"}, r"no text files \(matching '\*.txt'\)"),
    ({"a.txt": "abcdefgh", "b.txt": "c"}, {"seq_len": 5, "val_fraction": 0.5},
     "the (val|train) documents hold 2 tokens, fewer than --seq-len 5; change --val-fraction"),
])
def test_too_little_text_is_one_line(tmp_path, files, kw, message):
    src = write(tmp_path / "src", files)
    with pytest.raises(UserError, match=message):
        scan(src, **kw)

"""Tables (issue 37): the scan is a named step, the plan it computes is frozen, and encoding
rows reads the plan without changing it."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from ringfeed.shards.options import ShardOptions
from ringfeed.shards.sources import open_source
from ringfeed.shards.sources.tabular import Tabular


def _opts(src: Path, out: Path, **kw) -> ShardOptions:
    return ShardOptions(src=src, out=out, format="csv", **kw)


def test_constructing_reads_and_writes_nothing(tmp_path):
    out = tmp_path / "out"
    source = Tabular(_opts(tmp_path / "absent.csv", out, fields={"label": "cls"}))
    assert source.plan is None and not out.exists()
    source.close()
    assert not out.exists()


def test_the_plan_is_frozen_and_encoding_leaves_it_as_it_was(tmp_path):
    src = tmp_path / "t.jsonl"
    src.write_text('{"a": 1, "b": 2.5, "v": [1, 2], "c": "x", "label": 0}\n'
                   '{"a": 2, "b": null, "v": [3, 4], "c": "y", "label": 1}\n')
    out = tmp_path / "out"
    source = open_source(ShardOptions(src=src, out=out, format="jsonl", categorical=["c"],
                                      fields={"label": "cls", "v": "v.npy"}, fill=0.0))
    try:
        plan = source.plan
        assert plan is not None and [m.ext for m in plan.members] == ["cls", "v.npy", "x.npy"]
        with pytest.raises(dataclasses.FrozenInstanceError):
            plan.members[0].ext = "other"  # type: ignore[misc]
        with pytest.raises(TypeError):
            plan.vocab["c"]["z"] = 3  # type: ignore[index]
        encoder = source._encoder
        assert encoder.arrays["v.npy"] == ("int64", (2,)) and encoder.filled["b"] == 1
        before = dataclasses.astuple(plan.members[1])
        row = {"a": 9, "b": 1.0, "v": [1, 2, 3], "c": "y", "label": 1}
        encoder.encode(row, "row", src)  # a shape not seen before
        assert dataclasses.astuple(plan.members[1]) == before and source.plan is plan
        assert encoder.arrays["v.npy"] == ("int64", None)  # the encoder's own record
    finally:
        source.close()
    assert not out.exists()

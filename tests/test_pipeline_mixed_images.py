"""An image folder with both PNG and JPEG files, sharded by `ringfeed shard`, streams as
batches with one image field (the manifest's first image kind), every sample valid."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import ringfeed
from PIL import Image

from ringfeed.formats.manifest import Manifest
from ringfeed.pipeline import ShardPipeline

pytestmark = pytest.mark.system  # each test starts processes (tests/conftest.py)


def test_mixed_png_and_jpeg_folder_streams_every_sample(tmp_path):
    src, out = tmp_path / "src", tmp_path / "shards"
    rng = np.random.default_rng(0)
    for i in range(24):
        folder = src / f"class{i % 3}"
        folder.mkdir(parents=True, exist_ok=True)
        pixels = Image.fromarray(rng.integers(0, 256, (8, 8, 3), dtype=np.uint8))
        pixels.save(folder / (f"{i:03d}.png" if i % 2 else f"{i:03d}.jpg"))
    res = ringfeed("shard", str(src), str(out), "--format", "imagefolder", "--max-count", "8",
                   timeout=120)
    assert res.returncode == 0, res.output
    image_fields = [k for k, v in Manifest.load(out).fields.items() if v == "image"]
    assert sorted(image_fields) == ["jpg", "png"]

    pipe = ShardPipeline(str(out), batch_size=8, shuffle=False, on_error="fail")
    batches = list(pipe)
    assert len(batches) == 3
    for batch in batches:
        assert set(k for k in batch if not k.startswith("__")) == {image_fields[0], "cls"}
        assert batch[image_fields[0]].shape == (8, 8, 8, 3)
        assert batch["__valid__"].all()
    assert sorted(np.concatenate([b["__index__"] for b in batches]).tolist()) == list(range(24))
    assert pipe.stats()["skipped"] == 0

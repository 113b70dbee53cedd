"""Bring your own model: library models train as the library builds them.

The README's "Bring your own model" factories are run as written (the `# mymodels.py` block,
extracted into a module): Hugging Face transformers' ResNetForImageClassification under torch
(NCHW input, an ImageClassifierOutput out) and keras.applications.MobileNetV3Small under
TensorFlow (NHWC, a softmax at the end), each a short 1-rank `ringfeed train`. The output rules
(tensor, ModelOutput/mapping with logits, tuple; anything else one line naming the factory) and
the layout rule are checked in one process.
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import numpy as np
import pytest
from helpers import REPO, ringfeed, test_env
from train_util import write_config

from ringfeed.errors import UserError
from ringfeed.train.data import CLASSIFY, LM, DataSpec
from ringfeed.train.models import channels_first
from ringfeed.train.models.outputs import logits_of, on_logits

IMAGE_SPEC = DataSpec(CLASSIFY, "png", "cls", (32, 32, 1), num_classes=4)


def is_array(value) -> bool:
    return isinstance(value, np.ndarray)


# -- one process: the rules -----------------------------------------------------------------
def test_logits_are_taken_from_what_libraries_return():
    logits = np.zeros((2, 4))

    @dataclasses.dataclass
    class Output:  # a dataclass with logits (what ModelOutput also is)
        loss: object = None
        logits: object = None

    for out in (logits, {"logits": logits, "pooler": 1}, Output(logits=logits),
                (logits, np.ones(3)), [logits]):
        assert logits_of(out, is_array, "mymodels:m") is logits


@pytest.mark.parametrize("out, shown", [
    ({"scores": np.zeros(2)}, "dict (keys scores)"),
    ((None, np.zeros(2)), "tuple (2 element(s), the first NoneType)"),
    ("logits", "str"),
])
def test_an_unusable_output_is_one_line_naming_the_factory(out, shown):
    loss = on_logits(lambda o, y: o, is_array, "mymodels:bad")
    with pytest.raises(UserError) as e:
        loss(out, None)
    message = str(e.value)
    assert "\n" not in message and e.value.exit_code == 2
    assert message.startswith(f"model.name mymodels:bad: the model returned {shown};"), message
    assert "a tensor of logits, a mapping or ModelOutput/dataclass with 'logits'" in message


def test_image_layout_follows_the_framework_unless_asked():
    assert channels_first("torch", "auto", IMAGE_SPEC)
    assert not channels_first("tensorflow", "auto", IMAGE_SPEC)
    assert channels_first("tensorflow", "nchw", IMAGE_SPEC)
    assert not channels_first("torch", "nhwc", IMAGE_SPEC)
    # tokens and table rows are not images: never laid out
    assert not channels_first("torch", "nchw", DataSpec(LM, "t", None, (16,), vocab_size=8))
    assert not channels_first("torch", "auto", DataSpec(CLASSIFY, "x", "y", (8,),
                                                         num_classes=3))


# -- the README's factories, trained ----------------------------------------------------------
def readme_models(tmp: Path) -> Path:
    """README's `# mymodels.py` block as tmp/mymodels.py; the folder to put on PYTHONPATH."""
    section = (REPO / "README.md").read_text().split("## Bring your own model", 1)[1]
    block = re.search(r"```python\n(# mymodels\.py\n.*?)```", section, re.S)
    assert block, "README's Bring your own model section has no # mymodels.py block"
    (tmp / "mymodels.py").write_text(block.group(1))
    return tmp


@pytest.fixture(scope="module")
def image_shards(tmp_path_factory) -> Path:
    """4 classes of 32x32 grayscale PNGs (the class sets the brightness), sharded."""
    from PIL import Image

    from ringfeed.train.cli import main

    root = tmp_path_factory.mktemp("byo")
    rng = np.random.default_rng(0)
    for cls in range(4):
        folder = root / "images" / f"c{cls}"
        folder.mkdir(parents=True)
        for i in range(24):
            pixels = cls * 60 + rng.integers(0, 40, (32, 32))
            Image.fromarray(pixels.astype(np.uint8), "L").save(folder / f"{i}.png")
    assert main(["shard", str(root / "images"), str(root / "shards"), "--format", "imagefolder",
                 "--val-fraction", "0.25", "--shuffle-seed", "0", "--no-progress"]) == 0
    return root / "shards"


def train_readme_model(tmp_path: Path, shards: Path, framework: str, name: str):
    models = readme_models(tmp_path)
    cfg = write_config(tmp_path / "run.yaml", framework=framework,
                       model={"name": f"mymodels:{name}"},
                       data={"train": str(shards), "batch_size": 8},
                       optim={"name": "adam", "lr": 0.002},
                       train={"max_steps": 3, "log_every": 1},
                       output={"dir": str(tmp_path / "out"), "loggers": []})
    env = test_env(PYTHONPATH=f"{models}:{test_env()['PYTHONPATH']}")
    res = ringfeed("train", str(cfg), timeout=240, env=env)
    assert res.returncode == 0, res.output[-3000:]
    assert "Traceback" not in res.output, res.output[-3000:]
    return json.loads((tmp_path / "out" / "summary.json").read_text()), res.output


@pytest.mark.system
@pytest.mark.timeout(300)
def test_hugging_face_resnet_trains_as_built(tmp_path, image_shards):
    """NCHW in, ImageClassifierOutput out: no wrapper (with NHWC input the model raises its
    'channel dimension of the pixel values' error; without logits_of the loss fails)."""
    pytest.importorskip("transformers")
    summary, _ = train_readme_model(tmp_path, image_shards, "torch", "hf_resnet")
    assert summary["status"] == "finished" and summary["step"] == 3
    assert 0.0 <= summary["val"]["accuracy"] <= 1.0 and np.isfinite(summary["val"]["loss"])


@pytest.mark.system
@pytest.mark.timeout(300)
def test_keras_mobilenet_with_its_softmax_trains_as_built(tmp_path, image_shards):
    summary, output = train_readme_model(tmp_path, image_shards, "tensorflow", "mobilenet")
    assert "model.name mymodels:mobilenet: the model ends in a softmax" in output
    assert summary["status"] == "finished" and summary["step"] == 3
    assert 0.0 <= summary["val"]["accuracy"] <= 1.0 and np.isfinite(summary["val"]["loss"])


# -- a Hugging Face datasets Parquet export: its ClassLabel names ------------------------------
def write_hf_export(path: Path, labels: list[int], names: list[str]) -> Path:
    """A Parquet file as `datasets` exports one: an Image column ({bytes, path}), a ClassLabel
    column, and the features in the schema's b"huggingface" metadata."""
    import io

    import pyarrow as pa
    import pyarrow.parquet as pq
    from PIL import Image

    def png(value: int) -> bytes:
        buf = io.BytesIO()
        Image.fromarray(np.full((8, 8), abs(value) * 40, np.uint8), "L").save(buf, format="PNG")
        return buf.getvalue()

    features = {"image": {"_type": "Image"},
                "label": {"names": names, "_type": "ClassLabel"}}
    table = pa.table({"image": [{"bytes": png(c), "path": None} for c in labels],
                      "label": pa.array(labels, pa.int64())})
    table = table.replace_schema_metadata(
        {b"huggingface": json.dumps({"info": {"features": features}}).encode()})
    pq.write_table(table, path)
    return path


@pytest.mark.integration
def test_class_label_names_of_a_hugging_face_export_reach_the_manifest(tmp_path, capsys):
    from ringfeed.formats.manifest import Manifest
    from ringfeed.train.cli import main

    names = ["cat", "dog", "bird"]
    src = write_hf_export(tmp_path / "train-00000-of-00001.parquet", [0, 1, 2, 1] * 5, names)
    out = tmp_path / "shards"
    assert main(["shard", str(src), str(out), "--format", "parquet", "--field", "image=png",
                 "--field", "label=cls", "--no-progress"]) == 0
    assert Manifest.load(out).class_names == names
    capsys.readouterr()
    assert main(["inspect", str(out)]) == 0
    shown = capsys.readouterr().out
    assert "cat: 5" in shown and "dog: 10" in shown and "bird: 5" in shown, shown

    bad = write_hf_export(tmp_path / "bad.parquet", [0, 1, -1], names)  # -1: "no label"
    assert main(["shard", str(bad), str(tmp_path / "bad"), "--format", "parquet",
                 "--field", "image=png", "--field", "label=cls", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "column 'label': class id -1 is not one of its 3 " \
                                      "ClassLabel names" in err, err

"""Every example config (examples/configs/*.yaml) is a valid `ringfeed train` config, checked
as `ringfeed train` checks it before any rank starts (its shards are not made here)."""

from __future__ import annotations

import pytest
from helpers import REPO

from ringfeed.train.config import load_config

CONFIGS = sorted((REPO / "examples" / "configs").glob("*.yaml"))


def test_the_examples_are_there():
    assert {p.name for p in CONFIGS} >= {"digits.yaml", "lm.yaml", "imagenet.yaml"}


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_every_example_config_validates(path, monkeypatch):
    monkeypatch.syspath_prepend(str(REPO / "examples"))  # imagenet.yaml's vision_models
    load_config(path, check_paths=False)


def test_imagenet_validates_as_horovods_script(monkeypatch):
    """Train: RandomResizedCrop(224) + flip; validation: Resize(256) + CenterCrop(224)."""
    monkeypatch.syspath_prepend(str(REPO / "examples"))
    cfg = load_config(REPO / "examples" / "configs" / "imagenet.yaml", check_paths=False)
    train, val = cfg.to_pipeline_config("train"), cfg.to_pipeline_config("val")
    assert train.augment == ["random_resized_crop", "horizontal_flip"]
    assert val.augment == [{"resize": {"shorter": 256}}, "center_crop"]
    assert val.image_size == 224 and val.batch_size == 32

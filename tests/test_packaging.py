"""One installed package: the wheel holds `ringfeed` alone, and a user's own train.py,
pipeline.py and shards.py beside their script shadow nothing of it."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from helpers import BIN, REPO, test_env

pytestmark = pytest.mark.system  # builds a wheel, runs the CLI


def test_the_wheel_holds_one_top_level_package(tmp_path: Path) -> None:
    res = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                          "-q", "-w", str(tmp_path), str(REPO)], capture_output=True, text=True,
                         timeout=300, cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    (wheel,) = tmp_path.glob("ringfeed-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    top = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert top == {"ringfeed"}, top
    for sub in ("pipeline/core.py", "train/loop.py", "shards/build.py", "shards/sources/text.py",
                "train/models/torch_models.py", "formats/tarindex.py"):
        assert f"ringfeed/{sub}" in names, sub


def test_a_users_own_modules_shadow_nothing(tmp_path: Path) -> None:
    for name in ("train", "pipeline", "shards"):
        (tmp_path / f"{name}.py").write_text("raise ImportError('the user file was imported')\n")
    code = ("from ringfeed.pipeline import ShardPipeline, PipelineConfig\n"
            "import ringfeed.train.loop, ringfeed.shards.build\n"
            "print(ShardPipeline.__module__)\n")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         cwd=tmp_path, env=test_env())
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "ringfeed.pipeline.core"
    res = subprocess.run([str(BIN / "ringfeed"), "train", "--help"], capture_output=True, text=True,
                         timeout=120, cwd=tmp_path, env=test_env())
    assert res.returncode == 0, res.stderr
    assert "usage: ringfeed train" in res.stdout

"""One installed package: the wheel holds `ringfeed` alone, and a user's own train.py,
pipeline.py and shards.py beside their script shadow nothing of it."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from helpers import BIN, REPO, test_env

# A statement `import pipeline` / `from train.cli import main`, in code or in a command string,
# or `python -m` of one of the folders: from the repository root these still import the
# folders, as other modules than ringfeed's
BARE_IMPORT = re.compile(r"(?:^[ \t]*|[\"';][ \t]*)(?:from|import)[ \t]+(?:pipeline|train|shards)"
                         r"(?:[.\s]|$)|-m[ \t]+(?:pipeline|train|shards)\b", re.M)


def test_nothing_imports_the_folders_as_top_level_packages() -> None:
    skip = {"build", "demo-out", "runs"}  # and hidden folders: .venv, .git, benchmarks' peers
    files = [p for p in REPO.rglob("*") if p.suffix in (".py", ".sh", ".sbatch", ".def")
             and not skip.intersection(p.relative_to(REPO).parts)
             and not any(part.startswith(".") for part in p.relative_to(REPO).parts[:-1])
             and p.is_file()]
    bad = [f"{p.relative_to(REPO)}: {m.group(0).strip()}" for p in files
           for m in BARE_IMPORT.finditer(p.read_text(errors="replace"))]
    assert len(files) > 100 and not bad, bad


@pytest.mark.system  # builds a wheel
def test_the_wheel_holds_one_top_level_package(tmp_path: Path) -> None:
    source = tmp_path / "source"  # a copy: building in the checkout leaves build/ behind
    for name in ("pyproject.toml", "README.md", "ringfeed", "pipeline", "train", "shards"):
        source.mkdir(exist_ok=True)
        copy = shutil.copytree if (REPO / name).is_dir() else shutil.copy
        copy(REPO / name, source / name, **({"ignore": shutil.ignore_patterns("__pycache__")}
                                            if (REPO / name).is_dir() else {}))
    res = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                          "-q", "-w", str(tmp_path), str(source)], capture_output=True, text=True,
                         timeout=300, cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    (wheel,) = tmp_path.glob("ringfeed-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    top = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert top == {"ringfeed"}, top
    for sub in ("pipeline/core.py", "train/loop.py", "shards/build.py", "shards/sources/text.py",
                "train/models/torch_models.py", "formats/tarindex.py"):
        assert f"ringfeed/{sub}" in names, sub
    # every module of the tree, sub-packages too (one left out of pyproject's `packages` is not)
    modules = [p.relative_to(source).as_posix()
               for name in ("ringfeed", "pipeline", "train", "shards")
               for p in (source / name).rglob("*.py")]
    missing = [m for m in modules if f"ringfeed/{m.removeprefix('ringfeed/')}" not in names]
    assert len(modules) > 100 and not missing, missing


@pytest.mark.system  # runs Python and the CLI
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

"""README's "Life of a sample" names real functions: every `path.py:Name[.attr]` in it must
exist in that file (read with ast, nothing imported), so the map cannot rot."""

from __future__ import annotations

import ast
import re

from helpers import REPO

HOP = re.compile(r"`([\w/]+\.py):([\w.]+)`")


def defined(path, dotted: str) -> bool:
    scope: list[ast.stmt] = ast.parse(path.read_text()).body
    for part in dotted.split("."):
        node = next((n for n in scope if isinstance(n, (ast.FunctionDef, ast.ClassDef))
                     and n.name == part), None)
        if node is None:
            return False
        scope = node.body
    return True


def test_life_of_a_sample_names_functions_that_exist():
    text = (REPO / "README.md").read_text()
    section = text.split("## Life of a sample", 1)[1].split("\n## ", 1)[0]
    hops = HOP.findall(section)
    assert len(hops) >= 15
    missing = [f"{path}:{name}" for path, name in hops
               if not (REPO / path).exists() or not defined(REPO / path, name)]
    assert not missing, f"README's map names what no longer exists: {missing}"

"""User code named in the config as "module:function" (models, loss, metrics, decode/transform):
loading it (`load_callable`), and telling its errors apart (`UserCode`, one per command)."""

from __future__ import annotations

import importlib
import inspect
import os
import re
import sys
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from dataclasses import field as dataclass_field
from typing import Any

from ringfeed.errors import UserError

# What a config may name as user code: "package.module:function"
IMPORT_PATH = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")


def load_callable(path: str, field: str) -> Callable[..., Any]:
    """Import `module:function`; a missing module or attribute is one UserError line."""
    module_name, _, attr = path.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise UserError(f"{field}: cannot import {module_name!r} ({e})") from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise UserError(f"{field}: {module_name!r} has no callable {attr!r}")
    return fn


def _source_of(module: Any) -> str | None:
    """Where a module's code lives: its file, or its folder for a package."""
    file = getattr(module, "__file__", None)
    if not file:
        return None
    file = os.path.realpath(file)
    if os.path.basename(file) == "__init__.py":
        return os.path.dirname(file) + os.sep
    return file


def _entry(named: list[tuple[str, str]], frames: list[Any]) -> tuple[str, str]:
    """Of the fields that named one module, the one whose function the traceback passed
    through (outermost first: the function ringfeed called), else the first."""
    for frame in frames:
        for field, path in named:
            if frame.f_code.co_name == path.partition(":")[2]:
                return field, path
    return named[0]


@dataclass
class UserCode:
    """The user code one command runs, as its config names it, and the optimizer steps this
    process completed: what tells an exception raised from the user's code apart and names it.
    Made for each command by the CLI (train/cli.py main), filled by the command that reads a
    config (train/main.py), told of every step by the loop, asked by exit_status."""

    named: list[tuple[str, str]] = dataclass_field(default_factory=list)  # (field, "module:function")
    steps_done: int = 0  # an error before the first step is deterministic: a relaunch runs
    last_step: int = 0  # the same code on the same state

    def note_step(self, step: int) -> None:
        """The loop completed optimizer step `step` in this process."""
        self.steps_done += 1
        self.last_step = step

    def culprit(self, exc: BaseException) -> str | None:
        """Whether `exc` was raised from the user's code (a frame of a module the config
        named, once imported, in its traceback or its cause's): " (field=module:function)"
        before this process's first step, " at step N (field=...)" after it; None when no
        user code is involved."""
        sources = self._sources()
        seen: set[int] = set()
        while exc is not None and id(exc) not in seen:
            seen.add(id(exc))
            frames = [frame for frame, _ in traceback.walk_tb(exc.__traceback__)]
            for frame in reversed(frames):  # the innermost frame of the user's code names it
                name = os.path.realpath(frame.f_code.co_filename)
                for where, named in sources.items():
                    if name == where or (where.endswith(os.sep) and name.startswith(where)):
                        field_name, path = _entry(named, frames)
                        if not self.steps_done:
                            return f" ({field_name}={path})"
                        return f" at step {self.last_step + 1} ({field_name}={path})"
            exc = exc.__cause__ or exc.__context__
        return None

    def _sources(self) -> dict[str, list[tuple[str, str]]]:
        """Each named module this process imported: its file (a package's folder) -> the
        (field, "module:function") pairs that name it."""
        sources: dict[str, list[tuple[str, str]]] = {}
        for field_name, path in self.named:
            where = _source_of(sys.modules.get(path.partition(":")[0]))
            if where is not None and (field_name, path) not in sources.setdefault(where, []):
                sources[where].append((field_name, path))
        return sources


def call_with_optional(fn: Callable[..., Any], kwargs: dict[str, Any],
                       optional: dict[str, Any]) -> Any:
    """Call `fn(**kwargs)`, adding each `optional` keyword only if `fn` accepts it (so a user
    factory may ask for `spec` or `framework` without having to)."""
    params = inspect.signature(fn).parameters
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    extra = {k: v for k, v in optional.items() if takes_any or k in params}
    return fn(**kwargs, **extra)

"""User code named in the config as "module:function" (models, loss, metrics, decode/transform)."""

from __future__ import annotations

import importlib
import inspect
import os
import re
import traceback
from collections.abc import Callable
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
    where = _source_of(module)
    if where is not None and (field, path) not in _loaded.setdefault(where, []):
        _loaded[where].append((field, path))
    return fn


# The user code this process loaded: its module's file (a package's folder) -> the (field,
# "module:function") pairs that named it.
_loaded: dict[str, list[tuple[str, str]]] = {}
# The optimizer steps this process completed (the loop counts them): an error from user code
# before the first one is deterministic - a relaunch runs the same code on the same state.
_steps = {"done": 0, "last": 0}


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


def note_step(step: int) -> None:
    """The loop completed optimizer step `step` in this process."""
    _steps["done"] += 1
    _steps["last"] = step


def reset() -> None:
    """A new command in this process: no user code loaded, no step taken."""
    _loaded.clear()
    _steps.update(done=0, last=0)


def user_code_of(exc: BaseException) -> str | None:
    """Whether `exc` was raised from the user's code (a frame of a module the config named, in
    its traceback or its cause's): " (field=module:function)" before this process's first
    step, " at step N (field=...)" after it; None when no user code is involved."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        frames = [frame for frame, _ in traceback.walk_tb(exc.__traceback__)]
        for frame in reversed(frames):  # the innermost frame of the user's code names it
            name = os.path.realpath(frame.f_code.co_filename)
            for where, named in _loaded.items():
                if name == where or (where.endswith(os.sep) and name.startswith(where)):
                    field, path = _entry(named, frames)
                    if not _steps["done"]:
                        return f" ({field}={path})"
                    return f" at step {_steps['last'] + 1} ({field}={path})"
        exc = exc.__cause__ or exc.__context__
    return None


def call_with_optional(fn: Callable[..., Any], kwargs: dict[str, Any],
                       optional: dict[str, Any]) -> Any:
    """Call `fn(**kwargs)`, adding each `optional` keyword only if `fn` accepts it (so a user
    factory may ask for `spec` or `framework` without having to)."""
    params = inspect.signature(fn).parameters
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    extra = {k: v for k, v in optional.items() if takes_any or k in params}
    return fn(**kwargs, **extra)

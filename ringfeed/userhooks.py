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


class ProcessError(Exception):
    """An exception raised in another process (a loader worker), carried here as text: its
    type's name, its message, its traceback as printed there, and its frames (file,
    function), outermost first, so `UserCode.culprit` can name the user's code in it."""

    def __init__(self, type_name: str, message: str, text: str,
                 frames: list[tuple[str, str]]) -> None:
        super().__init__(f"{type_name} in a loader worker process: {message}\n{text}")
        self.type_name, self.message, self.text, self.frames = type_name, message, text, frames

    @classmethod
    def of(cls, exc: BaseException) -> ProcessError:
        """`exc` (the one being handled in this process) as what another process can raise."""
        frames = [(os.path.realpath(f.filename), f.name)
                  for f in traceback.extract_tb(exc.__traceback__)]
        return cls(type(exc).__name__, str(exc), "".join(traceback.format_exception(exc)),
                   frames)

    def __reduce__(self) -> tuple[Any, ...]:  # (pickled by torch's worker queue)
        return type(self), (self.type_name, self.message, self.text, self.frames)


def described(exc: BaseException) -> tuple[str, str, str]:
    """(traceback text, type name, message) of `exc`, as raised where it was raised."""
    if isinstance(exc, ProcessError):
        return exc.text, exc.type_name, exc.message
    return "".join(traceback.format_exception(exc)), type(exc).__name__, str(exc)


def _frames_of(exc: BaseException) -> list[tuple[str, str]]:
    """(file, function) of each frame of `exc`'s traceback, outermost first, and where it
    was carried from another process, that process's after this one's."""
    frames = [(os.path.realpath(f.f_code.co_filename), f.f_code.co_name)
              for f, _ in traceback.walk_tb(exc.__traceback__)]
    return frames + (exc.frames if isinstance(exc, ProcessError) else [])


def _entry(named: list[tuple[str, str]], frames: list[tuple[str, str]]) -> tuple[str, str]:
    """Of the fields that named one module, the one whose function the traceback passed
    through (outermost first: the function ringfeed called), else the first."""
    for _, function in frames:
        for field, path in named:
            if function == path.partition(":")[2]:
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
            frames = _frames_of(exc)
            for name, _ in reversed(frames):  # the innermost frame of the user's code names it
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

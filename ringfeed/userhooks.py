"""User code named in the config as "module:function" (models, loss, metrics, decode/transform)."""

from __future__ import annotations

import importlib
import inspect
import re
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
    return fn


def call_with_optional(fn: Callable[..., Any], kwargs: dict[str, Any],
                       optional: dict[str, Any]) -> Any:
    """Call `fn(**kwargs)`, adding each `optional` keyword only if `fn` accepts it (so a user
    factory may ask for `spec` or `framework` without having to)."""
    params = inspect.signature(fn).parameters
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    extra = {k: v for k, v in optional.items() if takes_any or k in params}
    return fn(**kwargs, **extra)

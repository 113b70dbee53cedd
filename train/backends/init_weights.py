"""`model.init_from: PATH`: a model's weights from a file the user already has, loaded by every
rank right after the model is built (the start's broadcast from rank 0 then holds them on every
rank; a resume's checkpoint replaces them). The file must be readable by every rank, as data
paths are. A file that does not fit the model is one line naming it and the first mismatches
(exit 2), never a traceback.

    torch: a state_dict, or a dict holding one under "model" or "state_dict" (Horovod's
           examples and ringfeed's own checkpoints' state.pt); DataParallel's "module."
           prefixes are dropped
    TensorFlow/Keras: a Keras weights file (`model.save_weights`, `.weights.h5`)
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ringfeed.errors import UserError

SHOWN = 3  # mismatching names a line shows


def _file(path: str) -> Path:
    file = Path(path).expanduser()
    if not file.is_file():
        raise UserError(f"model.init_from: {path} is not a file (a torch state_dict or a Keras "
                        ".weights.h5 every rank can read)")
    return file


def torch_state_dict(path: str) -> dict[str, Any]:
    """The state_dict the file holds: itself, or under "model" / "state_dict"."""
    import torch

    file = _file(path)
    try:
        loaded = torch.load(file, map_location="cpu", weights_only=True)
    except Exception as e:  # not a torch file, or one holding more than tensors
        raise UserError(f"model.init_from: {path} is not a torch state_dict file "
                        f"({type(e).__name__}: {str(e).splitlines()[0][:200]})") from None
    for key in ("model", "state_dict"):
        if isinstance(loaded, dict) and isinstance(loaded.get(key), dict):
            loaded = loaded[key]
            break
    if not isinstance(loaded, dict) or not all(torch.is_tensor(v) for v in loaded.values()):
        raise UserError(f"model.init_from: {path} holds no state_dict (tensors by name, or one "
                        "under 'model' or 'state_dict')")
    return {k.removeprefix("module."): v for k, v in loaded.items()}


def mismatch(expected: dict[str, tuple], found: dict[str, tuple]) -> str | None:
    """What differs between the model's (name -> shape) and the file's, or None."""
    missing = [k for k in expected if k not in found]
    unexpected = [k for k in found if k not in expected]
    shapes = [f"{k} {tuple(found[k])} in the file, {tuple(expected[k])} in the model"
              for k in expected if k in found and tuple(found[k]) != tuple(expected[k])]
    parts = [f"{label} ({len(items)}): {', '.join(items[:SHOWN])}"
             + (", ..." if len(items) > SHOWN else "")
             for label, items in (("missing in the file", missing),
                                  ("not in the model", unexpected), ("other shapes", shapes))
             if items]
    return "; ".join(parts) or None


def load_torch(model: Any, path: str) -> None:
    """The file's weights into `model` (every parameter and buffer, checked first)."""
    state = torch_state_dict(path)
    own = model.state_dict()
    problem = mismatch({k: tuple(v.shape) for k, v in own.items()},
                       {k: tuple(v.shape) for k, v in state.items()})
    if problem:
        raise UserError(f"model.init_from: {path} does not fit model.name's model: {problem}")
    model.load_state_dict(state)


def load_keras(model: Any, path: str) -> None:
    """A Keras weights file into `model` (Keras checks the layers and shapes)."""
    file = _file(path)
    if not file.name.endswith(".weights.h5"):
        raise UserError(f"model.init_from: {path}: a Keras model takes a weights file "
                        "ending in .weights.h5 (model.save_weights)")
    try:
        model.load_weights(str(file))
    except (ValueError, OSError, KeyError) as e:
        raise UserError(f"model.init_from: {path} does not fit model.name's model "
                        f"({str(e).splitlines()[0][:300]})") from None

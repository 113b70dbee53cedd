"""`ringfeed export RUN_DIR_or_CHECKPOINT OUT_DIR [--format hf|state_dict]`: a run's newest
complete checkpoint (or the one named) as files other tools load.

- `hf` (the built-in gpt): a Hugging Face `GPT2LMHeadModel` directory, `config.json` and
  `model.safetensors`, which `transformers` loads and generates with. The gpt is GPT-2's
  architecture layer for layer (train/models/torch_models.py), so the weights map one-to-one:
  GPT-2's Conv1D layers hold the transposes of torch's Linear weights; a model without biases
  gets zero biases (GPT-2 always has them), a tied head is GPT-2's own tying.
- `state_dict` (any torch model): `state_dict.pt`, the model's weights alone, for
  `model.load_state_dict(torch.load(path, weights_only=True))` (and `model.init_from`).

The directory appears whole or not at all: written beside OUT_DIR and renamed into place. An
existing OUT_DIR is refused (one line), never overwritten. The checkpoint is found and checked
by the checkpoint reader a resume uses (train/checkpoint/files.py): a run's own checkpoint.dir
(local or a bucket, with the run's checkpoint.storage_options), a directory of checkpoints, or
one checkpoint's path or URL. TensorFlow checkpoints are refused (one line).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import struct
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from ringfeed.errors import EXIT_WRITE, UserError
from ringfeed.train.checkpoint.files import META, find_resume_point
from ringfeed.train.checkpoint.store import is_remote, open_store
from ringfeed.train.observe.runfiles import CONFIG_FILE, checkpoint_dir

STATE_FILE = "state.pt"  # the torch backend's payload (train/backends/torch.py)
STATE_DICT_FILE = "state_dict.pt"


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "export", help="a run's checkpoint as a Hugging Face GPT-2 directory or a state_dict",
        description="Write the newest complete checkpoint of a run (or the checkpoint named) "
                    "as a Hugging Face GPT2LMHeadModel directory (the built-in gpt) or a plain "
                    "torch state_dict file (any torch model).")
    add_source_arguments(p)
    p.add_argument("out_dir", help="the directory to create (must not exist)")
    p.add_argument("--format", choices=["hf", "state_dict"], default="hf",
                   help="hf: config.json + model.safetensors (default); state_dict: "
                        "state_dict.pt")
    p.set_defaults(func=run)


def add_source_arguments(p: argparse.ArgumentParser) -> None:
    """The checkpoint argument `ringfeed export` and `ringfeed generate` share."""
    p.add_argument("source", metavar="RUN_DIR_or_CHECKPOINT",
                   help="a run's output.dir (its newest complete checkpoint), a checkpoint "
                        "directory, or one checkpoint (path or URL)")
    p.add_argument("--storage-option", action="append", default=[], metavar="KEY=VALUE",
                   help="fsspec option for a checkpoint URL (endpoint_url=...); a run's own "
                        "checkpoint.storage_options are used too")


@dataclass(frozen=True)
class Checkpoint:
    """A torch checkpoint's model weights and the run's config (as its meta.json holds it)."""

    location: str
    step: int
    config: dict[str, Any]
    weights: dict[str, Any]  # the model's state_dict (torch tensors)

    @property
    def model_name(self) -> str:
        return str((self.config.get("model") or {}).get("name", "mlp"))

    def model_args(self) -> dict[str, Any]:
        return dict((self.config.get("model") or {}).get("args") or {})


def read_checkpoint(source: str, storage_specs: list[str]) -> Checkpoint:
    """The newest complete checkpoint of `source` (rules in the module doc); UserError (one
    line) when there is none or it is not torch's."""
    import torch

    resume, location, options = _checkpoint_location(source, storage_specs)
    try:
        found = find_resume_point(resume, open_store(location, options), _warn,
                                  lambda where: open_store(where, options))
    except UserError as e:
        raise UserError(f"{source}: {str(e).removeprefix('checkpoint.resume: ')}") from None
    if found is None:
        raise UserError(f"{source}: no complete checkpoint in {location} (a run writes them "
                        "with checkpoint.every_steps and at its end)")
    try:
        meta = found.meta
        if meta.get("framework") != "torch":
            raise UserError(f"{found.location}: a {meta.get('framework')} checkpoint; ringfeed "
                            "export and generate read torch checkpoints (framework: torch)")
        state = torch.load(found.path / STATE_FILE, map_location="cpu", weights_only=True)
    finally:
        found.store.release(found.path)
    return Checkpoint(found.location, int(meta["step"]), dict(meta.get("config") or {}),
                      state["model"])


def _checkpoint_location(source: str, storage_specs: list[str]
                         ) -> tuple[str, str, dict[str, Any]]:
    """(find_resume_point's `resume`, its directory, the storage options): "auto" in a run
    directory's checkpoint.dir or a local directory of checkpoints, else `source` itself (one
    checkpoint, or a URL of either kind)."""
    from ringfeed.shards.remote import parse_storage_options

    options = parse_storage_options(storage_specs)
    if is_remote(source):
        return source, source, options
    path = Path(source)
    if not path.exists():
        raise UserError(f"{source}: no such run directory or checkpoint")
    config = path / CONFIG_FILE
    if not config.is_file():
        return ("auto" if path.is_dir() and not (path / META).exists() else source), source, \
            options
    try:
        section = (yaml.safe_load(config.read_text()) or {}).get("checkpoint") or {}
    except (OSError, yaml.YAMLError, AttributeError) as e:
        raise UserError(f"{config}: not a readable run config ({type(e).__name__})") from None
    directory = checkpoint_dir(path, section.get("dir"))
    if not is_remote(directory) and not Path(directory).is_dir():
        raise UserError(f"{source}: no checkpoints ({directory} does not exist; a run writes "
                        "them with checkpoint.every_steps and at its end)")
    return "auto", directory, {**(section.get("storage_options") or {}), **options}


def shards_text(config: dict[str, Any]) -> dict[str, Any] | None:
    """The `text` entry (tokenizer, eos_id, vocab_size) of the manifest of the run's train data
    (a mixture's first source), None where it cannot be read (moved, not token shards)."""
    import fsspec

    data = config.get("data") or {}
    train = data.get("train")
    if isinstance(train, list) and train and isinstance(train[0], dict):
        train = train[0].get("path")
    if not isinstance(train, str) or "{" in train or train.endswith(".tar"):
        return None
    try:
        with fsspec.open(train.rstrip("/") + "/manifest.json", "rb",
                         **(data.get("storage_options") or {})) as f:
            text = json.load(f).get("text")
    except Exception:  # noqa: BLE001 - any unreadable manifest: the caller says what it lacks
        return None
    return text if isinstance(text, dict) else None


def _warn(message: str) -> None:
    print(f"ringfeed: {message}", file=sys.stderr, flush=True)


def build_gpt(checkpoint: Checkpoint, command: str) -> Any:
    """The built-in gpt of `checkpoint`, its weights loaded, in eval mode. Its vocabulary and
    positions are read off the weights (the data that decided them need not be at hand)."""
    from ringfeed.train.data import LM, DataSpec
    from ringfeed.train.models import build_model

    if checkpoint.model_name != "gpt":
        raise UserError(f"{checkpoint.location}: model.name is {checkpoint.model_name!r}; "
                        f"ringfeed {command} needs the built-in language model (model.name: "
                        "gpt)" + ("; --format state_dict exports any torch model"
                                  if command == "export" else ""))
    vocab, _ = checkpoint.weights["tok.weight"].shape
    positions = int(checkpoint.weights["pos.weight"].shape[0])
    spec = DataSpec(LM, "tokens", None, (positions,), vocab_size=int(vocab))
    model = build_model("torch", "gpt", checkpoint.model_args(), spec)
    model.load_state_dict(checkpoint.weights)
    return model.eval()


# -- Hugging Face GPT-2 -----------------------------------------------------------------------
def gpt2_config(model: Any, eos_id: int | None) -> dict[str, Any]:
    """config.json of the GPT2LMHeadModel equal to `model` (train/models/torch_models.py GPT):
    exact GELU (GPT-2's default is the tanh approximation), LayerNorm eps 1e-5, 4x MLP."""
    first = model.blocks[0]
    config: dict[str, Any] = {
        "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2",
        "vocab_size": model.tok.num_embeddings, "n_positions": model.pos.num_embeddings,
        "n_embd": model.tok.embedding_dim, "n_layer": len(model.blocks), "n_head": first.n_head,
        "n_inner": None, "activation_function": "gelu", "layer_norm_epsilon": 1e-5,
        "resid_pdrop": first.dropout, "embd_pdrop": first.dropout, "attn_pdrop": first.dropout,
        "initializer_range": 0.02, "scale_attn_weights": True, "use_cache": True,
        "tie_word_embeddings": model.head.weight is model.tok.weight,
        "torch_dtype": "float32"}
    if eos_id is not None:
        config.update(bos_token_id=eos_id, eos_token_id=eos_id)
    return config


def gpt2_tensors(model: Any) -> dict[str, Any]:
    """GPT2LMHeadModel's weights from `model`'s: names mapped, Linear weights transposed into
    Conv1D's (in, out), absent biases as zeros."""
    import torch

    out: dict[str, Any] = {"transformer.wte.weight": model.tok.weight,
                           "transformer.wpe.weight": model.pos.weight}
    if model.head.weight is not model.tok.weight:
        out["lm_head.weight"] = model.head.weight
    layers = {"ln_1": "ln1", "ln_2": "ln2", "attn.c_attn": "qkv", "attn.c_proj": "proj",
              "mlp.c_fc": "mlp.0", "mlp.c_proj": "mlp.2"}
    for i, block in enumerate(model.blocks):
        for hf, ours in layers.items():
            module = block.get_submodule(ours)
            weight = module.weight if hf.startswith("ln") else module.weight.t()
            out[f"transformer.h.{i}.{hf}.weight"] = weight
            out[f"transformer.h.{i}.{hf}.bias"] = (
                module.bias if module.bias is not None else torch.zeros(weight.shape[-1]))
    out["transformer.ln_f.weight"] = model.ln_f.weight
    out["transformer.ln_f.bias"] = (model.ln_f.bias if model.ln_f.bias is not None
                                    else torch.zeros_like(model.ln_f.weight))
    return {name: t.detach().to("cpu", torch.float32).contiguous() for name, t in out.items()}


def safetensors_bytes(tensors: dict[str, Any]) -> bytes:
    """The safetensors format (an 8-byte little-endian header size, the JSON header, the
    tensors' bytes), written here so that exporting needs no package beyond torch."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    blobs, offset = [], 0
    for name, tensor in tensors.items():
        data = tensor.numpy().tobytes()
        header[name] = {"dtype": "F32", "shape": list(tensor.shape),
                        "data_offsets": [offset, offset + len(data)]}
        blobs.append(data)
        offset += len(data)
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)  # the tensors start 8-byte aligned
    return struct.pack("<Q", len(head)) + head + b"".join(blobs)


# -- the command ------------------------------------------------------------------------------
def run(args: argparse.Namespace) -> int:
    import torch

    out = Path(args.out_dir)
    if out.exists():
        raise UserError(f"{out}: already exists (ringfeed export writes a new directory; "
                        "choose another or remove it)")
    checkpoint = read_checkpoint(args.source, args.storage_option)
    files: dict[str, bytes | Any] = {}
    if args.format == "state_dict":
        files[STATE_DICT_FILE] = {k: v.detach().cpu() for k, v in checkpoint.weights.items()}
    else:
        model = build_gpt(checkpoint, "export")
        text = shards_text(checkpoint.config) or {}
        files["config.json"] = (json.dumps(gpt2_config(model, text.get("eos_id")), indent=2)
                                + "\n").encode()
        files["model.safetensors"] = safetensors_bytes(gpt2_tensors(model))
    _write_dir(out, files, torch.save)
    print(f"ringfeed export: {checkpoint.location} (step {checkpoint.step}) -> {out} "
          f"({args.format})")
    return 0


def _write_dir(out: Path, files: dict[str, Any], save: Any) -> None:
    """`files` (bytes, or a state dict for torch.save) into a new directory `out`, whole: a
    temporary sibling, fsynced, renamed into place."""
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    except OSError as e:
        raise UserError(f"{out}: cannot write here ({e.strerror})", exit_code=EXIT_WRITE) from None
    try:
        for name, content in files.items():
            with open(tmp / name, "wb") as f:
                if isinstance(content, bytes):
                    f.write(content)
                else:
                    save(content, f)
                f.flush()
                os.fsync(f.fileno())
        os.chmod(tmp, 0o755)
        os.rename(tmp, out)
    except OSError as e:
        raise UserError(f"{out}: cannot write the export ({e.strerror}; nothing was left "
                        "there)", exit_code=EXIT_WRITE) from None
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)

"""`ringfeed info`: versions and Horovod's build matrix (frameworks, controllers, tensor ops).

Each framework extension is probed in its own subprocess (both in parallel): importing torch and
TensorFlow into one process is slow, and a broken extension must not take `info` down with it.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from importlib.metadata import PackageNotFoundError, version

PACKAGES = ["ringfeed", "horovod", "torch", "tensorflow-cpu", "tensorflow", "keras", "webdataset",
            "fsspec", "numpy"]
OPS = ["mpi", "gloo", "nccl", "ddl", "ccl", "cuda", "rocm"]

_PROBE = """
import json, sys
out = {"built": False}
try:
    ext = __import__("horovod.%(fw)s", fromlist=["x"])
    out["built"] = True
    for op in %(ops)r:
        fn = getattr(ext, op + "_built", None)
        out[op] = bool(fn()) if fn else False
    if "%(fw)s" == "torch":
        import torch
        out["accelerator"] = torch.cuda.is_available()
    else:
        import tensorflow as tf
        out["accelerator"] = bool(tf.config.list_physical_devices("GPU"))
except Exception as e:  # report, don't crash: info must show what is broken
    out["error"] = f"{type(e).__name__}: {e}"
print(json.dumps(out))
"""


def _version(name: str) -> str | None:
    try:
        return version(name)
    except PackageNotFoundError:
        return None


def probe_framework(fw: str, timeout: float = 120) -> dict:
    code = _PROBE % {"fw": fw, "ops": OPS}
    try:
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                              timeout=timeout, env=_quiet_env())
    except subprocess.TimeoutExpired:
        return {"built": False, "error": f"probe timed out after {timeout}s"}
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        return {"built": False, "error": tail}
    return json.loads(lines[-1])


def _quiet_env() -> dict:
    import os

    env = dict(os.environ)
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    return env


def collect() -> dict:
    with ThreadPoolExecutor(2) as pool:
        torch_f, tf_f = pool.submit(probe_framework, "torch"), pool.submit(probe_framework, "tensorflow")
        frameworks = {"torch": torch_f.result(), "tensorflow": tf_f.result()}
    built = [f for f in frameworks.values() if f.get("built")]
    controllers = {c: any(f.get(c) for f in built) for c in ("mpi", "gloo")}
    tensor_ops = {op: any(f.get(op) for f in built) for op in ("nccl", "ddl", "ccl", "mpi", "gloo")}
    return {
        "python": sys.version.split()[0],
        "versions": {p: v for p in PACKAGES if (v := _version(p))},
        "frameworks": frameworks,
        "controllers": controllers,
        "tensor_ops": tensor_ops,
    }


def render(info: dict) -> str:
    def mark(flag: bool) -> str:
        return "[X]" if flag else "[ ]"

    lines = [f"ringfeed {info['versions'].get('ringfeed', '?')} (Python {info['python']})", "",
             "Versions:"]
    lines += [f"  {name:<15} {v}" for name, v in info["versions"].items()]
    lines += ["", "Horovod frameworks:"]
    for fw, f in info["frameworks"].items():
        extra = f"  ({f['error']})" if f.get("error") else ""
        gpu = "  GPU visible" if f.get("accelerator") else ""
        lines.append(f"  {mark(f.get('built', False))} {fw}{gpu}{extra}")
    lines += ["", "Horovod controllers:"]
    lines += [f"  {mark(v)} {k.upper() if k == 'mpi' else k.capitalize()}"
              for k, v in info["controllers"].items()]
    lines += ["", "Horovod tensor operations:"]
    lines += [f"  {mark(v)} {k.upper() if k != 'gloo' else 'Gloo'}" for k, v in info["tensor_ops"].items()]
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    info = collect()
    print(json.dumps(info, indent=2) if args.json else render(info))
    # Non-zero when Horovod cannot serve both frameworks: a broken install should fail loudly.
    return 0 if all(f.get("built") for f in info["frameworks"].values()) else 1


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("info", help="versions and Horovod's build matrix")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=run)

"""Find what Horovod's NCCL build needs on a GPU host, or name the one thing that is missing.

    python docker/gpu_build.py [--nccl-link-dir DIR]   ->  KEY=VALUE lines for the build

What it looks for, in order (the first that is complete wins):
- CUDA: $HOROVOD_CUDA_HOME, $CUDA_HOME, the toolkit around `nvcc` on PATH, /usr/local/cuda;
  complete = bin/nvcc and include/cuda_runtime.h.
- NCCL: $HOROVOD_NCCL_HOME; the system's (nccl.h in /usr/include or CUDA's include, libnccl.so
  in the usual lib dirs); the `nvidia-nccl-cu*` wheel that torch's CUDA build installs (site
  packages of the interpreter running this). The wheel ships only libnccl.so.2, and Horovod's
  CMake looks for libnccl.so, so a folder with include/ and lib/libnccl.so links is made in
  --nccl-link-dir.
- Compute capabilities: $HOROVOD_BUILD_CUDA_CC_LIST; `nvidia-smi --query-gpu=compute_cap`;
  torch.cuda's device capabilities.
Every failure is one line on stderr naming what is missing and how to provide it, exit 1.
"""

from __future__ import annotations

import argparse
import os
import shutil
import site
import subprocess
import sys
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path

LIB_DIRS = ("lib", "lib64", "lib/x86_64-linux-gnu", "lib/aarch64-linux-gnu")
SYSTEM_ROOTS = ("/usr", "/usr/local")


class Missing(Exception):
    """One line: what is missing and what to do."""


def find_cuda(env: Mapping[str, str], which: Callable[[str], str | None] = shutil.which,
              default: str = "/usr/local/cuda") -> Path:
    candidates: list[tuple[str, Path]] = []
    for var in ("HOROVOD_CUDA_HOME", "CUDA_HOME"):
        if env.get(var):
            candidates.append((f"${var}", Path(env[var])))
    nvcc = which("nvcc")
    if nvcc:
        candidates.append(("nvcc on PATH", Path(nvcc).resolve().parent.parent))
    candidates.append((default, Path(default)))
    for _, root in candidates:
        if (root / "bin" / "nvcc").exists() and (root / "include" / "cuda_runtime.h").exists():
            return root
    tried = ", ".join(f"{how} ({root})" if how != str(root) else how for how, root in candidates)
    raise Missing(f"no CUDA toolkit found (tried {tried}; need bin/nvcc and "
                  "include/cuda_runtime.h): install the CUDA toolkit or set CUDA_HOME")


def _libnccl(root: Path) -> Path | None:
    for sub in LIB_DIRS:
        for name in ("libnccl.so", "libnccl.so.2"):
            if (root / sub / name).exists():
                return root / sub / name
    return None


def find_nccl(env: Mapping[str, str], cuda: Path, link_dir: Path,
              site_dirs: Iterable[str], system_roots: Iterable[str] = SYSTEM_ROOTS) -> Path:
    """A folder with include/nccl.h and lib/libnccl.so for HOROVOD_NCCL_HOME."""
    if env.get("HOROVOD_NCCL_HOME"):
        home = Path(env["HOROVOD_NCCL_HOME"])
        if (home / "include" / "nccl.h").exists() and _libnccl(home):
            return home
        raise Missing(f"$HOROVOD_NCCL_HOME={home} has no include/nccl.h and lib/libnccl.so: "
                      "point it at an NCCL install, or unset it to use the system's or the "
                      "nvidia-nccl wheel's")
    for root in (*map(Path, system_roots), cuda):
        lib = _libnccl(root)
        if (root / "include" / "nccl.h").exists() and lib is not None and lib.name == "libnccl.so":
            return root
    for directory in site_dirs:
        wheel = Path(directory) / "nvidia" / "nccl"
        lib = wheel / "lib" / "libnccl.so.2"
        if (wheel / "include" / "nccl.h").exists() and lib.exists():
            return _link_tree(wheel / "include", lib, link_dir)
    raise Missing("no NCCL found (no $HOROVOD_NCCL_HOME, no nccl.h + libnccl.so under "
                  f"{', '.join(system_roots)} or {cuda}, no nvidia-nccl wheel in this "
                  "environment): install torch's CUDA build (it brings nvidia-nccl-cu*), the "
                  "system's libnccl-dev, or set HOROVOD_NCCL_HOME")


def _link_tree(include: Path, lib: Path, link_dir: Path) -> Path:
    """include -> the wheel's headers, lib/libnccl.so -> its libnccl.so.2 (made atomically)."""
    (link_dir / "lib").mkdir(parents=True, exist_ok=True)
    for link, target in ((link_dir / "include", include),
                         (link_dir / "lib" / "libnccl.so", lib)):
        tmp = link.with_name(link.name + ".tmp")
        if tmp.is_symlink() or tmp.exists():
            tmp.unlink()
        tmp.symlink_to(target.resolve())
        os.replace(tmp, link)
    return link_dir


def compute_capabilities(env: Mapping[str, str],
                         query: Callable[[], list[str] | None] | None = None) -> str:
    """"80,90" style: the CC list to compile Horovod's CUDA kernels for."""
    if env.get("HOROVOD_BUILD_CUDA_CC_LIST"):
        return env["HOROVOD_BUILD_CUDA_CC_LIST"]
    found = (query or _query_capabilities)()
    if not found:
        raise Missing("cannot tell the GPUs' compute capability (nvidia-smi gave none and torch "
                      "sees no GPU): set HOROVOD_BUILD_CUDA_CC_LIST, e.g. 90 for H100, 80 for "
                      "A100")
    return ",".join(sorted({cc.replace(".", "").strip() for cc in found}, key=int))


def _query_capabilities() -> list[str] | None:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=compute_cap", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30, check=True).stdout
        caps = [line.strip() for line in out.splitlines() if line.strip()]
        if caps:
            return caps
    except (OSError, subprocess.SubprocessError):
        pass
    try:
        import torch

        return [f"{a}.{b}" for a, b in (torch.cuda.get_device_capability(i)
                                        for i in range(torch.cuda.device_count()))]
    except Exception:  # noqa: BLE001 - no torch / no CUDA torch: same answer, nothing found
        return None


def build_env(env: Mapping[str, str], link_dir: Path, site_dirs: Iterable[str],
              which: Callable[[str], str | None] = shutil.which,
              query: Callable[[], list[str] | None] | None = None,
              system_roots: Iterable[str] = SYSTEM_ROOTS) -> dict[str, str]:
    cuda = find_cuda(env, which)
    nccl = find_nccl(env, cuda, link_dir, site_dirs, system_roots)
    return {"HOROVOD_GPU_OPERATIONS": "NCCL", "HOROVOD_CUDA_HOME": str(cuda),
            "HOROVOD_NCCL_HOME": str(nccl), "HOROVOD_NCCL_LINK": "SHARED",
            "HOROVOD_BUILD_CUDA_CC_LIST": compute_capabilities(env, query)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nccl-link-dir", type=Path,
                        default=Path(os.environ.get("RINGFEED_CACHE", Path.home() / ".cache" /
                                                    "ringfeed")) / "nccl")
    args = parser.parse_args(argv)
    try:
        found = build_env(os.environ, args.nccl_link_dir, site.getsitepackages())
    except Missing as missing:
        print(f"setup: {missing}", file=sys.stderr)
        return 1
    for key, value in found.items():
        print(f"{key}={value}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

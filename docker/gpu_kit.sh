#!/usr/bin/env bash
# `make gpu-kit`: everything `make gpu-check` needs on a GPU machine that has PyTorch (CUDA), a
# compiler and nothing else - no network - packed into .gpu/ (git-ignored) to copy over:
#   .gpu/whl/       ringfeed's pure-Python and small binary dependencies as wheels for the
#                   target Python (GPU_PYTHON_VERSION, default 3.12), the versions of this .venv
#   .gpu/whl-s3/    what `gpu_check.sh feed-s3` (gpu_feed_bench.py --s3, issue 36) adds: moto's
#                   S3 server (moto[s3] + flask + flask-cors: what moto.server needs for S3),
#                   boto3, botocore, s3fs, aiobotocore, aiohttp and their dependencies, resolved
#                   by pip for the target Python and held to this .venv's versions (~33 MB; the
#                   wheels already in .gpu/whl left out). GPU_KIT_MOTO="moto[server]" packs all
#                   of moto's server extras (cfn-lint, sympy, docker, ...: ~53 MB); GPU_KIT_S3=0
#                   skips the folder.
#   .gpu/horovod-0.28.1.tar.gz   Horovod's sdist (from make setup's cache)
#   .gpu/data/digits-shards      the digits demo's shards (made here: no scikit-learn there)
#   .gpu/wheels/    a Horovod GPU wheel brought back by an earlier gpu-check, if any (kept)
# Needs `make setup` first (the Makefile target runs it).
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(dirname "$HERE")"
PY="${VENV:-$ROOT/.venv}/bin/python"
KIT="$ROOT/.gpu"
CACHE="${RINGFEED_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/ringfeed}"
PYVER="${GPU_PYTHON_VERSION:-3.12}"
die() { echo "gpu-kit: $*" >&2; exit 1; }

[ -x "$PY" ] || die "no $PY: run make setup first"
mkdir -p "$KIT/whl" "$KIT/data" "$KIT/wheels"

# The runtime dependencies a bare torch environment lacks, at this venv's versions (pydantic and
# pydantic-core must match each other); numpy, torch and their own dependencies are there.
mapfile -t pins < <("$PY" - <<'EOF'
from importlib.metadata import version
for name in ("webdataset", "braceexpand", "pydantic", "pydantic-core", "annotated-types",
             "typing-inspection", "typing-extensions", "pyyaml", "pillow", "simplejpeg", "fsspec",
             "tqdm", "psutil", "packaging", "cloudpickle", "cffi", "pycparser"):
    print(f"{name}=={version(name)}")
EOF
)
"$PY" -m pip download -q --no-deps --only-binary=:all: --implementation cp \
  --python-version "$PYVER" --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 -d "$KIT/whl" "${pins[@]}" \
  || die "pip download of the wheels for Python $PYVER failed"

# S3 rows (gpu_feed_bench.py --s3): the dependency closure by pip's resolver for the target
# Python, every package held to this venv's version where it has one (a constraints file from
# pip freeze; torch, nvidia-*, triton and this checkout left out: the GPU machine has its own)
if [ "${GPU_KIT_S3:-1}" != 0 ]; then
  constraints="$(mktemp)"
  trap 'rm -f "$constraints"' EXIT
  "$PY" -m pip freeze --exclude-editable 2>/dev/null | grep '==' \
    | grep -viE '^(torch|nvidia-|triton|horovod|tensorflow|ringfeed)' >"$constraints"
  mapfile -t s3pins < <("$PY" - "${GPU_KIT_MOTO:-moto[s3]}" <<'EOF'
import sys
from importlib.metadata import version
moto = sys.argv[1]
print(f"{moto}=={version('moto')}")
for name in ("flask", "flask-cors", "boto3", "botocore", "s3fs", "aiobotocore", "aiohttp"):
    print(f"{name}=={version(name)}")
EOF
)
  rm -rf "$KIT/whl-s3"
  "$PY" -m pip download -q --only-binary=:all: --implementation cp --python-version "$PYVER" \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -c "$constraints" -d "$KIT/whl-s3" "${s3pins[@]}" \
    || die "pip download of the S3 wheels (${s3pins[*]}) for Python $PYVER failed"
  for w in "$KIT"/whl-s3/*.whl; do  # one copy of each wheel: gpu-check installs both folders
    if [ -f "$KIT/whl/$(basename "$w")" ]; then rm -f "$w"; fi
  done
  bad="$(find "$KIT/whl-s3" -iname 'torch-*' -o -iname 'nvidia_*' -o -iname 'triton-*' | head -3)"
  [ -z "$bad" ] || die "the S3 wheels' closure pulled in torch/nvidia/triton: $bad"
  du -sh "$KIT/whl-s3" | awk -v n="$(find "$KIT/whl-s3" -name '*.whl' | wc -l)" \
    '{print "gpu-kit: " n " S3 wheels, " $1 " in .gpu/whl-s3 (for gpu_check.sh feed-s3)"}'
fi

sdist="$CACHE/src/horovod-0.28.1.tar.gz"
[ -f "$sdist" ] || die "no $sdist: make setup keeps Horovod's sdist there; run it first"
cp "$sdist" "$KIT/"

if [ ! -f "$KIT/data/digits-shards/manifest.json" ]; then
  "$PY" - "$KIT/data" <<'EOF'
import subprocess, sys
from pathlib import Path
sys.path.insert(0, "examples")
from demo import build_digits
out = Path(sys.argv[1])
build_digits(out / "digits-images")
subprocess.run([sys.executable, "-m", "train", "shard", str(out / "digits-images"),
                str(out / "digits-shards"), "--format", "imagefolder", "--val-fraction", "0.1",
                "--shuffle-seed", "0", "--max-count", "200"], check=True)
EOF
  rm -rf "$KIT/data/digits-images"
fi
du -sh "$KIT" | awk '{print "gpu-kit: " $1 " in .gpu/ (carry it to the GPU machine; then make gpu-check there)"}'

#!/usr/bin/env bash
# benchmarks/peers/setup.sh: the peers' own venv for benchmarks/bucket_bench.py,
# benchmarks/.peers-venv (gitignored): MosaicML Streaming, LitData, webdataset, with a CPU torch,
# and NVIDIA DALI for benchmarks/augment_bench.py.
# Idempotent: a venv whose stamp matches this script's pins is left alone (FORCE=1 rebuilds).
#
# Why a venv of their own: mosaicml-streaming 0.13 wants numpy < 2.2 (ringfeed's .venv has 2.4),
# and `import streaming` imports torchvision, whose PyPI wheel is a CUDA build that does not load
# beside a CPU torch: we install no torchvision and put a stub of the two names streaming uses
# (peers/stubs/torchvision) on the venv's path instead.
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"
VENV="${PEERS_VENV:-$ROOT/benchmarks/.peers-venv}"
PY="${PYTHON:-python3.11}"
# torch: the main venv's version (a CPU build), else the pin below
TORCH_V="$("$ROOT/.venv/bin/python" -c 'import torch; print(torch.__version__)' 2>/dev/null || echo 2.13.0)"
PINS=("torch==$TORCH_V" "mosaicml-streaming==0.13.0" "numpy<2.2" "litdata==0.2.76"
      "obstore" "webdataset==1.0.2" "simplejpeg" "pillow" "boto3" "s3fs")
DALI_PIN="nvidia-dali-cuda130==2.4.0"   # its CPU pipeline runs without a GPU
STAMP="$VENV/.stamp"
want="$(printf '%s\n' "${PINS[@]}" "$DALI_PIN" | sha256sum | cut -c1-16)-$(sha256sum "$HERE/setup.sh" | cut -c1-16)"
if [ "${FORCE:-0}" != 1 ] && [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$want" ]; then
  echo "peers venv up to date: $VENV"; exit 0
fi
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --upgrade pip >/dev/null
# torch first and alone, so the others' "torch" requirement is met by this build
"$VENV/bin/python" -m pip install -q "torch==$TORCH_V" \
  || "$VENV/bin/python" -m pip install -q "torch==${TORCH_V%%+*}" --index-url https://download.pytorch.org/whl/cpu
# the peers without their torchvision (streaming's only use of it is two names: stubbed)
"$VENV/bin/python" -m pip install -q "${PINS[@]:1}" "torch==$TORCH_V"
"$VENV/bin/python" -m pip uninstall -q -y torchvision 2>/dev/null || true
# DALI's CPU pipeline (benchmarks/augment_bench.py), optional: the bench skips it when missing
"$VENV/bin/python" -m pip install -q "$DALI_PIN" \
  || echo "peers venv: $DALI_PIN not installed (augment_bench skips DALI)" >&2
site="$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
echo "$HERE/stubs" >"$site/ringfeed_peer_stubs.pth"
"$VENV/bin/python" - <<'PYEOF'
import litdata, numpy, obstore, streaming, torch, webdataset
print("peers venv:", "streaming", streaming.__version__, "litdata", litdata.__version__,
      "webdataset", webdataset.__version__, "torch", torch.__version__, "numpy", numpy.__version__)
PYEOF
echo "$want" >"$STAMP"

#!/usr/bin/env bash
# ringfeed's one installer: `make setup` and the Docker images both run it.
#   docker/install.sh VENV_DIR
# Env: PYTHON (python3.11; 3.10-3.12 work), EXTRAS (torch,tf-cpu,test), RINGFEED_EDITABLE (1),
#      RINGFEED_CACHE (~/.cache/ringfeed: Horovod's sdist and built wheels, keyed by versions),
#      HOROVOD_GPU_OPERATIONS: NCCL builds Horovod's GPU ops (the default where nvidia-smi lists
#        a GPU; `none` forces a CPU build); docker/gpu_build.py finds CUDA, NCCL and the
#        compute capabilities, or names what is missing,
#      TORCH_INDEX_URL: install torch from this index first (a CUDA build for a GPU host, e.g.
#        https://download.pytorch.org/whl/cu130).
# Idempotent: a second run with nothing changed takes seconds. Every failure is one line on
# stderr naming the cause and, for builds, the full log.
set -euo pipefail

HOROVOD_VERSION=0.28.1
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(dirname "$HERE")"
VENV="${1:-$ROOT/.venv}"
PYTHON="${PYTHON:-python3.11}"
EXTRAS="${EXTRAS:-torch,tf-cpu,test}"
EDITABLE="${RINGFEED_EDITABLE:-1}"
CACHE="${RINGFEED_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/ringfeed}"

die() { echo "setup: $*" >&2; exit 1; }
say() { echo "setup: $*"; }

# --- prerequisites, each a one-line error -------------------------------------------------
command -v "$PYTHON" >/dev/null 2>&1 \
  || die "$PYTHON not found; install Python 3.11 or run with PYTHON=/path/to/python3.11"
pyver="$("$PYTHON" -c 'import sys; print("%d.%d" % sys.version_info[:2])')"
case "$pyver" in
  3.10|3.11|3.12) ;;
  *) die "$PYTHON is Python $pyver; ringfeed needs 3.10-3.12 (set PYTHON=/path/to/python3.11)" ;;
esac
command -v g++ >/dev/null 2>&1 || die "no C++ compiler (g++) found; Horovod is built from source: install g++ (Debian: apt-get install g++)"
mkdir -p "$(dirname "$VENV")" "$CACHE"
free_kb="$(df -Pk "$(dirname "$VENV")" | awk 'NR==2 {print $4}')"
[ "${free_kb:-0}" -gt 4000000 ] || [ -f "$VENV/.ringfeed-horovod" ] \
  || die "less than 4 GB free under $(dirname "$VENV"); torch + TensorFlow + the Horovod build need about 4 GB"

# --- virtual environment and the pinned Python stack ---------------------------------------
if [ ! -x "$VENV/bin/python" ]; then
  say "creating $VENV ($PYTHON)"
  "$PYTHON" -m venv "$VENV" || die "could not create a virtual environment at $VENV (Debian: apt-get install python3.11-venv)"
fi
PY="$VENV/bin/python"

# --- GPU or CPU build of Horovod's collective ops ------------------------------------------
gpu="${HOROVOD_GPU_OPERATIONS:-}"
if [ -z "$gpu" ] && command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L 2>/dev/null | grep -q '^GPU'; then
  gpu=NCCL
  say "nvidia-smi lists a GPU: building Horovod with NCCL (HOROVOD_GPU_OPERATIONS=none for a CPU build)"
fi
case "$gpu" in ""|none|cpu|CPU) gpu=cpu ;; NCCL) ;; *) die "HOROVOD_GPU_OPERATIONS=$gpu: ringfeed builds NCCL or none" ;; esac

deps_key="$(sha256sum <"$ROOT/pyproject.toml" | cut -c1-16)-$EXTRAS-$EDITABLE-${TORCH_INDEX_URL:-}"
if [ "$(cat "$VENV/.ringfeed-deps" 2>/dev/null)" != "$deps_key" ]; then
  log="$VENV/pip-install.log"
  say "installing the pinned Python stack [$EXTRAS] (log: $log)"
  target="${ROOT}[${EXTRAS}]"
  if [ "$EDITABLE" = "1" ]; then set -- -e "$target"; else set -- "$target"; fi
  if [ -n "${TORCH_INDEX_URL:-}" ]; then
    # torch's pin, from the given index (its CUDA builds are not on PyPI's default index)
    torch_pin="$(grep -o 'torch==[0-9.]*' "$ROOT/pyproject.toml" | head -n1)"
    "$PY" -m pip install --disable-pip-version-check -q "$torch_pin" --index-url "$TORCH_INDEX_URL" >"$log" 2>&1 \
      || die "installing $torch_pin from $TORCH_INDEX_URL failed: $(grep -m1 -E '^ERROR' "$log" || tail -n1 "$log") (full log: $log)"
  fi
  if ! "$PY" -m pip install --disable-pip-version-check -q "$@" >"$log" 2>&1; then
    die "pip install failed: $(grep -m1 -E '^ERROR' "$log" || tail -n1 "$log") (full log: $log)"
  fi
  echo "$deps_key" >"$VENV/.ringfeed-deps"
fi

# --- Horovod, built once per (horovod, torch, tf, python, controllers) and cached ----------
read -r torch_v tf_v <<<"$("$PY" - <<'PYEOF'
from importlib.metadata import version, PackageNotFoundError
def v(*names):
    for n in names:
        try:
            return version(n)
        except PackageNotFoundError:
            pass
    return "none"
print(v("torch"), v("tensorflow-cpu", "tensorflow"))
PYEOF
)"
if command -v mpicxx >/dev/null 2>&1; then mpi=mpi; else mpi=nompi; fi
gpu_env=()
if [ "$gpu" = NCCL ]; then
  "$PY" -c 'import sys, torch; sys.exit(torch.version.cuda is None)' 2>/dev/null \
    || die "torch $torch_v in $VENV is not a CUDA build; for a GPU host: TORCH_INDEX_URL=https://download.pytorch.org/whl/cu130 make setup (or HOROVOD_GPU_OPERATIONS=none for a CPU build)"
  found="$("$PY" "$HERE/gpu_build.py" --nccl-link-dir "$CACHE/nccl")" || exit 1
  mapfile -t gpu_env <<<"$found"
  cc="$(printf '%s\n' "${gpu_env[@]}" | sed -n 's/^HOROVOD_BUILD_CUDA_CC_LIST=//p' | tr , _)"
  gpu="nccl-cc$cc"
  say "GPU build: $(printf '%s ' "${gpu_env[@]}")"
fi
# (a change to patch_horovod.py is a different build)
patches="$(cksum <"$HERE/patch_horovod.py" | cut -c1-8)"
hvd_key="horovod${HOROVOD_VERSION}-torch${torch_v}-tf${tf_v}-py${pyver}-${mpi}-${gpu}-p${patches}"

# Horovod's sdist, kept: the wheel is built from it, the patch tests read it, and a GPU machine
# without network gets it from here (make gpu-kit).
sdist="$CACHE/src/horovod-$HOROVOD_VERSION.tar.gz"
if [ ! -f "$sdist" ]; then
  mkdir -p "$CACHE/src"
  dl="$(mktemp -d "${TMPDIR:-/tmp}/ringfeed-sdist.XXXXXX")"
  if "$PY" -m pip download -q --no-deps --no-binary :all: -d "$dl" "horovod==$HOROVOD_VERSION" >/dev/null 2>&1; then
    mv "$dl/horovod-$HOROVOD_VERSION.tar.gz" "$sdist.tmp" && mv "$sdist.tmp" "$sdist"
  else
    say "could not download Horovod $HOROVOD_VERSION's sdist (only needed for a build)"
  fi
  rm -rf "$dl"
fi
if [ "$(cat "$VENV/.ringfeed-horovod" 2>/dev/null)" = "$hvd_key" ] && "$PY" -c "import horovod" 2>/dev/null; then
  say "ready ($hvd_key)"
  exit 0
fi

wheel_dir="$CACHE/wheels/$hvd_key"
wheel="$(find "$wheel_dir" -maxdepth 1 -name 'horovod-*.whl' -print -quit 2>/dev/null || true)"
if [ -z "$wheel" ]; then
  if [ "$mpi" = nompi ]; then
    say "mpicxx not found: building Horovod with Gloo only (for MPI: apt-get install libopenmpi-dev openmpi-bin, then make setup again)"
  fi
  # CMake 4 rejects the vendored gloo's cmake_minimum_required(VERSION 2.8) unless told which
  # policies to assume; older than 3.13 is too old for Horovod: then a 3.x one from PyPI.
  export CMAKE_POLICY_VERSION_MINIMUM=3.5
  cmake_v="$(cmake --version 2>/dev/null | awk 'NR==1 {print $3}')"
  case "$cmake_v" in
    3.1[3-9]*|3.[2-9]*|[4-9].*) ;;
    *) say "system CMake '${cmake_v:-none}' unusable for Horovod; installing cmake<4 into $VENV"
       "$PY" -m pip install -q "cmake>=3.13,<4" >/dev/null 2>&1 || die "could not install cmake<4 from PyPI"
       export HOROVOD_CMAKE="$VENV/bin/cmake" ;;
  esac
  if [ "$mpi" = mpi ]; then mpi_flag=HOROVOD_WITH_MPI=1; else mpi_flag=HOROVOD_WITHOUT_MPI=1; fi
  if [ "$tf_v" = none ]; then tf_flag=HOROVOD_WITHOUT_TENSORFLOW=1; else tf_flag=HOROVOD_WITH_TENSORFLOW=1; fi
  [ -f "$sdist" ] || die "no Horovod $HOROVOD_VERSION sdist at $sdist and none could be downloaded (no network? copy it there)"
  # Horovod's setup.py imports cffi at build time and, without it, asks pip (no network: fails)
  "$PY" -c "import cffi" 2>/dev/null || "$PY" -m pip install -q cffi >/dev/null 2>&1 \
    || die "Horovod's build needs cffi: pip install cffi into $VENV"
  build="$(mktemp -d "${TMPDIR:-/tmp}/ringfeed-horovod.XXXXXX")"
  log="$CACHE/horovod-build.log"
  say "building Horovod $HOROVOD_VERSION ($hvd_key): about 4 minutes on 2 cores (log: $log)"
  {
    tar -xzf "$sdist" -C "$build" &&
    "$PY" "$HERE/patch_horovod.py" "$build/horovod-$HOROVOD_VERSION" &&
    env HOROVOD_WITH_PYTORCH=1 "$tf_flag" HOROVOD_WITHOUT_MXNET=1 HOROVOD_WITH_GLOO=1 \
      "$mpi_flag" "${gpu_env[@]}" MAKEFLAGS="${MAKEFLAGS:--j$(nproc)}" \
      "$PY" -m pip wheel --no-build-isolation --no-deps -w "$build/dist" "$build/horovod-$HOROVOD_VERSION"
  } >"$log" 2>&1 || die "Horovod build failed: $(grep -m1 -E 'error:|Error' "$log" || tail -n1 "$log") (full log: $log)"
  mkdir -p "$wheel_dir"
  built="$(find "$build/dist" -maxdepth 1 -name 'horovod-*.whl' -print -quit)"
  cp "$built" "$wheel_dir/.tmp.whl" && mv "$wheel_dir/.tmp.whl" "$wheel_dir/$(basename "$built")"
  wheel="$wheel_dir/$(basename "$built")"
  rm -rf "$build"
else
  say "using cached Horovod wheel $wheel"
fi
"$PY" -m pip install -q --no-deps --force-reinstall "$wheel" >"$VENV/horovod-install.log" 2>&1 \
  || die "installing $wheel failed (log: $VENV/horovod-install.log)"
if [ "$tf_v" = none ]; then imports="import horovod.torch"; else imports="import horovod.torch, horovod.tensorflow"; fi
"$PY" -c "$imports" >"$VENV/horovod-import.log" 2>&1 \
  || die "Horovod installed but does not import: $(tail -n1 "$VENV/horovod-import.log") (log: $VENV/horovod-import.log)"
# horovodrun reads these instead of forking a framework import on every launch (fix 6)
"$PY" "$HERE/patch_horovod.py" --record-probes >"$VENV/horovod-probes.log" 2>&1 \
  || die "recording Horovod's build answers failed (log: $VENV/horovod-probes.log)"
echo "$hvd_key" >"$VENV/.ringfeed-horovod"
say "ready ($hvd_key)"

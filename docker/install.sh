#!/usr/bin/env bash
# ringfeed's one installer: `make setup` and the Docker images both run it.
#   docker/install.sh VENV_DIR
# Env: PYTHON (python3.11), EXTRAS (torch,tf-cpu,test), RINGFEED_EDITABLE (1),
#      RINGFEED_CACHE (~/.cache/ringfeed: built Horovod wheels, keyed by versions),
#      HOROVOD_GPU_OPERATIONS (e.g. NCCL, for GPU images).
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
[ "$pyver" = "3.11" ] || die "$PYTHON is Python $pyver; ringfeed needs 3.11 (set PYTHON=/path/to/python3.11)"
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
deps_key="$(sha256sum <"$ROOT/pyproject.toml" | cut -c1-16)-$EXTRAS-$EDITABLE"
if [ "$(cat "$VENV/.ringfeed-deps" 2>/dev/null)" != "$deps_key" ]; then
  log="$VENV/pip-install.log"
  say "installing the pinned Python stack [$EXTRAS] (log: $log)"
  target="${ROOT}[${EXTRAS}]"
  if [ "$EDITABLE" = "1" ]; then set -- -e "$target"; else set -- "$target"; fi
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
gpu="${HOROVOD_GPU_OPERATIONS:-cpu}"
hvd_key="horovod${HOROVOD_VERSION}-torch${torch_v}-tf${tf_v}-py${pyver}-${mpi}-${gpu}"
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
  # CMake 4 rejects the vendored gloo's cmake_minimum_required; use a 3.x one.
  cmake_v="$(cmake --version 2>/dev/null | awk 'NR==1 {print $3}')"
  case "$cmake_v" in
    3.1[3-9]*|3.[2-9]*) ;;
    *) say "system CMake '${cmake_v:-none}' unusable for Horovod; installing cmake<4 into $VENV"
       "$PY" -m pip install -q "cmake>=3.13,<4" >/dev/null 2>&1 || die "could not install cmake<4 from PyPI"
       export HOROVOD_CMAKE="$VENV/bin/cmake" ;;
  esac
  if [ "$mpi" = mpi ]; then mpi_flag=HOROVOD_WITH_MPI=1; else mpi_flag=HOROVOD_WITHOUT_MPI=1; fi
  build="$(mktemp -d "${TMPDIR:-/tmp}/ringfeed-horovod.XXXXXX")"
  log="$CACHE/horovod-build.log"
  say "building Horovod $HOROVOD_VERSION ($hvd_key): about 4 minutes on 2 cores (log: $log)"
  {
    "$PY" -m pip download --no-deps --no-binary :all: -d "$build" "horovod==$HOROVOD_VERSION" &&
    tar -xzf "$build/horovod-$HOROVOD_VERSION.tar.gz" -C "$build" &&
    "$PY" "$HERE/patch_horovod.py" "$build/horovod-$HOROVOD_VERSION" &&
    env HOROVOD_WITH_PYTORCH=1 HOROVOD_WITH_TENSORFLOW=1 HOROVOD_WITHOUT_MXNET=1 HOROVOD_WITH_GLOO=1 \
      "$mpi_flag" MAKEFLAGS="${MAKEFLAGS:--j$(nproc)}" \
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
"$PY" -c "import horovod.torch, horovod.tensorflow" >"$VENV/horovod-import.log" 2>&1 \
  || die "Horovod installed but does not import: $(tail -n1 "$VENV/horovod-import.log") (log: $VENV/horovod-import.log)"
echo "$hvd_key" >"$VENV/.ringfeed-horovod"
say "ready ($hvd_key)"

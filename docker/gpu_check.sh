#!/usr/bin/env bash
# `make gpu-check`: is ringfeed ready on this GPU machine? Needs only PyTorch with CUDA, a C++
# compiler and nvcc; without network it takes its packages from .gpu/ (`make gpu-kit` on a machine
# with network). Each step prints PASS/FAIL; the summary goes to stdout and $REPORT_DIR.
#   1. Horovod with NCCL: a cached wheel (.gpu/wheels/, $RINGFEED_CACHE) or built once (~2 min
#      on 16 cores; the wheel is kept, and split into <16 MiB parts under $REPORT_DIR/wheel/)
#   2. `ringfeed info` lists NCCL
#   3. the GPU feeding benchmark -> benchmarks/results/gpu.json and the table in
#      benchmarks/README.md (device named); first, as the measurement a lease is for
#   4. the digits demo on one GPU in fp32, bf16 and fp16 (val accuracy >= 0.95 each), and with
#      train.channels_last + train.compile; each reports its MFU; the bf16 run's profile
#      (train.profile in the demo config) must hold GPU kernels
#   5. more ranks than GPUs: one line, exit 2
# (TensorBoard is not among the packages carried: the runs here set output.tensorboard=false.)
# `bash docker/gpu_check.sh feed-s3` (or GPU_CHECK_ONLY=feed-s3): only step 3 with its S3 rows
# (issue 36: gpu_feed_bench.py --s3, moto's S3 server behind tests/s3_proxy.py), no Horovod, no
# demo: installs .gpu/whl + .gpu/whl-s3 (make gpu-kit) into $RINGFEED_CACHE/gpu-site-s3, writes
# $REPORT_DIR/gpu_s3.json, gpu_s3_table.md, gpu_feed_bench_s3.log and the S3 server's log, and
# prints the table; benchmarks/README.md is left as it is. Runs --compile off --no-small-model
# (GPU_FEED_ARGS come after them, e.g. "--workers 8 --compile on").
# Env: PYTHON (python3), REPORT_DIR (default $OUT when set, else gpu-check-out), GPU_CHECK_QUICK=1
# (short benchmark), GPU_FEED_ARGS (more gpu_feed_bench.py arguments, e.g. "--workers 8,16"),
# RINGFEED_CACHE.
set -uo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(dirname "$HERE")"
cd "$ROOT" || exit 1
PY="${PYTHON:-python3}"
KIT="$ROOT/.gpu"
CACHE="${RINGFEED_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/ringfeed}"
REPORT="${REPORT_DIR:-${OUT:-$ROOT/gpu-check-out}}"
SITE="$CACHE/gpu-site"
mkdir -p "$REPORT" "$CACHE/wheels"
LOG="$REPORT/gpu-check.log"
: >"$LOG"
failures=0
say() { echo "gpu-check: $*" | tee -a "$LOG"; }
die() { say "FAIL: $*"; exit 1; }
result() {  # result NAME OK DETAIL
  if [ "$2" = 0 ]; then say "PASS $1: $3"; else say "FAIL $1: $3"; failures=$((failures + 1)); fi
}

# --- 0. the machine ---------------------------------------------------------------------------
command -v nvidia-smi >/dev/null 2>&1 || die "nvidia-smi not found: this is not a GPU machine"
ngpu="$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')"
[ "$ngpu" -gt 0 ] || die "nvidia-smi lists no GPU"
"$PY" -c "import torch, sys; sys.exit(not torch.cuda.is_available())" 2>>"$LOG" \
  || die "$PY's torch sees no GPU (torch.version.cuda: $("$PY" -c 'import torch; print(torch.version.cuda)' 2>&1)): install torch's CUDA build"
say "$(nvidia-smi --query-gpu=name,driver_version,compute_cap --format=csv,noheader | head -n1), $ngpu GPU(s); $("$PY" -c 'import sys, torch; print(f"Python {sys.version.split()[0]}, torch {torch.__version__}, CUDA {torch.version.cuda}")')"

MODE="${1:-${GPU_CHECK_ONLY:-all}}"
case "$MODE" in
  all | feed-s3) ;;
  *) die "unknown mode '$MODE' (none for every check, or feed-s3)" ;;
esac

# --- feed-s3: the feeding benchmark with its S3 rows, nothing else ---------------------------
if [ "$MODE" = feed-s3 ]; then
  SRC="$CACHE/gpu-src"
  bash "$HERE/ringfeed_links.sh" "$SRC" || die "cannot link this checkout as a package in $SRC"
  SITE="$CACHE/gpu-site-s3"
  export PYTHONPATH="$SRC:$SITE${PYTHONPATH:+:$PYTHONPATH}"
  needs="import webdataset, pydantic, yaml, simplejpeg, fsspec, moto.server, flask, boto3, s3fs, aiohttp"
  if ! "$PY" -c "$needs" 2>/dev/null; then
    ls "$KIT"/whl/*.whl "$KIT"/whl-s3/*.whl >/dev/null 2>&1 \
      || die "no wheels in .gpu/whl and .gpu/whl-s3: run make gpu-kit where there is network and bring .gpu/"
    rm -rf "$SITE"
    started=$SECONDS
    "$PY" -m pip install -q --no-index --no-deps --target "$SITE" "$KIT"/whl/*.whl \
      "$KIT"/whl-s3/*.whl >>"$LOG" 2>&1 || die "installing .gpu/whl + .gpu/whl-s3 into $SITE failed (log: $LOG)"
    say "installed .gpu/whl + .gpu/whl-s3 into $SITE in $((SECONDS - started)) s"
  fi
  "$PY" -c "$needs" 2>>"$LOG" || die "still missing after the install: $(tail -n1 "$LOG")"
  quick=(); [ "${GPU_CHECK_QUICK:-0}" = 1 ] && quick=(--quick)
  read -ra extra <<<"${GPU_FEED_ARGS:-}"
  out="$REPORT/gpu_s3.json"
  started=$SECONDS
  "$PY" benchmarks/gpu_feed_bench.py --device cuda --s3 --compile off --no-small-model \
    --out "$out" "${quick[@]}" "${extra[@]}" 2>&1 | tee "$REPORT/gpu_feed_bench_s3.log"
  rc=${PIPESTATUS[0]}
  if [ -f "$out" ]; then
    "$PY" -c "import json, sys; print(json.load(open(sys.argv[1]))['table_md'])" "$out" \
      >"$REPORT/gpu_s3_table.md" 2>>"$LOG"
  fi
  result "feeding-bench-s3" "$rc" "exit $rc in $((SECONDS - started)) s; $out, $REPORT/gpu_s3_table.md (log $REPORT/gpu_feed_bench_s3.log)"
  say "$failures check(s) failed; report in $REPORT"
  [ "$failures" = 0 ]
  exit
fi

# --- 1. Python packages and Horovod with NCCL -------------------------------------------------
# this checkout as the installed package would be (links; the repository root alone is not
# importable as ringfeed)
SRC="$CACHE/gpu-src"
bash "$HERE/ringfeed_links.sh" "$SRC" || die "cannot link this checkout as a package in $SRC"
export PYTHONPATH="$SRC:$SITE${PYTHONPATH:+:$PYTHONPATH}"
export PATH="$SITE/bin:$PATH"
hvd_nccl() { "$PY" -c "import sys, horovod.torch as h; sys.exit(not h.nccl_built())" 2>/dev/null; }
torch_v="$("$PY" -c 'import torch; print(torch.__version__)')"
pyver="$("$PY" -c 'import sys; print("%d.%d" % sys.version_info[:2])')"
cc="$("$PY" -c 'import torch; print("".join(map(str, torch.cuda.get_device_capability())))')"
wheel_dir="$CACHE/wheels/horovod0.28.1-torch${torch_v}-tfnone-py${pyver}-nompi-nccl-cc${cc}"

if ! "$PY" -c "import webdataset, pydantic, yaml, simplejpeg, fsspec" 2>/dev/null || ! hvd_nccl; then
  wheel="$(find "$wheel_dir" "$KIT/wheels" -maxdepth 1 -name 'horovod-*.whl' -print -quit 2>/dev/null)"
  if [ -z "$wheel" ] && ls "$KIT"/wheels/hvdwhl.part.* >/dev/null 2>&1; then
    mkdir -p "$wheel_dir"  # parts brought back by an earlier run: one wheel again
    cat "$KIT"/wheels/hvdwhl.part.* >"$wheel_dir/.tmp.whl"
    name="$(cat "$KIT/wheels/WHEEL_NAME" 2>/dev/null || echo "horovod-0.28.1-cp${pyver/./}-cp${pyver/./}-linux_x86_64.whl")"
    mv "$wheel_dir/.tmp.whl" "$wheel_dir/$name" && wheel="$wheel_dir/$name"
  fi
  if [ -z "$wheel" ]; then
    [ -f "$KIT/horovod-0.28.1.tar.gz" ] || [ -f "$CACHE/src/horovod-0.28.1.tar.gz" ] \
      || die "no Horovod wheel or sdist: run make gpu-kit where there is network and bring .gpu/"
    sdist="$KIT/horovod-0.28.1.tar.gz"; [ -f "$sdist" ] || sdist="$CACHE/src/horovod-0.28.1.tar.gz"
    build="$(mktemp -d)"
    # cffi for Horovod's setup.py, where the build can import it
    "$PY" -m pip install -q --no-index --no-deps --target "$build/tools" "$KIT"/whl/cffi-*.whl \
      "$KIT"/whl/pycparser-*.whl >>"$LOG" 2>&1 || "$PY" -c "import cffi" 2>/dev/null \
      || die "Horovod's build needs cffi: none in .gpu/whl and none installed"
    found="$(PYTHONPATH="$build/tools" "$PY" "$HERE/gpu_build.py" --nccl-link-dir "$CACHE/nccl" 2>&1)" \
      || die "${found#setup: }"
    mapfile -t gpu_env <<<"$found"
    say "building Horovod with ${gpu_env[*]} (log: $REPORT/horovod-build.log)"
    started=$SECONDS
    if tar -xzf "$sdist" -C "$build" && "$PY" "$HERE/patch_horovod.py" "$build/horovod-0.28.1" &&
       env "${gpu_env[@]}" PYTHONPATH="$build/tools" CMAKE_POLICY_VERSION_MINIMUM=3.5 \
         MAKEFLAGS="-j$(nproc)" HOROVOD_WITH_PYTORCH=1 HOROVOD_WITHOUT_TENSORFLOW=1 \
         HOROVOD_WITHOUT_MXNET=1 HOROVOD_WITH_GLOO=1 HOROVOD_WITHOUT_MPI=1 \
         "$PY" -m pip wheel --no-build-isolation --no-deps -w "$build/dist" \
         "$build/horovod-0.28.1" >"$REPORT/horovod-build.log" 2>&1; then
      built="$(find "$build/dist" -name 'horovod-*.whl' -print -quit)"
      mkdir -p "$wheel_dir" && cp "$built" "$wheel_dir/" && wheel="$wheel_dir/$(basename "$built")"
      say "built $(basename "$built") in $((SECONDS - started)) s"
      mkdir -p "$REPORT/wheel"  # to bring back (parts < 16 MiB), for a fresh machine next time
      (cd "$REPORT/wheel" && split -b 15m "$wheel" hvdwhl.part. && basename "$wheel" >WHEEL_NAME)
    else
      # not fatal: the feeding benchmark needs no Horovod (its small-model table says so)
      say "FAIL: Horovod build failed: $(grep -m1 -E 'error:|Error' "$REPORT/horovod-build.log") (log: $REPORT/horovod-build.log)"
    fi
    rm -rf "$build"
  fi
  # one --target install for all (a second one into the same folder skips bin/: no horovodrun)
  rm -rf "$SITE"
  "$PY" -m pip install -q --no-index --no-deps --target "$SITE" "$KIT"/whl/*.whl ${wheel:+"$wheel"} \
    >>"$LOG" 2>&1 || die "installing .gpu/whl ${wheel} into $SITE failed (log: $LOG)"
fi
hvd_nccl; result "horovod-nccl" $? "horovod.torch.nccl_built()"

# --- 2. ringfeed info -------------------------------------------------------------------------
"$PY" -m ringfeed.train info >"$REPORT/info.txt" 2>&1
grep -q '\[X\] NCCL' "$REPORT/info.txt"; result "info" $? "ringfeed info lists NCCL ($REPORT/info.txt)"

# --- 3. the GPU feeding benchmark -------------------------------------------------------------
# first: the measurement is what a short GPU lease is for; the checks below are quick
quick=(); [ "${GPU_CHECK_QUICK:-0}" = 1 ] && quick=(--quick)
read -ra extra <<<"${GPU_FEED_ARGS:-}"
# (pipefail: the benchmark's own exit status; its progress shown as it goes)
if "$PY" benchmarks/gpu_feed_bench.py --device cuda --out benchmarks/results/gpu.json "${quick[@]}" "${extra[@]}" \
     2>&1 | tee "$REPORT/gpu_feed_bench.log"; then
  "$PY" - <<'EOF' >>"$LOG" 2>&1
import json, re
from pathlib import Path
table = json.loads(Path("benchmarks/results/gpu.json").read_text())["table_md"].strip()
readme = Path("benchmarks/README.md")
text = readme.read_text()
new = re.sub(r"<!-- gpu-table -->.*?<!-- /gpu-table -->",
             lambda _: f"<!-- gpu-table -->\n{table}\n<!-- /gpu-table -->", text, flags=re.S)
tmp = readme.with_suffix(".md.tmp")
tmp.write_text(new)
tmp.replace(readme)
EOF
  cp benchmarks/results/gpu.json benchmarks/README.md "$REPORT/" 2>/dev/null
  result "feeding-bench" 0 "benchmarks/results/gpu.json, table in benchmarks/README.md"
  tail -n 30 "$REPORT/gpu_feed_bench.log" >>"$LOG"
else
  result "feeding-bench" 1 "$(tail -n1 "$REPORT/gpu_feed_bench.log") (log $REPORT/gpu_feed_bench.log)"
fi

# --- 4. the digits demo on the GPU ------------------------------------------------------------
shards="$KIT/data/digits-shards"
[ -f "$shards/manifest.json" ] || shards="$ROOT/demo-out/digits-shards"
accuracy() { "$PY" -c "import json, sys; print(json.load(open(sys.argv[1]))['val']['accuracy'])" "$1/summary.json" 2>/dev/null; }
# "MFU 1.2% (peak source), FLOP/sample, samples/s, first step s" from a run's summary.json
compute() { "$PY" - "$1/summary.json" <<'EOF' 2>/dev/null
import json, sys
s = json.load(open(sys.argv[1]))
t = s.get("throughput") or {}
mfu = f"MFU {100 * t['mfu']:.2f}%" if t.get("mfu") is not None else "no MFU"
print(f"{mfu} ({t.get('peak_source')}), {t.get('flops_per_sample') or 0:.3g} FLOP/sample, "
      f"{s['samples_per_s']:.0f} samples/s, first step {s['first_step_s']:.1f} s")
EOF
}
digits() {  # digits NAME SET...
  local name="$1"; shift
  local run="$REPORT/runs/digits-$name"
  rm -rf "$run"
  timeout 300 horovodrun -np 1 "$PY" -m ringfeed.train train examples/configs/digits.yaml --set "data.train=$shards" \
    --set "output.dir=$run" --set data.cache_dir="$CACHE/data" --set output.tensorboard=false \
    "$@" >"$REPORT/digits-$name.log" 2>&1
  local rc=$? acc
  acc="$(accuracy "$run")"
  "$PY" -c "import sys; sys.exit(not ($rc == 0 and float('${acc:-0}') >= 0.95))"
  result "digits-$name" $? "exit $rc, val accuracy ${acc:-none} (>= 0.95); $(compute "$run") (log $REPORT/digits-$name.log)"
}
# the torch profiler's trace of a run (train.profile) holds CUDA kernels, not only CPU ops
gpu_trace() {
  "$PY" - "$1/profile" <<'EOF'
import json, sys
from pathlib import Path
traces = sorted(Path(sys.argv[1]).glob("rank0/*.pt.trace.json"))
if not traces:
    sys.exit(f"no rank0/*.pt.trace.json under {sys.argv[1]}")
events = json.loads(traces[0].read_text())["traceEvents"]
kernels = sum(1 for e in events if e.get("cat") == "kernel")
ranges = sorted({e["name"] for e in events if e.get("cat") == "user_annotation"})
timeline = (Path(sys.argv[1]) / "horovod_timeline.json").exists()
print(f"{kernels} GPU kernels, named ranges {ranges[:6]}, Horovod timeline {timeline}")
sys.exit(0 if kernels > 0 and timeline else 1)
EOF
}
if [ -f "$shards/manifest.json" ]; then
  digits fp32 --set train.precision=fp32
  digits bf16 --set train.precision=bf16
  digits fp16 --set train.precision=fp16
  detail="$(gpu_trace "$REPORT/runs/digits-bf16" 2>&1)"
  result "profile-gpu" $? "bf16 run's train.profile trace: $detail"
  digits compile-channels-last --set train.precision=bf16 --set train.channels_last=true \
    --set train.compile=true
else
  result "digits" 1 "no digits shards (make gpu-kit makes .gpu/data/digits-shards)"
fi

# --- 5. more ranks than GPUs ------------------------------------------------------------------
if [ -f "$shards/manifest.json" ]; then
  timeout 120 horovodrun -np $((ngpu + 1)) "$PY" -m ringfeed.train train examples/configs/digits.yaml \
    --set "data.train=$shards" --set "output.dir=$REPORT/runs/oversubscribed" \
    --set train.max_steps=2 --set output.tensorboard=false >"$REPORT/oversubscribed.log" 2>&1
  rc=$?
  grep -q "ranks on one host share $ngpu visible GPU" "$REPORT/oversubscribed.log"
  found=$?
  ok=1; [ "$rc" -ne 0 ] && [ "$found" = 0 ] && ok=0
  result "ranks>gpus" "$ok" "-np $((ngpu + 1)) on $ngpu GPU(s): exit $rc, $(grep -m1 -o 'error: .*' "$REPORT/oversubscribed.log" | head -c 200)"
fi

say "$failures check(s) failed; report in $REPORT"
[ "$failures" = 0 ]

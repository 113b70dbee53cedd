#!/usr/bin/env bash
# `make image-check`: build ringfeed:cpu from docker/Dockerfile.cpu with podman and run it for
# real; then the nearest real checks of the recipes whose bases cannot be had here
# (Dockerfile.gpu, apptainer.def). Slow (a cold run took 24 minutes on 2 cores), run by hand.
#
#   docker/image_check.sh [cpu] [gpu-recipe] [apptainer-recipe]     (default: all three)
#
# cpu:  - podman and runc (debootstrap, podman-compose, iproute2 when needed) installed with
#         apt-get when root and missing; a container runtime found that starts containers here
#         (the machine's settings, else default_ulimits = [], else also runc: CONTAINERS_CONF);
#       - the Dockerfile's base image pulled, or, where no registry is reachable, a stand-in
#         made with debootstrap (Debian bookworm + python3, -venv, -pip, -dev) and imported,
#         kept as a local image between runs (podman keeps the build's layers too);
#       - the build, from a snapshot of what the .dockerignore lets through: podman build
#         --format docker (buildah ignores SHELL otherwise); RUN steps reach the package indexes
#         the way this host does (--network host, the host's pip configuration, the local
#         folders it names and its CA bundle as read-only mounts); PyTorch's index replaced
#         through the PIP_EXTRA_INDEX_URL build argument when it cannot be reached. The builder
#         stage is built with those mounts, the image from the cached builder without them;
#       - `ringfeed info` as uid 1000; no pip settings and no keys in the image;
#       - horovodrun --mpi -np 2 in one container: tests/scripts/hvd_smoke.py, checked exactly;
#       - examples/demo.py (`make demo`: shard, then torch and TensorFlow on 2 Horovod ranks, val
#         accuracy >= 0.95 each) in one container;
#       - two containers as two hosts (the entry point's sshd, one job key, `horovodrun -H
#         node1:1,node2:1 -p 2222`): hvd_smoke.py with --gloo and with --mpi, checked exactly,
#         then `ringfeed train` of the digits config to >= 0.95. Network: a podman bridge
#         network, or (IMAGE_CHECK_NET=netns, or where the bridge does not work) two network
#         namespaces joined by a veth pair, `podman run --network ns:/run/netns/NAME`;
#       - docker/docker-compose.yml itself, with podman-compose, to >= 0.95.
# gpu-recipe, apptainer-recipe: see the functions of those names below.
#
# Env: IMAGE_CHECK_DIR (/var/tmp/ringfeed-image-check: logs, stand-in rootfs, demo files),
#      IMAGE_CHECK_MIRROR (Debian mirror for debootstrap; default: the one this host's apt uses),
#      IMAGE_CHECK_NET (auto | bridge | netns), IMAGE_CHECK_TAG (ringfeed:cpu).
# Exit status: 0 when every check passed; the summary names each check and its result.
set -euo pipefail
# The whole script is one { } block, read before it runs: editing the file meanwhile is safe.
{
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
WORK="${IMAGE_CHECK_DIR:-/var/tmp/ringfeed-image-check}"
LOGS="$WORK/logs"
TAG="${IMAGE_CHECK_TAG:-ringfeed:cpu}"
STANDIN="localhost/ringfeed-check-base:bookworm"
NET_MODE="${IMAGE_CHECK_NET:-auto}"
NODE_PREFIX="ringfeed-check"
UID_IN_IMAGE=1000
CONTAINERS_CONF_FILE="$WORK/containers.conf"

SECTIONS=("$@")
[ ${#SECTIONS[@]} -gt 0 ] || SECTIONS=(cpu gpu-recipe apptainer-recipe)

RESULTS=()   # "PASS|FAIL|INFO<TAB>name<TAB>detail"
FAILED=0
START_ALL=$SECONDS

say() { echo "image-check: $*"; }
record() {  # STATUS NAME DETAIL
  RESULTS+=("$1	$2	$3")
  [ "$1" != FAIL ] || FAILED=$((FAILED + 1))
  say "$1 $2: $3"
}
die() { record FAIL "$1" "$2"; summary; exit 1; }
tail_log() { echo "---- last lines of $1"; tail -n "${2:-25}" "$1" | sed 's/^/    /'; echo "----"; }
wanted() { local s; for s in "${SECTIONS[@]}"; do [ "$s" = "$1" ] && return 0; done; return 1; }
human() { awk -v b="$1" 'BEGIN { if (b >= 1e9) printf "%.2f GB", b / 1e9; else printf "%.0f MB", b / 1e6 }'; }

summary() {
  local line status name detail
  echo
  echo "== image-check summary ($(date -u +%Y-%m-%dT%H:%MZ), $((SECONDS - START_ALL)) s in all)"
  for line in "${RESULTS[@]}"; do
    IFS=$'\t' read -r status name detail <<<"$line"
    printf '  %-4s  %-24s %s\n' "$status" "$name" "$detail"
  done
  if [ "$FAILED" -eq 0 ]; then echo "image-check: all checks passed"; else echo "image-check: $FAILED check(s) FAILED (logs: $LOGS)"; fi
}

cleanup() {
  local name
  for name in node1 node2 demo apptainer; do
    podman rm -f -t 0 "$NODE_PREFIX-$name" >/dev/null 2>&1 || true
  done
  if [ -n "${NETNS_A:-}" ]; then ip netns del "$NETNS_A" 2>/dev/null || true; fi
  if [ -n "${NETNS_B:-}" ]; then ip netns del "$NETNS_B" 2>/dev/null || true; fi
}
trap cleanup EXIT

mkdir -p "$LOGS"

# ---- prerequisites ----------------------------------------------------------------------------
apt_install() {
  if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null 2>&1; then
    die prerequisites "$* missing; install them (Debian: apt-get install $*) or run as root"
  fi
  say "installing $* (apt-get)"
  { apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q "$@"; } \
    >"$LOGS/apt-install.log" 2>&1 || { tail_log "$LOGS/apt-install.log"; die prerequisites "apt-get install $* failed (log: $LOGS/apt-install.log)"; }
}
need=()
command -v podman >/dev/null 2>&1 || need+=(podman)
command -v runc >/dev/null 2>&1 || need+=(runc)
command -v python3 >/dev/null 2>&1 || need+=(python3)
[ ${#need[@]} -eq 0 ] || apt_install "${need[@]}"

# ---- base image ------------------------------------------------------------------------------
dockerfile_arg() {  # FILE NAME: the default of `ARG NAME=...`
  sed -n "s/^ARG $2=//p" "$1" | head -n1
}
BASE_DEFAULT="$(dockerfile_arg "$ROOT/docker/Dockerfile.cpu" PYTHON_IMAGE)"

debian_mirror() {  # the Debian mirror and security mirror this host's apt uses for bookworm
  local suite="$1"
  if [ -n "${IMAGE_CHECK_MIRROR:-}" ] && [ "$suite" = bookworm ]; then echo "$IMAGE_CHECK_MIRROR"; return; fi
  # shellcheck disable=SC2016  # apt's own $(FIELD) format, not the shell's
  apt-get indextargets --format '$(REPO_URI) $(CODENAME)' 'Identifier: Packages' 2>/dev/null \
    | awk -v s="$suite" '$2 == s { print $1; exit }'
}

debootstrap_image() {  # IMAGE INCLUDE [CHANGES...]: Debian bookworm minbase, imported as IMAGE
  local image="$1" include="$2" mirror security rootfs="$WORK/rootfs" log
  log="$LOGS/debootstrap-$(echo "${1##*/}" | tr : -).log"
  shift 2
  command -v debootstrap >/dev/null 2>&1 || apt_install debootstrap
  mirror="$(debian_mirror bookworm)"; mirror="${mirror:-http://deb.debian.org/debian/}"
  security="$(debian_mirror bookworm-security)"; security="${security:-http://deb.debian.org/debian-security/}"
  say "making $image with debootstrap from $mirror (about 1-2 minutes)"
  rm -rf "$rootfs"
  debootstrap --variant=minbase ${include:+"--include=$include"} bookworm "$rootfs" "$mirror" >"$log" 2>&1 \
    || { tail_log "$log"; die base "debootstrap failed (log: $log)"; }
  # The sources Debian's bookworm images have (bookworm, -updates, -security), from the mirror
  # this machine can reach; no package lists or .debs kept, as in those images.
  printf 'deb %s bookworm main\ndeb %s bookworm-updates main\ndeb %s bookworm-security main\n' \
    "$mirror" "$mirror" "$security" >"$rootfs/etc/apt/sources.list"
  rm -rf "$rootfs"/var/lib/apt/lists/* "$rootfs"/var/cache/apt/*.bin "$rootfs"/var/cache/apt/archives/*.deb
  local changes=() change
  for change in "$@"; do changes+=(--change "$change"); done
  tar -C "$rootfs" -c . | podman import "${changes[@]}" - "$image" >>"$log" 2>&1 \
    || { tail_log "$log"; die base "podman import failed (log: $log)"; }
  rm -rf "$rootfs"
}

base_image() {  # IMAGE STANDIN INCLUDE [CHANGES...]: echo the image to build FROM, and why
  local image="$1" standin="$2" include="$3" why
  shift 3
  if podman image exists "$image" 2>/dev/null; then
    BASE_WHY="$image (local)"; BASE_PICK="$image"; return
  fi
  if timeout 600 podman pull -q "$image" >"$LOGS/pull.log" 2>&1; then
    BASE_WHY="$image (pulled)"; BASE_PICK="$image"; return
  fi
  why="$(grep -m1 -o 'Error: .*' "$LOGS/pull.log" | sed -E 's/^.*(lookup |error )/\1/' | cut -c1-100)"
  BASE_PICK="$standin"
  if podman image exists "$standin"; then
    BASE_WHY="$standin, cached (debootstrap bookworm; $image cannot be pulled: ${why:-see $LOGS/pull.log})"
  else
    debootstrap_image "$standin" "$include" "$@"
    BASE_WHY="$standin, made now (debootstrap bookworm; $image cannot be pulled: ${why:-see $LOGS/pull.log})"
  fi
}

# python:3.11-slim-bookworm's stand-in: Debian's python3 (3.11) with venv, pip and the headers
# Horovod's build needs (the official image has them under /usr/local).
base_image "$BASE_DEFAULT" "$STANDIN" python3,python3-venv,python3-pip,python3-dev,ca-certificates \
  'ENV=LANG=C.UTF-8' 'CMD=["python3"]'
BASE="$BASE_PICK"
BASE_NOTE="$BASE_WHY"
record INFO base "$BASE_NOTE"

# ---- a runtime that starts containers here ----------------------------------------------------
# Probe the machine's own configuration first; then (containers.conf of our own, used for every
# later podman call) no default ulimits, then also runc instead of crun.
probe() { timeout 120 podman run --rm "$BASE" true >"$LOGS/runtime-probe.log" 2>&1; }
RUNTIME_NOTE="podman $(podman --version | awk '{print $3}')"
default_runtime="$(podman info --format '{{.Host.OCIRuntime.Name}}' 2>/dev/null || echo "the default runtime")"
if probe; then
  RUNTIME_NOTE="$RUNTIME_NOTE, this machine's containers.conf"
else
  first_error="$(grep -m1 -o 'Error: .*' "$LOGS/runtime-probe.log" | sed -E 's/^.*(lookup |error )/\1/' | cut -c1-100)"
  printf '[containers]\ndefault_ulimits = []\n' >"$CONTAINERS_CONF_FILE"
  export CONTAINERS_CONF="$CONTAINERS_CONF_FILE"
  if probe; then
    RUNTIME_NOTE="$RUNTIME_NOTE, default_ulimits = [] ($CONTAINERS_CONF_FILE; with the defaults: $first_error)"
  else
    second_error="$(grep -m1 -o 'Error: .*' "$LOGS/runtime-probe.log" | sed -E 's/^.*(lookup |error )/\1/' | cut -c1-100)"
    printf '[containers]\ndefault_ulimits = []\n[engine]\nruntime = "runc"\n' >"$CONTAINERS_CONF_FILE"
    probe || { tail_log "$LOGS/runtime-probe.log"; die runtime "no container starts, with crun or runc ($first_error)"; }
    RUNTIME_NOTE="$RUNTIME_NOTE, runc and default_ulimits = [] ($CONTAINERS_CONF_FILE; with the defaults: $first_error; $default_runtime with default_ulimits = []: $second_error)"
  fi
fi
record INFO runtime "$RUNTIME_NOTE, $(podman info --format '{{.Host.OCIRuntime.Name}}') runtime"

# ---- the host's pip settings for RUN steps -----------------------------------------------------
# pip inside the build reads what this host's pip reads: one merged pip.conf (the files `pip
# config list` shows, env vars on top) mounted at /etc/pip.conf, each local path it names mounted
# read-only at the same path, the CA bundle at a path of its own. Build-time mounts only.
HOST_MOUNTS=()
BUILD_ARGS=()
pip_settings() {
  local out="$WORK/host-pip" line
  rm -rf "$out"; mkdir -p "$out"
  python3 - "$out" <<'PYEOF' || return 1
import ast, configparser, os, subprocess, sys
out = sys.argv[1]
listed = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True,
                        text=True).stdout
files, env = {}, {}
for line in listed.splitlines():
    key, _, value = line.partition("=")
    if not value:
        continue
    section, _, name = key.rpartition(".")
    value = ast.literal_eval(value)
    (env if section == ":env:" else files)[(section if section != ":env:" else "global", name)] = value
merged = {**files, **env}               # pip: environment variables override config files
config = configparser.ConfigParser(interpolation=None)
mounts = []
def local(path):
    path = path[len("file://"):] if path.startswith("file://") else path
    return path if path.startswith("/") and os.path.exists(path) else None
for (section, name), value in sorted(merged.items()):
    if name in ("cert", "client-cert") and local(value):
        mounts.append((local(value), f"/usr/local/share/ringfeed-check-host-{name}.pem"))
        value = mounts[-1][1]
    else:
        for word in value.split():
            path = local(word)
            if path:
                # a wheel index's pages link to files beside it (../../files/...): its parent
                if path.rstrip("/").endswith("/simple"):
                    path = os.path.dirname(path.rstrip("/"))
                mounts.append((path, path))
    if not config.has_section(section):
        config.add_section(section)
    config.set(section, name, value)
with open(os.path.join(out, "pip.conf"), "w") as f:
    config.write(f)
with open(os.path.join(out, "mounts"), "w") as f:
    for host, inside in dict.fromkeys(mounts):
        f.write(f"{host}\t{inside}\n")
with open(os.path.join(out, "extra-index-url"), "w") as f:
    f.write(merged.get(("global", "extra-index-url"), ""))
PYEOF
  HOST_MOUNTS=(-v "$out/pip.conf:/etc/pip.conf:ro")
  while IFS=$'\t' read -r host inside; do
    [ -n "$host" ] && HOST_MOUNTS+=(-v "$host:$inside:ro")
  done <"$out/mounts"
  # The Dockerfile's PyTorch index, where it cannot be reached, replaced by this host's extra
  # index (empty: none), a build argument that lives in the builder stage only.
  local index
  index="$(dockerfile_arg "$ROOT/docker/Dockerfile.cpu" PIP_EXTRA_INDEX_URL)"
  if python3 -c "import sys, urllib.request; urllib.request.urlopen(sys.argv[1], timeout=15)" "$index/" >/dev/null 2>&1; then
    INDEX_NOTE="PyTorch index $index reachable, kept"
    TORCH_CPU_INDEX="$index"
  else
    TORCH_CPU_INDEX="$(cat "$out/extra-index-url")"
    BUILD_ARGS+=(--build-arg "PIP_EXTRA_INDEX_URL=$TORCH_CPU_INDEX")
    INDEX_NOTE="PyTorch index $index unreachable: PIP_EXTRA_INDEX_URL='$(cat "$out/extra-index-url")' (this host's)"
  fi
  line="$(cut -f1 "$out/mounts" | tr '\n' ' ')"
  record INFO "pip settings" "$INDEX_NOTE; mounted read-only for RUN steps: merged pip.conf ${line:+$line}"
}

# ---- build -----------------------------------------------------------------------------------
BUILD_COMMON=(--format docker --network host --layers)

# The build context: a snapshot of what the .dockerignore lets through (what `docker build`
# would send), taken once, so both builds see the same files while the checkout changes.
snapshot_context() {
  local ctx="$WORK/context" entry
  rm -rf "$ctx"; mkdir -p "$ctx/docker"
  cp docker/Dockerfile.cpu docker/Dockerfile.cpu.dockerignore "$ctx/docker/"
  while read -r entry; do
    mkdir -p "$ctx/$(dirname "$entry")"
    cp -a "$ROOT/$entry" "$ctx/$entry"
  done < <(sed -n 's:^!\(.*[^/]\)/*$:\1:p' docker/Dockerfile.cpu.dockerignore)
  find "$ctx" -name __pycache__ -prune -exec rm -rf {} +
  CONTEXT="$ctx"
}

build_cpu() {
  local log1="$LOGS/build-builder.log" log2="$LOGS/build-image.log" t0=$SECONDS cached
  [ "$BASE" = "$BASE_DEFAULT" ] || BUILD_ARGS+=(--build-arg "PYTHON_IMAGE=$BASE")
  snapshot_context
  say "building the builder stage (first time ~10-20 minutes; log: $log1)"
  if ! podman build "${BUILD_COMMON[@]}" "${HOST_MOUNTS[@]}" "${BUILD_ARGS[@]}" \
        -f "$CONTEXT/docker/Dockerfile.cpu" --ignorefile "$CONTEXT/docker/Dockerfile.cpu.dockerignore" \
        --target builder -t ringfeed-check-builder:cpu "$CONTEXT" >"$log1" 2>&1; then
    tail_log "$log1" 40
    die "build $TAG" "builder stage failed after $((SECONDS - t0)) s (log: $log1)"
  fi
  say "building $TAG from the cached builder stage, without the host mounts (log: $log2)"
  if ! podman build "${BUILD_COMMON[@]}" "${BUILD_ARGS[@]}" \
        -f "$CONTEXT/docker/Dockerfile.cpu" --ignorefile "$CONTEXT/docker/Dockerfile.cpu.dockerignore" \
        -t "$TAG" "$CONTEXT" >"$log2" 2>&1; then
    tail_log "$log2" 40
    die "build $TAG" "runtime stage failed after $((SECONDS - t0)) s (log: $log2)"
  fi
  BUILD_S=$((SECONDS - t0))
  # The builder's install step must come from the cache (it ran with the host's settings):
  # a rebuild here would have gone without them.
  if ! grep -A2 -F 'bash docker/install.sh /opt/venv' "$log2" | grep -q 'Using cache'; then
    die "build $TAG" "the second build ran the builder's install step again instead of using the cached layer (log: $log2)"
  fi
  cached="$(grep -c 'Using cache' "$log1" "$log2" | awk -F: '{s += $2} END {print s}')"
  record PASS "build $TAG" "${BUILD_S} s (podman build --format docker; $cached step(s) from the layer cache; logs: $log1, $log2)"
  local size base_size
  size="$(podman image inspect --format '{{.Size}}' "$TAG")"
  base_size="$(podman image inspect --format '{{.Size}}' "$BASE")"
  IMAGE_SIZE="$(human "$size")"
  record INFO "image size" "$IMAGE_SIZE uncompressed (podman image inspect; base $(human "$base_size"))"
}

# ---- checks on the image -----------------------------------------------------------------------
check_info() {
  local log="$LOGS/info.log"
  if podman run --rm "$TAG" sh -c 'echo "uid=$(id -u) gid=$(id -g) user=$(id -un)"; ringfeed info' >"$log" 2>&1 \
     && grep -q "^uid=$UID_IN_IMAGE gid=$UID_IN_IMAGE user=ringfeed" "$log" \
     && grep -Eq '^\s+torch\s+2\.13\.0' "$log" && grep -Eq '^\s+tensorflow-cpu\s+2\.21\.0' "$log" \
     && grep -q '\[X\] MPI' "$log" && grep -q '\[X\] Gloo' "$log" \
     && grep -A2 'frameworks' "$log" | grep -q '\[X\] torch' && grep -A3 'frameworks' "$log" | grep -q '\[X\] tensorflow'; then
    record PASS "ringfeed info" "as uid $UID_IN_IMAGE (ringfeed): $(grep -E '^\s+(horovod|torch|tensorflow-cpu) ' "$log" | awk '{printf "%s %s, ", $1, $2}')Horovod: torch+TF, MPI+Gloo controllers"
  else
    tail_log "$log"
    record FAIL "ringfeed info" "expected uid $UID_IN_IMAGE, torch 2.13.0, tensorflow-cpu 2.21.0, Horovod with torch+TF, MPI and Gloo (log: $log)"
  fi
  # Nothing of this host or of the build left in the image: no pip settings, no ssh keys.
  local leaks
  leaks="$(podman image inspect --format '{{range .Config.Env}}{{println .}}{{end}}' "$TAG" | grep -E '^PIP_' || true)"
  leaks="$leaks$(podman run --rm --entrypoint sh "$TAG" -c 'ls -d /etc/pip.conf /etc/xdg/pip /usr/local/share/ringfeed-check-host-* /etc/ssh/ssh_host_* /opt/venv/pip.conf 2>/dev/null; find / -xdev \( -name id_rsa -o -name id_ed25519 \) -print 2>/dev/null' || true)"
  if [ -z "$leaks" ]; then
    record PASS "no host settings" "no PIP_* in the image's env, no pip.conf, no host CA mount point, no ssh keys"
  else
    record FAIL "no host settings" "found in the image: $(echo "$leaks" | tr '\n' ' ')"
  fi
}

digits_images() {  # the demo's own PNG maker (scikit-learn's digits) on the host, once
  local dir="$WORK/demo/digits-images" py
  [ -d "$dir" ] && return 0
  for py in "$ROOT/.venv/bin/python" python3; do
    if "$py" -c 'import sklearn, PIL' 2>/dev/null; then
      "$py" - "$ROOT/examples" "$dir" <<'PYEOF'
import sys
from pathlib import Path
sys.path.insert(0, sys.argv[1])
from demo import build_digits
print("digits PNGs:", build_digits(Path(sys.argv[2])))
PYEOF
      return
    fi
  done
  return 1
}

check_demo() {
  local log="$LOGS/demo.log" out="$WORK/demo/out" t0=$SECONDS
  if ! digits_images >"$LOGS/digits.log" 2>&1; then
    record FAIL "demo, 1 container" "could not make the digits PNGs on the host: needs scikit-learn and Pillow (make setup) (log: $LOGS/digits.log)"
    return
  fi
  # A fresh shard and fresh runs each time; the PNGs are examples/demo.py's own (build_digits,
  # made on the host: the image has no scikit-learn), the rest is demo.py in the container.
  rm -rf "$out"; mkdir -p "$out"; cp -r "$WORK/demo/digits-images" "$out/"
  chown -R "$UID_IN_IMAGE:$UID_IN_IMAGE" "$WORK/demo"
  say "running examples/demo.py in one container (shard, torch and TensorFlow on 2 ranks; log: $log)"
  if timeout 3600 podman run --rm --name "$NODE_PREFIX-demo" \
        -v "$ROOT/examples:/src/examples:ro" -v "$WORK/demo:/demo" \
        "$TAG" python /src/examples/demo.py --out /demo/out >"$log" 2>&1; then
    record PASS "demo, 1 container" "examples/demo.py (the full make demo: torch and tensorflow, 2 ranks, -H localhost:2 --gloo), $((SECONDS - t0)) s: $(grep -E '^\s+(torch|tensorflow) +val accuracy' "$log" | awk '{printf "%s %s, ", $1, $4}')goal >= 0.95"
  else
    tail_log "$log"
    record FAIL "demo, 1 container" "examples/demo.py failed or missed the accuracy after $((SECONDS - t0)) s (log: $log)"
  fi
}

verify_smoke() {  # DIR HOST...: tests/scripts/hvd_smoke.py's two rank files, checked exactly
  python3 - "$@" <<'PYEOF'
import json, sys
from pathlib import Path
out, hosts = Path(sys.argv[1]), sorted(sys.argv[2:])
r = [json.loads((out / f"rank{i}.json").read_text()) for i in range(2)]
assert [x["rank"] for x in r] == [0, 1] and [x["size"] for x in r] == [2, 2], r
assert sorted(x["host"] for x in r) == hosts, [x["host"] for x in r]
for x in r:   # rank k sent [0,1,2,3] + 10k: exact sums, averages and broadcasts
    assert x["torch_allreduce_sum"] == [10.0, 12.0, 14.0, 16.0], x
    assert x["torch_allreduce_avg"] == [5.0, 6.0, 7.0, 8.0], x
    assert x["torch_broadcast"] == [1.0, 1.0, 1.0], x
    assert x["tf_allreduce_sum"] == [10.0, 12.0, 14.0, 16.0], x
    assert x["tf_broadcast"] == [1.0, 1.0, 1.0], x
assert r[0]["torch_params"] == r[1]["torch_params"]
print("smoke results exact:", [(x["rank"], x["host"]) for x in r])
PYEOF
}

check_mpi_one_container() {
  local dir="$WORK/mpi-smoke" log="$LOGS/mpi-one-container.log"
  rm -rf "$dir"; mkdir -p "$dir"; chown "$UID_IN_IMAGE:$UID_IN_IMAGE" "$dir"
  if timeout 600 podman run --rm --hostname node1 -v "$ROOT/tests/scripts:/checks:ro" -v "$dir:/out" "$TAG" \
        horovodrun --mpi -np 2 -H localhost:2 python /checks/hvd_smoke.py /out >"$log" 2>&1 \
     && verify_smoke "$dir" node1 node1 >>"$log" 2>&1; then
    record PASS "MPI, 1 container" "horovodrun --mpi -np 2 (OpenMPI, as uid $UID_IN_IMAGE): hvd_smoke.py's torch/TF allreduce and broadcasts exact"
  else
    tail_log "$log"
    record FAIL "MPI, 1 container" "horovodrun --mpi -np 2 tests/scripts/hvd_smoke.py (log: $log)"
  fi
}

# ---- two containers as two hosts -----------------------------------------------------------------
NET_ARGS_1=()
NET_ARGS_2=()
NETNS_A=""
NETNS_B=""
two_host_network() {  # sets NET_ARGS_1/2 and HOST_1/2 (names horovodrun uses) and NET_NOTE
  local mode="$NET_MODE" net="$NODE_PREFIX"
  if [ "$mode" = auto ] || [ "$mode" = bridge ]; then
    podman network exists "$net" || podman network create "$net" >"$LOGS/network.log" 2>&1 || true
    # probe: one container reaches another by its alias over the bridge
    podman rm -f -t 0 "$NODE_PREFIX-node2" >/dev/null 2>&1 || true
    if podman network exists "$net" \
       && podman run -d --rm --name "$NODE_PREFIX-node2" --network "$net" --network-alias node2 \
            --entrypoint python3 "$TAG" -m http.server -d /opt 8000 >>"$LOGS/network.log" 2>&1 \
       && sleep 3 \
       && podman run --rm --network "$net" --entrypoint python3 "$TAG" -c \
            "import urllib.request as u; u.urlopen('http://node2:8000/', timeout=20)" >>"$LOGS/network.log" 2>&1; then
      podman rm -f -t 0 "$NODE_PREFIX-node2" >/dev/null 2>&1 || true
      NET_ARGS_1=(--network "$net" --network-alias node1)
      NET_ARGS_2=(--network "$net" --network-alias node2)
      HOST_1=node1 HOST_2=node2
      NET_NOTE="podman bridge network '$net' ($(podman info --format '{{.Host.NetworkBackend}}'), names by its DNS)"
      return 0
    fi
    podman rm -f -t 0 "$NODE_PREFIX-node2" >/dev/null 2>&1 || true
    [ "$mode" = auto ] || { tail_log "$LOGS/network.log"; return 1; }
    say "the bridge network does not work here ($LOGS/network.log): network namespaces instead"
  fi
  command -v ip >/dev/null 2>&1 || apt_install iproute2
  NETNS_A="rfimg$$a" NETNS_B="rfimg$$b"
  {
    ip netns add "$NETNS_A" && ip netns add "$NETNS_B" &&
    ip link add eth0 netns "$NETNS_A" type veth peer name eth0 netns "$NETNS_B" &&
    ip -n "$NETNS_A" addr add 192.168.78.1/24 dev eth0 && ip -n "$NETNS_B" addr add 192.168.78.2/24 dev eth0 &&
    ip -n "$NETNS_A" link set eth0 up && ip -n "$NETNS_B" link set eth0 up &&
    ip -n "$NETNS_A" link set lo up && ip -n "$NETNS_B" link set lo up
  } >>"$LOGS/network.log" 2>&1 || { tail_log "$LOGS/network.log"; return 1; }
  NET_ARGS_1=(--network "ns:/run/netns/$NETNS_A" --add-host node1:192.168.78.1 --add-host node2:192.168.78.2)
  NET_ARGS_2=(--network "ns:/run/netns/$NETNS_B" --add-host node1:192.168.78.1 --add-host node2:192.168.78.2)
  HOST_1=node1 HOST_2=node2
  NET_NOTE="network namespaces $NETNS_A/$NETNS_B, veth eth0 pair 192.168.78.1/.2, podman --network ns:"
}

demo_accuracy_reached() {  # SUMMARY_JSON: prints the run's summary; fails below the demo's goal
  python3 - "$1" <<'PYEOF'
import json, sys
s = json.loads(open(sys.argv[1]).read())
print("summary:", {k: s.get(k) for k in ("step", "val", "samples_per_s")})
print(f"val accuracy {s['val']['accuracy']:.4f} after {s['step']} steps")
assert s["val"]["accuracy"] >= 0.95, s["val"]
PYEOF
}

check_two_hosts() {
  local dir="$WORK/two-hosts" log="$LOGS/two-hosts.log" t0=$SECONDS
  if ! two_host_network; then
    record FAIL "two hosts: network" "neither a bridge network nor network namespaces worked (log: $LOGS/network.log)"
    return
  fi
  rm -rf "$dir"; mkdir -p "$dir/ssh" "$dir/smoke"
  chmod 700 "$dir/ssh"
  chown -R "$UID_IN_IMAGE:$UID_IN_IMAGE" "$dir" "$WORK/demo"
  # What docker-compose.yml gives each node: --init, RINGFEED_SSHD=1, the job's key volume;
  # node1 waits for node2's sshd. /demo holds the shards (the shared filesystem of a cluster).
  local common=(--init -d -e RINGFEED_SSHD=1 -v "$dir/ssh:/var/lib/ringfeed/ssh"
                -v "$WORK/demo:/demo" -v "$ROOT/tests/scripts:/checks:ro"
                -v "$ROOT/examples/configs:/configs:ro" -v "$dir:/job")
  {
    podman run "${common[@]}" --name "$NODE_PREFIX-node2" --hostname node2 "${NET_ARGS_2[@]}" "$TAG" sleep infinity &&
    podman run "${common[@]}" --name "$NODE_PREFIX-node1" --hostname node1 "${NET_ARGS_1[@]}" \
      -e RINGFEED_WAIT_FOR_SSH="$HOST_2 $HOST_1" "$TAG" sleep infinity
  } >"$log" 2>&1 || { tail_log "$log"; record FAIL "two hosts: start" "containers did not start (log: $log)"; return; }
  # The entry point waits for ssh to both hosts before it runs the command (sleep): poll for it.
  local waited=0
  until podman exec "$NODE_PREFIX-node1" sh -c 'cat /proc/[0-9]*/comm 2>/dev/null | grep -qx sleep' >/dev/null 2>&1; do
    if [ "$(podman inspect -f '{{.State.Running}}' "$NODE_PREFIX-node1" 2>/dev/null)" != true ] || [ $waited -ge 150 ]; then
      podman logs "$NODE_PREFIX-node1" >>"$log" 2>&1 || true
      tail_log "$log"; record FAIL "two hosts: ssh" "node1's entry point did not get ssh to node2 ($NET_NOTE; log: $log)"; return
    fi
    sleep 2; waited=$((waited + 2))
  done
  record PASS "two hosts: ssh" "entry point: job key made at start, sshd on 2222 as uid $UID_IN_IMAGE in both, node1 reached both over ssh ($NET_NOTE)"
  local across=(horovodrun -np 2 -H "$HOST_1:1,$HOST_2:1" -p 2222 --network-interface eth0 --start-timeout 120)
  local controller
  for controller in gloo mpi; do
    rm -rf "$dir/smoke"; mkdir -p "$dir/smoke"; chown "$UID_IN_IMAGE:$UID_IN_IMAGE" "$dir/smoke"
    echo "== smoke ($controller): ${across[*]} --$controller python /checks/hvd_smoke.py /job/smoke" >>"$log"
    if timeout 600 podman exec "$NODE_PREFIX-node1" "${across[@]}" "--$controller" python /checks/hvd_smoke.py /job/smoke >>"$log" 2>&1 \
       && verify_smoke "$dir/smoke" node1 node2 >>"$log" 2>&1; then
      record PASS "two hosts: $controller" "horovodrun --$controller -H $HOST_1:1,$HOST_2:1 -p 2222 tests/scripts/hvd_smoke.py, rank 0 on node1, rank 1 on node2: torch sum/avg, TF sum, broadcasts, parameters exact"
    else
      tail_log "$log"
      record FAIL "two hosts: $controller" "horovodrun --$controller across the containers or its results (log: $log)"
    fi
  done
  local shards=/demo/out/digits-shards
  if [ ! -f "$WORK/demo/out/digits-shards/manifest.json" ]; then
    record FAIL "two hosts: train" "no digits shards (the one-container demo makes them)"
    return
  fi
  echo "== train: ${across[*]} ringfeed train /configs/digits.yaml" >>"$log"
  t0=$SECONDS
  if timeout 1800 podman exec "$NODE_PREFIX-node1" "${across[@]}" --gloo ringfeed train /configs/digits.yaml \
        --set framework=torch --set "data.train=$shards" --set output.dir=/job/run >>"$log" 2>&1 \
     && demo_accuracy_reached "$dir/run/summary.json" >>"$log" 2>&1
  then
    record PASS "two hosts: train" "ringfeed train examples/configs/digits.yaml (torch, --gloo) across node1+node2 in $((SECONDS - t0)) s: $(grep -m1 '^val accuracy' "$log") (goal >= 0.95)"
  else
    tail_log "$log"
    record FAIL "two hosts: train" "ringfeed train across the containers (log: $log)"
  fi
}

# ---- docker-compose.yml itself, with podman-compose ----------------------------------------------
# The file unchanged, in a staging copy of the parts of the repository it mounts at /workspace
# (the config and the digits shards, owned by uid 1000 so the job can write its checkpoints).
check_compose() {
  local stage="$WORK/compose" log="$LOGS/compose.log" project="ringfeed-check-compose" t0=$SECONDS
  command -v podman-compose >/dev/null 2>&1 || apt_install podman-compose
  if [ ! -f "$WORK/demo/out/digits-shards/manifest.json" ]; then
    record FAIL "compose" "no digits shards (the one-container demo makes them)"; return
  fi
  rm -rf "$stage"; mkdir -p "$stage/docker" "$stage/examples/configs" "$stage/demo-out"
  cp "$ROOT/docker/docker-compose.yml" "$stage/docker/"
  cp "$ROOT/examples/configs/digits.yaml" "$stage/examples/configs/"
  cp -r "$WORK/demo/out/digits-shards" "$stage/demo-out/"
  chown -R "$UID_IN_IMAGE:$UID_IN_IMAGE" "$stage"
  local compose=(podman-compose -p "$project" -f "$stage/docker/docker-compose.yml")
  "${compose[@]}" down -v >/dev/null 2>&1 || true
  say "docker/docker-compose.yml with podman-compose (log: $log)"
  local node1 code
  if RINGFEED_UID=$UID_IN_IMAGE "${compose[@]}" up -d --no-build >"$log" 2>&1 \
     && node1="$(podman ps -a -q --filter "label=com.docker.compose.project=$project" --filter label=com.docker.compose.service=node1)" \
     && [ -n "$node1" ]; then
    code="$(timeout 1800 podman wait "$node1" 2>>"$log" || echo timeout)"
    podman logs "$node1" >>"$log" 2>&1 || true
  else
    code="not started"
  fi
  "${compose[@]}" down -v >>"$log" 2>&1 || true
  podman network rm -f "${project}_default" >/dev/null 2>&1 || true   # podman-compose 1.0 leaves it
  if [ "$code" = 0 ] && demo_accuracy_reached "$stage/demo-out/runs/digits/summary.json" >>"$log" 2>&1
  then
    record PASS "compose" "podman-compose up of docker/docker-compose.yml: node1 ran horovodrun -H node1:1,node2:1 (ringfeed train digits.yaml --resume auto), exit 0, $(grep -m1 '^val accuracy' "$log"), $((SECONDS - t0)) s"
  else
    tail_log "$log"
    record FAIL "compose" "node1 exit status '$code' or accuracy below 0.95 (log: $log)"
  fi
}

# ---- gpu-recipe: what of Dockerfile.gpu can run without a CUDA base, a GPU or a registry --------
gpu_recipe() {
  local gpu="$ROOT/docker/Dockerfile.gpu" cpu="$ROOT/docker/Dockerfile.cpu" log="$LOGS/gpu-recipe.log"
  local devel why ppa
  devel="$(dockerfile_arg "$gpu" CUDA_DEVEL_IMAGE)"
  if podman image exists "$devel" || timeout 300 podman pull -q "$devel" >"$LOGS/pull-cuda.log" 2>&1; then
    record INFO "gpu image build" "$devel is available here, but this check does not build the GPU image (no GPU to run it on)"
  else
    why="$(grep -m1 -o 'Error: .*' "$LOGS/pull-cuda.log" | sed -E 's/^.*(lookup |error )/\1/' | cut -c1-80)"
    if python3 -c "import urllib.request as u; u.urlopen('https://ppa.launchpadcontent.net/deadsnakes/ppa/ubuntu/dists/jammy/Release', timeout=15)" 2>/dev/null; then
      ppa="reachable"; else ppa="unreachable"; fi
    record SKIP "gpu image build" "not built: $devel cannot be pulled ($why); the deadsnakes PPA its Python comes from is $ppa; no GPU, CUDA toolkit or NCCL here for Horovod's NCCL build"
  fi
  # 1. The runtime stage after Python: user, entry point, environment - the CPU image's lines.
  if diff <(sed -n '/^ARG RINGFEED_UID/,$p' "$cpu" | grep -v '^#') <(sed -n '/^ARG RINGFEED_UID/,$p' "$gpu" | grep -v '^#') >"$log" 2>&1; then
    record PASS "gpu: runtime tail" "Dockerfile.gpu's runtime stage from ARG RINGFEED_UID on (user, ssh dir, venv, entry point, ENV, USER) is, comments aside, the CPU image's, built and run above"
  else
    record FAIL "gpu: runtime tail" "Dockerfile.gpu's runtime stage differs from the CPU image's (diff: $log)"
  fi
  # 2. Its builder's HOROVOD_* settings given to install.sh in the CPU builder image (torch
  #    2.13.0+cpu): the installer must refuse to build a GPU Horovod there, in one line.
  local envs=() kvs=() kv
  while read -r kv; do envs+=(-e "$kv"); kvs+=("$kv"); done < <(sed -n 's/^ *\(ENV \)\{0,1\}\(HOROVOD_[A-Z_]*=[^ \\]*\).*/\2/p' "$gpu")
  if podman image exists ringfeed-check-builder:cpu \
     && ! podman run --rm "${envs[@]}" -e EXTRAS=torch,tf-cpu -e RINGFEED_EDITABLE=0 -e PYTHON=python3.11 \
          ringfeed-check-builder:cpu bash docker/install.sh /opt/venv >>"$log" 2>&1 \
     && grep -q 'is not a CUDA build' "$log"; then
    record PASS "gpu: install.sh guard" "with Dockerfile.gpu's ${kvs[*]} on a CPU torch, install.sh stops: $(grep -m1 -o 'torch .*is not a CUDA build' "$log")"
  else
    tail_log "$log"
    record FAIL "gpu: install.sh guard" "install.sh with Dockerfile.gpu's HOROVOD_* settings did not stop on a CPU torch (log: $log)"
  fi
}

# ---- apptainer-recipe: apptainer.def's scriptlets, run by podman ---------------------------------
# No Apptainer here (not in Debian 12; its sources need GitHub). apptainer.def is translated into
# a Containerfile that does what `apptainer build` does with it: per stage, FROM the stage's base,
# %files copied, %post run with /bin/sh, `%files from build` copied across; %environment,
# %runscript and %test kept as scripts, then %test and `%runscript info` run as uid 1000 and an
# MPI job (mpirun -np 2, what srun/mpirun do with the .sif on a cluster) in the result. CPU build
# arguments: BUILD_IMAGE/RUN_IMAGE debian:bookworm (a debootstrap stand-in here), EXTRAS
# torch,tf-cpu, GPU_OPERATIONS none, PIP_EXTRA_INDEX_URL PyTorch's CPU index (or this host's).
apptainer_recipe() {
  local ctx="$WORK/apptainer" log="$LOGS/apptainer-build.log" t0=$SECONDS image=ringfeed-check-apptainer:cpu
  local tool
  tool="$(command -v apptainer singularity 2>/dev/null | head -n1 || true)"
  if [ -z "$tool" ] && command -v apt-cache >/dev/null 2>&1 \
     && ! apt-cache policy apptainer singularity-container 2>/dev/null | grep -q 'Candidate: [0-9]'; then
    tool="none (apt has no apptainer or singularity-container package)"
  fi
  record SKIP "apptainer build" "apptainer/singularity here: ${tool:-none}; no .sif built or run, no .sif size; the GPU default (CUDA base, Ubuntu PPA path) not run"
  base_image docker.io/library/debian:bookworm localhost/ringfeed-check-debian:bookworm ""
  local debian="$BASE_PICK"
  rm -rf "$ctx"; mkdir -p "$ctx/files" "$ctx/scripts"
  if ! python3 - "$ROOT" "$ctx" "$debian" "EXTRAS=torch,tf-cpu" "GPU_OPERATIONS=none" \
        "PIP_EXTRA_INDEX_URL=$TORCH_CPU_INDEX" "BUILD_IMAGE=$debian" "RUN_IMAGE=$debian" >"$log" 2>&1 <<'PYEOF'
import re, shutil, sys
from pathlib import Path
root, ctx, overrides = Path(sys.argv[1]), Path(sys.argv[2]), dict(a.split("=", 1) for a in sys.argv[4:])
text = (root / "docker" / "apptainer.def").read_text()
stages, current, section = [], None, None
for line in text.splitlines():
    if line.startswith("Bootstrap:"):
        current = {"header": {}, "sections": {}}
        stages.append(current)
        section = None
    elif current is None or line.startswith("#") and section is None:
        continue
    elif re.match(r"^(From|Stage):", line) and section is None:
        key, value = line.split(":", 1)
        current["header"][key] = value.strip()
    elif line.startswith("%"):
        section = line.strip()
        current["sections"][section] = ""
    elif section:
        current["sections"][section] += line + "\n"
args = {}
for stage in stages:
    for line in stage["sections"].get("%arguments", "").splitlines():
        if line.strip():
            key, value = line.strip().split("=", 1)
            args[key] = value
args.update(overrides)
fill = lambda s: re.sub(r"{{\s*(\w+)\s*}}", lambda m: args[m.group(1)], s)
out = []
for stage in stages:
    name, sections = stage["header"]["Stage"], stage["sections"]
    out.append(f"FROM {fill(stage['header']['From'])} AS {name}")
    for head, body in sections.items():
        if head == "%files":
            for line in body.split("\n"):
                if line.strip():
                    src, dest = line.split()
                    target = ctx / "files" / src
                    target.parent.mkdir(parents=True, exist_ok=True)
                    if (root / src).is_dir():
                        shutil.copytree(root / src, target, ignore=shutil.ignore_patterns("__pycache__"))
                    else:
                        shutil.copy2(root / src, target)
                    out.append(f"COPY files/{src} {dest}")
        elif head.startswith("%files from "):
            for line in body.split("\n"):
                if line.strip():
                    src, dest = line.split()
                    out.append(f"COPY --from={head.split()[-1]} {src} {dest}")
    for head, body in sections.items():
        kind = head.split()[0][1:]
        if kind in ("post", "environment", "runscript", "test"):
            script = ctx / "scripts" / f"{name}-{kind}.sh"
            script.write_text("#!/bin/sh\n" + fill(body))
    out.append(f"COPY scripts/{name}-* /.ringfeed-check/")
    if "%post" in sections:
        out.append(f'RUN ["/bin/sh", "/.ringfeed-check/{name}-post.sh"]')
(ctx / "Containerfile").write_text("\n".join(out) + "\n")
print((ctx / "Containerfile").read_text())
PYEOF
  then
    tail_log "$log"; record FAIL "apptainer: translate" "could not translate docker/apptainer.def (log: $log)"; return
  fi
  say "building apptainer.def's stages with podman (first time ~10-20 minutes; log: $log)"
  if ! podman build "${BUILD_COMMON[@]}" "${HOST_MOUNTS[@]}" -f "$ctx/Containerfile" -t "$image" "$ctx" >>"$log" 2>&1; then
    tail_log "$log" 40
    record FAIL "apptainer: %post" "a %post of apptainer.def failed after $((SECONDS - t0)) s (log: $log)"; return
  fi
  record PASS "apptainer: %post" "both stages' %post on debian:bookworm (stand-in), %files, %files from build: $((SECONDS - t0)) s ($(grep -c 'Using cache' "$log") step(s) cached)"
  local run=(podman run --rm --user "$UID_IN_IMAGE:$UID_IN_IMAGE" -e HOME=/tmp --hostname apptainer-node)
  local env=". /.ringfeed-check/runtime-environment.sh &&"
  log="$LOGS/apptainer-run.log"
  if "${run[@]}" "$image" /bin/sh -c "$env /bin/sh -e /.ringfeed-check/runtime-test.sh" >"$log" 2>&1; then
    record PASS "apptainer: %test" "ringfeed --help, horovodrun --check-build as uid $UID_IN_IMAGE, with %environment"
  else
    tail_log "$log"; record FAIL "apptainer: %test" "(log: $log)"
  fi
  if "${run[@]}" "$image" /bin/sh -c "$env exec /bin/sh /.ringfeed-check/runtime-runscript.sh info" >>"$log" 2>&1 \
     && grep -q '\[X\] MPI' "$log" && grep -q '\[X\] Gloo' "$log" && grep -A2 frameworks "$log" | grep -q '\[X\] torch'; then
    record PASS "apptainer: %runscript" "'%runscript info' = ringfeed info: Horovod with torch+TF, MPI and Gloo"
  else
    tail_log "$log"; record FAIL "apptainer: %runscript" "(log: $log)"
  fi
  local dir="$WORK/apptainer-smoke"
  rm -rf "$dir"; mkdir -p "$dir"; chown "$UID_IN_IMAGE:$UID_IN_IMAGE" "$dir"
  # OpenMPI's single-copy shared memory needs ptrace rights a podman container lacks (Apptainer's
  # do not): the same setting the Docker images carry.
  if "${run[@]}" -e OMPI_MCA_btl_vader_single_copy_mechanism=none -v "$ROOT/tests/scripts:/checks:ro" -v "$dir:/out" \
        "$image" /bin/sh -c "$env mpirun -np 2 python /checks/hvd_smoke.py /out" >>"$log" 2>&1 \
     && verify_smoke "$dir" apptainer-node apptainer-node >>"$log" 2>&1; then
    record PASS "apptainer: mpirun" "mpirun -np 2 hvd_smoke.py in the image (Horovod's MPI controller): allreduce and broadcasts exact"
  else
    tail_log "$log"; record FAIL "apptainer: mpirun" "mpirun -np 2 tests/scripts/hvd_smoke.py (log: $log)"
  fi
}

# ---- run ---------------------------------------------------------------------------------------
cd "$ROOT"
if wanted cpu || wanted apptainer-recipe; then
  pip_settings || die "pip settings" "could not read this host's pip configuration"
fi
if wanted cpu; then
  build_cpu
  check_info
  check_mpi_one_container
  check_demo
  check_two_hosts
  cleanup
  check_compose
fi
if wanted gpu-recipe; then gpu_recipe; fi
if wanted apptainer-recipe; then apptainer_recipe; fi
summary
[ "$FAILED" -eq 0 ]
exit
}

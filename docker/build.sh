#!/usr/bin/env bash
# The megamoe image's build steps. The Dockerfile runs them; CI runs them too (`ci`,
# CPU mode), so what the image does is tested where no Docker engine runs.
#
#   docker/build.sh wheel   SRC_DIR OUT_DIR    build the megamoe wheel into OUT_DIR
#   docker/build.sh install WHEEL_DIR VENV     fresh venv with torch and the wheel (+ service extra)
#   docker/build.sh smoke   VENV               `megamoe serve` on 127.0.0.1: ready, one infer, SIGTERM, clean exit
#   docker/build.sh ci      [WORK_DIR]         wheel + install + smoke in CPU mode (what CI runs)
#
# Environment:
#   MEGAMOE_BUILD_MODE   gpu (default; the image), cpu (CI: no CUDA compile, torch from $PYTHON's environment)
#                        or cpu-image (docker/Dockerfile.cpu: no CUDA compile, torch from TORCH_INDEX_URL)
#   MEGAMOE_CUDA_ARCHS   CUDA targets in gpu mode, default "90a;100a"
#   TORCH_INDEX_URL      where `install` gets torch in gpu mode (the image passes the CUDA 12.8 index)
#   TORCH_VERSION        torch version spec for `install`, default "==2.13.0"
# Every pip install is constrained by constraints.txt (beside this script in the image, at the
# repository root in a source tree): the same pinned versions as scripts/setup.sh and CI.
#   PYTHON               interpreter that makes the venvs (default python3); in cpu mode the
#                        fresh venv also sees this interpreter's packages (torch among them)
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
mode="${MEGAMOE_BUILD_MODE:-gpu}"
python="${PYTHON:-python3}"

log() { printf '[docker/build.sh %s] %s\n' "$mode" "$*" >&2; }

constraints="$here/constraints.txt"
[[ -f "$constraints" ]] || constraints="$here/../constraints.txt"
[[ -f "$constraints" ]] || { echo "constraints.txt not found beside $here or in its parent" >&2; exit 1; }
constraints="$(cd "$(dirname "$constraints")" && pwd)/constraints.txt"
export PIP_CONSTRAINT="$constraints"  # also pins the isolated build environment of `pip wheel`

build_wheel() {
  local src="$1" wheel_dir="$2"
  mkdir -p "$wheel_dir"
  local tools
  tools="$(mktemp -d)"
  "$python" -m venv "$tools/venv"
  "$tools/venv/bin/pip" install --quiet --upgrade pip
  if [[ "$mode" == cpu || "$mode" == cpu-image ]]; then
    # No CUDA compile on CPU machines (it would also take hours on two cores): an
    # empty CUDA compiler makes CMake build the torch-backend-only extension.
    log "building the wheel without CUDA"
    "$tools/venv/bin/pip" wheel --no-deps --wheel-dir "$wheel_dir" \
      --config-settings=build-dir="$tools/build" \
      --config-settings=cmake.define.CMAKE_CUDA_COMPILER= \
      --config-settings=cmake.define.MEGAMOE_REQUIRE_CUDA=OFF "$src"
  else
    log "building the wheel for CUDA archs ${MEGAMOE_CUDA_ARCHS:-90a;100a}"
    MEGAMOE_REQUIRE_CUDA=ON MEGAMOE_CUDA_ARCHS="${MEGAMOE_CUDA_ARCHS:-90a;100a}" \
      "$tools/venv/bin/pip" wheel --no-deps --wheel-dir "$wheel_dir" --config-settings=build-dir="$tools/build" "$src"
  fi
  rm -rf "$tools"
  ls -l "$wheel_dir"/megamoe-*.whl >&2
}

install_wheel() {
  local wheels="$1" venv="$2"
  local built=("$wheels"/megamoe-*.whl)
  local wheel="${built[0]}"
  [[ -e "$wheel" ]] || { echo "no megamoe wheel in $wheels" >&2; exit 1; }
  "$python" -m venv "$venv"
  if [[ "$mode" == cpu ]]; then
    # CI reuses the torch (and the rest) of the environment running this script, seen
    # through a .pth file after the venv's own site-packages: no second multi-GB torch
    # download, and the wheel installed here still shadows any megamoe installed there.
    local venv_site
    venv_site="$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
    "$python" -c 'import site, sysconfig
paths = [sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"], *site.getsitepackages()]
print("\n".join(dict.fromkeys(paths)))' >"$venv_site/_parent_environment.pth"
  else
    "$venv/bin/pip" install --no-cache-dir --upgrade pip
    "$venv/bin/pip" install --no-cache-dir --index-url "${TORCH_INDEX_URL:?gpu mode needs TORCH_INDEX_URL}" \
      "torch${TORCH_VERSION:-==2.13.0}"
  fi
  log "installing $(basename "$wheel") into $venv"
  # --force-reinstall --no-deps: the wheel itself always lands in the venv, even when the
  # same version is visible from elsewhere; then its requirements (service extra included)
  "$venv/bin/pip" install --no-cache-dir --force-reinstall --no-deps "$wheel"
  "$venv/bin/pip" install --no-cache-dir "${wheel}[service]"
  # the installed package, not a source tree, must be what runs
  (cd / && "$venv/bin/python" - <<'PY'
import importlib.util, sys, megamoe, megamoe.service
assert importlib.util.find_spec("service") is None, "the wheel installed a top-level `service` module"
for module in (megamoe, megamoe.service):
    assert module.__file__.startswith(sys.prefix), f"{module.__name__} imported from {module.__file__}, not the venv"
print("installed:", megamoe.__file__)
PY
  )
  "$venv/bin/megamoe" serve --help >/dev/null
}

smoke() {
  local venv="$1"
  local port workdir pid rc
  port="$("$venv/bin/python" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')"
  workdir="$(mktemp -d)"
  log "starting megamoe serve on 127.0.0.1:$port"
  (cd "$workdir" && MEGAMOE_HOST=127.0.0.1 MEGAMOE_PORT="$port" MEGAMOE_PRESET=tiny MEGAMOE_CHECKPOINT= \
    MEGAMOE_TOKEN= MEGAMOE_BACKEND="${MEGAMOE_BACKEND:-torch}" \
    exec "$venv/bin/megamoe" serve) >"$workdir/server.log" 2>&1 &
  pid=$!
  local ready=0
  for _ in $(seq 1 240); do
    if MEGAMOE_PORT="$port" "$venv/bin/python" "$here/healthcheck.py" 2>/dev/null; then ready=1; break; fi
    kill -0 "$pid" 2>/dev/null || break
    sleep 0.5
  done
  if [[ "$ready" != 1 ]]; then
    log "server never became ready; its log:"; cat "$workdir/server.log" >&2
    kill "$pid" 2>/dev/null || true
    return 1
  fi
  MEGAMOE_PORT="$port" "$venv/bin/python" - <<'PY'
import json, os, random, urllib.request
port = os.environ["MEGAMOE_PORT"]
meta = json.load(urllib.request.urlopen(f"http://127.0.0.1:{port}/v2/models/tiny", timeout=10))
hidden, top_k, experts = (meta["parameters"][k] for k in ("hidden_size", "top_k", "num_experts"))
rng = random.Random(0)
tokens = 3
body = {"inputs": [
    {"name": "hidden_states", "datatype": "FP32", "shape": [tokens, hidden], "data": [rng.gauss(0, 1) for _ in range(tokens * hidden)]},
    {"name": "topk_ids", "datatype": "INT32", "shape": [tokens, top_k], "data": [rng.randrange(experts) for _ in range(tokens * top_k)]},
    {"name": "topk_weights", "datatype": "FP32", "shape": [tokens, top_k], "data": [rng.random() for _ in range(tokens * top_k)]},
]}
request = urllib.request.Request(f"http://127.0.0.1:{port}/v2/models/tiny/infer", data=json.dumps(body).encode(),
                                 headers={"content-type": "application/json"})
reply = json.load(urllib.request.urlopen(request, timeout=60))
out = reply["outputs"][0]
assert out["shape"] == [tokens, hidden] and len(out["data"]) == tokens * hidden, out["shape"]
assert any(v != 0 for v in out["data"]), "all-zero output"
print("smoke infer ok:", out["name"], out["datatype"], out["shape"])
PY
  kill -TERM "$pid"
  rc=0; wait "$pid" || rc=$?
  if [[ "$rc" != 0 ]]; then
    log "server exited $rc after SIGTERM; its log:"; cat "$workdir/server.log" >&2
    return 1
  fi
  log "server stopped cleanly on SIGTERM"
  rm -rf "$workdir"
}

case "${1:-}" in
  wheel) build_wheel "${2:?SRC_DIR}" "${3:?OUT_DIR}" ;;
  install) install_wheel "${2:?WHEEL_DIR}" "${3:?VENV}" ;;
  smoke) smoke "${2:?VENV}" ;;
  ci)
    mode=cpu
    work="${2:-$(mktemp -d)}"
    src="$(cd "$here/.." && pwd)"
    build_wheel "$src" "$work/dist"
    install_wheel "$work/dist" "$work/venv"
    smoke "$work/venv"
    log "ok: wheel built, installed into a fresh venv, served, probed ready, stopped"
    ;;
  *) sed -n '2,/^set -euo/p' "$0" | grep '^#' >&2; exit 2 ;;
esac

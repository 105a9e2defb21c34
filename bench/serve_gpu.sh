#!/usr/bin/env bash
# The service at GPU speed, measured with NVIDIA's perf_analyzer: `megamoe serve --backend cuda-sm90
# --preset v4-flash` on 127.0.0.1, binary tensors, T=512 per request (concurrency 4 and 8) and T=1 per request
# (concurrency 1 and 16), against the forward-only tokens/s of the same layer measured in the same run
# (CUDA events, no HTTP), for each instance count in INSTANCES. Writes OUT_DIR/serve_h200.json (copy it to bench/results/) and the logs.
#
#   bench/serve_gpu.sh [OUT_DIR]          default ./serve_gpu_out
#
# Needs: a Hopper GPU, python3 with torch; the service's Python packages importable or as wheels in
# WHEELS (default .whl/); perf_analyzer at PERF_ANALYZER (default: .venv/bin/perf_analyzer, then
# ./perf_analyzer/perf_analyzer; scripts/install_perf_analyzer.sh makes one, its folder runs on any
# x86-64 Linux). The extension is built here (CMake, sm_90a) unless megamoe/_C has the sm90 kernels.
# Server flags: --queue-delay-ms 0 (the batcher never waits while the device is idle; requests that
# arrive while it is busy join the next batch), --selftest-level quick.
# INSTANCES (default "1 4"): the server is started once per entry (--instances N, each instance its own
# copy of the layer on the GPU; an entry N:BF16 also sets --hidden-datatype BF16, so that perf_analyzer
# sends and receives BF16 hidden states, half the bytes of FP32) and every case runs against each, in this one run. Besides
# perf_analyzer's figures each case records the CPU time of perf_analyzer itself and of the server
# (the parent and its instance processes) over the case, as a share of one core.
# GIT_COMMIT names the commit that runs (default: git rev-parse HEAD; a copied tree may have none).
# PYTHON (default python3) runs everything; PRESET / BACKEND (default v4-flash / cuda-sm90) change the layer, e.g. for a CPU smoke run of this
# script: PYTHON=.venv/bin/python PRESET=small BACKEND=torch WINDOW_MS=500 bench/serve_gpu.sh /tmp/x
set -uo pipefail
PRESET=${PRESET:-v4-flash}
BACKEND=${BACKEND:-cuda-sm90}
PY=${PYTHON:-python3}
cd "$(dirname "$0")/.."
LOG_DIR=${1:-$PWD/serve_gpu_out}
mkdir -p "$LOG_DIR"
LOG_DIR=$(cd "$LOG_DIR" && pwd)
export PYTHONUNBUFFERED=1
t0=$(date +%s); el() { echo "$(( $(date +%s) - t0 ))s"; }
work=$(mktemp -d)
server_pid=
cleanup() { [ -n "$server_pid" ] && kill "$server_pid" 2>/dev/null; wait 2>/dev/null; rm -rf "$work"; }
trap cleanup EXIT

# 1. Python packages: the service's, from wheels when the interpreter lacks them
if ! "$PY" -c "import fastapi, uvicorn, pydantic_settings, prometheus_client" 2>/dev/null; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --target "$work/site" "${WHEELS:-.whl}"/*.whl \
    >"$LOG_DIR/setup.log" 2>&1 || { tail -20 "$LOG_DIR/setup.log"; echo "wheel install failed"; exit 1; }
  export PYTHONPATH="$work/site${PYTHONPATH:+:$PYTHONPATH}"
fi
# 2. the extension with the sm90 kernels
if [[ "$BACKEND" == cuda-sm90 ]] && ! "$PY" -c "from megamoe import _ext; assert _ext.has_part('sm90')" 2>/dev/null; then
  (cmake -S . -B build/serve_gpu -G Ninja -DMEGAMOE_CUDA_ARCHS=90a -DMEGAMOE_REQUIRE_CUDA=ON -DCMAKE_BUILD_TYPE=Release \
     -DPython_EXECUTABLE="$(command -v "$PY")" && cmake --build build/serve_gpu -j "$(nproc)" \
     && cp build/serve_gpu/_C*.so megamoe/) >"$LOG_DIR/build.log" 2>&1 || { tail -30 "$LOG_DIR/build.log"; echo "BUILD FAILED"; exit 1; }
  echo "extension built at $(el)"
fi
# 3. the installed layout (megamoe.service) when the package is not installed: megamoe/ with service/ inside
# ($PY -m and -c put the working directory first on sys.path: the service runs from $work)
if ! (cd "$work" && "$PY" -c "import megamoe.service") 2>/dev/null; then
  mkdir -p "$work/pkg/megamoe"
  for f in "$PWD"/megamoe/*; do ln -s "$f" "$work/pkg/megamoe/"; done
  ln -s "$PWD/service" "$work/pkg/megamoe/service"
  export PYTHONPATH="$work/pkg${PYTHONPATH:+:$PYTHONPATH}"
fi
(cd "$work" && "$PY" -c "import megamoe.service") || { echo "megamoe.service does not import"; exit 1; }
PA=${PERF_ANALYZER:-}
for cand in .venv/bin/perf_analyzer perf_analyzer/perf_analyzer; do
  [ -z "$PA" ] && [ -x "$cand" ] && PA=$PWD/$cand
done
[ -n "$PA" ] || { echo "perf_analyzer not found: set PERF_ANALYZER (scripts/install_perf_analyzer.sh)"; exit 1; }
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv >"$LOG_DIR/gpu.txt" 2>&1

# 4. forward-only tokens/s and the perf_analyzer data files (random inputs, routing given)
"$PY" bench/serve_gpu_forward.py --preset "$PRESET" --backend "$BACKEND" --tokens 512 1 --data-dir "$work" \
  --expect "$work/expect.pt" --out "$LOG_DIR/forward.json" >"$LOG_DIR/forward.log" 2>&1 || { tail -20 "$LOG_DIR/forward.log"; echo "forward timing failed"; exit 1; }
echo "forward-only timed at $(el): $(tail -1 "$LOG_DIR/forward.log")"

# 5. the server, once per instance count; the served-output check and the perf_analyzer cases against each
cpu_ticks() {  # user+system clock ticks of the server process and its children (the instances)
  local total=0 p
  for p in "$server_pid" $(pgrep -P "$server_pid" 2>/dev/null); do
    [ -r "/proc/$p/stat" ] && total=$(( total + $(awk '{print $14 + $15}' "/proc/$p/stat") ))
  done
  echo "$total"
}
pa_case() {  # name tokens concurrency
  local name=$1 tokens=$2 conc=$3 ticks0 ticks1 pa_times
  curl -sf "http://127.0.0.1:$port/metrics" >"$LOG_DIR/metrics_${tag}${name}_before.txt"
  ticks0=$(cpu_ticks)
  # bash's time: wall, user and system seconds of perf_analyzer (and its children)
  pa_times=$( { TIMEFORMAT='%R %U %S'; time "$PA" -m "$PRESET" -u "127.0.0.1:$port" -i http \
    --input-data "$work/data_T$tokens$dsuffix.json" --concurrency-range "$conc:$conc" --measurement-interval "${WINDOW_MS:-2000}" \
    --stability-percentage 40 --max-trials 8 -f "$LOG_DIR/pa_${tag}$name.csv" >"$LOG_DIR/pa_${tag}$name.log" 2>&1; } 2>&1 )
  local rc=$?
  ticks1=$(cpu_ticks)
  echo "$pa_times $(( ticks1 - ticks0 )) $(getconf CLK_TCK)" >"$LOG_DIR/cpu_${tag}$name.txt"
  echo "perf_analyzer ${tag}$name rc=$rc at $(el) (perf_analyzer wall/user/sys s, server ticks: $(cat "$LOG_DIR/cpu_${tag}$name.txt"))"
  curl -sf "http://127.0.0.1:$port/metrics" >"$LOG_DIR/metrics_${tag}${name}_after.txt"
}
for spec in ${INSTANCES:-1 4}; do
  n=${spec%%:*} dtype=FP32 dsuffix= tag="i${spec%%:*}_"
  if [[ $spec == *:* ]]; then dtype=${spec#*:}; dtype=${dtype^^}; dsuffix=_${dtype,,}; tag="i${n}${dtype,,}_"; fi
  port=$("$PY" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
  (cd "$work" && exec "$PY" -m megamoe.cli serve --backend "$BACKEND" --preset "$PRESET" --host 127.0.0.1 --port "$port" \
    --queue-delay-ms 0 --selftest-level quick --log-level info --instances "$n" --hidden-datatype "$dtype") \
    >"$LOG_DIR/server_${tag%_}.log" 2>&1 &
  server_pid=$!
  # ready: every instance (megamoe_instance_ready is 1 for each of them)
  for _ in $(seq 1 600); do
    [ "$(curl -sf "http://127.0.0.1:$port/metrics" 2>/dev/null | grep -c '^megamoe_instance_ready{.*} 1.0$')" -ge "$n" ] && break
    kill -0 "$server_pid" 2>/dev/null || { tail -30 "$LOG_DIR/server_${tag%_}.log"; echo "server exited"; exit 1; }
    sleep 0.5
  done
  curl -sf "http://127.0.0.1:$port/v2/health/ready" >/dev/null || { tail -30 "$LOG_DIR/server_${tag%_}.log"; echo "server never ready"; exit 1; }
  echo "server with $n instance(s), $dtype hidden states, ready at $(el)"
  # the served outputs against the layer's own forward (single, batched, stacked and padded requests)
  "$PY" bench/serve_gpu_forward.py --check "127.0.0.1:$port" --model "$PRESET" --expect "$work/expect.pt" \
    --out "$LOG_DIR/check_${tag%_}.json" >"$LOG_DIR/check_${tag%_}.log" 2>&1
  echo "served-output check rc=$? at $(el): $(tail -1 "$LOG_DIR/check_${tag%_}.log")"
  for case in ${CASES:-T512_c4:512:4 T512_c8:512:8 T1_c1:1:1 T1_c16:1:16}; do
    IFS=: read -r cname ctokens cconc <<<"$case"
    pa_case "$cname" "$ctokens" "$cconc"
  done
  kill -TERM "$server_pid"; wait "$server_pid"; echo "server with $n instance(s) exited with status $? at $(el)"
  server_pid=
done

"$PY" bench/serve_gpu_forward.py --report "$LOG_DIR" --instances ${INSTANCES:-1 4} \
  --command "PRESET=$PRESET BACKEND=$BACKEND INSTANCES=\"${INSTANCES:-1 4}\" WINDOW_MS=${WINDOW_MS:-2000} bench/serve_gpu.sh" --perf-analyzer "$PA" \
  ${GIT_COMMIT:+--commit "$GIT_COMMIT"} \
  --out "$LOG_DIR/serve_h200.json" || exit 1
echo "done at $(el)"

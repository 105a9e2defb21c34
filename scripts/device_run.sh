#!/bin/bash
# Build megamoe._C for sm_90a on the GPU machine, run the GPU tests, run the benchmark.
# Everything is logged under $OUT (or ./device_out); a short table is printed last.
#
#   scripts/device_run.sh [build|test|bench|all]... [-- extra pytest args]
# Environment: BENCH_ARGS (default: the full benchmark), PYTEST_ARGS (default: tests/gpu -q).
# Needs the nvidia-cutlass wheel in .whl/ (../shared/tools/device-wheels.sh fills it).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/device_out}
mkdir -p "$OUT"
steps=("$@")
[ ${#steps[@]} -eq 0 ] && steps=(all)
has() { for s in "${steps[@]}"; do [ "$s" = "$1" ] || [ "$s" = all ] && return 0; done; return 1; }
export PYTHONUNBUFFERED=1
summary=()

if has build; then
  t0=$(date +%s)
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/nvidia_cutlass-*.whl >"$OUT/pip.log" 2>&1
  export PYTHONPATH=/tmp/site
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv >"$OUT/nvidia_smi.txt" 2>&1
  cmake -S . -B build/device -G Ninja -DMEGAMOE_CUDA_ARCHS=90a -DMEGAMOE_REQUIRE_CUDA=ON \
        -DCMAKE_BUILD_TYPE=Release -DPython_EXECUTABLE="$(command -v python3)" >"$OUT/build.log" 2>&1 &&
    cmake --build build/device -j 16 >>"$OUT/build.log" 2>&1
  rc=$?
  if [ $rc -ne 0 ]; then tail -40 "$OUT/build.log"; echo "BUILD FAILED"; exit 1; fi
  cp build/device/_C*.so megamoe/
  summary+=("build: ok in $(( $(date +%s) - t0 ))s")
fi
export PYTHONPATH=$PWD:${PYTHONPATH:-/tmp/site}

if has test; then
  t0=$(date +%s)
  timeout ${TEST_TIMEOUT:-300} python3 -m pytest ${PYTEST_ARGS:-tests/gpu -q -rs -s} --timeout=${PER_TEST_TIMEOUT:-120} \
    --timeout-method=thread --durations=15 -p no:cacheprovider >"$OUT/pytest.log" 2>&1
  rc=$?
  grep -E "cosine|rel_err|worst" "$OUT/pytest.log" | head -60
  tail -25 "$OUT/pytest.log"
  summary+=("tests: rc=$rc in $(( $(date +%s) - t0 ))s: $(tail -1 "$OUT/pytest.log")")
fi

if has bench; then
  t0=$(date +%s)
  timeout ${BENCH_TIMEOUT:-1200} python3 bench/moe_bench.py ${BENCH_ARGS:-} --out "$OUT/moe_h200.json" >"$OUT/bench.log" 2>&1
  rc=$?
  summary+=("bench: rc=$rc in $(( $(date +%s) - t0 ))s")
  tail -30 "$OUT/bench.log"
fi
printf '%s\n' "${summary[@]}"

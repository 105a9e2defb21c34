#!/bin/bash
# Build the extension for the GPU of this machine, run the GPU tests and the MoE benchmark, and
# write every log under one folder; a short table comes last.
#
#   scripts/gpu_check.sh [LOG_DIR]        (or GPU_CHECK_OUT=LOG_DIR; default ./gpu_check_out)
#
# Needs: nvcc, cmake, ninja, python3 with torch, pytest, nanobind and nvidia-cutlass importable.
# Optional caps in seconds: TEST_S (GPU tests, default 420), BENCH_S (benchmark, default 300).
# BENCH_ARGS overrides the benchmark's arguments (default: --quick --profile, all T, both presets).
set -uo pipefail
cd "$(dirname "$0")/.."
LOG=${1:-${GPU_CHECK_OUT:-$PWD/gpu_check_out}}
mkdir -p "$LOG"
export PYTHONUNBUFFERED=1
t0=$(date +%s)
el() { echo "$(( $(date +%s) - t0 ))s"; }
summary=()

nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv >"$LOG/build.log" 2>&1
cap=$(python3 -c "import torch; M, m = torch.cuda.get_device_capability(); print(f'{M}{m}')" 2>>"$LOG/build.log")
if [ -z "$cap" ]; then echo "no CUDA GPU visible to torch (see $LOG/build.log)"; exit 1; fi
ARCHS=${MEGAMOE_CUDA_ARCHS:-${cap}a}
cmake -S . -B build/gpu_check -G Ninja -DMEGAMOE_CUDA_ARCHS="$ARCHS" -DMEGAMOE_REQUIRE_CUDA=ON -DCMAKE_BUILD_TYPE=Release \
  -DPython_EXECUTABLE="$(command -v python3)" >>"$LOG/build.log" 2>&1 \
  && cmake --build build/gpu_check -j "$(nproc)" >>"$LOG/build.log" 2>&1
if [ $? -ne 0 ]; then tail -40 "$LOG/build.log"; echo "BUILD FAILED (archs $ARCHS)"; exit 1; fi
cp build/gpu_check/_C*.so megamoe/
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
summary+=("build ($ARCHS): ok at $(el)")

PT=(python3 -m pytest -q -rs -p no:cacheprovider)
python3 -c "import pytest_timeout" 2>/dev/null && PT+=(--timeout=120 --timeout-method=thread)
tests=(tests/gpu)
[ "${cap:0:2}" = "10" ] && tests+=(tests/sm100_gpu)
timeout "${TEST_S:-420}" "${PT[@]}" "${tests[@]}" >"$LOG/pytest_gpu.log" 2>&1
rc=$?
summary+=("GPU tests (${tests[*]}): rc=$rc at $(el): $(tail -1 "$LOG/pytest_gpu.log")")
grep -E "^FAILED|^ERROR" "$LOG/pytest_gpu.log" | head -12

if [ "${cap:0:1}" = "9" ]; then
  # shellcheck disable=SC2086
  timeout "${BENCH_S:-300}" python3 bench/moe_bench.py ${BENCH_ARGS:---quick --profile} --out "$LOG/moe_bench.json" \
    >"$LOG/bench.log" 2>&1
  rc=$?
  summary+=("benchmark (bench/moe_bench.py ${BENCH_ARGS:---quick --profile}): rc=$rc at $(el)")
  sed -n '/^preset/,$p' "$LOG/bench.log"
else
  summary+=("benchmark: skipped (bench/moe_bench.py times the cuda-sm90 backend; this GPU is sm_$cap)")
fi
printf '%s\n' "${summary[@]}"

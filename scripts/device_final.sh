#!/bin/bash
# One bounded device call on the H200 (carry .whl): build (90a), GPU tests (default path with
# both PDL settings, then the experimental warp-specialized wgmma variants in their own process),
# full benchmark of the default dispatch, variant timings at large T, a decode A/B with PDL off,
# and `megamoe selftest --level full`. Logs and JSON under $OUT (8 files at most); table last.
#   scripts/device_final.sh      (caps in seconds: TEST_S, TEST_WS_S, BENCH_S, VAR_S, AB_S, ST_S)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/device_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
t00=$(date +%s); summary=()
el() { echo "$(( $(date +%s) - t00 ))s"; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >>"$OUT/setup.log" 2>&1 || echo "pip install failed (see setup.log)"
export PYTHONPATH=/tmp/site
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv >>"$OUT/setup.log" 2>&1
cmake -S . -B build/device -G Ninja -DMEGAMOE_CUDA_ARCHS=90a -DMEGAMOE_REQUIRE_CUDA=ON -DCMAKE_BUILD_TYPE=Release \
  -DPython_EXECUTABLE="$(command -v python3)" >>"$OUT/setup.log" 2>&1 && cmake --build build/device -j 16 >>"$OUT/setup.log" 2>&1
if [ $? -ne 0 ]; then tail -40 "$OUT/setup.log"; echo "BUILD FAILED"; exit 1; fi
cp build/device/_C*.so megamoe/
export PYTHONPATH=$PWD:/tmp/site
summary+=("build ok at $(el)")
PT="python3 -m pytest -q -rs -p no:cacheprovider --timeout=60 --timeout-method=thread"
timeout ${TEST_S:-90} $PT tests/gpu/test_gpu_moe.py tests/gpu/test_gpu_gemm.py tests/gpu/test_gpu_quantize.py tests/gpu/test_gpu_sf_layout.py -k "not ws" >"$OUT/pytest_main.log" 2>&1
summary+=("tests (default path, all GPU files): rc=$? at $(el): $(tail -1 "$OUT/pytest_main.log")")
timeout ${TEST_WS_S:-35} $PT -x tests/gpu/test_gpu_gemm.py tests/gpu/test_gpu_moe.py -k "wgmma and ws" >"$OUT/pytest_ws.log" 2>&1
rc_ws=$?
summary+=("tests (warp-specialized wgmma 7/8/9): rc=$rc_ws at $(el): $(tail -1 "$OUT/pytest_ws.log")")
grep -E "^FAILED|^ERROR" "$OUT/pytest_main.log" "$OUT/pytest_ws.log" | head -8
timeout ${BENCH_S:-110} python3 bench/moe_bench.py --quick --tokens 1 8 32 128 512 2048 8192 --out "$OUT/moe_h200.json" >"$OUT/bench.log" 2>&1
summary+=("bench (default dispatch, all T): rc=$? at $(el)")
V=5; [ $rc_ws -eq 0 ] && V=5,7,8,9
MEGAMOE_BENCH_VARIANTS=$V timeout ${VAR_S:-35} python3 bench/moe_bench.py --quick --variants --no-torch --tokens 2048 8192 \
  --modes w4a16 --out "$OUT/moe_h200_variants.json" --plot /tmp/v.png >>"$OUT/bench.log" 2>&1
summary+=("variants $V: rc=$? at $(el)")
MEGAMOE_SM90_PDL=0 MEGAMOE_SM90_FUSE_NT1=0 timeout ${AB_S:-20} python3 bench/moe_bench.py --quick --no-torch --tokens 1 8 32 \
  --out "$OUT/moe_h200_nopdl.json" --plot /tmp/n.png >>"$OUT/bench.log" 2>&1
summary+=("decode A/B with PDL and fusion off: rc=$? at $(el)")
timeout ${ST_S:-25} python3 -m megamoe.cli selftest --backend cuda-sm90 --level full >>"$OUT/bench.log" 2>&1
summary+=("selftest full: rc=$? at $(el)")
tail -9 "$OUT/bench.log"
python3 - "$OUT" <<'PY'
import json, sys, os
o = sys.argv[1]
def rows(name):
    try:
        return json.load(open(os.path.join(o, name)))["results"]
    except Exception as e:
        print(name, "missing:", e); return []
print("preset T | w4a16 w4a4 torch (us) | x torch w4a16 w4a4 | %copyBW")
for x in rows("moe_h200.json"):
    t = x.get("torch_bf16_us")
    print(x["preset"], x["T"], "|", *(f"{x.get(k, float('nan')):.0f}" for k in ("sm90_w4a16_us", "sm90_w4a4_us", "torch_bf16_us")),
          "|", *(f"{t / x[k]:.2f}" if t and k in x else "-" for k in ("sm90_w4a16_us", "sm90_w4a4_us")),
          "|", f'{x.get("sm90_w4a16_pct_copy_bw", float("nan")):.0f}')
for name in ("moe_h200_variants.json", "moe_h200_nopdl.json"):
    for x in rows(name):
        print(name.split("_")[-1][:-5], x["preset"], x["T"], {k: round(v) for k, v in x.items() if k.endswith("_us")})
PY
printf '%s\n' "${summary[@]}"

#!/bin/bash
# One bounded device call (carry .whl): build (90a), the GEMM and MoE GPU tests (every decode
# switch combination is inside the tests), then the decode A/B: persistent decode grid on/off
# (and on without the next-item L2 prefetch), and the full T sweep with it on. Files in $OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/device_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
t00=$(date +%s); summary=()
el() { echo "$(( $(date +%s) - t00 ))s"; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >>"$OUT/setup.log" 2>&1
export PYTHONPATH=/tmp/site
cmake -S . -B build/device -G Ninja -DMEGAMOE_CUDA_ARCHS=90a -DMEGAMOE_REQUIRE_CUDA=ON -DCMAKE_BUILD_TYPE=Release \
  -DPython_EXECUTABLE="$(command -v python3)" >>"$OUT/setup.log" 2>&1 && cmake --build build/device -j 16 >>"$OUT/setup.log" 2>&1
if [ $? -ne 0 ]; then tail -40 "$OUT/setup.log"; echo "BUILD FAILED"; exit 1; fi
cp build/device/_C*.so megamoe/
export PYTHONPATH=$PWD:/tmp/site
summary+=("build ok at $(el)")
PT="python3 -m pytest -q -rs -p no:cacheprovider --timeout=60 --timeout-method=thread"
timeout ${TEST_S:-100} $PT tests/gpu/test_gpu_moe.py tests/gpu/test_gpu_gemm.py tests/gpu/test_gpu_quantize.py tests/gpu/test_gpu_sf_layout.py -k "not ws" >"$OUT/pytest.log" 2>&1
rc=$?
summary+=("GPU tests: rc=$rc at $(el): $(tail -1 "$OUT/pytest.log")")
grep -E "^FAILED|^ERROR" "$OUT/pytest.log" | head -8
B="python3 bench/moe_bench.py --quick --no-torch --tokens 1 8 32"
MEGAMOE_SM90_DECODE_PERSISTENT=0 timeout 30 $B --out "$OUT/decode_old.json" --plot /tmp/a.png >"$OUT/bench.log" 2>&1
MEGAMOE_SM90_DECODE_PERSISTENT=1 timeout 30 $B --out "$OUT/decode_persistent.json" --plot /tmp/b.png >>"$OUT/bench.log" 2>&1
MEGAMOE_SM90_DECODE_PERSISTENT=1 MEGAMOE_SM90_DECODE_PREFETCH_NEXT=0 timeout 30 $B --out "$OUT/decode_persistent_nopf.json" --plot /tmp/c.png >>"$OUT/bench.log" 2>&1
summary+=("decode A/B at $(el)")
if [ $rc -eq 0 ]; then
  MEGAMOE_SM90_DECODE_PERSISTENT=1 timeout 60 python3 bench/moe_bench.py --quick --tokens 1 8 32 128 512 2048 8192 \
    --out "$OUT/moe_h200_persistent.json" >>"$OUT/bench.log" 2>&1
  summary+=("full sweep, persistent on: rc=$? at $(el)")
fi
python3 - "$OUT" <<'PY'
import json, os, sys
o = sys.argv[1]
for name in ("decode_old", "decode_persistent", "decode_persistent_nopf"):
    try:
        for x in json.load(open(os.path.join(o, name + ".json")))["results"]:
            print(f"{name:24s} {x['preset']:9s} T={x['T']:<3d} w4a16 {x.get('sm90_w4a16_us', float('nan')):7.1f} us "
                  f"({x.get('sm90_w4a16_pct_copy_bw', float('nan')):.0f}% BW)  w4a4 {x.get('sm90_w4a4_us', float('nan')):7.1f} us")
    except Exception as e:
        print(name, "missing:", e)
PY
printf '%s\n' "${summary[@]}"

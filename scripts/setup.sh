#!/usr/bin/env bash
# Set up .venv/ with megamoe, its service and test extras, on a fresh machine.
#  - torch 2.13.0 unless the environment already has a torch, from pip's configured index; where that
#    index serves the CUDA build (PyPI on Linux x86-64: the CUDA wheel and several GB of NVIDIA
#    libraries), MEGAMOE_TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu takes the CPU-only one.
#  - CUDA kernels: compiled when nvcc is found (MEGAMOE_CUDA_ARCHS, default "90a;100a");
#    then a compile error fails the set-up (MEGAMOE_REQUIRE_CUDA=ON). Without nvcc the
#    package installs with the torch backend only and says so.
# Versions: every pip install is constrained by constraints.txt (also the image's and CI's pins).
# Re-running is cheap: the CMake build in build/ is incremental.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  echo "[setup] creating .venv with $($PY --version)"
  $PY -m venv .venv
fi
. .venv/bin/activate
if ! python -c "import torch" 2>/dev/null; then
  if [ -n "${MEGAMOE_TORCH_INDEX_URL:-}" ]; then
    echo "[setup] installing torch 2.13.0 from $MEGAMOE_TORCH_INDEX_URL"
    python -m pip install -q -c constraints.txt --index-url "$MEGAMOE_TORCH_INDEX_URL" "torch==2.13.0"
  else
    echo "[setup] installing torch 2.13.0 from pip's index (CPU-only build: MEGAMOE_TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu)"
    python -m pip install -q -c constraints.txt "torch==2.13.0"
  fi
fi
echo "[setup] build tools"
python -m pip install -q -c constraints.txt "scikit-build-core>=0.10" "nanobind>=2.4" "nvidia-cutlass==4.2.0.0" "cmake>=3.28" ninja
if command -v nvcc >/dev/null 2>&1; then
  export MEGAMOE_REQUIRE_CUDA=${MEGAMOE_REQUIRE_CUDA:-ON}
  echo "[setup] nvcc found ($(nvcc --version | tail -1)): compiling CUDA for ${MEGAMOE_CUDA_ARCHS:-90a;100a} (several minutes the first time)"
else
  echo "[setup] no nvcc: building without CUDA kernels (torch backend only)"
fi
export CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}
# -v so that ninja's [n/N] progress lines (pip indents them) and any compiler error reach the
# terminal; the whole log is in build.log
set +e
python -m pip install -v --no-build-isolation -c constraints.txt -e ".[test,bench]" 2>&1 | tee build.log \
  | grep --line-buffered -E "^[[:space:]]*\[[0-9]+/[0-9]+\]|megamoe:|error:|FAILED|Successfully installed"
rc=${PIPESTATUS[0]}
set -e
if [ "$rc" -ne 0 ]; then
  echo "[setup] FAILED (pip exit $rc); last lines of build.log:" >&2
  tail -60 build.log >&2
  exit "$rc"
fi
echo "[setup] perf_analyzer (Triton's load generator, for the service tests and benchmarks)"
bash scripts/install_perf_analyzer.sh .venv
cd /tmp && python -m megamoe.cli info

"""Compile and run the C++ host tests: docs/SPEC.md §2 closed form vs CuTe's Sm1xxBlockScaledConfig, and the sm90
activation orders (megamoe/sm90_operand_order.hpp) vs CuTe layouts, the sm90 grouped-GEMM argument rules."""
import importlib.util
import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def cutlass_include():
    spec = importlib.util.find_spec("cutlass_library")
    if spec is None:
        return None
    inc = Path(spec.origin).parent / "source" / "include"
    return inc if (inc / "cute" / "tensor.hpp").exists() else None


def cuda_includes():
    nvcc = shutil.which("nvcc")
    roots = [os.environ.get("CUDA_HOME"), "/usr/local/cuda"]
    if nvcc:
        roots.append(str(Path(os.path.realpath(nvcc)).parents[1]))
    for r in roots:
        if r and (Path(r) / "include" / "cuda_runtime_api.h").exists():
            inc = [Path(r) / "include"]
            if (Path(r) / "include" / "cccl").exists():  # CUDA 13 keeps libcu++ there
                inc.append(Path(r) / "include" / "cccl")
            return inc
    return None


def compile_and_run(tmp_path, name, *sources):
    inc = cutlass_include()
    cuda = cuda_includes()
    if inc is None or cuda is None:
        if os.environ.get("CI"):
            pytest.fail(f"CI must run the CuTe host test: CUTLASS headers {inc}, CUDA headers {cuda}")
        pytest.skip("needs the nvidia-cutlass headers and the CUDA toolkit headers")
    cxx = shutil.which("c++") or shutil.which("g++")
    exe = tmp_path / name
    cmd = [cxx, "-std=c++17", "-O1", "-w", f"-I{ROOT / 'cpp' / 'include'}", f"-I{inc}",
           *[f"-I{c}" for c in cuda], str(ROOT / "cpp" / "tests" / f"{name}.cpp"),
           *[str(ROOT / src) for src in sources], "-o", str(exe)]
    build = subprocess.run(cmd, capture_output=True, text=True)
    assert build.returncode == 0, build.stderr[-4000:]
    run = subprocess.run([str(exe)], capture_output=True, text=True, timeout=300)
    print(run.stdout)
    assert run.returncode == 0, run.stdout[-4000:]
    return run.stdout


def test_sm90_operand_and_lane_order_equal_cute(tmp_path):
    out = compile_and_run(tmp_path, "test_sm90_operand_order")
    assert " 0 failed" in out and " 0 checks" not in out


def test_sm90_grouped_gemm_argument_rules(tmp_path):
    out = compile_and_run(tmp_path, "test_sm90_gemm_args", "cpp/sm90/gemm_args.cpp")
    assert " 0 failed" in out and " 0 checks" not in out


def test_sf_layout_closed_form_equals_cute(tmp_path):
    assert " 0 failed" in compile_and_run(tmp_path, "test_sf_layout")


def test_global_scale_modes_seen_by_python_are_the_cpp_enum():
    """megamoe::GlobalScaleMode (cpp/include/megamoe/common_kernels.h) is declared once: the extension exports every
    member with its value, cuda_common's GS_* are those members, and quantize_nvfp4 refuses a gs_mode outside it."""
    import re

    from megamoe import _ext
    from megamoe.backends import cuda_common

    if not _ext.has_part("common"):
        pytest.skip("the extension was built without cpp/common")
    header = (ROOT / "cpp" / "include" / "megamoe" / "common_kernels.h").read_text()
    body = re.search(r"enum class GlobalScaleMode : int \{(.*?)\};", header, re.S).group(1)
    cpp = {re.sub(r"(?<!^)([A-Z])", r"_\1", name[1:]).lower(): int(value)
           for name, value in re.findall(r"^\s*(k\w+)\s*=\s*(\d+)\s*,", body, re.M)}
    assert set(cpp) == {"single", "per_expert", "per_row", "per_row_dynamic"}, cpp
    exported = _ext.ext.GlobalScaleMode
    assert {m.name: int(m.value) for m in exported} == cpp
    assert [cuda_common.GS_SINGLE, cuda_common.GS_PER_EXPERT, cuda_common.GS_PER_ROW,
            cuda_common.GS_PER_ROW_DYNAMIC] == [exported.single, exported.per_expert, exported.per_row,
                                                exported.per_row_dynamic]
    import torch

    with pytest.raises(TypeError):  # refused while converting the arguments, before anything runs
        _ext.ext.quantize_nvfp4(src=torch.zeros(2, 16), global_scale=None, gs_mode=max(cpp.values()) + 1,
                                src_rows=None, expert_offsets=None, dst_offsets=None, data=None, scale=None,
                                scale_swz=None, sf_rows=0, dequant=None, row_scale_out=None, stream=0)

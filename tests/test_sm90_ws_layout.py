"""Host-only check (nvcc, no GPU) of the shared-memory layout of the warp-specialized wgmma kernel:
store-side swizzle vs the PTX 128B swizzle, activation chunk coverage, and one emulated 64-K stage
(weights decoded into pair order, activations in operand order, wgmma reads modelled from the PTX
descriptor rules) against a plain dot product. See tests/host/ws_layout_check.cu."""
from __future__ import annotations

import os
import shutil
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not found")
def test_ws_smem_layout_matches_ptx_model(tmp_path):
    exe = tmp_path / "ws_layout_check"
    subprocess.run(["nvcc", "-std=c++17", "--expt-relaxed-constexpr", "-gencode=arch=compute_90a,code=sm_90a",
                    "-I", os.path.join(ROOT, "cpp", "include"), os.path.join(ROOT, "tests", "host", "ws_layout_check.cu"),
                    "-o", str(exe)], check=True, capture_output=True, text=True, timeout=600)
    res = subprocess.run([str(exe)], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "ok" in res.stdout


def test_ws_pipeline_protocol_model():
    import importlib.util
    spec = importlib.util.spec_from_file_location("ws_pipeline_model", os.path.join(ROOT, "tests", "host", "ws_pipeline_model.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    mod.check_all(seeds=15)

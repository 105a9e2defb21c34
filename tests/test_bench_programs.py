"""The CUDA benchmark programs (bench/*.cu) include the kernels' own sources, so a change to a kernel can break them;
each must still compile for sm_90a with the command bench/README.md gives (no GPU needed to compile)."""
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PROGRAMS = sorted(p.name for p in (ROOT / "bench").glob("*.cu"))


def find_nvcc():
    home = os.environ.get("CUDA_HOME")
    for cand in (shutil.which("nvcc"), home and str(Path(home) / "bin" / "nvcc"), "/usr/local/cuda/bin/nvcc"):
        if cand and Path(cand).exists():
            return cand
    return None


def readme_command(program):
    """The nvcc command of `program` in bench/README.md, its line continuations joined, up to the '&&' that runs it."""
    text = (ROOT / "bench" / "README.md").read_text().replace("\\\n", " ")
    m = re.search(rf"^nvcc [^\n]*bench/{re.escape(program)}", text, re.M)
    assert m, f"bench/README.md has no nvcc command for {program}"
    return m.group(0).split()


def test_every_program_is_in_the_readme():
    assert PROGRAMS == ["combine_rate.cu", "wgmma_decode_rate.cu"], PROGRAMS
    for p in PROGRAMS:
        readme_command(p)


@pytest.mark.parametrize("program", PROGRAMS)
def test_bench_program_compiles(program, tmp_path):
    nvcc = find_nvcc()
    if nvcc is None:
        if os.environ.get("CI"):
            pytest.fail("CI must compile the CUDA benchmark programs: no nvcc")
        pytest.skip("needs nvcc")
    cmd = readme_command(program)
    out = cmd.index("-o")
    cmd[0], cmd[out + 1] = nvcc, str(tmp_path / Path(program).stem)
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-4000:]
    assert (tmp_path / Path(program).stem).exists()

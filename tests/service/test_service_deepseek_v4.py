"""`megamoe serve --checkpoint DIR` on a DeepSeek-V4 hash layer written by NVIDIA ModelOpt: the model
metadata asks for input_ids, a request without them is a 400 naming them, and with the recorded
token ids the answer agrees with ModelOpt's own float32 forward of the layer (docs/SPEC.md §3)."""
from __future__ import annotations

import json
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from service_testkit import ServerProcess

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "real" / "modelopt_v4_nvfp4"
MODEL = FIXTURE.name


def _post(server, body):
    req = urllib.request.Request(f"{server.url}/v2/models/{MODEL}/infer", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as reply:
            return reply.status, json.load(reply)
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = ServerProcess(tmp_path_factory.mktemp("v4") / "server.log",
                        args=["--checkpoint", str(FIXTURE), "--layer", "0", "--backend", "torch"])
    try:
        srv.wait_for("/v2/health/ready")
        yield srv
    finally:
        srv.stop()


def test_hash_layer_served_from_the_folder_with_input_ids(server):
    status, meta = server.get(f"/v2/models/{MODEL}")
    assert status == 200
    inputs = {i["name"]: i for i in meta["inputs"]}
    assert inputs["input_ids"]["shape"] == [-1] and not inputs["input_ids"].get("optional")

    ref = load_file(str(FIXTURE / "reference.safetensors"))
    x, ids, y = ref["layers.0.x"].float(), ref["layers.0.input_ids"], ref["layers.0.y_fp32"].double()
    hidden = {"name": "hidden_states", "datatype": "FP32", "shape": list(x.shape), "data": x.flatten().tolist()}

    status, body = _post(server, {"inputs": [hidden]})
    assert status == 400 and "input_ids" in body["error"], body

    token_ids = {"name": "input_ids", "datatype": "INT64", "shape": [x.shape[0]], "data": ids.tolist()}
    status, body = _post(server, {"inputs": [hidden, token_ids]})
    assert status == 200, body
    out = torch.tensor(body["outputs"][0]["data"], dtype=torch.float64).view(x.shape)
    cos = torch.nn.functional.cosine_similarity(out.flatten(), y.flatten(), dim=0)
    assert cos >= 0.99999, float(cos)
    assert abs(float(out.norm() / y.norm()) - 1) < 1e-3

    # other token ids route to other experts: the ids are used, not ignored
    status, body = _post(server, {"inputs": [hidden, dict(token_ids, data=((ids + 1) % 256).tolist())]})
    assert status == 200
    assert not torch.equal(torch.tensor(body["outputs"][0]["data"], dtype=torch.float64).view(x.shape), out)


def test_batch_invariant_mode_in_metadata_config_and_health(tmp_path):
    """The model metadata, the model configuration and the kernel-health report say whether
    answers are batch-invariant: on by default, off with --no-batch-invariant."""
    for args, expected in (([], True), (["--no-batch-invariant"], False)):
        srv = ServerProcess(tmp_path / f"server{len(args)}.log", args=["--backend", "torch", *args])
        try:
            srv.wait_for("/v2/health/ready")
            status, meta = srv.get("/v2/models/tiny")
            assert status == 200 and meta["parameters"]["batch_invariant"] is expected, meta["parameters"]
            status, config = srv.get("/v2/models/tiny/config")
            assert status == 200 and config["parameters"]["batch_invariant"]["string_value"] == str(expected)
            status, report = srv.get("/v1/health/kernels")
            assert status == 200 and report["batch_invariant"] is expected
        finally:
            srv.stop()

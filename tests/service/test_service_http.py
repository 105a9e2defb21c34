"""The service over real HTTP (uvicorn on 127.0.0.1) with a real v2 client (tritonclient).

Every result is compared with the library's own forward on the same weights.
"""

from __future__ import annotations

import asyncio
import json

import httpx
import ml_dtypes
import numpy as np
import pytest
import torch
import tritonclient.http as tclient
import tritonclient.http.aio as tclient_aio
from prometheus_client.parser import text_string_to_metric_families

from service_testkit import PRESET, TOKEN, random_inputs

TORCH_DTYPE = {"FP32": torch.float32, "FP16": torch.float16, "BF16": torch.bfloat16}


def to_numpy(t: torch.Tensor) -> np.ndarray:
    if t.dtype == torch.bfloat16:
        return t.float().numpy().astype(ml_dtypes.bfloat16)
    return t.numpy()


def from_numpy(a: np.ndarray) -> torch.Tensor:
    if a.dtype == ml_dtypes.bfloat16:
        return torch.from_numpy(a.astype(np.float32)).to(torch.bfloat16)
    return torch.from_numpy(np.array(a))


def triton_inputs(named: dict[str, tuple[str, torch.Tensor]], binary: bool):
    inputs = []
    for name, (datatype, tensor) in named.items():
        inp = tclient.InferInput(name, list(tensor.shape), datatype)
        inp.set_data_from_numpy(to_numpy(tensor), binary_data=binary)
        inputs.append(inp)
    return inputs


@pytest.fixture
def client(server):
    c = tclient.InferenceServerClient(server.url.removeprefix("http://"), network_timeout=60.0)
    yield c
    c.close()


def auth() -> dict:
    # a fresh dict per call: tritonclient writes Inference-Header-Content-Length into the one it gets
    return {"Authorization": f"Bearer {TOKEN}"}


def test_health_and_metadata(server, client, layer):
    assert server.get("/v2/health/live") == (200, {"live": True})
    assert server.get("/v2/health/ready") == (200, {"ready": True})
    status, meta = server.get("/v2")
    assert status == 200 and meta["name"] == "megamoe" and "binary_tensor_data" in meta["extensions"]
    assert client.is_server_live() and client.is_server_ready() and client.is_model_ready(PRESET)

    model = client.get_model_metadata(PRESET)
    cfg = layer.config
    assert model["name"] == PRESET and model["versions"] == ["1"]
    inputs = {i["name"]: i for i in model["inputs"]}
    assert inputs["hidden_states"]["shape"] == [-1, cfg.hidden_size]
    assert inputs["topk_ids"]["shape"] == [-1, cfg.top_k]
    assert inputs["router_logits"]["shape"] == [-1, cfg.num_experts]
    assert model["outputs"][0]["name"] == "output"
    assert model["parameters"]["backend"] == "torch"
    assert server.get(f"/v2/models/{PRESET}/versions/1")[0] == 200
    assert server.get("/v2/models/nope")[0] == 404
    assert server.get("/v2/models/nope/ready")[0] == 404


# tritonclient sends BF16 only as binary; JSON BF16 is test_bf16_json_numbers
@pytest.mark.parametrize("datatype, binary", [("FP32", True), ("FP32", False), ("FP16", True), ("FP16", False),
                                              ("BF16", True)])
def test_infer_equals_library_forward(client, layer, datatype, binary):
    hidden, ids, weights = random_inputs(layer, tokens=13, seed=11, dtype=TORCH_DTYPE[datatype])
    inputs = triton_inputs({"hidden_states": (datatype, hidden), "topk_ids": ("INT32", ids),
                            "topk_weights": ("FP32", weights)}, binary)
    outputs = [tclient.InferRequestedOutput("output", binary_data=binary)]
    result = client.infer(PRESET, inputs, outputs=outputs, headers=auth(), request_id="req-13")
    got = from_numpy(result.as_numpy("output"))
    expected = layer.forward(hidden, topk_ids=ids, topk_weights=weights)
    assert got.dtype == expected.dtype and got.shape == expected.shape
    assert torch.equal(got, expected), f"max |diff| {(got.float() - expected.float()).abs().max()}"
    assert result.get_response()["id"] == "req-13"
    assert expected.abs().sum() > 0


def test_bf16_json_numbers(server, layer):
    """BF16 in JSON: numbers in, numbers out (exact, since bf16 values are exact in float)."""
    hidden, ids, weights = random_inputs(layer, tokens=3, seed=5, dtype=torch.bfloat16)
    body = {"inputs": [
        {"name": "hidden_states", "datatype": "BF16", "shape": list(hidden.shape), "data": hidden.float().tolist()},
        {"name": "topk_ids", "datatype": "INT64", "shape": list(ids.shape), "data": ids.tolist()},
        {"name": "topk_weights", "datatype": "FP32", "shape": list(weights.shape), "data": weights.flatten().tolist()},
    ]}
    reply = httpx.post(f"{server.url}/v2/models/{PRESET}/infer", json=body, headers=auth(), timeout=30)
    assert reply.status_code == 200, reply.text
    out = reply.json()["outputs"][0]
    assert out["datatype"] == "BF16" and out["shape"] == [3, layer.config.hidden_size]
    got = torch.tensor(out["data"], dtype=torch.float32).reshape(out["shape"])
    expected = layer.forward(hidden, topk_ids=ids, topk_weights=weights).float()
    assert torch.equal(got, expected)


@pytest.mark.parametrize("mode", ["router_logits", "own_router"])
def test_routing_by_the_layer(client, layer, mode):
    hidden, _, _ = random_inputs(layer, tokens=9, seed=21)
    named = {"hidden_states": ("FP32", hidden)}
    kwargs = {}
    if mode == "router_logits":
        logits = torch.randn(9, layer.config.num_experts, generator=torch.Generator().manual_seed(3))
        named["router_logits"] = ("FP32", logits)
        kwargs["router_logits"] = logits
    result = client.infer(PRESET, triton_inputs(named, True), headers=auth())
    got = from_numpy(result.as_numpy("output"))
    assert torch.equal(got, layer.forward(hidden, **kwargs))


def test_request_level_binary_output(server, layer):
    """``parameters.binary_data_output`` with a JSON body: the reply carries the tensor raw."""
    hidden, ids, weights = random_inputs(layer, tokens=2, seed=8)
    body = {"parameters": {"binary_data_output": True}, "inputs": [
        {"name": "hidden_states", "datatype": "FP32", "shape": [2, layer.config.hidden_size], "data": hidden.tolist()},
        {"name": "topk_ids", "datatype": "INT32", "shape": [2, layer.config.top_k], "data": ids.tolist()},
        {"name": "topk_weights", "datatype": "FP32", "shape": [2, layer.config.top_k], "data": weights.tolist()},
    ]}
    reply = httpx.post(f"{server.url}/v2/models/{PRESET}/infer", json=body, headers=auth(), timeout=30)
    assert reply.status_code == 200, reply.text
    head_len = int(reply.headers["Inference-Header-Content-Length"])
    head = json.loads(reply.content[:head_len])
    raw = reply.content[head_len:]
    assert head["outputs"][0]["parameters"]["binary_data_size"] == len(raw) == 2 * layer.config.hidden_size * 4
    got = torch.frombuffer(bytearray(raw), dtype=torch.float32).reshape(2, -1)
    assert torch.equal(got, layer.forward(hidden, topk_ids=ids, topk_weights=weights))


async def _concurrent_clients(url: str, requests: list[dict]) -> list[torch.Tensor]:
    client = tclient_aio.InferenceServerClient(url.removeprefix("http://"), conn_limit=len(requests))
    try:
        async def one(req):
            inputs = []
            for name, (datatype, tensor) in req.items():
                inp = tclient_aio.InferInput(name, list(tensor.shape), datatype)
                inp.set_data_from_numpy(to_numpy(tensor), binary_data=True)
                inputs.append(inp)
            result = await client.infer(PRESET, inputs, headers=auth(),
                                        outputs=[tclient_aio.InferRequestedOutput("output", binary_data=True)])
            return from_numpy(result.as_numpy("output"))

        return await asyncio.gather(*(one(r) for r in requests))
    finally:
        await client.close()


def concurrent_burst(server, layer, clients: int = 64, seed: int = 1000):
    """``clients`` requests at once, with different T and dtypes, every other one routed by the
    model's own router (the others send topk_ids/topk_weights); returns (requests, expected, got)
    where ``expected`` is each request's forward alone."""
    requests, expected = [], []
    dtypes = ["FP32", "BF16", "FP32", "FP16", "BF16", "FP32", "FP16", "FP32"]
    for i in range(clients):
        datatype = dtypes[i % len(dtypes)]
        hidden, ids, weights = random_inputs(layer, tokens=1 + (i * 7) % 17, seed=seed + i, dtype=TORCH_DTYPE[datatype])
        if i % 2:
            requests.append({"hidden_states": (datatype, hidden)})
            expected.append(layer.forward(hidden))
        else:
            requests.append({"hidden_states": (datatype, hidden), "topk_ids": ("INT32", ids),
                             "topk_weights": ("FP32", weights)})
            expected.append(layer.forward(hidden, topk_ids=ids, topk_weights=weights))
    got = asyncio.run(_concurrent_clients(server.url, requests))
    return requests, expected, got


def test_64_concurrent_clients_each_get_their_own_rows_bit_for_bit(server, layer):
    """docs/SPEC.md §3.5: a request's answer does not depend on its batch-mates. Each of 64
    concurrent callers (batched together by the server) gets the bits of its own request run
    alone, routed by the model's router or by the caller."""
    _, expected, got = concurrent_burst(server, layer, clients=64)
    for i, (g, e) in enumerate(zip(got, expected)):
        assert g.dtype == e.dtype and g.shape == e.shape, f"client {i}: {g.dtype}{list(g.shape)} vs {e.dtype}{list(e.shape)}"
        assert torch.equal(g, e), f"client {i} ({e.dtype}): max |batched - alone| {(g.float() - e.float()).abs().max()}"
        for j, other in enumerate(expected):
            if j != i and other.shape == e.shape:
                assert (g.float() - other.float()).abs().max() > 0.01 * e.float().abs().max(), f"client {i} got client {j}'s rows"


def _families(server) -> dict:
    status, text = server.get("/metrics")
    assert status == 200
    return {f.name: f for f in text_string_to_metric_families(text)}


def _value(families, family: str, sample: str, **labels) -> float:
    total = 0.0
    for s in families[family].samples:
        if s.name == sample and all(s.labels.get(k) == v for k, v in labels.items()):
            total += s.value
    return total


def test_metrics_show_requests_batches_and_selftest(server, layer):
    before = _families(server)
    tokens_before = _value(before, "megamoe_tokens_processed", "megamoe_tokens_processed_total", model=PRESET)
    _, expected, _ = concurrent_burst(server, layer, clients=32, seed=5000)
    after = _families(server)

    sent_tokens = sum(e.shape[0] for e in expected)
    assert _value(after, "megamoe_tokens_processed", "megamoe_tokens_processed_total", model=PRESET) - tokens_before == sent_tokens
    ok = _value(after, "megamoe_requests", "megamoe_requests_total", route="/v2/models/{model_name}/infer", code="200")
    assert ok >= 32
    batches = _value(after, "megamoe_batch_size_requests", "megamoe_batch_size_requests_count", model=PRESET)
    requests_in_batches = _value(after, "megamoe_batch_size_requests", "megamoe_batch_size_requests_sum", model=PRESET)
    assert requests_in_batches >= 32
    assert batches < requests_in_batches, "32 concurrent requests never shared a batch"
    single = _value(after, "megamoe_batch_size_requests", "megamoe_batch_size_requests_bucket", model=PRESET, le="1.0")
    assert single < batches
    for family in ("megamoe_queue_latency_seconds", "megamoe_compute_latency_seconds", "megamoe_request_latency_seconds"):
        assert _value(after, family, family + "_count", model=PRESET) > 0
    assert _value(after, "megamoe_ready", "megamoe_ready") == 1.0
    assert _value(after, "megamoe_selftest_runs", "megamoe_selftest_runs_total", level="quick", status="pass") >= 1
    checks = {s.labels["check"]: s.value for s in after["megamoe_selftest_check_status"].samples}
    assert checks["sf_roundtrip"] == 1.0 and checks["gemm_cosine_random"] == 1.0, checks
    assert all(v in (1.0, -1.0) for v in checks.values()), checks  # pass, or skip (moe_vs_reference on torch)


def test_kernel_health_report(server):
    assert server.get("/v1/health/kernels?level=quick")[0] == 401
    status, report = server.get("/v1/health/kernels?level=quick", token=TOKEN)
    assert status == 200, report
    assert report["status"] == "pass", report
    assert {"device", "backend", "versions", "checks"} <= set(report)
    names = {c["name"] for c in report["checks"]}
    assert {"sf_roundtrip", "gemm_cosine_random"} <= names, names
    for check in report["checks"]:
        assert {"name", "status", "metric", "threshold", "detail", "duration_ms"} <= set(check)
        assert check["status"] in ("pass", "skip")
    assert server.get("/v1/health/kernels?level=bogus", token=TOKEN)[0] == 400

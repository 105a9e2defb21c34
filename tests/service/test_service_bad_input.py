"""Bad requests get a clear 4xx ``{"error": ...}`` and change nothing (docs/SPEC.md §6).

The server (conftest ``server``): token required, at most 64 tokens per request, 1 MiB bodies.
"""

from __future__ import annotations

import json
import math

import httpx
import pytest
import torch

from service_testkit import PRESET, TOKEN

H, I, E, K = 256, 128, 8, 2  # the tiny preset (checked against the layer below)
AUTH = {"Authorization": f"Bearer {TOKEN}"}
INFER = f"/v2/models/{PRESET}/infer"


def tensor_json(name, datatype, tensor):
    return {"name": name, "datatype": datatype, "shape": list(tensor.shape), "data": tensor.flatten().tolist()}


def good_json(tokens=3, seed=0):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(tokens, H, generator=gen)
    ids = torch.randint(0, E, (tokens, K), generator=gen, dtype=torch.int32)
    weights = torch.rand(tokens, K, generator=gen)
    return {"inputs": [tensor_json("hidden_states", "FP32", hidden), tensor_json("topk_ids", "INT32", ids),
                       tensor_json("topk_weights", "FP32", weights)]}


def with_input(body, index, **changes):
    body["inputs"][index].update(changes)
    return body


def binary_request(parts: list[tuple[str, str, list[int], bytes]], declared: list[int] | None = None,
                   extra: bytes = b"", truncate: int = 0):
    """A binary-extension body; ``declared`` overrides each binary_data_size."""
    inputs = []
    for i, (name, datatype, shape, raw) in enumerate(parts):
        size = len(raw) if declared is None else declared[i]
        inputs.append({"name": name, "datatype": datatype, "shape": shape, "parameters": {"binary_data_size": size}})
    head = json.dumps({"inputs": inputs}).encode()
    body = head + b"".join(raw for *_, raw in parts) + extra
    if truncate:
        body = body[:-truncate]
    return body, {"Inference-Header-Content-Length": str(len(head)), "Content-Type": "application/octet-stream"}


def fp32_bytes(t: torch.Tensor) -> bytes:
    return t.float().contiguous().numpy().tobytes()


def good_binary_parts(tokens=2):
    gen = torch.Generator().manual_seed(3)
    return [("hidden_states", "FP32", [tokens, H], fp32_bytes(torch.randn(tokens, H, generator=gen))),
            ("topk_ids", "INT32", [tokens, K], torch.randint(0, E, (tokens, K), dtype=torch.int32).numpy().tobytes()),
            ("topk_weights", "FP32", [tokens, K], fp32_bytes(torch.rand(tokens, K, generator=gen)))]


def json_case(body, status=400, match=""):
    return {"content": json.dumps(body, allow_nan=True).encode(), "headers": {"Content-Type": "application/json"},
            "status": status, "match": match}


def raw_case(content: bytes, headers: dict, status=400, match=""):
    return {"content": content, "headers": headers, "status": status, "match": match}


def _nan_hidden():
    body = good_json()
    body["inputs"][0]["data"][7] = math.nan
    return body


def _inf_binary():
    parts = good_binary_parts()
    hidden = torch.randn(2, H)
    hidden[1, 5] = math.inf
    parts[0] = ("hidden_states", "FP32", [2, H], fp32_bytes(hidden))
    return binary_request(parts)


def _nan_weights_binary():
    parts = good_binary_parts()
    parts[2] = ("topk_weights", "FP32", [2, K], fp32_bytes(torch.tensor([[0.5, math.nan], [0.1, 0.2]])))
    return binary_request(parts)


CASES = {
    "malformed_json": raw_case(b'{"inputs": [', {"Content-Type": "application/json"}, match="malformed JSON"),
    "json_not_object": json_case([1, 2], match="JSON object"),
    "no_inputs": json_case({"inputs": []}, match="inputs"),
    "unsupported_datatype": json_case(with_input(good_json(), 0, datatype="FP64"), match="datatype"),
    "hidden_int32": json_case(with_input(good_json(), 0, datatype="INT32",
                                         data=[1] * (3 * H)), match="hidden_states must be one of"),
    "topk_ids_float": json_case(with_input(good_json(1), 1, datatype="FP32"), match="topk_ids must be one of"),
    "topk_weights_int": json_case(with_input(good_json(1), 2, datatype="INT32", data=[1, 0]),
                                  match="topk_weights must be one of"),
    "hidden_rank_1": json_case(with_input(good_json(1), 0, shape=[H]), match="2-D"),
    "hidden_size_mismatch": json_case(with_input(good_json(), 0, shape=[6, H // 2]), match="hidden size mismatch"),
    "data_count_mismatch": json_case(with_input(good_json(), 0, shape=[4, H]), match="elements"),
    "data_strings": json_case(with_input(good_json(1), 1, data=["a", "b"]), match="list of numbers"),
    "data_ragged": json_case(with_input(good_json(1), 1, data=[[1], [2, 3]]), match="list of numbers"),
    "int_not_integer": json_case(with_input(good_json(1), 1, data=[1.5, 2]), match="integers"),
    "topk_id_too_large": json_case(with_input(good_json(1), 1, data=[0, E]), match="out of range"),
    "topk_id_negative": json_case(with_input(good_json(1), 1, data=[-1, 2]), match="out of range"),
    "topk_weights_wrong_shape": json_case(with_input(good_json(1), 2, shape=[1, K + 1], data=[0.1] * (K + 1)),
                                          match="topk_weights must have shape"),
    "topk_ids_wrong_shape": json_case(with_input(good_json(1), 1, shape=[K, 1]), match="topk_ids must have shape"),
    "ids_without_weights": json_case({"inputs": good_json(1)["inputs"][:2]}, match="go together"),
    # with topk_ids given, router_logits is not used for routing, but it is still checked
    "ids_and_bad_logits": json_case({"inputs": good_json(1)["inputs"] + [
        {"name": "router_logits", "datatype": "FP32", "shape": [1, E - 1], "data": [0.0] * (E - 1)}]},
        match="router_logits must have shape"),
    "router_logits_wrong_shape": json_case({"inputs": [good_json(1)["inputs"][0], {
        "name": "router_logits", "datatype": "FP32", "shape": [1, E - 1], "data": [0.0] * (E - 1)}]},
        match="router_logits must have shape"),
    "nan_in_hidden_json": json_case(_nan_hidden(), match="NaN or Inf"),
    "inf_in_hidden_binary": raw_case(*_inf_binary(), match="NaN or Inf"),
    "nan_in_weights_binary": raw_case(*_nan_weights_binary(), match="NaN or Inf"),
    "too_many_tokens": raw_case(*binary_request([("hidden_states", "FP32", [65, H], fp32_bytes(torch.randn(65, H)))]),
                                match="at most 64"),
    "zero_tokens": raw_case(*binary_request([("hidden_states", "FP32", [0, H], b"")]), match="no rows"),
    "unknown_input": json_case({"inputs": good_json(1)["inputs"] + [
        {"name": "extra", "datatype": "FP32", "shape": [1], "data": [1.0]}]}, match="unknown input"),
    "duplicate_input": json_case({"inputs": good_json(1)["inputs"] + good_json(1)["inputs"][:1]}, match="twice"),
    "unknown_output": json_case({**good_json(1), "outputs": [{"name": "logits"}]}, match="unknown output"),
    "binary_truncated": raw_case(*binary_request(good_binary_parts(), truncate=100), match="truncated"),
    "binary_trailing_bytes": raw_case(*binary_request(good_binary_parts(), extra=b"\0" * 8), match="beyond"),
    "binary_size_vs_shape": raw_case(*binary_request(good_binary_parts()[:1], declared=[2 * H * 4 - 4],
                                                     extra=b""), match="binary_data_size"),
    "header_length_too_big": raw_case(b'{"inputs": []}', {"Inference-Header-Content-Length": "999"},
                                      match="Inference-Header-Content-Length"),
    "header_length_not_int": raw_case(b'{"inputs": []}', {"Inference-Header-Content-Length": "ten"},
                                      match="Inference-Header-Content-Length"),
    "binary_without_header_length": raw_case(binary_request(good_binary_parts())[0],
                                             {"Content-Type": "application/octet-stream"}, match="malformed JSON"),
    "gzip_body": raw_case(b"\x1f\x8b", {"Content-Encoding": "gzip"}, match="Content-Encoding"),
    "oversized_body": raw_case(b"x" * ((1 << 20) + 1), {"Content-Type": "application/json"}, status=413,
                               match="exceeds"),
}


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=30) as client:
        yield client


@pytest.fixture(scope="module")
def baseline(http, layer):
    assert (layer.config.hidden_size, layer.config.intermediate_size, layer.config.num_experts,
            layer.config.top_k) == (H, I, E, K)
    reply = http.post(INFER, json=good_json(seed=42), headers=AUTH)
    assert reply.status_code == 200, reply.text
    return reply.json()["outputs"][0]["data"]


def assert_error(reply: httpx.Response, status: int, match: str):
    assert reply.status_code == status, (reply.status_code, reply.text)
    body = reply.json()
    assert set(body) == {"error"} and isinstance(body["error"], str), body
    assert match in body["error"], body["error"]


@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_request_is_refused(http, baseline, case):
    spec = CASES[case]
    reply = http.post(INFER, content=spec["content"], headers={**AUTH, **spec["headers"]})
    assert_error(reply, spec["status"], spec["match"])


def test_oversized_streamed_body_is_413(http, baseline):
    """No Content-Length (chunked): the limit is enforced while reading."""
    def chunks():
        for _ in range(20):
            yield b"y" * (64 * 1024)

    reply = http.post(INFER, content=chunks(), headers=AUTH)
    assert_error(reply, 413, "exceeds")


def test_unknown_model_is_404(http, baseline):
    assert_error(http.post("/v2/models/nope/infer", json=good_json(), headers=AUTH), 404, "unknown model")
    assert_error(http.post(f"/v2/models/{PRESET}/versions/7/infer", json=good_json(), headers=AUTH), 404,
                 f"model '{PRESET}' has no version '7'; this server serves version '1'")
    assert http.post(f"/v2/models/{PRESET}/versions/1/infer", json=good_json(), headers=AUTH).status_code == 200


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Basic {TOKEN}"},
                                     {"Authorization": TOKEN}], ids=["none", "wrong", "basic", "no_scheme"])
def test_token_required(http, baseline, headers):
    reply = http.post(INFER, json=good_json(), headers=headers)
    assert_error(reply, 401, "token")
    assert reply.headers["www-authenticate"] == "Bearer"
    assert_error(http.get("/v1/health/kernels", headers=headers), 401, "token")
    # liveness, readiness, metadata and metrics stay open for probes and scrapers
    for path in ("/v2/health/live", "/v2/health/ready", "/v2", f"/v2/models/{PRESET}", "/metrics"):
        assert http.get(path, headers=headers).status_code == 200, path


def test_not_found_and_method_errors_are_json(http):
    assert_error(http.get("/v3/nothing"), 404, "Not Found")
    assert_error(http.get(INFER, headers=AUTH), 405, "Method Not Allowed")


def test_state_unchanged_after_bad_requests(http, server, baseline, layer):
    """After every bad request above: still ready, and the same input gives the same output."""
    for spec in CASES.values():
        http.post(INFER, content=spec["content"], headers={**AUTH, **spec["headers"]})
    assert http.get("/v2/health/ready").status_code == 200
    reply = http.post(INFER, json=good_json(seed=42), headers=AUTH)
    assert reply.status_code == 200
    assert reply.json()["outputs"][0]["data"] == baseline
    body = good_json(seed=42)["inputs"]
    hidden, ids, weights = (torch.tensor(t["data"]).reshape(t["shape"]) for t in body)
    expected = layer.forward(hidden.float(), topk_ids=ids.int(), topk_weights=weights.float())
    assert torch.equal(torch.tensor(baseline).reshape(expected.shape), expected)
    assert server.proc.poll() is None

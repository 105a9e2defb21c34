"""The service against a hostile client: no 5xx from client input, bounded bodies and
connections, kernel health that does not block inference, no request lost at SIGTERM.

Most tests run the service's own server (``build_server``: the uvicorn server, protocol and
app that ``megamoe serve`` runs) on a thread of this process, which starts in well under a
second and can be stopped exactly as SIGTERM stops it (``handle_exit``). Start-up exits are
tested on real processes.
"""

from __future__ import annotations

import json
import logging
import os
import pickle
import random
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import numpy as np
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from megamoe.moe import MoELayer
from megamoe.service.protocol import ProtocolError, parse_header_length, parse_infer_request
from megamoe.service.server import build_server
from megamoe.service.settings import ServiceSettings
from megamoe_test_backends import SlowDeviceCallsBackend
from service_testkit import PRESET, REPO, TOKEN, LocalServer, free_port, random_inputs

AUTH = {"Authorization": f"Bearer {TOKEN}"}
INFER = f"/v2/models/{PRESET}/infer"
H, E, K = 256, 8, 2  # the tiny preset (checked in served_layer)


@pytest.fixture(scope="module")
def served_layer():
    layer = MoELayer.from_preset(PRESET, seed=0, backend="torch")
    cfg = layer.config
    assert (cfg.hidden_size, cfg.num_experts, cfg.top_k) == (H, E, K)
    return layer


@pytest.fixture(scope="module")
def local(served_layer):
    srv = LocalServer(served_layer, token=TOKEN, max_body_bytes=4 << 20, max_json_body_bytes=2 << 20,
                      timeout_keep_alive_s=0.5, timeout_request_head_s=1.0, timeout_body_s=1.0)
    yield srv
    srv.stop()


def json_body(tokens=2, seed=0, dtype="FP32", **request_fields) -> dict:
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(tokens, H, generator=gen)
    ids = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(tokens)])
    weights = torch.rand(tokens, K, generator=gen) + 0.1
    return {"inputs": [
        {"name": "hidden_states", "datatype": dtype, "shape": [tokens, H], "data": hidden.flatten().tolist()},
        {"name": "topk_ids", "datatype": "INT32", "shape": [tokens, K], "data": ids.flatten().tolist()},
        {"name": "topk_weights", "datatype": "FP32", "shape": [tokens, K], "data": weights.flatten().tolist()},
    ], **request_fields}


def raw_http(port: int, head: bytes, body: bytes = b"", timeout_s: float = 10.0) -> bytes:
    """Send ``head`` + ``body`` on a fresh connection; everything the server sends until it closes."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout_s) as s:
        s.sendall(head + body)
        return _read_until_closed(s, timeout_s)


def _read_until_closed(s: socket.socket, timeout_s: float) -> bytes:
    s.settimeout(timeout_s)
    got = b""
    while True:
        try:
            chunk = s.recv(65536)
        except (ConnectionResetError, socket.timeout):
            return got
        if not chunk:
            return got
        got += chunk


def _read_response(s: socket.socket, timeout_s: float = 10.0) -> bytes:
    """One HTTP response (head and Content-Length body) from ``s``, without waiting for a close."""
    s.settimeout(timeout_s)
    got = b""
    while b"\r\n\r\n" not in got:
        chunk = s.recv(65536)
        if not chunk:
            return got
        got += chunk
    head, _, body = got.partition(b"\r\n\r\n")
    length = next((int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                   if line.lower().startswith(b"content-length:")), 0)
    while len(body) < length:
        chunk = s.recv(65536)
        if not chunk:
            break
        body += chunk
    return head + b"\r\n\r\n" + body


def strict_loads(text):
    """A strict JSON parser: bare NaN / Infinity tokens are errors (as in JavaScript, Go, rapidjson)."""
    def refuse(token):
        raise ValueError(f"not JSON: {token}")

    return json.loads(text, parse_constant=refuse)


# --- 1. client input never answers 5xx ------------------------------------------------------------

def _deep(n: int) -> str:
    return "[" * n + "]" * n


HOSTILE_BODIES = {
    "deep_data": '{"inputs":[{"name":"hidden_states","datatype":"FP32","shape":[1,256],"data":' + _deep(1100) + "}]}",
    "deep_id": '{"id":' + _deep(1100) + ',"inputs":[]}',
    "deep_objects": '{"parameters":' + '{"a":' * 1100 + "1" + "}" * 1100 + "}",
    "int_400_digits": '{"inputs":[{"name":"hidden_states","datatype":"FP32","shape":[1,1],"data":[' + "7" * 400 + "]}]}",
    "int_5000_digits": '{"inputs":[{"name":"hidden_states","datatype":"FP32","shape":[1,1],"data":[' + "7" * 5000 + "]}]}",
    "shape_400_digits": '{"inputs":[{"name":"hidden_states","datatype":"FP32","shape":[' + "9" * 400 + '],"data":[]}]}',
    "shape_huge_zero_size": '{"inputs":[{"name":"hidden_states","datatype":"FP32","shape":[0,99999999999],"data":[]}]}',
    "nan_token": '{"inputs":[{"name":"hidden_states","datatype":"FP32","shape":[1,1],"data":[NaN]}]}',
    "infinity_token": '{"inputs":[{"name":"hidden_states","datatype":"FP32","shape":[1,1],"data":[-Infinity]}]}',
    "float_overflow": '{"inputs":[{"name":"hidden_states","datatype":"FP32","shape":[1,256],"data":[1e999' + ",0" * 255 + "]}]}",
    "data_nested_9_deep": '{"inputs":[{"name":"hidden_states","datatype":"FP32","shape":[1],"data":' + "[" * 9 + "1" + "]" * 9 + "}]}",
    "strings_in_data": '{"inputs":[{"name":"hidden_states","datatype":"FP32","shape":[2],"data":["1","2"]}]}',
    "bool_in_ids": '{"inputs":[{"name":"topk_ids","datatype":"INT64","shape":[1],"data":[true]}]}',
    "duplicate_key": '{"inputs":[],"inputs":[{"name":"hidden_states","datatype":"FP32","shape":[1,256],"data":[0]}]}',
    "not_utf8": b'{"id": "\xff\xfe"}',
    "lone_surrogate": '{"id": "\\ud800", "inputs": []}',
}


def test_hostile_json_is_400_counted_logged_once_and_keeps_the_connection(local, caplog):
    before = local.metric("megamoe_requests_total", route="/v2/models/{model_name}/infer", code="400")
    with caplog.at_level(logging.DEBUG), httpx.Client(base_url=local.url, timeout=30) as client:
        for name, body in HOSTILE_BODIES.items():
            reply = client.post(INFER, content=body if isinstance(body, bytes) else body.encode(),
                                headers={**AUTH, "Content-Type": "application/json"})
            assert reply.status_code == 400, (name, reply.status_code, reply.text[:200])
            assert set(reply.json()) == {"error"}, name
            assert reply.headers.get("connection") != "close", name
            # the same pooled connection serves the next request
            assert client.post(INFER, json=json_body(), headers=AUTH).status_code == 200, name
    after = local.metric("megamoe_requests_total", route="/v2/models/{model_name}/infer", code="400")
    assert after - before == len(HOSTILE_BODIES)
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert errors == [], [r.getMessage()[:200] for r in errors]


def test_an_exception_escaping_a_route_is_one_json_500_and_one_log_line(local, caplog, monkeypatch):
    def broken():
        raise RuntimeError("metadata exploded\nsecond line")

    monkeypatch.setattr(local.state.model, "metadata", broken)
    with caplog.at_level(logging.DEBUG, logger="megamoe.service"), httpx.Client(base_url=local.url, timeout=30) as c:
        before = local.metric("megamoe_requests_total", route="/v2/models/{model_name}", code="500")
        reply = c.get(f"/v2/models/{PRESET}")
        assert reply.status_code == 500 and reply.json() == {"error": "internal error: RuntimeError"}
        assert local.metric("megamoe_requests_total", route="/v2/models/{model_name}", code="500") - before == 1
        assert local.metric("megamoe_request_failures_total", route="/v2/models/{model_name}", reason="internal") >= 1
        assert c.get("/v2/health/live").status_code == 200  # same connection, still usable
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1 and errors[0].name == "megamoe.service", [(r.name, r.getMessage()) for r in errors]
    assert "metadata exploded" in errors[0].getMessage() and "\n" not in errors[0].getMessage()
    assert errors[0].exc_info is None  # the traceback goes to debug, once
    assert sum(1 for r in caplog.records if r.exc_info) == 1


# --- 2. strict parsing ------------------------------------------------------------------------

@pytest.mark.parametrize("value", ["3_67", " 367", "367 ", "+367", "-1", "\u0663\u0666\u0667", "0x10", "", "1" * 40])
def test_header_length_is_plain_decimal(value):
    with pytest.raises(ProtocolError, match="decimal"):
        parse_header_length(value, 10**6)
    assert parse_header_length("367", 400) == 367


def _one_input(**request_fields):
    return {"inputs": [{"name": "x", "datatype": "FP32", "shape": [1], "data": [1.5]}], **request_fields}


@pytest.mark.parametrize("doc, match", [
    (_one_input(parameters={"binary_data_output": "false"}), "JSON boolean"),
    (_one_input(parameters={"binary_data_output": 0}), "JSON boolean"),
    (_one_input(parameters={"binary_data_output": None}), "JSON boolean"),
    (_one_input(outputs=None), "'outputs' must be a list"),
    (_one_input(outputs=[{"name": "output", "parameters": {"binary_data": "true"}}]), "JSON boolean"),
    (_one_input(outputs=[{"name": "output", "parameters": 0}]), "must be a JSON object"),
    (_one_input(parameters=0), "request parameters must be a JSON object"),
    (_one_input(parameters=[]), "request parameters must be a JSON object"),
    (_one_input(parameters=None), "request parameters must be a JSON object"),
    (_one_input(id=None), "'id' must be a string"),
    ({"inputs": [{"name": "x", "datatype": "FP32", "shape": [1], "data": [1.5], "parameters": 0}]}, "parameters must be"),
    ({"inputs": [{"name": "x", "datatype": "INT32", "shape": [1], "data": [1.0]}]}, "JSON integers"),
    ({"inputs": [{"name": "x", "datatype": "INT64", "shape": [1], "data": [2**63]}]}, "out of INT64 range"),
    ({"inputs": [{"name": "x", "datatype": "FP32", "shape": [True], "data": [1.5]}]}, "shape must be"),
    ({"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 2], "data": [[1.5], [2.5, 3.5]]}]}, "ragged"),
])
def test_codec_is_strict(doc, match):
    with pytest.raises(ProtocolError, match=match) as err:
        parse_infer_request(json.dumps(doc).encode(), None)
    assert err.value.status == 400


def test_int64_ids_are_exact():
    big = [2**53 + 1, -(2**63), 2**63 - 1, 3]
    doc = {"inputs": [{"name": "topk_ids", "datatype": "INT64", "shape": [4], "data": big}]}
    got = parse_infer_request(json.dumps(doc).encode(), None).inputs["topk_ids"]
    assert got.dtype == torch.int64 and got.tolist() == big  # float64 would make 2**53 + 1 into 2**53


def test_strict_parsing_over_http(local):
    body = json.dumps(json_body()).encode()
    reply = httpx.post(local.url + INFER, content=body, timeout=30,
                       headers={**AUTH, "Inference-Header-Content-Length": "3_67"})
    assert reply.status_code == 400 and "decimal" in reply.json()["error"]
    ids = json_body()
    ids["inputs"][1].update(datatype="INT64", data=[2**53 + 1] * (2 * K))
    reply = httpx.post(local.url + INFER, json=ids, headers=AUTH, timeout=30)
    assert reply.status_code == 400 and str(2**53 + 1) in reply.json()["error"], reply.text


# --- 3. strict JSON output ------------------------------------------------------------------------

def test_non_finite_outputs_are_json_strings(local, served_layer):
    """BF16 hidden states near the top of the range overflow the layer's own router: the output
    holds NaN. The response stays strict JSON; numpy reads the strings back as the values."""
    # fixed data (not the session seed): with it one row overflows, the other stays finite
    hidden = (torch.randn(2, H, generator=torch.Generator().manual_seed(1)).sign() * 3e38).to(torch.bfloat16)
    expected = served_layer.forward(hidden).float()
    assert bool(torch.isnan(expected).any()), "the yardstick has no non-finite value: the test would be vacuous"
    body = {"inputs": [{"name": "hidden_states", "datatype": "BF16", "shape": [2, H], "data": hidden.float().flatten().tolist()}]}
    reply = httpx.post(local.url + INFER, json=body, headers=AUTH, timeout=30)
    assert reply.status_code == 200, reply.text
    out = strict_loads(reply.text)["outputs"][0]
    assert {v for v in out["data"] if isinstance(v, str)} <= {"NaN", "Infinity", "-Infinity"}
    got = torch.from_numpy(np.array(out["data"], dtype=np.float32)).reshape(out["shape"])
    assert torch.equal(torch.isnan(got), torch.isnan(expected))
    finite = torch.isfinite(expected)
    assert torch.equal(got[finite], expected[finite])


# --- 4. bounded JSON bodies ---------------------------------------------------------------------------

def test_too_many_json_values_are_refused_while_the_body_arrives(local):
    limit = local.plane.json_value_limit  # 64 rows x (256 + 8) + slack
    declared = 8 << 20
    head = (f"POST {INFER} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {min(declared, (2 << 20) - 1)}\r\n\r\n").encode()
    first = b'{"inputs":[{"name":"hidden_states","datatype":"FP32","shape":[9999,256],"data":[' + b"0," * (limit + 10)
    with socket.create_connection(("127.0.0.1", local.port), timeout=10) as s:
        s.sendall(head + first)  # the rest never comes
        reply = _read_response(s)
    assert reply.startswith(b"HTTP/1.1 400"), reply[:200]
    assert f"more than {limit} values".encode() in reply


def test_json_body_over_its_limit_is_413_from_content_length(local):
    head = (f"POST {INFER} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {(2 << 20) + 1}\r\n\r\n").encode()
    with socket.create_connection(("127.0.0.1", local.port), timeout=10) as s:
        s.sendall(head)  # no body sent at all: the answer comes from the header
        reply = _read_response(s)
    assert reply.startswith(b"HTTP/1.1 413") and b"JSON body" in reply, reply[:200]


def test_large_json_body_goes_through_the_decoder_process(local, served_layer):
    hidden, ids, weights = random_inputs(served_layer, 64, seed=9)
    body = {"inputs": [
        {"name": "hidden_states", "datatype": "FP32", "shape": [64, H], "data": hidden.tolist()},
        {"name": "topk_ids", "datatype": "INT32", "shape": [64, K], "data": ids.tolist()},
        {"name": "topk_weights", "datatype": "FP32", "shape": [64, K], "data": weights.tolist()},
    ]}
    raw = json.dumps(body).encode()
    from megamoe.service.dataplane import OFFLOAD_JSON_BYTES, OFFLOAD_JSON_VALUES
    assert len(raw) >= OFFLOAD_JSON_BYTES and 64 * H >= OFFLOAD_JSON_VALUES
    reply = httpx.post(local.url + INFER, content=raw, headers=AUTH, timeout=120)
    assert reply.status_code == 200, reply.text
    out = strict_loads(reply.text)["outputs"][0]
    assert local.plane.decoder is not None
    got = torch.tensor(out["data"]).reshape(out["shape"])
    assert torch.equal(got, served_layer.forward(hidden, topk_ids=ids, topk_weights=weights))


# --- 5. connection timeouts ---------------------------------------------------------------------------

def test_a_connection_that_sends_nothing_is_closed(local):
    t0 = time.monotonic()
    with socket.create_connection(("127.0.0.1", local.port), timeout=10) as s:
        assert _read_until_closed(s, 10) == b""
    assert time.monotonic() - t0 < 5  # timeout_keep_alive_s 0.5


def test_a_slowly_dripped_request_head_is_cut_off(local):
    t0 = time.monotonic()
    with socket.create_connection(("127.0.0.1", local.port), timeout=10) as s:
        s.sendall(b"GET /v2/health/live HTTP/1.1\r\n")
        closed = False
        for i in range(40):  # one header line every 0.2 s, for up to 8 s
            time.sleep(0.2)
            try:
                s.sendall(f"X-Drip-{i}: {i}\r\n".encode())
            except OSError:
                closed = True
                break
            s.settimeout(0.01)
            try:
                if s.recv(1) == b"":
                    closed = True
                    break
            except socket.timeout:
                pass
    assert closed, "the server kept a dripping request head open"
    assert time.monotonic() - t0 < 5  # timeout_request_head_s 1.0


def test_a_slow_body_gets_408_json_and_close(local):
    head = (f"POST {INFER} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN}\r\n"
            "Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n").encode()
    t0 = time.monotonic()
    reply = raw_http(local.port, head, b'{"inputs": [', timeout_s=10)
    assert reply.startswith(b"HTTP/1.1 408"), reply[:200]
    assert b"connection: close" in reply.lower() and b'{"error":' in reply
    assert time.monotonic() - t0 < 5  # timeout_body_s 1.0


def test_a_request_that_is_not_http_gets_json_400(local):
    before = local.metric("megamoe_requests_total", route="unparsed", code="400")
    reply = raw_http(local.port, b"POST /v2 HTTP/1.1\r\nContent-Length: 3\r\nContent-Length: 4\r\n\r\nabc", timeout_s=5)
    assert reply.startswith(b"HTTP/1.1 400"), reply[:200]
    assert b"application/json" in reply and b'{"error": "malformed HTTP request' in reply
    assert local.metric("megamoe_requests_total", route="unparsed", code="400") - before == 1


def test_a_request_head_over_16_kib_gets_json_400_and_close(local):
    before = local.metric("megamoe_requests_total", route="unparsed", code="400")
    # the head in two writes: h11 bounds the part still incomplete, httptools the whole head
    with socket.create_connection(("127.0.0.1", local.port), timeout=5) as s:
        s.sendall(f"GET /v2 HTTP/1.1\r\nHost: x\r\nX-Pad: {'a' * (17 * 1024)}".encode())
        time.sleep(0.3)
        try:
            s.sendall(b"\r\n\r\n")
        except OSError:
            pass  # already answered and closed
        reply = _read_until_closed(s, 5)
    assert reply.startswith(b"HTTP/1.1 400"), reply[:200]
    assert b'{"error": "malformed HTTP request' in reply and b"connection: close" in reply.lower()
    assert local.metric("megamoe_requests_total", route="unparsed", code="400") - before == 1
    ok = raw_http(local.port, f"GET /v2 HTTP/1.1\r\nHost: x\r\nX-Pad: {'a' * 8000}\r\nConnection: close\r\n\r\n".encode(),
                  timeout_s=5)
    assert ok.startswith(b"HTTP/1.1 200"), ok[:200]


def test_a_non_ascii_authorization_header_is_401(local):
    head = (f"POST {INFER} HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n").encode() + \
        "Authorization: Bearer t\u00e4st\r\n\r\n".encode("utf-8")
    reply = raw_http(local.port, head + b"{}", timeout_s=3)
    assert reply.startswith(b"HTTP/1.1 401"), reply[:200]


# --- 6. kernel health does not block inference --------------------------------------------------------

@pytest.fixture(scope="module")
def slow_health():
    layer = MoELayer.from_preset(PRESET, seed=0, backend=SlowDeviceCallsBackend())
    srv = LocalServer(layer, token=TOKEN)
    yield srv
    srv.stop()


def test_health_runs_are_shared_and_yield_to_inference(slow_health):
    srv = slow_health
    runs_before = srv.metric("megamoe_selftest_runs_total", level="quick")
    reports, latencies = [], []

    def health():
        reports.append(httpx.get(srv.url + "/v1/health/kernels?level=quick", headers=AUTH, timeout=120))

    callers = [threading.Thread(target=health) for _ in range(3)]
    t0 = time.monotonic()
    for c in callers:
        c.start()
    time.sleep(0.5)
    # the other level while one runs: refused, not queued behind it
    busy = httpx.get(srv.url + "/v1/health/kernels?level=full", headers=AUTH, timeout=30)
    assert busy.status_code == 429 and busy.headers.get("retry-after") and "in progress" in busy.json()["error"]
    with httpx.Client(base_url=srv.url, timeout=60) as client:
        while any(c.is_alive() for c in callers) and time.monotonic() - t0 < 100:
            started = time.monotonic()
            reply = client.post(INFER, json=json_body(tokens=1, seed=len(latencies)), headers=AUTH)
            assert reply.status_code == 200, reply.text
            latencies.append(time.monotonic() - started)
    for c in callers:
        c.join(120)
    run_s = time.monotonic() - t0
    assert [r.status_code for r in reports] == [200, 200, 200]
    assert len({r.json()["seed"] for r in reports}) == 1, "the three requests did not share one run"
    assert srv.metric("megamoe_selftest_runs_total", level="quick") - runs_before == 1
    # the run holds the device for seconds (0.3 s per GEMM / SF call); each T=1 request waited at most a call or two
    assert run_s > 3.0 and len(latencies) >= 3, (run_s, latencies)
    assert max(latencies) < 1.5, latencies


def test_full_health_needs_a_token(served_layer, caplog):
    with caplog.at_level(logging.INFO, logger="megamoe.service"):
        srv = LocalServer(served_layer)
    try:
        assert any("authentication is off" in r.getMessage() for r in caplog.records)
        reply = httpx.get(srv.url + "/v1/health/kernels?level=full", timeout=30)
        assert reply.status_code == 403 and "token" in reply.json()["error"]
    finally:
        srv.stop()


# --- 7. start-up ----------------------------------------------------------------------------------------

def _serve(env: dict, *args, timeout_s: float = 120) -> subprocess.CompletedProcess:
    child_env = {k: v for k, v in os.environ.items() if not k.startswith("MEGAMOE_")}
    child_env.update(env)
    return subprocess.run([sys.executable, "-m", "megamoe.service", "--host", "127.0.0.1", "--port", "0", *args],
                          cwd=REPO, env=child_env, capture_output=True, text=True, timeout=timeout_s)


@pytest.mark.parametrize("token, match", [("   ", "only whitespace"), ("\t", "only whitespace"),
                                          ("p\u00e4sswort", "non-ASCII"), ("two words", "whitespace")])
def test_unusable_token_stops_start_up(token, match):
    out = _serve({"MEGAMOE_TOKEN": token}, timeout_s=60)
    assert out.returncode == 2, (out.returncode, out.stderr[-2000:])
    assert match in out.stderr
    if token.strip():
        assert token not in out.stderr  # a rejected token is not printed


def test_token_settings():
    assert ServiceSettings(token="").token is None  # compose's ${MEGAMOE_TOKEN:-}
    assert ServiceSettings(token="s3cret-Token_1").token_value() == "s3cret-Token_1"


def test_missing_checkpoint_exits_non_zero(tmp_path):
    out = _serve({}, "--checkpoint", str(tmp_path / "nope.safetensors"), "--selftest-level", "off", "--backend", "torch")
    assert out.returncode == 1, (out.returncode, out.stderr[-2000:])
    assert "cannot be loaded" in out.stderr and "nope.safetensors" in out.stderr


def test_checkpoint_file_is_served_under_its_stem(tmp_path):
    assert ServiceSettings(checkpoint=str(tmp_path / "s.safetensors")).served_model_name() == "s"
    (tmp_path / "layer7").mkdir()
    assert ServiceSettings(checkpoint=str(tmp_path / "layer7")).served_model_name() == "layer7"
    assert ServiceSettings(checkpoint=str(tmp_path / "s.safetensors"), model_name="m").served_model_name() == "m"


def test_synth_writes_files_others_can_read(tmp_path):
    from megamoe.cli import main as cli_main

    old = os.umask(0o022)
    try:
        assert cli_main(["synth", "--preset", PRESET, "--out", str(tmp_path / "s.safetensors"), "--quiet"]) == 0
    finally:
        os.umask(old)
    assert (tmp_path / "s.safetensors").stat().st_mode & 0o777 == 0o644


def test_serve_help_is_plain():
    out = subprocess.run([sys.executable, "-m", "megamoe.service", "--help"], cwd=REPO, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "{str,null}" not in out.stdout and "null" not in out.stdout
    for flag in ("--timeout-keep-alive-s", "--timeout-request-head-s", "--timeout-body-s", "--max-json-body-bytes",
                 "--timeout-write-s", "--instance-heartbeat-timeout-s", "--instance-restarts"):
        assert flag in out.stdout
    # the token is a string to give, not a type name to puzzle over
    assert "SecretStr" not in out.stdout and "--token str" in out.stdout
    # and the settings, token included, still travel to the instance processes (pickled)
    from megamoe.service.settings import parse_settings

    assert pickle.loads(pickle.dumps(parse_settings(["--token", "t0k"]))).token_value() == "t0k"
    # one "(default: ...)" per option: argparse wraps help text, so count per option block
    blocks = [b for b in out.stdout.split("\n  --")[1:]]
    assert blocks and all(b.count("(default") <= 1 for b in blocks), [b for b in blocks if b.count("(default") > 1]


# --- 8. SIGTERM under keep-alive load -----------------------------------------------------------------------

def _sigterm_run(layer, clients: int = 16, load_s: float = 0.3) -> dict:
    srv = LocalServer(layer, graceful_shutdown_s=10.0)
    body = json.dumps(json_body(tokens=1)).encode()
    counts = {"ok": 0, "refused": 0, "lost": 0, "other": 0}
    lock = threading.Lock()
    stop_at = time.monotonic() + 20  # bounded, whatever happens
    sigterm_at: list[float] = []

    def client():
        with httpx.Client(base_url=srv.url, timeout=30) as c:
            while time.monotonic() < stop_at:
                sent_s = time.monotonic()
                try:
                    reply = c.post(INFER, content=body, headers={"Content-Type": "application/json"})
                    kind = "ok" if reply.status_code == 200 else "other"
                    if kind == "other":
                        why = f"HTTP {reply.status_code} {dict(reply.headers)} {reply.text}"
                except httpx.ConnectError:
                    kind = "refused"  # never sent: the listening socket is closed
                except (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError) as exc:
                    kind = "lost"  # sent, and the connection closed without a response
                    why = f"{type(exc).__name__}: {exc!r} (cause: {exc.__cause__!r})"
                if kind in ("lost", "other"):
                    since = sent_s - sigterm_at[0] if sigterm_at else None
                    when = f"sent {since:+.3f} s from SIGTERM" if since is not None else "sent before SIGTERM"
                    with lock:
                        counts.setdefault("why", []).append(f"{kind}: {why} ({when})")
                with lock:
                    counts[kind] += 1
                if kind == "refused":
                    return

    threads = [threading.Thread(target=client) for _ in range(clients)]
    for t in threads:
        t.start()
    # every client has its keep-alive connection and a request in flight or about to be
    while counts["ok"] < 2 * clients and time.monotonic() < stop_at - 10:
        time.sleep(0.01)
    time.sleep(load_s * random.random())
    sigterm_at.append(time.monotonic())
    srv.sigterm()
    for t in threads:
        t.join(30)
    srv.stop()
    return counts


@pytest.mark.parametrize("order", [(signal.SIGTERM, signal.SIGINT), (signal.SIGINT, signal.SIGTERM),
                                   (signal.SIGINT, signal.SIGINT)])
def test_a_repeated_ctrl_c_forces_the_exit_of_a_server_of_its_own_only(served_layer, order, tmp_path, monkeypatch):
    """A second SIGINT forces a lone server's exit (no drain); an instance of several (service/instances.py) gets the
    terminal's SIGINT beside its parent's SIGTERM, in either order, and only drains: a forced exit there tore its
    shutdown down with a traceback in the log."""
    settings = ServiceSettings(host="127.0.0.1", port=free_port(), preset=PRESET, backend="torch",
                               selftest_level="off", log_level="warning")
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path))  # as the parent sets it for its instances
    parent, child = socket.socketpair()
    try:
        for instance in (None, (0, child)):
            server = build_server(settings, layer=served_layer, instance=instance)
            for sig in order:
                server.handle_exit(sig, None)
            assert server.should_exit and server.service_state.draining
            forced = instance is None and order[1] == signal.SIGINT
            assert server.force_exit == forced, (instance, order)
    finally:
        parent.close()
        child.close()


def test_no_request_lost_at_sigterm_under_keep_alive_load(served_layer):
    totals = {"ok": 0, "refused": 0, "lost": 0, "other": 0, "why": []}
    t0 = time.monotonic()
    for _ in range(10):
        for k, v in _sigterm_run(served_layer).items():
            totals[k] += v
    if totals["lost"] or totals["other"]:
        # every reason in full, one per line (a dict in the assertion would be cut short)
        counts = {k: v for k, v in totals.items() if k != "why"}
        pytest.fail(f"requests lost or refused at SIGTERM: {counts}\n" + "\n".join(totals["why"]), pytrace=False)
    assert totals["ok"] >= 10 * 2 * 16 and totals["refused"] <= 10 * 16, totals
    assert time.monotonic() - t0 < 180


def test_a_body_still_arriving_when_the_grace_ends_gets_json_503(served_layer):
    srv = LocalServer(served_layer, graceful_shutdown_s=1.0, timeout_body_s=30.0)
    head = (f"POST {INFER} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            "Content-Length: 100000\r\n\r\n").encode()
    try:
        with socket.create_connection(("127.0.0.1", srv.port), timeout=10) as s:
            s.sendall(head + b'{"inputs": [')
            time.sleep(0.3)
            srv.sigterm()
            reply = _read_until_closed(s, 10)
    finally:
        srv.stop()
    assert reply.startswith(b"HTTP/1.1 503"), reply[:300]
    assert b'{"error":' in reply and b"shutting down" in reply and b"connection: close" in reply.lower()


# --- 9. a small fuzz (the long one: scripts/service_fuzz.py) ---------------------------------------------

def _mutations(rng: random.Random, base: bytes, n: int):
    for _ in range(n):
        b = bytearray(base)
        for _ in range(rng.randint(1, 8)):
            op, i = rng.random(), rng.randrange(len(b))
            if op < 0.4:
                b[i] = rng.randrange(256)
            elif op < 0.6:
                del b[i: i + rng.randint(1, 64)]
            elif op < 0.8:
                b[i:i] = rng.choice([b"[", b"]", b"{", b"}", b",", b'"', b"-", b"e99999", b"null", b"1" * 30,
                                     b"NaN", b"\x00", b"\xff"]) * rng.randint(1, 50)
            else:
                j = rng.randrange(len(b))
                b[i:i] = b[j: j + rng.randint(1, 200)]
        yield bytes(b)


def _schema_requests(rng: random.Random, n: int):
    values = [None, True, 0, -1, 2**63, 1.5, "", "x", [], {}, [1], {"a": 1}, "BF16", "INT64", [-1], [1, 256],
              [2**40], "false", [[1]], {"binary_data_size": 4}, {"binary_data_size": -1}]
    keys_req = ["id", "inputs", "outputs", "parameters"]
    keys_in = ["name", "datatype", "shape", "data", "parameters"]
    for _ in range(n):
        doc = json_body(tokens=rng.randint(1, 3), seed=rng.randrange(1000))
        for _ in range(rng.randint(1, 3)):
            if rng.random() < 0.5:
                doc[rng.choice(keys_req)] = rng.choice(values)
            elif isinstance(doc.get("inputs"), list) and doc["inputs"]:
                spec = rng.choice(doc["inputs"])
                if isinstance(spec, dict):
                    spec[rng.choice(keys_in)] = rng.choice(values)
        yield json.dumps(doc).encode()


def test_small_fuzz_never_answers_5xx(local):
    rng = random.Random(20261201)
    base_json = json.dumps(json_body(tokens=2)).encode()
    hidden = torch.randn(2, H).numpy().tobytes()
    head = json.dumps({"inputs": [{"name": "hidden_states", "datatype": "FP32", "shape": [2, H],
                                   "parameters": {"binary_data_size": len(hidden)}}]}).encode()
    statuses: dict[int, int] = {}
    with httpx.Client(base_url=local.url, timeout=60) as c:
        def send(method, path, **kw):
            reply = c.request(method, path, **kw)
            statuses[reply.status_code] = statuses.get(reply.status_code, 0) + 1
            assert reply.status_code < 500, (path, reply.status_code, reply.text[:300], kw.get("content", b"")[:300])
            if reply.status_code >= 400:
                assert set(reply.json()) == {"error"}

        for body in _schema_requests(rng, 120):
            send("POST", INFER, content=body, headers={**AUTH, "Content-Type": "application/json"})
        for body in _mutations(rng, base_json, 120):
            send("POST", INFER, content=body, headers={**AUTH, "Content-Type": "application/json"})
        for body in _mutations(rng, head + hidden, 80):
            length = str(rng.choice([len(head), len(head) + rng.randint(-5, 5), len(body), 0]))
            send("POST", INFER, content=body, headers={**AUTH, "Inference-Header-Content-Length": length})
        for path in (f"/v2/models/{PRESET}", f"/v2/models/{PRESET}/versions/1", f"/v2/models/{PRESET}/versions/%00",
                     f"/v2/models/{'x' * 3000}", "/v2/models/%ff/ready", f"/v2/models/{PRESET}/versions/2/ready",
                     "/v1/health/kernels?level=%00", "/v1/health/kernels?level=bogus&level=%ff",
                     "/v1/health/kernels?level=" + "q" * 5000, "/v2/health/ready?x=" + "%" * 100):
            send("GET", path, headers=AUTH)  # (no valid level: a real health run takes minutes here)
    assert statuses.get(200, 0) > 0 and sum(v for k, v in statuses.items() if 400 <= k < 500) > 200, statuses

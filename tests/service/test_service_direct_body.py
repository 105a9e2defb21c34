"""Binary infer bodies read straight into their buffer (service/server.py, the buffered httptools
protocol): however the bytes arrive (with the head, dripped, pipelined, answered early), each
request gets exactly its own rows and the connection goes on with the next request. And the pooled
host blocks those bodies live in (service/runner.py PinnedPool) are reused only once nothing uses them.
"""

from __future__ import annotations

import gc
import json
import socket
import time
import weakref

import numpy as np
import pytest
import torch

from megamoe.moe import MoELayer
from megamoe.service import server as server_module
from megamoe.service.runner import PinnedPool
from megamoe.service.protocol import aligned_body, binary_infer_body, build_request, decode_json_request
from service_testkit import PRESET, TOKEN, random_inputs
from test_service_hardening import INFER, LocalServer, _read_response

try:  # the direct body is the httptools protocol's
    import httptools  # noqa: F401
except ImportError:
    pytest.skip("httptools is not installed: the server runs h11, which reads bodies through the app",
                allow_module_level=True)


@pytest.fixture(scope="module")
def served_layer():
    return MoELayer.from_preset(PRESET, seed=0, backend="torch")


@pytest.fixture(scope="module")
def local(served_layer):
    # the tiny preset's bodies are small: every binary infer body takes the direct path here
    patch = pytest.MonkeyPatch()
    patch.setattr(server_module, "DIRECT_BODY_MIN_BYTES", 1)
    srv = LocalServer(served_layer, token=TOKEN, max_body_bytes=4 << 20, timeout_keep_alive_s=2.0,
                      timeout_request_head_s=2.0, timeout_body_s=2.0)
    yield srv
    srv.stop()
    patch.undo()


def binary_request(layer, tokens: int, seed: int, path: str = INFER) -> tuple[bytes, bytes, torch.Tensor]:
    """(head, body, expected output) of a binary infer request with random inputs."""
    hidden, ids, weights = random_inputs(layer, tokens, seed)
    body, header_len = binary_infer_body({"hidden_states": hidden, "topk_ids": ids.int(), "topk_weights": weights})
    head = (f"POST {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN}\r\n"
            f"Content-Type: application/octet-stream\r\nInference-Header-Content-Length: {header_len}\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode()
    expect = layer.forward(hidden, topk_ids=ids, topk_weights=weights)
    return head, body, expect


def output_of(reply: bytes) -> torch.Tensor:
    head, _, body = reply.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200"), reply[:300]
    lines = {k.strip().lower(): v.strip() for k, _, v in (ln.partition(b":") for ln in head.split(b"\r\n")[1:])}
    n = int(lines[b"inference-header-content-length"])
    assert int(lines[b"content-length"]) == len(body)
    shape = json.loads(body[:n])["outputs"][0]["shape"]
    return torch.from_numpy(np.frombuffer(body[n:], dtype=np.float32).copy()).reshape(shape)


def test_bodies_however_they_arrive_on_one_connection(local, served_layer, monkeypatch):
    direct = []
    original = server_module._direct_receive
    monkeypatch.setattr(server_module, "_direct_receive", lambda body: direct.append(body) or original(body))
    requests = [binary_request(served_layer, tokens, seed) for tokens, seed in ((64, 1), (3, 2), (40, 3), (1, 4))]
    with socket.create_connection(("127.0.0.1", local.port), timeout=10) as s:
        # 1: the head with the first 100 body bytes, then the rest dripped in three writes
        head, body, expect = requests[0]
        s.sendall(head + body[:100])
        for part in (body[100:5000], body[5000:-7], body[-7:]):
            time.sleep(0.05)
            s.sendall(part)
        assert torch.equal(output_of(_read_response(s)), expect)
        # 2 and 3 pipelined in one write (3's head right after 2's body), 4 after them
        (h2, b2, e2), (h3, b3, e3), (h4, b4, e4) = requests[1:]
        s.sendall(h2 + b2 + h3 + b3)
        assert torch.equal(output_of(_read_response(s)), e2)
        assert torch.equal(output_of(_read_response(s)), e3)
        s.sendall(h4)
        time.sleep(0.05)
        s.sendall(b4)
        assert torch.equal(output_of(_read_response(s)), e4)
    assert len({id(body) for body in direct}) == 4, "the bodies did not take the direct path"


def test_a_body_answered_before_it_arrived_then_the_next_request(local, served_layer):
    # an unknown model is answered 404 at once; its body keeps arriving, then the connection serves on
    head, body, _ = binary_request(served_layer, 64, 5, path="/v2/models/nope/infer")
    head2, body2, expect2 = binary_request(served_layer, 2, 6)
    with socket.create_connection(("127.0.0.1", local.port), timeout=10) as s:
        s.sendall(head + body[:10])
        first = _read_response(s)
        assert first.startswith(b"HTTP/1.1 404"), first[:200]
        assert b"unknown model 'nope'" in first
        s.sendall(body[10:])
        s.sendall(head2 + body2)
        assert torch.equal(output_of(_read_response(s)), expect2)


def test_a_client_gone_mid_body_leaves_the_server_serving(local, served_layer):
    head, body, _ = binary_request(served_layer, 64, 7)
    before = local.metric("megamoe_requests_total", code="400")
    with socket.create_connection(("127.0.0.1", local.port), timeout=10) as s:
        s.sendall(head + body[: len(body) // 2])
        time.sleep(0.1)
    deadline = time.monotonic() + 5
    while local.metric("megamoe_requests_total", code="400") == before and time.monotonic() < deadline:
        time.sleep(0.02)
    assert local.metric("megamoe_requests_total", code="400") == before + 1
    head2, body2, expect2 = binary_request(served_layer, 5, 8)
    with socket.create_connection(("127.0.0.1", local.port), timeout=10) as s:
        s.sendall(head2 + body2)
        assert torch.equal(output_of(_read_response(s)), expect2)


def test_a_pooled_block_is_reused_only_once_nothing_uses_it():
    allocated = []

    def allocate(nbytes):
        block = np.full(nbytes, 0xAB, dtype=np.uint8)  # poisoned: a test never reads it back unwritten
        allocated.append(block)
        return block

    pool = PinnedPool(allocate)
    gen = torch.Generator().manual_seed(11)
    hidden = torch.randn(3, 40, generator=gen)
    header = json.dumps({"inputs": [{"name": "hidden_states", "datatype": "FP32", "shape": [3, 40],
                                     "parameters": {"binary_data_size": hidden.nbytes}}]}).encode()
    view = aligned_body(len(header) + hidden.nbytes, len(header), pool.take(len(header) + hidden.nbytes + 64))
    view[:] = header + hidden.numpy().tobytes()
    tensor = build_request(decode_json_request(view[:len(header)]), view[len(header):]).inputs["hidden_states"]
    del view
    gc.collect()
    assert pool.pooled_bytes == 0, "a block went back to the pool while a tensor still views it"
    rows = tensor[1:]
    del tensor
    gc.collect()
    assert pool.pooled_bytes == 0, "a block went back to the pool while a slice of its tensor is alive"
    assert torch.equal(rows, hidden[1:])
    del rows
    gc.collect()
    assert pool.pooled_bytes == PinnedPool.MIN_BYTES
    again = pool.take(100)  # the same block, not a new one
    assert len(allocated) == 1 and np.shares_memory(again, allocated[0])
    bigger = pool.take(PinnedPool.MIN_BYTES + 1)  # the next size up: a new block
    assert len(allocated) == 2 and len(allocated[1]) == 2 * PinnedPool.MIN_BYTES and len(bigger) == PinnedPool.MIN_BYTES + 1


def test_a_direct_body_is_freed_without_the_garbage_collector(local, served_layer, monkeypatch):
    # no reference cycle may hold a body's buffer: on a CUDA device it is a pooled pinned block,
    # and one held until the collector runs makes the pool allocate more pinned memory meanwhile
    buffers = []

    def body_buffer(declared, header_length):
        raw = np.full(declared + 64, 0xCD, dtype=np.uint8)
        buffers.append(weakref.ref(raw))
        return aligned_body(declared, header_length, raw)

    monkeypatch.setattr(local.state, "body_buffer", body_buffer)
    requests = [binary_request(served_layer, 8, 20 + i) for i in range(3)]
    gc.collect()
    gc.disable()
    try:
        with socket.create_connection(("127.0.0.1", local.port), timeout=10) as s:
            for head, body, expect in requests:
                s.sendall(head + body)
                assert torch.equal(output_of(_read_response(s)), expect)
        deadline = time.monotonic() + 5
        while any(ref() is not None for ref in buffers[:2]) and time.monotonic() < deadline:
            time.sleep(0.02)
        # the last one may still be the connection's current request; the earlier ones must be gone
        assert len(buffers) == 3
        assert all(ref() is None for ref in buffers[:2]), "a direct body outlived its request"
    finally:
        gc.enable()

"""Nothing is reserved before a request is allowed: route and token are checked before a body gets a
buffer, a refused request's body is discarded as it arrives, a reset frees its body's buffer, a client
that does not read its answer is cut off after ``timeout_write_s``, pooled pinned blocks are capped,
and ``Upgrade: h2c`` is ignored (RFC 9110 section 7.8)."""

from __future__ import annotations

import json
import socket
import struct
import threading
import time
import weakref

import numpy as np
import pytest
import torch

from megamoe.moe import MoELayer
from megamoe.service.runner import PinnedPool
from megamoe.service.protocol import binary_infer_body

from service_testkit import PRESET, TOKEN, LocalServer, random_inputs

INFER = f"/v2/models/{PRESET}/infer"


@pytest.fixture(scope="module")
def layer():
    return MoELayer.from_preset(PRESET, seed=0, backend="torch")


@pytest.fixture(scope="module")
def srv(layer):
    server = LocalServer(layer, token=TOKEN, max_tokens_per_request=4096, max_batch_tokens=8192,
                         max_body_bytes=8 << 20, timeout_body_s=3.0, timeout_write_s=1.0)
    reserved: list = []
    original = server.state.body_buffer

    def recording(declared, header_length):
        view = original(declared, header_length)
        reserved.append((declared, weakref.ref(view.obj)))
        return view

    server.state.body_buffer = recording
    server.reserved = reserved
    yield server
    server.stop()


def _binary(layer, tokens: int, seed: int = 0):
    hidden, ids, weights = random_inputs(layer, tokens, seed)
    body, header_length = binary_infer_body({"hidden_states": hidden, "topk_ids": ids, "topk_weights": weights})
    return body, header_length, layer.forward(hidden, topk_ids=ids, topk_weights=weights)


def _head(path: str, body_len: int, header_length: int | None = None, token: str | None = TOKEN,
          extra: str = "") -> bytes:
    lines = [f"POST {path} HTTP/1.1", "Host: x", f"Content-Length: {body_len}"]
    if header_length is not None:
        lines.append(f"Inference-Header-Content-Length: {header_length}")
    if token:
        lines.append(f"Authorization: Bearer {token}")
    return ("\r\n".join(lines) + "\r\n" + extra + "\r\n").encode()


def _response(sock: socket.socket, timeout_s: float = 20.0) -> tuple[int, dict, bytes]:
    sock.settimeout(timeout_s)
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, f"connection closed before a response: {data!r}"
        data += chunk
    head, _, rest = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {k.lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    length = int(headers.get("content-length", 0))
    while len(rest) < length:
        chunk = sock.recv(65536)
        assert chunk, "connection closed in the body"
        rest += chunk
    return int(lines[0].split()[1]), headers, rest[:length]


def _output(headers: dict, body: bytes) -> torch.Tensor:
    if "inference-header-content-length" in headers:
        n = int(headers["inference-header-content-length"])
        meta = json.loads(body[:n])["outputs"][0]
        return torch.frombuffer(bytearray(body[n:]), dtype=torch.float32).reshape(meta["shape"])
    meta = json.loads(body)["outputs"][0]
    return torch.tensor(meta["data"], dtype=torch.float32).reshape(meta["shape"])


@pytest.mark.parametrize("path, token", [("/no/such/route/infer", TOKEN), (INFER, None), (INFER, "wrong"),
                                         ("/v2/models/other/infer", TOKEN)])
def test_no_buffer_before_route_and_token_and_the_body_is_discarded(srv, layer, path, token):
    body, header_length, _ = _binary(layer, 1024)  # 1 MiB: a body the server would read directly
    good, good_length, expected = _binary(layer, 3, seed=1)
    before = len(srv.reserved)
    with socket.create_connection(("127.0.0.1", srv.port)) as sock:
        sock.sendall(_head(path, len(body), header_length, token))
        status, _, _ = _response(sock)
        assert status in (401, 404), status
        sock.sendall(body)  # arrives after the answer: discarded, the connection stays usable
        sock.sendall(_head(INFER, len(good), good_length) + good)
        status, headers, answer = _response(sock)
        assert status == 200, answer[:300]
        torch.testing.assert_close(_output(headers, answer), expected, rtol=0, atol=0)
    assert all(declared != len(body) for declared, _ in srv.reserved[before:]), "a refused body got a buffer"


def test_a_declared_size_over_the_limit_reserves_nothing(srv):
    before = len(srv.reserved)
    with socket.create_connection(("127.0.0.1", srv.port)) as sock:
        sock.sendall(_head(INFER, (8 << 20) + 1, 100))
        status, _, answer = _response(sock)
    assert status == 413, answer
    assert len(srv.reserved) == before


def test_a_reset_frees_the_body_buffer(srv, layer):
    body, header_length, _ = _binary(layer, 2048)  # 2 MiB
    before = len(srv.reserved)
    sock = socket.create_connection(("127.0.0.1", srv.port))
    sock.sendall(_head(INFER, len(body), header_length) + body[:300_000])
    deadline = time.monotonic() + 10
    while len(srv.reserved) == before and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(srv.reserved) == before + 1
    buffer_alive = srv.reserved[-1][1]
    assert buffer_alive() is not None
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()  # RST
    deadline = time.monotonic() + 5
    while buffer_alive() is not None and time.monotonic() < deadline:
        time.sleep(0.02)
    assert buffer_alive() is None, "the body buffer of a reset connection is still held"


def test_a_client_that_does_not_read_its_answers_is_cut_off(srv, layer):
    body, header_length, _ = _binary(layer, 4096)  # 4 MiB in, 4 MiB out per request
    connections = srv.server.server_state.connections
    before = len(connections)
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", srv.port))
    try:
        stop = threading.Event()

        def send():  # pipelined requests, answers never read
            try:
                for _ in range(6):
                    if stop.is_set():
                        return
                    sock.sendall(_head(INFER, len(body), header_length) + body)
            except OSError:
                pass

        sender = threading.Thread(target=send, daemon=True)
        sender.start()
        deadline = time.monotonic() + 5
        while len(connections) <= before and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(connections) > before
        deadline = time.monotonic() + 15
        while len(connections) > before and time.monotonic() < deadline:
            time.sleep(0.05)
        stop.set()
        assert len(connections) == before, "a connection whose client reads nothing is still open"
    finally:
        sock.close()


UPGRADE = "Connection: Upgrade, HTTP2-Settings\r\nUpgrade: h2c\r\nHTTP2-Settings: AAMAAABkAAQAAP__\r\n"


def test_upgrade_h2c_is_ignored(srv, layer):
    hidden, ids, weights = random_inputs(layer, 2, 5)
    doc = json.dumps({"inputs": [
        {"name": "hidden_states", "datatype": "FP32", "shape": [2, hidden.shape[1]], "data": hidden.flatten().tolist()},
        {"name": "topk_ids", "datatype": "INT32", "shape": list(ids.shape), "data": ids.flatten().tolist()},
        {"name": "topk_weights", "datatype": "FP32", "shape": list(weights.shape), "data": weights.flatten().tolist()},
    ]}).encode()
    expected = layer.forward(hidden, topk_ids=ids, topk_weights=weights)
    binary, header_length, expected_binary = _binary(layer, 3, seed=6)
    with socket.create_connection(("127.0.0.1", srv.port)) as sock:
        # the head alone first, then the body: and both in one write
        sock.sendall(_head(INFER, len(doc), extra=UPGRADE))
        time.sleep(0.05)
        sock.sendall(doc)
        status, headers, answer = _response(sock)
        assert status == 200, answer[:300]
        torch.testing.assert_close(_output(headers, answer), expected, rtol=0, atol=0)
        sock.sendall(_head(INFER, len(binary), header_length, extra=UPGRADE) + binary
                     + _head(INFER, len(doc)) + doc)  # and a pipelined plain request after it
        status, headers, answer = _response(sock)
        assert status == 200, answer[:300]
        torch.testing.assert_close(_output(headers, answer), expected_binary, rtol=0, atol=0)
        status, headers, answer = _response(sock)
        assert status == 200, answer[:300]
        torch.testing.assert_close(_output(headers, answer), expected, rtol=0, atol=0)
        # refused (no token): its body discarded, the connection closed after the 401
        sock.sendall(_head(INFER, len(doc), token=None, extra=UPGRADE) + doc)
        status, headers, _ = _response(sock)
        assert status == 401 and headers.get("connection") == "close"


def test_pooled_pinned_blocks_are_capped():
    allocated, released = [], []

    def allocate(n):
        allocated.append(np.empty(n, dtype=np.uint8))
        return allocated[-1]

    pool = PinnedPool(allocate, max_pooled_bytes=2 * PinnedPool.MIN_BYTES, release=lambda: released.append(1))
    views = [pool.take(PinnedPool.MIN_BYTES) for _ in range(4)]
    assert len(allocated) == 4
    del views
    assert pool.pooled_bytes == 2 * PinnedPool.MIN_BYTES  # two kept, two let go
    assert not released
    pool.take(10)  # a kept block, and the let-go ones returned to the system first
    assert released == [1] and len(allocated) == 4

"""Unit tests without a server: the v2 codec, the dynamic batcher, the settings."""

from __future__ import annotations

import asyncio
import json
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from megamoe.service.batching import DynamicBatcher
from megamoe.service.model import ModelRequest
from megamoe.service.protocol import (
    BodyBuffer,
    ProtocolError,
    binary_aligned,
    build_request,
    decode_json_request,
    encode_infer_response,
    parse_header_length,
    parse_infer_request,
)
from megamoe.service.settings import parse_settings


# --- codec -------------------------------------------------------------------------

def binary_body(tensors: dict[str, tuple[str, torch.Tensor]], **request_fields) -> tuple[bytes, int]:
    inputs, blobs = [], []
    for name, (datatype, t) in tensors.items():
        raw = t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        inputs.append({"name": name, "datatype": datatype, "shape": list(t.shape),
                       "parameters": {"binary_data_size": len(raw)}})
        blobs.append(raw)
    head = json.dumps({"inputs": inputs, **request_fields}).encode()
    return head + b"".join(blobs), len(head)


@pytest.mark.parametrize("datatype, dtype", [("BF16", torch.bfloat16), ("FP16", torch.float16),
                                             ("FP32", torch.float32), ("INT32", torch.int32), ("INT64", torch.int64)])
def test_binary_roundtrip_is_bit_exact(datatype, dtype):
    gen = torch.Generator().manual_seed(0)
    t = (torch.randn(5, 48, generator=gen) * 100).to(dtype)
    body, head = binary_body({"a": (datatype, t), "b": ("FP32", torch.randn(2, 3, generator=gen))})
    parsed = parse_infer_request(body, parse_header_length(str(head), len(body)))
    assert parsed.datatypes["a"] == datatype
    assert parsed.inputs["a"].dtype == dtype and torch.equal(parsed.inputs["a"], t)

    out, headers = encode_infer_response("m", "1", "id-1", [("output", t, True)])
    n = int(headers["Inference-Header-Content-Length"])
    meta = json.loads(out[:n])
    assert meta["id"] == "id-1" and meta["outputs"][0]["datatype"] == datatype
    assert meta["outputs"][0]["parameters"]["binary_data_size"] == len(out) - n
    back = torch.frombuffer(bytearray(out[n:]), dtype=dtype).reshape(t.shape)
    assert torch.equal(back, t)


@pytest.mark.parametrize("chunk", [1, 7, 4096, 1 << 20])
def test_body_buffer_aligns_the_binary_part_and_decodes_without_a_copy(chunk):
    gen = torch.Generator().manual_seed(1)
    t = torch.randn(33, 64, generator=gen)
    ids = torch.randint(-5, 9, (33, 3), generator=gen, dtype=torch.int32)
    body, head = binary_body({"x": ("FP32", t), "ids": ("INT32", ids)}, id="r" * 7)  # odd-length header
    assert head % 4
    buf = BodyBuffer(len(body), head)
    for i in range(0, len(body), chunk):
        buf.append(body[i:i + chunk])
    got = buf.body()
    assert bytes(got) == body and binary_aligned(got[head:])
    parsed = build_request(decode_json_request(got[:head], None), got[head:])
    assert torch.equal(parsed.inputs["x"], t) and torch.equal(parsed.inputs["ids"], ids)
    # zero-copy: the tensor is the body's memory (a write to the body shows in it)
    got[head:head + 4] = bytes(4)
    assert parsed.inputs["x"][0, 0].item() == 0.0 and t[0, 0].item() != 0.0


def test_body_buffer_without_or_beyond_its_declared_length_keeps_every_byte():
    for declared in (None, 5):
        buf = BodyBuffer(declared, 3)
        for piece in (b"abc", b"", b"defg", b"hij"):
            buf.append(piece)
        assert bytes(buf.body()) == b"abcdefghij" and buf.size == 10


def test_bf16_binary_is_the_raw_two_byte_pattern():
    t = torch.tensor([[1.0, -2.5, 3.140625]], dtype=torch.bfloat16)
    body, head = binary_body({"x": ("BF16", t)})
    assert body[head:] == bytes.fromhex("803f" "20c0" "4940")  # little-endian bfloat16 bits
    out, headers = encode_infer_response("m", "1", None, [("output", t, False)])
    assert json.loads(out)["outputs"][0]["data"] == [1.0, -2.5, 3.140625]
    assert headers["content-type"] == "application/json"


def test_json_nested_and_flat_data_agree():
    nested = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [2, 3], "data": [[1, 2, 3], [4, 5, 6.5]]}]}
    flat = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [2, 3], "data": [1, 2, 3, 4, 5, 6.5]}]}
    a = parse_infer_request(json.dumps(nested).encode(), None).inputs["x"]
    b = parse_infer_request(json.dumps(flat).encode(), None).inputs["x"]
    assert torch.equal(a, b) and a.shape == (2, 3)


@pytest.mark.parametrize("body, header, match", [
    (b"{", None, "malformed JSON"),
    (b'{"inputs": [{"name": "x", "datatype": "INT32", "shape": [1], "data": [3000000000]}]}', None, "range"),
    (b'{"inputs": [{"name": "x", "datatype": "FP32", "shape": [-1], "data": []}]}', None, "shape must be a list"),
    (b'{"inputs": [{"name": "x", "datatype": "FP16", "shape": [2], "data": [1, 70000]}]}', None, "out of FP16 range"),
    (b'{"inputs": [{"name": "x", "datatype": "FP32", "shape": [1]}]}', None, "neither"),
    (b'{"inputs": [{"name": "x", "datatype": "FP32", "shape": [1], "data": [1], '
     b'"parameters": {"binary_data_size": 4}}]}', "0", "both"),
    (b'{"inputs": [{"name": 3}]}', None, "string 'name'"),
    (b'{"inputs": [{"name": "x", "datatype": "FP32", "shape": [1], "data": [1]}], "id": 5}', None, "'id'"),
])
def test_codec_rejects(body, header, match):
    with pytest.raises(ProtocolError, match=match) as err:
        parse_infer_request(body, None if header is None else parse_header_length(str(len(body) if header == "0" else header), len(body)))
    assert err.value.status == 400


# --- batcher --------------------------------------------------------------------------

def request(tokens: int, value: float, dtype=torch.float32, mode="topk") -> ModelRequest:
    hidden = torch.full((tokens, 4), value, dtype=dtype)
    return ModelRequest(hidden, mode)


def test_batcher_groups_compatible_requests_and_splits_exactly():
    calls = []

    def run_batch(reqs):
        calls.append([(r.tokens, r.batch_key) for r in reqs])
        stacked = torch.cat([r.hidden_states for r in reqs])
        return list((stacked * 2).split([r.tokens for r in reqs]))

    async def scenario():
        executor = ThreadPoolExecutor(1)
        batcher = DynamicBatcher(run_batch, executor, max_batch_tokens=10, queue_delay_s=0.05)
        batcher.start()
        reqs = [request(3, 1), request(4, 2), request(2, 3, torch.bfloat16), request(5, 4),
                request(1, 5, mode="router"), request(2, 6)]
        results = await asyncio.gather(*(batcher.submit(r) for r in reqs))
        await batcher.stop()
        executor.shutdown()
        return reqs, results

    reqs, results = asyncio.run(scenario())
    for req, res in zip(reqs, results):
        assert torch.equal(res.output, req.hidden_states * 2)  # each caller: exactly its own rows
        assert res.batch_tokens <= 10
    # fp32/topk requests of 3+4+2 tokens share a batch (5 does not fit in 10); bf16 and router go alone
    # (the key's last part: whether the requests carry token ids, none here)
    key = (torch.float32, "topk", False)
    assert calls[0] == [(3, key), (4, key), (2, key)]
    assert sorted(len(c) for c in calls) == [1, 1, 1, 3]
    assert sum(len(c) for c in calls) == len(reqs)


def test_batcher_failure_reaches_every_caller_of_the_batch_and_it_keeps_serving():
    def run_batch(reqs):
        if any(float(r.hidden_states[0, 0]) < 0 for r in reqs):
            raise RuntimeError("device fault")
        return [r.hidden_states + 1 for r in reqs]

    async def scenario():
        executor = ThreadPoolExecutor(1)
        batcher = DynamicBatcher(run_batch, executor, max_batch_tokens=64, queue_delay_s=0.02)
        batcher.start()
        bad = await asyncio.gather(batcher.submit(request(1, -1)), batcher.submit(request(1, 2)),
                                   return_exceptions=True)
        good = await batcher.submit(request(2, 7))
        await batcher.stop()
        executor.shutdown()
        return bad, good

    bad, good = asyncio.run(scenario())
    assert all(isinstance(b, RuntimeError) for b in bad)
    assert torch.equal(good.output, torch.full((2, 4), 8.0))


def test_batcher_survives_a_failing_metrics_callback_and_a_short_output_list():
    def on_batch(n, tokens, seconds):
        raise ValueError("metrics backend down")

    def run_batch(reqs):
        outs = [r.hidden_states * 3 for r in reqs]
        return outs[:-1] if float(reqs[0].hidden_states[0, 0]) == 5 else outs  # value 5: one output lost

    async def scenario():
        executor = ThreadPoolExecutor(1)
        batcher = DynamicBatcher(run_batch, executor, max_batch_tokens=64, queue_delay_s=0.02, on_batch=on_batch)
        batcher.start()
        first = await asyncio.wait_for(batcher.submit(request(2, 1)), 5)  # callback raises after the results
        short = await asyncio.wait_for(asyncio.gather(batcher.submit(request(1, 5)), batcher.submit(request(1, 6)),
                                                      return_exceptions=True), 5)
        after = await asyncio.wait_for(batcher.submit(request(1, 2)), 5)  # the loop is still alive
        await batcher.stop()
        executor.shutdown()
        return first, short, after

    first, short, after = asyncio.run(scenario())
    assert torch.equal(first.output, torch.full((2, 4), 3.0))
    assert all(isinstance(r, RuntimeError) and "outputs" in str(r) for r in short)
    assert torch.equal(after.output, torch.full((1, 4), 6.0))


# --- settings ---------------------------------------------------------------------------

def test_settings_env_then_flags(monkeypatch):
    monkeypatch.setenv("MEGAMOE_PRESET", "tiny")
    monkeypatch.setenv("MEGAMOE_QUEUE_DELAY_MS", "7.5")
    monkeypatch.setenv("MEGAMOE_TOKEN", "")  # compose's ${MEGAMOE_TOKEN:-}: no authentication
    s = parse_settings(["--queue-delay-ms", "3", "--port", "9000"])
    assert (s.preset, s.queue_delay_ms, s.port, s.token_value()) == ("tiny", 3.0, 9000, None)
    monkeypatch.setenv("MEGAMOE_TOKEN", "secret")
    assert parse_settings([]).token_value() == "secret"
    assert "secret" not in repr(parse_settings([]))


def test_settings_reject_a_batch_smaller_than_a_request():
    with pytest.raises(ValueError, match="max_batch_tokens"):
        parse_settings(["--max-batch-tokens", "8", "--max-tokens-per-request", "16"])

"""``input_ids``: the optional [T] token-id input (INT32/INT64) that a hash-routed layer (DeepSeek-V4's
``hash_moe``: experts = tid2eid[input_ids]) needs. In the metadata and the model config; passed to the
layer's forward; a hash-routed model called without it answers 400 naming it; a batch concatenates the
ids alongside the rows; a request without ids to a model that does not route by them is served as before.

A hash-routed stand-in (the tiny layer, its experts chosen by a fixed table, fixed weights) makes every
test here independent of the library's own hash routing; the last test serves the library's hash-routed
layer where it exists.
"""

from __future__ import annotations

import asyncio
import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch

from megamoe.moe import MoELayer
from megamoe.service.batching import DynamicBatcher
from megamoe.service.model import ServedModel
from megamoe.service.protocol import ProtocolError
from megamoe.service.runner import BatchRunner

from service_testkit import PRESET, TOKEN, LocalServer, random_inputs

AUTH = {"Authorization": f"Bearer {TOKEN}"}
INFER = f"/v2/models/{PRESET}/infer"
VOCAB = 50


class _Weights:
    def __init__(self, inner, table):
        self._inner, self.tid2eid = inner, table

    def __getattr__(self, name):
        return getattr(self._inner, name)


class HashRouted:
    """The tiny layer routed by token id: experts tid2eid[input_ids], weights 0.75 / 0.25. Routed by
    the caller (topk_ids + topk_weights), it is the tiny layer."""

    needs_input_ids = True

    def __init__(self, layer, seed: int = 7):
        gen = torch.Generator().manual_seed(seed)
        cfg = layer.config
        table = torch.stack([torch.randperm(cfg.num_experts, generator=gen)[: cfg.top_k] for _ in range(VOCAB)])
        self.inner, self.config, self.backend, self.device = layer, layer.config, layer.backend, layer.device
        self.weights = _Weights(layer.weights, table)
        self.calls: list[dict] = []

    def forward(self, hidden_states, topk_ids=None, topk_weights=None, router_logits=None, validate=True,
                input_ids=None):
        self.calls.append({"rows": hidden_states.shape[0], "input_ids": input_ids})
        if topk_ids is None:
            if input_ids is None:
                raise ValueError("input_ids is required by a hash-routed layer")
            topk_ids = self.weights.tid2eid[input_ids.long()].int()
            topk_weights = torch.tensor([0.75, 0.25]).expand(hidden_states.shape[0], 2).contiguous()
        return self.inner.forward(hidden_states, topk_ids=topk_ids, topk_weights=topk_weights)

    def expected(self, hidden, input_ids):
        ids = self.weights.tid2eid[input_ids.long()].int()
        weights = torch.tensor([0.75, 0.25]).expand(hidden.shape[0], 2).contiguous()
        return self.inner.forward(hidden, topk_ids=ids, topk_weights=weights)


class TakesIds(HashRouted):
    """A layer that takes token ids but does not route by them (ignores them)."""

    needs_input_ids = False

    def forward(self, hidden_states, topk_ids=None, topk_weights=None, router_logits=None, validate=True,
                input_ids=None):
        self.calls.append({"rows": hidden_states.shape[0], "input_ids": input_ids})
        return self.inner.forward(hidden_states, topk_ids, topk_weights, router_logits)


@pytest.fixture(scope="module")
def tiny():
    return MoELayer.from_preset(PRESET, seed=0, backend="torch")


def _body(hidden, input_ids=None, datatype="INT64", routing=None) -> bytes:
    inputs = [{"name": "hidden_states", "datatype": "FP32", "shape": list(hidden.shape),
               "data": hidden.flatten().tolist()}]
    if input_ids is not None:
        inputs.append({"name": "input_ids", "datatype": datatype, "shape": list(input_ids.shape),
                       "data": input_ids.tolist()})
    if routing is not None:
        ids, weights = routing
        inputs += [{"name": "topk_ids", "datatype": "INT32", "shape": list(ids.shape), "data": ids.flatten().tolist()},
                   {"name": "topk_weights", "datatype": "FP32", "shape": list(weights.shape),
                    "data": weights.flatten().tolist()}]
    return json.dumps({"inputs": inputs}).encode()


def _output(reply: httpx.Response) -> torch.Tensor:
    out = reply.json()["outputs"][0]
    return torch.tensor(out["data"], dtype=torch.float32).reshape(out["shape"])


def test_metadata_and_config_advertise_input_ids(tiny):
    hashed = ServedModel("m", HashRouted(tiny), 64)
    meta = {i["name"]: i for i in hashed.metadata()["inputs"]}
    assert meta["input_ids"] == {"name": "input_ids", "datatype": "INT32", "shape": [-1],
                                 "parameters": {"datatypes": ["INT32", "INT64"]}}  # required: not optional
    assert hashed.metadata()["parameters"]["hash_routing"] is True
    config = {i["name"]: i for i in hashed.triton_config(2.0, 1024)["input"]}
    assert config["input_ids"]["dims"] == [-1] and config["input_ids"]["data_type"] == "TYPE_INT32"
    assert config["input_ids"]["optional"] is False
    # a layer that takes ids without routing by them: optional
    plain = ServedModel("m", TakesIds(tiny), 64)
    assert {i["name"]: i for i in plain.metadata()["inputs"]}["input_ids"]["optional"] is True
    assert {i["name"]: i for i in plain.triton_config(2.0, 1024)["input"]}["input_ids"]["optional"] is True


def test_validation_of_input_ids(tiny):
    served = ServedModel("m", HashRouted(tiny), 64)
    hidden = torch.randn(3, tiny.config.hidden_size)
    with pytest.raises(ProtocolError, match="input 'input_ids' is required"):
        served.validate({"hidden_states": hidden}, {"hidden_states": "FP32"})
    with pytest.raises(ProtocolError, match=r"input_ids must have shape \[3\]"):
        served.validate({"hidden_states": hidden, "input_ids": torch.zeros(2, dtype=torch.int64)},
                        {"hidden_states": "FP32", "input_ids": "INT64"})
    with pytest.raises(ProtocolError, match="input_ids must be one of"):
        served.validate({"hidden_states": hidden, "input_ids": torch.zeros(3)},
                        {"hidden_states": "FP32", "input_ids": "FP32"})
    with pytest.raises(ProtocolError, match=f"input_ids out of range: {VOCAB}"):
        served.validate({"hidden_states": hidden, "input_ids": torch.tensor([0, VOCAB, 1], dtype=torch.int32)},
                        {"hidden_states": "FP32", "input_ids": "INT32"})
    request = served.validate({"hidden_states": hidden, "input_ids": torch.tensor([4, 5, 6], dtype=torch.int32)},
                              {"hidden_states": "FP32", "input_ids": "INT32"})
    assert request.input_ids.dtype == torch.int64 and request.input_ids.tolist() == [4, 5, 6]
    # routed by the caller: no ids needed
    _, ids, weights = random_inputs(tiny, 3, 1)
    assert served.validate({"hidden_states": hidden, "topk_ids": ids, "topk_weights": weights},
                           {"hidden_states": "FP32", "topk_ids": "INT32", "topk_weights": "FP32"}).mode == "topk"


def _batched(served: ServedModel, requests: list):
    """Every request submitted at once to a batcher over ``served`` (one batch when their keys agree)."""
    async def main():
        executor = ThreadPoolExecutor(1)
        batcher = DynamicBatcher(BatchRunner(served).forward_batch, executor, max_batch_tokens=1024, queue_delay_s=0.05)
        batcher.start()
        results = await asyncio.gather(*(batcher.submit(r) for r in requests))
        await batcher.stop()
        executor.shutdown()
        return results

    return asyncio.run(main())


def test_a_batch_concatenates_input_ids_alongside_the_rows(tiny):
    layer = HashRouted(tiny)
    served = ServedModel("m", layer, 64)
    types = {"hidden_states": "FP32", "input_ids": "INT64"}
    gen = torch.Generator().manual_seed(3)
    parts = [(torch.randn(n, tiny.config.hidden_size, generator=gen), torch.randint(0, VOCAB, (n,), generator=gen))
             for n in (3, 1, 5)]
    requests = [served.validate({"hidden_states": h, "input_ids": i}, types) for h, i in parts]
    results = _batched(served, requests)
    assert all(r.batch_requests == 3 for r in results), "the three requests ran as one batch"
    assert layer.calls[-1]["input_ids"].tolist() == torch.cat([i for _, i in parts]).tolist()
    for (hidden, ids), result in zip(parts, results):
        torch.testing.assert_close(result.output, layer.expected(hidden, ids), rtol=0, atol=1e-6)


def test_a_batch_mixing_requests_with_and_without_ids_on_a_model_that_ignores_them(tiny):
    layer = TakesIds(tiny)
    served = ServedModel("m", layer, 64)
    gen = torch.Generator().manual_seed(5)
    expected, requests = [], []
    for n, with_ids in ((2, True), (3, False), (1, True)):
        hidden, ids, weights = random_inputs(tiny, n, int(torch.randint(0, 1000, (1,), generator=gen)))
        tensors = {"hidden_states": hidden, "topk_ids": ids, "topk_weights": weights}
        types = {"hidden_states": "FP32", "topk_ids": "INT32", "topk_weights": "FP32"}
        if with_ids:
            tensors["input_ids"], types["input_ids"] = torch.arange(n, dtype=torch.int32), "INT32"
        requests.append(served.validate(tensors, types))
        expected.append(tiny.forward(hidden, topk_ids=ids, topk_weights=weights))
    results = _batched(served, requests)
    assert all(r.batch_requests == 3 for r in results)
    assert layer.calls[-1]["input_ids"] is None  # ids of a model that does not route by them are not passed
    for result, want in zip(results, expected):
        torch.testing.assert_close(result.output, want, rtol=0, atol=1e-6)


def test_hash_model_over_http(tiny):
    layer = HashRouted(tiny)
    srv = LocalServer(layer, token=TOKEN)
    try:
        hidden = torch.randn(4, tiny.config.hidden_size, generator=torch.Generator().manual_seed(9))
        token_ids = torch.tensor([3, 17, 0, VOCAB - 1])
        with httpx.Client(base_url=srv.url, headers=AUTH, timeout=30) as client:
            reply = client.post(INFER, content=_body(hidden))
            assert reply.status_code == 400 and "input_ids" in reply.json()["error"], reply.text
            for datatype in ("INT64", "INT32"):
                reply = client.post(INFER, content=_body(hidden, token_ids, datatype))
                assert reply.status_code == 200, reply.text
                torch.testing.assert_close(_output(reply), layer.expected(hidden, token_ids), rtol=0, atol=1e-6)
            routing = random_inputs(tiny, 4, 2)[1:]
            reply = client.post(INFER, content=_body(hidden, routing=routing))
            assert reply.status_code == 200, reply.text
            torch.testing.assert_close(_output(reply), tiny.forward(hidden, *routing), rtol=0, atol=1e-6)
            meta = client.get(f"/v2/models/{PRESET}").json()
            assert "input_ids" in {i["name"] for i in meta["inputs"]}
    finally:
        srv.stop()


def _library_hash_layer():
    try:
        return MoELayer.from_preset(PRESET, seed=0, backend="torch", scoring="sqrtsoftplus", hash_routing=True)
    except (TypeError, ValueError, KeyError) as exc:
        pytest.skip(f"the library has no hash-routed preset layer here ({type(exc).__name__}: {exc})")


def test_the_library_hash_layer_is_served_with_input_ids():
    layer = _library_hash_layer()
    assert getattr(layer, "needs_input_ids", False)
    table = getattr(layer.weights, "tid2eid", None)
    assert table is not None, "synthetic_weights gives a hash-routed config no tid2eid table"
    served = ServedModel("m", layer, 64)
    assert served.needs_input_ids
    srv = LocalServer(layer, token=TOKEN)
    try:
        gen = torch.Generator().manual_seed(11)
        hidden = torch.randn(5, layer.config.hidden_size, generator=gen)
        token_ids = torch.randint(0, table.shape[0], (5,), generator=gen)
        with httpx.Client(base_url=srv.url, headers=AUTH, timeout=30) as client:
            reply = client.post(INFER, content=_body(hidden))
            assert reply.status_code == 400 and "input_ids" in reply.json()["error"], reply.text
            reply = client.post(INFER, content=_body(hidden, token_ids))
            assert reply.status_code == 200, reply.text
            torch.testing.assert_close(_output(reply), layer.forward(hidden, input_ids=token_ids), rtol=0, atol=0)
    finally:
        srv.stop()


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["cuda-sm90", "cuda-sm100"])
def test_a_hash_batch_on_the_gpu_is_the_layer_forward_of_the_batch(backend):
    """On a GPU: the batch runner's staging (pinned pool, the ids copied beside the rows, no graph)
    gives exactly the layer's own forward of the concatenated batch."""
    from _helpers import backend_or_skip

    backend_or_skip(backend)
    layer = MoELayer.from_preset(PRESET, seed=0, backend=backend, scoring="sqrtsoftplus", hash_routing=True)
    served = ServedModel("m", layer, 4096)
    runner = BatchRunner(served)
    vocab = layer.weights.tid2eid.shape[0]
    gen = torch.Generator().manual_seed(13)
    parts = [(torch.randn(n, layer.config.hidden_size, generator=gen), torch.randint(0, vocab, (n,), generator=gen))
             for n in (3, 70, 1)]  # stacked, and copied per request (64 rows or more)
    requests = [served.validate({"hidden_states": h, "input_ids": i}, {"hidden_states": "FP32", "input_ids": "INT64"})
                for h, i in parts]
    outputs, _ = runner.finish_batch(runner.launch_batch(requests))
    whole = layer.forward(torch.cat([h for h, _ in parts]).cuda(), input_ids=torch.cat([i for _, i in parts]).cuda())
    assert torch.equal(torch.cat(outputs), whole.cpu())

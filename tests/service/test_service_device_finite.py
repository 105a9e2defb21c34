"""The NaN/Inf check of large requests on a CUDA device, the CPU side of it (no GPU needed):
ServedModel.validate leaves a large request's hidden_states to the device (and checks everything
else on the host, as on the CPU backend), nonfinite_errors turns the device's per-row flags into
the 400 of exactly the requests they belong to, and the batcher hands that error to its request
only. The device half runs in tests/gpu/test_gpu_service_finite.py."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from megamoe.service.batching import DynamicBatcher
from megamoe.service.model import DEVICE_FINITE_MIN_ROWS, ModelRequest, ServedModel, nonfinite_errors
from megamoe.service.protocol import ProtocolError

from service_testkit import random_inputs

TYPES = {"hidden_states": "FP32", "topk_ids": "INT32", "topk_weights": "FP32"}


class _OnCuda:
    """The tiny layer as a CUDA one looks to ServedModel (validate never touches the device)."""

    def __init__(self, layer):
        self.config, self.weights, self.backend = layer.config, layer.weights, layer.backend
        self.device = "cuda"

    def forward(self, hidden_states, topk_ids=None, topk_weights=None, router_logits=None, validate=True):
        raise AssertionError("not called")


def inputs(layer, tokens: int, seed: int, nan_at=None, weight_nan=False):
    hidden, ids, weights = random_inputs(layer, tokens, seed)
    if nan_at is not None:
        hidden[nan_at] = float("nan") if seed % 2 else float("inf")
    if weight_nan:
        weights[tokens - 1, 0] = float("nan")
    return {"hidden_states": hidden, "topk_ids": ids, "topk_weights": weights}


def test_validate_leaves_large_requests_to_the_device(layer):
    cuda = ServedModel("m", _OnCuda(layer), 4096)
    big = DEVICE_FINITE_MIN_ROWS + 5
    deferred = cuda.validate(inputs(layer, big, 1, nan_at=(big - 2, 3)), TYPES)
    assert deferred.finite_on_device and deferred.tokens == big
    # a small request is checked here, with the element named
    with pytest.raises(ProtocolError, match=r"hidden_states contains NaN or Inf \(first at \[2, 5\]\)"):
        cuda.validate(inputs(layer, DEVICE_FINITE_MIN_ROWS - 1, 2, nan_at=(2, 5)), TYPES)
    assert not cuda.validate(inputs(layer, DEVICE_FINITE_MIN_ROWS - 1, 3), TYPES).finite_on_device
    # the other float inputs of a large request are still checked here
    with pytest.raises(ProtocolError, match="topk_weights contains NaN or Inf"):
        cuda.validate(inputs(layer, big, 4, weight_nan=True), TYPES)
    # the CPU backend: unchanged, every request checked on the host
    cpu = ServedModel("m", layer, 4096)
    with pytest.raises(ProtocolError, match=r"hidden_states contains NaN or Inf \(first at \[7, 1\]\)"):
        cpu.validate(inputs(layer, big, 5, nan_at=(7, 1)), TYPES)


def test_device_flags_become_the_400_of_their_request_only(layer):
    cuda = ServedModel("m", _OnCuda(layer), 4096)
    big = DEVICE_FINITE_MIN_ROWS
    requests = [cuda.validate(inputs(layer, big, 11), TYPES),
                cuda.validate(inputs(layer, big + 3, 13, nan_at=(9, 4)), TYPES),
                cuda.validate(inputs(layer, 2, 14), TYPES),
                cuda.validate(inputs(layer, big + 1, 15, nan_at=(big, 0)), TYPES)]
    assert [r.finite_on_device for r in requests] == [True, True, False, True]
    sizes = [r.tokens for r in requests]
    # what the device computes: one flag per row of the stacked batch
    flags = torch.isfinite(torch.cat([r.hidden_states for r in requests])).all(dim=1)
    errors = nonfinite_errors(requests, sizes, flags)
    assert sorted(errors) == [1, 3], errors
    assert errors[1].status == 400 and "hidden_states contains NaN or Inf (first at [9, 4])" in errors[1].message
    assert "(first at [%d, 0])" % big in errors[3].message
    # a request checked on the host is never reported from flags (its rows were finite)
    flags[big + big + 3] = False  # the 2-row request's first row
    assert sorted(nonfinite_errors(requests, sizes, flags)) == [1, 3]


def test_batcher_delivers_a_per_request_error_to_that_request_only():
    def request(tokens: int, seed: int) -> ModelRequest:
        return ModelRequest(torch.randn(tokens, 4, generator=torch.Generator().manual_seed(seed)), "router")

    def run_batch(batch):
        outs = [r.hidden_states * 2 for r in batch]
        outs[1] = ProtocolError("hidden_states contains NaN or Inf (first at [0, 1])")
        return outs

    async def main():
        executor = ThreadPoolExecutor(1)
        batcher = DynamicBatcher(run_batch, executor, max_batch_tokens=64, queue_delay_s=0.05)
        batcher.start()
        reqs = [request(3, 1), request(2, 2), request(4, 3)]
        results = await asyncio.gather(*(batcher.submit(r) for r in reqs), return_exceptions=True)
        await batcher.stop()
        executor.shutdown()
        return reqs, results

    reqs, results = asyncio.run(main())
    assert isinstance(results[1], ProtocolError) and "[0, 1]" in results[1].message
    for k in (0, 2):
        assert torch.equal(results[k].output, reqs[k].hidden_states * 2)
        assert results[k].batch_requests == 3

"""Helpers shared by every test folder (a unique module name: tests/service has its own conftest).

Import as ``from _helpers import ...`` (tests/ is on sys.path through tests/conftest.py):

* ``SEED``: the run's random seed (``MEGAMOE_TEST_SEED`` replays one; printed in the summary).
* ``cosine``, ``rel_err``: the metrics of the health checks (``megamoe.health``), one copy.
* ``random_scales``, ``random_nvfp4``: random e4m3 block scales and random NVFP4 matrices.
* ``backend_or_skip``: a GPU backend, or a pytest skip that says why it is not here.
* ``capture_graph``: capture a callable in a CUDA graph (after a warm-up on the capture stream).
* ``routed_inputs``: random x on the GPU routed by the layer's router from random logits.
* ``random_inputs``: random host hidden states (a few large rows) and routing for a layer.
* ``poison_empty``: make ``torch.empty`` return NaN-filled float buffers (padding that must never be read).
"""
from __future__ import annotations

import os

import pytest
import torch

from megamoe import nvfp4
from megamoe.health import cosine, rel_err
from megamoe.health import random_nvfp4 as _health_random_nvfp4
from megamoe.health import random_scales as _health_random_scales

__all__ = ["SEED", "cosine", "rel_err", "random_scales", "random_nvfp4", "backend_or_skip", "capture_graph",
           "routed_inputs", "random_inputs", "poison_empty"]

# Fresh random data each run, but reproducible when a test fails: the seed is printed.
SEED = int(os.environ.get("MEGAMOE_TEST_SEED", torch.seed() % 2**31))


def random_scales(rows: int, cols: int, gen: torch.Generator, signed: bool = False) -> torch.Tensor:
    """Random finite e4m3 block scales ``[rows, cols]``, every exponent and zeros included;
    ``signed``: random sign bits too (a layout test moves bytes, whatever they mean)."""
    s = _health_random_scales(rows, cols, gen)
    if not signed:
        return s
    sign = torch.randint(0, 2, (rows, cols), generator=gen, dtype=torch.int32).to(torch.uint8) << 7
    return (s.view(torch.uint8) | sign).view(torch.float8_e4m3fn)


def random_nvfp4(rows: int, k: int, gen: torch.Generator | None, global_scale: float | None = 1.0,
                 uniform: bool = False) -> nvfp4.NVFP4Tensor:
    """NVFP4 ``[rows, k]``: random data with per-block scales over ~6 binades, quantized with
    ``global_scale`` (None: the data's default global scale). ``uniform``: all-ones data
    (uniform codes and scales: the case that cannot see a scale permutation)."""
    if uniform:
        gs = None if global_scale is None else torch.tensor(global_scale, dtype=torch.float32)
        return nvfp4.quantize(torch.ones(rows, k), gs)
    return _health_random_nvfp4(rows, k, gen, global_scale)


def backend_or_skip(name: str):
    """The backend ``name`` (``"cuda-sm90"``, ``"cuda-sm100"``), or skip the test with the reason
    (no CUDA GPU, or the backend unavailable: wrong architecture, extension built without it)."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    from megamoe.backends import available_backends, get_backend

    ok, why = available_backends()[name]
    if not ok:
        pytest.skip(f"{name} not available: {why}")
    return get_backend(name)


def sm90_and_torch_layers(preset: str = "small", seed: int = 0, **over):
    """(cuda-sm90 layer, torch-backend layer on the GPU) with the same weights; skips without
    cuda-sm90. ``over`` overrides the preset's shape fields (``hidden_size``, ``act_mode``...)."""
    from megamoe.moe import MoELayer

    backend_or_skip("cuda-sm90")
    gpu = MoELayer.from_preset(preset, seed=seed, backend="cuda-sm90", **over)
    ref = MoELayer(gpu.weights, gpu.config, backend="torch", device="cuda")
    return gpu, ref


def capture_graph(fn, *args, **kwargs):
    """Run ``fn(*args, **kwargs)`` once on a side stream (warm-up: allocations, lazy set-up),
    then capture it in a CUDA graph. Returns ``(graph, out)``: ``graph.replay()`` recomputes
    ``out`` in place from the current contents of the captured input tensors."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn(*args, **kwargs)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn(*args, **kwargs)
    return graph, out


def routed_inputs(layer, t: int, gen: torch.Generator, dtype=torch.bfloat16):
    """``(x, topk_ids, topk_weights)`` on the GPU: x ``[t, H]`` random (times 2) in ``dtype``, routed by
    the layer's router from random logits."""
    cfg = layer.config
    x = (torch.randn((t, cfg.hidden_size), generator=gen) * 2).to(dtype).cuda()
    logits = torch.randn((t, cfg.num_experts), generator=gen).cuda()
    w, ids = layer.route(x, logits)
    return x, ids, w


def random_inputs(layer, tokens: int, seed: int, dtype=torch.float32):
    """Random hidden states (with a few large values) and routing for ``layer`` (host tensors):
    ``(hidden [T, H], topk_ids [T, k] int32, topk_weights [T, k] summing to 1)``."""
    cfg = layer.config
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(tokens, cfg.hidden_size, generator=gen) * (1 + 4 * torch.rand(tokens, 1, generator=gen))
    ids = torch.stack([torch.randperm(cfg.num_experts, generator=gen)[: cfg.top_k] for _ in range(tokens)]).int()
    weights = torch.rand(tokens, cfg.top_k, generator=gen) + 0.05
    return hidden.to(dtype), ids, weights / weights.sum(-1, keepdim=True)


def poison_empty(monkeypatch) -> None:
    """``torch.empty`` returns NaN-filled float buffers (until the monkeypatch is undone): a kernel
    or glue that reads an unwritten row or padding shows NaN."""
    orig = torch.empty

    def empty(*size, dtype=None, device=None, **kw):
        t = orig(*size, dtype=dtype, device=device, **kw)
        if t.is_floating_point():
            t.fill_(float("nan"))
        return t

    monkeypatch.setattr(torch, "empty", empty)


# ------------------------------------------------------------------ batch invariance (docs/SPEC.md §3.5)
def near_tied_rows(layer, n, gen):
    """Rows whose k-th and (k+1)-th router logits are equal in exact arithmetic: x is projected
    onto the plane where those two experts' logits agree, so float rounding alone decides."""
    w = layer._float32("router_weight").cpu()
    k = layer.config.top_k
    x = torch.randn(n, w.shape[1], generator=gen)
    order = (x @ w.T).argsort(dim=1, descending=True)
    a, b = order[:, k - 1], order[:, k]
    d = w[a] - w[b]
    x = x - ((x * d).sum(1, keepdim=True) / (d * d).sum(1, keepdim=True)) * d
    return x


def check_rows_alone_equal_batched(layer, probes, gen, batches, input_ids=None, vocab=None):
    """docs/SPEC.md §3.5: each probe row through ``layer`` alone, then inside a batch of each size in ``batches``
    (random batch-mates of spread magnitudes, the probe at a random position): the same bits."""
    h = layer.config.hidden_size
    kw = lambda ids: {} if ids is None else {"input_ids": ids}  # noqa: E731
    alone = [layer(p[None], **kw(None if input_ids is None else input_ids[i:i + 1])) for i, p in enumerate(probes)]
    differ = []
    for b in batches:
        i = int(torch.randint(0, len(probes), (1,), generator=gen))
        pos = int(torch.randint(0, b, (1,), generator=gen))
        x = (torch.randn(b, h, generator=gen) * torch.rand(b, 1, generator=gen) * 4).to(probes.dtype)
        x[pos] = probes[i]
        ids = None
        if input_ids is not None:
            ids = torch.randint(0, vocab, (b,), generator=gen)
            ids[pos] = input_ids[i]
        y = layer(x, **kw(ids))
        if not torch.equal(y[pos], alone[i][0]):
            differ.append((b, pos, float((y[pos].float() - alone[i][0].float()).abs().max())))
    assert not differ, f"{len(differ)} batched rows differ from the same row alone (batch, position, max diff): {differ[:8]}"


def wide_block_rows(n, h, gen):
    """Rows whose 16-element blocks span 2^-12 .. 2^12 in magnitude (outlier channels): their NVFP4 block scales,
    and so the products a GEMM sums over K, range over many binades, where a sum's rounding depends on its order."""
    x = torch.randn(n, h, generator=gen)
    mag = torch.exp2(torch.randint(-12, 13, (n, h // 16, 1), generator=gen).float())
    return (x.view(n, h // 16, 16) * mag).view(n, h)


def min_cosine_vs_torch(act_mode: str, tokens: int) -> float:
    """The cosine a GPU forward of ``tokens`` tokens is held to against the torch backend on the same weights.

    W4A4 quantizes h again for the second GEMM, from an fp32 sum in another order than the torch backend's: an h
    value on an e2m1 rounding point lands on either side, and over a few tokens one such step of a large h value is a
    visible share of the output (one differing h code moved a one-token output of H 7168, I 464 to cosine 0.99877:
    60 tokens on the CPU, h perturbed by 1e-4 relative; on a GPU one seed gave 0.99937). From 64 tokens on, the
    output holds enough values to keep 0.9999; W4A16 always does."""
    return 0.995 if act_mode == "w4a4" and tokens < 64 else 0.9999


# expected tokens per expert on each side of every switch point of the sm90 plan (cpp/include/megamoe/sm90_plan.h)
SWITCH_TOKENS_PER_EXPERT = (4, 5, 24, 25, 63, 64, 1024)
# the GPU invariance cases: preset and config overrides
INVARIANCE_CASES = {
    "small-w4a4": ("small", {}),
    "small-w4a4-dynamic": ("small", {"dynamic_act_scale": True}),
    "small-w4a16": ("small", {"act_mode": "w4a16"}),
    "v4-flash-w4a16": ("v4-flash", {"act_mode": "w4a16"}),
    "v4-flash-w4a4": ("v4-flash", {}),
}


def invariance_batches(cfg) -> list[int]:
    """Every batch size up to 64, and for each switch point the smallest batch whose ceil(T*k/E) reaches it."""
    e, k = cfg.num_experts, cfg.top_k
    return list(range(1, 65)) + sorted({-(-tpe * e // k) for tpe in SWITCH_TOKENS_PER_EXPERT})


def invariance_probes(layer, gen) -> torch.Tensor:
    """Random rows, near-tied router rows and rows whose blocks span 24 binades (bf16)."""
    h = layer.config.hidden_size
    return torch.cat([torch.randn(3, h, generator=gen), near_tied_rows(layer, 3, gen),
                      wide_block_rows(2, h, gen)]).to(torch.bfloat16)

"""Tensor parallelism on one GPU: the 8 ranks' slices of a DeepSeek-V4-Flash-shaped layer
(H 4096, I 2048, so I = 256 per rank: the second GEMM has K = 256), run in turn on one GPU and
summed in rank order, agree with the whole layer (cosine >= 0.9999), on cuda-sm90 and on the
torch backend on CUDA; the single-GPU stand-in of 8 tensor-parallel ranks (NCCL runs:
tests/gpu/test_distributed_nccl.py).

The layer has V4's semantics (sqrt(softplus) scores with a correction bias, SwiGLU clamped,
one shared expert of width 2048, also sliced) and fewer experts (32, top-6) to keep the
synthetic weights quick; the kernels' shapes per expert are V4-Flash's. Skips without a GPU
(cuda-sm90: without a Hopper GPU and the extension built for it).
"""
from __future__ import annotations

import pytest
import torch

from _helpers import backend_or_skip, cosine, rel_err

pytestmark = pytest.mark.gpu

TP = 8


@pytest.fixture(scope="module")
def full_weights():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    from megamoe.checkpoint import synthetic_weights
    from megamoe.presets import get_preset

    cfg = get_preset("v4-flash").with_(num_experts=32)
    return cfg, synthetic_weights(cfg, seed=5, device="cuda")


def _layers(backend: str, full_weights, **over):
    """(whole layer, the 8 slices' layers) on one GPU with ``backend``."""
    from megamoe.distributed import tp_local_config, tp_slice_weights
    from megamoe.moe import MoELayer

    if backend != "torch":
        backend_or_skip(backend)
    cfg, w = full_weights
    cfg = cfg.with_(**over)
    whole = MoELayer(w, cfg, backend=backend, device="cuda")
    local = tp_local_config(cfg, TP)
    assert local.intermediate_size == 256 and local.shared_intermediate_size == 256
    slices = [MoELayer(tp_slice_weights(w, r, TP), local, backend=backend, device="cuda") for r in range(TP)]
    return whole, slices


def _sum_of_slices(slices, x, ids, tw) -> torch.Tensor:
    """Each rank's partial (routed slice + shared slice, float32) in turn, added in rank order."""
    out = None
    for layer in slices:
        part = layer.backend.moe_forward(layer._prepared, layer.config, x, ids, tw).float() + layer._shared_expert(x)
        out = part if out is None else out + part
    return out


@pytest.mark.parametrize("backend", ["cuda-sm90", "torch"])
@pytest.mark.parametrize("mode", ["w4a4", "w4a16"])
def test_eight_slices_summed_match_the_whole_layer(backend, mode, full_weights):
    whole, slices = _layers(backend, full_weights, act_mode=mode)
    gen = torch.Generator().manual_seed(11)
    # T = 1 (the one-token path), 8 (streaming), 128 and 600 (wgmma tiles at K = 256)
    for t in (1, 8, 128, 600) if backend != "torch" else (1, 37):
        x = (torch.randn((t, whole.config.hidden_size), generator=gen) * 2).to(torch.bfloat16).cuda()
        tw, ids = whole.route(x)
        for r, layer in enumerate(slices):  # the router is replicated: every rank routes alike
            tw_r, ids_r = layer.route(x)
            assert torch.equal(ids_r, ids) and torch.equal(tw_r, tw), f"rank {r} routes differently"
        want = whole.backend.moe_forward(whole._prepared, whole.config, x, ids, tw).float() + whole._shared_expert(x)
        got = _sum_of_slices(slices, x, ids, tw)
        c, e = cosine(got, want), rel_err(got, want)
        print(f"{backend} {mode} T={t}: 8 slices summed vs the whole layer: cosine {c:.7f}, rel err {e:.2e}")
        assert torch.isfinite(got).all()
        assert c >= 0.9999, (backend, mode, t, c, e)


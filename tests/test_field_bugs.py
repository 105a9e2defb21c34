"""docs/FIELD_BUGS.md rows 15-29 on the CPU: the torch backend and cuda-sm100 (its CUTLASS kernel
replaced by the CPU emulator of the same plan, see tests/test_sm100_host.py).

The GPU side of the same rows (cuda-sm90 on the H200, the torch backend on CUDA) is
tests/gpu/test_gpu_field_bugs.py; the Blackwell kernel itself is tests/sm100_gpu (it has
never run here: there is no Blackwell GPU).
"""
from __future__ import annotations

import functools

import pytest
import torch

from _helpers import cosine
from megamoe import _ext, nvfp4
from megamoe.moe import MoELayer

BACKENDS = ["torch", "cuda-sm100-emulate"]


def make_backend(name: str):
    if name == "torch":
        from megamoe.backends.torch_ref import TorchBackend

        return TorchBackend()
    if not _ext.has_part("sm100"):
        pytest.skip(f"megamoe._C built without sm_100a (parts {_ext.built_parts()})")
    from megamoe.backends.cuda_sm100 import CudaSm100Backend

    return CudaSm100Backend(device="cpu", executor="emulate", sm_count=148)


@pytest.fixture(params=BACKENDS)
def backend(request):
    return make_backend(request.param)


@functools.lru_cache(maxsize=None)
def _weights(preset: str, seed: int, over: tuple):
    """Synthetic weights of a shape, made once for every backend (making them is the slow part)."""
    from megamoe.checkpoint import synthetic_weights
    from megamoe.presets import get_preset

    cfg = get_preset(preset).with_(**dict(over))
    return cfg, synthetic_weights(cfg, seed=seed)


def _layer(be, preset="tiny", seed=5, **over):
    cfg, weights = _weights(preset, seed, tuple(sorted(over.items())))
    return MoELayer(weights, cfg, backend=be)


def _x(t, h, seed):
    return torch.randn(t, h, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)


def _spread_ids(t, k, e, seed):
    """[t, k] distinct ids per token that cover every expert (t * k >= e)."""
    gen = torch.Generator().manual_seed(seed)
    base = torch.randperm(e, generator=gen)
    ids = torch.stack([base[(torch.arange(k) + t_ * k) % e] for t_ in range(t)])
    return ids.to(torch.int32)


def _route_weights(t, k, seed):
    w = torch.rand(t, k, generator=torch.Generator().manual_seed(seed)) + 0.1
    return (w / w.sum(1, keepdim=True)).float()


def _ref_backend():
    from megamoe.backends.torch_ref import TorchBackend

    return TorchBackend()


def check_every_column(out, ref, min_cos):
    """docs/FIELD_BUGS.md row 29: each output column on its own, not only the whole norm."""
    assert out.shape == ref.shape
    o, r = out.double(), ref.double()
    col_norm = r.norm(dim=0)
    assert (col_norm > 0).all(), "reference has an all-zero column: the check would be blind there"
    col_cos = (o * r).sum(0) / (o.norm(dim=0) * col_norm).clamp_min(1e-300)
    worst = int(col_cos.argmin())
    assert float(col_cos.min()) >= min_cos, f"column {worst}: cosine {float(col_cos[worst]):.6f}"


# ------------------------------------------------------------------------------------------
# row 26: masked expert ids (docs/SPEC.md §3.1)
# ------------------------------------------------------------------------------------------

def _masked_case(layer, t, seed):
    cfg = layer.config
    e, k = cfg.num_experts, cfg.top_k
    ids = _spread_ids(t, k, e, seed)
    w = _route_weights(t, k, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    mask = torch.rand(t, k, generator=gen) < 0.35
    mask[0] = True  # one token with every slot masked
    bad = torch.tensor([-1, -1, -1, e, e + 7, -5], dtype=torch.int32)
    masked_ids = torch.where(mask, bad[torch.randint(0, len(bad), (t, k), generator=gen)], ids)
    return ids, w, mask, masked_ids


def test_masked_ids_contribute_nothing(backend):
    layer = _layer(backend, top_k=4)
    cfg = layer.config
    t = 37
    x = _x(t, cfg.hidden_size, 26)
    ids, w, mask, masked_ids = _masked_case(layer, t, 26)
    out = backend.moe_forward(layer._prepared, cfg, x, masked_ids, w)
    assert out.shape == (t, cfg.hidden_size) and torch.isfinite(out).all()
    assert torch.equal(out[0], torch.zeros_like(out[0]))  # every slot masked: nothing
    # the same as routing the masked slots anywhere with weight 0 (one reference, the torch backend)
    ref = _ref_backend().moe_forward(layer.weights, cfg, x, ids, torch.where(mask, torch.zeros(()), w))
    assert torch.allclose(out, ref, rtol=1e-5, atol=1e-6 * float(ref.abs().max()))
    # a masked slot's weight is never read: NaN there changes no bit
    nan_w = torch.where(mask, torch.full((), float("nan")), w)
    again = backend.moe_forward(layer._prepared, cfg, x, masked_ids, nan_w)
    assert torch.equal(again, out)


def test_all_ids_masked_gives_zeros(backend):
    layer = _layer(backend)
    cfg = layer.config
    x = _x(9, cfg.hidden_size, 1)
    ids = torch.full((9, cfg.top_k), -1, dtype=torch.int64)
    out = backend.moe_forward(layer._prepared, cfg, x, ids, _route_weights(9, cfg.top_k, 1))
    assert out.shape == (9, cfg.hidden_size) and torch.equal(out, torch.zeros_like(out))


# ------------------------------------------------------------------------------------------
# rows 15, 20, 8, 29: shapes that are not multiples of 128 / 4 / 16
# ------------------------------------------------------------------------------------------

SHAPES = [
    # (H, I, E, k): H, I multiples of 16 but not of 128; E not a multiple of 4 / of 16
    pytest.param(1040, 208, 60, 3, id="H1040-I208-E60"),
    pytest.param(400, 464, 6, 2, id="H400-I464-E6"),
    pytest.param(272, 144, 20, 4, id="H272-I144-E20"),
    # row 29: N = 896 (GEMM 1, 2I) and N = 1856 (GEMM 1), H = 896 (GEMM 2)
    pytest.param(896, 448, 5, 2, id="H896-I448-N896"),
    pytest.param(144, 928, 3, 2, id="H144-I928-N1856"),
]


@pytest.mark.parametrize("h,i,e,k", SHAPES)
def test_odd_shapes_against_the_reference_every_column(backend, h, i, e, k):
    """rows 15 (H % 128 != 0, many experts), 20 (E % 4 != 0), 8 (I % 128 != 0), 29 (every column)."""
    layer = _layer(backend, hidden_size=h, intermediate_size=i, num_experts=e, top_k=k)
    cfg = layer.config
    for t in (1, 129):
        x = _x(t, h, t)
        ids = _spread_ids(t, k, e, t)
        w = _route_weights(t, k, t)
        out = backend.moe_forward(layer._prepared, cfg, x, ids, w)
        assert out.shape == (t, h) and torch.isfinite(out).all()
        if backend.name == "torch":
            # the reference itself: against the bf16 reference (the format's own error)
            ref = layer.reference_bf16(x, topk_ids=ids, topk_weights=w).float()
            assert cosine(out, ref) >= 0.97
            if t == 129:
                check_every_column(out, ref, 0.9)
        else:
            ref = _ref_backend().moe_forward(layer.weights, cfg, x, ids, w)
            assert cosine(out, ref) >= 0.99999
            if t == 129:
                check_every_column(out, ref, 0.9999)


# ------------------------------------------------------------------------------------------
# row 24: many small experts, random scales per expert, every expert compared
# ------------------------------------------------------------------------------------------

def test_many_small_experts_each_compared(backend):
    e, k = 60, 2
    layer = _layer(backend, hidden_size=272, intermediate_size=144, num_experts=e, top_k=k, seed=24)
    cfg = layer.config
    gs = layer.weights.w13.global_scale
    assert gs.unique().numel() > e  # per-expert (and per gate/up) global scales, all different
    t = e  # slot 0 of token t is expert t: every expert has one or two tokens
    ids = torch.stack([torch.arange(t), (torch.arange(t) * 7 + 3) % e], dim=1).to(torch.int32)
    x = _x(t, cfg.hidden_size, 24)
    w = _route_weights(t, k, 24)
    out = backend.moe_forward(layer._prepared, cfg, x, ids, w)
    for ex in range(e):  # each expert on its own: its token(s) through it alone
        tok = (ids == ex).any(1).nonzero().flatten()
        one = torch.where(ids[tok] == ex, w[tok], torch.zeros(()))
        ref = _ref_backend().moe_forward(layer.weights, cfg, x[tok], ids[tok], one)
        got = backend.moe_forward(layer._prepared, cfg, x[tok], ids[tok], one)
        assert cosine(got, ref) >= 0.99999, f"expert {ex}"
    ref_all = _ref_backend().moe_forward(layer.weights, cfg, x, ids, w)
    per_token = [cosine(out[j], ref_all[j]) for j in range(t)]
    assert min(per_token) >= 0.9999, (int(torch.tensor(per_token).argmin()), min(per_token))


# ------------------------------------------------------------------------------------------
# row 25: every token on one expert (a graph captured with all-zero ids), then real routing
# ------------------------------------------------------------------------------------------

def test_all_tokens_on_one_expert_then_real_routing(backend):
    layer = _layer(backend, top_k=3)
    cfg = layer.config
    t = 130
    x = _x(t, cfg.hidden_size, 25)
    w = _route_weights(t, cfg.top_k, 25)
    zeros = torch.zeros(t, cfg.top_k, dtype=torch.int32)  # duplicates inside a token too
    real = _spread_ids(t, cfg.top_k, cfg.num_experts, 25)
    for ids in (zeros, real, zeros):
        out = backend.moe_forward(layer._prepared, cfg, x, ids, w)
        ref = _ref_backend().moe_forward(layer.weights, cfg, x, ids, w)
        assert torch.isfinite(out).all() and cosine(out, ref) >= (0.99999 if backend.name != "torch" else 1 - 1e-12)


# ------------------------------------------------------------------------------------------
# row 28: same input, same bits (top-k >= 3); on CPU this guards the code path, the GPU
# tests (tests/gpu/test_gpu_field_bugs.py, tests/sm100_gpu) are where atomics would show
# ------------------------------------------------------------------------------------------

def test_same_input_same_bits_top_k_3_or_more(backend):
    layer = _layer(backend, top_k=6)
    cfg = layer.config
    x = _x(65, cfg.hidden_size, 28)
    ids = _spread_ids(65, 6, cfg.num_experts, 28)
    w = _route_weights(65, 6, 28)
    a = backend.moe_forward(layer._prepared, cfg, x, ids, w)
    b = backend.moe_forward(layer._prepared, cfg, x, ids, w)
    assert torch.equal(a, b)


# ------------------------------------------------------------------------------------------
# row 18: per-expert and shared input scales both work, and per-expert ones are really used
# ------------------------------------------------------------------------------------------

def test_per_expert_and_shared_input_scales(backend):
    layer = _layer(backend)
    cfg = layer.config
    wts = layer.weights
    assert wts.w13_input_scale is not None and wts.w13_input_scale.unique().numel() > 1
    x = _x(40, cfg.hidden_size, 18)
    ids = _spread_ids(40, cfg.top_k, cfg.num_experts, 18)
    w = _route_weights(40, cfg.top_k, 18)
    shared = type(wts)(**{**wts.__dict__, "w13_input_scale": wts.w13_input_scale.max().expand_as(
        wts.w13_input_scale).contiguous(), "w2_input_scale": wts.w2_input_scale.max().expand_as(
        wts.w2_input_scale).contiguous()})
    outs = {}
    for name, wt in (("per_expert", wts), ("shared", shared)):
        out = backend.moe_forward(backend.prepare_weights(wt), cfg, x, ids, w)
        ref = _ref_backend().moe_forward(wt, cfg, x, ids, w)
        assert cosine(out, ref) >= (0.99999 if backend.name != "torch" else 1 - 1e-12), name
        outs[name] = out
    assert not torch.equal(outs["per_expert"], outs["shared"])  # the per-expert scales are read


# ------------------------------------------------------------------------------------------
# row 16: scale buffers exactly as large as the tiles the writer fills; guard bytes untouched
# ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("t", [1, 5, 127, 129])
@pytest.mark.parametrize("cols", [4, 29, 64])
def test_swizzle_writes_inside_its_buffer(backend, t, cols):
    gen = torch.Generator().manual_seed(t * 100 + cols)
    scale = (torch.rand(t, cols, generator=gen) * 200 + 1).to(torch.float8_e4m3fn)
    prow, pcol = nvfp4.sf_padded_shape(t, cols)
    n = prow * pcol
    big = torch.full((n + 4096,), 0xA5, dtype=torch.uint8)
    backend.swizzle_scales(scale, out=big[:n])
    assert (big[n:] == 0xA5).all()  # nothing past the padded size
    assert torch.equal(big[:n], nvfp4.swizzle_scales(scale).reshape(-1))
    q = backend.quantize(torch.randn(t, cols * 16, generator=gen))
    assert q.scale.shape == (t, cols) and q.data.shape == (t, cols * 8)

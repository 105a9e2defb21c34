"""docs/FIELD_BUGS.md rows 15-29 on the GPU: cuda-sm90 against the torch backend on the same GPU
(the one reference, same NVFP4 weights and routing). The CPU side (torch, cuda-sm100 emulated)
is tests/test_field_bugs.py; the Blackwell kernel is tests/sm100_gpu.

Skipped, with the reason, without a Hopper GPU.
"""
from __future__ import annotations

import pytest
import torch

from _helpers import backend_or_skip, capture_graph, cosine, min_cosine_vs_torch
from _helpers import routed_inputs as _inputs
from _helpers import sm90_and_torch_layers as _pair
from test_field_bugs import SHAPES as CPU_SHAPES
from test_field_bugs import check_every_column
from megamoe import nvfp4

pytestmark = pytest.mark.gpu


def _fwd(layer, x, ids, w):
    """The backend's routed experts alone (no id validation: masked ids reach the backend)."""
    return layer.backend.moe_forward(layer._prepared, layer.config, x, ids, w).float()


def _mask(ids, e, gen, frac=0.35):
    """Ids with about `frac` of the slots masked (-1, or ids outside [0, E)), token 0 fully masked."""
    t, k = ids.shape
    mask = torch.rand((t, k), generator=gen) < frac
    mask[0] = True
    bad = torch.tensor([-1, -1, -1, e, e + 7, -5], dtype=ids.dtype)
    repl = bad[torch.randint(0, len(bad), (t, k), generator=gen)]
    return torch.where(mask.cuda(), repl.cuda(), ids), mask.cuda()


# ------------------------------------------------------------------------------------------
# row 26: masked expert ids (docs/SPEC.md §3.1), graph-safe
# ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("mode", ["w4a4", "w4a16"])
@pytest.mark.parametrize("t", [1, 7, 300])
def test_masked_ids_contribute_nothing(mode, t, gen):
    gpu, ref = _pair(act_mode=mode)
    e = gpu.config.num_experts
    x, ids, w = _inputs(gpu, t, gen)
    masked, mask = _mask(ids, e, gen)
    out = _fwd(gpu, x, masked, w)
    assert torch.isfinite(out).all()
    assert torch.equal(out[0], torch.zeros_like(out[0]))  # every slot of token 0 masked
    exp = _fwd(ref, x, ids, torch.where(mask, torch.zeros((), device="cuda"), w))  # weight 0 instead
    c = cosine(out, exp)
    print(f"masked ids {mode} T={t}: cosine vs torch backend {c:.7f}")
    assert c >= min_cosine_vs_torch(mode, t) or (t == 1 and float(exp.abs().max()) == 0.0)
    # a masked slot's weight is never read: NaN there changes no bit
    nan_w = torch.where(mask, torch.full((), float("nan"), device="cuda"), w)
    assert torch.equal(_fwd(gpu, x, masked, nan_w), out)
    # int64 ids take the same path
    assert torch.equal(_fwd(gpu, x, masked.long(), w), out)


def test_masked_ids_in_a_cuda_graph(gen):
    """Captured with one mask pattern, replayed with others (none masked, all masked): each replay
    equals the eager result for the ids copied in (no host synchronisation in the masking)."""
    gpu, _ = _pair()
    e, t = gpu.config.num_experts, 64
    x, ids, w = _inputs(gpu, t, gen)
    masked, _ = _mask(ids, e, gen)
    xs, ids_s, ws_ = x.clone(), masked.clone(), w.clone()
    g, out = capture_graph(gpu.backend.moe_forward, gpu._prepared, gpu.config, xs, ids_s, ws_)
    for new_ids in (masked, ids, torch.full_like(ids, -1), _mask(ids, e, gen, 0.6)[0]):
        ids_s.copy_(new_ids)
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(out.float(), _fwd(gpu, x, new_ids, w))


# ------------------------------------------------------------------------------------------
# rows 15, 20, 8, 29: H, I multiples of 16 not of 128; E not a multiple of 4 / 16; every column
# ------------------------------------------------------------------------------------------

SHAPES = CPU_SHAPES + [pytest.param(7168, 464, 61, 8, id="H7168-I464-E61")]


@pytest.mark.parametrize("mode", ["w4a4", "w4a16"])
@pytest.mark.parametrize("h,i,e,k", SHAPES)
def test_odd_shapes_every_column(h, i, e, k, mode, gen):
    gpu, ref = _pair("tiny", hidden_size=h, intermediate_size=i, num_experts=e, top_k=k, act_mode=mode)
    for t in (1, 5, 127, 129, 1000):
        x, ids, w = _inputs(gpu, t, gen)
        out = _fwd(gpu, x, ids, w)
        exp = _fwd(ref, x, ids, w)
        c = cosine(out, exp)
        print(f"odd shape H={h} I={i} E={e} k={k} {mode} T={t}: cosine {c:.7f}")
        assert torch.isfinite(out).all() and c >= min_cosine_vs_torch(mode, t), (t, c)
        if t >= 127:
            # W4A4 quantizes h again for L2: an fp32 sum in another order can land h on the other side of
            # an e2m1 rounding point or move a block's e4m3 scale, so a column over ~128 tokens may differ
            # by a code step of a few tokens (worst seen 0.9988, seed-dependent). A column the kernel
            # skips or misplaces (the field bug) reads ~0.
            check_every_column(out, exp, 0.999 if mode == "w4a16" else 0.99)


# ------------------------------------------------------------------------------------------
# row 23: a prefill with T * top_k * H > 2^31 (v3, T = 37,500)
# ------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def v3_pair():
    gpu, ref = _pair("v3", seed=23)
    yield gpu, ref
    del gpu, ref
    torch.cuda.empty_cache()


def test_v3_prefill_past_2_31(v3_pair, gen):
    gpu, ref = v3_pair
    cfg = gpu.config
    t = 37_500
    assert t * cfg.top_k * cfg.hidden_size > 2**31
    x, ids, w = _inputs(gpu, t, gen)
    out = _fwd(gpu, x, ids, w)
    exp = _fwd(ref, x, ids, w)
    c = cosine(out, exp)
    # the last tokens' staged rows and combine reads sit past element 2^31 of [T*k, H] buffers
    tail = cosine(out[-2048:], exp[-2048:])
    per_token = torch.nn.functional.cosine_similarity(out[-2048:].double(), exp[-2048:].double(), dim=1)
    print(f"v3 T={t}: cosine {c:.7f}, last 2048 tokens {tail:.7f}, worst token {float(per_token.min()):.6f}")
    assert torch.isfinite(out).all() and c >= 0.9999 and tail >= 0.9999
    assert float(per_token.min()) >= 0.99
    check_every_column(out, exp, 0.999)


def test_v3_every_slot_on_one_expert_past_2_31(v3_pair, gen):
    """rows 23 and 25 together: every one of the T*k = 300,000 slots on expert 0, so a single
    expert's rows times H pass 2^31."""
    gpu, ref = v3_pair
    cfg = gpu.config
    t = 37_500
    x, _, w = _inputs(gpu, t, gen)
    ids = torch.zeros((t, cfg.top_k), dtype=torch.int32, device="cuda")
    out = _fwd(gpu, x, ids, w)
    exp = _fwd(ref, x, ids, w)
    c, tail = cosine(out, exp), cosine(out[-2048:], exp[-2048:])
    print(f"v3 T={t} all on expert 0: cosine {c:.7f}, last 2048 tokens {tail:.7f}")
    assert torch.isfinite(out).all() and c >= 0.9999 and tail >= 0.9999


# ------------------------------------------------------------------------------------------
# row 25: CUDA-graph capture with every token on one expert, replay with real routing
# ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("mode", ["w4a4", "w4a16"])
@pytest.mark.parametrize("t", [8, 256])
def test_graph_captured_on_one_expert_replays_real_routing(t, mode, gen):
    gpu, _ = _pair(act_mode=mode)
    x, ids, w = _inputs(gpu, t, gen)
    zeros = torch.zeros_like(ids)
    xs, ids_s, ws_ = x.clone(), zeros.clone(), w.clone()
    g, out = capture_graph(gpu.backend.moe_forward, gpu._prepared, gpu.config, xs, ids_s, ws_)
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(out.float(), _fwd(gpu, x, zeros, w))
    for new_ids in (ids, torch.full_like(ids, gpu.config.num_experts - 1), ids.flip(0)):
        ids_s.copy_(new_ids)
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(out.float(), _fwd(gpu, x, new_ids, w))


# ------------------------------------------------------------------------------------------
# row 28: no atomic combine: same input, same bits, top-k >= 3
# ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("k", [3, 8])
@pytest.mark.parametrize("backend", ["cuda-sm90", "torch"])
def test_same_input_same_bits(backend, k, gen):
    gpu, ref = _pair("small", num_experts=64, top_k=k)
    layer = gpu if backend == "cuda-sm90" else ref
    for t in (7, 513, 4096):
        x, ids, w = _inputs(gpu, t, gen)
        # a token listing one expert several times (graph warm-up with all-zero ids) adds up to
        # three rows of one expert into one output row
        cases = [ids, torch.where(torch.arange(k, device="cuda") < 3, ids[:, :1], ids)]
        for case in cases:
            first = _fwd(layer, x, case, w)
            for _ in range(3):
                assert torch.equal(_fwd(layer, x, case, w), first), (backend, k, t)


# ------------------------------------------------------------------------------------------
# row 24: many small experts, random scales per expert, every expert compared
# ------------------------------------------------------------------------------------------

def test_many_small_experts_each_compared(gen):
    e = 160
    gpu, ref = _pair("tiny", hidden_size=1040, intermediate_size=208, num_experts=e, top_k=2, seed=24)
    t = e
    ids = torch.stack([torch.arange(t), (torch.arange(t) * 7 + 3) % e], dim=1).to(torch.int32).cuda()
    x = (torch.randn((t, 1040), generator=gen) * 2).to(torch.bfloat16).cuda()
    w = torch.rand((t, 2), generator=gen).cuda() + 0.1
    out = _fwd(gpu, x, ids, w)
    exp = _fwd(ref, x, ids, w)
    per_token = torch.nn.functional.cosine_similarity(out.double(), exp.double(), dim=1)
    worst = int(per_token.argmin())
    print(f"{e} experts, 1-2 tokens each: worst token {worst} cosine {float(per_token[worst]):.6f}")
    assert float(per_token.min()) >= 0.999, (worst, ids[worst].tolist())


# ------------------------------------------------------------------------------------------
# row 16: the GPU swizzle writes inside its buffer (whole 128-row tiles fit the padded size)
# ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("t", [1, 5, 127, 129])
@pytest.mark.parametrize("cols", [4, 29, 64])
def test_gpu_swizzle_writes_inside_its_buffer(t, cols, gen):
    be = backend_or_skip("cuda-sm90")
    scale = (torch.rand((t, cols), generator=gen) * 200 + 1).to(torch.float8_e4m3fn)
    prow, pcol = nvfp4.sf_padded_shape(t, cols)
    n = prow * pcol
    big = torch.full((n + 4096,), 0xA5, dtype=torch.uint8, device="cuda")
    be.swizzle_scales(scale.cuda(), out=big[:n])
    torch.cuda.synchronize()
    assert (big[n:] == 0xA5).all()
    assert torch.equal(big[:n].cpu(), nvfp4.swizzle_scales(scale).reshape(-1))
    sizes = [t, 0, 3]
    s2 = (torch.rand((sum(sizes), cols), generator=gen) * 200 + 1).to(torch.float8_e4m3fn)
    total = int(nvfp4.grouped_row_offsets(sizes)[-1])
    n2 = nvfp4.sf_padded_shape(total, cols)[0] * pcol
    big2 = torch.full((n2 + 4096,), 0xA5, dtype=torch.uint8, device="cuda")
    be.swizzle_scales_grouped(s2.cuda(), sizes, out=big2[:n2].view(-1, pcol))
    torch.cuda.synchronize()
    assert (big2[n2:] == 0xA5).all()
    assert torch.equal(big2[:n2].cpu().view(-1, pcol), nvfp4.swizzle_scales_grouped(s2, sizes))

"""The tiled weight order (``cuda_sm90.sm90_tiled``) on a GPU: every kernel, reading a layer's weights in the tiled
order and in the row-major order, writes the same bits; where the shape does not allow the tiled order, that GEMM
stays row-major. (The MoE, batch-invariance and field-bug GPU files check the forward against the reference through
``prepare_weights``, so in the tiled order wherever the shape allows it; the GEMM file the row-major order.)"""
from __future__ import annotations

import dataclasses

import pytest
import torch

from _helpers import backend_or_skip
from megamoe.backends import cuda_sm90
from megamoe.moe import MoELayer

pytestmark = pytest.mark.gpu


def row_major(p: cuda_sm90.PreparedSm90) -> cuda_sm90.PreparedSm90:
    w13, s13 = cuda_sm90.sm90_untiled(p.w13_data, p.w13_scale) if p.w13_tiled else (p.w13_data, p.w13_scale)
    w2, s2 = cuda_sm90.sm90_untiled(p.w2_data, p.w2_scale) if p.w2_tiled else (p.w2_data, p.w2_scale)
    return dataclasses.replace(p, w13_data=w13, w13_scale=s13, w2_data=w2, w2_scale=s2, w13_tiled=False,
                               w2_tiled=False)


# (H, I, whether w13 and w2 are tiled): both; I = 192 (w2's K is not a multiple of 256: w13 only); H = 1088 (w13's
# K is not a multiple of 256: w2 only)
SHAPES = [(1024, 512, True, True), (1024, 192, True, False), (1088, 512, False, True)]
MIN_STAGE_K = {"wgmma32": 256, "wgmma64": 128, "wgmma128": 64}  # megamoe/sm90_plan.h wg_min_stage_k


# every kernel that can run each shape (a forced wgmma tile needs both K multiples of its smallest K per stage)
CASES = [(kernel, *shape) for kernel in ("auto", "stream", "wgmma32", "wgmma64", "wgmma128") for shape in SHAPES
         if kernel not in MIN_STAGE_K or (shape[0] % MIN_STAGE_K[kernel] == 0 and shape[1] % MIN_STAGE_K[kernel] == 0)]


@pytest.mark.parametrize("act_mode", ["w4a16", "w4a4"])
@pytest.mark.parametrize("kernel,hidden,inter,tiled13,tiled2", CASES)
def test_tiled_and_row_major_weights_give_the_same_bits(gen, kernel, act_mode, hidden, inter, tiled13, tiled2):
    backend_or_skip("cuda-sm90")
    be = cuda_sm90.CudaSm90Backend(kernel=kernel)
    layer = MoELayer.from_preset("small", seed=int(torch.randint(0, 1000, (1,), generator=gen)), backend=be,
                                 act_mode=act_mode, hidden_size=hidden, intermediate_size=inter)
    p = layer._prepared
    assert (p.w13_tiled, p.w2_tiled) == (tiled13, tiled2)
    flat = row_major(p)
    assert tiled13 == (not torch.equal(flat.w13_data, p.w13_data))
    assert tiled2 == (not torch.equal(flat.w2_data, p.w2_data))
    for t in (1, 3, 8, 40, 300):
        x = torch.randn(t, layer.config.hidden_size, generator=gen).to("cuda", torch.bfloat16)
        ids = torch.stack([torch.randperm(layer.config.num_experts, generator=gen)[: layer.config.top_k]
                           for _ in range(t)]).to("cuda", torch.int32)
        w = torch.rand(t, layer.config.top_k, generator=gen).to("cuda")
        x, ids, w = (v.contiguous() for v in (x, ids, w))
        out = {}
        for name, prepared in (("tiled", p), ("row-major", flat)):
            y = be.moe_forward(prepared, layer.config, x, ids, w)
            torch.cuda.synchronize()
            assert torch.isfinite(y).all(), (name, t)
            out[name] = y
        assert torch.equal(out["tiled"], out["row-major"]), (kernel, act_mode, inter, t)
        assert out["tiled"].abs().max() > 0


def test_v4_flash_and_v3_shapes_are_tiled():
    for h, i in ((4096, 2048), (7168, 2048)):
        assert cuda_sm90.sm90_tileable(2 * i, h, gate_up=True) and cuda_sm90.sm90_tileable(h, i)

"""cuda-sm90 / cpp/common NVFP4 quantizer: bytes identical to megamoe.nvfp4.quantize."""
from __future__ import annotations

import pytest
import torch

from megamoe import nvfp4
from megamoe.backends.torch_ref import row_global_scales

from _helpers import backend_or_skip

pytestmark = pytest.mark.gpu


def _nasty(rows: int, k: int, gen: torch.Generator) -> torch.Tensor:
    """Gaussian data with per-row magnitudes over 1e-4..1e4, outliers, exact E2M1 ties, zero blocks, Inf/NaN."""
    x = torch.randn((rows, k), generator=gen) * torch.exp(torch.randn((rows, 1), generator=gen) * 3)
    out = torch.rand((rows, k), generator=gen) < 0.002
    x[out] *= 30
    # exact ties: block values at E2M1 midpoints times a power of two (after scaling they land on .25, .75, ...)
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, -0.25, -0.75, -1.25, -1.75, -2.5, -3.5, -5.0, -6.0])
    nb = k // 16
    for r in range(0, rows, 3):
        b = int(torch.randint(0, nb, (1,), generator=gen))
        x[r, b * 16:(b + 1) * 16] = ties[torch.randperm(16, generator=gen)] * 2.0 ** int(torch.randint(-8, 8, (1,), generator=gen))
    x = x.clamp(-6e4, 6e4)  # finite in fp16 too
    if rows > 2:
        x[1, :16] = 0
        x[2, 5] = float("nan")
    return x


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows,k", [(1, 16), (7, 64), (33, 464), (129, 256), (300, 2048), (5, 5008), (1100, 2048)])
def test_quantize_bytes_identical(dtype, rows, k, gen):
    be = backend_or_skip("cuda-sm90")
    x = _nasty(rows, k, gen).to(dtype)
    for gs in (None, 1e-3, 1e3, "row"):
        g = row_global_scales(x.float()) if gs == "row" else gs
        ref = nvfp4.quantize(x, g)
        got = be.quantize(x.cuda(), None if g is None else (g.cuda() if torch.is_tensor(g) else g))
        assert torch.equal(got.data.cpu(), ref.data), f"data bytes differ (gs={gs}, {dtype}, {rows}x{k}): " \
            f"{int((got.data.cpu() != ref.data).sum())} of {ref.data.numel()}"
        assert torch.equal(got.scale.cpu().view(torch.uint8), ref.scale.view(torch.uint8)), f"scale bytes differ (gs={gs})"
        assert torch.equal(got.global_scale.cpu(), ref.global_scale), "global scale differs"


def _boundary_blocks(gs: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """fp32 blocks whose quotients by their block's decode scale lie within a few ulps of the E2M1
    rounding boundaries (and of the E2M1 values), with a few tiny and subnormal values: one row per
    global scale, 64 blocks each."""
    from megamoe.nvfp4 import FP4_MAX, FP8_MAX

    rows, nb = gs.numel(), 64
    # block amax = 6 * gs * S, S over the e4m3 range: the block's scale byte and decode scale d follow
    s_raw = 2.0 ** (torch.rand((rows, nb), generator=gen) * 17 - 9)
    amax = (FP4_MAX * gs[:, None] * s_raw).float()
    scale = (amax / (torch.tensor(FP4_MAX) * gs[:, None])).clamp(max=FP8_MAX).to(torch.float8_e4m3fn)
    d = scale.float() * gs[:, None]
    marks = torch.tensor([0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 3.5, 4.0, 5.0, 6.0])
    t = marks[torch.randint(0, marks.numel(), (rows, nb, 15), generator=gen)]
    x = t * d[..., None]
    steps = torch.randint(-3, 4, (rows, nb, 15), generator=gen)
    for _ in range(3):  # walk each value up to 3 ulps off its mark
        x = torch.where(steps > 0, torch.nextafter(x, torch.tensor(float("inf"))), x)
        x = torch.where(steps < 0, torch.nextafter(x, torch.tensor(float("-inf"))), x)
        steps = steps - steps.sign()
    tiny = torch.rand((rows, nb, 15), generator=gen) < 0.05
    x = torch.where(tiny, d[..., None] * 2.0 ** -80, x)
    x[:, :, 0] = torch.where(torch.rand((rows, nb), generator=gen) < 0.1, torch.tensor(1e-45), x[:, :, 0])
    x = x * torch.where(torch.rand(x.shape, generator=gen) < 0.5, -1.0, 1.0)
    return torch.cat([amax[..., None], x], dim=-1).reshape(rows, nb * 16)


def test_quantize_rounding_boundaries_over_the_scale_range(gen):
    """Quotients within 3 ulps of every E2M1 rounding boundary, under global scales from 2^-75 to 2^75
    (block decode scales on both sides of the range where the quantizer divides through one reciprocal
    per block), one global scale per row: bytes identical to the reference."""
    be = backend_or_skip("cuda-sm90")
    exps = torch.arange(-75, 76, 5).float()
    gs = (2.0 ** exps) * (1 + torch.rand(exps.shape, generator=gen))
    x = _boundary_blocks(gs, gen)
    assert torch.isfinite(x).all()
    for reps in (1, 70):  # a small grid (one block per thread) and a large one (two per thread)
        xr, gr = x.repeat(reps, 1), gs.repeat(reps)
        ref = nvfp4.quantize(xr, gr)
        got = be.quantize(xr.cuda(), gr.cuda())
        assert torch.equal(got.scale.cpu().view(torch.uint8), ref.scale.view(torch.uint8)), "scale bytes differ"
        bad = (got.data.cpu() != ref.data).any(dim=-1)
        assert not bad.any(), f"data bytes differ in the rows of global scales {gr[bad].tolist()} ({reps} copies)"


def test_quantize_inf_static_scale(gen):
    """Inf saturates to +-6 with the largest block scale; NaN encodes as 0 (static global scale)."""
    be = backend_or_skip("cuda-sm90")
    x = torch.randn((9, 64), generator=gen)
    x[0, 3], x[4, 40], x[5, 7] = float("inf"), float("-inf"), float("nan")
    ref = nvfp4.quantize(x, 0.01)
    got = be.quantize(x.cuda(), 0.01)
    assert torch.equal(got.data.cpu(), ref.data)
    assert torch.equal(got.scale.cpu().view(torch.uint8), ref.scale.view(torch.uint8))


def test_quantize_grouped_rowwise_dynamic_and_swizzled(gen):
    """Grouped rows at 128-aligned offsets, per-row dynamic scale, swizzled SF written directly."""
    be = backend_or_skip("cuda-sm90")
    from megamoe import _ext
    from megamoe.backends.cuda_common import GS_PER_ROW_DYNAMIC, current_stream

    sizes = [5, 0, 130, 1, 33]
    k = 464
    t = 40
    x = _nasty(t, k, gen).to(torch.bfloat16)
    src_rows = torch.randint(0, t, (sum(sizes),), generator=gen, dtype=torch.int32)
    src_off = torch.tensor([0] + list(torch.tensor(sizes).cumsum(0)), dtype=torch.int32)
    dst_off = nvfp4.grouped_row_offsets(sizes)
    total = int(dst_off[-1])
    kb = k // 16
    prow, pcol = nvfp4.sf_padded_shape(total, kb)
    data = torch.full((total, k // 2), 0xEE, dtype=torch.uint8, device="cuda")
    scale = torch.full((total, kb), 0x7F, dtype=torch.uint8, device="cuda")
    swz = torch.zeros((prow, pcol), dtype=torch.uint8, device="cuda")
    rs = torch.full((total,), float("nan"), device="cuda")
    _ext.ext.quantize_nvfp4(x.cuda(), None, GS_PER_ROW_DYNAMIC, src_rows.cuda(), src_off.cuda(),
                            dst_off[:-1].to(torch.int32).cuda(), data, scale, swz, total, None, rs,
                            current_stream())
    xs = x[src_rows.long()]
    ref = nvfp4.quantize(xs, row_global_scales(xs.float()))
    dst_rows = torch.cat([torch.arange(n) + int(o) for n, o in zip(sizes, dst_off[:-1])])
    assert torch.equal(data.cpu()[dst_rows], ref.data)
    assert torch.equal(scale.cpu()[dst_rows], ref.scale.view(torch.uint8))
    assert torch.equal(rs.cpu()[dst_rows], row_global_scales(xs.float()))
    ref_swz = nvfp4.swizzle_scales_grouped(ref.scale, sizes)
    assert torch.equal(swz.cpu(), ref_swz), "grouped swizzled SF written by the quantizer differs from the reference"

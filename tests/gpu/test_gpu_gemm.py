"""cuda-sm90 NVFP4 GEMM against the dequantized reference of the same NVFP4 inputs
(float64), random data and random per-block scales (docs/FIELD_BUGS.md rows 2, 11, 12)."""
from __future__ import annotations

import pytest
import torch

from megamoe import nvfp4
from megamoe.backends.cuda_sm90 import CudaSm90Backend

from _helpers import backend_or_skip, cosine, random_nvfp4, rel_err

pytestmark = pytest.mark.gpu

SHAPES = [(1, 256, 256), (7, 464, 464), (5, 96, 1040), (33, 1040, 2048), (129, 256, 7168), (300, 4096, 512), (8, 2048, 4096),
          # token counts across the wgmma kernels' per-tile widths (tile 64: 8, 16, 32, 40, 48, 56, 64; tile 128: 32 to
          # 128 in steps of 16) and tile boundaries
          (17, 200, 320), (70, 130, 192), (100, 264, 512), (193, 384, 256), (257, 136, 128), (257, 136, 256),
          (53, 320, 512), (109, 256, 256)]


# Every kernel of the dispatch plan (megamoe._C.Sm90GemmKernel); a K the wgmma kernel does not take
# (K % 64 != 0) runs the streaming kernel whatever is asked.
@pytest.mark.parametrize("kernel", ["stream", "wgmma32", "wgmma64", "wgmma128"])
@pytest.mark.parametrize("m,n,k", SHAPES)
@pytest.mark.parametrize("a_kind", ["nvfp4", "bf16"])
def test_gemm_random_scales(kernel, m, n, k, a_kind, gen):
    backend_or_skip("cuda-sm90")
    be = CudaSm90Backend(kernel=kernel)
    b = random_nvfp4(n, k, gen, global_scale=3.7e-3)
    if a_kind == "nvfp4":
        a = random_nvfp4(m, k, gen, global_scale=2.1e2)
    else:
        a = (torch.randn((m, k), generator=gen) * 3).to(torch.bfloat16)
    ref = nvfp4.gemm(a, b, compute_dtype=torch.float64)
    out = torch.full((m, n), float("nan"), device="cuda")  # poison: every element must be written
    be.gemm(a, b, out=out)
    out = out.cpu()
    cos, rel = cosine(out, ref), rel_err(out, ref)
    print(f"gemm {a_kind} kernel={kernel} {m}x{n}x{k}: cosine {cos:.8f} rel_err {rel:.2e}")
    assert torch.isfinite(out).all()
    assert cos >= 0.9999, (cos, rel)
    assert rel < 1e-4, rel  # both operands exact in bf16: only fp32 accumulation rounds
    # docs/FIELD_BUGS.md row 12: no structured error by column position
    err = (out.double() - ref).abs().amax(dim=0) / ref.abs().amax().clamp_min(1e-30)
    per_pos = torch.stack([err[p::32].max() for p in range(min(32, n))])
    assert float(per_pos.max()) < 1e-4, per_pos


def test_gemm_uniform_and_gate_up_scales(gen):
    be = backend_or_skip("cuda-sm90")
    a = random_nvfp4(16, 512, gen, uniform=True)
    b = random_nvfp4(64, 512, gen, uniform=True)
    ref = nvfp4.gemm(a, b, compute_dtype=torch.float64)
    assert cosine(be.gemm(a, b).cpu(), ref) >= 0.9999
    # two row groups with global scales 1e3 apart (gate / up style)
    b2 = random_nvfp4(64, 512, gen)
    b2 = nvfp4.NVFP4Tensor(b2.data, b2.scale, torch.tensor([1e-3, 1.0]))
    a2 = random_nvfp4(5, 512, gen)
    ref2 = nvfp4.gemm(a2, b2, compute_dtype=torch.float64)
    out2 = be.gemm(a2, b2).cpu()
    assert rel_err(out2[:, :32], ref2[:, :32]) < 1e-4 and rel_err(out2[:, 32:], ref2[:, 32:]) < 1e-4


# The wgmma kernels' K per stage (tile 32: 256; tile 64: 256, or 128 when K % 256 != 0; tile 128: 128, or 64 when
# K % 128 != 0) and ring depth (3; 3, or 6 with K 128; 4, or 8 with K 64), each slot with a full and an empty mbarrier
# whose phases alternate on every reuse. Tile 128 runs K = 64 j: its K-128 ring for even j, its K-64 ring for odd j;
# tile 64 runs K = 128 j: its K-256 ring for even j, its K-128 ring for odd j.
WG_STAGE_K = {"wgmma32": 256, "wgmma64": 128, "wgmma128": 64}


@pytest.mark.parametrize("kernel", list(WG_STAGE_K))
def test_gemm_every_ring_depth(kernel, gen):
    """K = 1 .. 10 stages of the kernel (tiles 64 and 128: K = 128 .. 2560 and 64 .. 1280, 1 .. 10 stages of their
    larger K per stage and 1 .. 19 of the smaller):
    fewer K tiles than the prefetch distance, exactly the ring, and every slot reused several times (each
    barrier phase parity on every slot), with token counts that pick different tile widths; poisoned output,
    bit-identical rerun. 416 weight rows: where the rows come by TMA, tile 64 runs its two row blocks (256 and a
    partial 160) in one block and tile 32 its four (128 each, the last partial) in two, the ring running on from the
    first into the second, also when the ring holds stages of both."""
    backend_or_skip("cuda-sm90")
    be = CudaSm90Backend(kernel=kernel)
    for stages in range(1, 11 if kernel == "wgmma32" else 21):
        k = WG_STAGE_K[kernel] * stages
        for m in (5, 40, 129):
            b = random_nvfp4(416, k, gen, global_scale=3.7e-3)
            a = (torch.randn((m, k), generator=gen) * 3).to(torch.bfloat16)
            ref = nvfp4.gemm(a, b, compute_dtype=torch.float64)
            out = torch.full((m, 416), float("nan"), device="cuda")
            be.gemm(a, b, out=out)
            got = out.cpu()
            assert torch.isfinite(got).all(), (kernel, k, m)
            assert cosine(got, ref) >= 0.9999 and rel_err(got, ref) < 1e-4, (kernel, k, m, rel_err(got, ref))
            # the rows of each block on their own (tile 64's two row blocks, tile 32's two pairs): the second
            # block's rows are where a ring carried over wrongly shows
            for r0, r1 in ((0, 256), (256, 416)):
                assert rel_err(got[:, r0:r1], ref[:, r0:r1]) < 1e-4, (kernel, k, m, r0)
            again = torch.full((m, 416), float("nan"), device="cuda")
            be.gemm(a, b, out=again)
            assert torch.equal(again.cpu(), got), (kernel, k, m)


@pytest.mark.parametrize("kernel", ["stream", "wgmma32", "wgmma64", "wgmma128"])
def test_gemm_every_scale_byte(kernel, gen):
    """Weight row r carries the one e4m3 scale byte r in all its blocks (every byte: zeros, negatives, subnormals,
    the largest, NaN), so that output column r sees that scale alone: each column against the reference (the scale
    codes and the signs and zeros prepare folds into the codes, megamoe/backends/cuda_sm90.py sm90_weights)."""
    backend_or_skip("cuda-sm90")
    be = CudaSm90Backend(kernel=kernel)
    k = 512
    data = torch.randint(0, 256, (256, k // 2), generator=gen, dtype=torch.uint8)
    scale = torch.arange(256, dtype=torch.int32).to(torch.uint8)[:, None].expand(256, k // 16).contiguous()
    b = nvfp4.NVFP4Tensor(data, scale.view(torch.float8_e4m3fn), torch.tensor(1.0))
    for m in (3, 40, 129):
        a = (torch.randn((m, k), generator=gen) * 3).to(torch.bfloat16)
        ref = nvfp4.gemm(a, b, compute_dtype=torch.float64)
        out = torch.full((m, 256), 7.0, device="cuda")  # poison
        be.gemm(a, b, out=out)
        got = out.cpu().double()
        nan_cols = [0x7F, 0xFF]
        assert torch.isnan(got[:, nan_cols]).all() and torch.isnan(ref[:, nan_cols]).all(), (kernel, m)
        zero_cols = [0x00, 0x80]
        assert torch.equal(got[:, zero_cols].abs(), torch.zeros(m, 2, dtype=torch.float64)), (kernel, m)
        rest = [c for c in range(256) if c not in nan_cols + zero_cols]
        assert torch.isfinite(got[:, rest]).all(), (kernel, m)
        assert bool((ref[:, rest].abs().amax(dim=0) > 0).all())  # every other column has a nonzero value
        err = (got[:, rest] - ref[:, rest]).abs().amax(dim=0) / ref[:, rest].abs().amax(dim=0)
        assert float(err.max()) < 1e-4, (kernel, m, rest[int(err.argmax())], float(err.max()))

"""Reference GEMM and the torch backend's GEMM against float64 loops."""
import pytest
import torch

from megamoe import nvfp4 as F
from megamoe.backends import get_backend

from _helpers import cosine, random_nvfp4, rel_err


def float64_dot_loop(a64, b64):
    m, n = a64.shape[0], b64.shape[0]
    out = torch.empty(m, n, dtype=torch.float64)
    for i in range(m):
        out[i] = (b64 * a64[i]).sum(1)
    return out


@pytest.mark.parametrize("m,n,k", [(1, 16, 16), (7, 33, 208), (33, 464, 48), (129, 64, 464)])
@pytest.mark.parametrize("gs", [(1e-3, 1e3), (None, None)])
def test_gemm_w4a4_vs_float64(gen, m, n, k, gs):
    a = random_nvfp4(m, k, gen, gs[0])
    b = random_nvfp4(n, k, gen, gs[1])
    ref = float64_dot_loop(F.dequantize(a, torch.float64), F.dequantize(b, torch.float64))
    out = F.gemm(a, b)
    assert out.dtype == torch.float32
    assert rel_err(out, ref) < 1e-5
    be_out = get_backend("torch").gemm(a, b, out_dtype=torch.bfloat16)
    assert be_out.dtype == torch.bfloat16
    assert cosine(be_out.float(), ref) > 0.9999


def test_gemm_w4a16_and_alpha(gen):
    a = torch.randn(9, 64, generator=gen).to(torch.bfloat16)
    b = random_nvfp4(40, 64, gen, 2.0)
    ref = float64_dot_loop(a.double(), F.dequantize(b, torch.float64)) * 0.5
    out = F.gemm(a, b, alpha=0.5)
    assert rel_err(out, ref) < 1e-5


def test_gemm_k_mismatch_is_an_error(gen):
    with pytest.raises(ValueError, match="K mismatch"):
        F.gemm(torch.randn(3, 32), random_nvfp4(4, 48, gen, None))


def test_random_scales_matter_uniform_scales_do_not(gen):
    # Why the health check uses random scales: permuting uniform scales changes nothing,
    # permuting random ones destroys the result (docs/FIELD_BUGS.md row 2).
    for uniform, expect_same in ((True, True), (False, False)):
        b = random_nvfp4(64, 256, gen, None, uniform=uniform)
        a = random_nvfp4(8, 256, gen, None, uniform=uniform)
        perm = torch.randperm(b.scale.numel(), generator=gen)
        b_bad = F.NVFP4Tensor(b.data, b.scale.reshape(-1)[perm].reshape(b.scale.shape), b.global_scale)
        c = cosine(F.gemm(a, b_bad), F.gemm(a, b))
        assert (c > 0.99999) == expect_same

"""Shared helpers of the GPU tests: the skip rule and the metrics."""
from __future__ import annotations

import pytest
import torch


def sm90_backend():
    """The cuda-sm90 backend, or a pytest skip that says why it is not here."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    from megamoe.backends import available_backends, get_backend

    ok, why = available_backends()["cuda-sm90"]
    if not ok:
        pytest.skip(f"cuda-sm90 not available: {why}")
    return get_backend("cuda-sm90")


def cosine(a, b) -> float:
    a = a.double().flatten()
    b = b.double().flatten()
    return float(a @ b / (a.norm() * b.norm()))


def rel_err(a, b) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def random_nvfp4(rows: int, k: int, gen: torch.Generator, global_scale=1.0, uniform: bool = False):
    """NVFP4 [rows, k] with random codes and random per-block e4m3 scales (never only ones)."""
    from megamoe import nvfp4

    if uniform:
        data = torch.full((rows, k // 2), 0x22, dtype=torch.uint8)  # all codes 2 (= 1.0)
        scale = torch.ones((rows, k // 16)).to(torch.float8_e4m3fn)
    else:
        data = torch.randint(0, 256, (rows, k // 2), generator=gen, dtype=torch.uint8)
        # scales spread over ~2^-6 .. 2^6 including subnormal-free normals and some tiny values
        s = torch.exp2(torch.randint(-6, 7, (rows, k // 16), generator=gen).float()) * (
            1 + torch.randint(0, 8, (rows, k // 16), generator=gen).float() / 8)
        scale = s.to(torch.float8_e4m3fn)
    return nvfp4.NVFP4Tensor(data, scale, torch.as_tensor(global_scale, dtype=torch.float32))

"""Fault injection: a backend with a known scale-factor bug (docs/FIELD_BUGS.md rows 1 and 2).

``SwappedScaleLayout(backend)`` behaves like ``backend`` except that its SF swizzle
iterates the *unpadded* size (padding left as it was: poison, or garbage) and swaps the M
and K coordinates. Uniform scales hide it (cosine 1.0); random scales expose it. The
health checks must fail on it: ``megamoe selftest --inject-fault swapped-sf`` shows they do.
"""
from __future__ import annotations

import torch

from megamoe import nvfp4
from megamoe.backends.base import Backend

FAULTS = ("swapped-sf",)


class SwappedScaleLayout(Backend):
    """``inner`` with the broken SF swizzle (M/K swapped, padding unwritten); all else is ``inner``'s."""

    def __init__(self, inner: Backend) -> None:
        self.inner = inner
        self.name = inner.name

    @property
    def device(self):
        return self.inner.device

    def swizzle_scales(self, scale, out=None):
        rows, cols = scale.shape[-2:]
        prow, pcol = nvfp4.sf_padded_shape(rows, cols)
        if out is None:
            out = torch.empty((prow, pcol), dtype=torch.uint8, device=scale.device)  # never zeroed
        flat = out.view(-1)
        i = torch.arange(rows * cols, device=scale.device)
        m, k = i % rows, i // rows  # M and K swapped: walks the scales column-major
        flat[nvfp4.sf_offset(m, k, cols)] = scale.contiguous().view(torch.uint8).reshape(-1)
        return out

    # everything else is the healthy backend's
    def quantize(self, x, global_scale=None):
        return self.inner.quantize(x, global_scale)

    def unswizzle_scales(self, buf, rows, cols):
        return self.inner.unswizzle_scales(buf, rows, cols)

    def swizzle_scales_grouped(self, scale, group_sizes, out=None):
        return self.inner.swizzle_scales_grouped(scale, group_sizes, out=out)

    def unswizzle_scales_grouped(self, buf, group_sizes, cols):
        return self.inner.unswizzle_scales_grouped(buf, group_sizes, cols)

    def gemm(self, a, b, alpha=None, out_dtype=torch.float32):
        from megamoe.backends.torch_ref import TorchBackend

        if isinstance(self.inner, TorchBackend):
            # the torch backend's GEMM reads its scales through self.swizzle_scales
            return TorchBackend.gemm(self, a, b, alpha=alpha, out_dtype=out_dtype)
        return self.inner.gemm(a, b, alpha=alpha, out_dtype=out_dtype)

    def prepare_weights(self, weights):
        return self.inner.prepare_weights(weights)

    def moe_forward(self, prepared, cfg, x, topk_ids, topk_weights, batch_invariant: bool = True):
        return self.inner.moe_forward(prepared, cfg, x, topk_ids, topk_weights, batch_invariant)

    def synchronize(self):
        self.inner.synchronize()


def inject(backend: Backend, fault: str) -> Backend:
    if fault == "swapped-sf":
        return SwappedScaleLayout(backend)
    raise ValueError(f"unknown fault {fault!r}; known: {list(FAULTS)}")

"""The ``torch`` backend: the reference computation (:mod:`megamoe.reference`,
docs/SPEC.md §3) on any torch device.

Weights stay NVFP4; each expert is dequantized on the fly (never all experts at once),
activations are quantized with the reference quantizer, GEMMs run in float32. Top-k ids
outside ``[0, E)`` (masked, -1) are skipped.
"""
from __future__ import annotations

import torch

from megamoe import nvfp4, reference
from megamoe.backends.base import Backend
# The reference math lives in megamoe.reference; the two names other modules import from
# here stay importable (import them from megamoe.reference).
from megamoe.reference import row_global_scales, swiglu  # noqa: F401


class _DequantizedExperts:
    """Prepared weights with every expert decoded once to float32 (the same values the
    per-forward decode gives, so results are bit-identical; only time is saved)."""

    def __init__(self, weights) -> None:
        self.weights = weights
        self.w13 = nvfp4.dequantize(weights.w13)
        self.w2 = nvfp4.dequantize(weights.w2)


class TorchBackend(Backend):
    """Reference backend (CPU or any torch device).

    Args:
        device: torch device (default CPU).
        cache_dequantized: keep a float32 copy of the decoded experts instead of decoding
            the experts a batch uses on every forward. ``None`` (default) caches when the
            copy is at most ``CACHE_LIMIT_BYTES`` (the tiny and small presets), which makes
            CPU serving several times faster; large layers are decoded per forward.
    """

    name = "torch"
    CACHE_LIMIT_BYTES = 1 << 30
    #: computes the experts' biases (b13, b2) and the activation's swiglu_alpha / swiglu_up_shift
    expert_bias_and_activation = True

    def __init__(self, device: str | torch.device | None = None, cache_dequantized: bool | None = None) -> None:
        self._device = torch.device(device) if device is not None else torch.device("cpu")
        self.cache_dequantized = cache_dequantized

    @property
    def device(self) -> torch.device:
        return self._device

    def gemm(self, a, b: nvfp4.NVFP4Tensor, alpha=None, out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
        # The scales take the path a tensor-core kernel's take: through the swizzled
        # layout and back. A broken swizzle then breaks this GEMM too, which is what
        # the random-scale health check exists to notice.
        n, kb = b.scale.shape[-2:]
        b_scale = self.unswizzle_scales(self.swizzle_scales(b.scale), n, kb)
        b_seen = nvfp4.NVFP4Tensor(b.data, b_scale, b.global_scale)
        if isinstance(a, nvfp4.NVFP4Tensor):
            m, akb = a.scale.shape[-2:]
            a = nvfp4.NVFP4Tensor(a.data, self.unswizzle_scales(self.swizzle_scales(a.scale), m, akb), a.global_scale)
        return nvfp4.gemm(a, b_seen, alpha=alpha, out_dtype=out_dtype)

    def prepare_weights(self, weights):
        weights = weights.to(self._device)
        decoded_bytes = 4 * (weights.w13.data.numel() + weights.w2.data.numel()) * 2
        cache = self.cache_dequantized
        if cache is None:
            cache = decoded_bytes <= self.CACHE_LIMIT_BYTES
        return _DequantizedExperts(weights) if cache else weights

    def moe_forward(self, prepared, cfg, x, topk_ids, topk_weights, batch_invariant: bool = True):
        # every GEMM here runs in fixed 64-row blocks (megamoe.invariant): batch-invariant either way
        cached = prepared if isinstance(prepared, _DequantizedExperts) else None
        w = cached.weights if cached is not None else prepared

        def expert(e: int, rows: torch.Tensor) -> torch.Tensor:
            w13 = cached.w13[e] if cached is not None else nvfp4.dequantize(w.w13[e])
            w2 = cached.w2[e] if cached is not None else nvfp4.dequantize(w.w2[e])
            in1 = None if w.w13_input_scale is None else w.w13_input_scale[e]
            in2 = None if w.w2_input_scale is None else w.w2_input_scale[e]
            return reference.expert_mlp(rows, w13, w2, cfg, in1, in2, b13=None if w.b13 is None else w.b13[e],
                                        b2=None if w.b2 is None else w.b2[e])

        return reference.routed_experts(x, topk_ids, topk_weights, cfg.num_experts, expert)

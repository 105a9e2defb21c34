"""The ``torch`` backend: the reference computation of SPEC §3 on any torch device.

Weights stay NVFP4; each expert is dequantized on the fly (never all experts at once),
activations are quantized with the reference quantizer, GEMMs run in float32.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from megamoe import nvfp4
from megamoe.backends.base import Backend


def row_global_scales(x: torch.Tensor) -> torch.Tensor:
    """Dynamic activation scales: one per row, ``amax(|row|) / 2688`` (1.0 for a zero row)."""
    return nvfp4.default_global_scale(x, dim=-1)


def activation_to_gemm_input(x: torch.Tensor, cfg, static_scale: torch.Tensor | None) -> torch.Tensor:
    """What the expert GEMM sees of an activation, as float32 (SPEC §3).

    w4a4: NVFP4 quantize (static per-expert scale, or per-row dynamic) then exact decode.
    w4a16: rounded to bfloat16.
    """
    if cfg.act_mode == "w4a16":
        return x.to(torch.bfloat16).float()
    gs = row_global_scales(x) if (cfg.dynamic_act_scale or static_scale is None) else static_scale
    return nvfp4.dequantize(nvfp4.quantize(x, gs))


def swiglu(gu: torch.Tensor, intermediate: int, limit: float | None) -> torch.Tensor:
    gate, up = gu[:, :intermediate], gu[:, intermediate:]
    if limit is not None:
        gate = gate.clamp(max=limit)
        up = up.clamp(-limit, limit)
    return F.silu(gate) * up


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

    def moe_forward(self, prepared, cfg, x, topk_ids, topk_weights):
        cached = prepared if isinstance(prepared, _DequantizedExperts) else None
        w = cached.weights if cached is not None else prepared
        t, h = x.shape
        inter = cfg.intermediate_size
        out = torch.zeros((t, h), dtype=torch.float32, device=x.device)
        flat_ids = topk_ids.reshape(-1).long()
        flat_w = topk_weights.reshape(-1).float()
        token_of = torch.arange(t, device=x.device).repeat_interleave(topk_ids.shape[1])
        order = torch.argsort(flat_ids, stable=True)
        counts = torch.bincount(flat_ids, minlength=cfg.num_experts).tolist()
        start = 0
        for e, n in enumerate(counts):
            if n == 0:
                continue
            sel = order[start:start + n]
            start += n
            tok = token_of[sel]
            xe = x[tok].float()
            a1 = activation_to_gemm_input(xe, cfg, None if w.w13_input_scale is None else w.w13_input_scale[e])
            gu = a1 @ (cached.w13[e] if cached is not None else nvfp4.dequantize(w.w13[e])).T
            hmid = swiglu(gu, inter, cfg.swiglu_limit)
            a2 = activation_to_gemm_input(hmid, cfg, None if w.w2_input_scale is None else w.w2_input_scale[e])
            ye = a2 @ (cached.w2[e] if cached is not None else nvfp4.dequantize(w.w2[e])).T
            out.index_add_(0, tok, ye * flat_w[sel].unsqueeze(1))
        return out

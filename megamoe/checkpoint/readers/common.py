"""Checks every reader applies: scales finite and > 0 (naming the tensor and the expert), no FP8
weights read as plain floats, K a multiple of 16 with matching block scales, a per-tensor
scale as a decode multiplier (a divisor inverted)."""
from __future__ import annotations

import torch

from megamoe.checkpoint.report import CheckpointError


def _check_scales(name: str, t: torch.Tensor, what: str) -> None:
    """Every value of a global / input scale finite and > 0, else a CheckpointError naming
    ``name`` (docs/FIELD_BUGS.md row 17)."""
    tf = t.float()
    bad = ~(torch.isfinite(tf) & (tf > 0))
    if bool(bad.any()):
        idx = [int(i) for i in bad.nonzero()[0].tolist()] if tf.dim() else []
        v = float(tf[tuple(idx)]) if idx else float(tf)
        at = f" at index {tuple(idx)}" if idx else ""
        raise CheckpointError(f"{name}: {what} {v!r}{at}; every {what} must be finite and > 0")


def _expert_scale_check(name: str, t: torch.Tensor, what: str) -> None:
    """Like :func:`_check_scales` for a stacked ``[E]`` / ``[E, 2]`` tensor; names the expert."""
    tf = t.float()
    bad = ~(torch.isfinite(tf) & (tf > 0))
    if bool(bad.any()):
        idx = bad.nonzero()[0].tolist()
        e = idx[0] if idx else 0
        part = {0: " (gate)", 1: " (up)"}.get(idx[1], "") if len(idx) > 1 else ""
        raise CheckpointError(f"{name}: expert {e}{part}: {what} {float(tf[tuple(idx)])!r}; "
                              f"every {what} must be finite and > 0")


_FP8 = {torch.float8_e4m3fn, torch.float8_e5m2, getattr(torch, "float8_e4m3fnuz", None),
        getattr(torch, "float8_e5m2fnuz", None)} - {None}


def _not_fp8(name: str, data: torch.Tensor) -> None:
    """An FP8 weight needs its own scales: never 'quantized at load' as if it were plain floats."""
    if data.dtype in _FP8:
        raise CheckpointError(f"{name}: dtype {data.dtype}: FP8 expert weights are not read (NVFP4 or "
                              f"bf16/fp16/fp32 only)")


def _check_k(name: str, data: torch.Tensor, scale: torch.Tensor | None) -> int:
    k = data.shape[-1] * 2 if data.dtype == torch.uint8 else data.shape[-1]
    if k % 16:
        raise CheckpointError(f"{name}: K={k} is not a multiple of 16 (NVFP4 blocks of 16)")
    if scale is not None and scale.shape[-1] * 16 != k:
        raise CheckpointError(f"{name}_scale: shape {tuple(scale.shape)} does not match K={k} (expected K/16={k // 16})")
    if scale is not None and scale.shape[:-1] != data.shape[:-1]:
        raise CheckpointError(f"{name}_scale: shape {tuple(scale.shape)} does not match {name} {tuple(data.shape)}")
    return k


def _scalar_scale(name: str, t: torch.Tensor, divisor: bool, what: str) -> torch.Tensor:
    """A per-tensor scale (shape [], [1]) as a float32 decode multiplier; a divisor is inverted."""
    if t.numel() != 1:
        raise CheckpointError(f"{name}: shape {tuple(t.shape)}, expected one value ([] or [1])")
    _check_scales(name, t, what + (" (a divisor)" if divisor else ""))
    v = t.float().reshape(())
    return torch.reciprocal(v) if divisor else v


def _has(get, name: str) -> bool:
    """Whether tensor ``name`` exists, without reading it where ``get`` can tell (``get.has``)."""
    has = getattr(get, "has", None)
    return has(name) if has is not None else get(name, required=False) is not None

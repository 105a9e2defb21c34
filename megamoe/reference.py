"""The reference MoE computation of docs/SPEC.md §3: the one copy of its math.

The NVFP4 format's own math (quantize, dequantize, scale-factor layout) is
:mod:`megamoe.nvfp4`; this module composes it into the MoE layer:

* :func:`swiglu`: ``silu(gate) * up`` with the optional clamp, or its gpt-oss variant
  ``(up + shift) * gate * sigmoid(alpha * gate)``;
* :func:`activation_to_gemm_input`: what an expert GEMM sees of an activation
  (w4a4: NVFP4 quantize with the static per-expert scale or per-row dynamic scales,
  then exact decode; w4a16: rounded to bfloat16);
* :func:`expert_mlp`: one expert on its rows (GEMM, + bias, activation, GEMM, + bias);
* :func:`routed_experts`: the loop over experts that sums each token's top-k
  weighted contributions, expert by expert in ascending id order;
* :func:`dense_mlp`: the shared expert (dense, unquantized).

Every GEMM here goes through :func:`megamoe.invariant.matmul_rows` (unless ``invariant=False``), so a
row's result does not depend on the other rows of its batch (docs/SPEC.md §3.5).

The torch backend (:mod:`megamoe.backends.torch_ref`) runs :func:`routed_experts` with
quantized activations; :meth:`megamoe.moe.MoELayer.reference_bf16` runs it on decoded
weights without activation quantization; the layer's shared expert is :func:`dense_mlp`.

Masked slots (docs/SPEC.md §3.1): a top-k id outside ``[0, E)`` (``-1`` is the mask value)
contributes nothing: its slot is skipped (its weight is never read, no expert runs for
it). The masking is elementwise on the device and adds no host synchronisation.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from megamoe import nvfp4
from megamoe.invariant import matmul

__all__ = ["row_global_scales", "activation_to_gemm_input", "swiglu", "expert_mlp", "valid_slots",
           "routed_experts", "dense_mlp"]


def row_global_scales(x: torch.Tensor) -> torch.Tensor:
    """Dynamic activation scales: one per row, ``amax(|row|) / 2688`` (1.0 for a zero row)."""
    return nvfp4.default_global_scale(x, dim=-1)


def activation_to_gemm_input(x: torch.Tensor, cfg, static_scale: torch.Tensor | None,
                             dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """What the expert GEMM sees of an activation, in ``dtype`` (docs/SPEC.md §3).

    w4a4: NVFP4 quantize (static per-expert scale, or per-row dynamic) then exact decode.
    w4a16: rounded to bfloat16.
    """
    if cfg.act_mode == "w4a16":
        return x.to(torch.bfloat16).to(dtype)
    gs = row_global_scales(x) if (cfg.dynamic_act_scale or static_scale is None) else static_scale
    return nvfp4.dequantize(nvfp4.quantize(x, gs), dtype)


def swiglu(gu: torch.Tensor, intermediate: int, limit: float | None, alpha: float = 1.0,
           up_shift: float = 0.0) -> torch.Tensor:
    """The experts' activation of ``gu = [gate | up]`` (``intermediate`` columns each):
    ``(up + up_shift) * gate * sigmoid(alpha * gate)``, which for ``alpha = 1``, ``up_shift = 0``
    is SwiGLU, ``silu(gate) * up`` (computed as exactly that). With ``limit``, gate is clamped
    to at most ``limit`` and up to ``[-limit, limit]`` first (before the shift). gpt-oss:
    limit 7, alpha 1.702, up_shift 1."""
    gate, up = gu[:, :intermediate], gu[:, intermediate:]
    if limit is not None:
        gate = gate.clamp(max=limit)
        up = up.clamp(-limit, limit)
    glu = F.silu(gate) if alpha == 1.0 else gate * torch.sigmoid(gate * alpha)
    return (up + up_shift if up_shift else up) * glu


def expert_mlp(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, cfg, in1: torch.Tensor | None = None,
               in2: torch.Tensor | None = None, quantize_activations: bool = True,
               invariant: bool = True, b13: torch.Tensor | None = None,
               b2: torch.Tensor | None = None) -> torch.Tensor:
    """One expert on its rows: ``[n, H]`` -> ``[n, H]`` in the dtype of the decoded weights.

    ``w13`` ``[2I, H]`` (gate rows, then up rows) and ``w2`` ``[H, I]`` are the expert's decoded
    weights (a routed expert, or a shared expert stored in NVFP4: I is ``w2``'s); ``in1`` /
    ``in2`` its static input scales (None: dynamic); ``b13`` ``[2I]`` / ``b2`` ``[H]`` its
    biases (gpt-oss), added to the first GEMM's output before the activation and to the
    second's output. The activation is :func:`swiglu` with the config's ``swiglu_limit``,
    ``swiglu_alpha`` and ``swiglu_up_shift``. With ``quantize_activations`` False the
    activations enter the GEMMs unchanged (the bf16 yardstick).
    """
    dtype = w13.dtype
    a1 = activation_to_gemm_input(x, cfg, in1, dtype) if quantize_activations else x.to(dtype)
    gu = matmul(a1, w13, invariant)
    if b13 is not None:
        gu = gu + b13.to(gu.dtype)
    hmid = swiglu(gu, w2.shape[1], cfg.swiglu_limit, getattr(cfg, "swiglu_alpha", 1.0),
                  getattr(cfg, "swiglu_up_shift", 0.0))
    # the second activation is quantized from float32, as a kernel's epilogue holds it
    a2 = activation_to_gemm_input(hmid.float(), cfg, in2, dtype) if quantize_activations else hmid
    y = matmul(a2, w2, invariant)
    return y if b2 is None else y + b2.to(y.dtype)


def valid_slots(topk_ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Boolean mask of the top-k slots whose id is in ``[0, num_experts)`` (the others are masked)."""
    return (topk_ids >= 0) & (topk_ids < num_experts)


def routed_experts(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, num_experts: int,
                   expert: Callable[[int, torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """``out[t] = sum_j w[t, j] * expert(ids[t, j], x[t])`` over the valid slots, float32 ``[T, H]``.

    ``expert(e, rows)`` maps expert ``e``'s rows (float32 ``[n, H]``, tokens in ascending order,
    a token's slots in slot order) to its outputs ``[n, H]``. Each expert runs once on all
    its rows; contributions are added expert by expert in ascending id order. Slots with an
    id outside ``[0, num_experts)`` are skipped.
    """
    t, h = x.shape
    out = torch.zeros((t, h), dtype=torch.float32, device=x.device)
    k = topk_ids.shape[1]
    ids = topk_ids.reshape(-1).long()
    # masked slots go to bin E, sorted after every expert's rows, and are never read
    flat_ids = torch.where(valid_slots(ids, num_experts), ids, torch.full_like(ids, num_experts))
    flat_w = topk_weights.reshape(-1).float()
    token_of = torch.arange(t, device=x.device).repeat_interleave(k)
    order = torch.argsort(flat_ids, stable=True)
    counts = torch.bincount(flat_ids, minlength=num_experts + 1)[:num_experts].tolist()
    start = 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        sel = order[start:start + n]
        start += n
        tok = token_of[sel]
        contrib = expert(e, x[tok].float()) * flat_w[sel].unsqueeze(1)
        if n > 1 and bool((tok[1:] == tok[:-1]).any()):
            # A token that lists expert e in several slots: index_add_ with a repeated index is an
            # atomic, unordered add on CUDA (docs/FIELD_BUGS.md row 28), so add the slots one
            # occurrence at a time, in slot order; each pass has distinct tokens.
            idx = torch.arange(n, device=x.device)
            run_start = torch.where(torch.cat([tok.new_ones(1, dtype=torch.bool), tok[1:] != tok[:-1]]), idx, 0)
            rank = idx - torch.cummax(run_start, 0).values
            for r in range(int(rank.max()) + 1):
                m = rank == r
                out.index_add_(0, tok[m], contrib[m])
        else:
            out.index_add_(0, tok, contrib)
    return out


def dense_mlp(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, limit: float | None,
              invariant: bool = True, alpha: float = 1.0, up_shift: float = 0.0) -> torch.Tensor:
    """The shared expert: ``swiglu(x @ gate_up.T) @ down.T`` in the dtype of the weights
    (``gate_up`` ``[2Is, H]``, ``down`` ``[H, Is]``; the activation as :func:`swiglu`)."""
    gu = matmul(x.to(gate_up.dtype), gate_up, invariant)
    return matmul(swiglu(gu, down.shape[1], limit, alpha, up_shift), down, invariant)

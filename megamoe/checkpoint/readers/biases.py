"""Reader: the routed experts' biases (gpt-oss), in each layout's names, as megamoe's ``b13``
float32 ``[E, 2I]`` (gate's I values then up's, in the stored row order of ``w13``; the loader
reorders them with the rows) and ``b2`` float32 ``[E, H]``:

* ``fused`` (megamoe's own writer, vLLM's names): ``w13_bias`` ``[E, 2I]``, ``w2_bias`` ``[E, H]``;
* ``hf-fused`` (transformers' names, ModelOpt's fused export): ``experts.gate_up_proj_bias``
  ``[E, 2I]`` (gpt-oss: gate and up interleaved), ``experts.down_proj_bias`` ``[E, H]``;
* ``per-expert`` (compressed-tensors, ModelOpt per expert): ``experts.{e}.gate_proj.bias``,
  ``up_proj.bias`` (``[I]`` each), ``down_proj.bias`` ``[H]`` (or ``w1`` / ``w3`` / ``w2``).

Each bias is read where present, and then every expert must have it (gate's and up's
together); which biases a layer needs is its architecture's rule (:mod:`megamoe.architectures`,
checked by the loader)."""
from __future__ import annotations

import torch

from megamoe.checkpoint.readers.common import _has
from megamoe.checkpoint.report import CheckpointError

#: layout -> (gate/up bias name, down bias name) of the stacked layouts
FUSED_BIAS_NAMES = {"fused": ("w13_bias", "w2_bias"),
                    "hf-fused": ("experts.gate_up_proj_bias", "experts.down_proj_bias")}
#: per-expert projection names: (gate, up, down), transformers' then DeepSeek's upstream
_PER_EXPERT_PROJS = (("gate_proj", "up_proj", "down_proj"), ("w1", "w3", "w2"))


def _float_bias(name: str, t: torch.Tensor, shape: tuple) -> torch.Tensor:
    if not torch.is_floating_point(t) or t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        raise CheckpointError(f"{name}: dtype {t.dtype}: a bias is bf16, fp16 or fp32")
    if tuple(t.shape) != tuple(shape):
        raise CheckpointError(f"{name}: shape {tuple(t.shape)}, expected {tuple(shape)}")
    t = t.float()
    if not bool(torch.isfinite(t).all()):
        raise CheckpointError(f"{name}: holds a NaN or an infinity")
    return t


def read_expert_biases(get, get_experts, prefix: str, where, layout: str, n_experts: int, two_i: int, h: int,
                       experts: tuple[int, int] | None = None):
    """``(b13 or None, b2 or None)`` of the layer's routed experts ``experts`` (default all
    ``n_experts``), read through ``get`` / ``get_experts`` (which record every tensor read)."""
    if layout in FUSED_BIAS_NAMES:
        n13, n2 = FUSED_BIAS_NAMES[layout]
        b13 = get_experts(n13, required=False)
        b2 = get_experts(n2, required=False)
        e = n_experts if experts is None else experts[1] - experts[0]
        return (None if b13 is None else _float_bias(prefix + n13, b13, (e, two_i)),
                None if b2 is None else _float_bias(prefix + n2, b2, (e, h)))
    ids = range(*(experts or (0, n_experts)))
    i = two_i // 2
    found: dict[str, list] = {"gate": [], "up": [], "down": []}
    for ex in ids:
        for j, (part, size) in enumerate((("gate", i), ("up", i), ("down", h))):
            names = [f"experts.{ex}.{projs[j]}.bias" for projs in _PER_EXPERT_PROJS]
            present = [n for n in names if _has(get, n)]
            found[part].append(_float_bias(prefix + present[0], get(present[0]), (size,)) if present else None)
    for part, proj in (("gate", "gate_proj"), ("up", "up_proj"), ("down", "down_proj")):
        have = [b is not None for b in found[part]]
        if any(have) and not all(have):
            at = list(ids)[have.index(False)]
            other = list(ids)[have.index(True)]
            raise CheckpointError(f"{prefix}experts.{at}.{proj}.bias: missing for expert {at} (present for expert "
                                  f"{other})")
    if (found["gate"][0] is None) != (found["up"][0] is None):
        have, miss = ("gate_proj", "up_proj") if found["up"][0] is None else ("up_proj", "gate_proj")
        ex = list(ids)[0]
        raise CheckpointError(f"{prefix}experts.{ex}.{miss}.bias: missing (the expert's {have}.bias is there; "
                              f"the first GEMM's bias covers gate and up)")
    b13 = None if found["gate"][0] is None else torch.stack(
        [torch.cat([g, u]) for g, u in zip(found["gate"], found["up"])])
    b2 = None if found["down"][0] is None else torch.stack(found["down"])
    return b13, b2


def apply_b13_layout(b13: torch.Tensor | None, layout: str) -> torch.Tensor | None:
    """``b13`` ``[E, 2I]`` in a fused tensor's row order -> ``[gate; up]`` (the rows of
    :func:`megamoe.checkpoint.readers.fused._apply_w13_layout`)."""
    if b13 is None or layout == "gate-up":
        return b13
    n = b13.shape[1]
    if layout == "up-gate":
        perm = torch.cat([torch.arange(n // 2, n), torch.arange(0, n // 2)])
    elif layout == "interleaved":
        perm = torch.cat([torch.arange(0, n, 2), torch.arange(1, n, 2)])
    else:
        raise CheckpointError(f"w13_layout={layout!r}: not a fused gate/up order")
    return b13[:, perm.to(b13.device)].contiguous()


__all__ = ["read_expert_biases", "apply_b13_layout", "FUSED_BIAS_NAMES"]

"""The tensors around the routed experts, which every rank keeps whole: the router, its
correction bias or logit bias (gpt-oss), the hash table of DeepSeek-V4's hash layers, Qwen2-MoE's shared-expert gate
and the shared expert (bf16 or NVFP4, under each naming of :data:`SHARED_NAMINGS`)."""
from __future__ import annotations

import torch

from megamoe import nvfp4
from megamoe.checkpoint.readers.per_expert import _read_proj
from megamoe.checkpoint.report import CheckpointError, LoadReport

#: names of the router tensors after the layer prefix, in the order they are looked for:
#: transformers' names first, then DeepSeek's upstream ones (llmcompressor's save of DeepSeek-V4).
ROUTER_NAMES = {
    # Llama 4 and gpt-oss name the router "router"
    "router": ("gate.weight", "router.weight"),
    # MiniMax-M2 keeps the bias in the block, not the router
    "bias": ("gate.e_score_correction_bias", "gate.bias", "e_score_correction_bias"),
    "tid2eid": ("gate.tid2eid",),
    # gpt-oss's router bias, added to the logits (not DeepSeek's selection-only gate.bias)
    "logit_bias": ("router.bias",),
    # Qwen2-MoE: the shared expert's output scaled by sigmoid(x · g)
    "shared_gate": ("shared_expert_gate.weight",),
}
#: the shared expert's projections, per naming: transformers' (gate/up/down_proj), DeepSeek's
#: upstream (w1 = gate, w3 = up, w2 = down), and the singular ``shared_expert`` of Qwen2-MoE
#: and Llama 4.
SHARED_NAMINGS = (("shared_experts.gate_proj.", "shared_experts.up_proj.", "shared_experts.down_proj."),
                  ("shared_experts.w1.", "shared_experts.w3.", "shared_experts.w2."),
                  ("shared_expert.gate_proj.", "shared_expert.up_proj.", "shared_expert.down_proj."))


def _has_name(get_optional, name: str) -> bool:
    has = getattr(get_optional, "has", None)
    return has(name) if has is not None else get_optional(name) is not None


def _one_of(get_optional, prefix: str, names: tuple[str, ...]):
    """The tensor stored under one of ``names`` (aliases), or None; two of them present is refused."""
    present = [n for n in names if _has_name(get_optional, n)]
    if len(present) > 1:
        raise CheckpointError(f"{prefix}{present[0]} and {prefix}{present[1]}: both present; they are two names "
                              f"for one tensor, and megamoe does not choose between them")
    return get_optional(present[0]) if present else None


def _shared_naming(get_optional, prefix: str) -> tuple[str, str, str] | None:
    """The shared expert's projection bases (gate, up, down) under the naming the checkpoint
    uses, or None when it has no such tensors."""
    found = [bases for bases in SHARED_NAMINGS
             if any(_has_name(get_optional, b + s) for b in bases for s in ("weight", "weight_packed"))]
    if len(found) > 1:
        raise CheckpointError(f"{prefix}{found[0][0]}* and {prefix}{found[1][0]}*: two shared experts under two "
                              f"namings")
    return found[0] if found else None


def _shared_nvfp4(get_optional, prefix: str, bases=SHARED_NAMINGS[0]):
    """An NVFP4 shared expert (``bases``: its gate, up and down projections), either format's
    naming -> (gate_up NVFP4 [2Is, H] with global scale [2], down NVFP4 [H, Is], in1, in2)."""
    report = LoadReport(path="")

    def get(name, required=True):
        t = get_optional(name)
        if t is None and required:
            raise CheckpointError(f"{prefix}{name}: missing")
        return t

    get.has = getattr(get_optional, "has", None)

    g, ig, _, _ = _read_proj(get, report, prefix, bases[0])
    u, iu, _, _ = _read_proj(get, report, prefix, bases[1])
    d, idn, _, _ = _read_proj(get, report, prefix, bases[2])
    if g.data.shape != u.data.shape:
        raise CheckpointError(f"{prefix}{bases[1]}: shape {tuple(u.shape)} differs from {bases[0]} {tuple(g.shape)}")
    gu = nvfp4.NVFP4Tensor(torch.cat([g.data, u.data]), torch.cat([g.scale, u.scale]),
                           torch.stack([g.global_scale.reshape(()), u.global_scale.reshape(())]))
    in1 = None if ig is None and iu is None else torch.maximum(ig, iu) if ig is not None and iu is not None else (ig if ig is not None else iu)
    return gu, d, in1, idn, report


def read_dense_tensors(get_optional, prefix: str) -> dict:
    """Router, correction bias, hash table and shared expert (every rank keeps these whole).

    ``get_optional(name)`` returns the tensor or None. Names after the prefix
    (:data:`ROUTER_NAMES`, :data:`SHARED_NAMINGS`): the router ``gate.weight``; the correction
    bias ``gate.e_score_correction_bias`` (DeepSeek's upstream ``gate.bias``); the hash table
    ``gate.tid2eid`` (DeepSeek-V4 hash layers); the router bias ``router.bias`` added to the
    logits (gpt-oss); the shared expert
    ``shared_experts.{gate,up,down}_proj`` (upstream ``shared_experts.w1/w3/w2``) or
    ``shared_experts.gate_up_proj`` + ``down_proj``, in a float dtype or in NVFP4 (ModelOpt or
    compressed-tensors naming; then ``shared_kind`` is ``"nvfp4"`` and the input scales come along).
    """
    out = {"router": _one_of(get_optional, prefix, ROUTER_NAMES["router"]),
           "bias": _one_of(get_optional, prefix, ROUTER_NAMES["bias"]),
           "tid2eid": _one_of(get_optional, prefix, ROUTER_NAMES["tid2eid"]),
           "logit_bias": _one_of(get_optional, prefix, ROUTER_NAMES["logit_bias"]),
           "shared_gate": _one_of(get_optional, prefix, ROUTER_NAMES["shared_gate"]),
           "shared_gate_up": None, "shared_down": None, "shared_in1": None, "shared_in2": None,
           "shared_kind": "none", "shared_report": None}
    g = out["shared_gate"]
    if g is not None and (not torch.is_floating_point(g) or g.dim() != 2 or g.shape[0] != 1):
        raise CheckpointError(f"{prefix}{ROUTER_NAMES['shared_gate'][0]}: {g.dtype} {tuple(g.shape)}; expected an "
                              f"unquantized [1, H] gate (bf16/fp16/fp32)")
    lb = out["logit_bias"]
    if lb is not None and (not torch.is_floating_point(lb) or lb.dim() != 1):
        raise CheckpointError(f"{prefix}{ROUTER_NAMES['logit_bias'][0]}: {lb.dtype} {tuple(lb.shape)}; expected an "
                              f"unquantized [E] router bias (bf16/fp16/fp32)")
    t = out["tid2eid"]
    if t is not None and (t.dim() != 2 or torch.is_floating_point(t) or t.dtype == torch.bool):
        raise CheckpointError(f"{prefix}{ROUTER_NAMES['tid2eid'][0]}: {t.dtype} {tuple(t.shape)}; expected an "
                              f"integer table [vocab, top_k]")
    bases = _shared_naming(get_optional, prefix) or SHARED_NAMINGS[0]
    gname, uname, dname = bases
    packed = _has_name(get_optional, gname + "weight_packed")
    plain = None if packed else get_optional(gname + "weight")
    if packed or (plain is not None and plain.dtype == torch.uint8):
        gu, d, in1, in2, rep = _shared_nvfp4(get_optional, prefix, bases)
        out.update(shared_gate_up=gu, shared_down=d, shared_in1=in1, shared_in2=in2, shared_kind="nvfp4",
                   shared_report=rep)
        return out
    shared_gu = get_optional("shared_experts.gate_up_proj.weight")
    if shared_gu is None:
        u = get_optional(uname + "weight")
        if (plain is None) != (u is None):
            have, miss = (gname, uname) if u is None else (uname, gname)
            raise CheckpointError(f"{prefix}{miss}weight: missing (the shared expert's {have}weight is there)")
        shared_gu = torch.cat([plain, u]) if plain is not None else None
    elif plain is not None:
        raise CheckpointError(f"{prefix}shared_experts.gate_up_proj.weight and {prefix}{gname}weight: the shared "
                              f"expert's gate stored twice")
    shared_down = get_optional(dname + "weight")
    if (shared_gu is None) != (shared_down is None):
        miss = dname + "weight" if shared_down is None else gname + "weight"
        raise CheckpointError(f"{prefix}{miss}: missing (the shared expert is incomplete)")
    for name, t in ((gname + "weight", shared_gu), (dname + "weight", shared_down)):
        if t is not None and not torch.is_floating_point(t):
            raise CheckpointError(f"{prefix}{name}: dtype {t.dtype}: a shared expert is bf16/fp16/fp32 or NVFP4 "
                                  f"with its scales")
    out.update(shared_gate_up=shared_gu, shared_down=shared_down,
               shared_kind="none" if shared_gu is None else str(shared_gu.dtype).replace("torch.", ""))
    return out

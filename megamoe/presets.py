"""The reference MoE shapes of docs/SPEC.md §3."""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace


@dataclass(frozen=True)
class MoEConfig:
    """Shape and semantics of one MoE layer (docs/SPEC.md §3).

    Attributes:
        hidden_size: H.  intermediate_size: I (per expert).  num_experts: E.  top_k: k.
        scoring: "softmax", "sigmoid" or "sqrtsoftplus" (``sqrt(softplus(logits))``) router scores,
            or "softmax_topk" (gpt-oss: the top-k of the logits, weighted by the softmax over the k
            chosen logits; normalised by definition, so ``renormalize`` must stay True).
        hash_routing: the experts are ``tid2eid[input_ids]`` (a frozen token-id table, DeepSeek-V4's
            ``hash_moe`` layers) instead of the top-k of the scores; the scores still give the weights.
        n_group / topk_group: group-limited routing (None: off).
        renormalize: renormalise the chosen weights.  routed_scaling_factor: final weight scale.
        n_shared_experts / shared_intermediate_size: dense SwiGLU expert added to every token.
        act_mode: "w4a4" (activations quantized to NVFP4) or "w4a16" (bf16 activations).
        dynamic_act_scale: compute each activation row's global scale from the row
            (amax/2688) instead of the static per-expert input scales.
        swiglu_limit: optional clamp of gate (max) and up (±limit) before the activation.
        swiglu_alpha / swiglu_up_shift: the experts' activation is
            ``h = (up + swiglu_up_shift) * gate * sigmoid(swiglu_alpha * gate)`` (after the clamp);
            the defaults 1.0 / 0.0 give SwiGLU, ``silu(gate) * up``; gpt-oss: 1.702 / 1.0.
        shared_expert_gate: the shared expert's output is scaled per token by
            ``sigmoid(x · g)`` (``g`` = the weights' ``shared_expert_gate``, ``[1, H]``; Qwen2-MoE).
        router_weight_on_input: each chosen expert runs on its row multiplied by the router
            weight (in the rows' dtype) and its output is added with weight 1 (Llama 4), instead
            of its output being multiplied by the weight.
    """

    hidden_size: int
    intermediate_size: int
    num_experts: int
    top_k: int
    scoring: str = "softmax"
    hash_routing: bool = False
    n_group: int | None = None
    topk_group: int | None = None
    renormalize: bool = True
    routed_scaling_factor: float = 1.0
    n_shared_experts: int = 0
    shared_intermediate_size: int | None = None
    act_mode: str = "w4a4"
    dynamic_act_scale: bool = False
    swiglu_limit: float | None = None
    shared_expert_gate: bool = False
    router_weight_on_input: bool = False
    swiglu_alpha: float = 1.0
    swiglu_up_shift: float = 0.0

    def __post_init__(self) -> None:
        for name in ("hidden_size", "intermediate_size"):
            v = getattr(self, name)
            if v <= 0 or v % 16:
                raise ValueError(f"{name}={v} must be a positive multiple of 16 (NVFP4 blocks)")
        if self.num_experts <= 0 or not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"need 1 <= top_k ({self.top_k}) <= num_experts ({self.num_experts})")
        if self.act_mode not in ("w4a4", "w4a16"):
            raise ValueError(f"act_mode={self.act_mode!r}: expected 'w4a4' or 'w4a16'")
        if self.scoring not in ("softmax", "sigmoid", "sqrtsoftplus", "softmax_topk"):
            raise ValueError(f"scoring={self.scoring!r}: expected 'softmax', 'sigmoid', 'sqrtsoftplus' or "
                             f"'softmax_topk'")
        if self.scoring == "softmax_topk":
            if self.hash_routing or (self.n_group and self.n_group > 1):
                raise ValueError("scoring='softmax_topk' takes the top-k of the logits: hash_routing and n_group "
                                 "do not apply")
            if not self.renormalize:
                raise ValueError("scoring='softmax_topk' weighs the chosen experts by the softmax over their "
                                 "logits, which sums to 1: renormalize=False does not apply")
        if not (math.isfinite(self.swiglu_alpha) and self.swiglu_alpha > 0):
            raise ValueError(f"swiglu_alpha={self.swiglu_alpha}: expected a finite value > 0")
        if not math.isfinite(self.swiglu_up_shift):
            raise ValueError(f"swiglu_up_shift={self.swiglu_up_shift}: expected a finite value")
        if self.hash_routing and self.n_group and self.n_group > 1:
            raise ValueError("hash_routing chooses the experts from a table: n_group does not apply")
        if self.shared_expert_gate and not self.n_shared_experts:
            raise ValueError("shared_expert_gate scales the shared expert: it needs n_shared_experts >= 1")
        if self.swiglu_limit is not None and not self.swiglu_limit > 0:
            raise ValueError(f"swiglu_limit={self.swiglu_limit}: expected a positive limit or None")

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "MoEConfig":
        known = {f for f in cls.__dataclass_fields__}
        return cls(**{k: v for k, v in d.items() if k in known})

    def with_(self, **kw) -> "MoEConfig":
        return replace(self, **kw)


PRESETS: dict[str, MoEConfig] = {
    "tiny": MoEConfig(256, 128, 8, 2),
    "small": MoEConfig(1024, 512, 32, 4),
    # DeepSeek-V4-Flash's MoE (a top-k `moe` layer): sqrt(softplus) scores with a correction bias,
    # SwiGLU clamped at 10, one shared expert of width 2048. Its `hash_moe` layers are the same
    # with hash_routing=True.
    "v4-flash": MoEConfig(4096, 2048, 256, 6, scoring="sqrtsoftplus", routed_scaling_factor=1.5,
                          n_shared_experts=1, shared_intermediate_size=2048, swiglu_limit=10.0),
    "v3": MoEConfig(7168, 2048, 256, 8, scoring="sigmoid", n_group=8, topk_group=4,
                    routed_scaling_factor=2.5, n_shared_experts=1, shared_intermediate_size=2048),
}


def get_preset(name: str) -> MoEConfig:
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)}") from None

"""The weights of one NVFP4 MoE layer (:class:`MoEWeights`), shared by the layer
(:mod:`megamoe.moe`), the loaders (:mod:`megamoe.checkpoint`, :mod:`megamoe.distributed`)
and the backends. Depends only on the NVFP4 format and the config, so every one of those
modules can import it.
"""
from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from megamoe import nvfp4
from megamoe.presets import MoEConfig

__all__ = ["MoEWeights"]


@dataclass
class MoEWeights:
    """Weights of one MoE layer (ModelOpt NVFP4 naming, docs/SPEC.md §3).

    Attributes:
        w13: NVFP4 ``[E, 2I, H]`` gate rows then up rows; global_scale ``[E, 2]`` (gate, up).
        w2: NVFP4 ``[E, H, I]``; global_scale ``[E]``.
        w13_input_scale: float32 ``[E]`` static global scale of the L1 input, or None (dynamic).
        w2_input_scale: float32 ``[E]`` static global scale of the L2 input, or None (dynamic).
        router_weight: ``[E, H]`` router (gate) weight, or None (caller routes).
        router_bias: float32 ``[E]`` e_score_correction_bias (selection only), or None.
        shared_gate_up: bf16 ``[2*Is, H]`` shared expert gate and up rows, or None.
        shared_down: bf16 ``[H, Is]`` shared expert down projection, or None.
        shared_gate_up_input_scale, shared_down_input_scale: float32 ``[]`` static input
            scales of a shared expert stored in NVFP4 (then ``shared_gate_up`` and
            ``shared_down`` are :class:`~megamoe.nvfp4.NVFP4Tensor`, gate/up global scale
            ``[2]``), or None (docs/SPEC.md §3.4).
        tid2eid: int64 ``[vocab, k]`` the experts of each token id in a hash-routed layer
            (DeepSeek-V4 ``hash_moe``), or None.
        shared_expert_gate: ``[1, H]`` the shared expert's gate (its output is scaled per token
            by ``sigmoid(x · g)``, Qwen2-MoE), or None.
        b13: float32 ``[E, 2I]`` the experts' gate/up bias (gate's I values, then up's, in the row
            order of ``w13``), added to the first GEMM's output before the activation (gpt-oss),
            or None.
        b2: float32 ``[E, H]`` the experts' down bias, added to each expert's output before its
            routing weight (gpt-oss), or None.
        router_logit_bias: float32 ``[E]`` added to the router logits (gpt-oss's router bias; it
            changes the selection and the weights, unlike ``router_bias``), or None.
    """

    w13: nvfp4.NVFP4Tensor
    w2: nvfp4.NVFP4Tensor
    w13_input_scale: torch.Tensor | None = None
    w2_input_scale: torch.Tensor | None = None
    router_weight: torch.Tensor | None = None
    router_bias: torch.Tensor | None = None
    shared_gate_up: torch.Tensor | None = None
    shared_down: torch.Tensor | None = None
    shared_gate_up_input_scale: torch.Tensor | None = None
    shared_down_input_scale: torch.Tensor | None = None
    tid2eid: torch.Tensor | None = None
    shared_expert_gate: torch.Tensor | None = None
    b13: torch.Tensor | None = None
    b2: torch.Tensor | None = None
    router_logit_bias: torch.Tensor | None = None

    #: the per-expert fields (sliced by :meth:`expert_slice`, on ``routed_device`` in :meth:`to`)
    ROUTED = ("w13", "w2", "w13_input_scale", "w2_input_scale", "b13", "b2")

    def to(self, device, routed_device=None) -> "MoEWeights":
        """Every tensor on ``device``; the routed experts (``w13``, ``w2``) on ``routed_device``
        when given (their biases ``b13``, ``b2`` stay on ``device``, beside the backend's own
        copy of the experts). Tensors already there are kept, not copied."""
        kw = {}
        for f in fields(self):
            v = getattr(self, f.name)
            dev = routed_device if routed_device is not None and f.name in ("w13", "w2") else device
            kw[f.name] = v.to(dev) if v is not None else None
        return MoEWeights(**kw)

    @property
    def num_experts(self) -> int:
        return self.w13.data.shape[0]

    def expert_slice(self, start: int, end: int) -> "MoEWeights":
        """Experts ``[start, end)`` of every per-expert tensor (NVFP4 data, block scales, global
        scales, input scales), as copies that own exactly their bytes; the router and the
        shared expert (which cover every expert or none) stay whole. A 0-d scale (one value
        for every expert) is kept as it is."""
        if not 0 <= start < end <= self.num_experts:
            raise ValueError(f"expert slice [{start}, {end}) is not inside the {self.num_experts} experts")

        def part(t):
            return t if t is None or t.dim() == 0 else t[start:end].clone()

        def part_nvfp4(q):
            return nvfp4.NVFP4Tensor(part(q.data), part(q.scale), part(q.global_scale))

        return MoEWeights(
            w13=part_nvfp4(self.w13), w2=part_nvfp4(self.w2),
            w13_input_scale=part(self.w13_input_scale), w2_input_scale=part(self.w2_input_scale),
            router_weight=self.router_weight, router_bias=self.router_bias,
            shared_gate_up=self.shared_gate_up, shared_down=self.shared_down,
            shared_gate_up_input_scale=self.shared_gate_up_input_scale,
            shared_down_input_scale=self.shared_down_input_scale, tid2eid=self.tid2eid,
            shared_expert_gate=self.shared_expert_gate, b13=part(self.b13), b2=part(self.b2),
            router_logit_bias=self.router_logit_bias,
        )

    def validate(self, cfg: MoEConfig, num_local_experts: int | None = None) -> None:
        """Raise ValueError naming the first tensor whose shape or dtype disagrees with ``cfg``.

        ``num_local_experts``: the expert tensors hold this many experts (a rank's shard);
        the router still covers all ``cfg.num_experts``.
        """
        e_all, h, i = cfg.num_experts, cfg.hidden_size, cfg.intermediate_size
        e = e_all if num_local_experts is None else num_local_experts
        want = {
            "w13_weight": (self.w13.data, (e, 2 * i, h // 2), torch.uint8),
            "w13_weight_scale": (self.w13.scale, (e, 2 * i, h // 16), torch.float8_e4m3fn),
            "w13_weight_scale_2": (self.w13.global_scale, (e, 2), torch.float32),
            "w2_weight": (self.w2.data, (e, h, i // 2), torch.uint8),
            "w2_weight_scale": (self.w2.scale, (e, h, i // 16), torch.float8_e4m3fn),
            "w2_weight_scale_2": (self.w2.global_scale, (e,), torch.float32),
        }
        if self.w13_input_scale is not None:
            want["w13_input_scale"] = (self.w13_input_scale, (e,), torch.float32)
        if self.w2_input_scale is not None:
            want["w2_input_scale"] = (self.w2_input_scale, (e,), torch.float32)
        if self.router_weight is not None:
            want["gate.weight"] = (self.router_weight, (e_all, h), None)
        if self.router_bias is not None:
            if cfg.scoring == "softmax_topk":
                raise ValueError("gate.e_score_correction_bias: present, but scoring='softmax_topk' selects the top-k "
                                 "of the logits (a logit bias is router_logit_bias)")
            want["gate.e_score_correction_bias"] = (self.router_bias, (e_all,), None)
        if cfg.n_shared_experts:
            is_ = (cfg.shared_intermediate_size or i) * cfg.n_shared_experts
            want["shared_experts.gate_up_proj.weight"] = (self.shared_gate_up, (2 * is_, h), None)
            want["shared_experts.down_proj.weight"] = (self.shared_down, (h, is_), None)
        if cfg.hash_routing:
            if self.tid2eid is None:
                raise ValueError("gate.tid2eid: missing (the config routes by token id: hash_routing=True)")
            if self.tid2eid.dim() != 2 or self.tid2eid.shape[1] != cfg.top_k:
                raise ValueError(f"gate.tid2eid: shape {tuple(self.tid2eid.shape)}, expected [vocab, {cfg.top_k}]")
            if torch.is_floating_point(self.tid2eid) or self.tid2eid.dtype == torch.bool:
                raise ValueError(f"gate.tid2eid: dtype {self.tid2eid.dtype}, expected an integer type")
            if self.tid2eid.numel() and (int(self.tid2eid.min()) < 0 or int(self.tid2eid.max()) >= e_all):
                raise ValueError(f"gate.tid2eid: expert ids outside [0, {e_all}): min {int(self.tid2eid.min())}, "
                                 f"max {int(self.tid2eid.max())}")
        elif self.tid2eid is not None:
            raise ValueError("gate.tid2eid: present, but the config does not route by token id (hash_routing=False)")
        if self.b13 is not None:
            want["w13_bias"] = (self.b13, (e, 2 * i), torch.float32)
        if self.b2 is not None:
            want["w2_bias"] = (self.b2, (e, h), torch.float32)
        if self.router_logit_bias is not None:
            if self.router_weight is None:
                raise ValueError("router.bias: present without the router weight (the bias is added to the "
                                 "logits the router weight computes)")
            want["router.bias"] = (self.router_logit_bias, (e_all,), torch.float32)
        if getattr(cfg, "shared_expert_gate", False):
            want["shared_expert_gate.weight"] = (self.shared_expert_gate, (1, h), None)
        elif self.shared_expert_gate is not None:
            raise ValueError("shared_expert_gate.weight: present, but the config has shared_expert_gate=False")
        for name, (t, shape, dtype) in want.items():
            if t is None:
                raise ValueError(f"{name}: missing")
            if tuple(t.shape) != shape:
                raise ValueError(f"{name}: shape {tuple(t.shape)}, expected {shape}")
            if dtype is not None and t.dtype != dtype:
                raise ValueError(f"{name}: dtype {t.dtype}, expected {dtype}")

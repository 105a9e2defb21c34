"""The MoE layer of SPEC §3: routing, routed NVFP4 experts (on a backend), shared expert."""
from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from megamoe import nvfp4
from megamoe.backends import Backend, get_backend
from megamoe.backends.torch_ref import swiglu
from megamoe.presets import MoEConfig, get_preset
from megamoe.routing import route

__all__ = ["MoEWeights", "MoELayer", "MoEConfig"]


@dataclass
class MoEWeights:
    """Weights of one MoE layer (ModelOpt NVFP4 naming, SPEC §3).

    Attributes:
        w13: NVFP4 ``[E, 2I, H]`` gate rows then up rows; global_scale ``[E, 2]`` (gate, up).
        w2: NVFP4 ``[E, H, I]``; global_scale ``[E]``.
        w13_input_scale: float32 ``[E]`` static global scale of the L1 input, or None (dynamic).
        w2_input_scale: float32 ``[E]`` static global scale of the L2 input, or None (dynamic).
        router_weight: ``[E, H]`` router (gate) weight, or None (caller routes).
        router_bias: float32 ``[E]`` e_score_correction_bias (selection only), or None.
        shared_gate_up: bf16 ``[2*Is, H]`` shared expert gate and up rows, or None.
        shared_down: bf16 ``[H, Is]`` shared expert down projection, or None.
    """

    w13: nvfp4.NVFP4Tensor
    w2: nvfp4.NVFP4Tensor
    w13_input_scale: torch.Tensor | None = None
    w2_input_scale: torch.Tensor | None = None
    router_weight: torch.Tensor | None = None
    router_bias: torch.Tensor | None = None
    shared_gate_up: torch.Tensor | None = None
    shared_down: torch.Tensor | None = None

    def to(self, device) -> "MoEWeights":
        kw = {}
        for f in fields(self):
            v = getattr(self, f.name)
            kw[f.name] = v.to(device) if v is not None else None
        return MoEWeights(**kw)

    @property
    def num_experts(self) -> int:
        return self.w13.data.shape[0]

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
            want["gate.e_score_correction_bias"] = (self.router_bias, (e_all,), None)
        if cfg.n_shared_experts:
            is_ = (cfg.shared_intermediate_size or i) * cfg.n_shared_experts
            want["shared_experts.gate_up_proj.weight"] = (self.shared_gate_up, (2 * is_, h), None)
            want["shared_experts.down_proj.weight"] = (self.shared_down, (h, is_), None)
        for name, (t, shape, dtype) in want.items():
            if t is None:
                raise ValueError(f"{name}: missing")
            if tuple(t.shape) != shape:
                raise ValueError(f"{name}: shape {tuple(t.shape)}, expected {shape}")
            if dtype is not None and t.dtype != dtype:
                raise ValueError(f"{name}: dtype {t.dtype}, expected {dtype}")


class MoELayer:
    """An NVFP4 MoE layer bound to a backend.

    ``forward`` computes, per token, ``sum_j w_j * expert_{e_j}(x)`` (+ the shared expert),
    with the routed experts on the chosen backend and routing / shared expert identical
    for every backend.
    """

    def __init__(self, weights: MoEWeights, config: MoEConfig, backend: str | Backend = "auto",
                 device: str | torch.device | None = None) -> None:
        weights.validate(config)
        self.config = config
        self.backend = get_backend(backend, device=device)
        self.device = self.backend.device
        self.weights = weights.to(self.device)
        self._prepared = self.backend.prepare_weights(self.weights)

    # ------------------------------------------------------------------ builders
    @classmethod
    def from_preset(cls, preset: str, seed: int = 0, backend: str | Backend = "auto", device=None,
                    **config_overrides) -> "MoELayer":
        """A layer with synthetic weights (see :func:`megamoe.checkpoint.synthetic_weights`)."""
        from megamoe.checkpoint import synthetic_weights

        cfg = get_preset(preset).with_(**config_overrides) if config_overrides else get_preset(preset)
        be = get_backend(backend, device=device)
        weights = synthetic_weights(cfg, seed=seed, device=be.device)
        return cls(weights, cfg, backend=be)

    @classmethod
    def from_checkpoint(cls, path, backend: str | Backend = "auto", device=None, **load_kw) -> "MoELayer":
        """Load a ModelOpt NVFP4 checkpoint (see :func:`megamoe.checkpoint.load`)."""
        from megamoe.checkpoint import load

        loaded = load(path, **load_kw)
        layer = cls(loaded.weights, loaded.config, backend=backend, device=device)
        layer.load_report = loaded.report
        return layer

    # ------------------------------------------------------------------ routing
    def route(self, hidden_states=None, router_logits=None):
        """``(topk_weights f32 [T,k], topk_ids i32 [T,k])`` from logits, or from the layer's router."""
        cfg = self.config
        if router_logits is None:
            if self.weights.router_weight is None:
                raise ValueError("this layer has no router weight: pass topk_ids/topk_weights or router_logits")
            router_logits = hidden_states.float() @ self._float32("router_weight").T
        if router_logits.shape[-1] != cfg.num_experts or router_logits.dim() != 2:
            raise ValueError(f"router_logits must be [T, {cfg.num_experts}], got {tuple(router_logits.shape)}")
        return route(router_logits, cfg.top_k, cfg.scoring, self.weights.router_bias, cfg.n_group,
                     cfg.topk_group, cfg.renormalize, cfg.routed_scaling_factor)

    def _check_inputs(self, x, topk_ids, topk_weights, router_logits):
        cfg = self.config
        if not torch.is_tensor(x) or x.dim() != 2 or x.shape[1] != cfg.hidden_size:
            shape = tuple(x.shape) if torch.is_tensor(x) else type(x).__name__
            raise ValueError(f"hidden_states must be [T, {cfg.hidden_size}], got {shape}")
        if x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
            raise TypeError(f"hidden_states dtype {x.dtype}: expected bfloat16, float16 or float32")
        t = x.shape[0]
        if (topk_ids is None) != (topk_weights is None):
            raise ValueError("topk_ids and topk_weights must be given together")
        if topk_ids is not None:
            if topk_ids.shape != (t, cfg.top_k) or topk_weights.shape != (t, cfg.top_k):
                raise ValueError(f"topk_ids/topk_weights must be [{t}, {cfg.top_k}], got "
                                 f"{tuple(topk_ids.shape)} / {tuple(topk_weights.shape)}")
            if torch.is_floating_point(topk_ids):
                raise TypeError(f"topk_ids must be integers, got {topk_ids.dtype}")
            if t and (int(topk_ids.min()) < 0 or int(topk_ids.max()) >= cfg.num_experts):
                raise ValueError(f"topk_ids out of range [0, {cfg.num_experts}): "
                                 f"min {int(topk_ids.min())}, max {int(topk_ids.max())}")
        if router_logits is not None and tuple(router_logits.shape) != (t, cfg.num_experts):
            raise ValueError(f"router_logits must be [{t}, {cfg.num_experts}], got {tuple(router_logits.shape)}")

    # ------------------------------------------------------------------ forward
    def forward(self, hidden_states: torch.Tensor, topk_ids: torch.Tensor | None = None,
                topk_weights: torch.Tensor | None = None, router_logits: torch.Tensor | None = None,
                validate: bool = True) -> torch.Tensor:
        """MoE forward (SPEC §3).

        Args:
            hidden_states: ``[T, H]`` bfloat16 / float16 / float32.
            topk_ids: ``[T, k]`` int expert ids and topk_weights ``[T, k]`` float, or
            router_logits: ``[T, E]``; with neither, the layer's own router is used.
            validate: check shapes and id ranges (costs a device sync for ``topk_ids``;
                pass False inside CUDA-graph capture).

        Returns:
            ``[T, H]`` in the dtype of ``hidden_states``.
        """
        if validate:
            self._check_inputs(hidden_states, topk_ids, topk_weights, router_logits)
        x = hidden_states.to(self.device)
        if topk_ids is None:
            topk_weights, topk_ids = self.route(x, None if router_logits is None else router_logits.to(self.device))
        else:
            topk_ids = topk_ids.to(self.device, torch.int32)
            topk_weights = topk_weights.to(self.device, torch.float32)
        if x.shape[0] == 0:
            return torch.zeros_like(x)
        y = self.backend.moe_forward(self._prepared, self.config, x, topk_ids, topk_weights).float()
        if self.config.n_shared_experts:
            y = y + self._shared_expert(x)
        return y.to(hidden_states.dtype)

    __call__ = forward

    def _float32(self, name: str) -> torch.Tensor:
        """A float32 copy of a dense weight (router, shared expert), made once, not per forward.
        The weights are treated as immutable once the layer is built."""
        cache = self.__dict__.setdefault("_f32_cache", {})
        src = getattr(self.weights, name)
        hit = cache.get(name)
        if hit is None or hit[0] is not src:
            hit = cache[name] = (src, src.float())
        return hit[1]

    def _shared_expert(self, x: torch.Tensor) -> torch.Tensor:
        down = self._float32("shared_down")
        gu = x.float() @ self._float32("shared_gate_up").T
        return swiglu(gu, down.shape[1], self.config.swiglu_limit) @ down.T

    def reference_bf16(self, hidden_states: torch.Tensor, topk_ids=None, topk_weights=None,
                       router_logits=None) -> torch.Tensor:
        """The yardstick of SPEC §3: the same forward with dequantized weights and no
        activation quantization, computed in float32. Returns float32 ``[T, H]``."""
        self._check_inputs(hidden_states, topk_ids, topk_weights, router_logits)
        cfg, w = self.config, self.weights
        x = hidden_states.to(self.device).float()
        if topk_ids is None:
            topk_weights, topk_ids = self.route(x, None if router_logits is None else router_logits.to(self.device))
        ids = topk_ids.to(self.device).long()
        tw = topk_weights.to(self.device).float()
        out = torch.zeros_like(x)
        for e in torch.unique(ids).tolist():
            tok, slot = (ids == e).nonzero(as_tuple=True)
            gu = x[tok] @ nvfp4.dequantize(w.w13[e]).T
            he = swiglu(gu, cfg.intermediate_size, cfg.swiglu_limit)
            out.index_add_(0, tok, (he @ nvfp4.dequantize(w.w2[e]).T) * tw[tok, slot].unsqueeze(1))
        if cfg.n_shared_experts:
            out = out + self._shared_expert(x)
        return out

    def expert_weight_bytes(self, topk_ids: torch.Tensor) -> int:
        """NVFP4 bytes (data + scales) of the experts that ``topk_ids`` uses."""
        used = torch.unique(topk_ids).numel()
        per = (self.weights.w13.nbytes() + self.weights.w2.nbytes()) // self.config.num_experts
        return used * per

    def __repr__(self) -> str:
        c = self.config
        return (f"MoELayer(H={c.hidden_size}, I={c.intermediate_size}, E={c.num_experts}, k={c.top_k}, "
                f"{c.act_mode}, backend={self.backend.name})")


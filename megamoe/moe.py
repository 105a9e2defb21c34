"""The MoE layer of docs/SPEC.md §3: routing, routed NVFP4 experts (on a backend), shared expert.

The math of the reference forward is :mod:`megamoe.reference`; the weights are
:class:`megamoe.weights.MoEWeights` (re-exported here).
"""
from __future__ import annotations

import dataclasses

import torch

from megamoe import checkpoint, nvfp4, reference
from megamoe.backends import Backend, get_backend
from megamoe.presets import MoEConfig, get_preset
from megamoe.invariant import matmul
from megamoe.routing import hash_expert_ids, route
from megamoe.weights import MoEWeights

__all__ = ["MoEWeights", "MoELayer", "MoEConfig"]


class MoELayer:
    """An NVFP4 MoE layer bound to a backend.

    ``forward`` computes, per token, ``sum_j w_j * expert_{e_j}(x)`` (+ the shared expert),
    with the routed experts on the chosen backend and routing / shared expert identical
    for every backend.

    ``batch_invariant`` (default True): the router's and the shared expert's float32 GEMMs run
    in fixed 64-row blocks, so their results for a row do not depend on the rest of its batch
    (docs/SPEC.md §3.5). Set it False on a layer to run them as one GEMM each: faster for many
    rows on a GPU (bench/invariance_cost.py), but a row's bits may then depend on its batch.
    """

    batch_invariant: bool = True

    def __init__(self, weights: MoEWeights, config: MoEConfig, backend: str | Backend = "auto",
                 device: str | torch.device | None = None) -> None:
        if config.router_weight_on_input and type(self).forward is not MoELayer.forward:
            # the weight on the expert's input is applied by MoELayer.forward (_routed); a layer
            # with its own forward would weigh the outputs instead, computing another layer
            raise NotImplementedError(f"{type(self).__name__}: router_weight_on_input (Llama 4: the router weight "
                                      f"multiplies the expert's input) is computed by MoELayer.forward only")
        self._check_weights(weights, config)
        self.config = config
        self.backend = get_backend(backend, device=device)
        self._check_expert_math(weights, config)
        self.device = self.backend.device
        # A backend that re-lays out the routed experts makes its own device copy of them; the layer's
        # NVFP4 copy of those experts (read only by the reference paths) then stays in host memory, so
        # the device holds each weight once.
        host_routed = self.backend.copies_routed_weights and self.device.type != "cpu"
        self.weights = weights.to(self.device, routed_device="cpu" if host_routed else None)
        self._prepared = self.backend.prepare_weights(self._routed_weights())

    def _check_weights(self, weights: MoEWeights, config: MoEConfig) -> None:
        weights.validate(config)

    def _check_expert_math(self, weights: MoEWeights, config: MoEConfig) -> None:
        """The backend computes the layer's expert biases (``b13``, ``b2``) and activation variant
        (``swiglu_alpha``, ``swiglu_up_shift``; gpt-oss), or the layer is refused: a backend that
        does not declare ``expert_bias_and_activation`` would compute another layer."""
        needs = [n for n, on in (("b13", weights.b13 is not None), ("b2", weights.b2 is not None),
                                 (f"swiglu_alpha={config.swiglu_alpha}", config.swiglu_alpha != 1.0),
                                 (f"swiglu_up_shift={config.swiglu_up_shift}", config.swiglu_up_shift != 0.0)) if on]
        if needs and not getattr(self.backend, "expert_bias_and_activation", False):
            raise NotImplementedError(f"backend {self.backend.name!r} does not compute expert biases or the gpt-oss "
                                      f"activation ({', '.join(needs)}); use the torch or cuda-sm100 backend")

    def _routed_weights(self) -> MoEWeights:
        """What the backend prepares (the routed experts; the layer runs the rest itself)."""
        return self.weights

    # ------------------------------------------------------------------ builders
    @classmethod
    def from_preset(cls, preset: str, seed: int = 0, backend: str | Backend = "auto", device=None,
                    **config_overrides) -> "MoELayer":
        """A layer with synthetic weights (see :func:`megamoe.checkpoint.synthetic_weights`)."""
        cfg = get_preset(preset).with_(**config_overrides) if config_overrides else get_preset(preset)
        be = get_backend(backend, device=device)
        weights = checkpoint.synthetic_weights(cfg, seed=seed, device=be.device)
        return cls(weights, cfg, backend=be)

    @classmethod
    def from_checkpoint(cls, path, backend: str | Backend = "auto", device=None, **load_kw) -> "MoELayer":
        """Load a ModelOpt NVFP4 checkpoint (see :func:`megamoe.checkpoint.load`)."""
        loaded = checkpoint.load(path, **load_kw)
        layer = cls(loaded.weights, loaded.config, backend=backend, device=device)
        layer.load_report = loaded.report
        return layer

    @classmethod
    def from_prepared(cls, weights: MoEWeights, config: MoEConfig, prepared, backend: str | Backend = "auto",
                      device=None, float32: dict[str, torch.Tensor] | None = None) -> "MoELayer":
        """A layer over weights that ``backend`` has already prepared, nothing converted or copied again.

        ``prepared`` is what ``backend.prepare_weights`` returned for ``weights`` (in this process or in
        another one that shares its tensors, e.g. through torch.multiprocessing); ``weights`` are the
        layer's weights as a layer on ``backend`` keeps them: every tensor on the backend's device, except
        the routed experts (``w13``, ``w2``) of a backend that :attr:`~Backend.copies_routed_weights`,
        which may be anywhere (host memory, or the meta device when the layer keeps no copy of its own;
        only :meth:`reference_bf16` reads them). ``float32``: the float32 copies of the dense weights
        that the layer would otherwise make itself (:meth:`dense_float32` of a layer over the same
        weights). The layer only reads these tensors: they may be shared with other layers and processes."""
        if config.router_weight_on_input and cls.forward is not MoELayer.forward:
            raise NotImplementedError(f"{cls.__name__}: router_weight_on_input is computed by MoELayer.forward only")
        layer = cls.__new__(cls)
        layer._check_weights(weights, config)
        layer.config = config
        layer.backend = get_backend(backend, device=device)
        layer._check_expert_math(weights, config)
        layer.device = layer.backend.device
        for f in dataclasses.fields(weights):
            value = getattr(weights, f.name)
            if value is None or (f.name in ("w13", "w2") and layer.backend.copies_routed_weights):
                continue
            where = value.device
            if where.type != layer.device.type or (where.index or 0) != (layer.device.index or 0):
                raise ValueError(f"from_prepared: weights.{f.name} is on {where}, the backend "
                                 f"{layer.backend.name} runs on {layer.device}")
        layer.weights = weights
        layer._prepared = prepared
        for name, copy in (float32 or {}).items():
            src = getattr(weights, name)
            if src is None or tuple(copy.shape) != tuple(src.shape) or copy.dtype != torch.float32:
                raise ValueError(f"from_prepared: float32[{name!r}] is not a float32 copy of weights.{name}")
            layer.__dict__.setdefault("_f32_cache", {})[name] = (src, copy)
        return layer

    def dense_float32(self) -> dict[str, torch.Tensor]:
        """The float32 copies of the dense weights (router, shared expert, its gate) that the forward
        uses, by field name, made now where not yet (what :meth:`from_prepared` takes to share them)."""
        names = ("router_weight", "shared_gate_up", "shared_down", "shared_expert_gate")
        return {name: self._float32(name) for name in names if getattr(self.weights, name, None) is not None}

    # ------------------------------------------------------------------ routing
    @property
    def needs_input_ids(self) -> bool:
        """True when the layer routes by token id (hash routing): its own router then needs the
        rows' ``input_ids``."""
        return bool(self.config.hash_routing)

    def route(self, hidden_states=None, router_logits=None, input_ids=None):
        """``(topk_weights f32 [T,k], topk_ids i32 [T,k])`` from logits, or from the layer's router.

        Logits computed here include the weights' ``router_logit_bias`` (gpt-oss); given
        ``router_logits`` are used as they are.

        A hash-routed layer takes its experts from ``tid2eid[input_ids]`` (``input_ids`` int
        ``[T]`` required, else :class:`megamoe.routing.InputIdsRequired`) and their weights
        from the scores. The router GEMM is float32 and batch-invariant
        (:func:`megamoe.invariant.matmul_rows`, unless :attr:`batch_invariant` is off); ties go to
        the lowest expert id.
        """
        cfg = self.config
        expert_ids = hash_expert_ids(self.weights.tid2eid, input_ids) if cfg.hash_routing else None
        if router_logits is None:
            if self.weights.router_weight is None:
                raise ValueError("this layer has no router weight: pass topk_ids/topk_weights or router_logits")
            router_logits = matmul(hidden_states.float(), self._float32("router_weight"), self.batch_invariant)
            if self.weights.router_logit_bias is not None:  # gpt-oss: the router's own bias
                router_logits = router_logits + self.weights.router_logit_bias.float()
        if router_logits.shape[-1] != cfg.num_experts or router_logits.dim() != 2:
            raise ValueError(f"router_logits must be [T, {cfg.num_experts}], got {tuple(router_logits.shape)}")
        return route(router_logits, cfg.top_k, cfg.scoring, self.weights.router_bias, cfg.n_group,
                     cfg.topk_group, cfg.renormalize, cfg.routed_scaling_factor, expert_ids=expert_ids)

    def _routing(self, x, topk_ids, topk_weights, router_logits, input_ids=None):
        """``(topk_ids int32, topk_weights float32)`` on the layer's device: the given ones, or routed."""
        if topk_ids is None:
            topk_weights, topk_ids = self.route(x, None if router_logits is None else router_logits.to(self.device),
                                                input_ids)
            return topk_ids, topk_weights
        return topk_ids.to(self.device, torch.int32), topk_weights.to(self.device, torch.float32)

    def _check_inputs(self, x, topk_ids, topk_weights, router_logits, input_ids=None):
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
        if input_ids is not None and (not torch.is_tensor(input_ids) or tuple(input_ids.shape) != (t,)):
            shape = tuple(input_ids.shape) if torch.is_tensor(input_ids) else type(input_ids).__name__
            raise ValueError(f"input_ids must be [{t}] (one token id per row), got {shape}")

    # ------------------------------------------------------------------ forward
    def forward(self, hidden_states: torch.Tensor, topk_ids: torch.Tensor | None = None,
                topk_weights: torch.Tensor | None = None, router_logits: torch.Tensor | None = None,
                validate: bool = True, input_ids: torch.Tensor | None = None) -> torch.Tensor:
        """MoE forward (docs/SPEC.md §3).

        Args:
            hidden_states: ``[T, H]`` bfloat16 / float16 / float32.
            topk_ids: ``[T, k]`` int expert ids and topk_weights ``[T, k]`` float, or
            router_logits: ``[T, E]``; with neither, the layer's own router is used.
            validate: check shapes, dtypes and that ``topk_ids`` are in ``[0, E)`` (the range
                check costs a device sync; pass False inside CUDA-graph capture). Unvalidated,
                a top-k id outside ``[0, E)`` (the mask value -1) is a masked slot: it
                contributes nothing (docs/SPEC.md §3.1).
            input_ids: int ``[T]`` token ids of the rows; required when the layer routes by
                token id (:attr:`needs_input_ids`) and routes itself, ignored otherwise.

        Returns:
            ``[T, H]`` in the dtype of ``hidden_states``.

        Raises:
            megamoe.routing.InputIdsRequired: a hash-routed layer without ``input_ids``.
        """
        if validate:
            self._check_inputs(hidden_states, topk_ids, topk_weights, router_logits, input_ids)
        x = hidden_states.to(self.device)
        topk_ids, topk_weights = self._routing(x, topk_ids, topk_weights, router_logits, input_ids)
        if x.shape[0] == 0:
            return torch.zeros_like(x)
        y = self._routed(x, topk_ids, topk_weights,
                         lambda cfg, rows, ids, w: self.backend.moe_forward(self._prepared, cfg, rows, ids, w,
                                                                           self.batch_invariant))
        if self.config.n_shared_experts:
            y = y + self._shared_expert(x)
        return y.to(hidden_states.dtype)

    __call__ = forward

    def _routed(self, x, topk_ids, topk_weights, run) -> torch.Tensor:
        """The routed experts' sum, float32 ``[T, H]``: ``run(cfg, rows, ids, weights)`` computes
        ``sum_j w_j * expert_{e_j}(row)``. With ``router_weight_on_input`` (Llama 4) each slot's
        row is first multiplied by its weight in the rows' dtype (transformers: ``routed_in =
        hidden_states * router_scores``) and the experts' outputs are added with weight 1: the
        ``T * k`` scaled rows go through the experts as one-slot rows, summed over the slots."""
        cfg = self.config
        if not cfg.router_weight_on_input:
            return run(cfg, x, topk_ids, topk_weights).float()
        t, k = topk_ids.shape
        rows = (x.unsqueeze(1) * topk_weights.to(x.dtype).unsqueeze(-1)).reshape(t * k, x.shape[1])
        ones = torch.ones((t * k, 1), dtype=torch.float32, device=x.device)
        one = cfg if k == 1 else cfg.with_(top_k=1)
        return run(one, rows, topk_ids.reshape(t * k, 1), ones).float().view(t, k, -1).sum(1)

    def _float32(self, name: str) -> torch.Tensor:
        """A float32 copy of a dense weight (router, shared expert), made once, not per forward.
        The weights are treated as immutable once the layer is built."""
        cache = self.__dict__.setdefault("_f32_cache", {})
        src = getattr(self.weights, name)
        hit = cache.get(name)
        if hit is None or hit[0] is not src:
            hit = cache[name] = (src, nvfp4.dequantize(src) if isinstance(src, nvfp4.NVFP4Tensor) else src.float())
        return hit[1]

    def _shared_expert(self, x: torch.Tensor, quantize_activations: bool = True) -> torch.Tensor:
        w = self.weights
        if quantize_activations and isinstance(w.shared_gate_up, nvfp4.NVFP4Tensor):
            # a shared expert stored in NVFP4 runs like a routed one (docs/SPEC.md §3.4)
            out = reference.expert_mlp(x.float(), self._float32("shared_gate_up"), self._float32("shared_down"),
                                       self.config, w.shared_gate_up_input_scale, w.shared_down_input_scale,
                                       invariant=self.batch_invariant)
        else:
            out = reference.dense_mlp(x, self._float32("shared_gate_up"), self._float32("shared_down"),
                                      self.config.swiglu_limit, invariant=self.batch_invariant,
                                      alpha=self.config.swiglu_alpha, up_shift=self.config.swiglu_up_shift)
        if self.config.shared_expert_gate:
            # Qwen2-MoE: scaled per token by sigmoid(x · g), the [1, H] gate in float32
            out = out * torch.sigmoid(matmul(x.float(), self._float32("shared_expert_gate"), self.batch_invariant))
        return out

    def reference_bf16(self, hidden_states: torch.Tensor, topk_ids=None, topk_weights=None,
                       router_logits=None, validate: bool = True, input_ids=None) -> torch.Tensor:
        """The yardstick of docs/SPEC.md §3: the same forward (:mod:`megamoe.reference`) with
        dequantized weights and no activation quantization, computed in float32. Returns
        float32 ``[T, H]``. Arguments as for :meth:`forward`."""
        if validate:
            self._check_inputs(hidden_states, topk_ids, topk_weights, router_logits, input_ids)
        cfg, w = self.config, self.weights
        x = hidden_states.to(self.device).float()
        topk_ids, topk_weights = self._routing(x, topk_ids, topk_weights, router_logits, input_ids)

        def expert(e: int, rows: torch.Tensor) -> torch.Tensor:  # (the experts may sit in host memory)
            return reference.expert_mlp(rows, nvfp4.dequantize(w.w13[e].to(self.device)),
                                        nvfp4.dequantize(w.w2[e].to(self.device)), cfg, quantize_activations=False,
                                        b13=None if w.b13 is None else w.b13[e], b2=None if w.b2 is None else w.b2[e])

        out = self._routed(x, topk_ids, topk_weights,
                           lambda c, rows, ids, wt: reference.routed_experts(rows, ids, wt, c.num_experts, expert))
        if cfg.n_shared_experts:
            out = out + self._shared_expert(x, quantize_activations=False)
        return out

    def expert_weight_bytes(self, topk_ids: torch.Tensor) -> int:
        """NVFP4 bytes (data + scales) of the experts that ``topk_ids`` uses (masked ids use none)."""
        ids = torch.unique(topk_ids)
        used = int(reference.valid_slots(ids, self.config.num_experts).sum())
        per = (self.weights.w13.nbytes() + self.weights.w2.nbytes()) // self.config.num_experts
        return used * per

    def __repr__(self) -> str:
        c = self.config
        return (f"MoELayer(H={c.hidden_size}, I={c.intermediate_size}, E={c.num_experts}, k={c.top_k}, "
                f"{c.act_mode}, backend={self.backend.name})")


"""The routing of each supported architecture (Hugging Face ``model_type``), from its config.json.

One rule per architecture in :data:`ARCHITECTURES`: a function ``(config.json dict, layer
number or None) -> ArchitectureRouting`` that reads the architecture's keys, records where each
value came from, and refuses what megamoe cannot compute (:class:`UnknownArchitecture`, naming
the key). The rules say *what* to compute; :func:`megamoe.routing.route` computes it.

Adding an architecture: write its rule with :class:`_Rule` (``take`` a config.json key or the
architecture's default, ``fix`` what its code fixes, ``silu_only``, ``one_key``; ``done`` with
the gate/up order of its fused tensors, notes and the router tensors it needs), following the
architecture's transformers router and MoE block, and add it to :data:`ARCHITECTURES`. The
loader (:mod:`megamoe.checkpoint`) finds its tensors' names in
:data:`megamoe.checkpoint.ROUTER_NAMES` / :data:`megamoe.checkpoint.SHARED_NAMINGS`; each rule
is checked against transformers' own router on recorded inputs (``tests/test_routing.py``).
A known MoE family whose expert math megamoe does not compute goes in :data:`UNSUPPORTED`,
with the reason.
"""
from __future__ import annotations

from dataclasses import dataclass

from megamoe.routing import SCORINGS

__all__ = ["architecture_routing", "ArchitectureRouting", "UnknownArchitecture", "ARCHITECTURES", "UNSUPPORTED"]


class UnknownArchitecture(ValueError):
    """config.json names a ``model_type`` whose routing megamoe does not know (never guessed)."""


@dataclass(frozen=True)
class ArchitectureRouting:
    """What one ``model_type`` means for one MoE layer.

    ``fields`` are :class:`megamoe.presets.MoEConfig` fields (routing, shapes, shared expert);
    ``choices`` says, for each field, where its value came from (a config.json key, or the
    architecture's default when config.json omits the key); ``stated`` maps each field whose
    value config.json states to that key (``num_experts`` -> ``"num_local_experts"``), so that a
    disagreement with the tensors can be told truthfully; ``w13_layout`` is the order of a fused
    gate/up tensor in this architecture's own (Hugging Face) layout; ``requires`` names the
    router tensors the layer cannot be computed without (``"correction_bias"``, ``"tid2eid"``);
    ``notes`` are differences from the architecture's reference code that the caller should know.
    ``requires`` may also name ``"router_logit_bias"`` (the router's own bias, added to the
    logits) and ``"expert_biases"`` (both expert GEMMs' biases), gpt-oss's.
    """

    model_type: str
    fields: dict
    choices: list[str]
    w13_layout: str
    notes: list[str]
    stated: dict
    requires: tuple


class _Rule:
    """Reads one architecture's keys from config.json, recording where each value came from."""

    def __init__(self, hf: dict, model_type: str, where: str = ""):
        # ``where``: the part of config.json the keys are read from ("text_config." for a
        # text model inside a multimodal wrapper), named in every choice and ``stated`` key
        self.hf, self.model_type, self.where = hf, model_type, where
        self.fields: dict = {}
        self.choices: list[str] = []
        self.stated: dict = {}

    def take(self, field_name: str, keys, default):
        """``fields[field_name]`` from the first of ``keys`` config.json states, else ``default``."""
        keys = (keys,) if isinstance(keys, str) else tuple(keys)
        for key in keys:
            if self.hf.get(key) is not None:
                self.choices.append(f"{field_name}={self.hf[key]!r} (config.json {self.where}{key})")
                self.stated[field_name] = self.where + key
                self.fields[field_name] = self.hf[key]
                return self.hf[key]
        self.choices.append(f"{field_name}={default!r} (architecture default; config.json has no "
                            f"{' or '.join(self.where + k for k in keys)})")
        self.fields[field_name] = default
        return default

    def fix(self, field_name: str, value, why: str):
        """A value the architecture's code fixes, whatever config.json says."""
        self.choices.append(f"{field_name}={value!r} ({why})")
        self.fields[field_name] = value
        return value

    def silu_only(self) -> None:
        act = self.hf.get("hidden_act", "silu")
        if act != "silu":
            raise UnknownArchitecture(f"config.json {self.where}hidden_act={act!r}: megamoe's experts are SwiGLU (silu); "
                                      f"{self.model_type} with {act!r} is not supported")

    def one_key(self, field_name: str, keys) -> None:
        """config.json stating one value under two names that disagree is refused."""
        vals = {k: self.hf[k] for k in keys if self.hf.get(k) is not None}
        if len(set(map(repr, vals.values()))) > 1:
            said = ", ".join(f"{self.where}{k}={v!r}" for k, v in vals.items())
            raise UnknownArchitecture(f"config.json: {said} disagree (both give {field_name})")

    def take_one(self, field_name: str, keys, default):
        """:meth:`take` from config.json keys that name one value (refused where two of them disagree: :meth:`one_key`)."""
        self.one_key(field_name, keys)
        return self.take(field_name, keys, default)

    def done(self, w13_layout: str = "gate-up", notes=(), requires=()) -> ArchitectureRouting:
        return ArchitectureRouting(self.model_type, dict(self.fields), list(self.choices), w13_layout,
                                   list(notes), dict(self.stated), tuple(requires))


def _v3_like(hf: dict, model_type: str, defaults: dict, where: str = "") -> ArchitectureRouting:
    # transformers' DeepseekV3TopkRouter and Glm4MoeTopkRouter: logits in float32, sigmoid
    # scores, e_score_correction_bias added for selection only, group-limited top-k (a group
    # scores the sum of its two best biased scores), chosen weights = unbiased scores,
    # renormalised if norm_topk_prob, times routed_scaling_factor; a shared expert of
    # moe_intermediate_size * n_shared_experts. transformers 5 writes no scoring_func /
    # topk_method; DeepSeek's own config.json writes scoring_func="sigmoid", topk_method="noaux_tc".
    r = _Rule(hf, model_type, where)
    r.silu_only()
    scoring = hf.get("scoring_func")
    if scoring not in (None, "sigmoid"):
        raise UnknownArchitecture(f"config.json {where}scoring_func={scoring!r}: {model_type} routes with sigmoid "
                                  f"scores")
    method = hf.get("topk_method")
    if method not in (None, "noaux_tc"):
        raise UnknownArchitecture(f"config.json {where}topk_method={method!r}: {model_type} routing is 'noaux_tc' "
                                  f"(sigmoid, correction bias, group-limited top-k)")
    r.fix("scoring", "sigmoid", model_type + (f", config.json {where}scoring_func" if scoring else
                                              f"; config.json has no {where}scoring_func"))
    r.take_one("num_experts", ("n_routed_experts", "num_local_experts"), defaults["num_experts"])
    r.take("top_k", "num_experts_per_tok", defaults["top_k"])
    r.take("n_group", "n_group", defaults["n_group"])
    r.take("topk_group", "topk_group", defaults["topk_group"])
    r.fields["renormalize"] = bool(r.take("renormalize", "norm_topk_prob", True))
    r.fields["routed_scaling_factor"] = float(r.take("routed_scaling_factor", "routed_scaling_factor",
                                                     defaults["routed_scaling_factor"]))
    i = r.take("intermediate_size", "moe_intermediate_size", defaults["intermediate_size"])
    n = r.take("n_shared_experts", "n_shared_experts", 1) or 0
    r.fields["n_shared_experts"] = n
    if n:
        r.fields["shared_intermediate_size"] = i
        r.choices.append(f"shared expert: {n} x moe_intermediate_size ({model_type})")
    return r.done("gate-up", ["the e_score_correction_bias tensor is required (noaux_tc selection)"],
                  ("correction_bias",))


def _deepseek_v3(hf: dict, layer: int | None = None) -> ArchitectureRouting:
    return _v3_like(hf, "deepseek_v3", dict(num_experts=256, top_k=8, n_group=8, topk_group=4,
                                            routed_scaling_factor=2.5, intermediate_size=2048))


def _glm4_moe(hf: dict, layer: int | None = None) -> ArchitectureRouting:
    # GLM-4.5 / 4.6 MoE: DeepSeek-V3's router (transformers' Glm4MoeTopkRouter) with GLM's defaults.
    return _v3_like(hf, "glm4_moe", dict(num_experts=128, top_k=8, n_group=1, topk_group=1,
                                         routed_scaling_factor=1.0, intermediate_size=1408))


def _text_config(hf: dict, model_type: str, text_types: tuple[str, ...]) -> dict:
    """The ``text_config`` of a multimodal wrapper's config.json, checked to be one of ``text_types``."""
    tc = hf.get("text_config")
    if not isinstance(tc, dict):
        raise UnknownArchitecture(f"config.json model_type={model_type!r} without a text_config: the routing of its "
                                  f"text model is in text_config")
    mt = tc.get("model_type")
    if mt is not None and mt not in text_types:
        raise UnknownArchitecture(f"config.json text_config.model_type={mt!r}: a {model_type} text model is "
                                  f"{' or '.join(repr(t) for t in text_types)}")
    return tc


def _kimi_k25(hf: dict, layer: int | None = None) -> ArchitectureRouting:
    # Kimi-K2.5 (transformers Kimi_K25ForConditionalGeneration): a DeepSeek-V3 text model
    # (Kimi-K2's, model_type deepseek_v3 or kimi_k2) inside a multimodal wrapper; the routing is
    # the text model's, read from text_config (DeepseekV3TopkRouter, DeepSeek-V3's defaults).
    tc = _text_config(hf, "kimi_k25", ("deepseek_v3", "kimi_k2"))
    return _v3_like(tc, "kimi_k25", dict(num_experts=256, top_k=8, n_group=8, topk_group=4,
                                         routed_scaling_factor=2.5, intermediate_size=2048), "text_config.")


def _minimax_m2(hf: dict, layer: int | None = None) -> ArchitectureRouting:
    # transformers' MiniMaxM2TopKRouter, called with the block's e_score_correction_bias (a
    # buffer of the sparse-MoE block, not of the router: block_sparse_moe.e_score_correction_bias
    # in MiniMax's names, mlp.e_score_correction_bias in transformers'): logits, sigmoid scores
    # in float32, the top-k of scores + bias, the chosen unbiased scores divided by their sum
    # (always), no scaling, no groups, no shared expert. MiniMax's own config.json states
    # scoring_func="sigmoid" and use_routing_bias=true; transformers 5 writes neither.
    r = _Rule(hf, "minimax_m2")
    r.silu_only()
    scoring = hf.get("scoring_func")
    if scoring not in (None, "sigmoid"):
        raise UnknownArchitecture(f"config.json scoring_func={scoring!r}: minimax_m2 routes with sigmoid scores")
    if hf.get("use_routing_bias") is False:
        raise UnknownArchitecture("config.json use_routing_bias=false: transformers' minimax_m2 always adds the "
                                  "block's e_score_correction_bias for selection")
    r.fix("scoring", "sigmoid", "minimax_m2" + (", config.json scoring_func" if scoring else
                                                "; config.json has no scoring_func"))
    r.fix("n_group", None, "minimax_m2 has no expert groups")
    r.fix("topk_group", None, "minimax_m2 has no expert groups")
    r.fix("renormalize", True, "minimax_m2 always normalises the chosen weights")
    r.fields.update(routed_scaling_factor=1.0, n_shared_experts=0)
    r.take_one("num_experts", ("num_local_experts", "num_experts"), 256)
    r.take("top_k", "num_experts_per_tok", 8)
    r.take("intermediate_size", "intermediate_size", 1536)
    return r.done("gate-up", ["the e_score_correction_bias tensor is required (top-k of sigmoid scores + bias)",
                              "router logits: transformers computes them in the model dtype, megamoe in float32 "
                              "(a near-tie may pick a different expert)"], ("correction_bias",))


def _qwen2_moe(hf: dict, layer: int | None = None) -> ArchitectureRouting:
    # transformers' Qwen2MoeTopKRouter: softmax (float32), top-k, renormalised only if
    # norm_topk_prob (default False), no scaling; Qwen2MoeSparseMoeBlock adds one shared expert
    # (shared_expert, of shared_expert_intermediate_size) scaled per token by
    # sigmoid(shared_expert_gate(x)), a [1, H] linear layer kept unquantized.
    r = _Rule(hf, "qwen2_moe")
    r.silu_only()
    r.fix("scoring", "softmax", "qwen2_moe")
    r.fields.update(routed_scaling_factor=1.0)
    r.take_one("num_experts", ("num_local_experts", "num_experts"), 60)
    r.take("top_k", "num_experts_per_tok", 4)
    r.fields["renormalize"] = bool(r.take("renormalize", "norm_topk_prob", False))
    r.take("intermediate_size", "moe_intermediate_size", 1408)
    r.fix("n_shared_experts", 1, "qwen2_moe builds one shared expert")
    r.take("shared_intermediate_size", "shared_expert_intermediate_size", 5632)
    r.fix("shared_expert_gate", True, "qwen2_moe scales the shared expert by sigmoid(shared_expert_gate(x))")
    return r.done("gate-up", ["router logits and weights: transformers computes logits and returns weights in the "
                              "model dtype, megamoe keeps float32 (a near-tie may pick a different expert)"])


def _llama4_text(hf: dict, layer: int | None = None, where: str = "", model_type: str = "llama4_text"
                 ) -> ArchitectureRouting:
    # transformers' Llama4Router and Llama4TextMoe: logits, the top-k of the logits (top-1 in
    # the released models), weights sigmoid(logit) of the chosen experts (not normalised, not
    # scaled); the weight multiplies the expert's INPUT (routed_in = x * weight, in the model's
    # dtype), the expert's output is added with weight 1; one shared expert (shared_expert,
    # of intermediate_size) added to every token. The experts are fused and transposed
    # (gate_up_proj [E, H, 2I]: gate columns, then up).
    r = _Rule(hf, model_type, where)
    r.silu_only()
    r.fix("scoring", "sigmoid", f"{model_type}: sigmoid of the chosen logits")
    r.fix("renormalize", False, f"{model_type} does not normalise the weights")
    r.fix("router_weight_on_input", True, f"{model_type} multiplies the expert's input by the router weight")
    r.fields.update(routed_scaling_factor=1.0, n_group=None, topk_group=None)
    r.take_one("num_experts", ("num_local_experts", "num_experts"), 16)
    r.take("top_k", "num_experts_per_tok", 1)
    i = r.take("intermediate_size", "intermediate_size", 8192)
    r.fix("n_shared_experts", 1, f"{model_type} builds one shared expert")
    r.fields["shared_intermediate_size"] = i
    return r.done("gate-up", ["selection: transformers takes the top-k of the logits, megamoe of their sigmoid "
                              "(the same order, unless float32 sigmoid saturates two logits above ~17 to 1.0)"])


def _llama4(hf: dict, layer: int | None = None) -> ArchitectureRouting:
    # Llama 4 (Llama4ForConditionalGeneration): the llama4_text model inside a multimodal wrapper
    tc = _text_config(hf, "llama4", ("llama4_text",))
    return _llama4_text(tc, layer, "text_config.", "llama4")


def _gpt_oss(hf: dict, layer: int | None = None) -> ArchitectureRouting:
    # transformers' GptOssTopKRouter and GptOssExperts: logits = x W^T + b (the router's bias),
    # the top-k of the logits, weights softmax over the k chosen logits (no scaling, no groups,
    # no shared expert). Experts fused and transposed (gate_up_proj [E, H, 2I], gate and up
    # columns INTERLEAVED), with biases on both GEMMs: gate_up = x W13 + b13, gate clamped at
    # 7, up to [-7, 7], h = (up + 1) * gate * sigmoid(1.702 * gate), y = h W2 + b2. The limit
    # and alpha are fixed in GptOssExperts (hidden_act is not read); OpenAI's own config.json
    # states swiglu_limit=7.0.
    r = _Rule(hf, "gpt_oss")
    lim = hf.get("swiglu_limit")
    if lim is not None and float(lim) != 7.0:
        raise UnknownArchitecture(f"config.json swiglu_limit={lim!r}: transformers' gpt_oss experts clamp at 7.0 "
                                  f"whatever config.json says; a checkpoint stating another limit is ambiguous")
    r.fix("scoring", "softmax_topk", "gpt_oss: softmax over the top-k logits (the router's bias added to the logits)")
    r.fix("renormalize", True, "gpt_oss: the softmax over the chosen logits sums to 1")
    r.fields.update(routed_scaling_factor=1.0, n_group=None, topk_group=None, n_shared_experts=0)
    r.take_one("num_experts", ("num_local_experts", "num_experts"), 128)
    r.take("top_k", "num_experts_per_tok", 4)
    r.take("intermediate_size", "intermediate_size", 2880)
    r.fix("swiglu_limit", 7.0, "gpt_oss experts clamp gate at 7 and up to [-7, 7]"
          + (" (config.json swiglu_limit)" if lim is not None else ""))
    r.fix("swiglu_alpha", 1.702, "gpt_oss experts: gate * sigmoid(1.702 * gate)")
    r.fix("swiglu_up_shift", 1.0, "gpt_oss experts: (up + 1) * ...")
    return r.done("interleaved", ["the router bias (router.bias) and both expert biases are required",
                                  "router logits: transformers computes them in the model dtype, megamoe in float32 "
                                  "(a near-tie may pick a different expert)"],
                  ("router_logit_bias", "expert_biases"))


#: model_type -> why megamoe refuses it (every other unknown model_type is refused too, but
#: these are known MoE families whose expert math megamoe does not compute yet). Empty: every
#: family of docs/SPEC.md §3.4.1 is computed.
UNSUPPORTED: dict[str, str] = {}


def _deepseek_v4_kind(hf: dict, layer: int | None) -> tuple[str, str]:
    """``("hash_moe" | "moe", where that came from)`` for MoE layer ``layer`` of a deepseek_v4 config."""
    types = hf.get("mlp_layer_types")
    if types is not None:
        if layer is None:
            raise UnknownArchitecture("deepseek_v4: config.json mlp_layer_types gives each layer hash or top-k "
                                      "routing; the layer number is needed to know which")
        if not 0 <= layer < len(types):
            raise UnknownArchitecture(f"deepseek_v4: layer {layer} is outside config.json mlp_layer_types "
                                      f"({len(types)} entries)")
        kind = types[layer]
        if kind not in ("hash_moe", "moe"):
            raise UnknownArchitecture(f"config.json mlp_layer_types[{layer}]={kind!r}: deepseek_v4 MoE layers "
                                      f"are 'hash_moe' or 'moe'")
        return kind, f"config.json mlp_layer_types[{layer}]"
    n_hash, src = hf.get("num_hash_layers"), "config.json num_hash_layers"
    if n_hash is None:
        n_hash, src = 3, "architecture default: the first 3 layers; config.json has neither mlp_layer_types nor num_hash_layers"
    if layer is None:
        raise UnknownArchitecture(f"deepseek_v4: the first {n_hash} layers route by token id (hash), the others "
                                  f"by top-k; the layer number is needed to know which")
    return ("hash_moe" if layer < n_hash else "moe"), f"{src}={n_hash}" if src.startswith("config") else src


def _deepseek_v4(hf: dict, layer: int | None = None) -> ArchitectureRouting:
    # transformers' DeepseekV4TopKRouter / DeepseekV4HashRouter: logits = x W^T, scores =
    # sqrt(softplus(logits)) (config scoring_func); "moe" layers pick the top-k of scores +
    # e_score_correction_bias (no groups), "hash_moe" layers take tid2eid[input_ids]; both weigh
    # the chosen experts by their scores / (sum + 1e-20) * routed_scaling_factor, always
    # normalised (norm_topk_prob is not read). Experts and the one shared expert (of
    # moe_intermediate_size) compute SiLU(min(gate, L)) * clamp(up, -L, L), L = swiglu_limit.
    r = _Rule(hf, "deepseek_v4")
    r.silu_only()
    scoring = r.take("scoring", "scoring_func", "sqrtsoftplus")
    if scoring not in SCORINGS:
        raise UnknownArchitecture(f"config.json scoring_func={scoring!r}: not a router score function megamoe "
                                  f"computes ({', '.join(SCORINGS)})")
    kind, src = _deepseek_v4_kind(hf, layer)
    r.fix("hash_routing", kind == "hash_moe", f"{kind}, {src}")
    r.take_one("num_experts", ("n_routed_experts", "num_local_experts"), 256)
    r.take("top_k", "num_experts_per_tok", 6)
    r.fix("n_group", None, "deepseek_v4 has no expert groups")
    r.fix("topk_group", None, "deepseek_v4 has no expert groups")
    r.fix("renormalize", True, "deepseek_v4 always normalises the chosen weights")
    r.fields["routed_scaling_factor"] = float(r.take("routed_scaling_factor", "routed_scaling_factor", 1.5))
    i = r.take("intermediate_size", "moe_intermediate_size", 2048)
    lim = r.take("swiglu_limit", "swiglu_limit", 10.0)
    r.fields["swiglu_limit"] = None if lim is None else float(lim)
    r.fix("n_shared_experts", 1, "deepseek_v4 builds one shared expert")
    r.fields["shared_intermediate_size"] = i
    r.choices.append("shared expert: one of moe_intermediate_size, clamped like the routed experts (deepseek_v4)")
    notes = ["router logits: transformers computes them in the model dtype, megamoe in float32 "
             "(a near-tie may pick a different expert)"]
    if kind == "hash_moe":
        notes.append("the tid2eid tensor is required (hash routing: experts = tid2eid[input_ids]); "
                     "forward needs input_ids")
        return r.done("gate-up", notes, ("tid2eid",))
    notes.append("the e_score_correction_bias tensor is required (top-k of scores + bias)")
    return r.done("gate-up", notes, ("correction_bias",))


def _mixtral(hf: dict, layer: int | None = None) -> ArchitectureRouting:
    # transformers' MixtralTopKRouter: softmax over all experts (float32), top-k, always
    # renormalised, no scaling, no shared expert.
    r = _Rule(hf, "mixtral")
    r.silu_only()
    r.fix("scoring", "softmax", "mixtral")
    r.fix("renormalize", True, "mixtral always normalises the chosen weights")
    r.fields.update(routed_scaling_factor=1.0, n_shared_experts=0)
    r.take_one("num_experts", ("num_local_experts", "num_experts"), 8)
    r.take("top_k", "num_experts_per_tok", 2)
    r.take("intermediate_size", "intermediate_size", 14336)
    return r.done("gate-up", ["router logits: transformers computes them in the model dtype, megamoe in float32 "
                              "(a near-tie may pick a different expert)"])


def _qwen3_moe(hf: dict, layer: int | None = None) -> ArchitectureRouting:
    # transformers' Qwen3MoeTopKRouter: softmax (float32), top-k, renormalised only if
    # norm_topk_prob (default False), no scaling, no shared expert. transformers 5 writes
    # num_local_experts (num_experts is its alias; transformers 4 wrote num_experts).
    r = _Rule(hf, "qwen3_moe")
    r.silu_only()
    r.fix("scoring", "softmax", "qwen3_moe")
    r.fields.update(routed_scaling_factor=1.0, n_shared_experts=0)
    r.take_one("num_experts", ("num_local_experts", "num_experts"), 128)
    r.take("top_k", "num_experts_per_tok", 8)
    r.fields["renormalize"] = bool(r.take("renormalize", "norm_topk_prob", False))
    r.take("intermediate_size", "moe_intermediate_size", 768)
    return r.done("gate-up", ["router logits and weights: transformers computes logits and returns weights in the "
                              "model dtype, megamoe keeps float32 (a near-tie may pick a different expert)"])


#: model_type -> rule(config.json dict, layer number or None) -> ArchitectureRouting. A
#: newcomer adds an architecture here. Each rule is checked against the transformers router
#: of that architecture on recorded inputs (tests/fixtures/real/routing_*.safetensors).
ARCHITECTURES = {"deepseek_v3": _deepseek_v3, "deepseek_v4": _deepseek_v4, "glm4_moe": _glm4_moe,
                 "gpt_oss": _gpt_oss, "kimi_k25": _kimi_k25, "llama4": _llama4, "llama4_text": _llama4_text, "minimax_m2": _minimax_m2,
                 "mixtral": _mixtral, "qwen2_moe": _qwen2_moe, "qwen3_moe": _qwen3_moe}


def architecture_routing(hf_config: dict, layer: int | None = None) -> ArchitectureRouting:
    """The MoE routing (and expert shapes) that ``hf_config`` (a parsed config.json) implies for
    MoE layer number ``layer`` (needed where the architecture routes layers differently:
    deepseek_v4's hash and top-k layers).

    Raises:
        UnknownArchitecture: no ``model_type``, a ``model_type`` megamoe has no rule for,
            or a key whose value the rule does not support (named in the message).
    """
    mt = hf_config.get("model_type")
    if mt is None:
        raise UnknownArchitecture("config.json has no model_type: the routing cannot be known "
                                  f"(supported: {', '.join(sorted(ARCHITECTURES))}; or pass the config)")
    rule = ARCHITECTURES.get(mt)
    if mt in UNSUPPORTED:
        raise UnknownArchitecture(f"config.json model_type={mt!r}: not supported: {UNSUPPORTED[mt]}")
    if rule is None:
        raise UnknownArchitecture(f"config.json model_type={mt!r}: megamoe does not know this architecture's "
                                  f"routing (supported: {', '.join(sorted(ARCHITECTURES))}); pass the config "
                                  f"explicitly to load it anyway")
    return rule(hf_config, layer)

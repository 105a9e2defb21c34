"""Expert routing (docs/SPEC.md §3): softmax top-k; sigmoid or sqrt(softplus) scores with a
correction bias and optional group-limited top-k (DeepSeek-V3 / V4 style); hash routing, where a
frozen token-id table chooses the experts (DeepSeek-V4 ``hash_moe`` layers); and the routing each
supported architecture (Hugging Face ``model_type``) implies (:func:`architecture_routing`).

Ties: among equal selection scores the lowest expert id wins (and, for groups, the lowest group
id), on every backend and whatever the batch (docs/SPEC.md §3.2).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

__all__ = ["route", "hash_expert_ids", "topk_lowest_id", "SCORINGS", "InputIdsRequired",
           "architecture_routing", "ArchitectureRouting", "UnknownArchitecture", "ARCHITECTURES"]

#: The router score functions: logits (float32) -> scores.
SCORINGS = {
    "softmax": lambda logits: torch.softmax(logits, dim=-1),
    "sigmoid": torch.sigmoid,
    "sqrtsoftplus": lambda logits: torch.sqrt(F.softplus(logits)),
}


class InputIdsRequired(ValueError):
    """A hash-routed layer (its experts are ``tid2eid[input_ids]``) was called without ``input_ids``."""


def topk_lowest_id(x: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the ``k`` largest entries of each row of ``x``, largest first; among equal
    entries the lowest index wins. (``torch.topk`` leaves the order of ties unspecified, and it
    does change with the batch on some devices.)"""
    return torch.sort(x, dim=-1, descending=True, stable=True).indices[..., :k]


def hash_expert_ids(tid2eid: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
    """The experts of a hash-routed layer: ``tid2eid[input_ids]`` as int32 ``[T, k]``.

    Raises:
        InputIdsRequired: ``input_ids`` is None.
        ValueError: ``input_ids`` is not an integer ``[T]`` tensor, or holds an id outside
            ``[0, vocab)`` (vocab = ``tid2eid.shape[0]``).
    """
    if input_ids is None:
        raise InputIdsRequired("this layer routes by token id (hash routing: experts = tid2eid[input_ids]); "
                               "pass input_ids, the [T] token ids of the rows")
    if not torch.is_tensor(input_ids) or input_ids.dim() != 1 or torch.is_floating_point(input_ids) \
            or input_ids.dtype == torch.bool:
        what = f"{input_ids.dtype} {tuple(input_ids.shape)}" if torch.is_tensor(input_ids) else type(input_ids).__name__
        raise ValueError(f"input_ids must be an integer tensor [T], got {what}")
    vocab = tid2eid.shape[0]
    ids = input_ids.to(tid2eid.device).long()
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab):
        raise ValueError(f"input_ids out of range [0, {vocab}) of the layer's tid2eid table: "
                         f"min {int(ids.min())}, max {int(ids.max())}")
    return tid2eid[ids].to(torch.int32)


def route(
    router_logits: torch.Tensor,
    top_k: int,
    scoring: str = "softmax",
    correction_bias: torch.Tensor | None = None,
    n_group: int | None = None,
    topk_group: int | None = None,
    renormalize: bool = True,
    routed_scaling_factor: float = 1.0,
    *,
    expert_ids: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Choose ``top_k`` experts per token and their weights.

    Args:
        router_logits: ``[T, E]`` any float dtype (computed in float32).
        top_k: experts per token.
        scoring: ``"softmax"``, ``"sigmoid"`` or ``"sqrtsoftplus"`` (``sqrt(softplus(logits))``).
        correction_bias: ``[E]``, added to the scores for *selection only*.
        n_group, topk_group: group-limited routing: experts split into ``n_group`` equal
            groups, a group's score is the sum of its two best (biased) scores, only the
            ``topk_group`` best groups are eligible.
        renormalize: divide the chosen weights by (their sum + 1e-20).
        routed_scaling_factor: multiply the final weights.
        expert_ids: ``[T, top_k]`` experts already chosen (hash routing,
            :func:`hash_expert_ids`); only their weights are computed from the scores.

    Ties go to the lowest expert id (:func:`topk_lowest_id`).

    Returns:
        ``(topk_weights float32 [T, top_k], topk_ids int32 [T, top_k])``.
    """
    if router_logits.dim() != 2:
        raise ValueError(f"router_logits must be [T, E], got {tuple(router_logits.shape)}")
    t, e = router_logits.shape
    if not 1 <= top_k <= e:
        raise ValueError(f"top_k={top_k} must be in [1, {e}]")
    fn = SCORINGS.get(scoring)
    if fn is None:
        raise ValueError(f"unknown scoring {scoring!r} (expected one of {', '.join(SCORINGS)})")
    scores = fn(router_logits.float())
    if expert_ids is not None:
        if tuple(expert_ids.shape) != (t, top_k):
            raise ValueError(f"expert_ids must be [{t}, {top_k}], got {tuple(expert_ids.shape)}")
        ids = expert_ids.to(scores.device).long()
        if t and (int(ids.min()) < 0 or int(ids.max()) >= e):
            raise ValueError(f"expert_ids out of range [0, {e}): min {int(ids.min())}, max {int(ids.max())}")
    else:
        choice = scores if correction_bias is None else scores + correction_bias.float().unsqueeze(0)
        if n_group and n_group > 1:
            if e % n_group:
                raise ValueError(f"{e} experts cannot split into n_group={n_group} groups")
            tg = topk_group or n_group
            if tg * (e // n_group) < top_k:
                raise ValueError(f"topk_group={tg} groups of {e // n_group} experts cannot hold top_k={top_k}")
            grouped = choice.view(t, n_group, e // n_group)
            group_score = grouped.topk(min(2, e // n_group), dim=-1).values.sum(-1)  # [T, n_group]
            keep = torch.zeros_like(group_score, dtype=torch.bool)
            keep.scatter_(1, topk_lowest_id(group_score, tg), True)
            mask = keep.unsqueeze(-1).expand(t, n_group, e // n_group).reshape(t, e)
            choice = choice.masked_fill(~mask, float("-inf"))
        ids = topk_lowest_id(choice, top_k)
    weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    weights = weights * routed_scaling_factor
    return weights.float(), ids.to(torch.int32)


# ------------------------------------------------------------------------------------------
# The routing of an architecture, from its Hugging Face config.json
# ------------------------------------------------------------------------------------------

class UnknownArchitecture(ValueError):
    """config.json names a ``model_type`` whose routing megamoe does not know (never guessed)."""


@dataclass(frozen=True)
class ArchitectureRouting:
    """What one ``model_type`` means for an MoE layer.

    ``fields`` are :class:`megamoe.presets.MoEConfig` fields (routing, shapes, shared expert);
    ``choices`` says, for each field, where its value came from (a config.json key, or the
    architecture's default when config.json omits the key); ``w13_layout`` is the order of a
    fused gate/up tensor in this architecture's own (Hugging Face) layout; ``notes`` are
    differences from the architecture's reference code that the caller should know.
    """

    model_type: str
    fields: dict
    choices: list[str]
    w13_layout: str
    notes: list[str]


def _take(hf: dict, key: str, default, choices: list[str], field_name: str, *, required: bool = False):
    if key in hf and hf[key] is not None:
        choices.append(f"{field_name}={hf[key]!r} (config.json {key})")
        return hf[key]
    if required:
        raise UnknownArchitecture(f"config.json: {key} is missing (needed for {field_name})")
    choices.append(f"{field_name}={default!r} (architecture default; config.json has no {key})")
    return default


def _silu_only(hf: dict, model_type: str) -> None:
    act = hf.get("hidden_act", "silu")
    if act != "silu":
        raise UnknownArchitecture(f"config.json hidden_act={act!r}: megamoe's experts are SwiGLU (silu); "
                                  f"{model_type} with {act!r} is not supported")


def _deepseek_v3(hf: dict) -> ArchitectureRouting:
    # transformers' DeepseekV3TopkRouter: sigmoid scores, e_score_correction_bias added for
    # selection only, group-limited top-k (a group scores the sum of its two best biased
    # scores), chosen weights = unbiased scores, renormalised if norm_topk_prob, times
    # routed_scaling_factor. transformers 5 writes no scoring_func / topk_method; DeepSeek's
    # own config.json writes scoring_func="sigmoid", topk_method="noaux_tc".
    c: list[str] = []
    _silu_only(hf, "deepseek_v3")
    scoring = hf.get("scoring_func")
    if scoring not in (None, "sigmoid"):
        raise UnknownArchitecture(f"config.json scoring_func={scoring!r}: deepseek_v3 routes with sigmoid scores")
    method = hf.get("topk_method")
    if method not in (None, "noaux_tc"):
        raise UnknownArchitecture(f"config.json topk_method={method!r}: deepseek_v3 routing is 'noaux_tc' "
                                  f"(sigmoid, correction bias, group-limited top-k)")
    c.append("scoring='sigmoid' (deepseek_v3" + (", config.json scoring_func)" if scoring else
                                                 "; config.json has no scoring_func)"))
    f = {"scoring": "sigmoid"}
    f["num_experts"] = _take(hf, "n_routed_experts", 256, c, "num_experts")
    f["top_k"] = _take(hf, "num_experts_per_tok", 8, c, "top_k")
    f["n_group"] = _take(hf, "n_group", 8, c, "n_group")
    f["topk_group"] = _take(hf, "topk_group", 4, c, "topk_group")
    f["renormalize"] = bool(_take(hf, "norm_topk_prob", True, c, "renormalize"))
    f["routed_scaling_factor"] = float(_take(hf, "routed_scaling_factor", 2.5, c, "routed_scaling_factor"))
    f["intermediate_size"] = _take(hf, "moe_intermediate_size", 2048, c, "intermediate_size")
    f["n_shared_experts"] = _take(hf, "n_shared_experts", 1, c, "n_shared_experts") or 0
    if f["n_shared_experts"]:
        # DeepseekV3MLP(intermediate_size = moe_intermediate_size * n_shared_experts)
        f["shared_intermediate_size"] = f["intermediate_size"]
        c.append(f"shared expert: {f['n_shared_experts']} x moe_intermediate_size (deepseek_v3)")
    return ArchitectureRouting("deepseek_v3", f, c, "gate-up", [
        "the e_score_correction_bias tensor is required (noaux_tc selection)"])


def _mixtral(hf: dict) -> ArchitectureRouting:
    # transformers' MixtralTopKRouter: softmax over all experts (float32), top-k, always
    # renormalised, no scaling, no shared expert.
    c: list[str] = ["scoring='softmax', renormalize=True (mixtral)"]
    _silu_only(hf, "mixtral")
    f = {"scoring": "softmax", "renormalize": True, "routed_scaling_factor": 1.0, "n_shared_experts": 0}
    f["num_experts"] = _take(hf, "num_local_experts", 8, c, "num_experts")
    f["top_k"] = _take(hf, "num_experts_per_tok", 2, c, "top_k")
    f["intermediate_size"] = _take(hf, "intermediate_size", 14336, c, "intermediate_size")
    return ArchitectureRouting("mixtral", f, c, "gate-up", [
        "router logits: transformers computes them in the model dtype, megamoe in float32 "
        "(a near-tie may pick a different expert)"])


def _qwen3_moe(hf: dict) -> ArchitectureRouting:
    # transformers' Qwen3MoeTopKRouter: softmax (float32), top-k, renormalised only if
    # norm_topk_prob (default False), no scaling, no shared expert.
    c: list[str] = ["scoring='softmax' (qwen3_moe)"]
    _silu_only(hf, "qwen3_moe")
    f = {"scoring": "softmax", "routed_scaling_factor": 1.0, "n_shared_experts": 0}
    f["num_experts"] = _take(hf, "num_experts", 128, c, "num_experts")
    f["top_k"] = _take(hf, "num_experts_per_tok", 8, c, "top_k")
    f["renormalize"] = bool(_take(hf, "norm_topk_prob", False, c, "renormalize"))
    f["intermediate_size"] = _take(hf, "moe_intermediate_size", 768, c, "intermediate_size")
    return ArchitectureRouting("qwen3_moe", f, c, "gate-up", [
        "router logits and weights: transformers computes logits and returns weights in the model dtype, "
        "megamoe keeps float32 (a near-tie may pick a different expert)"])


#: model_type -> rule. Each rule is checked against the transformers router of that
#: architecture on recorded inputs (tests/fixtures/real/routing_*.safetensors).
ARCHITECTURES = {"deepseek_v3": _deepseek_v3, "mixtral": _mixtral, "qwen3_moe": _qwen3_moe}


def architecture_routing(hf_config: dict) -> ArchitectureRouting:
    """The MoE routing (and expert shapes) that ``hf_config`` (a parsed config.json) implies.

    Raises:
        UnknownArchitecture: no ``model_type``, a ``model_type`` megamoe has no rule for,
            or a key whose value the rule does not support (named in the message).
    """
    mt = hf_config.get("model_type")
    if mt is None:
        raise UnknownArchitecture("config.json has no model_type: the routing cannot be known "
                                  f"(supported: {', '.join(sorted(ARCHITECTURES))}; or pass the config)")
    rule = ARCHITECTURES.get(mt)
    if rule is None:
        raise UnknownArchitecture(f"config.json model_type={mt!r}: megamoe does not know this architecture's "
                                  f"routing (supported: {', '.join(sorted(ARCHITECTURES))}); pass the config "
                                  f"explicitly to load it anyway")
    return rule(hf_config)

"""Expert routing (docs/SPEC.md §3): softmax top-k; the softmax over the top-k logits (gpt-oss); sigmoid or sqrt(softplus) scores with a
correction bias and optional group-limited top-k (DeepSeek-V3 / V4 style); hash routing, where a
frozen token-id table chooses the experts (DeepSeek-V4 ``hash_moe`` layers). The routing each
supported architecture (Hugging Face ``model_type``) implies is :mod:`megamoe.architectures`'s
(one rule per architecture; its names are importable from here too).

Ties: among equal selection scores the lowest expert id wins (and, for groups, the lowest group
id), on every backend and whatever the batch (docs/SPEC.md §3).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["route", "hash_expert_ids", "topk_lowest_id", "SCORINGS", "TOPK_SCORINGS", "InputIdsRequired",
           "architecture_routing", "ArchitectureRouting", "UnknownArchitecture", "ARCHITECTURES", "UNSUPPORTED"]

#: The router score functions: logits (float32) -> scores.
SCORINGS = {
    "softmax": lambda logits: torch.softmax(logits, dim=-1),
    "sigmoid": torch.sigmoid,
    "sqrtsoftplus": lambda logits: torch.sqrt(F.softplus(logits)),
}

#: Scorings that weigh the chosen experts from their logits alone (not a score of every expert):
#: ``softmax_topk`` (gpt-oss) selects the top-k of the logits and weighs them by the softmax over
#: the k chosen logits, which sums to 1 by definition.
TOPK_SCORINGS = ("softmax_topk",)


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
        scoring: ``"softmax"``, ``"sigmoid"`` or ``"sqrtsoftplus"`` (``sqrt(softplus(logits))``), or
            ``"softmax_topk"``: the top-k of the logits, weighted by ``softmax`` over the k chosen
            logits (gpt-oss; no correction bias, groups or ``expert_ids``; the weights already sum
            to 1 and are not divided again).
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
    if scoring in TOPK_SCORINGS:
        return _softmax_topk(router_logits, top_k, correction_bias, n_group, expert_ids, routed_scaling_factor)
    fn = SCORINGS.get(scoring)
    if fn is None:
        raise ValueError(f"unknown scoring {scoring!r} (expected one of {', '.join((*SCORINGS, *TOPK_SCORINGS))})")
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


def _softmax_topk(router_logits, top_k, correction_bias, n_group, expert_ids, routed_scaling_factor):
    """gpt-oss's router after its logits: the top-k of the float32 logits (ties: lowest id),
    weights ``softmax`` over the k chosen logits, times ``routed_scaling_factor``."""
    if correction_bias is not None or (n_group and n_group > 1) or expert_ids is not None:
        what = ("a correction bias" if correction_bias is not None else
                "expert groups" if expert_ids is None else "expert_ids (hash routing)")
        raise ValueError(f"scoring='softmax_topk' selects the top-k of the logits: {what} does not apply")
    logits = router_logits.float()
    ids = topk_lowest_id(logits, top_k)
    weights = torch.softmax(logits.gather(1, ids), dim=-1) * routed_scaling_factor
    return weights.float(), ids.to(torch.int32)


#: names :mod:`megamoe.architectures` defines, importable from here as before it had its own module
_ARCHITECTURE_NAMES = ("architecture_routing", "ArchitectureRouting", "UnknownArchitecture", "ARCHITECTURES",
                       "UNSUPPORTED")


def __getattr__(name: str):
    # looked up on first use: megamoe.architectures imports this module (SCORINGS)
    if name in _ARCHITECTURE_NAMES:
        from megamoe import architectures

        return getattr(architectures, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


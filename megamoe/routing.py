"""Expert routing (SPEC §3): softmax top-k, and sigmoid with correction bias and
group-limited top-k (DeepSeek-V3 style)."""
from __future__ import annotations

import torch

__all__ = ["route"]


def route(
    router_logits: torch.Tensor,
    top_k: int,
    scoring: str = "softmax",
    correction_bias: torch.Tensor | None = None,
    n_group: int | None = None,
    topk_group: int | None = None,
    renormalize: bool = True,
    routed_scaling_factor: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Choose ``top_k`` experts per token.

    Args:
        router_logits: ``[T, E]`` any float dtype (computed in float32).
        top_k: experts per token.
        scoring: ``"softmax"`` or ``"sigmoid"``.
        correction_bias: ``[E]``, added to the scores for *selection only* (sigmoid mode).
        n_group, topk_group: group-limited routing: experts split into ``n_group`` equal
            groups, a group's score is the sum of its two best (biased) scores, only the
            ``topk_group`` best groups are eligible.
        renormalize: divide the chosen weights by their sum.
        routed_scaling_factor: multiply the final weights.

    Returns:
        ``(topk_weights float32 [T, top_k], topk_ids int32 [T, top_k])``.
    """
    if router_logits.dim() != 2:
        raise ValueError(f"router_logits must be [T, E], got {tuple(router_logits.shape)}")
    t, e = router_logits.shape
    if not 1 <= top_k <= e:
        raise ValueError(f"top_k={top_k} must be in [1, {e}]")
    logits = router_logits.float()
    if scoring == "softmax":
        scores = torch.softmax(logits, dim=-1)
    elif scoring == "sigmoid":
        scores = torch.sigmoid(logits)
    else:
        raise ValueError(f"unknown scoring {scoring!r} (expected 'softmax' or 'sigmoid')")
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
        keep.scatter_(1, group_score.topk(tg, dim=-1).indices, True)
        mask = keep.unsqueeze(-1).expand(t, n_group, e // n_group).reshape(t, e)
        choice = choice.masked_fill(~mask, float("-inf"))
    ids = choice.topk(top_k, dim=-1).indices
    weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / weights.sum(-1, keepdim=True).clamp_min(1e-20)
    weights = weights * routed_scaling_factor
    return weights.float(), ids.to(torch.int32)

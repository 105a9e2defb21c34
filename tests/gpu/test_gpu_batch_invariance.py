"""docs/SPEC.md §3.5 on a GPU: a row's output bits do not depend on the rest of its batch.

The whole layer (router, activation quantization, the expert GEMMs the plan picks, the combine, the shared expert)
on cuda-sm90: random rows, near-tied router rows and rows whose blocks span 24 binades, each alone and inside
batches of every size up to 64 and of sizes whose expected tokens per expert cross every switch point of the plan
(4, 5, 24, 25, 63, 64, 1024). And the control that shows the check can fail: with ``batch_invariant`` off, the plan
streams one token and runs wgmma for a batch, and the same W4A16 rows then differ. (cuda-sm100: the same check in
tests/sm100_gpu/test_sm100_batch_invariance.py.)"""
from __future__ import annotations

import pytest
import torch

from _helpers import (INVARIANCE_CASES, backend_or_skip, check_rows_alone_equal_batched, invariance_batches,
                      invariance_probes)
from megamoe.moe import MoELayer

pytestmark = pytest.mark.gpu


def layer_for(case: str, seed: int) -> MoELayer:
    preset, over = INVARIANCE_CASES[case]
    return MoELayer.from_preset(preset, seed=seed, backend=backend_or_skip("cuda-sm90"), **over)


@pytest.mark.parametrize("case", list(INVARIANCE_CASES))
def test_rows_alone_equal_rows_batched_on_sm90(gen, case):
    layer = layer_for(case, int(torch.randint(0, 1000, (1,), generator=gen)))
    batches = invariance_batches(layer.config)
    be, cfg = layer.backend, layer.config
    # the sizes do cross the plan's choices: every kernel the plan has for this shape runs
    kernels = {str(be.plan(-(-b * cfg.top_k // cfg.num_experts), cfg.hidden_size, cfg.intermediate_size,
                           cfg.num_experts, cfg.act_mode == "w4a16", True, cfg.act_mode != "w4a16", b).kernel)
               for b in batches}
    assert {k.split(".")[-1] for k in kernels} == {"wgmma32", "wgmma64", "wgmma128"}, kernels
    check_rows_alone_equal_batched(layer, invariance_probes(layer, gen), gen, batches)


def test_the_check_fails_where_the_plan_mixes_kernels(gen):
    """The control: with batch_invariant off, one W4A16 token takes the streaming kernel (K split between warps)
    and a batch of 300 the wgmma kernels (K in one sequence): the same rows come out with other bits (on an H100,
    16 of 16 random rows of V4-Flash's shape differed, by up to 0.0156)."""
    layer = layer_for("v4-flash-w4a16", 11)
    layer.batch_invariant = False
    x = invariance_probes(layer, gen)
    alone = torch.cat([layer(r[None]) for r in x])
    batch = torch.cat([x, torch.randn(300 - len(x), x.shape[1], generator=gen).to(x.dtype)])
    together = layer(batch)[: len(x)]
    differ = int((alone != together).any(dim=1).sum())
    print(f"batch_invariant off: {differ} of {len(x)} rows differ alone vs in a batch of 300")
    assert differ > 0
    layer.batch_invariant = True
    assert torch.equal(torch.cat([layer(r[None]) for r in x]), layer(batch)[: len(x)])

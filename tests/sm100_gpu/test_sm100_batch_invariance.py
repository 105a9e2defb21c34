"""docs/SPEC.md §3.5 on a Blackwell GPU: a row's output bits do not depend on the rest of its batch, on cuda-sm100
(the CUTLASS grouped GEMMs, their small-M and large-M tiles, the host glue, the router, the shared expert).

Skipped, with the reason, everywhere else (no Blackwell GPU ran it in this project's CI). On a B200:
``pytest tests/sm100_gpu -q``. The same rows and batch sizes as tests/gpu/test_gpu_batch_invariance.py."""
from __future__ import annotations

import pytest
import torch

from _helpers import (INVARIANCE_CASES, backend_or_skip, check_rows_alone_equal_batched, invariance_batches,
                      invariance_probes)
from megamoe.moe import MoELayer

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("case", list(INVARIANCE_CASES))
def test_rows_alone_equal_rows_batched_on_sm100(gen, case):
    preset, over = INVARIANCE_CASES[case]
    layer = MoELayer.from_preset(preset, seed=int(torch.randint(0, 1000, (1,), generator=gen)),
                                 backend=backend_or_skip("cuda-sm100"), **over)
    check_rows_alone_equal_batched(layer, invariance_probes(layer, gen), gen, invariance_batches(layer.config))

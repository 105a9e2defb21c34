"""What perf_analyzer's ``--input-data random`` sends (random bit patterns) is refused with a 400
that names the tensor and the first bad element, in every float datatype the server accepts;
finite extremes (largest values, subnormals, signed zeros) are accepted. The server's fast
finiteness check is compared with torch.isfinite on every BF16 and FP16 bit pattern.
"""

from __future__ import annotations

import pytest
import torch

from megamoe.service.model import ServedModel, _all_finite
from megamoe.service.protocol import ProtocolError

from service_testkit import PRESET, random_inputs


@pytest.fixture(scope="module")
def served(layer):
    return ServedModel(PRESET, layer, max_tokens_per_request=64)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fast_check_agrees_with_torch_on_every_16_bit_pattern(dtype):
    patterns = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(dtype)
    expected = torch.isfinite(patterns)
    got = torch.tensor([_all_finite(patterns[i: i + 1]) for i in range(patterns.numel())])
    assert torch.equal(got, expected), f"{int((got != expected).sum())} of 65536 {dtype} patterns misjudged"
    assert not _all_finite(patterns) and _all_finite(patterns[expected])


# float32 bit patterns: non-finite (all exponent bits set) and finite extremes
F32_BAD = [0x7F800000, 0xFF800000, 0x7FC00000, 0xFFC00000, 0x7F800001, 0x7FBFFFFF, 0xFFFFFFFF]
F32_GOOD = [0x7F7FFFFF, 0xFF7FFFFF, 0x00000001, 0x80000001, 0x00800000, 0x00000000, 0x80000000, 0x3F800000]


def _f32(bits: list[int]) -> torch.Tensor:
    return torch.tensor([b - 2**32 if b >= 2**31 else b for b in bits], dtype=torch.int32).view(torch.float32)


def test_fast_check_float32_patterns():
    for bits in F32_BAD:
        x = torch.randn(3, 17)
        x.view(-1)[29] = _f32([bits])[0]
        assert not _all_finite(x), hex(bits)
    assert _all_finite(_f32(F32_GOOD))
    # float64 and a non-contiguous view go through the same check
    assert not _all_finite(torch.tensor([1.0, float("nan")], dtype=torch.float64))
    y = torch.randn(8, 8)
    y[5, 2] = float("inf")
    assert not _all_finite(y.t()) and _all_finite(y[:4].t())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("name", ["hidden_states", "topk_weights", "router_logits"])
def test_non_finite_input_is_refused_by_name_and_position(served, layer, dtype, name):
    hidden, ids, weights = random_inputs(layer, 3, seed=11)
    logits = torch.randn(3, layer.config.num_experts)
    tensors = {"hidden_states": hidden, "topk_ids": ids, "topk_weights": weights}
    if name == "router_logits":
        tensors = {"hidden_states": hidden, "router_logits": logits}
    tensors = {k: (v.to(dtype) if v.is_floating_point() else v) for k, v in tensors.items()}
    datatypes = {k: {torch.bfloat16: "BF16", torch.float16: "FP16", torch.float32: "FP32"}.get(v.dtype, "INT32")
                 for k, v in tensors.items()}
    served.validate(tensors, datatypes)  # finite: accepted
    bad = tensors[name].clone()
    bad[2, 1] = float("nan") if name != "topk_weights" else float("-inf")
    with pytest.raises(ProtocolError, match=rf"{name} contains NaN or Inf \(first at \[2, 1\]\)"):
        served.validate({**tensors, name: bad}, datatypes)


def test_router_logits_beside_topk_is_still_checked(served, layer):
    hidden, ids, weights = random_inputs(layer, 2, seed=5)
    logits = torch.randn(2, layer.config.num_experts)
    logits[1, 0] = float("inf")
    datatypes = {"hidden_states": "FP32", "topk_ids": "INT32", "topk_weights": "FP32", "router_logits": "FP32"}
    with pytest.raises(ProtocolError, match="router_logits contains NaN or Inf"):
        served.validate({"hidden_states": hidden, "topk_ids": ids, "topk_weights": weights, "router_logits": logits},
                        datatypes)
    request = served.validate({"hidden_states": hidden, "topk_ids": ids, "topk_weights": weights,
                               "router_logits": logits.nan_to_num(posinf=1.0)}, datatypes)
    assert request.mode == "topk" and torch.equal(request.topk_ids, ids)

"""cuda-sm90 lane order (the wgmma GEMMs' activation operand; megamoe/nvfp4_device.cuh): the three producers
(bf16 staging, the quantizer's exact decode, nvfp4_to_operand) write the same bytes in either order, every
64-element block is a true permutation of its operand-order block, and a shape lane order cannot hold is
refused. (That the order is the one the kernels read is checked by every wgmma GEMM and MoE test.)"""
from __future__ import annotations

import pytest
import torch

from megamoe import nvfp4

from _helpers import backend_or_skip

pytestmark = pytest.mark.gpu


def test_lane_order_producers_agree_and_permute_blocks(gen):
    backend_or_skip("cuda-sm90")
    from megamoe import _ext
    from megamoe.backends.cuda_common import GS_SINGLE, common_ext, current_stream

    rows, k = 37, 448
    x = (torch.randn((rows, k), generator=gen) * torch.exp(torch.randn((rows, 1), generator=gen))).to(torch.bfloat16)
    stream = current_stream()
    out = {}
    for lane in (False, True):
        data = torch.full((rows, k // 2), 0xEE, dtype=torch.uint8, device="cuda")
        scale = torch.full((rows, k // 16), 0x7F, dtype=torch.uint8, device="cuda")
        quant = torch.full((rows, k), float("nan"), dtype=torch.bfloat16, device="cuda")
        common_ext().quantize_nvfp4(x.cuda(), torch.ones(1, device="cuda"), GS_SINGLE, None, None, None, data, scale,
                                    None, 0, quant, None, stream, dequant_lane_order=lane)
        natural = nvfp4.dequantize(nvfp4.NVFP4Tensor(data.cpu(), scale.cpu().view(torch.float8_e4m3fn),
                                                     torch.tensor(1.0))).to(torch.bfloat16)
        staged = torch.full_like(quant, float("nan"))
        _ext.ext.sm90_stage_bf16(natural.cuda(), None, None, staged, stream, lane_order=lane)
        decoded = torch.full_like(quant, float("nan"))
        common_ext().nvfp4_to_operand(data, scale, decoded, stream, lane_order=lane)
        bits = [t.cpu().view(torch.int16) for t in (quant, staged, decoded)]
        assert torch.equal(bits[0], bits[1]) and torch.equal(bits[0], bits[2]), f"producers disagree (lane={lane})"
        out[lane], out["natural"] = quant.cpu().float(), natural.float()
    blocks = lambda t: t.reshape(rows, k // 64, 64).sort(dim=-1).values  # noqa: E731
    assert not torch.isnan(out[True]).any()
    assert torch.equal(blocks(out[False]), blocks(out[True])) and torch.equal(blocks(out[True]), blocks(out["natural"]))
    assert not torch.equal(out[False], out[True])


def test_lane_order_refuses_k_not_multiple_of_64(gen):
    backend_or_skip("cuda-sm90")
    from megamoe import _ext
    from megamoe.backends.cuda_common import current_stream

    x = torch.randn((4, 464), generator=gen).to(torch.bfloat16).cuda()
    dst = torch.empty_like(x)
    with pytest.raises(Exception, match="stage_bf16"):
        _ext.ext.sm90_stage_bf16(x, None, None, dst, current_stream(), lane_order=True)

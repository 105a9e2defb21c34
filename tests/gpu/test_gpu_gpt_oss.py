"""gpt-oss's expert math on cuda-sm90 (docs/SPEC.md §3): the expert biases b13 (gate and up, before the clamp) and
b2 (before the routing weight) and the activation (up + 1) * gate * sigmoid(1.702 * gate) in the GEMM epilogues,
against the torch backend on the same weights, for every kernel the plan has (streaming, wgmma tiles 32 / 64 / 128),
W4A16, W4A4 with static scales (h quantized in gemm1's epilogue) and W4A4 with a dynamic scale (h written in fp32),
one token (no align kernel) and batches. The real gpt-oss checkpoints: tests/gpu/test_gpu_real_checkpoints.py."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from _helpers import backend_or_skip, cosine
from megamoe import checkpoint as C
from megamoe.backends.cuda_sm90 import CudaSm90Backend
from megamoe.moe import MoELayer
from megamoe.presets import MoEConfig

pytestmark = pytest.mark.gpu

GPT_OSS = dict(scoring="softmax_topk", swiglu_limit=7.0, swiglu_alpha=1.702, swiglu_up_shift=1.0)
SHAPES = {"wgmma": (1024, 512, 16, 4), "stream-only": (64, 32, 6, 2)}  # H, I, E, k (I % 64 != 0: streaming only)
MODES = {"w4a16": dict(act_mode="w4a16"), "w4a4": dict(act_mode="w4a4"),
         "w4a4-dynamic": dict(act_mode="w4a4", dynamic_act_scale=True)}


def gpt_oss_weights(shape: str, mode: str, seed: int):
    h, i, e, k = SHAPES[shape]
    cfg = MoEConfig(h, i, e, k, **MODES[mode], **GPT_OSS)
    gen = torch.Generator().manual_seed(seed)
    w = C.synthetic_weights(cfg, seed=seed, static_input_scales=not cfg.dynamic_act_scale and mode != "w4a16")
    w.b13 = torch.randn(e, 2 * i, generator=gen) * 2.0
    w.b2 = torch.randn(e, h, generator=gen) * 2.0
    w.router_logit_bias = torch.randn(e, generator=gen) * 0.5
    return w, cfg


# every kernel at the shape that has them all; the plan's choice where I % 64 != 0 allows streaming only
KERNELS = [("wgmma", k) for k in ("auto", "stream", "wgmma32", "wgmma64", "wgmma128")] + [("stream-only", "auto")]


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("shape,kernel", KERNELS)
def test_gpt_oss_layer_on_sm90_matches_the_torch_backend(shape, mode, kernel):
    backend_or_skip("cuda-sm90")
    w, cfg = gpt_oss_weights(shape, mode, seed=7)
    gpu = MoELayer(w, cfg, backend=CudaSm90Backend(kernel=kernel))
    ref = MoELayer(w, cfg, backend="torch", device="cuda")
    gen = torch.Generator().manual_seed(3)
    for t in (1, 7, 64, 300, 2048):
        x = (torch.randn(t, cfg.hidden_size, generator=gen) * 3.0).to(torch.bfloat16)  # pre-activations past 7
        out, exp = gpu(x).float(), ref(x).float()
        c, ratio = cosine(out, exp), float(out.norm() / exp.norm())
        print(f"gpt-oss {shape} {mode} {kernel} T={t}: cosine {c:.7f}, norm ratio {ratio:.5f}")
        assert torch.isfinite(out).all() and c >= 0.9999 and abs(ratio - 1) < 1e-3, (t, c, ratio)
        if t == 300:  # the biases are applied in the kernels: without them the same layer is far off
            for drop in ("b13", "b2"):
                gpu._prepared = dataclasses.replace(gpu._prepared, **{drop: None})
                c_drop = cosine(gpu(x).float(), exp)
                gpu._prepared = gpu.backend.prepare_weights(gpu._routed_weights())
                assert c_drop < 0.999, (drop, c_drop)


def test_swiglu_alpha_and_shift_need_the_silu_mul_epilogue():
    be = backend_or_skip("cuda-sm90")
    from megamoe import _ext
    w, cfg = gpt_oss_weights("wgmma", "w4a16", seed=1)
    p = be.prepare_weights(w)
    plan = be.plan(1, cfg.intermediate_size, cfg.intermediate_size, cfg.num_experts, True, False)
    act = torch.zeros((1, cfg.intermediate_size), dtype=torch.bfloat16, device="cuda")
    with pytest.raises(ValueError, match="silu_mul epilogue only"):
        _ext.ext.sm90_grouped_gemm(act=act, slot_experts=torch.zeros(1, dtype=torch.int32, device="cuda"),
                                   grid_experts=1, w_data=p.w2_data, w_scale=p.w2_scale, w_global_scale=p.w2_gs,
                                   epilogue=_ext.ext.Sm90Epilogue.store, swiglu_alpha=1.702,
                                   out=torch.empty((1, cfg.hidden_size), device="cuda"), max_total_rows=1, plan=plan,
                                   stream=torch.cuda.current_stream().cuda_stream)
    with pytest.raises(ValueError, match=r"bias must be float32 \[E, N\]"):
        _ext.ext.sm90_grouped_gemm(act=act, slot_experts=torch.zeros(1, dtype=torch.int32, device="cuda"),
                                   grid_experts=1, w_data=p.w2_data, w_scale=p.w2_scale, w_global_scale=p.w2_gs,
                                   epilogue=_ext.ext.Sm90Epilogue.store, bias=p.b2[:, :-1].contiguous(),
                                   out=torch.empty((1, cfg.hidden_size), device="cuda"), max_total_rows=1, plan=plan,
                                   stream=torch.cuda.current_stream().cuda_stream)

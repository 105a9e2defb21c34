"""Synthetic checkpoints: realistic random NVFP4 weights of a layer config
(:func:`synthetic_weights`), written in megamoe's own fused layout (:func:`save`,
:func:`write_synthetic`) that :func:`megamoe.checkpoint.load` reads back
(:mod:`megamoe.checkpoint.readers.fused`)."""
from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from megamoe import nvfp4, reference
from megamoe.presets import MoEConfig, get_preset
from megamoe.weights import MoEWeights


def _with_outliers(shape, std, gen, device, frac=1e-3, lo=5.0, hi=20.0):
    w = torch.randn(shape, generator=gen, device=device) * std
    mask = torch.rand(shape, generator=gen, device=device) < frac
    boost = lo + (hi - lo) * torch.rand(shape, generator=gen, device=device)
    return torch.where(mask, w * boost, w)


def _amax_scale(x: torch.Tensor) -> torch.Tensor:
    return nvfp4.default_global_scale(x)


#: Token ids in a synthetic hash-routed layer's ``tid2eid`` table.
SYNTHETIC_VOCAB = 4096


def synthetic_weights(cfg: MoEConfig, seed: int = 0, device=None, progress: bool = False,
                      static_input_scales: bool = True) -> MoEWeights:
    """Realistic random NVFP4 weights for ``cfg``.

    Gaussian weights with 0.1% outliers (5-20x), per-expert global scales from each
    tensor's amax, gate and up of an expert scaled differently (up/gate magnitude ratio
    between 0.1 and 10, so their ``weight_scale_2`` differ), static input scales calibrated
    on 64-512 random tokens per expert (more for small shapes), a router (and correction bias for sigmoid scoring), and
    the shared expert in bf16. Deterministic for a given ``seed`` and device type.
    """
    device = torch.device(device or "cpu")
    gen = torch.Generator(device=device).manual_seed(seed)
    e, h, i = cfg.num_experts, cfg.hidden_size, cfg.intermediate_size
    w13_data = torch.empty((e, 2 * i, h // 2), dtype=torch.uint8, device=device)
    w13_scale = torch.empty((e, 2 * i, h // 16), dtype=torch.float8_e4m3fn, device=device)
    w13_gs = torch.empty((e, 2), dtype=torch.float32, device=device)
    w2_data = torch.empty((e, h, i // 2), dtype=torch.uint8, device=device)
    w2_scale = torch.empty((e, h, i // 16), dtype=torch.float8_e4m3fn, device=device)
    w2_gs = torch.empty((e,), dtype=torch.float32, device=device)
    in1 = torch.empty((e,), dtype=torch.float32, device=device)
    in2 = torch.empty((e,), dtype=torch.float32, device=device)
    calib_tokens = max(64, min(512, 2**27 // (h * i)))
    ratio = 10 ** (2 * torch.rand((e,), generator=gen, device=device) - 1)  # up/gate in [0.1, 10]

    it = range(e)
    if progress:
        from tqdm import tqdm

        it = tqdm(it, desc=f"synthesizing {e} experts", unit="expert")
    for ex in it:
        gate = _with_outliers((i, h), h ** -0.5, gen, device)
        up = _with_outliers((i, h), h ** -0.5, gen, device) * ratio[ex]
        down = _with_outliers((h, i), i ** -0.5, gen, device)
        gs = torch.stack([_amax_scale(gate), _amax_scale(up)])
        q13 = nvfp4.quantize(torch.cat([gate, up]), gs)
        q2 = nvfp4.quantize(down, _amax_scale(down))
        w13_data[ex], w13_scale[ex], w13_gs[ex] = q13.data, q13.scale, q13.global_scale
        w2_data[ex], w2_scale[ex], w2_gs[ex] = q2.data, q2.scale, q2.global_scale
        # calibration: amax of this expert's inputs over a few hundred tokens, as ModelOpt records
        xc = _with_outliers((calib_tokens, h), 1.0, gen, device, frac=1e-3, lo=3.0, hi=8.0)
        in1[ex] = _amax_scale(xc)
        gu = nvfp4.dequantize(nvfp4.quantize(xc, in1[ex])) @ nvfp4.dequantize(q13).T
        hmid = reference.swiglu(gu, i, cfg.swiglu_limit)
        in2[ex] = _amax_scale(hmid)

    router = (torch.randn((e, h), generator=gen, device=device) * h ** -0.5).to(torch.bfloat16)
    bias = (torch.randn((e,), generator=gen, device=device) * 0.01) if cfg.scoring != "softmax" else None
    if cfg.scoring == "softmax_topk":
        bias = None  # (drawn all the same) the top-k of the logits: no selection bias
    if cfg.hash_routing:
        bias = None  # (drawn all the same: the seed's later draws stay those without hash routing)
    shared_gu = shared_down = None
    if cfg.n_shared_experts:
        is_ = (cfg.shared_intermediate_size or i) * cfg.n_shared_experts
        shared_gu = (torch.randn((2 * is_, h), generator=gen, device=device) * h ** -0.5).to(torch.bfloat16)
        shared_down = (torch.randn((h, is_), generator=gen, device=device) * is_ ** -0.5).to(torch.bfloat16)
    tid2eid = None
    if cfg.hash_routing:
        # a token-id table of SYNTHETIC_VOCAB ids, each with top_k distinct experts (drawn last, so
        # the other weights of a seed are those of the same config without hash routing)
        tid2eid = torch.rand((SYNTHETIC_VOCAB, e), generator=gen, device=device).argsort(dim=1)[:, :cfg.top_k]
    return MoEWeights(
        w13=nvfp4.NVFP4Tensor(w13_data, w13_scale, w13_gs),
        w2=nvfp4.NVFP4Tensor(w2_data, w2_scale, w2_gs),
        w13_input_scale=in1 if static_input_scales else None,
        w2_input_scale=in2 if static_input_scales else None,
        router_weight=router,
        router_bias=bias,
        shared_gate_up=shared_gu,
        shared_down=shared_down,
        tid2eid=tid2eid,
    )


def save(path, weights: MoEWeights, cfg: MoEConfig) -> Path:
    """Write ``weights`` in the fused ModelOpt layout, with ``cfg`` in the metadata."""
    from safetensors.torch import save_file

    t = {
        "w13_weight": weights.w13.data,
        "w13_weight_scale": weights.w13.scale,
        "w13_weight_scale_2": weights.w13.global_scale,
        "w2_weight": weights.w2.data,
        "w2_weight_scale": weights.w2.scale,
        "w2_weight_scale_2": weights.w2.global_scale,
    }
    optional = {
        "w13_input_scale": weights.w13_input_scale,
        "w2_input_scale": weights.w2_input_scale,
        "gate.weight": weights.router_weight,
        "gate.e_score_correction_bias": weights.router_bias,
        "gate.tid2eid": weights.tid2eid,
        "shared_experts.gate_up_proj.weight": weights.shared_gate_up,
        "shared_experts.down_proj.weight": weights.shared_down,
        "shared_expert_gate.weight": weights.shared_expert_gate,
        "w13_bias": weights.b13,
        "w2_bias": weights.b2,
        "router.bias": weights.router_logit_bias,
    }
    t.update({k: v for k, v in optional.items() if v is not None})
    t = {k: v.detach().cpu().contiguous() for k, v in t.items()}
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".partial")
    save_file(t, str(tmp), metadata={"format": "modelopt-nvfp4", "quant_algo": "NVFP4",
                                     "megamoe.config": json.dumps(cfg.to_dict())})
    os.replace(tmp, path)  # a crash never leaves a half-written checkpoint under the real name
    return path


def write_synthetic(path, preset: str = "tiny", seed: int = 0, progress: bool = False, device=None,
                    **config_overrides) -> Path:
    """Write a synthetic checkpoint of ``preset`` (docs/SPEC.md §3) to ``path`` (.safetensors)."""
    cfg = get_preset(preset).with_(**config_overrides) if config_overrides else get_preset(preset)
    w = synthetic_weights(cfg, seed=seed, device=device, progress=progress)
    return save(path, w, cfg)

"""gpt-oss (transformers ``gpt_oss``): the pieces megamoe adds for it, each against its float64
definition, and the layer as a whole.

gpt-oss's MoE (transformers' GptOssTopKRouter and GptOssExperts):

* router: ``logits = x Wr^T + br`` (the router's own bias), the top-k of the logits, weights
  ``softmax`` over the k chosen logits (scoring ``softmax_topk``);
* expert: ``gu = x W13^T + b13``; ``gate = min(gu_gate, 7)``, ``up = clamp(gu_up, -7, 7)``;
  ``h = (up + 1) * gate * sigmoid(1.702 * gate)``; ``y = h W2^T + b2``; ``out = sum_k w_k y_k``.

The real ModelOpt / llmcompressor checkpoints are tests/test_real_checkpoints.py's (family part);
here: the definitions, the loader's refusals on those checkpoints, the megamoe format, the
backend guard, tensor parallelism's refusal.
"""
from __future__ import annotations

import math
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from megamoe import checkpoint as C
from megamoe import nvfp4, reference
from megamoe.backends.torch_ref import TorchBackend
from megamoe.moe import MoELayer
from megamoe.presets import MoEConfig
from megamoe.routing import route

from _helpers import cosine

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "real"
GPT_OSS = dict(scoring="softmax_topk", swiglu_limit=7.0, swiglu_alpha=1.702, swiglu_up_shift=1.0)
H, I, E, K = 64, 32, 6, 2


# ------------------------------------------------------------------------------------------
# float64 definitions
# ------------------------------------------------------------------------------------------

def act_f64(gu: torch.Tensor, inter: int, limit=7.0, alpha=1.702, shift=1.0) -> torch.Tensor:
    g, u = gu[:, :inter].double(), gu[:, inter:].double()
    if limit is not None:
        g, u = g.clamp(max=limit), u.clamp(-limit, limit)
    return (u + shift) * g * torch.sigmoid(alpha * g)


def gpt_oss_f64(x, w: C.MoEWeights, cfg: MoEConfig, round_bf16: bool = False):
    """gpt-oss's MoE in float64 on the decoded weights (w13 rows [gate; up]); ``round_bf16``: the
    expert GEMMs' inputs rounded to bfloat16 (what W4A16 feeds them)."""
    def r(t):
        return t.to(torch.bfloat16).double() if round_bf16 else t

    x64 = x.double()
    logits = x64 @ w.router_weight.double().T
    if w.router_logit_bias is not None:
        logits = logits + w.router_logit_bias.double()
    ids = torch.sort(logits, dim=-1, descending=True, stable=True).indices[:, :cfg.top_k]
    wts = torch.softmax(logits.gather(1, ids), dim=-1)
    w13, w2 = nvfp4.dequantize(w.w13).double(), nvfp4.dequantize(w.w2).double()
    out = torch.zeros_like(x64)
    for e in range(cfg.num_experts):
        tok, slot = (ids == e).nonzero(as_tuple=True)
        if tok.numel() == 0:
            continue
        gu = r(x64[tok]) @ w13[e].T
        if w.b13 is not None:
            gu = gu + w.b13[e].double()
        h = act_f64(gu, cfg.intermediate_size, cfg.swiglu_limit, cfg.swiglu_alpha, cfg.swiglu_up_shift)
        y = r(h) @ w2[e].T
        if w.b2 is not None:
            y = y + w.b2[e].double()
        out.index_add_(0, tok, y * wts[tok, slot].unsqueeze(1))
    return out, ids, logits


def _layer_weights(gen, act_mode="w4a16", **cfg_over):
    """A small gpt-oss layer: synthetic NVFP4 experts, biases with real spread."""
    cfg = MoEConfig(H, I, E, K, act_mode=act_mode, **{**GPT_OSS, **cfg_over})
    w = C.synthetic_weights(cfg, seed=int(torch.randint(0, 2**31, (1,), generator=gen)),
                            static_input_scales=act_mode == "w4a4")
    w.b13 = torch.randn(E, 2 * I, generator=gen) * 2.0
    # whatever the seed, both clamps bite: the first gate and up channels sit 12 past zero, where
    # x W13^T (spread about 3 on the gate, 1 to 20 on the up half) rarely brings them back inside 7
    w.b13[:, 0], w.b13[:, I] = 12.0, -12.0
    w.b2 = torch.randn(E, H, generator=gen) * 2.0
    w.router_logit_bias = torch.randn(E, generator=gen) * 0.5
    w.router_weight = (torch.randn(E, H, generator=gen) * 0.3).to(torch.bfloat16)
    return w, cfg


def _x(gen, t=96):
    return torch.randn(t, H, generator=gen) * 3.0  # pre-activations past the clamp at 7 on many rows


# ------------------------------------------------------------------------------------------
# the pieces
# ------------------------------------------------------------------------------------------

def test_activation_matches_its_float64_definition(gen):
    gu = (torch.rand(300, 2 * I, generator=gen) - 0.5) * 30  # [-15, 15]: both clamps bite
    got = reference.swiglu(gu, I, 7.0, 1.702, 1.0)
    want = act_f64(gu, I)
    assert torch.allclose(got.double(), want, rtol=2e-6, atol=2e-6)
    assert (gu[:, :I] > 7).any() and (gu[:, I:].abs() > 7).any()
    # each piece matters: the clamp, alpha, the shift
    for kw in (dict(limit=None), dict(alpha=1.0), dict(shift=0.0)):
        other = act_f64(gu, I, **{**dict(limit=7.0, alpha=1.702, shift=1.0), **kw})
        assert (other - want).abs().max() > 0.1, kw
    # the defaults are SwiGLU exactly as before (every other family): silu(gate) * up, bit for bit
    lim = reference.swiglu(gu, I, 7.0)
    assert torch.equal(lim, F.silu(gu[:, :I].clamp(max=7.0)) * gu[:, I:].clamp(-7.0, 7.0))
    assert torch.equal(reference.swiglu(gu, I, None), F.silu(gu[:, :I]) * gu[:, I:])


def test_softmax_topk_routing_matches_its_definition(gen):
    logits = torch.randn(200, 10, generator=gen) * 2
    w, ids = route(logits, 4, "softmax_topk")
    l64 = logits.double()
    srt = l64.sort(dim=-1, descending=True).values
    clear = (srt[:, 3] - srt[:, 4]) > 1e-4  # rows without a near-tie at the k-th place
    assert clear.float().mean() > 0.9
    want_ids = l64.topk(4, dim=-1).indices
    assert torch.equal(ids.long().sort(-1).values[clear], want_ids.sort(-1).values[clear])
    want_w = torch.softmax(l64.gather(1, ids.long()), dim=-1)
    assert torch.allclose(w.double(), want_w, rtol=1e-6, atol=1e-7)
    assert torch.allclose(w.sum(-1), torch.ones(200), atol=1e-6)
    w2, _ = route(logits, 4, "softmax_topk", routed_scaling_factor=2.0)
    assert torch.equal(w2, w * 2.0)
    # ties: the lowest id, whatever the batch
    tie = torch.tensor([[1.0, 3.0, 3.0, 0.0, 3.0]])
    wt, it = route(tie, 2, "softmax_topk")
    assert it.tolist() == [[1, 2]] and wt.tolist() == [[0.5, 0.5]]
    # the selection is the logits': where float32 softmax underflows to 0 for both runners-up,
    # softmax top-k would take the lower id, gpt-oss takes the larger logit
    far = torch.tensor([[300.0, 99.0, 100.0, -5.0]])
    assert route(far, 2, "softmax_topk")[1].tolist() == [[0, 2]]
    assert route(far, 2, "softmax")[1].tolist() == [[0, 1]]


@pytest.mark.parametrize("kw,msg", [
    (dict(correction_bias=torch.zeros(8)), "correction bias does not apply"),
    (dict(n_group=2, topk_group=1), "expert groups does not apply"),
    (dict(expert_ids=torch.zeros(3, 2, dtype=torch.int32)), "expert_ids"),
])
def test_softmax_topk_refuses_what_does_not_apply(kw, msg):
    with pytest.raises(ValueError, match=msg):
        route(torch.randn(3, 8), 2, "softmax_topk", **kw)


@pytest.mark.parametrize("kw,msg", [
    (dict(scoring="softmax_topk", renormalize=False), "renormalize=False does not apply"),
    (dict(scoring="softmax_topk", hash_routing=True), "hash_routing and n_group do not apply"),
    (dict(scoring="softmax_topk", n_group=2, topk_group=1), "hash_routing and n_group do not apply"),
    (dict(swiglu_alpha=0.0), "swiglu_alpha=0.0"),
    (dict(swiglu_alpha=float("inf")), "swiglu_alpha=inf"),
    (dict(swiglu_up_shift=float("nan")), "swiglu_up_shift=nan"),
])
def test_config_refuses_what_it_cannot_mean(kw, msg):
    with pytest.raises(ValueError, match=msg):
        MoEConfig(H, I, 8, 2, **kw)


# ------------------------------------------------------------------------------------------
# the layer
# ------------------------------------------------------------------------------------------

def test_layer_matches_the_float64_definition(gen):
    """The whole layer: router bias, top-k of logits, softmax over the chosen, b13, the clamped
    activation with alpha and shift, b2 before the routing weight."""
    w, cfg = _layer_weights(gen)
    layer = MoELayer(w, cfg, backend="torch")
    x = _x(gen)
    want, want_ids, logits = gpt_oss_f64(x, w, cfg)
    srt = logits.sort(dim=-1, descending=True).values
    clear = (srt[:, K - 1] - srt[:, K]) > 1e-3
    assert clear.float().mean() > 0.8
    _, ids = layer.route(x)
    assert torch.equal(ids.long().sort(-1).values[clear], want_ids.sort(-1).values[clear])
    # the yardstick (no activation rounding): float32 rounding away from float64
    got = layer.reference_bf16(x)[clear]
    err = float((got.double() - want[clear]).abs().max() / want[clear].abs().max())
    assert err < 1e-5, err
    # the torch backend at W4A16: the GEMM inputs rounded to bf16, as in the definition
    want16, _, _ = gpt_oss_f64(x, w, cfg, round_bf16=True)
    y = layer(x)[clear]
    assert cosine(y, want16[clear]) > 0.99999
    assert float((y.double() - want16[clear]).abs().max() / want16[clear].abs().max()) < 1e-2
    # the clamp bites on this data (gate above 7, up beyond +-7)
    gu = x.double() @ nvfp4.dequantize(w.w13).double()[0].T + w.b13[0].double()
    assert (gu[:, :I] > 7).any() and (gu[:, I:].abs() > 7).any()


@pytest.mark.parametrize("drop", ["b13", "b2", "router_logit_bias", "swiglu_limit", "swiglu_alpha",
                                  "swiglu_up_shift"])
def test_each_piece_matters(gen, drop):
    """The same layer without one of gpt-oss's pieces is measurably further from the definition."""
    w, cfg = _layer_weights(gen)
    x = _x(gen)
    want, _, _ = gpt_oss_f64(x, w, cfg)
    full = MoELayer(w, cfg, backend="torch").reference_bf16(x)
    if drop in ("b13", "b2", "router_logit_bias"):
        other = MoELayer(C.MoEWeights(**{**w.__dict__, drop: None}), cfg, backend="torch").reference_bf16(x)
    else:
        default = {"swiglu_limit": None, "swiglu_alpha": 1.0, "swiglu_up_shift": 0.0}[drop]
        other = MoELayer(w, cfg.with_(**{drop: default}), backend="torch").reference_bf16(x)
    assert cosine(full, want) > 0.99999
    assert cosine(other, want) < 0.9999, (drop, cosine(other, want))  # >= 10x the layer's own distance


def test_w4a4_layer_runs_the_same_math_with_quantized_activations(gen):
    """W4A4 (static input scales): close to the float64 definition, as NVFP4 activations allow,
    and each bias still matters."""
    w, cfg = _layer_weights(gen, act_mode="w4a4", dynamic_act_scale=True)
    x = _x(gen)
    want, _, _ = gpt_oss_f64(x, w, cfg)
    y = MoELayer(w, cfg, backend="torch")(x)
    assert cosine(y, want) > 0.97  # NVFP4 activations (dynamic scales) on both GEMMs
    no_b2 = MoELayer(C.MoEWeights(**{**w.__dict__, "b2": None}), cfg, backend="torch")(x)
    assert cosine(no_b2, want) < cosine(y, want) - 1e-3


# ------------------------------------------------------------------------------------------
# the weights: validate, to, expert_slice, the megamoe format
# ------------------------------------------------------------------------------------------

def test_weights_carry_the_new_fields(gen):
    w, cfg = _layer_weights(gen)
    w.validate(cfg)
    part = w.expert_slice(2, 5)
    assert torch.equal(part.b13, w.b13[2:5]) and torch.equal(part.b2, w.b2[2:5])
    assert part.router_logit_bias is w.router_logit_bias  # the router covers every expert
    part.validate(cfg, num_local_experts=3)
    moved = w.to("cpu", routed_device="cpu")
    assert moved.b13 is w.b13 and moved.router_logit_bias is w.router_logit_bias
    from megamoe.distributed import _expert_part

    assert _expert_part(w).b13 is w.b13 and _expert_part(w).b2 is w.b2


@pytest.mark.parametrize("field,value,msg", [
    ("b13", lambda w: w.b13[:, :-2], r"w13_bias: shape \(6, 62\), expected \(6, 64\)"),
    ("b13", lambda w: w.b13.to(torch.bfloat16), "w13_bias: dtype torch.bfloat16, expected torch.float32"),
    ("b2", lambda w: w.b2[:-1], r"w2_bias: shape \(5, 64\), expected \(6, 64\)"),
    ("router_logit_bias", lambda w: w.router_logit_bias[:3], r"router.bias: shape \(3,\)"),
    ("router_weight", lambda w: None, "router.bias: present without the router weight"),
])
def test_validate_names_a_wrong_field(gen, field, value, msg):
    w, cfg = _layer_weights(gen)
    bad = C.MoEWeights(**{**w.__dict__, field: value(w)})
    with pytest.raises(ValueError, match=msg):
        bad.validate(cfg)


def test_megamoe_format_keeps_the_biases(gen, tmp_path):
    w, cfg = _layer_weights(gen)
    path = C.save(tmp_path / "g.safetensors", w, cfg)
    stored = load_file(str(path))
    assert {"w13_bias", "w2_bias", "router.bias"} <= set(stored)
    got = C.load(path)
    assert got.config == cfg
    for f in ("b13", "b2", "router_logit_bias"):
        assert torch.equal(getattr(got.weights, f), getattr(w, f)), f
    assert got.report.read_as["router.bias"].startswith("router bias (added to the logits")
    assert got.report.read_as["w13_bias"].startswith("experts' gate/up biases")
    x = _x(gen, 40)
    assert torch.equal(MoELayer(got.weights, got.config, backend="torch")(x), MoELayer(w, cfg, backend="torch")(x))
    # an expert range reads its rows of the biases
    with C.open_checkpoint(path) as ck:
        part = C.load_open(ck, experts=(1, 4))
    assert torch.equal(part.weights.b13, w.b13[1:4]) and torch.equal(part.weights.b2, w.b2[1:4])


def test_a_backend_that_does_not_compute_the_math_refuses_the_layer(gen):
    """Until a backend declares ``expert_bias_and_activation`` it never runs such a layer."""
    class Plain(TorchBackend):
        expert_bias_and_activation = False

    w, cfg = _layer_weights(gen)
    with pytest.raises(NotImplementedError, match=r"does not compute expert biases.*\(b13, b2, swiglu_alpha=1.702"):
        MoELayer(w, cfg, backend=Plain())
    plain_w = C.MoEWeights(**{**w.__dict__, "b13": None, "b2": None})
    with pytest.raises(NotImplementedError, match=r"\(swiglu_up_shift=1.0\)"):
        MoELayer(plain_w, cfg.with_(swiglu_alpha=1.0), backend=Plain())
    MoELayer(plain_w, cfg.with_(swiglu_alpha=1.0, swiglu_up_shift=0.0), backend=Plain())  # SwiGLU: runs


# ------------------------------------------------------------------------------------------
# the real checkpoints: what the loader refuses, tensor parallelism, info
# ------------------------------------------------------------------------------------------

def _copy(name: str, tmp_path: Path, drop=(), add=None) -> Path:
    dst = tmp_path / name
    shutil.copytree(FIXTURES / name, dst)
    t = load_file(str(dst / "model.safetensors"))
    for k in [k for k in t if any(k.endswith(d) for d in drop)]:
        del t[k]
    t.update(add or {})
    save_file(t, str(dst / "model.safetensors"))
    return dst


@pytest.mark.parametrize("name,drop,msg", [
    ("llmc_gpt_oss_nvfp4", ["layers.0.mlp.experts.3.down_proj.bias"],
     r"model.layers.0.mlp.experts.3.down_proj.bias: missing for expert 3 \(present for expert 0\)"),
    ("llmc_gpt_oss_nvfp4", [f"layers.0.mlp.experts.{e}.down_proj.bias" for e in range(8)],
     "model.layers.0.mlp.experts.0.down_proj.bias: missing; gpt_oss experts add a bias to the down GEMM"),
    ("llmc_gpt_oss_nvfp4a16", [f"layers.0.mlp.experts.{e}.up_proj.bias" for e in range(6)],
     r"experts.0.up_proj.bias: missing \(the expert's gate_proj.bias is there"),
    ("llmc_gpt_oss_nvfp4", ["layers.0.mlp.router.bias"],
     "model.layers.0.mlp.router.bias: missing; gpt_oss routing adds the router's bias to the logits"),
    ("modelopt_gpt_oss_nvfp4", ["layers.0.mlp.experts.gate_up_proj_bias"],
     "model.layers.0.mlp.experts.gate_up_proj_bias: missing; gpt_oss experts add a bias to the gate/up GEMM"),
])
def test_a_missing_bias_fails_the_load_naming_it(tmp_path, name, drop, msg):
    d = _copy(name, tmp_path, drop)
    with pytest.raises(C.CheckpointError, match=msg):
        C.load(d, layer=0)


def test_biases_are_used_with_config_too(tmp_path):
    """config= (the architecture not read): every bias is still read and used, and a config that
    computes another activation is reported."""
    d = FIXTURES / "modelopt_gpt_oss_nvfp4"
    full = C.load(d, layer=1)
    other = C.load(d, layer=1, config=full.config.with_(swiglu_alpha=1.0, swiglu_up_shift=0.0))
    for f in ("b13", "b2", "router_logit_bias"):
        assert torch.equal(getattr(other.weights, f), getattr(full.weights, f)), f
    assert any("swiglu_alpha=1.0" in m and "'gpt_oss'" in m for m in other.report.warnings)
    assert other.report.w13_layout == "interleaved"  # the fused order still from config.json


def test_tensor_parallelism_refuses_gpt_oss(gen):
    from megamoe.distributed import load_tp_shard, tp_slice_weights

    with pytest.raises(C.CheckpointError, match="model_type='gpt_oss': tensor parallelism does not slice"):
        load_tp_shard(FIXTURES / "llmc_gpt_oss_nvfp4", 0, 2)
    w, _ = _layer_weights(gen)
    with pytest.raises(ValueError, match="does not slice expert biases"):
        tp_slice_weights(w, 0, 2)


def test_info_names_the_rule_and_every_bias(capsys):
    from megamoe.cli import main

    d = FIXTURES / "modelopt_gpt_oss_nvfp4"
    assert main(["info", "--checkpoint", str(d), "--layer", "1"]) == 0
    out = capsys.readouterr().out
    for word in ("layer config: config.json model_type 'gpt_oss'", "scoring=softmax_topk", "swiglu_alpha=1.702",
                 "swiglu_up_shift=1.0", "swiglu_limit=7.0", "router_logit_bias=True", "expert_biases=gate/up+down",
                 "w13 layout interleaved (gpt_oss fused gate_up_proj), the gate/up biases reordered with the rows",
                 "read: model.layers.1.mlp.router.bias: router bias (added to the logits, float32): bfloat16",
                 "read: model.layers.1.mlp.experts.gate_up_proj_bias: experts' gate/up biases",
                 "read: model.layers.1.mlp.experts.down_proj_bias: experts' down biases"):
        assert word in out, word


@pytest.mark.parametrize("name", ["modelopt_gpt_oss_nvfp4", "llmc_gpt_oss_nvfp4", "llmc_gpt_oss_nvfp4a16"])
def test_the_fixtures_make_every_piece_bite(name):
    """The recorded inputs push gate and up pre-activations past the clamp at 7 and the biases
    have real spread, so a forward without them would be measurably off
    (test_real_checkpoints.py::test_family_the_check_can_fail)."""
    for layer in (0, 1):
        loaded = C.load(FIXTURES / name, layer=layer)
        w, c = loaded.weights, loaded.config
        x = load_file(str(FIXTURES / name / "reference.safetensors"))[f"layers.{layer}.x"].float()
        _, ids = MoELayer(w, c, backend="torch").route(x)
        gate_over = up_over = 0
        for e in range(c.num_experts):
            rows = x[(ids == e).any(-1)]
            gu = rows @ nvfp4.dequantize(w.w13[e]).T + w.b13[e]
            gate_over += int((gu[:, :c.intermediate_size] > 7).sum())
            up_over += int((gu[:, c.intermediate_size:].abs() > 7).sum())
        assert gate_over > 0 and up_over > 0, (gate_over, up_over)
        assert float(w.b13.std()) > 0.5 and float(w.b2.std()) > 0.2 and float(w.router_logit_bias.std()) > 0.2
        assert math.isfinite(float(w.b13.abs().max()))


@pytest.mark.parametrize("name", ["modelopt_gpt_oss_nvfp4", "llmc_gpt_oss_nvfp4"])
def test_expert_parallel_shards_carry_their_experts_biases(name):
    """Under expert parallelism each rank reads its experts' biases with their weights (ModelOpt's
    fused [E, 2I] rows, compressed-tensors' per-expert tensors); the ranks' partial sums, each
    rank running only its experts, add up to the whole layer."""
    from megamoe.distributed import _expert_part, _local_config, load_shard

    d = FIXTURES / name
    full = C.load(d, layer=1)
    e, k = full.config.num_experts, full.config.top_k
    x = load_file(str(d / "reference.safetensors"))["layers.1.x"].float()
    layer = MoELayer(full.weights, full.config, backend="torch")
    w, ids = layer.route(x)
    whole = layer(x)
    for world in (2, 4):
        total = torch.zeros_like(whole)
        for rank in range(world):
            s = load_shard(d, rank, world, layer=1)
            a, b = s.expert_start, s.expert_start + e // world
            assert torch.equal(s.weights.b13, full.weights.b13[a:b]) and torch.equal(s.weights.b2, full.weights.b2[a:b])
            assert torch.equal(s.weights.router_logit_bias, full.weights.router_logit_bias)
            mine = (ids >= a) & (ids < b)
            local = torch.where(mine, ids - a, torch.full_like(ids, -1)).reshape(-1, 1)  # one slot a row
            rows = x.repeat_interleave(k, 0)
            cfg = _local_config(s.config, e // world)
            y = TorchBackend().moe_forward(_expert_part(s.weights), cfg, rows, local, w.reshape(-1, 1))
            total += y.view(-1, k, x.shape[1]).sum(1)
        assert cosine(total, whole) > 0.999999 and float((total - whole).abs().max() / whole.abs().max()) < 1e-5

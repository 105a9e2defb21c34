"""Checkpoint loading (docs/SPEC.md §3.4): ModelOpt and compressed-tensors per-expert layouts,
fused layouts and their gate/up order, routing from config.json, activation mode, input-scale
convention, synthetic checkpoints, and bad checkpoints named by tensor and expert. The
checkpoints written by the real producers are tested in tests/test_real_checkpoints.py."""
import json
import math
import re

import pytest
import torch
from safetensors.torch import load_file, save_file

from megamoe import checkpoint as C
from megamoe import nvfp4 as F
from megamoe.moe import MoELayer
from megamoe.presets import MoEConfig


def _proj_tensors(q: F.NVFP4Tensor, isc, naming: str) -> dict:
    """One projection's tensors in a producer's naming (global scales as divisors for
    compressed-tensors)."""
    gs = q.global_scale.reshape(())
    if naming == "compressed-tensors":
        t = {"weight_packed": q.data.contiguous(), "weight_scale": q.scale.contiguous(),
             "weight_global_scale": torch.reciprocal(gs).reshape(1)}
        if isc is not None:
            t["input_global_scale"] = torch.reciprocal(isc.reshape(())).reshape(1)
        return t
    t = {"weight": q.data.contiguous(), "weight_scale": q.scale.contiguous(), "weight_scale_2": gs.clone()}
    if isc is not None:
        t["input_scale"] = isc.reshape(()).clone()
    return t


def write_per_expert(folder, w, cfg, prefix="model.layers.0.mlp.", naming="modelopt", hf=None, quant="auto",
                     shared_nvfp4=False):
    """``w`` written the way ModelOpt / compressed-tensors export a per-expert MoE layer, with a
    config.json (``hf``) and the quantization config of ``quant`` ("auto": the naming's W4A4 or
    W4A16 by whether ``w`` has input scales; None: none)."""
    t = {}
    i = cfg.intermediate_size
    for e in range(cfg.num_experts):
        q13 = w.w13[e]
        for proj, rows, g in (("gate", slice(0, i), 0), ("up", slice(i, 2 * i), 1)):
            part = F.NVFP4Tensor(q13.data[rows], q13.scale[rows], q13.global_scale[g])
            isc = None if w.w13_input_scale is None else w.w13_input_scale[e]
            for k, v in _proj_tensors(part, isc, naming).items():
                t[f"{prefix}experts.{e}.{proj}_proj.{k}"] = v
        isc = None if w.w2_input_scale is None else w.w2_input_scale[e]
        for k, v in _proj_tensors(w.w2[e], isc, naming).items():
            t[f"{prefix}experts.{e}.down_proj.{k}"] = v
    if w.router_weight is not None:
        t[prefix + "gate.weight"] = w.router_weight
    if w.router_bias is not None:
        t[prefix + "gate.e_score_correction_bias"] = w.router_bias
    if w.shared_gate_up is not None:
        is_ = w.shared_gate_up.shape[0] // 2
        gu, down = w.shared_gate_up.float(), w.shared_down.float()
        for proj, mat in (("gate", gu[:is_]), ("up", gu[is_:]), ("down", down)):
            if shared_nvfp4:
                q = F.quantize(mat, F.default_global_scale(mat))
                src = w.w2_input_scale if proj == "down" else w.w13_input_scale
                isc = None if src is None else src.max()
                for k, v in _proj_tensors(q, isc, naming).items():
                    t[f"{prefix}shared_experts.{proj}_proj.{k}"] = v
            else:
                t[f"{prefix}shared_experts.{proj}_proj.weight"] = mat.to(torch.bfloat16).contiguous()
    folder.mkdir(parents=True, exist_ok=True)
    save_file(t, str(folder / "model.safetensors"))
    hf = dict(hf or {})
    a4 = w.w13_input_scale is not None
    if quant == "auto":
        quant = {"modelopt": "modelopt", "compressed-tensors": "ct"}[naming]
    if quant == "modelopt":
        (folder / "hf_quant_config.json").write_text(json.dumps(
            {"producer": {"name": "modelopt", "version": "test"},
             "quantization": {"quant_algo": "NVFP4" if a4 else "W4A16_NVFP4", "group_size": 16}}))
    elif quant == "ct":
        nv = {"num_bits": 4, "type": "float", "group_size": 16, "strategy": "tensor_group", "symmetric": True}
        hf["quantization_config"] = {
            "quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": dict(nv, dynamic=False),
                                          "input_activations": dict(nv, dynamic="local") if a4 else None}}}
    (folder / "config.json").write_text(json.dumps(hf))
    return folder


def deepseek_v3_config(cfg) -> dict:
    return {"model_type": "deepseek_v3", "hidden_size": cfg.hidden_size, "hidden_act": "silu",
            "n_routed_experts": cfg.num_experts, "num_experts_per_tok": cfg.top_k, "n_group": cfg.n_group,
            "topk_group": cfg.topk_group, "norm_topk_prob": cfg.renormalize,
            "routed_scaling_factor": cfg.routed_scaling_factor, "moe_intermediate_size": cfg.intermediate_size,
            "n_shared_experts": cfg.n_shared_experts}


V3_TINY = MoEConfig(64, 32, 6, 2, scoring="sigmoid", n_group=3, topk_group=2, routed_scaling_factor=2.5,
                    n_shared_experts=1, shared_intermediate_size=32)


@pytest.fixture
def tiny_ckpt(tmp_path):
    return C.write_synthetic(tmp_path / "tiny.safetensors", "tiny", seed=4)


def test_synthetic_round_trip(tiny_ckpt, gen):
    loaded = C.load(tiny_ckpt)
    assert loaded.config.hidden_size == 256 and loaded.config.top_k == 2
    assert loaded.report.quantized_at_load == []
    direct = C.synthetic_weights(loaded.config, seed=4)
    assert torch.equal(loaded.weights.w13.data, direct.w13.data)
    assert torch.equal(loaded.weights.w13.global_scale, direct.w13.global_scale)
    x = torch.randn(9, 256, generator=gen)
    a = MoELayer(loaded.weights, loaded.config, backend="torch")(x)
    b = MoELayer(direct, loaded.config, backend="torch")(x)
    assert torch.equal(a, b)


def test_synthetic_is_realistic(tiny_ckpt):
    w = C.load(tiny_ckpt).weights
    gs = w.w13.global_scale
    assert gs.shape == (8, 2)
    assert not torch.equal(gs[:, 0], gs[:, 1])  # gate/up differ (docs/FIELD_BUGS.md row 10)
    assert float((gs[:, 1] / gs[:, 0]).max() / (gs[:, 1] / gs[:, 0]).min()) > 2
    assert len(torch.unique(w.w2.global_scale)) == 8  # per-expert
    assert len(torch.unique(w.w13.scale.view(torch.uint8))) > 20  # scales vary (not uniform)
    assert w.w13_input_scale.shape == (8,) and bool((w.w13_input_scale > 0).all())


def test_gate_up_scales_kept_exact_10x_apart(tmp_path):
    t = load_file(str(C.write_synthetic(tmp_path / "a.safetensors", "tiny", seed=0)))
    t["w13_weight_scale_2"][:, 1] = t["w13_weight_scale_2"][:, 0] * 10
    save_file(t, str(tmp_path / "b.safetensors"), metadata={"megamoe.config": json.dumps(C.get_preset("tiny").to_dict())})
    w = C.load(tmp_path / "b.safetensors").weights
    assert torch.equal(w.w13.global_scale, t["w13_weight_scale_2"])


def test_per_expert_modelopt_layout_with_prefix(tmp_path, gen):
    cfg = MoEConfig(64, 32, 4, 2)
    w = C.synthetic_weights(cfg, seed=5)
    pre = "model.layers.3.mlp."
    write_per_expert(tmp_path, w, cfg, prefix=pre, hf={"model_type": "mixtral", "num_local_experts": 4,
                                                      "num_experts_per_tok": 2, "intermediate_size": 32})
    loaded = C.load(tmp_path)
    assert loaded.report.layout == "per-expert" and loaded.report.prefix == pre
    assert loaded.config.scoring == "softmax" and loaded.config.top_k == 2 and loaded.config.renormalize
    assert torch.equal(loaded.weights.w13.data, w.w13.data)
    assert torch.equal(loaded.weights.w13.global_scale, w.w13.global_scale)
    assert torch.equal(loaded.weights.w2.global_scale, w.w2.global_scale)
    x = torch.randn(5, 64, generator=gen)
    a = MoELayer(loaded.weights, loaded.config, backend="torch")(x)
    b = MoELayer(w, cfg, backend="torch")(x)
    assert torch.equal(a, b)


def test_bf16_expert_weights_are_quantized_and_reported(tmp_path, caplog):
    cfg = MoEConfig(64, 32, 2, 1)
    w = C.synthetic_weights(cfg, seed=0)
    t = {
        "w13_weight": F.dequantize(w.w13).to(torch.bfloat16),  # stored unquantized
        "w2_weight": w.w2.data, "w2_weight_scale": w.w2.scale, "w2_weight_scale_2": w.w2.global_scale,
    }
    save_file(t, str(tmp_path / "m.safetensors"), metadata={"megamoe.config": json.dumps(cfg.to_dict())})
    with caplog.at_level("WARNING"):
        loaded = C.load(tmp_path / "m.safetensors")
    assert loaded.report.quantized_at_load == ["w13_weight"]
    assert "quantized at load" in loaded.report.summary()
    assert "w13_weight" in caplog.text
    gs = loaded.weights.w13.global_scale
    assert gs.shape == (2, 2) and not torch.equal(gs[:, 0], gs[:, 1])


@pytest.fixture(scope="module")
def tiny_tensors(tmp_path_factory):
    """The tensors of one synthetic tiny checkpoint (made once per module: it is the slow part)."""
    return load_file(str(C.write_synthetic(tmp_path_factory.mktemp("tiny") / "ok.safetensors", "tiny", seed=0)))


def _broken(tmp_path, mutate, tensors=None):
    t = {k: v.clone() for k, v in tensors.items()} if tensors is not None else \
        load_file(str(C.write_synthetic(tmp_path / "ok.safetensors", "tiny", seed=0)))
    mutate(t)
    p = tmp_path / "bad.safetensors"
    save_file(t, str(p), metadata={"megamoe.config": json.dumps(C.get_preset("tiny").to_dict())})
    return p


@pytest.mark.parametrize("mutate,msg", [
    (lambda t: t.pop("w2_weight_scale"), "w2_weight_scale: missing"),
    (lambda t: t.pop("w13_weight_scale_2"), "w13_weight_scale_2: missing"),
    (lambda t: t.update(w13_weight_scale_2=t["w13_weight_scale_2"][:-1].contiguous()), "w13_weight_scale_2: shape"),
    (lambda t: t.update(w13_weight_scale_2=t["w13_weight_scale_2"].repeat(1, 2)), "w13_weight_scale_2: shape"),
    (lambda t: t.update(w2_weight_scale=t["w2_weight_scale"].float()), "w2_weight_scale: dtype"),
    (lambda t: t.update(w2_weight=t["w2_weight"][:, :, :-4].contiguous()), "w2_weight"),
    (lambda t: t.update(w13_weight=t["w13_weight"][:, :, :-4].contiguous(),
                        w13_weight_scale=t["w13_weight_scale"][:, :, :-1].contiguous()), "multiple of 16"),
    (lambda t: t.update(w13_weight=t["w13_weight"].to(torch.int32)), "w13_weight: dtype"),
    (lambda t: t.update({"gate.weight": t["gate.weight"][:3].contiguous()}), "gate.weight: shape"),
])
def test_bad_checkpoints_name_the_tensor(tmp_path, mutate, msg, tiny_tensors):
    with pytest.raises(C.CheckpointError, match=msg):
        C.load(_broken(tmp_path, mutate, tiny_tensors))


def test_missing_file_and_unknown_top_k(tmp_path, tiny_tensors):
    with pytest.raises(C.CheckpointError, match="no such checkpoint"):
        C.load(tmp_path / "nope.safetensors")
    t = tiny_tensors
    save_file(t, str(tmp_path / "nometa.safetensors"))
    # without megamoe's metadata nothing declares the fused gate/up order (docs/SPEC.md §3.3)
    with pytest.raises(C.CheckpointError, match="w13_layout"):
        C.load(tmp_path / "nometa.safetensors", top_k=2)
    with pytest.raises(C.CheckpointError, match="top_k"):
        C.load(tmp_path / "nometa.safetensors", w13_layout="gate-up")
    loaded = C.load(tmp_path / "nometa.safetensors", top_k=2, w13_layout="gate-up")
    assert loaded.config.top_k == 2 and loaded.config.act_mode == "w4a4"
    assert any("w13 layout gate-up (as asked)" in c for c in loaded.report.choices)


def test_write_is_atomic(tmp_path):
    p = C.write_synthetic(tmp_path / "a.safetensors", "tiny")
    assert p.exists() and not list(tmp_path.glob("*.partial"))


# ------------------------------------------------------------------------------------------
# formats, routing from config.json, activation mode
# ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("naming", ["modelopt", "compressed-tensors"])
@pytest.mark.parametrize("act", ["w4a4", "w4a16"])
def test_per_expert_formats_load_the_same_layer(tmp_path, gen, naming, act):
    w = C.synthetic_weights(V3_TINY, seed=7, static_input_scales=act == "w4a4")
    write_per_expert(tmp_path, w, V3_TINY, naming=naming, hf=deepseek_v3_config(V3_TINY))
    loaded = C.load(tmp_path)
    r = loaded.report
    assert r.format == naming and loaded.config.act_mode == act and r.act_mode.startswith(act)
    # the routing of deepseek_v3, with no scoring_func in config.json (transformers 5 writes none)
    c = loaded.config
    assert (c.scoring, c.n_group, c.topk_group, c.routed_scaling_factor, c.renormalize) == ("sigmoid", 3, 2, 2.5, True)
    assert any("scoring='sigmoid'" in ch and "no scoring_func" in ch for ch in r.choices)
    assert torch.equal(loaded.weights.w13.data, w.w13.data) and torch.equal(loaded.weights.w13.scale, w.w13.scale)
    if naming == "modelopt":
        assert torch.equal(loaded.weights.w13.global_scale, w.w13.global_scale)
    else:  # stored as divisors 1/gs: inverted at load (docs/FIELD_BUGS.md row 22), to the float32 rounding
        torch.testing.assert_close(loaded.weights.w13.global_scale, w.w13.global_scale, rtol=2e-7, atol=0)
        torch.testing.assert_close(loaded.weights.w2.global_scale, w.w2.global_scale, rtol=2e-7, atol=0)
        if act == "w4a4":
            torch.testing.assert_close(loaded.weights.w2_input_scale, w.w2_input_scale, rtol=2e-7, atol=0)
    x = torch.randn(24, 64, generator=gen)
    ref = MoELayer(w, V3_TINY.with_(act_mode=act), backend="torch")
    got = MoELayer(loaded.weights, loaded.config, backend="torch")
    assert torch.equal(got.route(x)[1], ref.route(x)[1])
    from _helpers import cosine
    assert cosine(got(x), ref(x)) > 0.99999


def test_compressed_tensors_divisor_multiplied_would_be_garbage(tmp_path):
    # docs/FIELD_BUGS.md row 22: a consumer multiplying by the stored divisor is off by ~gs^-2
    w = C.synthetic_weights(V3_TINY, seed=8)
    write_per_expert(tmp_path, w, V3_TINY, naming="compressed-tensors", hf=deepseek_v3_config(V3_TINY))
    stored = load_file(str(tmp_path / "model.safetensors"))["model.layers.0.mlp.experts.2.up_proj.weight_global_scale"]
    got = C.load(tmp_path).weights.w13.global_scale[2, 1]
    assert float(stored) > 100 and float(got) < 1e-2  # a divisor, and its inverse
    assert float(got) * float(stored) == pytest.approx(1.0, rel=1e-6)


@pytest.mark.parametrize("n_shared", [1, 2])
@pytest.mark.parametrize("shared", ["bf16", "nvfp4"])
@pytest.mark.parametrize("naming", ["modelopt", "compressed-tensors"])
def test_shared_expert_bf16_or_nvfp4(tmp_path, gen, shared, naming, n_shared):
    cfg = V3_TINY.with_(n_shared_experts=n_shared)  # 2: the shared expert is 2x wider than a routed one
    w = C.synthetic_weights(cfg, seed=9)
    write_per_expert(tmp_path, w, cfg, naming=naming, hf=deepseek_v3_config(cfg),
                     shared_nvfp4=shared == "nvfp4")
    loaded = C.load(tmp_path)
    assert loaded.report.shared_expert == ("nvfp4" if shared == "nvfp4" else "bfloat16")
    sw = loaded.weights.shared_gate_up
    x = torch.randn(16, 64, generator=gen)
    layer = MoELayer(loaded.weights, loaded.config, backend="torch")
    dense = layer._shared_expert(x)
    is_ = 32 * n_shared
    assert loaded.config.shared_intermediate_size * loaded.config.n_shared_experts == is_
    exact = (torch.nn.functional.silu(x @ w.shared_gate_up.float()[:is_].T) * (x @ w.shared_gate_up.float()[is_:].T)) \
        @ w.shared_down.float().T
    from _helpers import cosine
    if shared == "nvfp4":
        assert isinstance(sw, F.NVFP4Tensor) and sw.global_scale.shape == (2,)
        assert loaded.weights.shared_gate_up_input_scale is not None
        assert torch.equal(loaded.weights.shared_gate_up_input_scale.float(),
                           (w.w13_input_scale.max() if naming == "modelopt" else
                            torch.reciprocal(torch.reciprocal(w.w13_input_scale.max()))))
        # its activations are quantized like a routed expert's (the reference's functions),
        # its SwiGLU split at its own width
        from megamoe import reference
        c = loaded.config
        a1 = reference.activation_to_gemm_input(x.float(), c, loaded.weights.shared_gate_up_input_scale)
        hmid = reference.swiglu(a1 @ F.dequantize(sw).T, is_, c.swiglu_limit)
        a2 = reference.activation_to_gemm_input(hmid.float(), c, loaded.weights.shared_down_input_scale)
        torch.testing.assert_close(dense, a2 @ F.dequantize(loaded.weights.shared_down).T, rtol=1e-6, atol=1e-6)
        assert 0.95 < cosine(dense, exact) < 0.9999
        assert any("activations quantized with its own input scales" in c for c in loaded.report.choices)
        # the bf16 yardstick decodes the weights and skips activation quantization
        yard = layer._shared_expert(x, quantize_activations=False)
        assert not torch.equal(yard, dense)
    else:
        assert sw.dtype == torch.bfloat16
        torch.testing.assert_close(dense, exact, rtol=1e-5, atol=1e-5)


def test_input_scale_convention_per_expert_and_max(tmp_path, gen):
    """docs/SPEC.md §3.2 / docs/FIELD_BUGS.md row 18: per-expert scales are kept as stored; one
    value for all experts is broadcast; input_scales='max' reduces over all experts."""
    w = C.synthetic_weights(V3_TINY, seed=10)
    assert len(torch.unique(w.w13_input_scale)) == V3_TINY.num_experts  # distinct per expert
    write_per_expert(tmp_path / "per", w, V3_TINY, hf=deepseek_v3_config(V3_TINY))
    per = C.load(tmp_path / "per")
    assert torch.equal(per.weights.w13_input_scale, w.w13_input_scale)
    assert torch.equal(per.weights.w2_input_scale, w.w2_input_scale)
    assert per.report.input_scales == "per expert, as stored"
    mx = C.load(tmp_path / "per", input_scales="max")
    assert torch.equal(mx.weights.w13_input_scale, w.w13_input_scale.max().expand(6))
    assert torch.equal(mx.weights.w2_input_scale, w.w2_input_scale.max().expand(6))
    assert "max over all experts" in mx.report.input_scales
    x = torch.randn(32, 64, generator=gen)
    a = MoELayer(per.weights, per.config, backend="torch")(x)
    b = MoELayer(mx.weights, mx.config, backend="torch")(x)
    assert not torch.equal(a, b)  # the convention matters, so it is stated and reported
    # one value shared by the layer (TensorRT-LLM style), in the fused layout: broadcast
    t = load_file(str(C.write_synthetic(tmp_path / "f.safetensors", "tiny", seed=1)))
    t["w13_input_scale"] = t["w13_input_scale"].max().reshape(())
    t["w2_input_scale"] = t["w2_input_scale"].max().reshape(1)
    save_file(t, str(tmp_path / "shared.safetensors"), metadata={"megamoe.config": json.dumps(C.get_preset("tiny").to_dict())})
    sh = C.load(tmp_path / "shared.safetensors")
    assert torch.equal(sh.weights.w13_input_scale, t["w13_input_scale"].expand(8))
    assert "shared by all experts" in sh.report.input_scales
    with pytest.raises(C.CheckpointError, match="input_scales"):
        C.load(tmp_path / "per", input_scales="mean")


def test_unknown_architecture_and_format_refused(tmp_path):
    w = C.synthetic_weights(V3_TINY, seed=11)
    hf = deepseek_v3_config(V3_TINY)
    write_per_expert(tmp_path / "a", w, V3_TINY, hf=dict(hf, model_type="dbrx"))
    with pytest.raises(C.CheckpointError, match="model_type='dbrx'"):
        C.load(tmp_path / "a")
    # a known architecture whose routing has no use for one of the layer's tensors
    write_per_expert(tmp_path / "a2", w, V3_TINY, hf=dict(hf, model_type="llama4_text"))
    with pytest.raises(C.CheckpointError, match="gate.e_score_correction_bias: present but not used: llama4_text"):
        C.load(tmp_path / "a2")
    # explicit config: then the architecture need not be known
    assert C.load(tmp_path / "a", config=V3_TINY).config == V3_TINY
    write_per_expert(tmp_path / "b", w, V3_TINY, hf={k: v for k, v in hf.items() if k != "model_type"})
    with pytest.raises(C.CheckpointError, match="no model_type"):
        C.load(tmp_path / "b")
    write_per_expert(tmp_path / "c", w, V3_TINY, hf=dict(hf, scoring_func="softmax"))
    with pytest.raises(C.CheckpointError, match="scoring_func='softmax'"):
        C.load(tmp_path / "c")
    write_per_expert(tmp_path / "d", w, V3_TINY, hf=dict(hf, quantization_config={"quant_method": "gptq"}), quant=None)
    with pytest.raises(C.CheckpointError, match="quant_method='gptq'"):
        C.load(tmp_path / "d")
    write_per_expert(tmp_path / "e", w, V3_TINY, hf=hf)
    (tmp_path / "e" / "hf_quant_config.json").write_text(json.dumps({"quantization": {"quant_algo": "FP8"}}))
    with pytest.raises(C.CheckpointError, match="quant_algo='FP8'"):
        C.load(tmp_path / "e")
    write_per_expert(tmp_path / "f", w, V3_TINY, hf=dict(hf, hidden_act="gelu"))
    with pytest.raises(C.CheckpointError, match="hidden_act='gelu'"):
        C.load(tmp_path / "f")


def test_architecture_defaults_are_reported(tmp_path):
    w = C.synthetic_weights(V3_TINY.with_(n_group=8, topk_group=4, num_experts=8), seed=12)
    hf = {"model_type": "deepseek_v3", "hidden_size": 64, "n_routed_experts": 8, "moe_intermediate_size": 32,
          "num_experts_per_tok": 2}
    write_per_expert(tmp_path, w, V3_TINY.with_(num_experts=8), hf=hf)
    loaded = C.load(tmp_path)
    c = loaded.config
    assert (c.n_group, c.topk_group, c.routed_scaling_factor, c.renormalize, c.n_shared_experts) == (8, 4, 2.5, True, 1)
    text = loaded.report.summary()
    for key in ("n_group", "topk_group", "routed_scaling_factor", "norm_topk_prob"):
        assert f"architecture default; config.json has no {key}" in text


@pytest.mark.parametrize("quant,drop,msg", [
    ("modelopt", "input", "declares NVFP4 activations"),
    ("ct", "input", "declares NVFP4 activations"),
])
def test_activation_mode_must_match_the_quantization_config(tmp_path, quant, drop, msg):
    w = C.synthetic_weights(V3_TINY, seed=13)
    naming = "modelopt" if quant == "modelopt" else "compressed-tensors"
    write_per_expert(tmp_path, w, V3_TINY, naming=naming, hf=deepseek_v3_config(V3_TINY))
    t = load_file(str(tmp_path / "model.safetensors"))
    t = {k: v for k, v in t.items() if "input_" not in k}
    save_file(t, str(tmp_path / "model.safetensors"))
    with pytest.raises(C.CheckpointError, match=msg):
        C.load(tmp_path)


def test_weight_only_config_with_input_scales_refused(tmp_path):
    w = C.synthetic_weights(V3_TINY, seed=14)
    write_per_expert(tmp_path, w, V3_TINY, hf=deepseek_v3_config(V3_TINY))
    (tmp_path / "hf_quant_config.json").write_text(json.dumps({"quantization": {"quant_algo": "W4A16_NVFP4"}}))
    with pytest.raises(C.CheckpointError, match="W4A16"):
        C.load(tmp_path)


def test_layer_choice(tmp_path):
    w0 = C.synthetic_weights(V3_TINY, seed=15)
    w1 = C.synthetic_weights(V3_TINY, seed=16)
    write_per_expert(tmp_path / "x", w0, V3_TINY, prefix="model.layers.3.mlp.", hf=deepseek_v3_config(V3_TINY))
    write_per_expert(tmp_path / "y", w1, V3_TINY, prefix="model.layers.1.mlp.", hf=deepseek_v3_config(V3_TINY))
    t = load_file(str(tmp_path / "x" / "model.safetensors"))
    t.update(load_file(str(tmp_path / "y" / "model.safetensors")))
    save_file(t, str(tmp_path / "x" / "model.safetensors"))
    first = C.load(tmp_path / "x")
    assert first.report.prefix == "model.layers.1.mlp." and torch.equal(first.weights.w13.data, w1.w13.data)
    assert first.report.moe_layers == ["model.layers.1.mlp.", "model.layers.3.mlp."]
    third = C.load(tmp_path / "x", layer=3)
    assert torch.equal(third.weights.w13.data, w0.w13.data)
    assert C.load(tmp_path / "x", layer="model.layers.3.mlp").report.prefix == "model.layers.3.mlp."
    with pytest.raises(C.CheckpointError, match=r"layer 2: not a MoE layer .*layers\.1.*layers\.3"):
        C.load(tmp_path / "x", layer=2)


def test_hf_dense_fused_experts_quantized_at_load(tmp_path, gen):
    cfg = MoEConfig(64, 32, 4, 2)
    w = C.synthetic_weights(cfg, seed=17)
    t = {"model.layers.0.mlp.experts.gate_up_proj": F.dequantize(w.w13).to(torch.bfloat16),
         "model.layers.0.mlp.experts.down_proj": F.dequantize(w.w2).to(torch.bfloat16),
         "model.layers.0.mlp.gate.weight": w.router_weight}
    save_file(t, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3_moe", "num_experts": 4,
                                                      "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                                                      "norm_topk_prob": True}))
    loaded = C.load(tmp_path)
    r = loaded.report
    assert r.format == "hf-dense" and r.w13_layout == "gate-up"
    assert any("qwen3_moe fused gate_up_proj" in c for c in r.choices)
    assert r.quantized_at_load == ["model.layers.0.mlp.experts.gate_up_proj", "model.layers.0.mlp.experts.down_proj"]
    assert loaded.config.act_mode == "w4a16"  # no input scales and no quantization config
    from _helpers import cosine
    x = torch.randn(8, 64, generator=gen)
    ref = MoELayer(w, cfg.with_(act_mode="w4a16"), backend="torch")
    assert cosine(MoELayer(loaded.weights, loaded.config, backend="torch")(x), ref(x)) > 0.99


# ------------------------------------------------------------------------------------------
# the fused gate/up order (docs/SPEC.md §3.3, docs/FIELD_BUGS.md row 27)
# ------------------------------------------------------------------------------------------

def _fused_without_metadata(tmp_path, order: str, tensors):
    cfg = C.get_preset("tiny")
    t = {k: v.clone() for k, v in tensors.items()}
    gs = t["w13_weight_scale_2"]
    gs[:, 1] = gs[:, 0]  # one scale for both halves, so the interleaved order can hold it
    t["w13_weight_scale_2"] = gs[:, 0].contiguous()
    ref = dict(t)
    n = t["w13_weight"].shape[1]
    if order == "up-gate":
        perm = torch.cat([torch.arange(n // 2, n), torch.arange(n // 2)])
    elif order == "interleaved":
        perm = torch.stack([torch.arange(n // 2), torch.arange(n // 2, n)], 1).reshape(-1)
    else:
        perm = torch.arange(n)
    for k in ("w13_weight", "w13_weight_scale"):
        t[k] = t[k][:, perm].contiguous()
    save_file(t, str(tmp_path / f"{order}.safetensors"))
    save_file(ref, str(tmp_path / "ref.safetensors"), metadata={"megamoe.config": json.dumps(cfg.to_dict())})
    return tmp_path / f"{order}.safetensors", C.load(tmp_path / "ref.safetensors")


@pytest.mark.parametrize("order", ["gate-up", "up-gate", "interleaved"])
def test_w13_layout_declared_and_wrong_layout_fails_numerically(tmp_path, gen, order, tiny_tensors):
    path, ref = _fused_without_metadata(tmp_path, order, tiny_tensors)
    with pytest.raises(C.CheckpointError, match="w13_layout"):
        C.load(path, top_k=2)  # never guessed
    got = C.load(path, top_k=2, w13_layout=order)
    assert torch.equal(got.weights.w13.data, ref.weights.w13.data)
    assert torch.equal(got.weights.w13.scale.view(torch.uint8), ref.weights.w13.scale.view(torch.uint8))
    # 256 tokens and the mean of the per-token cosines: one token with a large output cannot carry the check
    # (with gate and up swapped the mean is 0.68-0.72 over seeds, with the interleaved order about 0)
    x = torch.randn(256, 256, generator=gen)
    good = MoELayer(ref.weights, ref.config, backend="torch")(x)
    assert torch.equal(MoELayer(got.weights, got.config, backend="torch")(x), good)
    for other in C.W13_LAYOUTS:
        if other == order:
            continue
        bad = C.load(path, top_k=2, w13_layout=other)
        per_token = torch.nn.functional.cosine_similarity(MoELayer(bad.weights, bad.config, backend="torch")(x), good,
                                                          dim=1)
        assert float(per_token.mean()) < 0.9, (other, float(per_token.mean()))


def test_w13_layout_refused_for_separate_gate_up(tmp_path):
    w = C.synthetic_weights(V3_TINY, seed=18)
    write_per_expert(tmp_path, w, V3_TINY, hf=deepseek_v3_config(V3_TINY))
    with pytest.raises(C.CheckpointError, match="separate"):
        C.load(tmp_path, w13_layout="interleaved")


# ------------------------------------------------------------------------------------------
# scales and per-expert tensors that would poison the output (docs/FIELD_BUGS.md row 17)
# ------------------------------------------------------------------------------------------

BAD_VALUES = [0.0, -0.5, math.nan, math.inf]


@pytest.mark.parametrize("value", BAD_VALUES)
@pytest.mark.parametrize("naming", ["modelopt", "compressed-tensors"])
@pytest.mark.parametrize("tensor", ["up_proj.global", "down_proj.input", "gate_proj.input"])
def test_bad_per_expert_scale_names_tensor_and_expert(tmp_path, value, naming, tensor):
    w = C.synthetic_weights(V3_TINY, seed=19)
    write_per_expert(tmp_path, w, V3_TINY, naming=naming, hf=deepseek_v3_config(V3_TINY))
    proj, kind = tensor.split(".")
    suffix = {("modelopt", "global"): "weight_scale_2", ("modelopt", "input"): "input_scale",
              ("compressed-tensors", "global"): "weight_global_scale",
              ("compressed-tensors", "input"): "input_global_scale"}[naming, kind]
    name = f"model.layers.0.mlp.experts.4.{proj}.{suffix}"
    t = load_file(str(tmp_path / "model.safetensors"))
    t[name] = torch.full_like(t[name], value)
    save_file(t, str(tmp_path / "model.safetensors"))
    with pytest.raises(C.CheckpointError, match=rf"{re.escape(name)}: .*expert 4"):
        C.load(tmp_path)


@pytest.mark.parametrize("value", BAD_VALUES)
@pytest.mark.parametrize("name,idx,part", [("w13_weight_scale_2", (3, 1), "expert 3 \\(up\\)"),
                                           ("w2_weight_scale_2", (5,), "expert 5"),
                                           ("w13_input_scale", (2,), "expert 2"),
                                           ("w2_input_scale", (7,), "expert 7")])
def test_bad_fused_scale_names_tensor_and_expert(tmp_path, value, name, idx, part, tiny_tensors):
    def mutate(t):
        t[name][idx] = value
    with pytest.raises(C.CheckpointError, match=rf"{name}: {part}"):
        C.load(_broken(tmp_path, mutate, tiny_tensors))


@pytest.mark.parametrize("naming", ["modelopt", "compressed-tensors"])
def test_tensor_missing_for_one_expert(tmp_path, naming):
    w = C.synthetic_weights(V3_TINY, seed=20)
    write_per_expert(tmp_path, w, V3_TINY, naming=naming, hf=deepseek_v3_config(V3_TINY))
    t0 = load_file(str(tmp_path / "model.safetensors"))
    gs = "weight_scale_2" if naming == "modelopt" else "weight_global_scale"
    isc = "input_scale" if naming == "modelopt" else "input_global_scale"
    cases = [f"model.layers.0.mlp.experts.5.up_proj.{gs}", f"model.layers.0.mlp.experts.2.down_proj.{isc}",
             "model.layers.0.mlp.experts.3.gate_proj.weight_scale", f"model.layers.0.mlp.experts.0.down_proj.{isc}"]
    for name in cases:
        save_file({k: v for k, v in t0.items() if k != name}, str(tmp_path / "model.safetensors"))
        expert = name.split(".experts.")[1].split(".")[0]
        with pytest.raises(C.CheckpointError, match=rf"{re.escape(name)}: missing.*expert {expert}"):
            C.load(tmp_path)
    # a whole expert missing in the middle, and one missing at the end (config says 6)
    for gone in (3, 5):
        save_file({k: v for k, v in t0.items() if f".experts.{gone}." not in k}, str(tmp_path / "model.safetensors"))
        with pytest.raises(C.CheckpointError, match=rf"model\.layers\.0\.mlp\.experts\.{gone}\.\*: .*missing"):
            C.load(tmp_path)


def test_scales_that_disagree_in_shape_between_experts(tmp_path):
    w = C.synthetic_weights(V3_TINY, seed=21)
    write_per_expert(tmp_path, w, V3_TINY, hf=deepseek_v3_config(V3_TINY))
    t0 = load_file(str(tmp_path / "model.safetensors"))
    name = "model.layers.0.mlp.experts.4.gate_proj.weight_scale_2"
    t = dict(t0)
    t[name] = t[name].reshape(1)
    save_file(t, str(tmp_path / "model.safetensors"))
    with pytest.raises(C.CheckpointError, match=rf"{re.escape(name)}: shape \(1,\) for expert 4, but expert 0 has \(\)"):
        C.load(tmp_path)
    t = dict(t0)
    t[name] = t[name].reshape(1).expand(2).contiguous()
    save_file(t, str(tmp_path / "model.safetensors"))
    with pytest.raises(C.CheckpointError, match=rf"{re.escape(name)}"):
        C.load(tmp_path)
    # a projection whose data and block scales are consistent but differ from the other experts
    t = dict(t0)
    for suf in ("weight", "weight_scale"):
        k = f"model.layers.0.mlp.experts.2.down_proj.{suf}"
        t[k] = t[k][:-16].contiguous()
    save_file(t, str(tmp_path / "model.safetensors"))
    with pytest.raises(C.CheckpointError, match=r"experts\.2\.down_proj\.weight: shape \(48, 16\) for expert 2, "
                                                r"but expert 0 has \(64, 16\)"):
        C.load(tmp_path)


def test_report_lists_every_choice(tmp_path):
    w = C.synthetic_weights(V3_TINY, seed=22)
    write_per_expert(tmp_path, w, V3_TINY, naming="compressed-tensors", hf=deepseek_v3_config(V3_TINY),
                     shared_nvfp4=True)
    text = C.load(tmp_path).report.summary()
    for word in ("format compressed-tensors", "routing: scoring='sigmoid'", "activations w4a4",
                 "input scales per expert", "shared expert nvfp4", "layer config: config.json model_type 'deepseek_v3'",
                 "w13 layout: separate gate/up tensors"):
        assert word in text, word


def test_sharded_checkpoint_reads_the_files_its_index_names(tmp_path):
    w = C.synthetic_weights(V3_TINY, seed=23)
    write_per_expert(tmp_path, w, V3_TINY, hf=deepseek_v3_config(V3_TINY))
    t = load_file(str(tmp_path / "model.safetensors"))
    (tmp_path / "model.safetensors").unlink()
    keys = sorted(t)
    half = {k: "model-00001-of-00002.safetensors" if i % 2 else "model-00002-of-00002.safetensors"
            for i, k in enumerate(keys)}
    for f in set(half.values()):
        save_file({k: t[k] for k in keys if half[k] == f}, str(tmp_path / f))
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": half}))
    # a stray file beside the shards (not in the index) is not read
    save_file({"model.layers.0.mlp.experts.9.gate_proj.weight": torch.zeros(32, 32, dtype=torch.uint8)},
              str(tmp_path / "stray.safetensors"))
    loaded = C.load(tmp_path)
    assert torch.equal(loaded.weights.w13.data, w.w13.data) and loaded.config.num_experts == 6
    (tmp_path / "model-00001-of-00002.safetensors").unlink()
    with pytest.raises(C.CheckpointError, match="model-00001-of-00002.safetensors: named by"):
        C.load(tmp_path)


def test_modelopt_fused_layout_needs_its_gate_up_order(tmp_path, gen):
    """A ModelOpt-labelled checkpoint in the fused layout (w13_weight ...): read, but the
    gate/up order of w13 must be declared (TensorRT-LLM fuses [up; gate], megamoe [gate; up])."""
    t = load_file(str(C.write_synthetic(tmp_path / "src.safetensors", "tiny", seed=5)))
    cfg = C.get_preset("tiny")
    d = tmp_path / "ckpt"
    d.mkdir()
    save_file({"model.layers.2.mlp." + k: v for k, v in t.items()}, str(d / "model.safetensors"))
    (d / "hf_quant_config.json").write_text(json.dumps({"quantization": {"quant_algo": "NVFP4"}}))
    (d / "config.json").write_text(json.dumps({"model_type": "mixtral", "num_local_experts": 8,
                                               "num_experts_per_tok": 2, "intermediate_size": 128}))
    with pytest.raises(C.CheckpointError, match="w13_layout"):
        C.load(d)
    got = C.load(d, w13_layout="gate-up")
    assert got.report.format == "modelopt" and got.report.layout == "fused" and got.config.act_mode == "w4a4"
    ref = C.load(tmp_path / "src.safetensors")
    x = torch.randn(8, 256, generator=gen)
    assert torch.equal(MoELayer(got.weights, got.config, backend="torch")(x),
                       MoELayer(ref.weights, cfg, backend="torch")(x))


def test_other_quantization_groups_and_fp8_weights(tmp_path):
    """A compressed-tensors config with a non-NVFP4 group for other layers still reads the NVFP4
    experts (the other group is reported); FP8 expert weights are refused, never 'quantized at
    load' without their scales."""
    w = C.synthetic_weights(V3_TINY, seed=24)
    write_per_expert(tmp_path, w, V3_TINY, naming="compressed-tensors", hf=deepseek_v3_config(V3_TINY))
    hf = json.loads((tmp_path / "config.json").read_text())
    hf["quantization_config"]["config_groups"]["group_1"] = {"format": "float-quantized", "targets": ["re:.*self_attn.*"],
                                                             "weights": {"num_bits": 8, "type": "float"}}
    (tmp_path / "config.json").write_text(json.dumps(hf))
    loaded = C.load(tmp_path)
    assert any("other groups not NVFP4: group_1 (float-quantized)" in c for c in loaded.report.choices)
    del hf["quantization_config"]["config_groups"]["group_0"]
    (tmp_path / "config.json").write_text(json.dumps(hf))
    with pytest.raises(C.CheckpointError, match="no 'nvfp4-pack-quantized' group"):
        C.load(tmp_path)
    t = load_file(str(tmp_path / "model.safetensors"))
    name = "model.layers.0.mlp.experts.1.up_proj.weight"
    for k in [k for k in t if ".experts.1.up_proj." in k]:
        del t[k]
    t[name] = torch.randn(32, 64).to(torch.float8_e4m3fn)
    t[name + "_scale"] = torch.ones(32, 1)
    save_file(t, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps(deepseek_v3_config(V3_TINY)))
    with pytest.raises(C.CheckpointError, match=rf"{re.escape(name)}: dtype torch.float8_e4m3fn: FP8"):
        C.load(tmp_path)


# ------------------------------------------------------------------------------------------
# every tensor of the layer is read, or the load fails naming it; the report says how each was read
# ------------------------------------------------------------------------------------------

def _v3_folder(tmp_path, seed=31, **write_kw):
    w = C.synthetic_weights(V3_TINY, seed=seed)
    return write_per_expert(tmp_path / "ck", w, V3_TINY, hf=deepseek_v3_config(V3_TINY), **write_kw), w


def _add_tensors(folder, extra: dict):
    t = load_file(str(folder / "model.safetensors"))
    t.update(extra)
    save_file(t, str(folder / "model.safetensors"))


@pytest.mark.parametrize("extra,why", [
    ("model.layers.0.mlp.shared_experts.gate_proj.bias",     # a bias the loader has no place for
     ": a tensor of the MoE layer .* does not read.*not these: .*shared_experts.gate_proj.bias"),
    ("model.layers.0.mlp.foo.weight", ": a tensor of the MoE layer .* does not read"),
    # names the loader reads in other families: beside this layer's own, refused all the same
    ("model.layers.0.mlp.router.weight", "gate.weight and .*router.weight: both present"),  # Llama 4's name
    ("model.layers.0.mlp.shared_expert.gate_proj.weight", ": two shared experts under two namings"),
    ("model.layers.0.mlp.shared_expert_gate.weight", r": .*expected an unquantized \[1, H\] gate"),
    ("model.layers.0.mlp.e_score_correction_bias", ": both present"),             # MiniMax-M2's bias name
])
@pytest.mark.parametrize("with_config", [False, True])
def test_a_tensor_the_loader_does_not_read_fails_the_load(tmp_path, extra, why, with_config):
    """Never a layer computed without one of its tensors: with or without config=."""
    folder, _ = _v3_folder(tmp_path)
    _add_tensors(folder, {extra: torch.ones(4, 64, dtype=torch.bfloat16)})
    kw = {"config": V3_TINY} if with_config else {}
    with pytest.raises(C.CheckpointError, match=why) as info:
        C.load(folder, **kw)
    assert extra.rpartition(".")[0] in str(info.value)  # named (a shared expert by its projection)
    # another layer's tensors are not this layer's
    folder2, _ = _v3_folder(tmp_path / "b")
    _add_tensors(folder2, {"model.layers.0.self_attn.o_proj.weight": torch.ones(4, 4),
                           "model.layers.1.mlp.gate.weight": torch.ones(6, 64)})
    C.load(folder2, **kw)


def test_the_report_lists_every_tensor_read_and_how(tmp_path):
    folder, _ = _v3_folder(tmp_path, naming="compressed-tensors", shared_nvfp4=True)
    r = C.load(folder).report
    names = set(load_file(str(folder / "model.safetensors")))
    assert set(r.read_as) == names  # every tensor of the (one-layer) file, each with how it was read
    p = "model.layers.0.mlp."
    assert r.read_as[p + "experts.3.up_proj.weight_packed"] == "expert 3 up weights: NVFP4 (packed E2M1, two values a byte)"
    assert r.read_as[p + "experts.3.up_proj.weight_global_scale"].startswith(
        "expert 3 up global scale (stored as a divisor; inverted)")
    assert "the larger of gate's and up's" in r.read_as[p + "experts.0.gate_proj.input_global_scale"]
    assert r.read_as[p + "gate.e_score_correction_bias"].startswith("correction bias (added to the scores for selection only)")
    assert r.read_as[p + "shared_experts.down_proj.weight_packed"].startswith("shared expert down weights: NVFP4")
    text = r.summary()
    assert f"read: {p}experts.{{0..5}}.gate_proj.weight_packed: experts' gate weights: NVFP4" in text
    assert text.count("read: ") == len({re.sub(r"experts\.\d+\.", "experts.N.", n) for n in names})


def test_layer_choice_wording(tmp_path):
    w = C.synthetic_weights(V3_TINY, seed=5)
    folder = write_per_expert(tmp_path / "two", w, V3_TINY, hf=deepseek_v3_config(V3_TINY))
    t = load_file(str(folder / "model.safetensors"))
    t.update({k.replace("layers.0.", "layers.1."): v.clone() for k, v in t.items()})
    save_file(t, str(folder / "model.safetensors"))
    assert "layer 'model.layers.0.mlp.' (the first MoE layer; the checkpoint has 2 MoE layers)" in \
        C.load(folder).report.choices
    assert "layer 'model.layers.1.mlp.' (layer=1; the checkpoint has 2 MoE layers)" in C.load(folder, layer=1).report.choices
    assert not any("as asked of" in c for c in C.load(folder).report.choices)


# ------------------------------------------------------------------------------------------
# expert counts from the tensors, config.json as a cross-check; glm4_moe; deepseek_v4 naming
# ------------------------------------------------------------------------------------------

QWEN_TINY = MoEConfig(64, 32, 8, 2, scoring="softmax", renormalize=True)


@pytest.mark.parametrize("key", ["num_local_experts", "num_experts"])
def test_qwen3_moe_expert_count_from_the_tensors(tmp_path, key):
    w = C.synthetic_weights(QWEN_TINY, seed=8)
    hf = {"model_type": "qwen3_moe", key: 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
          "norm_topk_prob": True}
    loaded = C.load(write_per_expert(tmp_path / "ok", w, QWEN_TINY, hf=hf))
    assert loaded.config.num_experts == 8 and loaded.config.renormalize
    assert f"routing: num_experts=8 (config.json {key})" in loaded.report.choices
    # config.json stating no count: the tensors decide (the architecture's default of 128 is not used)
    hf_none = {k: v for k, v in hf.items() if k != key}
    loaded = C.load(write_per_expert(tmp_path / "none", w, QWEN_TINY, hf=hf_none))
    assert loaded.config.num_experts == 8
    assert any(c.startswith("num_experts=8 (the tensors; config.json states none") for c in loaded.report.choices)
    # a count config.json states that the tensors contradict: a true message naming the key
    with pytest.raises(C.CheckpointError, match=rf"experts\.8\.\*: missing \(config\.json {key}=128, the "
                                                rf"checkpoint has experts 0\.\.7\)"):
        C.load(write_per_expert(tmp_path / "more", w, QWEN_TINY, hf={**hf, key: 128}))
    with pytest.raises(C.CheckpointError, match=rf"config\.json {key}=4 but the tensors .* have num_experts=8"):
        C.load(write_per_expert(tmp_path / "fewer", w, QWEN_TINY, hf={**hf, key: 4}))


def test_glm4_moe_loads_with_deepseek_v3_routing(tmp_path):
    cfg = V3_TINY.with_(routed_scaling_factor=1.5)
    w = C.synthetic_weights(cfg, seed=9)
    hf = {**deepseek_v3_config(cfg), "model_type": "glm4_moe"}
    loaded = C.load(write_per_expert(tmp_path / "glm", w, cfg, hf=hf))
    assert loaded.config == cfg.with_(act_mode=loaded.config.act_mode)
    assert "layer config: config.json model_type 'glm4_moe'" in loaded.report.choices
    x = torch.randn(16, 64)
    torch.testing.assert_close(MoELayer(loaded.weights, loaded.config, backend="torch")(x),
                               MoELayer(w, loaded.config, backend="torch")(x), rtol=0, atol=0)
    nobias = write_per_expert(tmp_path / "nobias", C.MoEWeights(**{**w.__dict__, "router_bias": None}), cfg, hf=hf)
    with pytest.raises(C.CheckpointError, match="gate.e_score_correction_bias: missing; glm4_moe routing"):
        C.load(nobias)


V4_TINY = MoEConfig(64, 32, 6, 2, scoring="sqrtsoftplus", routed_scaling_factor=1.5, n_shared_experts=1,
                    shared_intermediate_size=32, swiglu_limit=10.0)


def _v4_folder(tmp_path, layer_kind: str, upstream: bool):
    """A DeepSeek-V4 layer as a tool writes it: transformers names (ModelOpt) or DeepSeek's
    upstream ones (llmcompressor: experts.E.w1/w3/w2, gate.bias, shared_experts.w1/w3/w2)."""
    cfg = V4_TINY.with_(hash_routing=layer_kind == "hash_moe")
    w = C.synthetic_weights(cfg, seed=12)
    hf = {"model_type": "deepseek_v4", "n_routed_experts": 6, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
          "routed_scaling_factor": 1.5, "swiglu_limit": 10.0, "mlp_layer_types": [layer_kind]}
    naming = "compressed-tensors" if upstream else "modelopt"
    folder = write_per_expert(tmp_path / f"{layer_kind}-{naming}", w, cfg, hf=hf, naming=naming)
    t = load_file(str(folder / "model.safetensors"))
    if w.tid2eid is not None:
        t["model.layers.0.mlp.gate.tid2eid"] = w.tid2eid.contiguous()
    if upstream:
        ren = {"gate_proj.": "w1.", "up_proj.": "w3.", "down_proj.": "w2.", "gate.e_score_correction_bias": "gate.bias"}
        new = {}
        for k, v in t.items():
            k = k.replace(".mlp.", ".ffn.")
            for a, b in ren.items():
                k = k.replace(a, b)
            new[k] = v
        t = new
    save_file(t, str(folder / "model.safetensors"))
    return folder, w, cfg


@pytest.mark.parametrize("upstream", [False, True], ids=["transformers-names", "upstream-names"])
@pytest.mark.parametrize("kind", ["hash_moe", "moe"])
def test_deepseek_v4_layer_from_the_folder(tmp_path, kind, upstream):
    folder, w, cfg = _v4_folder(tmp_path, kind, upstream)
    loaded = C.load(folder)
    assert loaded.config == cfg.with_(act_mode=loaded.config.act_mode)
    assert loaded.report.prefix == ("model.layers.0.ffn." if upstream else "model.layers.0.mlp.")
    x = torch.randn(12, 64) * 3
    ids = torch.randint(0, w.tid2eid.shape[0], (12,)) if cfg.hash_routing else None
    tol = 1e-5 if upstream else 0  # compressed-tensors stores the global scales as divisors
    torch.testing.assert_close(MoELayer(loaded.weights, loaded.config, backend="torch")(x, input_ids=ids),
                               MoELayer(w, cfg, backend="torch")(x, input_ids=ids), rtol=tol, atol=tol)


def test_deepseek_v4_router_tensors_must_match_the_layer_kind(tmp_path):
    # config.json says top-k, the file holds a hash table: the table would be ignored
    folder, w, _ = _v4_folder(tmp_path, "hash_moe", False)
    hf = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**hf, "mlp_layer_types": ["moe"]}))
    with pytest.raises(C.CheckpointError, match="gate.e_score_correction_bias: missing; deepseek_v4 routing selects"):
        C.load(folder)
    _add_tensors(folder, {"model.layers.0.mlp.gate.e_score_correction_bias": torch.zeros(6)})
    with pytest.raises(C.CheckpointError, match="gate.tid2eid: present but not used"):
        C.load(folder)
    # and the caller's config routing by top-k does not drop it either
    with pytest.raises(C.CheckpointError, match="gate.tid2eid: present but not used"):
        C.load(folder, config=V4_TINY)
    # config.json says hash, the table is missing
    folder, _, _ = _v4_folder(tmp_path / "b", "moe", False)
    hf = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**hf, "mlp_layer_types": ["hash_moe"]}))
    with pytest.raises(C.CheckpointError, match="gate.tid2eid: missing; deepseek_v4 routing chooses the experts by "
                                                "token id"):
        C.load(folder)
    # a top-k layer without its correction bias
    folder, _, _ = _v4_folder(tmp_path / "c", "moe", True)
    t = load_file(str(folder / "model.safetensors"))
    del t["model.layers.0.ffn.gate.bias"]
    save_file(t, str(folder / "model.safetensors"))
    with pytest.raises(C.CheckpointError, match="gate.e_score_correction_bias: missing; deepseek_v4 routing"):
        C.load(folder)
    # both names of the bias at once
    folder, w, _ = _v4_folder(tmp_path / "d", "moe", False)
    _add_tensors(folder, {"model.layers.0.mlp.gate.bias": w.router_bias})
    with pytest.raises(C.CheckpointError, match="gate.e_score_correction_bias and .*gate.bias: both present"):
        C.load(folder)


@pytest.mark.parametrize("what", ["experts", "router"])
def test_biases_an_architecture_has_no_place_for_fail_the_load_and_config_uses_them(tmp_path, what):
    """Expert biases (every expert's gate, up and down) or a router bias in a deepseek_v3 layer: the
    architecture computes without them, so the load fails naming one; with config= the layer
    is computed with them (never dropped)."""
    folder, _ = _v3_folder(tmp_path)
    e = V3_TINY.num_experts
    if what == "experts":
        extra = {f"model.layers.0.mlp.experts.{i}.{p}.bias": torch.full((n,), 0.5, dtype=torch.bfloat16)
                 for i in range(e) for p, n in (("gate_proj", 32), ("up_proj", 32), ("down_proj", 64))}
        name = "model.layers.0.mlp.experts.0.gate_proj.bias: present but not used: deepseek_v3 experts have no biases"
    else:
        extra = {"model.layers.0.mlp.router.bias": torch.full((e,), 0.5, dtype=torch.bfloat16)}
        name = "model.layers.0.mlp.router.bias: present but not used: deepseek_v3 routing adds no bias"
    _add_tensors(folder, extra)
    with pytest.raises(C.CheckpointError, match=re.escape(name)):
        C.load(folder)
    got = C.load(folder, config=V3_TINY)
    if what == "experts":
        assert torch.equal(got.weights.b13, torch.full((e, 64), 0.5))
        assert torch.equal(got.weights.b2, torch.full((e, 64), 0.5))
        assert got.weights.router_logit_bias is None
    else:
        assert torch.equal(got.weights.router_logit_bias, torch.full((e,), 0.5))
        assert got.weights.b13 is None and got.weights.b2 is None
    assert all(n in got.report.tensors for n in extra)

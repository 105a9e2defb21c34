"""ModelOpt checkpoint loading, synthetic checkpoints, and bad checkpoints."""
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from megamoe import checkpoint as C
from megamoe import nvfp4 as F
from megamoe.moe import MoELayer
from megamoe.presets import MoEConfig


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
    assert not torch.equal(gs[:, 0], gs[:, 1])  # gate/up differ (FIELD_BUGS 10)
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
    t = {pre + "gate.weight": w.router_weight}
    for e in range(4):
        for proj, q, gs_idx in (("gate", w.w13[e], 0), ("up", w.w13[e], 1)):
            rows = slice(0, 32) if proj == "gate" else slice(32, 64)
            t[f"{pre}experts.{e}.{proj}_proj.weight"] = q.data[rows].contiguous()
            t[f"{pre}experts.{e}.{proj}_proj.weight_scale"] = q.scale[rows].contiguous()
            t[f"{pre}experts.{e}.{proj}_proj.weight_scale_2"] = w.w13.global_scale[e, gs_idx].clone()
            t[f"{pre}experts.{e}.{proj}_proj.input_scale"] = w.w13_input_scale[e].clone()
        t[f"{pre}experts.{e}.down_proj.weight"] = w.w2.data[e].contiguous()
        t[f"{pre}experts.{e}.down_proj.weight_scale"] = w.w2.scale[e].contiguous()
        t[f"{pre}experts.{e}.down_proj.weight_scale_2"] = w.w2.global_scale[e].clone()
        t[f"{pre}experts.{e}.down_proj.input_scale"] = w.w2_input_scale[e].clone()
    save_file(t, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps({"num_experts_per_tok": 2, "scoring_func": "softmax"}))
    loaded = C.load(tmp_path)
    assert loaded.report.layout == "per-expert" and loaded.report.prefix == pre
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


def _broken(tmp_path, mutate):
    t = load_file(str(C.write_synthetic(tmp_path / "ok.safetensors", "tiny", seed=0)))
    mutate(t)
    p = tmp_path / "bad.safetensors"
    save_file(t, str(p), metadata={"megamoe.config": json.dumps(C.get_preset("tiny").to_dict())})
    return p


@pytest.mark.parametrize("mutate,msg", [
    (lambda t: t.pop("w2_weight_scale"), "w2_weight_scale: missing"),
    (lambda t: t.pop("w13_weight_scale_2"), "w13_weight_scale_2: missing"),
    (lambda t: t.update(w13_weight_scale_2=t["w13_weight_scale_2"][:, 0].contiguous()), "w13_weight_scale_2: shape"),
    (lambda t: t.update(w2_weight_scale=t["w2_weight_scale"].float()), "w2_weight_scale: dtype"),
    (lambda t: t.update(w2_weight=t["w2_weight"][:, :, :-4].contiguous()), "w2_weight"),
    (lambda t: t.update(w13_weight=t["w13_weight"][:, :, :-4].contiguous(),
                        w13_weight_scale=t["w13_weight_scale"][:, :, :-1].contiguous()), "multiple of 16"),
    (lambda t: t.update(w13_weight=t["w13_weight"].to(torch.int32)), "w13_weight: dtype"),
    (lambda t: t.update({"gate.weight": t["gate.weight"][:3].contiguous()}), "gate.weight: shape"),
])
def test_bad_checkpoints_name_the_tensor(tmp_path, mutate, msg):
    with pytest.raises(C.CheckpointError, match=msg):
        C.load(_broken(tmp_path, mutate))


def test_missing_file_and_unknown_top_k(tmp_path):
    with pytest.raises(C.CheckpointError, match="no such checkpoint"):
        C.load(tmp_path / "nope.safetensors")
    t = load_file(str(C.write_synthetic(tmp_path / "x.safetensors", "tiny")))
    save_file(t, str(tmp_path / "nometa.safetensors"))
    with pytest.raises(C.CheckpointError, match="top_k"):
        C.load(tmp_path / "nometa.safetensors")
    assert C.load(tmp_path / "nometa.safetensors", top_k=2).config.top_k == 2


def test_write_is_atomic(tmp_path):
    p = C.write_synthetic(tmp_path / "a.safetensors", "tiny")
    assert p.exists() and not list(tmp_path.glob("*.partial"))

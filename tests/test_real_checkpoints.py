"""Checkpoints written by the real producers (tests/fixtures/real, made by
scripts/make_real_fixtures.py): NVIDIA ModelOpt 0.47 and llmcompressor 0.14 /
compressed-tensors 0.19 on tiny random Hugging Face DeepseekV3 models (8 or 6 experts,
top-2/3, group-limited sigmoid routing with a correction bias, one shared expert, 2 MoE
layers). Each fixture holds the tool's own forward of each MoE layer on the hidden states
that reach it (bf16 as the tool runs, and the same calibrated model in float32), the
transformers router's choice, and activation bytes from the tool's own NVFP4 quantizer.

The loader gets the folder alone: format, routing, activation mode, layer and shared expert
all come from the checkpoint (docs/SPEC.md §3.4).
"""
from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from megamoe import checkpoint as C
from megamoe import nvfp4
from megamoe.moe import MoELayer
from megamoe.routing import InputIdsRequired

from _helpers import cosine

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "tests" / "fixtures" / "real"
ALL = sorted(d for d in FIXTURES.iterdir() if (d / "fixture.json").exists()) if FIXTURES.exists() else []


def _spec(d: Path) -> dict:
    return json.loads((d / "fixture.json").read_text())


def _arch(d: Path) -> str:
    return _spec(d)["spec"].get("arch", "deepseek_v3")


# DeepSeek-V3's router (tests in this part): deepseek_v3 and GLM-4.5 MoE (glm4_moe)
CKPTS = [d for d in ALL if _arch(d) in ("deepseek_v3", "glm4_moe")]
V4_CKPTS = [d for d in ALL if _arch(d) == "deepseek_v4"]  # DeepSeek-V4 (the part below)
CASES = [pytest.param(d, layer, id=f"{d.name}-layer{layer}") for d in CKPTS for layer in (0, 1)]


def _ref(d: Path, layer: int) -> dict:
    pre = f"layers.{layer}."
    return {k[len(pre):]: v for k, v in load_file(str(d / "reference.safetensors")).items() if k.startswith(pre)}


def _is_ct_w4a4(d: Path) -> bool:
    s = _spec(d)
    return s["producer"] == "llmcompressor" and s["spec"]["scheme"] == "NVFP4"


def test_the_fixtures_are_there():
    names = {d.name for d in CKPTS}
    assert {"modelopt_nvfp4", "modelopt_nvfp4_shared_bf16", "llmc_nvfp4", "llmc_nvfp4a16"} <= names
    assert {"modelopt_glm4_nvfp4", "llmc_glm4_nvfp4"} <= names
    assert {"modelopt_v4_nvfp4", "llmc_v4_nvfp4", "llmc_v4_nvfp4a16"} <= {d.name for d in V4_CKPTS}
    for d in ALL:
        size = sum(f.stat().st_size for f in d.iterdir() if f.is_file())
        assert size < 700 * 2**10, f"{d.name} is {size} bytes: keep each fixture small"
    total = sum(f.stat().st_size for f in FIXTURES.rglob("*") if f.is_file())
    assert total < 14 * 2**20, f"fixtures are {total} bytes: keep them small"


@pytest.mark.parametrize("d,layer", CASES)
def test_fixture_loads_from_the_folder_alone(d, layer):
    spec = _spec(d)
    s = spec["spec"]
    loaded = C.load(d, layer=layer)
    r, c = loaded.report, loaded.config
    assert r.format == {"nvidia-modelopt": "modelopt", "llmcompressor": "compressed-tensors"}[spec["producer"]]
    assert r.prefix == f"model.layers.{layer}.mlp." and r.moe_layers == ["model.layers.0.mlp.", "model.layers.1.mlp."]
    assert c.act_mode == ("w4a4" if s["scheme"] == "NVFP4" else "w4a16")
    assert (loaded.weights.w13_input_scale is not None) == (c.act_mode == "w4a4")
    assert r.shared_expert == ("nvfp4" if s["shared"] == "nvfp4" else "bfloat16")
    assert (c.num_experts, c.top_k, c.n_group, c.topk_group, c.renormalize, c.routed_scaling_factor) == \
        (s["experts"], s["top_k"], s["n_group"], s["topk_group"], s["norm_topk_prob"], s["routed_scaling_factor"])
    assert c.scoring == "sigmoid" and loaded.weights.router_bias is not None and c.n_shared_experts == 1
    assert (c.hidden_size, c.intermediate_size) == (128, 64)
    assert r.quantized_at_load == []
    # the correction bias has a spread (the fixture script gives it one) and the gate/up
    # magnitudes differ per expert, so the interesting cases occur
    assert float(loaded.weights.router_bias.std()) > 0.01
    if spec["producer"] == "llmcompressor" and c.act_mode == "w4a4":
        assert len(torch.unique(loaded.weights.w2_input_scale)) > 1  # calibrated per expert
    text = r.summary()
    assert "no scoring_func" in text and f"layer config: config.json model_type '{_arch(d)}'" in text


@pytest.mark.parametrize("d,layer", CASES)
def test_routing_matches_transformers(d, layer):
    """The router transformers runs for this model (recorded) and megamoe's, from config.json
    alone: same experts for every token, same weights."""
    loaded = C.load(d, layer=layer)
    ref = _ref(d, layer)
    m = MoELayer(loaded.weights, loaded.config, backend="torch")
    logits = ref["x"].float() @ loaded.weights.router_weight.float().T
    torch.testing.assert_close(logits, ref["router_logits"], rtol=1e-5, atol=1e-5)
    w, ids = m.route(ref["x"])
    order = ids.long().sort(-1)
    order_ref = ref["topk_ids"].long().sort(-1)
    assert torch.equal(order.values, order_ref.values)
    torch.testing.assert_close(w.gather(1, order.indices), ref["topk_weights"].gather(1, order_ref.indices),
                               rtol=1e-5, atol=1e-6)
    # and the routing matters here: softmax scores (what the loader built before config.json
    # was read) pick other experts for some tokens
    soft = C.load(d, layer=layer, scoring="softmax")
    _, ids_soft = MoELayer(soft.weights, soft.config, backend="torch").route(ref["x"])
    assert not torch.equal(ids_soft.long().sort(-1).values, order_ref.values)


@pytest.mark.parametrize("d,layer", CASES)
def test_forward_matches_the_tool(d, layer):
    """megamoe's layer (torch backend, float32 math, docs/SPEC.md §3) against the tool's own
    forward of the same MoE block.

    Against the tool's forward of the calibrated model in float32 (float32 in, float32 out),
    W4A4 agrees to float32 rounding (max error 1e-6 of the output's largest value): the same
    quantized weights, the same activation bytes (in float32 compressed-tensors' block
    scales agree with megamoe's too), the same routing; what is left is float32 summation
    order. W4A16: cosine >= 0.999995, the rest being megamoe's W4A16 rounding activations to
    bf16 (docs/SPEC.md §3, what a bf16 kernel consumes), which the tool's float32 copy does not.

    Against the tool as it runs (bf16 model) the cosine is what the tool's own bf16
    arithmetic costs it: the tool rounds every GEMM output, the SwiGLU product and each
    expert's contribution to bf16, and it quantizes the second GEMM's input from that bf16
    SwiGLU product (megamoe from float32), so an element near an E2M1 rounding boundary can
    land on the other side. That is shown by megamoe's cosine to the bf16 forward equalling
    the tool's own bf16-vs-float32 cosine to within 3e-4. It is >= 0.999 for ModelOpt and for
    weight-only compressed-tensors; for compressed-tensors W4A4 the tool's bf16 forward is
    only ~0.998 from its own float32 forward, because its activation quantizer also divides
    the block amax by 6 in bf16 before the global scale (the bytes test shows it).
    """
    loaded = C.load(d, layer=layer)
    ref = _ref(d, layer)
    m = MoELayer(loaded.weights, loaded.config, backend="torch")
    y32 = m(ref["x"].float())
    assert y32.dtype == torch.float32 and torch.isfinite(y32).all()
    if loaded.config.act_mode == "w4a4":
        err = float((y32 - ref["y_fp32"]).abs().max() / ref["y_fp32"].abs().max())
        assert err < 1e-6, err
    else:
        assert cosine(y32, ref["y_fp32"]) >= 0.999995
    y = m(ref["x"]).float()  # bf16 in, bf16 out, as the tool runs
    c32 = cosine(y, ref["y_fp32"])
    c16 = cosine(y, ref["y"])
    tool_own = cosine(ref["y"], ref["y_fp32"])
    assert c32 >= 0.99999, (c32, c16, tool_own)
    assert abs(c16 - tool_own) < 3e-4, (c16, tool_own)
    assert c16 >= (0.997 if _is_ct_w4a4(d) else 0.999), (c16, tool_own)


@pytest.mark.parametrize("d,layer", CASES)
def test_the_check_can_fail(d, layer):
    """The same comparison with the faults the field had: softmax routing for a sigmoid
    model (issue: cosine 0.72), the compressed-tensors divisor used as a multiplier
    (docs/FIELD_BUGS.md row 22), gate/up rows swapped (row 27)."""
    loaded = C.load(d, layer=layer)
    ref = _ref(d, layer)
    y32 = ref["y_fp32"]
    soft = C.load(d, layer=layer, scoring="softmax", n_group=None, topk_group=None)
    assert cosine(MoELayer(soft.weights, soft.config, backend="torch")(ref["x"]), y32) < 0.999
    w = loaded.weights
    inv = C.MoEWeights(**{**w.__dict__, "w13": nvfp4.NVFP4Tensor(w.w13.data, w.w13.scale, 1 / w.w13.global_scale)})
    out = MoELayer(inv, loaded.config, backend="torch")(ref["x"]).float()
    assert not torch.isfinite(out).all() or cosine(out, y32) < 0.999
    i = loaded.config.intermediate_size
    perm = torch.cat([torch.arange(i, 2 * i), torch.arange(i)])
    sw = C.MoEWeights(**{**w.__dict__, "w13": nvfp4.NVFP4Tensor(w.w13.data[:, perm], w.w13.scale[:, perm],
                                                                   w.w13.global_scale.flip(-1))})
    assert cosine(MoELayer(sw, loaded.config, backend="torch")(ref["x"]), y32) < 0.99


def _codes(data: torch.Tensor) -> torch.Tensor:
    """E2M1 codes of packed bytes with negative zero (code 8) read as zero: ModelOpt's and
    compressed-tensors' packers set the sign bit of a negative value that rounds to 0; megamoe
    writes code 0 (docs/SPEC.md §1). Both decode to 0."""
    c = nvfp4.unpack_codes(data)
    return torch.where(c == 8, torch.zeros_like(c), c)


W4A4 = [p for p in CASES if _spec(p.values[0])["spec"]["scheme"] == "NVFP4"]


@pytest.mark.parametrize("d,layer", W4A4)
@pytest.mark.parametrize("which", ["act1", "act2"])
def test_activation_bytes_match_the_tool(d, layer, which):
    """megamoe's NVFP4 quantizer (``nvfp4.quantize`` with the input scale the loader read for
    that expert) against the tool's own quantize function on the same GEMM input (ModelOpt
    ``NVFP4QTensor.quantize``; compressed-tensors ``quantize`` + ``pack_fp4_to_uint8``; run
    by the fixture script).

    ModelOpt: identical block scales and codes. compressed-tensors: it computes a block
    scale as ``e4m3(g * bf16(amax / 6))`` with ``g`` the stored divisor, dividing the bf16
    block amax by 6 in bf16 (8 significant bits) where megamoe computes ``amax / (6 * gs)``
    in float32; the two differ by one e4m3 step where ``amax / 6`` lies within bf16's rounding
    of an e4m3 rounding midpoint (a few % of the blocks). The test checks that every
    differing block scale is exactly the tool's formula, that they are few, and that every
    code of every other block is identical.
    """
    loaded = C.load(d, layer=layer)
    ref = _ref(d, layer)
    e = int(ref[f"{which}.expert"])
    inp = ref["x"] if which == "act1" else ref["act2.input"]
    scale = (loaded.weights.w13_input_scale if which == "act1" else loaded.weights.w2_input_scale)[e]
    q = nvfp4.quantize(inp.float(), scale)
    got_s, tool_s = q.scale.view(torch.uint8), ref[f"{which}.scale"].view(torch.uint8)
    got_c, tool_c = _codes(q.data), _codes(ref[f"{which}.data"])
    if not _is_ct_w4a4(d):
        assert torch.equal(scale, ref[f"{which}.global_scale"])  # the exported input_scale, as is
        assert torch.equal(got_s, tool_s)
        assert torch.equal(got_c, tool_c)
        return
    g = ref[f"{which}.global_scale_divisor"]
    assert float(scale) == float(torch.reciprocal(g))  # the divisor, inverted at load (row 22)
    blocks = inp.reshape(inp.shape[0], -1, 16)
    amax = blocks.abs().amax(-1)  # bf16, as the tool has it
    # (g as a 1-element tensor, as the tool holds it: a 0-d one would make the product bf16)
    tool_formula = (g.reshape(1) * (amax / torch.tensor(6.0, dtype=amax.dtype))).clamp(max=448).to(torch.float8_e4m3fn)
    assert torch.equal(tool_formula.view(torch.uint8), tool_s)  # the explanation reproduces the tool
    differ = got_s != tool_s
    assert int(differ.sum()) <= 0.06 * differ.numel(), int(differ.sum())
    same_block = ~differ.repeat_interleave(16, dim=-1)
    assert torch.equal(got_c[same_block], tool_c[same_block])
    if which == "act1":  # compressed-tensors quantizes gate and up inputs apart: same scale, same bytes
        assert torch.equal(ref["act1.up_scale"].view(torch.uint8), tool_s)
        assert torch.equal(_codes(ref["act1.up_data"]), tool_c)


# ------------------------------------------------------------------------------------------
# regenerating the fixtures with the producers (opt-in, slow)
# ------------------------------------------------------------------------------------------

REGEN_ENV = "MEGAMOE_REAL_FIXTURE_PYTHONS"


def _producer_pythons() -> dict[str, str]:
    """``{"modelopt": python, "llmcompressor": python}`` from the env var (interpreters
    separated by ``os.pathsep``), keeping those that can import their producer."""
    found = {}
    for py in filter(None, os.environ.get(REGEN_ENV, "").split(os.pathsep)):
        for mod in ("modelopt", "llmcompressor"):
            ok = subprocess.run([py, "-c", f"import {mod}"], capture_output=True).returncode == 0
            if ok and mod not in found:
                found[mod] = py
    return found


@pytest.mark.slow
def test_regenerated_fixtures_are_identical(tmp_path):
    """Opt-in (several minutes): set MEGAMOE_REAL_FIXTURE_PYTHONS to the interpreters of a
    venv with nvidia-modelopt[hf] and one with llmcompressor (``:``-separated). The script
    then rebuilds every fixture; checkpoints and references must equal the committed ones
    tensor for tensor."""
    pythons = _producer_pythons()
    if not pythons:
        pytest.skip(f"{REGEN_ENV} names no interpreter that can import modelopt or llmcompressor")
    script = ROOT / "scripts" / "make_real_fixtures.py"
    out = tmp_path / "out"
    for producer, py in sorted(pythons.items()):
        res = subprocess.run([py, str(script), producer, "--out", str(out), "--work", str(tmp_path / "work")],
                             capture_output=True, text=True, timeout=3000)
        assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    made = sorted(p for p in out.iterdir() if p.is_dir())
    assert made
    for d in made:
        committed = FIXTURES / d.name
        for f in ("model.safetensors", "reference.safetensors"):
            a, b = load_file(str(d / f)), load_file(str(committed / f))
            assert a.keys() == b.keys(), (d.name, f)
            for k in a:
                assert a[k].dtype == b[k].dtype, (d.name, f, k)
                assert torch.equal(a[k].reshape(-1).view(torch.uint8), b[k].reshape(-1).view(torch.uint8)), (d.name, f, k)


def test_info_prints_what_the_loader_decided(capsys):
    """``megamoe info --checkpoint DIR [--layer N]``: format, layer, routing, activation mode,
    input scales, w13 layout, shared expert, what was quantized at load."""
    from megamoe.cli import main

    d = FIXTURES / "llmc_nvfp4"
    assert main(["info", "--checkpoint", str(d), "--layer", "1"]) == 0
    out = capsys.readouterr().out
    for word in ("compressed-tensors", "layer 'model.layers.1.mlp.'", "scoring=sigmoid", "n_group=4",
                 "activations: w4a4", "input scales: per expert", "shared expert: nvfp4", "quantized at load: none",
                 "choice: routing: scoring='sigmoid' (deepseek_v3; config.json has no scoring_func)"):
        assert word in out, word
    assert main(["info", "--checkpoint", str(d), "--layer", "7"]) == 1
    assert "layer 7: not a MoE layer" in capsys.readouterr().err


def test_serve_settings_choose_the_layer():
    """``megamoe serve --checkpoint DIR --layer N``: the service loads that MoE layer (default:
    the first), from the folder alone."""
    pytest.importorskip("pydantic_settings")
    from megamoe.service.model import load_layer
    from megamoe.service.settings import parse_settings

    d = FIXTURES / "modelopt_nvfp4"
    ref = _ref(d, 1)
    s = parse_settings(["--checkpoint", str(d), "--layer", "1", "--backend", "torch", "--device", "cpu"])
    layer = load_layer(s)
    assert layer.load_report.prefix == "model.layers.1.mlp."
    assert cosine(layer(ref["x"]), ref["y_fp32"]) >= 0.99999
    first = load_layer(parse_settings(["--checkpoint", str(d), "--backend", "torch", "--device", "cpu"]))
    assert first.load_report.prefix == "model.layers.0.mlp."
    with pytest.raises(C.CheckpointError, match="layer 4: not a MoE layer"):
        load_layer(parse_settings(["--checkpoint", str(d), "--layer", "4", "--backend", "torch"]))


@pytest.mark.parametrize("d", CKPTS, ids=[d.name for d in CKPTS])
def test_expert_parallel_shards_of_real_checkpoints(d):
    """Under expert parallelism each rank's shard of a real checkpoint (docs/FIELD_BUGS.md
    row 19): every per-expert tensor, input scales included, is that rank's slice of the
    whole load; the router and the shared expert whole."""
    from megamoe.distributed import load_shard

    full = C.load(d, layer=1)
    e = full.config.num_experts
    for world in (2, e // 2):
        for rank in range(world):
            s = load_shard(d, rank, world, layer=1)
            a, b = s.expert_start, s.expert_start + e // world
            w, fw = s.weights, full.weights
            assert torch.equal(w.w13.data, fw.w13.data[a:b]) and torch.equal(w.w2.scale.view(torch.uint8),
                                                                              fw.w2.scale[a:b].view(torch.uint8))
            assert torch.equal(w.w13.global_scale, fw.w13.global_scale[a:b])
            assert torch.equal(w.w2.global_scale, fw.w2.global_scale[a:b])
            if fw.w13_input_scale is not None:
                assert torch.equal(w.w13_input_scale, fw.w13_input_scale[a:b])
                assert torch.equal(w.w2_input_scale, fw.w2_input_scale[a:b])
            assert torch.equal(w.router_weight, fw.router_weight) and s.config == full.config
            for name in ("shared_gate_up", "shared_down"):  # bf16 tensors or NVFP4Tensor: whole
                mine, whole = getattr(w, name), getattr(fw, name)
                if isinstance(whole, nvfp4.NVFP4Tensor):
                    mine, whole = mine.data, whole.data
                assert torch.equal(mine, whole), name


# ------------------------------------------------------------------------------------------
# DeepSeek-V4: a hash-routed layer (0) and a top-k layer (1), from ModelOpt (transformers
# names) and llmcompressor (DeepSeek's upstream names: ffn.experts.E.w1/w3/w2, ffn.gate.bias),
# W4A4 and W4A16; sqrt(softplus) scores, SwiGLU clamped at swiglu_limit (biting on some rows)
# ------------------------------------------------------------------------------------------

V4_CASES = [pytest.param(d, layer, id=f"{d.name}-layer{layer}") for d in V4_CKPTS for layer in (0, 1)]


def _v4(d: Path, layer: int):
    loaded = C.load(d, layer=layer)
    return loaded, _ref(d, layer), MoELayer(loaded.weights, loaded.config, backend="torch")


def _rel_norm(y: torch.Tensor, ref: torch.Tensor) -> float:
    return abs(float(y.double().norm() / ref.double().norm()) - 1.0)


@pytest.mark.parametrize("d,layer", V4_CASES)
def test_v4_loads_from_the_folder_alone(d, layer):
    spec = _spec(d)
    s = spec["spec"]
    loaded = C.load(d, layer=layer)
    r, c, w = loaded.report, loaded.config, loaded.weights
    hashed = layer == 0  # config.json mlp_layer_types = ["hash_moe", "moe"]
    ffn = "mlp" if spec["producer"] == "nvidia-modelopt" else "ffn"  # llmcompressor: upstream names
    assert r.prefix == f"model.layers.{layer}.{ffn}."
    assert r.format == {"nvidia-modelopt": "modelopt", "llmcompressor": "compressed-tensors"}[spec["producer"]]
    assert (c.scoring, c.hash_routing, c.n_group, c.renormalize) == ("sqrtsoftplus", hashed, None, True)
    assert (c.num_experts, c.top_k, c.routed_scaling_factor, c.swiglu_limit) == \
        (s["experts"], s["top_k"], s["routed_scaling_factor"], s["swiglu_limit"])
    assert (c.n_shared_experts, c.shared_intermediate_size, c.hidden_size, c.intermediate_size) == (1, 64, 128, 64)
    assert c.act_mode == ("w4a4" if s["scheme"] == "NVFP4" else "w4a16")
    assert r.shared_expert == ("nvfp4" if s["shared"] == "nvfp4" else "bfloat16")
    assert r.quantized_at_load == []
    with C.open_checkpoint(d) as ck:
        if hashed:
            table = ck.get(r.prefix + "gate.tid2eid")
            assert w.router_bias is None and torch.equal(w.tid2eid, table.long())
            assert tuple(table.shape) == (128, s["top_k"])
        else:
            bias = ck.get(r.prefix + ("gate.e_score_correction_bias" if ffn == "mlp" else "gate.bias"))
            assert w.tid2eid is None and torch.equal(w.router_bias, bias.float())
            assert float(w.router_bias.std()) > 0.02  # spread (it changes choices: the router test)
        # every tensor of the layer was read, and the report says how
        layer_names = {n for n in ck.names() if n.startswith(r.prefix)}
    assert set(r.read_as) == layer_names
    text = r.summary()
    kind = "hash_moe" if hashed else "moe"
    assert f"hash_routing={hashed} ({kind}, config.json mlp_layer_types[{layer}])" in text
    assert f"swiglu_limit={s['swiglu_limit']} (config.json swiglu_limit)" in text
    assert ("hash table: the experts of each token id" in text) == hashed
    assert "layer config: config.json model_type 'deepseek_v4'" in text


@pytest.mark.parametrize("d,layer", V4_CASES)
def test_v4_router_choice_equals_the_models(d, layer):
    """The experts megamoe's router picks, from the folder alone, equal those of the model's
    router (transformers' DeepseekV4HashRouter / DeepseekV4TopKRouter, float32 copy) on every
    token; the weights too."""
    loaded, ref, m = _v4(d, layer)
    x, ids_in = ref["x"].float(), ref["input_ids"]
    logits = x @ loaded.weights.router_weight.float().T
    torch.testing.assert_close(logits, ref["router_logits_fp32"], rtol=1e-5, atol=1e-5)
    w, ids = m.route(x, input_ids=ids_in)
    got, want = ids.long().sort(-1), ref["topk_ids_fp32"].long().sort(-1)
    assert torch.equal(got.values, want.values)  # every token
    torch.testing.assert_close(w.gather(1, got.indices), ref["topk_weights_fp32"].gather(1, want.indices),
                               rtol=1e-5, atol=1e-6)
    if layer == 0:
        with C.open_checkpoint(d) as ck:
            table = ck.get(loaded.report.prefix + "gate.tid2eid")
        assert torch.equal(ids.long(), table[ids_in].long())  # tid2eid[input_ids], in the table's order
        with pytest.raises(InputIdsRequired, match="input_ids"):
            m(x)
    else:
        # the correction bias decides some choices here
        nb = C.MoEWeights(**{**loaded.weights.__dict__, "router_bias": None})
        _, ids_nb = MoELayer(nb, loaded.config, backend="torch").route(x)
        assert not torch.equal(ids_nb.long().sort(-1).values, want.values)


@pytest.mark.parametrize("d,layer", V4_CASES)
def test_v4_forward_matches_the_tools_float32_forward(d, layer):
    """megamoe's layer (torch backend) against the tool's own forward of the calibrated model
    in float32 (routed experts + shared expert, both clamped): cosine >= 0.99999 and the
    output norm within 0.1%. W4A4 agrees to float32 rounding. The clamp bites here: the same
    layer without it is measurably off."""
    loaded, ref, m = _v4(d, layer)
    x, ids_in, y_ref = ref["x"].float(), ref["input_ids"], ref["y_fp32"]
    y = m(x, input_ids=ids_in)
    assert y.dtype == torch.float32 and torch.isfinite(y).all()
    assert cosine(y, y_ref) >= 0.99999, cosine(y, y_ref)
    assert _rel_norm(y, y_ref) < 1e-3, _rel_norm(y, y_ref)
    if loaded.config.act_mode == "w4a4":
        err = float((y - y_ref).abs().max() / y_ref.abs().max())
        assert err < 1e-6, err
    unclamped = MoELayer(loaded.weights, loaded.config.with_(swiglu_limit=None), backend="torch")(x, input_ids=ids_in)
    assert cosine(unclamped, y_ref) < 0.9999
    # bf16 in and out, as the tool runs: the residual to the tool's bf16 forward is the tool's
    # own bf16 arithmetic (its bf16 forward is that far from its float32 one)
    yb = m(ref["x"], input_ids=ids_in).float()
    c32, c16, tool_own = cosine(yb, y_ref), cosine(yb, ref["y"]), cosine(ref["y"], y_ref)
    assert c32 >= 0.99999, (c32, c16, tool_own)
    assert abs(c16 - tool_own) < 3e-4, (c16, tool_own)


@pytest.mark.parametrize("d,layer", V4_CASES)
def test_v4_the_check_can_fail(d, layer):
    """The same comparison catches the faults a loader could make: sigmoid scores for
    sqrt(softplus), no routed_scaling_factor (cosine can stay high; the norm does not), and a
    hash layer routed by top-k."""
    loaded, ref, _ = _v4(d, layer)
    x, ids_in, y_ref = ref["x"].float(), ref["input_ids"], ref["y_fp32"]

    def run(**kw):
        return MoELayer(loaded.weights, loaded.config.with_(**kw), backend="torch")(x, input_ids=ids_in)

    assert cosine(run(scoring="sigmoid"), y_ref) < 0.99999
    assert _rel_norm(run(routed_scaling_factor=1.0), y_ref) > 1e-3
    if layer == 0:
        topk = C.MoEWeights(**{**loaded.weights.__dict__, "tid2eid": None})
        y = MoELayer(topk, loaded.config.with_(hash_routing=False), backend="torch")(x)
        assert cosine(y, y_ref) < 0.999


@pytest.mark.parametrize("d", V4_CKPTS, ids=[d.name for d in V4_CKPTS])
def test_v4_expert_parallel_shards(d):
    """Under expert parallelism each rank's shard of a V4 layer holds its experts' slices and
    the hash table whole (its ids are global)."""
    from megamoe.distributed import load_shard

    full = C.load(d, layer=0)
    e = full.config.num_experts
    for rank in range(2):
        s = load_shard(d, rank, 2, layer=0)
        a, b = s.expert_start, s.expert_start + e // 2
        assert torch.equal(s.weights.w13.data, full.weights.w13.data[a:b])
        assert torch.equal(s.weights.tid2eid, full.weights.tid2eid) and s.config == full.config


@pytest.mark.parametrize("d", V4_CKPTS, ids=[d.name for d in V4_CKPTS])
def test_v4_tensor_parallel_slices_read_from_the_files(d):
    """Under tensor parallelism each rank reads its slice of every expert and of the shared
    expert (in either naming: gate_proj/up_proj/down_proj or upstream w1/w3/w2) from the
    files; it equals the slice of the whole layer, and the slices' outputs sum to the layer's."""
    from megamoe.distributed import load_tp_shard, tp_local_config, tp_slice_weights

    for layer in (0, 1):
        full = C.load(d, layer=layer)
        ref = _ref(d, layer)
        x, ids_in = ref["x"].float(), ref["input_ids"]
        total = torch.zeros_like(ref["y_fp32"])
        for rank in range(2):
            s = load_tp_shard(d, rank, 2, layer=layer)
            want = tp_slice_weights(full.weights, rank, 2)
            for name in ("w13", "w2", "shared_gate_up", "shared_down"):
                a, b = getattr(s.weights, name), getattr(want, name)
                if isinstance(b, nvfp4.NVFP4Tensor):
                    assert torch.equal(a.data, b.data) and torch.equal(a.scale.view(torch.uint8), b.scale.view(torch.uint8))
                    assert torch.equal(a.global_scale, b.global_scale), name
                else:
                    assert torch.equal(a, b), name
            assert torch.equal(s.weights.router_weight, full.weights.router_weight)
            local = MoELayer(s.weights, tp_local_config(full.config, 2), backend="torch")
            total += local(x, input_ids=ids_in)
        assert cosine(total, ref["y_fp32"]) >= 0.99999
        assert _rel_norm(total, ref["y_fp32"]) < 1e-3


def test_info_names_the_architecture_the_rule_and_every_tensor_read(capsys):
    """``megamoe info --checkpoint DIR --layer N`` on a DeepSeek-V4 checkpoint (llmcompressor,
    upstream names): the architecture, where each routing value came from, and every tensor
    of the layer with how it was read."""
    from megamoe.cli import main

    d = FIXTURES / "llmc_v4_nvfp4"
    assert main(["info", "--checkpoint", str(d), "--layer", "0"]) == 0
    out = capsys.readouterr().out
    p = "model.layers.0.ffn."
    for word in ("layer config: config.json model_type 'deepseek_v4'",
                 "hash_routing=True (hash_moe, config.json mlp_layer_types[0])",
                 "scoring='sqrtsoftplus' (config.json scoring_func)", "swiglu_limit=10.0 (config.json swiglu_limit)",
                 f"read: {p}gate.tid2eid: hash table: the experts of each token id: int64",
                 f"read: {p}gate.weight: router weight",
                 f"read: {p}experts.{{0..7}}.w1.weight_packed: experts' gate weights: NVFP4",
                 f"read: {p}experts.{{0..7}}.w2.input_global_scale: experts' down input scale (stored as a divisor; "
                 f"inverted)",
                 f"read: {p}shared_experts.w3.weight_packed: shared expert up weights: NVFP4"):
        assert word in out, word
    with C.open_checkpoint(d) as ck:
        groups = {re.sub(r"experts\.\d+\.", "experts.N.", n) for n in ck.names() if n.startswith(p)}
    assert out.count("  read: ") == len(groups)


# ------------------------------------------------------------------------------------------
# Kimi-K2.5, MiniMax-M2, Qwen2-MoE, Llama 4, gpt-oss: each family from both tools, from the folder alone
# ------------------------------------------------------------------------------------------

#: family -> the layer prefix each tool writes (N = the layer number)
FAMILY_PREFIX = {
    ("kimi_k25", "nvidia-modelopt"): "model.language_model.layers.{}.mlp.",
    ("kimi_k25", "llmcompressor"): "language_model.model.blocks.{}.mlp.",
    ("minimax_m2", "nvidia-modelopt"): "model.layers.{}.block_sparse_moe.",
    ("minimax_m2", "llmcompressor"): "model.layers.{}.block_sparse_moe.",
    ("qwen2_moe", "nvidia-modelopt"): "model.layers.{}.mlp.",
    ("qwen2_moe", "llmcompressor"): "model.layers.{}.mlp.",
    ("llama4_text", "nvidia-modelopt"): "model.layers.{}.feed_forward.",
    ("llama4_text", "llmcompressor"): "model.layers.{}.feed_forward.",
    ("gpt_oss", "nvidia-modelopt"): "model.layers.{}.mlp.",
    ("gpt_oss", "llmcompressor"): "model.layers.{}.mlp.",
}
FAMILY_CKPTS = [d for d in ALL if _arch(d) in {a for a, _ in FAMILY_PREFIX}]
FAMILY_CASES = [pytest.param(d, layer, id=f"{d.name}-layer{layer}") for d in FAMILY_CKPTS for layer in (0, 1)]


def test_every_family_has_fixtures_from_both_tools():
    have = {(_arch(d), _spec(d)["producer"], _spec(d)["spec"]["scheme"]) for d in FAMILY_CKPTS}
    for arch in ("kimi_k25", "minimax_m2", "qwen2_moe", "llama4_text", "gpt_oss"):
        assert {(arch, "nvidia-modelopt", "NVFP4"), (arch, "llmcompressor", "NVFP4"),
                (arch, "llmcompressor", "NVFP4A16")} <= have, arch


def _family(d: Path, layer: int):
    loaded = C.load(d, layer=layer)
    return loaded, _ref(d, layer), MoELayer(loaded.weights, loaded.config, backend="torch")


@pytest.mark.parametrize("d,layer", FAMILY_CASES)
def test_family_loads_from_the_folder_alone(d, layer):
    """Format, layer prefix, routing and shared expert from the folder alone; every tensor of the
    layer read (the report names each and how)."""
    spec = _spec(d)
    s, arch = spec["spec"], _arch(d)
    loaded = C.load(d, layer=layer)
    r, c = loaded.report, loaded.config
    assert r.format == {"nvidia-modelopt": "modelopt", "llmcompressor": "compressed-tensors"}[spec["producer"]]
    prefix = FAMILY_PREFIX[(arch, spec["producer"])]
    assert r.prefix == prefix.format(layer) and r.moe_layers == [prefix.format(0), prefix.format(1)]
    assert c.act_mode == ("w4a4" if s["scheme"] == "NVFP4" else "w4a16")
    assert (c.num_experts, c.top_k, c.hidden_size, c.intermediate_size) == (s["experts"], s["top_k"], 128, 64)
    assert r.quantized_at_load == [] and r.warnings == [] or all("near-tie" in w or "saturates" in w
                                                                for w in r.warnings)
    assert f"layer config: config.json model_type '{arch}'" in r.summary()
    with C.open_checkpoint(d) as ck:
        names = {n for n in ck.names() if n.startswith(r.prefix)}
    assert set(r.read_as) == names  # every tensor of the layer, each with how it was read
    want_shared = {"none": "none", "nvfp4": "nvfp4", "bf16": "bfloat16"}[s["shared"]]
    assert r.shared_expert == want_shared
    if arch == "kimi_k25":
        assert c.scoring == "sigmoid" and loaded.weights.router_bias is not None and c.n_shared_experts == 1
        assert (c.n_group, c.topk_group, c.renormalize, c.routed_scaling_factor) == \
            (s["n_group"], s["topk_group"], s["norm_topk_prob"], s["routed_scaling_factor"])
        assert "config.json text_config.n_routed_experts" in r.summary()
    elif arch == "minimax_m2":
        assert (c.scoring, c.renormalize, c.routed_scaling_factor, c.n_shared_experts, c.n_group) == \
            ("sigmoid", True, 1.0, 0, None)
        assert float(loaded.weights.router_bias.std()) > 0.01  # the block-level bias, spread
        assert f"{r.prefix}e_score_correction_bias" in r.read_as
    elif arch == "qwen2_moe":
        assert (c.scoring, c.renormalize, c.routed_scaling_factor, c.n_shared_experts, c.shared_expert_gate) == \
            ("softmax", s["norm_topk_prob"], 1.0, 1, True)
        assert c.shared_intermediate_size == 96  # shared_expert_intermediate_size, its own width
        assert r.read_as[f"{r.prefix}shared_expert_gate.weight"].startswith("shared expert gate")
    elif arch == "gpt_oss":
        assert (c.scoring, c.renormalize, c.routed_scaling_factor, c.n_shared_experts, c.n_group) == \
            ("softmax_topk", True, 1.0, 0, None)
        assert (c.swiglu_limit, c.swiglu_alpha, c.swiglu_up_shift) == (7.0, 1.702, 1.0)
        w = loaded.weights
        e = c.num_experts
        assert w.b13.shape == (e, 128) and w.b2.shape == (e, 128) and w.router_logit_bias.shape == (e,)
        assert w.b13.dtype == w.b2.dtype == w.router_logit_bias.dtype == torch.float32
        assert r.read_as[f"{r.prefix}router.bias"].startswith("router bias (added to the logits")
        if spec["producer"] == "nvidia-modelopt":  # fused, transposed, gate/up interleaved
            assert r.layout.startswith("modelopt fused transposed") and r.w13_layout == "interleaved"
            assert "the gate/up biases reordered with the rows" in r.summary()
            assert r.read_as[f"{r.prefix}experts.gate_up_proj_bias"].startswith("experts' gate/up biases")
        else:
            assert r.read_as[f"{r.prefix}experts.0.up_proj.bias"].startswith("expert 0 up bias")
    else:
        assert (c.scoring, c.renormalize, c.routed_scaling_factor, c.n_shared_experts, c.router_weight_on_input) == \
            ("sigmoid", False, 1.0, 1, True)
        if spec["producer"] == "nvidia-modelopt":  # fused and transposed, packed along H
            assert r.layout.startswith("modelopt fused transposed") and r.w13_layout == "gate-up"
            assert r.read_as[f"{r.prefix}experts.gate_up_proj"].endswith("transposed at load")


@pytest.mark.parametrize("d,layer", FAMILY_CASES)
def test_family_router_choice_equals_the_models(d, layer):
    """The experts megamoe's router picks, from the folder alone, equal those of the model's
    router (transformers' module of the family) on every token; the weights too."""
    loaded, ref, m = _family(d, layer)
    x = ref["x"]
    logits = x.float() @ loaded.weights.router_weight.float().T
    if loaded.weights.router_logit_bias is not None:  # gpt-oss: the router's bias
        logits = logits + loaded.weights.router_logit_bias
    torch.testing.assert_close(logits, ref["router_logits"].float(), rtol=2e-2, atol=2e-2)  # (bf16 logits)
    if "topk_ids_fp32" in ref:  # gpt-oss: transformers routes in the model's dtype; the float32 model's choice
        torch.testing.assert_close(logits, ref["router_logits_fp32"], rtol=1e-5, atol=1e-5)
        ref = {**ref, "topk_ids": ref["topk_ids_fp32"], "topk_weights": ref["topk_weights_fp32"]}
    w, ids = m.route(x)
    got, want = ids.long().sort(-1), ref["topk_ids"].long().sort(-1)
    assert torch.equal(got.values, want.values)  # every token
    torch.testing.assert_close(w.gather(1, got.indices), ref["topk_weights"].float().gather(1, want.indices),
                               rtol=1e-2, atol=2e-3)  # (the model returns bf16 weights)


@pytest.mark.parametrize("d,layer", FAMILY_CASES)
def test_family_forward_matches_the_tools_float32_forward(d, layer):
    """megamoe's layer (torch backend) against the tool's own forward of the calibrated model in
    float32 (routed experts and shared expert as the family computes them): cosine >= 0.99999
    and the output norm within 0.1%; W4A4 agrees to float32 rounding."""
    loaded, ref, m = _family(d, layer)
    x, y_ref = ref["x"].float(), ref["y_fp32"]
    y = m(x)
    assert y.dtype == torch.float32 and torch.isfinite(y).all()
    assert cosine(y, y_ref) >= 0.99999, cosine(y, y_ref)
    assert _rel_norm(y, y_ref) < 1e-3, _rel_norm(y, y_ref)
    if loaded.config.act_mode == "w4a4":
        err = float((y - y_ref).abs().max() / y_ref.abs().max())
        assert err < 1e-5, err
    # the shared expert alone, as the block adds it (Qwen2-MoE: scaled by its sigmoid gate), against
    # the tool's bf16 run of it (its bf16 roundings move some NVFP4 activation codes)
    if loaded.config.n_shared_experts:
        assert cosine(m._shared_expert(x), ref["y_shared"]) >= 0.998
    # bf16 in and out, as the tool runs: as close to the tool's bf16 forward as the tool's own
    # float32 forward is. Without the weight on the input, also at float32's cosine from the
    # float32 forward; with it (Llama 4) the rows are scaled in bf16, as transformers scales them,
    # before the activation quantization, which moves NVFP4 codes (cosine ~0.998 either way)
    yb = m(ref["x"]).float()
    c32, c16, tool_own = cosine(yb, y_ref), cosine(yb, ref["y"]), cosine(ref["y"], y_ref)
    assert c16 >= tool_own - 3e-4, (c16, tool_own)
    assert c32 >= (0.997 if loaded.config.router_weight_on_input else 0.99999), (c32, c16, tool_own)


@pytest.mark.parametrize("d,layer", FAMILY_CASES)
def test_family_the_check_can_fail(d, layer):
    """The comparison catches what a loader dropping a part of the family would compute."""
    loaded, ref, _ = _family(d, layer)
    arch, x, y_ref = _arch(d), ref["x"].float(), ref["y_fp32"]
    w, c = loaded.weights, loaded.config

    def run(weights=w, **kw):
        return MoELayer(weights, c.with_(**kw), backend="torch")(x)

    def off(y):
        return cosine(y, y_ref) < 0.99999 or _rel_norm(y, y_ref) > 1e-3

    if arch == "kimi_k25":
        assert off(run(scoring="softmax", n_group=None, topk_group=None))
        if c.routed_scaling_factor != 1.0:
            assert _rel_norm(run(routed_scaling_factor=1.0), y_ref) > 1e-3
    elif arch == "minimax_m2":  # the block-level correction bias ignored
        assert off(run(C.MoEWeights(**{**w.__dict__, "router_bias": None})))
    elif arch == "qwen2_moe":  # the shared expert's sigmoid gate ignored, or the shared expert dropped
        assert off(run(C.MoEWeights(**{**w.__dict__, "shared_expert_gate": None}), shared_expert_gate=False))
        assert off(run(C.MoEWeights(**{**w.__dict__, "shared_expert_gate": None, "shared_gate_up": None,
                                       "shared_down": None, "shared_gate_up_input_scale": None,
                                       "shared_down_input_scale": None}),
                       shared_expert_gate=False, n_shared_experts=0, shared_intermediate_size=None))
    elif arch == "gpt_oss":  # each bias, the clamp, the activation's alpha and shift, the row order
        for field in ("b13", "b2", "router_logit_bias"):
            assert off(run(C.MoEWeights(**{**w.__dict__, field: None}))), field
        assert off(run(swiglu_limit=None)) and off(run(swiglu_alpha=1.0)) and off(run(swiglu_up_shift=0.0))
        if _spec(d)["producer"] == "nvidia-modelopt":  # the interleaved gate/up columns read as halves
            assert off(MoELayer(C.load(d, layer=layer, w13_layout="gate-up").weights, c, backend="torch")(x))
    else:  # the router weight applied to the output instead of the input
        assert off(run(router_weight_on_input=False))


@pytest.mark.parametrize("d", [d for d in FAMILY_CKPTS if _arch(d) in ("qwen2_moe", "llama4_text", "minimax_m2",
                                                                        "gpt_oss")],
                         ids=lambda d: d.name)
def test_family_config_path_drops_nothing(d):
    """With config= (the architecture not read from config.json) a tensor the config would not
    use fails the load naming it, and a routing that differs from what config.json's
    architecture computes is reported."""
    full = C.load(d, layer=0)
    arch = _arch(d)
    if arch == "qwen2_moe":
        with pytest.raises(C.CheckpointError, match=r"shared_expert_gate\.weight: present but not used"):
            C.load(d, layer=0, config=full.config.with_(shared_expert_gate=False))
    elif arch == "llama4_text":
        got = C.load(d, layer=0, config=full.config.with_(router_weight_on_input=False))
        assert any("router_weight_on_input=False" in w and "'llama4_text'" in w for w in got.report.warnings)
    else:
        got = C.load(d, layer=0, config=full.config.with_(scoring="softmax"))
        assert any("scoring='softmax'" in w for w in got.report.warnings)
    same = C.load(d, layer=0, config=full.config)  # the family's own config: loads, no such warning
    assert not any(w.startswith("config= has") for w in same.report.warnings)


def test_info_names_kimi_k25_text_config_and_blocks(capsys):
    """``megamoe info`` on llmcompressor's Kimi-K2.5 (layers written as ``blocks.N``): the layer
    by its number, the routing read from text_config, every tensor read."""
    from megamoe.cli import main

    d = FIXTURES / "llmc_kimi_k25_nvfp4"
    assert main(["info", "--checkpoint", str(d), "--layer", "1"]) == 0
    out = capsys.readouterr().out
    p = "language_model.model.blocks.1.mlp."
    for word in (f"layer '{p}'", "layer config: config.json model_type 'kimi_k25'",
                 "num_experts=8 (config.json text_config.n_routed_experts)",
                 "routed_scaling_factor=1.5 (config.json text_config.routed_scaling_factor)",
                 f"read: {p}gate.e_score_correction_bias: correction bias",
                 f"read: {p}shared_experts.gate_proj.weight_packed: shared expert gate weights: NVFP4"):
        assert word in out, word


def test_router_weight_on_input_scales_each_slots_row():
    """Llama 4's weight on the expert's input, with two experts per token (the layer does not
    assume top-1): each slot's row times its weight, in the rows' dtype, through its expert with
    weight 1, summed over the slots; plus the shared expert. A layer class with its own forward
    (which would weigh the outputs) refuses such a config."""
    from megamoe import reference

    loaded = C.load(FIXTURES / "llmc_llama4_nvfp4", layer=0)
    cfg, w = loaded.config.with_(top_k=2), loaded.weights
    m = MoELayer(w, cfg, backend="torch")
    x = _ref(FIXTURES / "llmc_llama4_nvfp4", 0)["x"]
    weights, ids = m.route(x)
    assert ids.shape == (x.shape[0], 2)
    want = m._shared_expert(x).float()
    for j in range(2):
        rows = x * weights[:, j:j + 1].to(x.dtype)  # bf16, as transformers scales them
        for t in range(x.shape[0]):
            e = int(ids[t, j])
            want[t] += reference.expert_mlp(rows[t:t + 1].float(), nvfp4.dequantize(w.w13[e]), nvfp4.dequantize(w.w2[e]),
                                            cfg, w.w13_input_scale[e], w.w2_input_scale[e])[0]
    got = m(x).float()
    torch.testing.assert_close(got, want.to(x.dtype).float(), rtol=0, atol=0)
    # weighing the outputs instead is another layer
    assert cosine(MoELayer(w, cfg.with_(router_weight_on_input=False), backend="torch")(x), want) < 0.9999

    class OwnForward(MoELayer):
        def forward(self, *a, **kw):
            return super().forward(*a, **kw)

    with pytest.raises(NotImplementedError, match="router_weight_on_input"):
        OwnForward(w, cfg, backend="torch")


def test_shared_expert_gate_scales_the_shared_expert_per_token():
    """Qwen2-MoE's shared expert: its output times sigmoid(x · gate), per token; the routed part
    unchanged."""
    d = FIXTURES / "modelopt_qwen2_moe_nvfp4"
    loaded = C.load(d, layer=0)
    x = _ref(d, 0)["x"].float()
    m = MoELayer(loaded.weights, loaded.config, backend="torch")
    ungated_w = C.MoEWeights(**{**loaded.weights.__dict__, "shared_expert_gate": None})
    ungated = MoELayer(ungated_w, loaded.config.with_(shared_expert_gate=False), backend="torch")
    g = torch.sigmoid(x @ loaded.weights.shared_expert_gate.float().T)
    assert float(g.min()) < 0.4 and float(g.max()) > 0.6  # the gate varies per token
    torch.testing.assert_close(m._shared_expert(x), ungated._shared_expert(x) * g, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(m(x) - m._shared_expert(x), ungated(x) - ungated._shared_expert(x), rtol=1e-6, atol=1e-5)

"""docs/SPEC.md §3 routing against hand-checked examples."""
import math

import pytest
import torch

from megamoe.routing import route


def test_softmax_topk_hand_checked():
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0]])
    w, ids = route(logits, 2, "softmax", renormalize=False)
    assert ids.tolist() == [[1, 2]]
    p = [math.exp(v) for v in (1, 3, 2, 0)]
    s = sum(p)
    assert w[0].tolist() == pytest.approx([p[1] / s, p[2] / s], rel=1e-6)
    w2, _ = route(logits, 2, "softmax", renormalize=True)
    assert w2[0].tolist() == pytest.approx([p[1] / (p[1] + p[2]), p[2] / (p[1] + p[2])], rel=1e-6)
    assert ids.dtype == torch.int32 and w.dtype == torch.float32


def test_sigmoid_grouped_with_bias_hand_checked():
    # 8 experts in 4 groups of 2; keep 2 groups; pick 2 experts.
    logits = torch.tensor([[0.0, 0.1, 2.0, -1.0, 1.0, 1.5, -2.0, 3.0]])
    bias = torch.tensor([0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, -0.9])
    sig = torch.sigmoid(logits[0])
    choice = sig + bias
    # group scores = sum of both members: g0 .5+.525, g1 .881+.269, g2 .731+.818, g3 .119+(.953-.9)
    w, ids = route(logits, 2, "sigmoid", correction_bias=bias, n_group=4, topk_group=2,
                   renormalize=True, routed_scaling_factor=2.5)
    # groups 2 and 1 win; best experts there by biased score: 2 (0.881) and 5 (0.818)
    assert sorted(ids[0].tolist()) == [2, 5]
    # weights use the unbiased scores, renormalised, then scaled
    order = ids[0].tolist()
    expect = [float(sig[i] / (sig[2] + sig[5]) * 2.5) for i in order]
    assert w[0].tolist() == pytest.approx(expect, rel=1e-6)
    assert float(choice[7]) < float(choice[5])  # the bias moved expert 7 out


def test_bias_changes_selection_not_weights():
    logits = torch.tensor([[0.0, 1.0, 0.5]])
    w0, ids0 = route(logits, 1, "sigmoid")
    w1, ids1 = route(logits, 1, "sigmoid", correction_bias=torch.tensor([5.0, 0.0, 0.0]))
    assert ids0.tolist() == [[1]] and ids1.tolist() == [[0]]
    w1n, _ = route(logits, 1, "sigmoid", correction_bias=torch.tensor([5.0, 0.0, 0.0]), renormalize=False)
    assert w1n.item() == pytest.approx(0.5)


@pytest.mark.parametrize("kw,msg", [
    (dict(top_k=0), "top_k"), (dict(top_k=9), "top_k"), (dict(top_k=2, scoring="relu"), "scoring"),
    (dict(top_k=2, n_group=3), "n_group"),
])
def test_bad_arguments(kw, msg):
    with pytest.raises(ValueError, match=msg):
        route(torch.randn(2, 8), **kw)


# ------------------------------------------------------------------------------------------
# the routing of each architecture, from config.json (docs/SPEC.md §3.4)
# ------------------------------------------------------------------------------------------

import json  # noqa: E402
from pathlib import Path  # noqa: E402

from megamoe.routing import ARCHITECTURES, UnknownArchitecture, architecture_routing, hash_expert_ids  # noqa: E402

ROUTERS = sorted((Path(__file__).resolve().parent / "fixtures" / "real").glob("routing_*.safetensors"))


def test_every_claimed_architecture_has_a_recorded_router():
    from safetensors import safe_open

    seen = set()
    for p in ROUTERS:
        with safe_open(str(p), "pt") as f:
            seen.add(json.loads(f.metadata()["config"])["model_type"])
    assert seen == set(ARCHITECTURES)


@pytest.mark.parametrize("path", ROUTERS, ids=[p.stem for p in ROUTERS])
def test_rule_matches_the_transformers_router(path):
    """transformers' own router module of the architecture (run by scripts/make_real_fixtures.py
    on random bf16 hidden states) against megamoe's route() with the fields that
    architecture_routing() derives from the same config.json."""
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        meta = f.metadata()
        t = {k: f.get_tensor(k) for k in f.keys()}
    hf = json.loads(meta["config"])
    layer = int(meta["layer"]) if "layer" in meta else None  # deepseek_v4: hash or top-k per layer
    rule = architecture_routing(hf, layer)
    fl = rule.fields
    assert ("tid2eid" in t) == bool(fl.get("hash_routing"))
    expert_ids = hash_expert_ids(t["tid2eid"], t["input_ids"]) if fl.get("hash_routing") else None
    args = (fl["top_k"], fl["scoring"], t.get("e_score_correction_bias"), fl.get("n_group"), fl.get("topk_group"),
            fl["renormalize"], fl["routed_scaling_factor"])
    w, ids = route(t["router_logits"], *args, expert_ids=expert_ids)
    got, want = ids.long().sort(-1), t["topk_ids"].long().sort(-1)
    differ = (got.values != want.values).any(-1)
    if differ.any():
        # Only an exact tie may choose differently: megamoe gives it to the lowest expert id
        # (docs/SPEC.md §3), torch.topk as it happens. Then the chosen selection scores are
        # the same multiset, and the megamoe choice is the lowest ids among the tied ones.
        from megamoe.routing import SCORINGS

        sel = SCORINGS.get(fl["scoring"], lambda v: v)(t["router_logits"].float())  # softmax_topk: the logits
        if t.get("e_score_correction_bias") is not None:
            sel = sel + t["e_score_correction_bias"].float()
        rows = differ.nonzero().flatten()
        assert len(rows) <= 2, f"{len(rows)} rows choose differently: more than exact ties explain"
        for r in rows.tolist():
            assert torch.equal(sel[r, got.values[r]].sort().values, sel[r, want.values[r]].sort().values), r
            extra_got = set(got.values[r].tolist()) - set(want.values[r].tolist())
            extra_want = set(want.values[r].tolist()) - set(got.values[r].tolist())
            assert max(extra_got) < min(extra_want), (r, extra_got, extra_want)
        keep = ~differ
        got = torch.return_types.sort((got.values[keep], got.indices[keep]))
        want = torch.return_types.sort((want.values[keep], want.indices[keep]))
        w, t["topk_weights"] = w[keep], t["topk_weights"][keep]
    assert torch.equal(got.values, want.values)
    gw, ww = w.gather(1, got.indices), t["topk_weights"].gather(1, want.indices)
    if hf["model_type"] in ("qwen3_moe", "qwen2_moe", "llama4", "llama4_text"):
        gw = gw.to(torch.bfloat16).float()  # transformers returns these weights in the logits' dtype
        torch.testing.assert_close(gw, ww, rtol=1e-2, atol=1e-3)
    else:
        torch.testing.assert_close(gw, ww, rtol=1e-5, atol=1e-7)
    # the fields that matter here do matter: another scoring picks other experts (top-k) or
    # weighs them otherwise (hash), and without its scaling factor the weights differ
    other = {"sigmoid": "softmax", "softmax": "sigmoid", "sqrtsoftplus": "sigmoid",
             "softmax_topk": "sigmoid"}[fl["scoring"]]
    w2, ids2 = route(t["router_logits"], fl["top_k"], other, *args[2:], expert_ids=expert_ids)
    if expert_ids is not None:
        assert torch.equal(ids2, ids) and not torch.allclose(w2, w, rtol=1e-3, atol=1e-4)
    elif fl.get("router_weight_on_input") or fl["scoring"] == "softmax_topk":
        # Llama 4: the top-k of the logits, whatever the (monotone) score; the weights differ
        assert not torch.allclose(w2, w, rtol=1e-3, atol=1e-4)
    elif fl["scoring"] != "softmax":
        assert not torch.equal(ids2.long().sort(-1).values, want.values)
    if fl["routed_scaling_factor"] != 1.0:
        w3, _ = route(t["router_logits"], *args[:-1], 1.0, expert_ids=expert_ids)
        assert not torch.allclose(w3, route(t["router_logits"], *args, expert_ids=expert_ids)[0], rtol=1e-3, atol=1e-4)


def test_deepseek_v3_rule_and_defaults():
    r = architecture_routing({"model_type": "deepseek_v3", "n_routed_experts": 64, "num_experts_per_tok": 6})
    f = r.fields
    assert (f["scoring"], f["num_experts"], f["top_k"], f["n_group"], f["topk_group"], f["renormalize"],
            f["routed_scaling_factor"], f["n_shared_experts"]) == ("sigmoid", 64, 6, 8, 4, True, 2.5, 1)
    assert r.w13_layout == "gate-up"
    assert any("architecture default; config.json has no n_group" in c for c in r.choices)
    assert any("config.json n_routed_experts" in c for c in r.choices)
    ok = architecture_routing({"model_type": "deepseek_v3", "scoring_func": "sigmoid", "topk_method": "noaux_tc"})
    assert ok.fields["scoring"] == "sigmoid"


@pytest.mark.parametrize("hf,msg", [
    ({"model_type": "deepseek_v3", "scoring_func": "softmax"}, "scoring_func='softmax'"),
    ({"model_type": "deepseek_v3", "topk_method": "greedy"}, "topk_method='greedy'"),
    ({"model_type": "mixtral", "hidden_act": "gelu"}, "hidden_act='gelu'"),
    ({"model_type": "gpt_oss", "swiglu_limit": 10.0}, r"swiglu_limit=10.0: transformers' gpt_oss experts clamp"),
    ({"model_type": "kimi_k25"}, "without a text_config"),
    ({"model_type": "kimi_k25", "text_config": {"model_type": "qwen3_moe"}}, "text_config.model_type='qwen3_moe'"),
    ({"model_type": "kimi_k25", "text_config": {"scoring_func": "softmax"}}, "text_config.scoring_func='softmax'"),
    ({"model_type": "minimax_m2", "use_routing_bias": False}, "use_routing_bias=false"),
    ({"model_type": "llama4", "text_config": {"model_type": "mixtral"}}, "text_config.model_type='mixtral'"),
    ({"n_routed_experts": 8}, "no model_type"),
])
def test_unknown_or_unsupported_is_refused(hf, msg):
    with pytest.raises(UnknownArchitecture, match=msg):
        architecture_routing(hf)


def test_mixtral_and_qwen3_moe_rules():
    m = architecture_routing({"model_type": "mixtral", "num_local_experts": 8, "num_experts_per_tok": 2,
                              "intermediate_size": 256}).fields
    assert (m["scoring"], m["renormalize"], m["routed_scaling_factor"], m["n_shared_experts"], m["intermediate_size"]) \
        == ("softmax", True, 1.0, 0, 256)
    q = architecture_routing({"model_type": "qwen3_moe", "num_experts": 16}).fields
    assert (q["scoring"], q["renormalize"], q["top_k"], q["num_experts"]) == ("softmax", False, 8, 16)


def test_qwen3_moe_reads_the_key_transformers_5_writes():
    """transformers 5 writes num_local_experts (num_experts is only its alias)."""
    r = architecture_routing({"model_type": "qwen3_moe", "num_local_experts": 16, "num_experts_per_tok": 2})
    assert r.fields["num_experts"] == 16 and r.stated["num_experts"] == "num_local_experts"
    assert any("num_experts=16 (config.json num_local_experts)" in c for c in r.choices)
    none = architecture_routing({"model_type": "qwen3_moe"})
    assert "num_experts" not in none.stated  # the default 128 is a default, not something config.json says
    with pytest.raises(UnknownArchitecture, match="num_local_experts=16, num_experts=8 disagree"):
        architecture_routing({"model_type": "qwen3_moe", "num_local_experts": 16, "num_experts": 8})


def test_glm4_moe_rule_is_deepseek_v3_routing_with_glm_defaults():
    r = architecture_routing({"model_type": "glm4_moe"})
    f = r.fields
    assert (f["scoring"], f["num_experts"], f["top_k"], f["n_group"], f["topk_group"], f["renormalize"],
            f["routed_scaling_factor"], f["intermediate_size"], f["n_shared_experts"]) == \
        ("sigmoid", 128, 8, 1, 1, True, 1.0, 1408, 1)
    assert r.requires == ("correction_bias",)
    with pytest.raises(UnknownArchitecture, match="hidden_act='gelu'"):
        architecture_routing({"model_type": "glm4_moe", "hidden_act": "gelu"})
    with pytest.raises(UnknownArchitecture, match="scoring_func='softmax'"):
        architecture_routing({"model_type": "glm4_moe", "scoring_func": "softmax"})


V4 = {"model_type": "deepseek_v4", "n_routed_experts": 16, "num_experts_per_tok": 4, "moe_intermediate_size": 64,
      "mlp_layer_types": ["hash_moe", "hash_moe", "moe", "moe"], "swiglu_limit": 7.0, "routed_scaling_factor": 2.0}


@pytest.mark.parametrize("layer,hashed", [(0, True), (1, True), (2, False), (3, False)])
def test_deepseek_v4_rule_per_layer(layer, hashed):
    r = architecture_routing(V4, layer)
    f = r.fields
    assert f["hash_routing"] is hashed
    assert (f["scoring"], f["num_experts"], f["top_k"], f["n_group"], f["renormalize"], f["routed_scaling_factor"],
            f["swiglu_limit"], f["n_shared_experts"], f["shared_intermediate_size"]) == \
        ("sqrtsoftplus", 16, 4, None, True, 2.0, 7.0, 1, 64)
    assert r.requires == (("tid2eid",) if hashed else ("correction_bias",))
    assert any(f"config.json mlp_layer_types[{layer}]" in c for c in r.choices)


def test_deepseek_v4_rule_defaults_and_legacy_num_hash_layers():
    d = architecture_routing({"model_type": "deepseek_v4"}, 2)
    assert d.fields["hash_routing"] is True and d.fields["swiglu_limit"] == 10.0  # 3 hash layers by default
    assert d.fields["scoring"] == "sqrtsoftplus" and d.fields["routed_scaling_factor"] == 1.5
    assert architecture_routing({"model_type": "deepseek_v4"}, 3).fields["hash_routing"] is False
    legacy = {"model_type": "deepseek_v4", "num_hash_layers": 1}
    assert architecture_routing(legacy, 0).fields["hash_routing"] is True
    assert architecture_routing(legacy, 1).fields["hash_routing"] is False
    assert any("num_hash_layers=1" in c for c in architecture_routing(legacy, 1).choices)


@pytest.mark.parametrize("hf,layer,msg", [
    (V4, None, "layer number is needed"),
    ({"model_type": "deepseek_v4"}, None, "layer number is needed"),
    (V4, 4, "outside config.json mlp_layer_types"),
    ({**V4, "scoring_func": "relu"}, 0, "scoring_func='relu'"),
    ({**V4, "mlp_layer_types": ["dense", "moe", "moe", "moe"]}, 0, r"mlp_layer_types\[0\]='dense'"),
    ({**V4, "num_local_experts": 8}, 2, "disagree"),
])
def test_deepseek_v4_rule_refusals(hf, layer, msg):
    with pytest.raises(UnknownArchitecture, match=msg):
        architecture_routing(hf, layer)


def test_kimi_k25_rule_reads_text_config():
    """Kimi-K2.5's routing is its DeepSeek-V3 text model's, read from text_config (every choice
    names the key under text_config)."""
    rule = architecture_routing({"model_type": "kimi_k25", "n_routed_experts": 99,
                                 "text_config": {"model_type": "kimi_k2", "n_routed_experts": 384,
                                                 "num_experts_per_tok": 8, "n_group": 1, "topk_group": 1,
                                                 "routed_scaling_factor": 2.827, "moe_intermediate_size": 2048}})
    f = rule.fields
    assert (f["num_experts"], f["top_k"], f["scoring"], f["routed_scaling_factor"], f["n_shared_experts"]) == \
        (384, 8, "sigmoid", 2.827, 1)
    assert rule.stated["num_experts"] == "text_config.n_routed_experts"
    assert "num_experts=384 (config.json text_config.n_routed_experts)" in rule.choices
    assert rule.requires == ("correction_bias",)


def test_minimax_qwen2_llama4_rules():
    mm = architecture_routing({"model_type": "minimax_m2", "num_local_experts": 256, "num_experts_per_tok": 8,
                               "intermediate_size": 1536, "scoring_func": "sigmoid", "use_routing_bias": True})
    assert (mm.fields["scoring"], mm.fields["renormalize"], mm.fields["routed_scaling_factor"],
            mm.fields["n_shared_experts"], mm.requires) == ("sigmoid", True, 1.0, 0, ("correction_bias",))
    q = architecture_routing({"model_type": "qwen2_moe", "num_experts": 60, "num_experts_per_tok": 4,
                              "moe_intermediate_size": 1408, "shared_expert_intermediate_size": 5632}).fields
    assert (q["scoring"], q["renormalize"], q["n_shared_experts"], q["shared_intermediate_size"],
            q["shared_expert_gate"]) == ("softmax", False, 1, 5632, True)
    for hf in ({"model_type": "llama4_text", "num_local_experts": 16, "num_experts_per_tok": 1,
                "intermediate_size": 8192},
               {"model_type": "llama4", "text_config": {"model_type": "llama4_text", "num_local_experts": 16,
                                                        "num_experts_per_tok": 1, "intermediate_size": 8192}}):
        f = architecture_routing(hf).fields
        assert (f["scoring"], f["renormalize"], f["routed_scaling_factor"], f["router_weight_on_input"],
                f["n_shared_experts"], f["shared_intermediate_size"], f["top_k"]) == \
            ("sigmoid", False, 1.0, True, 1, 8192, 1)

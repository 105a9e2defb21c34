"""DeepSeek-V4's MoE semantics (docs/SPEC.md §3): sqrt(softplus) scores, hash routing by token id,
the SwiGLU clamp, the shared expert, and the v4-flash preset — each against an independent
float64 computation written from the layer's definition, on fresh random data."""
import pytest
import torch
import torch.nn.functional as TF

from megamoe import nvfp4 as F
from megamoe import reference
from megamoe.checkpoint import synthetic_weights
from megamoe.moe import MoELayer
from megamoe.presets import MoEConfig, get_preset
from megamoe.routing import InputIdsRequired, hash_expert_ids, route, topk_lowest_id

from _helpers import cosine, rel_err


def v4_router_float64(logits, bias, k, scale, expert_ids=None):
    """DeepSeek-V4's router from its definition, in float64: scores = sqrt(softplus(logits));
    experts = top-k of scores + bias (or the given hash experts); weights = the chosen scores /
    (their sum + 1e-20) * scale."""
    scores = torch.sqrt(TF.softplus(logits.double()))
    if expert_ids is None:
        sel = scores + (0 if bias is None else bias.double())
        expert_ids = sel.argsort(dim=-1, descending=True, stable=True)[:, :k]
    w = scores.gather(1, expert_ids.long())
    return w / (w.sum(-1, keepdim=True) + 1e-20) * scale, expert_ids.long()


def test_sqrtsoftplus_topk_matches_the_definition(gen):
    logits = torch.randn(300, 32, generator=gen) * 3
    bias = torch.randn(32, generator=gen) * 0.1
    w, ids = route(logits, 6, "sqrtsoftplus", bias, routed_scaling_factor=1.5)
    rw, rids = v4_router_float64(logits, bias, 6, 1.5)
    assert torch.equal(ids.long(), rids)
    torch.testing.assert_close(w.double(), rw, rtol=1e-6, atol=1e-7)
    # the bias changes the choice but never the weights' source (a softmax or sigmoid would differ)
    assert not torch.allclose(w, route(logits, 6, "sigmoid", bias, routed_scaling_factor=1.5)[0])


def test_hash_routing_takes_the_table_and_weighs_by_scores(gen):
    vocab, e, k = 50, 16, 3
    tid2eid = torch.rand(vocab, e, generator=gen).argsort(1)[:, :k]
    input_ids = torch.randint(0, vocab, (40,), generator=gen)
    logits = torch.randn(40, e, generator=gen)
    ids = hash_expert_ids(tid2eid, input_ids)
    assert ids.dtype == torch.int32 and torch.equal(ids.long(), tid2eid[input_ids])
    w, got = route(logits, k, "sqrtsoftplus", torch.randn(e, generator=gen), routed_scaling_factor=1.5,
                   expert_ids=ids)
    rw, _ = v4_router_float64(logits, None, k, 1.5, expert_ids=tid2eid[input_ids])
    assert torch.equal(got.long(), tid2eid[input_ids])
    torch.testing.assert_close(w.double(), rw, rtol=1e-6, atol=1e-7)


def test_hash_ids_are_checked():
    tid2eid = torch.zeros(10, 2, dtype=torch.long)
    with pytest.raises(InputIdsRequired, match="input_ids"):
        hash_expert_ids(tid2eid, None)
    with pytest.raises(ValueError, match=r"out of range \[0, 10\)"):
        hash_expert_ids(tid2eid, torch.tensor([3, 10]))
    with pytest.raises(ValueError, match="integer tensor"):
        hash_expert_ids(tid2eid, torch.tensor([1.0, 2.0]))


@pytest.mark.parametrize("scoring", ["softmax", "sigmoid", "sqrtsoftplus"])
def test_ties_go_to_the_lowest_expert_id(gen, scoring):
    # every row has exactly equal logits in many places: the choice must be the lowest ids among
    # the equal ones, whatever the row's position or the batch size
    t, e, k = 64, 16, 4
    levels = torch.tensor([0.0, 0.5, 1.0])
    logits = levels[torch.randint(0, 3, (t, e), generator=gen)]
    _, ids = route(logits, k, scoring)
    for r in range(t):
        order = sorted(range(e), key=lambda j: (-float(logits[r, j]), j))
        assert ids[r].tolist() == order[:k], r
    for b in (1, 3, 17):
        assert torch.equal(route(logits[:b], k, scoring)[1], ids[:b])
    assert torch.equal(topk_lowest_id(torch.zeros(2, 5), 3), torch.tensor([[0, 1, 2], [0, 1, 2]]))


def test_group_ties_go_to_the_lowest_group_id():
    # 4 groups of 4 experts, all scores equal: groups 0 and 1 are kept, experts 0..3 chosen
    w, ids = route(torch.zeros(3, 16), 4, "sigmoid", None, n_group=4, topk_group=2)
    assert ids.tolist() == [[0, 1, 2, 3]] * 3


def float64_v4_layer(layer, x, input_ids):
    """The whole V4 layer in float64 from its definition: router (float32 logits, as the model
    computes them), experts with h = silu(min(gate, L)) * clamp(up, -L, L) and the activation
    quantization of docs/SPEC.md §3, shared expert with the same clamp, routed + shared."""
    cfg, W = layer.config, layer.weights
    L = cfg.swiglu_limit
    logits = x.float() @ W.router_weight.float().T
    hash_ids = W.tid2eid[input_ids] if cfg.hash_routing else None
    w, ids = v4_router_float64(logits, W.router_bias, cfg.top_k, cfg.routed_scaling_factor, hash_ids)
    out = torch.zeros(x.shape, dtype=torch.float64)
    clamped = 0
    for t in range(x.shape[0]):
        for j in range(cfg.top_k):
            e = int(ids[t, j])
            w13, w2 = F.dequantize(W.w13[e], torch.float64), F.dequantize(W.w2[e], torch.float64)
            a1 = reference.activation_to_gemm_input(x[t:t + 1].float(), cfg, W.w13_input_scale[e], torch.float64)
            gu = a1 @ w13.T
            gate, up = gu[:, :cfg.intermediate_size], gu[:, cfg.intermediate_size:]
            clamped += int((gate > L).sum() + (up.abs() > L).sum())
            h = TF.silu(torch.minimum(gate, torch.tensor(L, dtype=torch.float64))) * up.clamp(-L, L)
            a2 = reference.activation_to_gemm_input(h.float(), cfg, W.w2_input_scale[e], torch.float64)
            out[t] += float(w[t, j]) * (a2 @ w2.T)[0]
    gu = x.double() @ W.shared_gate_up.double().T
    s = W.shared_down.shape[1]
    gate, up = gu[:, :s], gu[:, s:]
    clamped += int((gate > L).sum() + (up.abs() > L).sum())
    hs = TF.silu(torch.minimum(gate, torch.tensor(L, dtype=torch.float64))) * up.clamp(-L, L)
    return out + hs @ W.shared_down.double().T, ids, clamped


@pytest.mark.parametrize("hash_routing", [False, True], ids=["topk", "hash"])
@pytest.mark.parametrize("act_mode", ["w4a4", "w4a16"])
def test_v4_layer_matches_its_definition(gen, hash_routing, act_mode):
    cfg = MoEConfig(128, 64, 16, 3, scoring="sqrtsoftplus", hash_routing=hash_routing, routed_scaling_factor=1.5,
                    n_shared_experts=1, shared_intermediate_size=32, swiglu_limit=1.5, act_mode=act_mode)
    layer = MoELayer(synthetic_weights(cfg, seed=int(torch.randint(0, 2**31, (1,), generator=gen))), cfg,
                     backend="torch")
    x = (torch.randn(24, 128, generator=gen) * 2).to(torch.bfloat16)
    input_ids = torch.randint(0, layer.weights.tid2eid.shape[0], (24,), generator=gen) if hash_routing else None
    ref, ids, clamped = float64_v4_layer(layer, x, input_ids)
    assert clamped > 0, "the data never reaches the clamp: the test would not see it"
    out = layer(x, input_ids=input_ids).float()
    assert torch.equal(layer.route(x, input_ids=input_ids)[1].long(), ids)
    assert cosine(out, ref) > 0.9999 and rel_err(out, ref) < 2e-2
    # without the clamp the answer is measurably different: the clamp is computed, not ignored
    unclamped = MoELayer(layer.weights, cfg.with_(swiglu_limit=None), backend="torch")
    assert rel_err(unclamped(x, input_ids=input_ids).float(), ref) > 4 * rel_err(out, ref)


def test_hash_layer_without_input_ids_says_so():
    layer = MoELayer.from_preset("tiny", backend="torch", scoring="sqrtsoftplus", hash_routing=True)
    assert layer.needs_input_ids and not MoELayer.from_preset("tiny", backend="torch").needs_input_ids
    x = torch.randn(4, 256)
    with pytest.raises(InputIdsRequired, match="input_ids"):
        layer(x)
    with pytest.raises(ValueError, match=r"input_ids must be \[4\]"):
        layer(x, input_ids=torch.zeros(3, dtype=torch.long))
    # routed by the caller, the table is not needed
    ids = torch.zeros(4, 2, dtype=torch.int32)
    ids[:, 1] = 1
    assert layer(x, ids, torch.full((4, 2), 0.5)).shape == (4, 256)


def test_hash_config_needs_its_table():
    cfg = MoEConfig(64, 32, 4, 2, scoring="sqrtsoftplus", hash_routing=True)
    w = synthetic_weights(cfg)
    assert w.tid2eid.shape[1] == 2 and (w.tid2eid[:, 0] != w.tid2eid[:, 1]).all()
    w.tid2eid = None
    with pytest.raises(ValueError, match="tid2eid: missing"):
        MoELayer(w, cfg, backend="torch")
    with pytest.raises(ValueError, match="hash_routing"):
        MoEConfig(64, 32, 4, 2, hash_routing=True, n_group=2, topk_group=1)


def test_v4_flash_preset_is_deepseek_v4_flash():
    c = get_preset("v4-flash")
    assert (c.hidden_size, c.intermediate_size, c.num_experts, c.top_k) == (4096, 2048, 256, 6)
    assert c.scoring == "sqrtsoftplus" and c.swiglu_limit == 10.0 and c.routed_scaling_factor == 1.5
    assert c.n_shared_experts == 1 and c.shared_intermediate_size == 2048 and not c.n_group


def test_synthetic_hash_checkpoint_round_trips(tmp_path, gen):
    from megamoe import checkpoint

    p = checkpoint.write_synthetic(tmp_path / "h.safetensors", "tiny", seed=3, scoring="sqrtsoftplus",
                                   hash_routing=True, swiglu_limit=10.0)
    a = MoELayer.from_checkpoint(p, backend="torch")
    b = MoELayer.from_preset("tiny", seed=3, backend="torch", scoring="sqrtsoftplus", hash_routing=True,
                             swiglu_limit=10.0)
    assert a.config == b.config and torch.equal(a.weights.tid2eid, b.weights.tid2eid)
    x = torch.randn(6, 256, generator=gen)
    ids = torch.randint(0, a.weights.tid2eid.shape[0], (6,), generator=gen)
    assert torch.equal(a(x, input_ids=ids), b(x, input_ids=ids))

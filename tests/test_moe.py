"""docs/SPEC.md §3: the MoE layer against the reference math run token by token in float64."""
import pytest
import torch

from megamoe import nvfp4 as F
from megamoe import reference
from megamoe.checkpoint import synthetic_weights
from megamoe.health import THRESHOLDS, random_rows_within_static_range
from megamoe.moe import MoELayer
from megamoe.presets import MoEConfig, get_preset

from _helpers import cosine, rel_err


def loop_reference(layer, x, ids, w):
    """Token by token, slot by slot, the reference expert (megamoe.reference.expert_mlp, with
    activation quantization as docs/SPEC.md §3) on float64-decoded weights: no grouping by expert,
    no float32 GEMMs, so the layer's loop and its float32 arithmetic are what is tested."""
    cfg, W = layer.config, layer.weights
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            if not 0 <= e < cfg.num_experts:
                continue  # a masked slot (docs/SPEC.md §3.1)
            in1 = None if W.w13_input_scale is None else W.w13_input_scale[e]
            in2 = None if W.w2_input_scale is None else W.w2_input_scale[e]
            y = reference.expert_mlp(x[t:t + 1].float(), F.dequantize(W.w13[e], torch.float64),
                                     F.dequantize(W.w2[e], torch.float64), cfg, in1, in2)
            out[t] += float(w[t, j]) * y[0]
    if cfg.n_shared_experts:
        out += reference.dense_mlp(x, W.shared_gate_up.double(), W.shared_down.double(), cfg.swiglu_limit)
    return out


def make_layer(cfg, seed=0):
    return MoELayer(synthetic_weights(cfg, seed=seed), cfg, backend="torch")


SMALL = MoEConfig(64, 48, 6, 2)


@pytest.mark.parametrize("mode,dynamic", [("w4a4", False), ("w4a4", True), ("w4a16", False)])
def test_forward_matches_float64_loop(gen, mode, dynamic):
    layer = make_layer(SMALL.with_(act_mode=mode, dynamic_act_scale=dynamic))
    x = torch.randn(13, 64, generator=gen).to(torch.bfloat16)
    w, ids = layer.route(x)
    out = layer(x, ids, w)
    ref = loop_reference(layer, x, ids, w)
    # float32 vs float64 accumulation can flip an activation code at a rounding tie;
    # a wrong expert, scale or layout would be orders of magnitude further off.
    assert rel_err(out.float(), ref) < 2e-2
    assert cosine(out.float(), ref) > 0.999


def test_intermediate_464_shared_expert_grouped_routing(gen):
    # docs/FIELD_BUGS.md rows 8 (I = 464, K/16 = 29 not a multiple of 4) and 10 (gate/up scales differ)
    cfg = MoEConfig(128, 464, 8, 3, scoring="sigmoid", n_group=4, topk_group=2, routed_scaling_factor=2.5,
                    n_shared_experts=1, shared_intermediate_size=64)
    layer = make_layer(cfg, seed=3)
    gs = layer.weights.w13.global_scale
    assert float((gs[:, 1] / gs[:, 0]).max() / (gs[:, 1] / gs[:, 0]).min()) > 2
    x = torch.randn(7, 128, generator=gen)
    w, ids = layer.route(x)
    out = layer(x)
    ref = loop_reference(layer, x, ids, w)
    assert out.dtype == torch.float32
    assert cosine(out, ref) > 0.999


def test_gate_and_up_global_scales_are_both_used(gen):
    layer = make_layer(SMALL.with_(act_mode="w4a16"))
    x = torch.randn(5, 64, generator=gen)
    w, ids = layer.route(x)
    base = layer(x, ids, w)
    layer.weights.w13.global_scale[:, 1] *= 8  # only the up half; a power of 2 keeps bf16 rounding exact
    out = layer.backend.moe_forward(layer.weights, layer.config, x, ids, w)
    assert torch.allclose(out, base * 8, rtol=1e-5, atol=1e-6)  # silu(g)*u is linear in u


def test_global_scales_far_from_one(gen):
    # docs/FIELD_BUGS.md row 11: weights' global scales of 1e-3 and 1e3 are honoured, not replaced by 1.0
    cfg = SMALL.with_(act_mode="w4a16")
    wts = synthetic_weights(cfg, seed=1)
    x = torch.randn(6, 64, generator=gen)
    base_layer = MoELayer(wts, cfg, backend="torch")
    w, ids = base_layer.route(x)
    base = base_layer(x, ids, w)
    wts.w2.global_scale.mul_(1024.0)
    assert rel_err(MoELayer(wts, cfg, backend="torch")(x, ids, w), base * 1024) < 1e-6
    wts.w2.global_scale.div_(1024.0)
    wts.w13.global_scale.mul_(1e-3)
    wts.w2.global_scale.mul_(1e3)
    layer = MoELayer(wts, cfg, backend="torch")
    out = layer(x, ids, w)
    assert rel_err(out, base) > 0.5  # silu is not linear: the scales really changed the result
    assert cosine(out, loop_reference(layer, x, ids, w)) > 0.9999


def test_w4a4_close_to_bf16_reference(gen):
    layer = MoELayer.from_preset("tiny", seed=2, backend="torch")
    # rows a static activation scale would clip are redrawn, as megamoe.health does (with them, 4
    # of 3,000 draws fell below 0.975 on this layer); the format itself: ~0.987, 0.9758 at worst
    x, _ = random_rows_within_static_range(layer, 61, gen)
    assert cosine(layer(x).float(), layer.reference_bf16(x)) > THRESHOLDS["moe_cosine_w4a4"]
    layer.config = layer.config.with_(act_mode="w4a16")
    assert cosine(layer(x).float(), layer.reference_bf16(x)) > 0.999


def test_rows_do_not_depend_on_the_batch(gen):
    # the service batches requests: a token's output must not depend on its neighbours
    for dynamic in (False, True):
        layer = make_layer(SMALL.with_(dynamic_act_scale=dynamic))
        x = torch.randn(20, 64, generator=gen).to(torch.bfloat16)
        x[5] *= 3e4  # one loud token must not change the others' scales
        full = layer(x)
        parts = torch.cat([layer(x[:7]), layer(x[7:8]), layer(x[8:])])
        # BLAS may sum in another order for another row count (and a tie may then round an
        # activation code differently); a batch-wide scale would be off by far more.
        for r in range(20):
            assert rel_err(parts[r].float(), full[r].float()) < 1e-2, r


def test_repeated_runs_identical(gen):
    layer = make_layer(SMALL)
    x = torch.randn(31, 64, generator=gen)
    assert torch.equal(layer(x), layer(x))


def test_output_dtype_follows_input(gen):
    layer = make_layer(SMALL)
    for dt in (torch.bfloat16, torch.float16, torch.float32):
        assert layer(torch.randn(3, 64, generator=gen).to(dt)).dtype == dt
    assert layer(torch.zeros(0, 64)).shape == (0, 64)


@pytest.mark.parametrize("kw,err", [
    (dict(x=torch.randn(3, 65)), "hidden_states"),
    (dict(x=torch.randn(3, 64), topk_ids=torch.zeros(3, 2, dtype=torch.int32)), "together"),
    (dict(x=torch.randn(3, 64), topk_ids=torch.full((3, 2), 6), topk_weights=torch.ones(3, 2)), "out of range"),
    (dict(x=torch.randn(3, 64), topk_ids=torch.zeros(3, 3, dtype=torch.int64), topk_weights=torch.ones(3, 3)), r"\[3, 2\]"),
    (dict(x=torch.randn(3, 64), router_logits=torch.randn(3, 5)), "router_logits"),
    (dict(x=torch.randint(0, 5, (3, 64))), "dtype"),
])
def test_bad_inputs_raise_with_the_value(kw, err):
    layer = make_layer(SMALL)
    x = kw.pop("x")
    with pytest.raises((ValueError, TypeError), match=err):
        layer(x, **kw)


def test_config_rejects_bad_shapes():
    with pytest.raises(ValueError, match="multiple of 16"):
        MoEConfig(100, 64, 4, 2)
    with pytest.raises(ValueError, match="top_k"):
        MoEConfig(64, 64, 4, 5)
    with pytest.raises(ValueError, match="preset"):
        get_preset("huge")


@pytest.mark.parametrize("t", [1, 2, 3, 5, 31, 127, 128, 129, 257])
def test_token_count_sweep(gen, t):
    # docs/FIELD_BUGS.md row 14 on the reference: every T gives each token its own result.
    # The float32 GEMMs sum in another order for another T (BLAS picks its kernel by shape),
    # which moves L1's output by float32 ulps; W4A16 then rounds h = silu(gate)*up to bf16,
    # and an element of h next to a bf16 rounding boundary moves by one bf16 ulp (at most
    # 2^-7 of itself). So token r's row may move by at most
    #     (2^-7 + 2(H+I)·2^-24) · sum_s |w_s| · ||W2_e||_2 · ||h_s||
    # with h_s recovered from expert e's own output W2_e h_s by least squares (I <= H).
    # Measured: under 4% of that bound; another token's row is more than 20x beyond it.
    cfg = SMALL.with_(act_mode="w4a16")
    layer = make_layer(cfg)
    w2 = F.dequantize(layer.weights.w2, torch.float64)  # [E, H, I]
    x = torch.randn(t, cfg.hidden_size, generator=gen)
    w, ids = layer.route(x)
    out = layer(x, ids, w)
    for r in {0, t // 2, t - 1}:
        single = layer(x[r:r + 1], ids[r:r + 1], w[r:r + 1])[0]
        bound = 0.0
        for s in range(cfg.top_k):
            e = int(ids[r, s])
            # expert e's unweighted output for token r: the same expert in every slot, weights (1, 0, ...)
            one = torch.zeros(1, cfg.top_k)
            one[0, 0] = 1.0
            y_s = layer(x[r:r + 1], torch.full((1, cfg.top_k), e), one)[0].double()
            h_s = torch.linalg.lstsq(w2[e], y_s.unsqueeze(1)).solution
            bound += abs(float(w[r, s])) * float(torch.linalg.matrix_norm(w2[e], 2)) * float(h_s.norm())
        tol = (2 ** -7 + 2 * (cfg.hidden_size + cfg.intermediate_size) * 2 ** -24) * bound
        diff = float((single.double() - out[r].double()).norm())
        assert diff <= tol, f"T={t} row {r}: |single - batched| = {diff:.3e} > {tol:.3e}"


def test_dequantized_cache_gives_identical_results(gen):
    from megamoe.backends.torch_ref import TorchBackend

    wts = synthetic_weights(SMALL, seed=6)
    x = torch.randn(17, 64, generator=gen)
    cached = MoELayer(wts, SMALL, backend=TorchBackend(cache_dequantized=True))
    plain = MoELayer(wts, SMALL, backend=TorchBackend(cache_dequantized=False))
    assert type(cached._prepared).__name__ == "_DequantizedExperts"
    assert torch.equal(cached(x), plain(x))


# ------------------------------------------------------------------------------------------
# masked expert ids (docs/SPEC.md §3.1): a top-k id outside [0, E) contributes nothing
# ------------------------------------------------------------------------------------------

def _one_valid_slot_per_token(gen, t, e, k):
    """ids [t, k] where every token keeps at most one valid slot (which one, and whether any,
    drawn at random); the others carry the mask value -1 or another id outside [0, e)."""
    ids = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(t)])
    keep = torch.randint(0, k + 1, (t,), generator=gen)  # k: no valid slot at all
    keep[0], keep[1] = k, 0  # whatever the seed: one token with no valid slot, one with its first
    bad = torch.tensor([-1, e, e + 7, -5])[torch.randint(0, 4, (t, k), generator=gen)]
    bad[0, 0] = -1  # and the mask value -1 among the masked ids
    masked = torch.arange(k).unsqueeze(0) != keep.unsqueeze(1)
    ids = torch.where(masked, bad, ids).to(torch.int32)
    return ids, masked, keep


@pytest.mark.parametrize("cache", [True, False])
@pytest.mark.parametrize("mode", ["w4a4", "w4a16"])
def test_masked_slots_are_skipped(gen, cache, mode):
    """A masked slot changes nothing, bit for bit: the layer with top_k=2 and one slot masked
    per token equals the layer with top_k=1 on the valid slots; a token with every slot
    masked gets exactly 0; the weight of a masked slot is never read (NaN there stays out)."""
    from megamoe.backends.torch_ref import TorchBackend

    cfg = SMALL.with_(act_mode=mode)
    wts = synthetic_weights(cfg, seed=4)
    layer = MoELayer(wts, cfg, backend=TorchBackend(cache_dequantized=cache))
    one = MoELayer(wts, cfg.with_(top_k=1), backend=TorchBackend(cache_dequantized=cache))
    t = 41
    x = torch.randn(t, 64, generator=gen).to(torch.bfloat16)
    ids, masked, keep = _one_valid_slot_per_token(gen, t, cfg.num_experts, cfg.top_k)
    assert masked.all(1).any() and not masked.all(1).all() and (ids == -1).any()
    w = torch.rand(t, cfg.top_k, generator=gen) + 0.1
    w = torch.where(masked, torch.full_like(w, float("nan")), w)

    out = layer(x, ids, w, validate=False)
    live = keep < cfg.top_k
    rows = live.nonzero().squeeze(1)
    slot = keep[rows].unsqueeze(1)
    expect = one(x[rows], ids[rows].gather(1, slot), w[rows].gather(1, slot))
    assert torch.isfinite(out).all()
    assert torch.equal(out[rows], expect)
    assert torch.equal(out[~live], torch.zeros_like(out[~live]))
    # the yardstick skips them the same way, and so does the float64 loop
    ref = layer.reference_bf16(x, ids, w, validate=False)
    assert torch.equal(ref[rows], one.reference_bf16(x[rows], ids[rows].gather(1, slot), w[rows].gather(1, slot)))
    assert torch.equal(ref[~live], torch.zeros_like(ref[~live]))
    assert cosine(out.float(), loop_reference(layer, x, ids, torch.nan_to_num(w))) > 0.999


def test_masked_slots_with_shared_expert_and_two_valid_slots(gen):
    """With k=3, tokens keep 0-3 valid slots: equal (to float32 rounding: the experts' GEMMs
    see fewer rows) to the same tokens with the masked slots given weight 0 on a valid expert;
    all-masked tokens get exactly the shared expert."""
    cfg = MoEConfig(128, 64, 8, 3, n_shared_experts=1, shared_intermediate_size=32)
    layer = make_layer(cfg, seed=5)
    t = 29
    x = torch.randn(t, 128, generator=gen)
    w, ids = layer.route(x)
    masked = torch.rand(t, 3, generator=gen) < 0.4
    masked[:3] = True  # some tokens with every slot masked
    out = layer(x, torch.where(masked, torch.full_like(ids, -1), ids), w, validate=False)
    zero_w = layer(x, ids, torch.where(masked, torch.zeros_like(w), w))
    assert rel_err(out, zero_w) < 1e-6
    assert torch.equal(out[:3], layer._shared_expert(x)[:3])  # the same GEMM over the same rows
    assert rel_err(out[3:], layer(x[3:], ids[3:], w[3:])) > 1e-2  # the masks really removed something


def test_validate_still_rejects_masked_ids_from_a_caller(gen):
    layer = make_layer(SMALL)
    x = torch.randn(3, 64, generator=gen)
    ids = torch.tensor([[0, 1], [-1, 2], [3, 4]], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"out of range \[0, 6\): min -1"):
        layer(x, ids, torch.ones(3, 2))


def test_expert_weight_bytes_ignore_masked_ids():
    layer = make_layer(SMALL)
    per = (layer.weights.w13.nbytes() + layer.weights.w2.nbytes()) // SMALL.num_experts
    ids = torch.tensor([[0, -1], [3, 6], [3, -1]])
    assert layer.expert_weight_bytes(ids) == 2 * per


def test_repeated_expert_in_one_token_adds_in_a_fixed_order():
    """docs/FIELD_BUGS.md row 28 on the reference: a token that lists one expert in several
    slots gets each slot's contribution added in expert order, then slot order (never through
    one index_add_ with a repeated index, which is an unordered atomic add on CUDA)."""
    from megamoe import reference

    g = torch.Generator().manual_seed(28)
    t, h, e, k = 9, 16, 4, 4
    x = torch.randn(t, h, generator=g)
    ids = torch.randint(0, e, (t, k), generator=g)
    ids[0] = 2  # every slot on one expert
    ids[1, :3] = 1
    ids[2, 1] = -1  # masked
    w = torch.rand(t, k, generator=g)

    def expert(i, rows):
        return rows * (i + 1.5) + 0.25

    out = reference.routed_experts(x, ids, w, e, expert)
    want = torch.zeros(t, h)
    for i in range(e):
        for tok in range(t):
            for j in range(k):
                if int(ids[tok, j]) == i:
                    want[tok] += expert(i, x[tok:tok + 1])[0] * w[tok, j]
    assert torch.equal(out, want)


class _CopyingBackend:
    """A backend on another device whose prepare_weights makes its own copy of the routed experts
    (as cuda-sm90's re-layout does): only the layer's bookkeeping is exercised, on the meta device."""

    name = "copying"
    copies_routed_weights = True
    device = torch.device("meta")

    def __init__(self):
        self.prepared_from = None

    def prepare_weights(self, weights):
        self.prepared_from = weights
        return weights.to(self.device)


def test_layer_keeps_routed_experts_in_host_memory_when_the_backend_copies_them(monkeypatch):
    """The device holds the routed experts once: the backend's copy; the layer's NVFP4 copy (for its
    reference paths) stays in host memory, and the other weights go to the device as before."""
    import megamoe.moe as moe_mod

    cfg = get_preset("tiny")
    w = synthetic_weights(cfg, seed=3)
    be = _CopyingBackend()
    monkeypatch.setattr(moe_mod, "get_backend", lambda backend, device=None: backend)
    layer = MoELayer(w, cfg, backend=be)
    for t in (layer.weights.w13.data, layer.weights.w13.scale, layer.weights.w2.data, layer.weights.w2.global_scale):
        assert t.device.type == "cpu"
    assert layer.weights.w13.data is w.w13.data  # host tensors are kept, not copied
    assert layer.weights.router_weight.device.type == "meta"
    assert be.prepared_from.w13.data.device.type == "cpu"  # prepared from the host copy: no device copy first
    # a backend that hands back the given tensors (the default) gets everything on its device
    assert not moe_mod.Backend.copies_routed_weights

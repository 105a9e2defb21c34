"""docs/SPEC.md §3.5: a row's output bits do not depend on the rest of its batch (its position,
the batch's size, the other rows), on the CPU torch backend: the router (its float32 GEMM and the
lowest-id tie rule), activation quantization, the expert GEMMs, the combine and the shared
expert. Random rows and near-tied router rows, each alone and inside batches of every size up
to 64 and of sizes that cross the sm90 plan's switch points."""
import pytest
import torch

from _helpers import check_rows_alone_equal_batched, near_tied_rows
from megamoe.invariant import ROW_BLOCK, matmul_rows
from megamoe.moe import MoELayer

# every size up to 64, and sizes around the block edge and the plan's switch points
BATCHES = list(range(1, 65)) + [65, 127, 128, 129, 200, 1024]
# the other cases: the block edges, the plan's switch points and a long batch
SOME_BATCHES = [1, 2, 3, 4, 5, 11, 24, 25, 63, 64, 65, 129, 300]


@pytest.mark.parametrize("case", ["w4a4", "w4a4-dynamic", "w4a16", "sigmoid-groups-shared"])
def test_rows_alone_equal_rows_batched(gen, case):
    over = {"w4a4": {}, "w4a4-dynamic": {"dynamic_act_scale": True}, "w4a16": {"act_mode": "w4a16"},
            "sigmoid-groups-shared": {"scoring": "sigmoid", "n_group": 4, "topk_group": 2, "n_shared_experts": 1,
                                      "shared_intermediate_size": 256, "routed_scaling_factor": 2.5}}[case]
    # preset small (H = 1024): large enough that the CPU GEMM's blocking changes with the rows
    layer = MoELayer.from_preset("small", seed=int(torch.randint(0, 1000, (1,), generator=gen)), backend="torch",
                                 **over)
    probes = torch.cat([torch.randn(4, 1024, generator=gen), near_tied_rows(layer, 4, gen)]).to(torch.bfloat16)
    check_rows_alone_equal_batched(layer, probes, gen, BATCHES if case == "w4a4" else SOME_BATCHES)


def test_v4_hash_and_topk_rows_alone_equal_rows_batched(gen):
    for hash_routing in (False, True):
        layer = MoELayer.from_preset("tiny", backend="torch", scoring="sqrtsoftplus", hash_routing=hash_routing,
                                     swiglu_limit=1.0, n_shared_experts=1, shared_intermediate_size=64,
                                     routed_scaling_factor=1.5)
        probes = torch.cat([torch.randn(3, 256, generator=gen) * 3, near_tied_rows(layer, 3, gen)]).to(torch.bfloat16)
        vocab = layer.weights.tid2eid.shape[0] if hash_routing else None
        ids = torch.randint(0, vocab, (6,), generator=gen) if hash_routing else None
        check_rows_alone_equal_batched(layer, probes, gen, batches=[1, 2, 7, 33, 64, 65, 300],
                                       input_ids=ids, vocab=vocab)


def test_near_tied_rows_are_near_tied(gen):
    # the probe is what it claims: the k-th and (k+1)-th logits agree to float32 rounding
    layer = MoELayer.from_preset("tiny", backend="torch")
    x = near_tied_rows(layer, 16, gen)
    logits = (x.double() @ layer._float32("router_weight").double().T).sort(dim=1, descending=True).values
    k = layer.config.top_k
    assert float((logits[:, k - 1] - logits[:, k]).abs().max()) < 1e-5


def test_matmul_rows_is_blocked_and_exact(gen):
    x, w = torch.randn(ROW_BLOCK * 2 + 5, 96, generator=gen), torch.randn(40, 96, generator=gen)
    y = matmul_rows(x, w)
    torch.testing.assert_close(y, x @ w.T, rtol=1e-5, atol=1e-5)
    for start in (0, 3, ROW_BLOCK - 1, ROW_BLOCK + 2):
        assert torch.equal(matmul_rows(x[start:start + 1], w)[0], y[start])
    assert matmul_rows(x[:0], w).shape == (0, 40)
    with pytest.raises(TypeError):
        matmul_rows(x.double(), w)


def test_batch_invariance_can_be_turned_off_per_layer(gen):
    """The opt-out (docs/SPEC.md §3.5): with ``batch_invariant`` off the router is one GEMM over all
    rows, bit for bit ``x @ W.T``; on (the default) it is the 64-row blocks."""
    layer = MoELayer.from_preset("small", backend="torch")
    assert layer.batch_invariant
    x = torch.randn(200, 1024, generator=gen)
    w = layer._float32("router_weight")
    captured = {}
    import megamoe.moe as moe_module

    real_route = moe_module.route

    def spy(logits, *a, **kw):
        captured["logits"] = logits
        return real_route(logits, *a, **kw)

    moe_module.route = spy
    try:
        layer.route(x)
        assert torch.equal(captured["logits"], matmul_rows(x, w))
        layer.batch_invariant = False
        layer.route(x)
        assert torch.equal(captured["logits"], x @ w.T)
        y_fast = layer(x)
        layer.batch_invariant = True
        # the two modes differ only by float32 rounding
        torch.testing.assert_close(y_fast, layer(x), rtol=1e-3, atol=1e-3)
    finally:
        moe_module.route = real_route

"""SPEC §3 routing against hand-checked examples."""
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

"""The cuda-sm90 workspace cache (host-side logic, no GPU): bounded, graph-captured ones kept; where the gemm1 input
is written in token order (the plan's answer)."""
import pytest
import torch

from megamoe import _ext
from megamoe.backends import cuda_sm90
from megamoe.presets import get_preset


class FakeWorkspace:
    def __init__(self, t, h, i, k, e, device):
        self.t = t


def make_backend(monkeypatch):
    monkeypatch.setattr(cuda_sm90, "_Workspace", FakeWorkspace)
    be = cuda_sm90.CudaSm90Backend.__new__(cuda_sm90.CudaSm90Backend)
    be._device = torch.device("cuda", 0)
    be._workspaces = cuda_sm90.OrderedDict()
    be._pinned = set()
    return be


def test_workspaces_are_bounded_and_reused(monkeypatch):
    be = make_backend(monkeypatch)
    cfg = get_preset("tiny")
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    first = be.workspace(1, cfg)
    assert be.workspace(1, cfg) is first
    for t in range(2, 40):
        be.workspace(t, cfg)
    assert len(be._workspaces) == be.MAX_WORKSPACES
    assert [k[0] for k in be._workspaces] == list(range(32, 40))


def test_graph_captured_workspace_is_never_evicted(monkeypatch):
    be = make_backend(monkeypatch)
    cfg = get_preset("tiny")
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    captured = be.workspace(7, cfg)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    for t in range(100, 130):
        be.workspace(t, cfg)
    assert be.workspace(7, cfg) is captured
    assert len(be._workspaces) == be.MAX_WORKSPACES


def test_one_value():
    assert cuda_sm90.one_value(torch.full((5,), 0.25))
    assert not cuda_sm90.one_value(torch.tensor([0.25, 0.25, 0.5]))
    assert not cuda_sm90.one_value(torch.tensor([float("nan")] * 2))
    assert not cuda_sm90.one_value(torch.empty(0))
    assert not cuda_sm90.one_value(None)


@pytest.mark.skipif(not _ext.has_part("sm90"), reason=f"megamoe._C built without sm90 kernels (parts: {_ext.built_parts()})")
def test_w4a4_token_order_only_where_a_tokens_slots_quantize_alike():
    """W4A16 from TOKEN_ORDER_FROM tokens; W4A4 from there only with a per-row dynamic scale or one static scale
    for every expert (per-expert scales quantize each slot differently: gathered per slot). The answer is the C++
    plan's (token_order), with the threshold the module passes it."""
    cfg = get_preset("tiny").with_(act_mode="w4a4")
    t = cuda_sm90.TOKEN_ORDER_FROM

    def prep(scale):
        return cuda_sm90.PreparedSm90(None, None, None, None, None, None, w13_input_scale=scale, w2_input_scale=None,
                                      w13_input_scale_uniform=cuda_sm90.one_value(scale))

    order = cuda_sm90.CudaSm90Backend._token_order
    per_expert, one = prep(torch.tensor([0.5, 0.25])), prep(torch.tensor([0.5, 0.5]))
    assert not order(per_expert, cfg, t)
    assert order(one, cfg, t) and not order(one, cfg, t - 1)
    assert order(per_expert, cfg.with_(dynamic_act_scale=True), t)
    assert order(prep(None), cfg, t)
    assert order(per_expert, cfg.with_(act_mode="w4a16"), t) and not order(per_expert, cfg.with_(act_mode="w4a16"), t - 1)
    assert t == _ext.ext.sm90_token_order_from


@pytest.mark.skipif(not _ext.has_part("sm90"), reason=f"megamoe._C built without sm90 kernels (parts: {_ext.built_parts()})")
def test_the_backend_passes_its_token_order_threshold_to_the_plan(monkeypatch):
    """Moving cuda_sm90.TOKEN_ORDER_FROM moves the plan's token order (a new plan, not a cached one)."""
    be = cuda_sm90.CudaSm90Backend.__new__(cuda_sm90.CudaSm90Backend)
    be.kernel, be.tokens_per_pass, be._plans = "auto", 0, {}
    t = cuda_sm90.TOKEN_ORDER_FROM
    assert be.plan(40, 4096, 2048, 256, True, True, False, t, True).token_order
    monkeypatch.setattr(cuda_sm90, "TOKEN_ORDER_FROM", t + 1)
    assert not be.plan(40, 4096, 2048, 256, True, True, False, t, True).token_order
    assert be.plan(40, 4096, 2048, 256, True, True, False, t + 1, True).token_order

"""The cuda-sm90 workspace cache (host-side logic, no GPU): bounded, graph-captured ones kept."""
import torch

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

"""cuda-sm90 align step of the forward chain (routing -> grouped rows): one block, and the two-kernel
multi-block form it takes above 8192 entries, both give a valid grouping of exactly the valid entries,
and the forward is bit-identical with either."""
from __future__ import annotations

import pytest
import torch

from _helpers import backend_or_skip, cosine, routed_inputs
from _helpers import sm90_and_torch_layers as _layers

pytestmark = pytest.mark.gpu


def _align(ids: torch.Tensor, e: int, scratch):
    from megamoe import _ext

    r = ids.numel()

    def poisoned(n):
        return torch.full((n,), -7, dtype=torch.int32, device="cuda")

    off, act, num, row_token, entry_row = poisoned(e + 1), poisoned(e), poisoned(1), poisoned(r), poisoned(r)
    _ext.ext.sm90_moe_align(ids, e, off, act, num, row_token, entry_row, torch.cuda.current_stream().cuda_stream,
                            scratch=scratch)
    torch.cuda.synchronize()
    return off.cpu(), act.cpu(), num.cpu(), row_token.cpu(), entry_row.cpu()


@pytest.mark.parametrize("t,k,e,dtype", [(1, 6, 256, torch.int32), (40, 8, 256, torch.int64),
                                         (1366, 6, 256, torch.int32), (8192, 6, 256, torch.int32),
                                         (3000, 8, 64, torch.int64), (2500, 4, 1500, torch.int32)])
def test_align_groups_every_valid_entry_once(t, k, e, dtype, gen):
    """Random ids with dropped ones (-1 and >= E); with and without the multi-block scratch (used above
    8192 entries): offsets = exclusive cumsum of the counts, the active experts ascending, every valid
    entry on its own row inside its expert's range, row_token = its token, dropped entries -1."""
    backend_or_skip("cuda-sm90")
    from megamoe import _ext

    ids = torch.randint(-1, e + 2, (t, k), generator=gen).to(dtype)
    flat = ids.flatten().long()
    valid = (flat >= 0) & (flat < e)
    counts = torch.bincount(flat[valid], minlength=e)
    want_off = torch.cat([torch.zeros(1, dtype=torch.long), counts.cumsum(0)]).int()
    want_act = torch.nonzero(counts > 0).flatten().int()
    scratch = torch.full((_ext.ext.sm90_align_scratch_size(t * k, e),), -7, dtype=torch.int32, device="cuda")
    for sc in (None, scratch):
        off, act, num, row_token, entry_row = _align(ids.cuda(), e, sc)
        label = (t, k, e, "multi-block" if sc is not None and t * k > 8192 else "one block")
        assert torch.equal(off, want_off), label
        assert int(num[0]) == want_act.numel(), label
        assert torch.equal(act[: want_act.numel()], want_act), label
        assert (entry_row[~valid] == -1).all(), label
        rows = entry_row[valid].long()
        assert rows.unique().numel() == int(valid.sum()), label
        ev = flat[valid]
        assert ((rows >= want_off[ev].long()) & (rows < want_off[ev + 1].long())).all(), label
        assert torch.equal(row_token[rows], (torch.nonzero(valid).flatten() // k).int()), label


def test_forward_same_bits_with_one_block_align(gen, monkeypatch):
    """T*k = 9000 > 8192: the forward with the multi-block align equals the one with the one-block align
    bit for bit (rows inside an expert may come in another order; no result depends on it), and the
    torch backend within cosine 0.9999."""
    from megamoe import _ext

    gpu, ref = _layers("tiny", act_mode="w4a16", num_experts=16, top_k=3)
    t = 3000
    x, ids, w = routed_inputs(gpu, t, gen)
    multi = gpu.forward(x, ids, w).clone()
    real = _ext.ext.sm90_moe_align

    def one_block(*args, **kw):
        kw.pop("scratch", None)
        return real(*args, **kw)

    monkeypatch.setattr(_ext.ext, "sm90_moe_align", one_block)
    single = gpu.forward(x, ids, w)
    assert torch.isfinite(multi.float()).all()
    assert torch.equal(multi, single)
    c = cosine(multi.float(), ref.forward(x, ids, w).float())
    assert c >= 0.9999, c

"""cuda-sm90 align step of the forward chain (routing -> grouped rows): one block, and the two-kernel
multi-block form it takes above 8192 entries, both give a valid grouping of exactly the valid entries,
and the forward is bit-identical with either; the per-slot L1 input in token order (W4A16, and W4A4 quantized once
per token) equals the gathered one; the combine reads bf16 expert rows exactly."""
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


@pytest.mark.parametrize("t,k,e,dtype", [(1, 6, 256, torch.int32), (42, 6, 256, torch.int32), (30, 8, 5, torch.int64),
                                         (40, 8, 256, torch.int64),
                                         (1366, 6, 256, torch.int32), (8192, 6, 256, torch.int32),
                                         (3000, 8, 64, torch.int64), (2500, 4, 1500, torch.int32)])
def test_align_groups_every_valid_entry_once(t, k, e, dtype, gen):
    """Random ids with dropped ones (-1 and >= E); with and without the multi-block scratch (used above
    8192 entries): offsets = exclusive cumsum of the counts, the active experts ascending, every valid
    entry on its own row inside its expert's range, row_token = its token, dropped entries -1. Up to 256
    entries (one warp per 32 entries, taking turns) the rows of an expert are in entry order."""
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
        if t * k <= 256:  # entry order: row = offset of the expert + earlier entries of the same expert
            earlier = torch.tensor([int((ev[:i] == ev[i]).sum()) for i in range(ev.numel())], dtype=torch.long)
            assert torch.equal(rows, want_off[ev].long() + earlier), label


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


@pytest.mark.parametrize("k,src_dtype", [(6, torch.bfloat16), (8, torch.float32), (16, torch.float16)])
def test_token_order_l1_input_equals_gathered(k, src_dtype, gen):
    """The per-slot W4A16 L1 input written in token order (each row of x read once, stored into its k grouped
    rows through entry_row) equals the one gathered per slot through row_token, bit for bit, in operand and lane
    order. Random ids with dropped ones (-1 and >= E); rows past the valid ones keep their poison."""
    backend_or_skip("cuda-sm90")
    from megamoe import _ext
    from megamoe.backends.cuda_common import current_stream

    t, h, e = 300, 448, 40
    ids = torch.randint(-1, e + 2, (t, k), generator=gen).int()
    off, _, _, row_token, entry_row = _align(ids.cuda(), e, None)
    r, total = t * k, int(off[-1])
    x = (torch.randn((t, h), generator=gen) * torch.exp(torch.randn((t, 1), generator=gen) * 2)).to(src_dtype).cuda()
    stream = current_stream()
    for lane in (False, True):
        gathered = torch.full((r, h), float("nan"), dtype=torch.bfloat16, device="cuda")
        scattered = torch.full_like(gathered, float("nan"))
        _ext.ext.sm90_stage_bf16(x, row_token[:total].cuda(), off[-1:].cuda(), gathered, stream, lane_order=lane)
        _ext.ext.sm90_scatter_bf16(x, entry_row.cuda(), k, scattered, stream, lane_order=lane)
        g, s = gathered.cpu(), scattered.cpu()
        assert not torch.isnan(g[:total]).any() and torch.isnan(g[total:]).all(), (k, lane)
        assert torch.equal(g.view(torch.int16), s.view(torch.int16)), (k, lane)
    with pytest.raises(Exception, match="scatter_bf16"):
        _ext.ext.sm90_scatter_bf16(x, entry_row[: r - 1].cuda(), k, scattered, stream)


@pytest.mark.parametrize("k,dynamic,src_dtype", [(6, False, torch.bfloat16), (8, True, torch.bfloat16),
                                                 (3, False, torch.float32), (16, True, torch.float16)])
def test_token_order_w4a4_l1_input_equals_gathered(k, dynamic, src_dtype, gen):
    """The W4A4 L1 input quantized once per token and stored into its k grouped rows through entry_row
    (``scatter_rows``) equals the per-slot quantization gathered through row_token, bit for bit, in operand and
    lane order: with one static scale for every expert, and with the per-row dynamic scale (whose row scales
    match too). Random ids with dropped ones; rows past the valid ones keep their poison; bad arguments raise."""
    backend_or_skip("cuda-sm90")
    from megamoe.backends.cuda_common import GS_PER_EXPERT, GS_PER_ROW_DYNAMIC, GS_SINGLE, common_ext, current_stream

    q = common_ext().quantize_nvfp4
    t, h, e = 300, 448, 40
    ids = torch.randint(-1, e + 2, (t, k), generator=gen).int()
    off, _, _, row_token, entry_row = _align(ids.cuda(), e, None)
    r, total = t * k, int(off[-1])
    x = (torch.randn((t, h), generator=gen) * torch.exp(torch.randn((t, 1), generator=gen) * 2)).to(src_dtype).cuda()
    gs = torch.full((e,), float(x.float().abs().max()) / (6 * 448) * 0.7, device="cuda")  # some blocks saturate
    stream = current_stream()
    for lane in (False, True):
        outs = []
        for token_order in (False, True):
            dq = torch.full((r, h), float("nan"), dtype=torch.bfloat16, device="cuda")
            rs = torch.full((r,), float("nan"), device="cuda")
            if token_order:
                q(x, None if dynamic else gs[:1], GS_PER_ROW_DYNAMIC if dynamic else GS_SINGLE, None, None, None, None,
                  None, None, 0, dq, rs if dynamic else None, stream, dequant_lane_order=lane,
                  scatter_rows=entry_row.cuda(), scatter_k=k)
            else:
                q(x, None if dynamic else gs, GS_PER_ROW_DYNAMIC if dynamic else GS_PER_EXPERT, row_token.cuda(),
                  off.cuda(), None, None, None, None, 0, dq, rs if dynamic else None, stream, dequant_lane_order=lane)
            outs.append((dq.cpu(), rs.cpu()))
        (g, grs), (s_, srs) = outs
        assert not torch.isnan(g[:total]).any() and torch.isnan(g[total:]).all(), (k, lane)
        assert (g[:total] != 0).float().mean() > 0.5, (k, lane)  # not a zero operand
        assert torch.equal(g.view(torch.int16), s_.view(torch.int16)), (k, lane, dynamic)
        if dynamic:
            assert torch.isfinite(grs[:total]).all() and torch.isnan(grs[total:]).all()
            assert torch.equal(grs.view(torch.int32), srs.view(torch.int32))  # bits: the poison is NaN
    dq = torch.empty((r, h), dtype=torch.bfloat16, device="cuda")
    with pytest.raises(Exception, match="scatter_rows"):
        q(x, gs[:1], GS_SINGLE, None, None, None, None, None, None, 0, dq, None, stream,
          scatter_rows=entry_row[: r - 1].cuda(), scatter_k=k)
    with pytest.raises(Exception, match="scatter_rows"):
        q(x, gs[:1], GS_SINGLE, None, None, None, torch.empty((t, h // 2), dtype=torch.uint8, device="cuda"), None,
          None, 0, dq, None, stream, scatter_rows=entry_row.cuda(), scatter_k=k)


@pytest.mark.parametrize("k,src_dtype,ids_dtype", [(6, torch.bfloat16, torch.int32), (8, torch.float32, torch.int64),
                                                     (1, torch.float16, torch.int32)])
def test_one_token_w4a4_l1_input_by_row_experts_equals_gathered(k, src_dtype, ids_dtype, gen):
    """One token's W4A4 L1 input without the align kernel: row j = x's row quantized with the static scale of expert
    ids[j] (``row_experts``; scales differing per expert) equals, bit for bit, the per-slot quantization of the
    aligned rows (row entry_row[j]), in operand and lane order; the rows of dropped ids (-1, E) keep their poison;
    bad arguments raise."""
    backend_or_skip("cuda-sm90")
    from megamoe.backends.cuda_common import GS_PER_EXPERT, GS_SINGLE, common_ext, current_stream

    q = common_ext().quantize_nvfp4
    h, e = 448, 40
    ids = torch.randperm(e, generator=gen)[:k].to(ids_dtype)
    if k > 2:
        ids[1], ids[-1] = -1, e
    off, _, _, row_token, entry_row = _align(ids.view(1, k).int().cuda(), e, None)
    total = int(off[-1])
    x = (torch.randn((1, h), generator=gen) * 3).to(src_dtype).cuda()
    gs = (float(x.float().abs().max()) / (6 * 448) * (0.5 + torch.rand((e,), generator=gen))).cuda()
    stream = current_stream()
    valid = (ids >= 0) & (ids < e)
    for lane in (False, True):
        grouped = torch.full((k, h), float("nan"), dtype=torch.bfloat16, device="cuda")
        direct = torch.full_like(grouped, float("nan"))
        q(x, gs, GS_PER_EXPERT, row_token.cuda(), off.cuda(), None, None, None, None, 0, grouped, None, stream,
          dequant_lane_order=lane)
        q(x, gs, GS_PER_EXPERT, torch.zeros(k, dtype=torch.int32, device="cuda"), None, None, None, None, None, 0,
          direct, None, stream, dequant_lane_order=lane, row_experts=ids.cuda())
        g, d = grouped.cpu(), direct.cpu()
        er = entry_row.cpu().long()
        assert torch.equal(er >= 0, valid) and total == int(valid.sum()), (k, lane)
        assert (d[valid] != 0).float().mean() > 0.5, (k, lane)  # not a zero operand
        assert torch.equal(d[valid].view(torch.int16), g[er[valid]].view(torch.int16)), (k, lane)
        assert torch.isnan(d[~valid]).all(), (k, lane)
    dq = torch.empty((k, h), dtype=torch.bfloat16, device="cuda")
    rows0 = torch.zeros(k, dtype=torch.int32, device="cuda")
    with pytest.raises(Exception, match="row_experts"):  # one id per row
        q(x, gs, GS_PER_EXPERT, rows0, None, None, None, None, None, 0, dq, None, stream, row_experts=ids[:-1].cuda())
    with pytest.raises(Exception, match="row_experts"):  # the per-expert scales only
        q(x, gs[:1], GS_SINGLE, rows0, None, None, None, None, None, 0, dq, None, stream, row_experts=ids.cuda())
    with pytest.raises(Exception, match="row_experts"):
        q(x, gs, GS_PER_EXPERT, rows0, None, None, None, None, None, 0, dq, None, stream,
          row_experts=ids.cuda().float())


def _assert_token_order_forward_equals_gathered(gpu, ref, t, gen, monkeypatch, dtype=torch.bfloat16):
    """gpu's forward of t tokens (wgmma tile 128, two dropped entries among the ids) equals, bit for bit, the one
    with the L1 input gathered per slot (TOKEN_ORDER_FROM out of reach), and ref's within cosine 0.9999. The
    layer has 16 experts."""
    from megamoe.backends import cuda_sm90

    gpu.backend.kernel = "wgmma128"
    try:
        x, ids, w = routed_inputs(gpu, t, gen, dtype=dtype)
        ids = ids.clone()
        ids[5, 1], ids[77, 0] = -1, 16  # dropped entries
        token_order = gpu.forward(x, ids, w, validate=False).clone()
        monkeypatch.setattr(cuda_sm90, "TOKEN_ORDER_FROM", 1 << 40)
        gathered = gpu.forward(x, ids, w, validate=False)
    finally:
        gpu.backend.kernel = "auto"
    assert torch.isfinite(token_order.float()).all()
    assert torch.equal(token_order, gathered)
    c = cosine(token_order.float(), ref.forward(x, ids, w, validate=False).float())
    assert c >= 0.9999, c


@pytest.mark.parametrize("mode", ["w4a4-one-scale", "w4a4-dynamic", "w4a4-per-expert"])
def test_w4a4_forward_same_bits_in_token_order(mode, gen, monkeypatch):
    """From TOKEN_ORDER_FROM tokens a W4A4 L1 input that is the same in all of a token's slots (one static scale
    for every expert, or the per-row dynamic scale) is quantized once per token; the forward equals the per-slot
    one bit for bit (wgmma tile 128), with dropped entries among the ids, and the torch backend within cosine
    0.9999. Per-expert static scales keep the per-slot quantization."""
    from megamoe.backends import cuda_sm90
    from megamoe.moe import MoELayer

    gpu, _ = _layers("tiny", act_mode="w4a4", num_experts=16, top_k=3, dynamic_act_scale=mode == "w4a4-dynamic")
    w = gpu.weights
    assert w.w13_input_scale is not None and w.w13_input_scale.unique().numel() > 1  # per-expert as calibrated
    if mode == "w4a4-one-scale":
        import dataclasses

        w = dataclasses.replace(w, w13_input_scale=torch.full_like(w.w13_input_scale, float(w.w13_input_scale.max())))
        gpu = MoELayer(w, gpu.config, backend="cuda-sm90")
    ref = MoELayer(w, gpu.config, backend="torch", device="cuda")
    t = cuda_sm90.TOKEN_ORDER_FROM + 37
    assert gpu.backend._token_order(gpu._prepared, gpu.config, t) == (mode != "w4a4-per-expert")
    assert not gpu.backend._token_order(gpu._prepared, gpu.config, cuda_sm90.TOKEN_ORDER_FROM - 1)
    _assert_token_order_forward_equals_gathered(gpu, ref, t, gen, monkeypatch)


@pytest.mark.parametrize("x_dtype", [torch.bfloat16, torch.float32])
def test_forward_same_bits_in_token_order(x_dtype, gen, monkeypatch):
    """From TOKEN_ORDER_FROM tokens the W4A16 L1 input is written in token order; the forward equals the one that
    gathers it per slot bit for bit (wgmma tile 128, which stages x per slot), with dropped entries among the ids,
    and the torch backend within cosine 0.9999."""
    from megamoe.backends import cuda_sm90

    gpu, ref = _layers("tiny", act_mode="w4a16", num_experts=16, top_k=3)
    _assert_token_order_forward_equals_gathered(gpu, ref, cuda_sm90.TOKEN_ORDER_FROM + 37, gen, monkeypatch, x_dtype)


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
def test_combine_reads_bf16_rows_exactly(out_dtype, gen):
    """The combine of bf16 expert rows (what the L2 GEMM writes with bf16 x) equals the combine of the same values
    held in fp32, bit for bit (bf16 -> fp32 is exact; same fp32 sum in j order), dropped entries skipped; an fp16
    y and a y whose width is not out's are refused."""
    backend_or_skip("cuda-sm90")
    from megamoe import _ext
    from megamoe.backends.cuda_common import current_stream

    t, k, h, e = 257, 6, 520, 40
    ids = torch.randint(-1, e + 2, (t, k), generator=gen).int()
    _, _, _, _, entry_row = _align(ids.cuda(), e, None)
    r = t * k
    y = (torch.randn((r, h), generator=gen) * torch.exp(torch.randn((r, 1), generator=gen) * 3)).to(torch.bfloat16)
    w = torch.rand((t, k), generator=gen).cuda()
    stream = current_stream()
    outs = []
    for yin in (y.cuda(), y.float().cuda()):
        out = torch.full((t, h), float("nan"), dtype=out_dtype, device="cuda")
        _ext.ext.sm90_moe_combine(yin, entry_row.cuda(), w, out, stream)
        outs.append(out.cpu())
    assert torch.isfinite(outs[0].float()).all()
    assert torch.equal(outs[0], outs[1])
    valid = (entry_row.view(t, k) >= 0)
    rows = entry_row.view(t, k).clamp(min=0).long()
    want = (w.cpu().unsqueeze(-1) * y.float()[rows] * valid.unsqueeze(-1)).sum(1)
    tol = 8e-3 if out_dtype == torch.bfloat16 else 1e-5  # the output's rounding
    assert (outs[0].float() - want).abs().max() <= tol * want.abs().max()
    with pytest.raises(Exception, match="moe_combine"):
        _ext.ext.sm90_moe_combine(y.half().cuda(), entry_row.cuda(), w, out.cuda(), stream)
    with pytest.raises(Exception, match="moe_combine"):
        _ext.ext.sm90_moe_combine(y[:, :-4].contiguous().cuda(), entry_row.cuda(), w, out.cuda(), stream)


@pytest.mark.parametrize("k,h", [(6, 1024), (12, 1024), (6, 1032)])
def test_combine_same_bits_batched_or_not(k, h, gen):
    """The combine reads a token's slots in batches of 8 where its grid is small (up to 2^16 threads) and one slot
    at a time above, bf16 rows there 4 chunks per thread where the hidden size is a multiple of 1024; the sums and
    their order are the same. The first tokens of a combine past the switch equal a combine of those tokens alone
    (below it) bit for bit, bf16 and fp32 rows, dropped entries among the ids; k = 12: a full batch and a partial
    one; h = 1032: bf16 rows one chunk per thread."""
    backend_or_skip("cuda-sm90")
    from megamoe import _ext
    from megamoe.backends.cuda_common import current_stream

    t, e, few = 1100, 40, 64  # 1100 * h / 8 > 2^17 threads (past the switch); 64 tokens: 64 * h / 8 < 2^16
    ids = torch.randint(-1, e + 2, (t, k), generator=gen).int()
    _, _, _, _, entry_row = _align(ids.cuda(), e, None)
    y = (torch.randn((t * k, h), generator=gen) * torch.exp(torch.randn((t * k, 1), generator=gen))).to(torch.bfloat16)
    w = torch.rand((t, k), generator=gen)
    stream = current_stream()
    for yin in (y.cuda(), y.float().cuda()):
        outs = []
        for n in (t, few):
            out = torch.full((n, h), float("nan"), dtype=torch.float32, device="cuda")
            _ext.ext.sm90_moe_combine(yin, entry_row.cuda(), w[:n].contiguous().cuda(), out, stream)
            outs.append(out.cpu())
        assert torch.isfinite(outs[0]).all()
        assert torch.equal(outs[0][:few], outs[1])
        valid = entry_row.view(t, k)[:few] >= 0
        rows = entry_row.view(t, k)[:few].clamp(min=0).long()
        want = (w[:few].unsqueeze(-1) * y.float()[rows] * valid.unsqueeze(-1)).sum(1)
        assert (outs[1] - want).abs().max() <= 1e-5 * want.abs().max()

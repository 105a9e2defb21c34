"""cuda-sm90 MoE forward: against the torch backend (same NVFP4 semantics) and the BF16
reference, T sweep, odd shapes, NaN in padded rows, determinism, CUDA graphs."""
from __future__ import annotations

import pytest
import torch


from _helpers import backend_or_skip, capture_graph, cosine, min_cosine_vs_torch, rel_err
from _helpers import routed_inputs as _route
from _helpers import sm90_and_torch_layers as _layers

pytestmark = pytest.mark.gpu


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The bits of a 2- or 4-byte float tensor as integers (NaN compares equal to the same NaN)."""
    return t.view(torch.int16 if t.element_size() == 2 else torch.int32)


def _forward_vs_torch(gpu, ref, t, gen, label):
    """t routed random tokens through both layers: the output must be finite and within cosine 0.9999
    of the torch backend's (W4A4 below 64 tokens: min_cosine_vs_torch). Returns x, ids, w and both outputs
    (float32)."""
    x, ids, w = _route(gpu, t, gen)
    out = gpu.forward(x, ids, w).float()
    exp = ref.forward(x, ids, w).float()
    c, r = cosine(out, exp), rel_err(out, exp)
    print(f"{label} T={t}: cosine vs torch backend {c:.7f}, rel_err {r:.2e}")
    assert torch.isfinite(out).all()
    assert c >= min_cosine_vs_torch(gpu.config.act_mode, t), (t, c, r)
    return x, ids, w, out, exp


@pytest.mark.parametrize("mode", ["w4a4", "w4a16"])
@pytest.mark.parametrize("dynamic", [False, True])
def test_moe_matches_torch_backend(mode, dynamic, gen):
    gpu, ref = _layers(act_mode=mode, dynamic_act_scale=dynamic)
    for t in (1, 5, 64, 300):
        x, ids, w, out, exp = _forward_vs_torch(gpu, ref, t, gen, f"moe {mode} dynamic={dynamic}")
        if mode == "w4a4" and t >= 64:  # a handful of tokens is too noisy a sample
            b = gpu.reference_bf16(x, ids, w)
            cb, cref = cosine(out, b), cosine(exp, b)
            print(f"   vs BF16 reference: cosine {cb:.5f} (torch backend's W4A4: {cref:.5f})")
            # docs/SPEC.md §3 asks >= 0.99; the reference W4A4 semantics itself reaches only what the torch
            # backend prints here on these synthetic weights (printed above), so the
            # kernel is held to that value, not to a number the reference does not reach.
            assert cb >= cref - 1e-3, (t, cb, cref)
            if dynamic:
                # with static scales these inputs (x times 2) pass the calibrated range in nearly every
                # row (99.6% in a CPU draw of the small preset), and the clipped format's cosine is the
                # reference's own, held above; per-row scales never clip
                assert cb >= 0.95, (t, cb)


def test_moe_t_sweep_odd_shapes(gen):
    """docs/FIELD_BUGS.md rows 5, 8, 9, 14: T = 1..300, I = 464, H % 128 != 0, many experts; both GEMM kernels."""
    gpu, ref = _layers("tiny", hidden_size=1040, intermediate_size=464, num_experts=16, top_k=3)
    worst = (1.0, 0)
    for t in range(1, 301):
        if t % 25 == 1:
            print(f"sweep T={t}", flush=True)
        x, ids, w = _route(gpu, t, gen)
        out = gpu.forward(x, ids, w, validate=False).float()
        exp = ref.forward(x, ids, w, validate=False).float()
        c = cosine(out, exp)
        worst = min(worst, (c, t))
        assert torch.isfinite(out).all(), t
        assert c >= min_cosine_vs_torch(gpu.config.act_mode, t), (t, c)
    print(f"T sweep 1..300: worst cosine {worst[0]:.7f} at T={worst[1]}")


def test_moe_v4_flash_shape_decode_and_prefill(gen):
    gpu, ref = _layers("v4-flash", num_experts=32)
    for t in (1, 7, 200):
        x, ids, w = _route(gpu, t, gen)
        c = cosine(gpu.forward(x, ids, w).float(), ref.forward(x, ids, w).float())
        print(f"v4-flash(E=32) T={t}: cosine {c:.7f}")
        assert c >= min_cosine_vs_torch(gpu.config.act_mode, t)


def _wgmma_kernels(fn) -> list[str]:
    """The names of the wgmma GEMM kernels that fn() runs, one per launch (torch.profiler)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return [e.name for e in prof.events() if "wg_gemm_kernel<" in e.name]


@pytest.mark.parametrize("mode,dynamic", [("w4a16", False), ("w4a4", False), ("w4a4", True)])
def test_one_token_runs_on_64_row_blocks_where_the_busiest_sm_gains(mode, dynamic, gen):
    """One token of V4-Flash's shape (k = 6, H = 4096, I = 2048): each GEMM's grid is 6 x 64 blocks of 64 rows
    (tile 8) or 6 x 32 of 128 (tile 32); on 132 SMs tile 8 puts 3 of 64 rows on the busiest SM where tile 32 puts 2 of
    128, so the launcher runs tile 8 (plan_tile8), except for a GEMM that quantizes h (W4A4 with a static scale:
    gemm1). V3's (k = 8, H = 7168) puts 4 of 64 rows or 2 of 128: tile 32 stays. Both near the
    torch backend (min_cosine_vs_torch; the bits equal tile 32's: tests/gpu/test_gpu_batch_invariance.py)."""
    backend_or_skip("cuda-sm90")
    sm = torch.cuda.get_device_properties(0).multi_processor_count
    for preset, k, expect in (("v4-flash", 6, 384 <= 3 * sm and -(-384 // sm) < 2 * -(-192 // sm)),
                              ("v3", 8, False)):
        gpu, ref = _layers(preset, num_experts=32, act_mode=mode, dynamic_act_scale=dynamic)
        assert gpu.config.top_k == k
        x, ids, w = _route(gpu, 1, gen)
        names = _wgmma_kernels(lambda: gpu.forward(x, ids, w))
        tile8 = [n for n in names if "wg_gemm_kernel<8," in n]
        want = (2 if mode == "w4a16" or dynamic else 1) if expect else 0
        assert len(names) == 2 and len(tile8) == want, (preset, sorted(names))
        c = cosine(gpu.forward(x, ids, w).float(), ref.forward(x, ids, w).float())
        print(f"{preset} {mode} dynamic={dynamic} T=1: {sorted(names)}, cosine {c:.7f}")
        assert c >= min_cosine_vs_torch(mode, 1), (preset, c)


@pytest.mark.parametrize("dynamic", [False, True])
def test_nan_padding_rows_do_not_leak(dynamic, gen):
    """docs/FIELD_BUGS.md row 6: padded (graph) rows full of NaN/Inf leave the real rows bit-identical."""
    gpu, _ = _layers(dynamic_act_scale=dynamic)
    # T stays below the streaming/wgmma switch for both forwards, so both use the same kernels
    t, pad = 21, 19
    x, ids, w = _route(gpu, t + pad, gen)
    real = gpu.forward(x[:t].contiguous(), ids[:t].contiguous(), w[:t].contiguous())
    xp = x.clone()
    xp[t:] = float("nan")
    xp[t::2] = float("inf")
    padded = gpu.forward(xp, ids, w)
    assert torch.equal(padded[:t], real), "padding rows changed real rows"


def test_repeated_forwards_bit_identical(gen):
    gpu, _ = _layers()
    for t in (3, 129, 1000):
        x, ids, w = _route(gpu, t, gen)
        first = gpu.forward(x, ids, w).clone()
        for _ in range(3):
            assert torch.equal(gpu.forward(x, ids, w), first), t


@pytest.mark.parametrize("mode", ["w4a4", "w4a16"])
@pytest.mark.parametrize("t", [1, 8, 32, 257])
def test_cuda_graph_replay_equals_eager(t, mode, gen):
    gpu, _ = _layers(act_mode=mode)
    x, ids, w = _route(gpu, t, gen)
    eager = gpu.forward(x, ids, w).clone()
    xs, ids_s, ws_ = x.clone(), ids.clone(), w.clone()
    g, out = capture_graph(gpu.forward, xs, ids_s, ws_, validate=False)
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)
    # new inputs copied into the captured buffers give the new eager result
    x2, ids2, w2 = _route(gpu, t, gen)
    xs.copy_(x2), ids_s.copy_(ids2), ws_.copy_(w2)
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, gpu.forward(x2, ids2, w2))


@pytest.mark.parametrize("shape", [(1040, 464), (1088, 576)], ids=["K%64!=0", "K%64==0"])
def test_fused_w4a16_equals_staged(shape, gen):
    """W4A16 with bf16 x: with the streaming kernel L1 gathers x itself, and L1 writes h as the bf16 L2
    operand with every kernel; float32 x holding the same bf16 values is staged first. Same sums, same
    roundings up to the L2 GEMM: its bf16 input (h) is bit-identical and its output rows, bf16 with bf16 x and
    fp32 with fp32 x, are the same values rounded (the bf16 row is the fp32 row rounded to nearest even; rows
    compared per (token, slot) through entry_row), over
    T = 1..40 and a few larger T (streaming one tile per pass, wgmma or the streaming fallback with several tiles
    per pass above: E = 16, k = 3), workspace poisoned before each forward."""
    gpu, ref = _layers("tiny", act_mode="w4a16", hidden_size=shape[0], intermediate_size=shape[1], num_experts=16,
                       top_k=3)
    for t in list(range(1, 41)) + [47, 97, 128, 700]:
        x, ids, w = _route(gpu, t, gen)
        outs, h_ops, y_rows = [], [], []
        ws = gpu.backend.workspace(t, gpu.config)
        for xin in (x, x.float()):
            for buf in (ws.h, ws.a1, ws.a2, ws.y, ws.y16, ws.x_op):
                buf.fill_(float("nan"))
            outs.append(gpu.forward(xin, ids, w, validate=False).to(torch.bfloat16))
            # each (token, slot)'s grouped row (the order of rows inside an expert is not fixed)
            rows = ws.entry_row[: t * gpu.config.top_k].long()
            rows = rows[rows >= 0]
            h_ops.append(ws.a2[rows].clone())
            y_rows.append((ws.y16 if xin.dtype == torch.bfloat16 else ws.y)[rows].clone())
        assert torch.isfinite(outs[0].float()).all(), t
        assert torch.equal(h_ops[0].view(torch.int16), h_ops[1].view(torch.int16)), t
        assert torch.isfinite(y_rows[0].float()).all(), t
        assert torch.equal(y_rows[0].view(torch.int16), y_rows[1].to(torch.bfloat16).view(torch.int16)), t
        assert cosine(outs[0].float(), outs[1].float()) >= 0.99999, t
        if t in (1, 8, 26, 33, 128):
            for out in outs:
                c = cosine(out.float(), ref.forward(x, ids, w, validate=False).float())
                assert c >= 0.9999, (t, c)


@pytest.mark.parametrize("invariant", [False, True], ids=["streaming", "wgmma"])
@pytest.mark.parametrize("mode", ["w4a16", "w4a4", "w4a4 one x scale", "w4a4 dynamic x", "w4a4 fp32 x"])
@pytest.mark.parametrize("top_k", [1, 3, 8, 10])
def test_one_token_without_align_equals_the_align_path(mode, top_k, invariant, gen, monkeypatch):
    """One token on the one-tile streaming kernel (batch invariance off) or on wgmma tile 32 (the batch-invariant
    plan; tile 8 or 32 by plan_tile8): no align kernel (slot j of the grid is row j of expert
    topk_ids[0, j]; L1 writes the token's entry_row; the combine kernel reads it). W4A16 with bf16 x; W4A4 with
    static scales for h (L1 quantizes h), x quantized per slot with its expert's static scale (per-expert scales,
    one scale for all experts) or once with its dynamic scale, bf16 or fp32 x. Against the same forward through the
    align kernel and its grouped rows: the output bit for bit, and each entry's L1 input (W4A4), L2 input (h) and y
    row bit for bit (workspace poisoned with NaN, entry_row with a sentinel, before each forward), over int32 and
    int64 ids, a duplicated expert, dropped ids (-1 and E) and all entries dropped, k from 1 to 10; the align kernel
    is not called (it raises here)."""
    from megamoe import _ext
    from megamoe.moe import MoELayer

    act_mode = mode.split()[0]
    gpu, ref = _layers("tiny", act_mode=act_mode, hidden_size=1280, intermediate_size=768, num_experts=16,
                       top_k=top_k)
    if mode != act_mode and mode != "w4a4 fp32 x":
        w = gpu.weights
        if mode == "w4a4 one x scale":
            w.w13_input_scale = torch.full_like(w.w13_input_scale, float(w.w13_input_scale.max()))
        else:  # a dynamic scale for x, the static one for h
            w.w13_input_scale = None
        gpu = MoELayer(w, gpu.config, backend="cuda-sm90")
        ref = MoELayer(gpu.weights, gpu.config, backend="torch", device="cuda")
    be, cfg = gpu.backend, gpu.config
    gpu.batch_invariant = invariant  # streaming decode only with invariance off; wgmma tile 32 with it on
    x_dtype = torch.float32 if mode == "w4a4 fp32 x" else torch.bfloat16
    plan = be.plan(1, cfg.hidden_size, cfg.intermediate_size, cfg.num_experts, act_mode == "w4a16",
                   x_dtype == torch.bfloat16, act_mode == "w4a4", 1, batch_invariant=invariant)
    assert plan.without_align
    assert plan.kernel == _ext.ext.Sm90GemmKernel.__members__["wgmma32" if invariant else "stream"], plan
    align = _ext.ext.sm90_moe_align
    cases = ["routed", "int64", "duplicate", "dropped", "all dropped"] if top_k > 1 else ["routed", "int64", "dropped"]
    for case in cases:
        x, ids, w = _route(gpu, 1, gen, dtype=x_dtype)
        if case == "int64":  # (the router's ids are int32)
            ids = ids.long()
        elif case == "duplicate":
            ids[0, 1] = ids[0, 0]
        elif case == "dropped":
            ids[0, 0], ids[0, -1] = -1, cfg.num_experts
        elif case == "all dropped":
            ids[0, :] = -1
        results = []
        for direct in (True, False):
            monkeypatch.setattr(be, "_without_align", lambda *a, d=direct: d)
            if direct:
                monkeypatch.setattr(_ext.ext, "sm90_moe_align", lambda *a, **kw: pytest.fail("align kernel called"))
            else:
                monkeypatch.setattr(_ext.ext, "sm90_moe_align", align)
            ws = be.workspace(1, cfg)
            y = ws.y16 if x_dtype == torch.bfloat16 else ws.y
            bufs = (ws.a2, y) if act_mode == "w4a16" else (ws.a1, ws.a2, y)
            for buf in bufs:
                buf.fill_(float("nan"))
            ws.entry_row.fill_(12345)
            out = gpu.forward(x, ids, w, validate=False).clone()
            rows = ws.entry_row[:top_k].long()
            assert ((rows == -1) | ((rows >= 0) & (rows < top_k))).all(), (case, direct, rows)
            valid = rows >= 0
            results.append((out, valid, [b[rows[valid]].clone() for b in bufs]))
            if direct:  # slot j is row j
                exp_valid = (ids[0] >= 0) & (ids[0] < cfg.num_experts)
                assert torch.equal(valid, exp_valid), case
                assert torch.equal(rows[valid], torch.nonzero(exp_valid).flatten().to(rows)), case
        (o1, v1, b1), (o2, v2, b2) = results
        assert torch.equal(v1, v2), case
        assert torch.isfinite(o1.float()).all() and all(torch.isfinite(b.float()).all() for b in b1), case
        for u, v in zip(b1, b2):
            assert torch.equal(_bits(u), _bits(v)), case
        assert torch.equal(_bits(o1), _bits(o2)), case
        if case != "all dropped":
            c = cosine(o1.float(), ref.forward(x, ids, w, validate=False).float())
            assert c >= min_cosine_vs_torch(act_mode, 1), (case, c)
        else:
            assert torch.equal(o1, torch.zeros_like(o1)), case


@pytest.mark.parametrize("kernel", ["auto", "stream", "wgmma32", "wgmma64", "wgmma128"])
@pytest.mark.parametrize("shape", [(1040, 464), (1280, 768)], ids=["K%64!=0", "K%256==0"])
def test_w4a4_h_quantized_in_l1_equals_the_quantizer(kernel, shape, gen, forced_kernel, monkeypatch):
    """W4A4 with static input scales: the L1 epilogue quantizes h to NVFP4 itself (plan.h_operand) and writes its
    bf16 decode as the L2 input. Against the same forward with that fusion off (L1 writes fp32 h, the quantize
    kernel makes the L2 input): the L2 input bit for bit (each (token, slot)'s grouped row, workspace poisoned with
    NaN first) and so the output too, over T across the token tiles of every kernel (K % 64 != 0: the streaming
    kernel whatever is asked), with fp32 and bf16 x."""
    gpu, ref = _layers("tiny", act_mode="w4a4", hidden_size=shape[0], intermediate_size=shape[1], num_experts=16,
                       top_k=3)
    assert gpu.weights.w2_input_scale is not None
    if kernel != "auto":
        forced_kernel(gpu, kernel)
    be = gpu.backend
    plan = be.plan
    ws_cfg = gpu.config
    for t in (1, 2, 7, 21, 40, 97, 300, 700):
        x, ids, w = _route(gpu, t, gen)
        for xin in (x, x.float()):
            outs, h_ops = [], []
            for fused in (True, False):
                if fused:
                    monkeypatch.setattr(be, "plan", plan)
                else:  # the plan without the static-scale fusion: h through the quantize kernel
                    monkeypatch.setattr(be, "plan", lambda *a: plan(*a[:6], False))
                ws = be.workspace(t, ws_cfg)
                for buf in (ws.h, ws.a1, ws.a2, ws.y, ws.y16):
                    buf.fill_(float("nan"))
                outs.append(gpu.forward(xin, ids, w, validate=False))
                assert be.plan(-(-t * ws_cfg.top_k // ws_cfg.num_experts), shape[0], shape[1], ws_cfg.num_experts,
                               False, xin.dtype == torch.bfloat16, True).h_operand == fused
                rows = ws.entry_row[: t * ws_cfg.top_k].long()
                h_ops.append(ws.a2[rows[rows >= 0]].clone())
            assert torch.isfinite(h_ops[0].float()).all(), t
            assert torch.equal(h_ops[0].view(torch.int16), h_ops[1].view(torch.int16)), (t, xin.dtype)
            assert torch.equal(outs[0], outs[1]), (t, xin.dtype)
        if t in (7, 300):
            c = cosine(outs[0].float(), ref.forward(x, ids, w, validate=False).float())
            assert c >= min_cosine_vs_torch(ws_cfg.act_mode, t), (t, c)


# ---------------------------------------------------------------- every kernel of the plan, forced
@pytest.fixture
def forced_kernel(request):
    """Sets backend.kernel of a layer for one test and restores the plan's choice ("auto") after it."""
    layers = []

    def force(layer, kernel):
        layer.backend.kernel = kernel
        layers.append(layer)

    yield force
    for layer in layers:
        layer.backend.kernel = "auto"


@pytest.mark.parametrize("kernel", ["stream", "wgmma32", "wgmma64", "wgmma128"])
@pytest.mark.parametrize("mode", ["w4a4", "w4a16"])
@pytest.mark.parametrize("dynamic", [False, True])
def test_moe_every_kernel_matches_torch_backend(kernel, mode, dynamic, gen, forced_kernel):
    """Each grouped GEMM kernel in both MoE GEMMs (gate/up with SiLU, down) against the torch
    backend; T up to 2100 on `small` (E=32, k=4: ~260 tokens per expert, tails of every width)."""
    gpu, ref = _layers(act_mode=mode, dynamic_act_scale=dynamic)
    forced_kernel(gpu, kernel)
    for t in (1, 6, 37, 300, 2100):
        _forward_vs_torch(gpu, ref, t, gen, f"moe kernel={kernel} {mode} dynamic={dynamic}")


@pytest.mark.parametrize("kernel", ["wgmma32", "wgmma64", "wgmma128"])
@pytest.mark.parametrize("shape", [(1088, 576), (1152, 640), (1280, 768)], ids=["K%128==64", "K%256==128", "K%256==0"])
def test_moe_wgmma_t_sweep_partial_tiles(kernel, shape, gen, forced_kernel):
    """H, I multiples of 64 but not of 128 (partial weight-row tiles, I = 576: 9 blocks of 64 gate/up
    columns; tiles 32 and 64 step K by 256 and by 256 or 128, so the plan runs tile 128 there), multiples of 128
    but not of 256 (tile 32 asked for runs tile 64) and multiples of 256 (every tile); T across the
    token-tile widths and boundaries; bit-identical reruns."""
    gpu, ref = _layers("tiny", hidden_size=shape[0], intermediate_size=shape[1], num_experts=16, top_k=3)
    forced_kernel(gpu, kernel)
    for t in (1, 2, 3, 11, 21, 22, 43, 64, 85, 86, 171, 300, 700):
        x, ids, w = _route(gpu, t, gen)
        out = gpu.forward(x, ids, w, validate=False)
        exp = ref.forward(x, ids, w, validate=False).float()
        c = cosine(out.float(), exp)
        assert torch.isfinite(out).all(), t
        assert c >= min_cosine_vs_torch(gpu.config.act_mode, t), (t, c)
        assert torch.equal(gpu.forward(x, ids, w, validate=False), out), t


@pytest.mark.parametrize("kernel", ["wgmma32", "wgmma64", "wgmma128"])
def test_moe_wgmma_more_experts_than_a_block_has_threads(kernel, gen, forced_kernel):
    """E = 600: the block-wide scan that maps each wgmma block to its expert tile runs in three passes of 256
    experts, with tiles (and experts without tokens) in every pass; each wgmma kernel forced, against the torch
    backend."""
    gpu, ref = _layers("tiny", hidden_size=512, intermediate_size=256, num_experts=600, top_k=8)
    forced_kernel(gpu, kernel)
    for t in (40, 700):
        _forward_vs_torch(gpu, ref, t, gen, f"moe E=600 kernel={kernel}")


@pytest.mark.parametrize("t", [256, 341, 384, 1100, 1160])
def test_moe_v4_flash_switch_pocket(t, gen):
    """v4-flash shapes with E cut to 64 and T to t/4 (the same T*k/E as v4-flash at T = t: 6, 8, 9, 26 and
    28 expected tokens per expert, around the plan's switch points): the plan's kernel against the torch
    backend."""
    gpu, ref = _layers("v4-flash", num_experts=64)
    x, ids, w = _route(gpu, t // 4, gen)
    c = cosine(gpu.forward(x, ids, w).float(), ref.forward(x, ids, w).float())
    assert c >= min_cosine_vs_torch(gpu.config.act_mode, t // 4), (t, c)


def test_device_holds_the_routed_experts_once(gen):
    """cuda-sm90 re-lays out the routed experts into its own device tensors; the layer's NVFP4 copy of
    them (for reference_bf16) stays in host memory, so building a layer from host weights grows device
    memory by the weights once, and the reference path still runs (on host-held experts)."""
    from megamoe import nvfp4
    from megamoe.checkpoint import synthetic_weights
    from megamoe.health import THRESHOLDS
    from megamoe.moe import MoELayer
    from megamoe.presets import get_preset

    backend_or_skip("cuda-sm90")
    cfg = get_preset("small").with_(act_mode="w4a16")
    w = synthetic_weights(cfg, seed=5)  # host memory
    routed = w.w13.nbytes() + w.w2.nbytes()
    names = ("w13_input_scale", "w2_input_scale", "router_weight", "router_bias", "shared_gate_up", "shared_down")
    other = sum(t.nbytes() if isinstance(t, nvfp4.NVFP4Tensor) else t.nbytes
                for t in (getattr(w, f) for f in names) if t is not None)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    layer = MoELayer(w, cfg, backend="cuda-sm90")
    torch.cuda.synchronize()
    grown = torch.cuda.memory_allocated() - before
    print(f"routed {routed / 2**20:.1f} MiB, other {other / 2**20:.1f} MiB, device grew {grown / 2**20:.1f} MiB")
    assert layer.weights.w13.data.device.type == "cpu" and layer.weights.w2.data.device.type == "cpu"
    assert routed <= grown < routed * 1.2 + other + (16 << 20), (grown, routed, other)
    x = torch.randn((37, cfg.hidden_size), generator=gen).to(torch.bfloat16).cuda()
    c = cosine(layer(x), layer.reference_bf16(x))
    assert c >= THRESHOLDS["moe_cosine_w4a16"], c

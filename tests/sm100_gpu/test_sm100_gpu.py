"""cuda-sm100 on a Blackwell GPU (compute capability 10.0): the CUTLASS kernel itself.

Skipped, with the reason, everywhere else; in this project's CI they never ran (no
Blackwell GPU). On a B200: ``pytest tests/sm100_gpu -q -s`` (``-s`` shows the printed
cosines and timings). The kernel is compared with the CPU emulator of the same plan
(tests/test_sm100_host.py checks the emulator and the plan against docs/SPEC.md §2) and
with the torch reference. A and D are compact (expert e's rows at sum_{j<e} count_j);
the activation scale factors are in 128-row expert blocks (nvfp4.swizzle_scales_grouped).
"""
from __future__ import annotations

import pytest
import torch

from _helpers import backend_or_skip, capture_graph, cosine, random_nvfp4
from megamoe import nvfp4

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def be():
    return backend_or_skip("cuda-sm100")


@pytest.mark.parametrize("m", [1, 7, 31, 33, 127, 129, 300])
@pytest.mark.parametrize("n,k", [(128, 64), (464, 208), (256, 7168), (2048, 464)])
def test_gemm_random_scales_vs_reference(be, m, n, k):
    gen = torch.Generator().manual_seed(m * 1000 + n + k)
    a = random_nvfp4(m, k, gen, 1e-3)
    b = random_nvfp4(n, k, gen, 1e3)
    ref = nvfp4.gemm(a, b, compute_dtype=torch.float64)
    out = be.gemm(a, b).cpu()
    c = cosine(out, ref)
    print(f"sm100 gemm {m}x{n}x{k}: cosine {c:.8f}")
    assert torch.isfinite(out).all() and c >= 0.99999
    # docs/FIELD_BUGS.md row 12: no column position (mod 32) much worse than the others
    if n % 32 == 0 and m > 1:
        per_col = (out.double() - ref).abs().amax(0).view(-1, 32).amax(0)
        assert float(per_col.max()) <= 8 * float(per_col.median()) + 1e-30


def test_gemm_uniform_scales(be):
    a = random_nvfp4(33, 256, None, uniform=True)
    b = random_nvfp4(256, 256, None, uniform=True)
    assert cosine(be.gemm(a, b).cpu(), nvfp4.gemm(a, b, compute_dtype=torch.float64)) >= 0.99999


def _compact_operands(counts, parts, n_part, k, gen, spare_rows=1):
    """Compact A (sum(counts) rows + spare rows), its grouped scale factors, weights and their
    per-(expert, part) scale factors, global scales (CPU tensors)."""
    e = len(counts)
    real = sum(counts)
    a = random_nvfp4(real + spare_rows, k, gen)
    w = random_nvfp4(e * parts * n_part, k, gen)
    a_sf = nvfp4.swizzle_scales_grouped(a.scale[:real], counts)
    b_sf = nvfp4.swizzle_scales(w.scale.reshape(e * parts, n_part, k // 16)).reshape(e, parts, -1)
    a_gs = torch.tensor([1e-3], dtype=torch.float32)
    b_gs = torch.tensor([1e3 * (1 + j % 17) * (10 if j % 2 else 1) for j in range(e * parts)], dtype=torch.float32)
    return a, a_sf, w, b_sf, a_gs, b_gs


@pytest.mark.parametrize("tile_n", [128, 64])
def test_grouped_kernel_equals_emulator_and_writes_only_real_rows(be, tile_n):
    """Same buffers, same plan: the kernel writes what the emulator writes, and only there
    (compact D: a spare row after the last expert stays NaN; TMA clips every tile to its
    group's rows), on both tile configurations."""
    from megamoe.backends.cuda_sm100 import CudaSm100Backend, emulate_grouped_gemm

    gen = torch.Generator().manual_seed(5)
    counts, n_part, k, parts = [33, 0, 129, 1, 300, 7], 464, 1056, 2
    rows = sum(counts) + 1
    a, a_sf, w, b_sf, a_gs, b_gs = _compact_operands(counts, parts, n_part, k, gen)
    plan = be._ext.sm100_plan_moe_gemm(counts, parts, n_part, k, a_gs.tolist(), b_gs.tolist(), be.sm_count,
                                       tile_n=tile_n)
    want = emulate_grouped_gemm(plan, a.data, a_sf, w.data, b_sf, torch.full((rows, parts * n_part), float("nan")))
    dev = be.device
    fixed = CudaSm100Backend(device=dev, tile_n=tile_n)
    got = torch.full((rows, parts * n_part), float("nan"), device=dev)
    fixed._grouped_gemm(counts, parts, n_part, k, a.data.to(dev), a_sf.to(dev), w.data.to(dev), b_sf.to(dev),
                        a_gs.to(dev), b_gs.to(dev), got)
    torch.cuda.synchronize()
    assert fixed.last_tile_n == tile_n
    got = got.cpu()
    assert torch.isnan(want[-1]).all() and not torch.isnan(want[:-1]).any()
    assert torch.equal(torch.isnan(got), torch.isnan(want))  # the spare row untouched
    real = ~torch.isnan(want)
    assert torch.allclose(got[real], want[real], rtol=1e-4, atol=1e-6 * float(want[real].abs().max()))


@pytest.mark.parametrize("dynamic", [False, True])
@pytest.mark.parametrize("inter", [128, 464])
def test_moe_matches_torch_backend_over_token_counts(be, dynamic, inter):
    from megamoe.backends.torch_ref import TorchBackend
    from megamoe.moe import MoELayer

    layer = MoELayer.from_preset("tiny", seed=1, backend=be, intermediate_size=inter, dynamic_act_scale=dynamic)
    ref_be = TorchBackend(device=be.device)
    gen = torch.Generator().manual_seed(2)
    for t in (1, 2, 3, 31, 61, 127, 128, 129, 257, 300):
        x = torch.randn(t, layer.config.hidden_size, generator=gen).to(torch.bfloat16).to(be.device)
        w, ids = layer.route(x)
        out = be.moe_forward(layer._prepared, layer.config, x, ids, w)
        again = be.moe_forward(layer._prepared, layer.config, x, ids, w)
        ref = ref_be.moe_forward(layer.weights, layer.config, x, ids, w)
        c = cosine(out, ref)
        print(f"sm100 moe I={inter} dynamic={dynamic} T={t}: cosine vs torch {c:.7f}")
        assert c >= 0.9999
        assert torch.equal(out, again)  # docs/FIELD_BUGS.md row 14: same input, same bits


def test_health_checks_full(be):
    from megamoe import health

    report = health.run_checks("full", backend=be)
    for c in report["checks"]:
        print(c["name"], c["status"], c["metric"], c["detail"])
    assert report["status"] == "pass", [c for c in report["checks"] if c["status"] == "fail"]


@pytest.mark.parametrize("preset,tokens", [("v3", 1), ("v3", 256), ("v3", 4096), ("v4-flash", 4096)])
def test_grouped_gemm1_throughput_printed(be, preset, tokens):
    """GEMM 1 (gate+up) of a real MoE shape: correctness on a sample of rows, TFLOP/s printed."""
    from megamoe.backends.cuda_sm100 import emulate_grouped_gemm
    from megamoe.presets import PRESETS

    cfg = PRESETS[preset]
    e, h, i, k = cfg.num_experts, cfg.hidden_size, cfg.intermediate_size, cfg.top_k
    gen = torch.Generator().manual_seed(tokens)
    ids = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(tokens)])
    counts = torch.bincount(ids.reshape(-1), minlength=e).tolist()
    rows = sum(counts)
    dev = be.device
    a = torch.randint(0, 256, (rows, h // 2), dtype=torch.uint8, device=dev)
    a_sf = be.swizzle_scales_grouped(torch.rand(rows, h // 16, device=dev).to(torch.float8_e4m3fn), counts)
    w = torch.randint(0, 256, (e, 2 * i, h // 2), dtype=torch.uint8, device=dev)
    w_sf = be.swizzle_scales(torch.rand(e * 2, i, h // 16, device=dev).to(torch.float8_e4m3fn)).reshape(e, 2, -1)
    a_gs = torch.ones(1, device=dev)
    b_gs = torch.rand(e * 2, device=dev) + 0.5
    out = torch.zeros(rows, 2 * i, device=dev)
    be._grouped_gemm(counts, 2, i, h, a, a_sf, w, w_sf, a_gs, b_gs, out)  # warm-up
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    reps = 10
    start.record()
    for _ in range(reps):
        be._grouped_gemm(counts, 2, i, h, a, a_sf, w, w_sf, a_gs, b_gs, out)
    stop.record()
    torch.cuda.synchronize()
    ms = start.elapsed_time(stop) / reps
    flops = 2.0 * sum(counts) * 2 * i * h
    print(f"sm100 GEMM1 {preset} T={tokens} (tile N {be.last_tile_n}): {ms:.3f} ms, "
          f"{flops / ms / 1e9:.1f} TFLOP/s")
    # correctness on the experts of the first token (the emulator is slow on the CPU)
    plan = be._ext.sm100_plan_moe_gemm(counts, 2, i, h, a_gs.cpu().tolist(), b_gs.cpu().tolist(), be.sm_count,
                                       tile_n=be.last_tile_n)
    plan["groups"] = [g for g in plan["groups"] if g["expert"] in ids[0].tolist()]
    want = emulate_grouped_gemm(plan, a.cpu(), a_sf.cpu(), w.cpu(), w_sf.cpu(), torch.full((rows, 2 * i), float("nan")))
    real = ~torch.isnan(want)
    got = out.cpu()[real]
    assert torch.allclose(got, want[real], rtol=1e-4, atol=1e-6 * float(want[real].abs().max()))


# --------------------------------------------------------------------------------------------
# the glue around the kernel and docs/FIELD_BUGS.md rows 23, 25, 26, 28
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("counts,parts,n_part,k", [([33, 0, 129, 1, 300, 7], 2, 464, 1056), ([5] * 60, 1, 1040, 480),
                                                   ([(j * 7) % 5 for j in range(600)], 2, 64, 64)])
def test_device_built_args_equal_the_host_planner_byte_for_byte(be, counts, parts, n_part, k):
    """The argument-builder kernel (one block scan over the counts, 600 experts crossing its
    256-expert chunks) fills CUTLASS's per-group arrays from device token counts; the host image
    of the same arrays (sm100_host_args_bytes, the planner's code) must be identical, byte for
    byte, gaps between the arrays included (both start from the same poison byte)."""
    gen = torch.Generator().manual_seed(7)
    e = len(counts)
    rows = sum(counts)
    dev = be.device
    a = random_nvfp4(rows, k, gen)
    w = random_nvfp4(e * parts * n_part, k, gen)
    a_data, w_data = a.data.to(dev), w.data.to(dev)
    a_sf = nvfp4.swizzle_scales_grouped(a.scale, counts).to(dev)
    b_sf = nvfp4.swizzle_scales(w.scale.reshape(e * parts, n_part, k // 16)).reshape(e, parts, -1).to(dev)
    a_gs = torch.tensor([1e-3], dtype=torch.float32, device=dev)
    b_gs = (torch.rand(e * parts, generator=gen) + 0.5).to(dev)
    out = torch.empty((rows, parts * n_part), device=dev)
    stream = torch.cuda.current_stream(dev).cuda_stream
    args, _ = be.launch_buffers(e * parts, stream)
    args.fill_(0xA5)
    be._grouped_gemm(torch.tensor(counts, dtype=torch.int32, device=dev), parts, n_part, k, a_data, a_sf, w_data,
                     b_sf, a_gs, b_gs, out)
    torch.cuda.synchronize()
    assert be.launch_buffers(e * parts, stream)[0] is args  # the launch used the cached buffer
    host = be._ext.sm100_host_args_bytes(counts, parts, n_part, k, a_gs.cpu().tolist(), b_gs.cpu().tolist(),
                                        [a_data.data_ptr(), a_sf.data_ptr(), w_data.data_ptr(), b_sf.data_ptr(),
                                         out.data_ptr()], args.data_ptr(), 0xA5)
    device = bytes(args.cpu().numpy().tobytes())
    assert len(device) == len(host)
    if device != host:
        lay = be._ext.sm100_plan_moe_gemm(counts, parts, n_part, k, a_gs.cpu().tolist(), b_gs.cpu().tolist(),
                                          be.sm_count)["args_layout"]
        first = next(i for i in range(len(host)) if host[i] != device[i])
        section = max((v, name) for name, v in lay.items() if name != "total_bytes" and v <= first)[1]
        pytest.fail(f"device args differ from the host planner's from byte {first} (array {section})")


def test_gemm_objects_and_buffers_reused_across_calls(be):
    """No Gemm::initialize after the first call: moe_forward (device counts), gemm() and a
    host-count launch all reuse the launcher's initialized Gemm objects."""
    layer = _layer_for(be, "tiny")
    x = torch.randn(33, layer.config.hidden_size, device=be.device).to(torch.bfloat16)
    w, ids = layer.route(x)
    gen = torch.Generator().manual_seed(3)
    a, b = random_nvfp4(7, 256, gen), random_nvfp4(128, 256, gen)
    counts, parts, n_part, k = [3, 0, 130], 1, 64, 64
    ops = _compact_operands(counts, parts, n_part, k, gen, spare_rows=0)
    dev = be.device
    d = torch.empty(sum(counts), n_part, device=dev)

    def host_count_launch():
        op_a, a_sf, op_w, b_sf, a_gs, b_gs = ops
        be._grouped_gemm(counts, parts, n_part, k, op_a.data.to(dev), a_sf.to(dev), op_w.data.to(dev),
                         b_sf.to(dev), a_gs.to(dev), b_gs.to(dev), d)

    for fn in (lambda: be.moe_forward(layer._prepared, layer.config, x, ids, w), lambda: be.gemm(a, b),
               host_count_launch):
        fn()
        torch.cuda.synchronize()
        n = be._ext.sm100_cached_gemm_count()
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        assert be._ext.sm100_cached_gemm_count() == n


def test_gemm_graph_captured(be):
    """gemm() keeps its count on the device and reuses an initialized Gemm: it can be captured."""
    gen = torch.Generator().manual_seed(4)
    a, b = random_nvfp4(5, 512, gen), random_nvfp4(256, 512, gen)
    a, b = a.to(be.device), b.to(be.device)
    g, out = capture_graph(be.gemm, a, b)
    want = be.gemm(a, b)
    out.fill_(float("nan"))
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, want)


def _layer_for(be, preset, **over):
    from megamoe.moe import MoELayer

    return MoELayer.from_preset(preset, seed=1, backend=be, **over)


def test_no_tokens_and_all_masked(be):
    layer = _layer_for(be, "tiny")
    cfg = layer.config
    empty = be.moe_forward(layer._prepared, cfg, torch.zeros(0, cfg.hidden_size, device=be.device),
                           torch.zeros(0, cfg.top_k, dtype=torch.int32, device=be.device),
                           torch.zeros(0, cfg.top_k, device=be.device))
    assert empty.shape == (0, cfg.hidden_size)
    x = torch.randn(9, cfg.hidden_size, device=be.device)
    out = be.moe_forward(layer._prepared, cfg, x, torch.full((9, cfg.top_k), -1, device=be.device),
                         torch.rand(9, cfg.top_k, device=be.device))
    assert torch.equal(out, torch.zeros_like(out))


def test_masked_ids_match_zero_weights(be):
    from megamoe.backends.torch_ref import TorchBackend

    layer = _layer_for(be, "small", top_k=4)
    cfg = layer.config
    gen = torch.Generator().manual_seed(26)
    x = torch.randn(300, cfg.hidden_size, generator=gen).to(torch.bfloat16).to(be.device)
    w, ids = layer.route(x)
    mask = (torch.rand(ids.shape, generator=gen) < 0.3).to(be.device)
    masked = torch.where(mask, torch.full_like(ids, -1), ids)
    out = be.moe_forward(layer._prepared, cfg, x, masked, w)
    nan_w = torch.where(mask, torch.full((), float("nan"), device=be.device), w)
    assert torch.equal(be.moe_forward(layer._prepared, cfg, x, masked, nan_w), out)
    ref = TorchBackend(device=be.device).moe_forward(layer.weights, cfg, x, ids,
                                                     torch.where(mask, torch.zeros((), device=be.device), w))
    assert cosine(out, ref) >= 0.9999


@pytest.mark.parametrize("preset,k", [("small", 3), ("v3", 8)])
def test_same_input_same_bits(be, preset, k):
    """docs/FIELD_BUGS.md row 28: the combine is a fixed-order gather and sum: identical bits."""
    layer = _layer_for(be, preset, top_k=k)
    x = torch.randn(4096, layer.config.hidden_size, device=be.device).to(torch.bfloat16)
    w, ids = layer.route(x)
    first = be.moe_forward(layer._prepared, layer.config, x, ids, w)
    for _ in range(3):
        assert torch.equal(be.moe_forward(layer._prepared, layer.config, x, ids, w), first)


def test_graph_captured_on_one_expert_replays_real_routing(be):
    """docs/FIELD_BUGS.md row 25."""
    layer = _layer_for(be, "small")
    cfg = layer.config
    t = 256
    x = torch.randn(t, cfg.hidden_size, device=be.device).to(torch.bfloat16)
    w, ids = layer.route(x)
    xs, ids_s, ws_ = x.clone(), torch.zeros_like(ids), w.clone()
    g, out = capture_graph(be.moe_forward, layer._prepared, cfg, xs, ids_s, ws_)
    for new_ids in (torch.zeros_like(ids), ids, torch.where(ids % 3 == 0, -1, ids)):
        ids_s.copy_(new_ids)
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, be.moe_forward(layer._prepared, cfg, x, new_ids, w))


def test_v3_prefill_past_2_31(be):
    """docs/FIELD_BUGS.md row 23: T * k * H > 2^31 (v3, T = 37,500) against the torch backend."""
    from megamoe.backends.torch_ref import TorchBackend

    layer = _layer_for(be, "v3")
    cfg = layer.config
    t = 37_500
    assert t * cfg.top_k * cfg.hidden_size > 2**31
    x = torch.randn(t, cfg.hidden_size, device=be.device).to(torch.bfloat16)
    w, ids = layer.route(x)
    out = be.moe_forward(layer._prepared, cfg, x, ids, w)
    ref = TorchBackend(device=be.device).moe_forward(layer.weights, cfg, x, ids, w)
    assert torch.isfinite(out).all()
    assert cosine(out, ref) >= 0.9999 and cosine(out[-2048:], ref[-2048:]) >= 0.9999


def _tiny_experts_case(be, hidden: int, inter: int, e: int = 160):
    """A layer of ``e`` experts and ``e`` tokens routed so that every expert gets 1 or 2 of them
    (token t: experts t and 7t + 3 mod e), with random bf16 rows and weights."""
    layer = _layer_for(be, "tiny", hidden_size=hidden, intermediate_size=inter, num_experts=e, top_k=2)
    ids = torch.stack([torch.arange(e), (torch.arange(e) * 7 + 3) % e], dim=1).to(torch.int32).to(be.device)
    x = torch.randn(e, hidden, device=be.device).to(torch.bfloat16)
    w = torch.rand(e, 2, device=be.device) + 0.1
    return layer, layer.config, x, ids, w


def test_many_small_experts_each_compared(be):
    """docs/FIELD_BUGS.md row 24: CUTLASS's grouped kernel replaces its tensor maps per group
    inside the kernel; 160 experts with 1-2 tokens each and per-expert global scales, every token
    (so every expert) compared with the torch backend."""
    from megamoe.backends.torch_ref import TorchBackend

    layer, cfg, x, ids, w = _tiny_experts_case(be, 1040, 208)
    out = be.moe_forward(layer._prepared, cfg, x, ids, w)
    ref = TorchBackend(device=be.device).moe_forward(layer.weights, cfg, x, ids, w)
    per_token = torch.nn.functional.cosine_similarity(out.double(), ref.double(), dim=1)
    assert float(per_token.min()) >= 0.999, int(per_token.argmin())


# --------------------------------------------------------------------------------------------
# repeat test: tensor-map updates at group switches (issue: in-place descriptor races)
# --------------------------------------------------------------------------------------------

STRESS_ITERATIONS = 1000


@pytest.mark.parametrize("tile_n", [128, 64])
def test_stress_many_tiny_experts_bit_exact(be, tile_n):
    """CUTLASS updates each CTA's tensor maps in the kernel at every group switch. 192 experts
    with 1-3 tokens each (so every CTA switches groups many times), two routings alternating
    (different per-group M, so the descriptors really change), 1,000 launches of each: every
    result must equal, bit for bit, the first result of its routing, and that one the emulator
    of the same plan. A race on a descriptor shows up as one iteration's bits differing."""
    from megamoe.backends.cuda_sm100 import CudaSm100Backend, emulate_grouped_gemm

    e, parts, n_part, k = 192, 2, 256, 512
    gen = torch.Generator().manual_seed(48)
    routings = [[1 + (j % 3) for j in range(e)], [1 + ((j * 5 + 1) % 3) for j in range(e)]]
    fixed = CudaSm100Backend(device=be.device, tile_n=tile_n)
    dev = be.device
    cases = []
    for counts in routings:
        a, a_sf, w, b_sf, a_gs, b_gs = _compact_operands(counts, parts, n_part, k, gen, spare_rows=0)
        plan = be._ext.sm100_plan_moe_gemm(counts, parts, n_part, k, a_gs.tolist(), b_gs.tolist(), be.sm_count,
                                           tile_n=tile_n)
        want = emulate_grouped_gemm(plan, a.data, a_sf, w.data, b_sf, torch.empty(sum(counts), parts * n_part))
        ops = [t.to(dev) for t in (a.data, a_sf, w.data, b_sf, a_gs, b_gs)]
        counts_dev = torch.tensor(counts, dtype=torch.int32, device=dev)
        out = torch.full((sum(counts), parts * n_part), float("nan"), device=dev)
        cases.append((counts_dev, ops, out, want))
    firsts = []
    for counts_dev, ops, out, want in cases:
        fixed._grouped_gemm(counts_dev, parts, n_part, k, *ops, out)
        torch.cuda.synchronize()
        first = out.clone()
        assert torch.allclose(first.cpu(), want, rtol=1e-4, atol=1e-6 * float(want.abs().max()))
        firsts.append(first)
    bad = torch.zeros(2, dtype=torch.int64, device=dev)
    for _ in range(STRESS_ITERATIONS):
        for j, (counts_dev, ops, out, _) in enumerate(cases):
            out.fill_(float("nan"))
            fixed._grouped_gemm(counts_dev, parts, n_part, k, *ops, out)
            bad[j] += (out.view(torch.int32) != firsts[j].view(torch.int32)).any().long()
    torch.cuda.synchronize()
    assert bad.tolist() == [0, 0], f"iterations with different bits (routing 0, 1): {bad.tolist()}"


def test_stress_moe_forward_160_experts_bit_exact(be):
    """The whole MoE (both GEMMs, quantize, swizzle, combine) with 160 experts of 1-2 tokens,
    1,000 times: identical bits every time, and the first result close to the torch backend."""
    from megamoe.backends.torch_ref import TorchBackend

    layer, cfg, x, ids, w = _tiny_experts_case(be, 1024, 256)
    first = be.moe_forward(layer._prepared, cfg, x, ids, w)
    ref = TorchBackend(device=be.device).moe_forward(layer.weights, cfg, x, ids, w)
    assert cosine(first, ref) >= 0.9999
    bad = torch.zeros((), dtype=torch.int64, device=be.device)
    for _ in range(STRESS_ITERATIONS):
        out = be.moe_forward(layer._prepared, cfg, x, ids, w)
        bad += (out.view(torch.int32) != first.view(torch.int32)).any().long()
    assert int(bad) == 0, f"{int(bad)} of {STRESS_ITERATIONS} iterations differ from the first"


# --------------------------------------------------------------------------------------------
# deployment shape: DeepSeek-V4-Flash at TP = 8 (I = 256 per rank, E = 256, k = 6), decode
# --------------------------------------------------------------------------------------------

V4_TP8 = dict(hidden_size=4096, intermediate_size=256, num_experts=256, top_k=6)


@pytest.fixture(scope="module")
def v4_tp8_layer(be):
    return _layer_for(be, "v4-flash", **V4_TP8)


@pytest.mark.parametrize("t", [1, 2, 3, 4, 6, 8, 16, 24, 31, 32, 33, 48, 63, 64])
def test_v4_flash_tp8_decode_vs_torch(be, v4_tp8_layer, t):
    """Routed experts at the V4-Flash TP = 8 shape against the torch backend (the reference
    in fp32/fp64 of the same NVFP4 math), with the tile the host picks (N = 64 at small T) and
    with the other one: both close to the reference, and the same bits on a second run."""
    from megamoe.backends.cuda_sm100 import CudaSm100Backend
    from megamoe.backends.torch_ref import TorchBackend

    layer = v4_tp8_layer
    cfg = layer.config
    gen = torch.Generator().manual_seed(1000 + t)
    x = torch.randn(t, cfg.hidden_size, generator=gen).to(torch.bfloat16).to(be.device)
    w, ids = layer.route(x)
    ref = TorchBackend(device=be.device).moe_forward(layer.weights, cfg, x, ids, w)
    out = be.moe_forward(layer._prepared, cfg, x, ids, w)
    picked = be.last_tile_n
    assert torch.equal(be.moe_forward(layer._prepared, cfg, x, ids, w), out)
    other = CudaSm100Backend(device=be.device, tile_n=64 if picked == 128 else 128)
    out_other = other.moe_forward(layer._prepared, cfg, x, ids, w)
    c, c_other = cosine(out, ref), cosine(out_other, ref)
    print(f"sm100 v4-flash TP=8 T={t}: cosine {c:.7f} (tile N {picked}), {c_other:.7f} (tile N {other.tile_n})")
    assert torch.isfinite(out).all() and c >= 0.9999 and c_other >= 0.9999
    per_token = torch.nn.functional.cosine_similarity(out.double(), ref.double(), dim=1)
    assert float(per_token.min()) >= 0.999

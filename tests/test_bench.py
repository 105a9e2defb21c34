"""bench/moe_bench.py's profile accounting (host only): the exposed non-GEMM time of a forward."""
from __future__ import annotations

import importlib.util
import os

import pytest

def _load_bench(name: str):
    """bench/<name>.py, imported as a module."""
    path = os.path.join(os.path.dirname(__file__), "..", "bench", name + ".py")
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def bench():
    return _load_bench("moe_bench")


def test_union_length_merges_overlaps_and_keeps_gaps(bench):
    assert bench.union_length([]) == 0.0
    assert bench.union_length([(0.0, 2.0), (1.0, 3.0), (5.0, 6.0)]) == pytest.approx(4.0)
    assert bench.union_length([(5.0, 6.0), (0.0, 10.0), (2.0, 3.0)]) == pytest.approx(10.0)  # nested, unsorted
    assert bench.union_length([(0.0, 1.0), (1.0, 2.0)]) == pytest.approx(2.0)  # touching


def test_exposed_other_excludes_the_wait_inside_a_gemm(bench):
    # one forward: align 0-2, gemm1 2-10, gemm2 launched early (PDL) 9-20, combine launched early 19-23 (waits for gemm2
    # until 20)
    spans = [("moe_align_kernel", 0.0, 2.0), ("wg_gemm_kernel<64>", 2.0, 10.0), ("wg_gemm_kernel<64>", 9.0, 20.0),
             ("combine_kernel", 19.0, 23.0)]
    # the kernels' own durations add up to 6 us of non-GEMM time; exposed: 0-2 and 20-23
    assert bench.exposed_other_us(spans, reps=1) == pytest.approx(5.0)
    # two forwards with a host gap between them: per call
    later = [(n, a + 100.0, b + 100.0) for n, a, b in spans]
    assert bench.exposed_other_us(spans + later, reps=2) == pytest.approx(5.0)


def test_gemm_kernel_names(bench):
    assert bench.is_gemm_kernel("void megamoe::sm90::wg_gemm_kernel<64, 256, true, false>(...)")
    assert bench.is_gemm_kernel("void megamoe::sm90::stream_gemm_nt1_fused_kernel<true>(...)")
    assert not bench.is_gemm_kernel("void megamoe::sm90::(anonymous namespace)::combine_kernel<float, float>(...)")
    assert bench.kernel_table({"void megamoe::sm90::(anonymous namespace)::combine_kernel<float>(x)": 1.0,
                               "void megamoe::sm90::(anonymous namespace)::combine_kernel<float>(y)": 2.0}) == \
        {"combine_kernel<float>": 3.0}


# ---------------------------------------------------------------- --tp N: one tensor-parallel rank's shapes

def test_tp_flag_builds_the_rank_shapes(bench):
    """``--tp 8`` measures V4-Flash as one of 8 tensor-parallel ranks runs it: I = 256 per expert
    (GEMM 2 with K = 256), H, E and k unchanged; every preset of the run alike; its own results file."""
    args = bench.parse_args(["--tp", "8", "--presets", "v4-flash", "v3"])
    v4, v3 = args.configs["v4-flash"], args.configs["v3"]
    assert (v4.hidden_size, v4.intermediate_size, v4.num_experts, v4.top_k) == (4096, 256, 256, 6)
    assert (v3.hidden_size, v3.intermediate_size, v3.num_experts, v3.top_k) == (7168, 256, 256, 8)
    assert args.out.endswith("moe_gpu_tp8.json")  # no GPU here: the record names none
    one = bench.parse_args(["--presets", "v4-flash"])
    assert one.configs["v4-flash"].intermediate_size == 2048 and one.out.endswith("moe_gpu.json")
    pa = bench.plan_args(v4, 8192, "w4a4")
    assert (pa["k_gemm1"], pa["k_gemm2"], pa["num_experts"], pa["tokens_per_expert"]) == (4096, 256, 256, 192)
    assert pa["h_static_scale"] and not pa["w4a16"]
    # a rank's expert FLOPs (and so its floors): 1/8 of the whole layer's
    from megamoe.backends.cuda_sm90 import CudaSm90Backend

    assert CudaSm90Backend.expert_flops(v4, 64) * 8 == CudaSm90Backend.expert_flops(one.configs["v4-flash"], 64)


def test_top_k_flag_runs_each_preset_per_k(bench, capsys):
    """``--top-k 2 8``: one row label per preset and k, the shapes unchanged, its own results file; a k the
    preset's experts cannot hold is refused by name."""
    args = bench.parse_args(["--presets", "v4-flash", "v3", "--top-k", "2", "8", "--tp", "8"])
    assert list(args.configs) == ["v4-flash/k2", "v4-flash/k8", "v3/k2", "v3/k8"]
    for label, cfg in args.configs.items():
        want = bench.bench_config(label.split("/")[0], 8)
        assert cfg.top_k == int(label.split("/k")[1])
        assert (cfg.hidden_size, cfg.intermediate_size, cfg.num_experts) == (
            want.hidden_size, want.intermediate_size, want.num_experts)
    assert args.out.endswith("moe_gpu_tp8_topk.json")
    assert bench.parse_args(["--presets", "v3", "--top-k", "4"]).out.endswith("moe_gpu_topk.json")
    with pytest.raises(SystemExit):
        bench.parse_args(["--presets", "v4-flash", "--top-k", "257"])
    assert "--top-k 257: expected 1 to 256 (the experts of v4-flash)" in capsys.readouterr().err


@pytest.mark.parametrize("name,tag", [("NVIDIA H100 80GB HBM3", "h100"), ("NVIDIA H200", "h200"),
                                      ("NVIDIA B200", "b200"), ("NVIDIA GeForce RTX 4090", "nvidia_geforce_rtx_4090"),
                                      ("NVIDIA A100-SXM4-80GB", "a100"), ("", "gpu")])
def test_the_default_record_is_named_after_the_card(bench, name, tag):
    """An H100 run writes moe_h100.json, never over the H200's record."""
    assert bench.gpu_tag(name) == tag


def test_tp_weights_have_the_rank_shapes(bench):
    """The benchmark's random weights at a rank's shape: w13 [E, 2I/N, H/2], w2 [E, H, I/N/2]."""
    import torch

    cfg = bench.bench_config("tiny", 4)
    w = bench.random_weights(cfg, torch.Generator().manual_seed(0), device="cpu")
    assert cfg.intermediate_size == 32
    assert tuple(w.w13.data.shape) == (8, 64, 128) and tuple(w.w2.data.shape) == (8, 256, 16)
    assert tuple(w.w2.scale.shape) == (8, 256, 2)
    w.validate(cfg)


@pytest.mark.parametrize("tp", ["3", "256", "0"])
def test_tp_flag_refuses_a_split_that_is_not_whole_blocks(bench, tp, capsys):
    with pytest.raises(SystemExit):
        bench.parse_args(["--tp", tp, "--presets", "v4-flash"])
    err = capsys.readouterr().err
    assert f"--tp {tp}" in err or "per rank, not a multiple of 16" in err, err


def test_sm90_plan_at_the_tp8_shapes(bench):
    """The dispatch plan at V4-Flash's TP = 8 shapes (K = 4096 and 256): streaming for decode, and
    the wgmma kernels above (K = 256 steps through every tile's K per stage), as at I = 2048."""
    from megamoe import _ext

    if not _ext.has_part("sm90"):
        pytest.skip(f"megamoe._C built without sm90 kernels (parts: {_ext.built_parts()})")
    v4 = bench.bench_config("v4-flash", 8)
    full = bench.bench_config("v4-flash", 1)
    kinds = {}
    for t in (1, 8, 32, 128, 512, 2048, 8192):
        for mode in ("w4a16", "w4a4"):
            plan = _ext.ext.sm90_plan(**bench.plan_args(v4, t, mode))
            same = _ext.ext.sm90_plan(**bench.plan_args(full, t, mode))
            kinds[(t, mode)] = bench.plan_summary(plan)
            assert plan.kernel == same.kernel, (t, mode, bench.plan_summary(plan), bench.plan_summary(same))
    assert kinds[(1, "w4a16")].startswith("stream") and kinds[(8192, "w4a4")].startswith("wgmma128"), kinds


# ---------------------------------------------------------------- the rates beside each time (bytes, FLOPs, shares)

def _tiny():
    from megamoe.presets import get_preset

    cfg = get_preset("tiny")
    assert (cfg.hidden_size, cfg.intermediate_size, cfg.num_experts, cfg.top_k) == (256, 128, 8, 2)
    return cfg


def test_weight_bytes_per_gemm_by_hand(bench):
    """One expert's bytes per GEMM: NVFP4 = half a byte per weight + one E4M3 scale per 16 weights; bf16 = 2 bytes.
    tiny (H 256, I 128): gemm1 reads w13 [256, 256] = 65536 weights, gemm2 w2 [256, 128] = 32768."""
    import torch

    cfg = _tiny()
    assert bench.expert_weight_bytes(cfg) == {"gemm1": 32768 + 4096, "gemm2": 16384 + 2048}
    assert bench.expert_weight_bytes(cfg, "bf16") == {"gemm1": 131072, "gemm2": 65536}
    # the same bytes as the benchmark's weights hold (data + scales), all 8 experts
    w = bench.random_weights(cfg, torch.Generator().manual_seed(0), device="cpu")
    assert (w.w13.nbytes(), w.w2.nbytes()) == (8 * 36864, 8 * 18432)
    # V4-Flash (H 4096, I 2048): 6 experts = the 84,934,656 bytes the T = 1 rows of bench/results record
    v4 = bench.bench_config("v4-flash")
    assert bench.expert_weight_bytes(v4) == {"gemm1": 9437184, "gemm2": 4718592}
    assert 6 * sum(bench.expert_weight_bytes(v4).values()) == 84934656
    with pytest.raises(ValueError, match="fp8"):
        bench.expert_weight_bytes(cfg, "fp8")


def test_gemm_flops_by_hand(bench):
    """2 FLOPs per multiply-add over the t*k routed rows: gemm1 2*t*k*H*2I, gemm2 2*t*k*I*H."""
    from megamoe.backends.cuda_sm90 import CudaSm90Backend

    cfg = _tiny()
    fl = bench.gemm_flops(cfg, 4)
    assert fl == {"gemm1": 2 * 8 * 256 * 256, "gemm2": 2 * 8 * 128 * 256}
    assert fl["gemm1"] == 1048576 and fl["gemm2"] == 524288
    assert sum(fl.values()) == CudaSm90Backend.expert_flops(cfg, 4)


def test_experts_touched(bench):
    import torch

    ids = torch.tensor([[0, 3], [3, 5], [0, -1], [8, 5]], dtype=torch.int32)  # -1: a dropped slot, 8: outside
    assert bench.experts_touched(ids, 8) == 3
    assert bench.experts_touched(torch.arange(16).reshape(8, 2), 8) == 8


def test_rates_from_given_times(bench):
    assert bench.rates(1.5e9, 3e12, 0.5) == pytest.approx((3.0, 6.0))
    assert bench.rates(84934656, 301989888.0, 50.96e-6) == pytest.approx((1666.69, 5.9260), rel=1e-5)
    with pytest.raises(ValueError, match="expected > 0"):
        bench.rates(1.0, 1.0, 0.0)


G1 = "void megamoe::sm90::wg_gemm_kernel<128, 128, true, true>(megamoe::sm90::GemmArgs)"
G2 = "void megamoe::sm90::wg_gemm_kernel<128, 128, true, false>(megamoe::sm90::GemmArgs)"
ALIGN = "void megamoe::sm90::(anonymous namespace)::moe_align_kernel<int>(int const*)"
COMBINE = "void megamoe::sm90::(anonymous namespace)::combine_kernel<__nv_bfloat16, __nv_bfloat16>(float const*)"


def _two_forwards(g1=G1, g2=G2):
    # forward 1: align 0-2, gemm1 2-10, gemm2 launched early (PDL) 9-20, combine launched early 19-23;
    # forward 2, 100 us later: align 100-102, gemm1 102-112, gemm2 111-120, combine 119-123. Given out of order.
    spans = [(ALIGN, 0.0, 2.0), (g1, 2.0, 10.0), (g2, 9.0, 20.0), (COMBINE, 19.0, 23.0),
             (ALIGN, 100.0, 102.0), (g1, 102.0, 112.0), (g2, 111.0, 120.0), (COMBINE, 119.0, 123.0)]
    return spans[::-1]


def test_kernel_launches_per_gemm(bench):
    launches, busy = bench.kernel_launches(_two_forwards(), reps=2)
    assert [x["kernel"] for x in launches] == ["wg_gemm_kernel<128, 128, true, true>",
                                               "wg_gemm_kernel<128, 128, true, false>"]
    # durations (8 + 10) / 2 and (11 + 9) / 2; exclusive: gemm2 from gemm1's end, (10 + 8) / 2
    assert launches[0]["us"] == pytest.approx(9.0) and launches[0]["exclusive_us"] == pytest.approx(9.0)
    assert launches[1]["us"] == pytest.approx(10.0) and launches[1]["exclusive_us"] == pytest.approx(9.0)
    assert busy == pytest.approx(23.0)
    with pytest.raises(ValueError, match="not a whole number"):
        bench.kernel_launches(_two_forwards()[:-2], reps=2)  # forward 1 lost its gemm2... (3 GEMMs in 2 forwards)
    with pytest.raises(ValueError, match="0 GEMM kernels"):
        bench.kernel_launches([(ALIGN, 0.0, 1.0)], reps=1)


def test_profile_fields_rates_and_share(bench):
    cfg = _tiny()
    nbytes = {g: 3 * b for g, b in bench.expert_weight_bytes(cfg).items()}  # 110592, 55296
    out = bench.profile_fields("sm90_w4a4", _two_forwards(), 2, nbytes, bench.gemm_flops(cfg, 4))
    assert out["sm90_w4a4_gemm1_us"] == pytest.approx(9.0) and out["sm90_w4a4_gemm2_us"] == pytest.approx(10.0)
    assert out["sm90_w4a4_gemm2_exclusive_us"] == pytest.approx(9.0)
    assert out["sm90_w4a4_gemm1_weight_GBps"] == pytest.approx(110592 / 9e-6 / 1e9)  # 12.288
    assert out["sm90_w4a4_gemm1_weight_GBps"] == pytest.approx(12.288)
    assert out["sm90_w4a4_gemm1_tflops"] == pytest.approx(1048576 / 9e-6 / 1e12)
    assert out["sm90_w4a4_gemm2_weight_GBps"] == pytest.approx(5.5296)
    assert out["sm90_w4a4_gemm2_tflops"] == pytest.approx(0.0524288)
    assert out["sm90_w4a4_busy_us"] == pytest.approx(23.0)
    assert out["sm90_w4a4_other_exposed_us"] == pytest.approx(5.0)  # 0-2 and 20-23 per forward
    assert out["sm90_w4a4_other_share"] == pytest.approx(5.0 / 23.0)
    assert "sm90_w4a4_gemm_split_error" not in out


def test_profile_fields_without_two_gemms_keeps_the_share(bench):
    """Three GEMM launches per forward: no per-GEMM attribution (an error field says why), the share still there."""
    cfg = _tiny()
    spans = [(ALIGN, 0.0, 2.0), (G1, 2.0, 10.0), (G2, 10.0, 14.0), (G2, 14.0, 20.0), (COMBINE, 20.0, 23.0)]
    out = bench.profile_fields("torch_bf16", spans, 1, bench.expert_weight_bytes(cfg), bench.gemm_flops(cfg, 4))
    assert "3 GEMM kernels per forward" in out["torch_bf16_gemm_split_error"]
    assert not any(k.startswith("torch_bf16_gemm1") for k in out)
    assert out["torch_bf16_other_share"] == pytest.approx(5.0 / 23.0)


def _record(bench):
    """A record row of tiny at T = 4 as main() builds it, from given routing and times (nothing timed)."""
    import torch

    cfg = _tiny()
    set0 = torch.tensor([[0, 3], [3, 5], [0, 1], [5, 3]], dtype=torch.int32)  # experts 0 1 3 5
    set1 = torch.tensor([[0, 1], [2, 3], [4, 5], [6, 7]], dtype=torch.int32)  # all 8
    row = bench.shape_row("tiny", cfg, 4, 1, [set0, set1], copy_bw=1e12, bf16_rate=1e12)
    row["sm90_w4a16_plan"] = "wgmma64/64/64"
    row.update(bench.timed_fields(row, "sm90_w4a16", [2e-6, 4e-6, 3e-6], [2.5e-6], copy_bw=1e12))
    per_call = {G1: 9.0, G2: 10.0, ALIGN: 2.0, COMBINE: 4.0}
    row.update(bench.profile_record(row, "sm90_w4a16", per_call, _two_forwards(), 2))
    tg = "void cutlass::device_kernel<cutlass::gemm::kernel::GemmUniversal<cutlass::gemm::GroupProblemShape>>(x)"
    fill = "void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>>(x)"
    tspans = [(fill, 0.0, 4.0), (tg, 4.0, 14.0), (tg, 14.0, 24.0), (fill, 24.0, 30.0)]
    row.update(bench.timed_fields(row, "torch_bf16", [6e-6], [5e-6], copy_bw=1e12))
    row.update(bench.profile_record(row, "torch_bf16", {tg: 20.0, fill: 10.0}, tspans, 1))
    row["speedup_w4a16_vs_torch"] = row["torch_bf16_us"] / row["sm90_w4a16_us"]
    return row


def test_record_holds_the_rates(bench):
    r = _record(bench)
    # shapes and routing: 6 experts on average (4 and 8), 4 in the profiled first set
    assert r["experts_used"] == 6 and r["profile_experts_used"] == 4
    assert r["nvfp4_weight_bytes"] == 6 * 55296 and r["bf16_weight_bytes"] == 6 * 196608
    assert (r["flops"], r["gemm1_flops"], r["gemm2_flops"]) == (1572864, 1048576, 524288)
    assert (r["profile_gemm1_weight_bytes"], r["profile_gemm2_weight_bytes"]) == (4 * 36864, 4 * 18432)
    assert r["floor_weight_us"] == pytest.approx(0.331776) and r["floor_compute_us"] == pytest.approx(1.572864)
    # the forward: median 3 us, p10 2 us
    assert r["sm90_w4a16_us"] == pytest.approx(3.0) and r["sm90_w4a16_p10_us"] == pytest.approx(2.0)
    assert r["sm90_w4a16_queued_us"] == pytest.approx(2.5)
    assert r["sm90_w4a16_weight_GBps"] == pytest.approx(110.592) and r["sm90_w4a16_tflops"] == pytest.approx(0.524288)
    assert r["sm90_w4a16_pct_copy_bw"] == pytest.approx(11.0592)
    assert r["roofline_frac_w4a16"] == pytest.approx(1.572864 / 3.0)
    # per GEMM, the profiled set's bytes over each kernel's duration
    assert r["sm90_w4a16_gemm1_weight_GBps"] == pytest.approx(16.384)
    assert r["sm90_w4a16_gemm2_weight_GBps"] == pytest.approx(7.3728)
    assert r["sm90_w4a16_gemm1_tflops"] == pytest.approx(1048576 / 9e-6 / 1e12)
    assert r["sm90_w4a16_gemm_us"] == pytest.approx(19.0) and r["sm90_w4a16_other_us"] == pytest.approx(6.0)
    assert r["sm90_w4a16_gemm_weight_GBps"] == pytest.approx(221184 / 19e-6 / 1e9)
    assert r["sm90_w4a16_other_share"] == pytest.approx(5.0 / 23.0)
    assert r["sm90_w4a16_gemm_kernels"] == "wg_gemm_kernel<128, 128, true, false>,wg_gemm_kernel<128, 128, true, true>"
    # torch bf16: its own (bf16) bytes, no roofline fraction
    assert r["torch_bf16_weight_GBps"] == pytest.approx(196.608) and r["torch_bf16_tflops"] == pytest.approx(0.262144)
    assert "roofline_frac_torch_bf16" not in r and "torch_bf16_pct_copy_bw" not in r
    assert r["torch_bf16_gemm1_weight_GBps"] == pytest.approx(4 * 131072 / 10e-6 / 1e9)
    assert r["torch_bf16_gemm2_tflops"] == pytest.approx(524288 / 10e-6 / 1e12)
    assert r["torch_bf16_other_share"] == pytest.approx(10.0 / 30.0)
    import json

    json.dumps(r)  # the record stays JSON


def test_table_prints_one_line_per_preset_path_and_t(bench):
    r = _record(bench)
    lines = bench.table_lines({"results": [r]}, ["w4a16"])
    header = next(ln for ln in lines if ln.startswith("preset"))
    body = [ln for ln in lines if ln.startswith("tiny")]
    assert len(body) == 2  # w4a16 and torch
    cols = header.split()
    ours = dict(zip(cols, body[0].split()))
    torch_ = dict(zip(cols, body[1].split()))
    assert ours["path"] == "w4a16" and ours["T"] == "4" and ours["us"] == "3.0" and ours["queued"] == "2.5"
    assert ours["%roof"] == "52" and ours["GB/s"] == "111" and ours["TF/s"] == "0.5"
    assert ours["g1GB/s"] == "16" and ours["g2GB/s"] == "7" and ours["other%"] == "21.7"
    assert ours["xtorch"] == "2.00" and ours["plan"] == "wgmma64/64/64"
    assert torch_["path"] == "torch" and torch_["us"] == "6.0" and torch_["%roof"] == "-" and torch_["GB/s"] == "197"
    assert torch_["g1GB/s"] == "52" and torch_["other%"] == "33.3" and torch_["xtorch"] == "-"
    assert all(len(ln) <= 120 for ln in lines), [len(ln) for ln in lines]


def test_table_marks_errors_and_missing_profile(bench):
    r = _record(bench)
    dropped = ("sm90_w4a16_gemm", "sm90_w4a16_other", "torch_bf16", "speedup")
    other = {k: v for k, v in r.items() if not k.startswith(dropped)}
    other["T"] = 8
    other["sm90_w4a4_error"] = "RuntimeError('no kernel for this shape')"
    lines = bench.table_lines({"results": [r, other]}, ["w4a16", "w4a4"])
    body = [ln for ln in lines if ln.startswith("tiny")]
    # T = 4: w4a16, w4a4 (never ran: err), torch; T = 8: w4a16, w4a4 (err), no torch line
    assert [ln.split()[2] for ln in body] == ["w4a16", "w4a4", "torch", "w4a16", "w4a4"]
    cols = next(ln for ln in lines if ln.startswith("preset")).split()
    no_profile = dict(zip(cols, body[3].split()))
    assert no_profile["us"] == "3.0" and no_profile["g1GB/s"] == "-" and no_profile["other%"] == "-"
    assert body[4].split()[3] == "err"
    assert any("T=8 sm90_w4a4_error: RuntimeError('no kernel for this shape')" in ln for ln in lines)


def test_main_writes_the_rates_into_the_record(bench, monkeypatch, tmp_path, capsys):
    """main() end to end on the host with every GPU step replaced by given numbers (floors, replay times, profiler
    intervals; nothing is timed): each row of the JSON holds the forward's and each GEMM's rates and the non-GEMM
    share for both modes and torch, and the output has one table that starts with "preset"."""
    import json

    import torch

    import megamoe.backends as backends

    cpu_gen = torch.Generator
    monkeypatch.setattr(torch, "Generator", lambda device=None: cpu_gen())
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "test device")
    monkeypatch.setattr(bench, "versions", lambda: {})
    monkeypatch.setattr(bench, "measure_copy_bw", lambda: 4e12)
    monkeypatch.setattr(bench, "measure_bf16_rate", lambda: 8e14)
    make_weights = bench.random_weights
    monkeypatch.setattr(bench, "random_weights", lambda cfg, gen: make_weights(cfg, gen, device="cpu"))
    monkeypatch.setattr(bench, "bf16_weights", lambda cfg, gen: (torch.zeros(1), torch.zeros(1)))

    def routing(t, cfg, gen):
        ids = torch.rand((t, cfg.num_experts), generator=gen).topk(cfg.top_k, dim=1).indices.to(torch.int32)
        return torch.zeros(t, cfg.hidden_size), ids, torch.ones(t, cfg.top_k)

    monkeypatch.setattr(bench, "random_routing", routing)
    monkeypatch.setattr(bench, "time_graph", lambda fn, sets, bufs, reps, warmup=3, queued=False:
                        ([3e-6, 2e-6, 4e-6], [2.5e-6]) if queued else [3e-6, 2e-6, 4e-6])

    def profile(fn, reps=bench.PROFILE_REPS):  # every forward as the first of _two_forwards: gemm1 8 us, gemm2 11
        one = [(ALIGN, 0.0, 2.0), (G1, 2.0, 10.0), (G2, 9.0, 20.0), (COMBINE, 19.0, 23.0)]
        spans = [(n, a + 100.0 * r, b + 100.0 * r) for r in range(reps) for n, a, b in one]
        return {G1: 8.0, G2: 11.0, ALIGN: 2.0, COMBINE: 4.0}, spans

    monkeypatch.setattr(bench, "profile_kernels", profile)

    class Plan:
        kernel, token_tile, tokens_per_pass = "Sm90GemmKernel.wgmma64", 64, 0

    class Backend:
        kernel, tokens_per_pass, _workspaces = "auto", 0, {}

        def prepare_weights(self, w):
            return w

        def plan(self, **kw):
            return Plan()

    monkeypatch.setattr(backends, "get_backend", lambda name: Backend())
    out = tmp_path / "moe.json"
    assert bench.main(["--presets", "tiny", "--tokens", "4", "--profile", "--out", str(out)]) == 0
    (row,) = json.loads(out.read_text())["results"]
    cfg = _tiny()
    used0 = row["profile_experts_used"]
    assert 1 <= used0 <= 8 and row["profile_gemm1_weight_bytes"] == used0 * 36864
    for path in ("sm90_w4a16", "sm90_w4a4", "torch_bf16"):
        assert row[f"{path}_us"] == pytest.approx(3.0)
        assert row[f"{path}_tflops"] == pytest.approx(sum(bench.gemm_flops(cfg, 4).values()) / 3e-6 / 1e12)
        assert row[f"{path}_gemm1_us"] == pytest.approx(8.0) and row[f"{path}_gemm2_us"] == pytest.approx(11.0)
        assert row[f"{path}_gemm2_exclusive_us"] == pytest.approx(10.0)
        assert row[f"{path}_gemm2_tflops"] == pytest.approx(524288 / 11e-6 / 1e12)
        assert row[f"{path}_other_share"] == pytest.approx(5.0 / 23.0)
    assert row["sm90_w4a16_weight_GBps"] == pytest.approx(row["experts_used"] * 55296 / 3e-6 / 1e9)
    assert row["torch_bf16_weight_GBps"] == pytest.approx(row["experts_used"] * 196608 / 3e-6 / 1e9)
    assert row["sm90_w4a4_gemm1_weight_GBps"] == pytest.approx(used0 * 36864 / 8e-6 / 1e9)
    assert row["torch_bf16_gemm1_weight_GBps"] == pytest.approx(used0 * 131072 / 8e-6 / 1e9)
    assert not any(k.endswith("_error") for k in row), [k for k in row if k.endswith("_error")]
    printed = capsys.readouterr().out.splitlines()
    assert sum(ln.startswith("preset") for ln in printed) == 1
    final = printed[printed.index(next(ln for ln in printed if ln.startswith("preset"))):]
    assert [ln.split()[2] for ln in final[1:]] == ["w4a16", "w4a4", "torch"]
    # --top-k: one row per k, each with the FLOPs and the experts of its own k
    out_k = tmp_path / "moe_k.json"
    assert bench.main(["--presets", "tiny", "--tokens", "4", "--top-k", "1", "3", "--out", str(out_k)]) == 0
    rows = json.loads(out_k.read_text())["results"]
    assert [r["preset"] for r in rows] == ["tiny/k1", "tiny/k3"]
    for r, k in zip(rows, (1, 3)):
        assert r["flops"] == sum(bench.gemm_flops(cfg.with_(top_k=k), 4).values())
        assert 1 <= r["experts_used"] <= 4 * k and not any(key.endswith("_error") for key in r)
    assert rows[1]["flops"] == 3 * rows[0]["flops"]


# ----------------------------------------------------------------------------- bench/gemm_counters.py (host only)
@pytest.fixture(scope="module")
def counters():
    return _load_bench("gemm_counters")


def _raw_csv(counters, rows, drop=None):
    """An ncu raw page (header, units, rows) holding every metric gemm_counters reads, plus two stall reasons."""
    stall = [counters.STALL_PREFIX + r + counters.STALL_SUFFIX for r in ("barrier", "long_scoreboard")]
    names = ["ID", "Kernel Name", *counters.METRICS.values(), *counters.OPTIONAL_METRICS.values(), *stall]
    units = {"gpu__time_duration.sum": "ms", "gpc__cycles_elapsed.max.per_second": "Ghz",
             "dram__bytes.sum.per_second": "Gbyte/s", "launch__shared_mem_per_block": "Kbyte/block"}
    keep = [i for i, n in enumerate(names) if n != drop]
    lines = [[names[i] for i in keep], [units.get(names[i], "") for i in keep]]
    lines += [[r[i] for i in keep if i < len(r)] for r in rows]
    return "\n".join(",".join(f'"{c}"' for c in line) for line in lines) + "\n"


def _row(counters, kid, name, duration_ms, dram_gbps, stalls):
    values = {"gpu__time_duration.sum": duration_ms, "gpc__cycles_elapsed.max.per_second": "1.75",
              "dram__bytes.sum.per_second": dram_gbps, "launch__grid_size": "3,584",
              "launch__shared_mem_per_block": "211.28", "lts__throughput.avg.pct_of_peak_sustained_elapsed": "71.3"}
    metrics = [*counters.METRICS.values(), *counters.OPTIONAL_METRICS.values()]
    return [str(kid), name, *[values.get(m, "12.5") for m in metrics], *stalls]


def test_counters_summarize_scales_units_and_orders_stalls(counters):
    rows = [_row(counters, 0, "void wg_gemm_kernel<64, 256, 1, 0, 0>(GroupedGemmCommon, WgMaps)", "1.0195", "2630.5",
                 ["0.31", "1.62"]),
            _row(counters, 1, "void wg_gemm_kernel<8, 256, 0, 0, 1>(GroupedGemmCommon, WgMaps)", "0.0294", "2008.4",
                 ["1.89", "n/a"]),
            ["2", "a truncated row"]]
    ks = counters.summarize(_raw_csv(counters, rows))
    assert [k["kernel"].split("(")[0] for k in ks] == ["void wg_gemm_kernel<64, 256, 1, 0, 0>",
                                                         "void wg_gemm_kernel<8, 256, 0, 0, 1>"]
    assert ks[0]["duration_us"] == pytest.approx(1019.5)  # ms -> µs
    assert ks[1]["duration_us"] == pytest.approx(29.4)
    assert ks[0]["dram_tbps"] == pytest.approx(2.6305)  # Gbyte/s -> TB/s
    assert ks[0]["grid_blocks"] == 3584  # thousands separator
    assert ks[0]["smem_kb_per_block"] == pytest.approx(211.28)
    assert ks[0]["l2_throughput_pct"] == pytest.approx(71.3) and ks[0]["l1_throughput_pct"] == pytest.approx(12.5)
    assert list(ks[0]["stalls_per_issue"]) == ["long_scoreboard", "barrier"]  # largest first
    assert ks[1]["stalls_per_issue"] == {"barrier": 1.89}  # a value that is not a number is left out


def test_counters_refuse_a_page_without_their_metrics(counters):
    rows = [_row(counters, 0, "k", "1", "1", ["1", "1"])]
    with pytest.raises(ValueError, match="dram__bytes.sum.per_second"):
        counters.summarize(_raw_csv(counters, rows, drop="dram__bytes.sum.per_second"))
    assert counters.summarize("") == []
    # an optional metric the page lacks (an ncu that does not report it) reads as None, the rest as before
    lts = counters.OPTIONAL_METRICS["l2_throughput_pct"]
    ks = counters.summarize(_raw_csv(counters, [_row(counters, 0, "k", "1", "1", ["1", "1"])], drop=lts))
    assert ks[0]["l2_throughput_pct"] is None and ks[0]["duration_us"] == pytest.approx(1000.0)


def test_counters_shapes(counters):
    assert counters.parse_shape("v4-flash:1") == ("v4-flash", 1, "w4a16")
    assert counters.parse_shape("v3:2048:w4a4") == ("v3", 2048, "w4a4")
    for bad in ("v3", "v3:0", "v3:x", "v3:8:fp8", "v3:8:w4a4:1"):
        with pytest.raises(Exception, match="expected preset:T|is not w4a16"):
            counters.parse_shape(bad)


def test_counters_table_prints_a_dash_for_a_missing_figure(counters):
    k = {"kernel": "void wg_gemm_kernel<8, 256, 0, 0, 1>(GroupedGemmCommon, WgMaps)", "preset": "v4-flash", "T": 1,
         "mode": "w4a16", "duration_us": 28.4, "sm_clock_ghz": None, "dram_tbps": 2.08, "tensor_active_pct": 5.7,
         "issue_active_pct": 44.5, "stalls_per_issue": {"long_scoreboard": 2.04, "wait": 0.99}}
    k["l2_throughput_pct"] = 64.2
    row = counters.table([k]).splitlines()[1]
    assert row.startswith("v4-flash:1:w4a16") and "wg_gemm_kernel<8, 256, 0, 0, 1>" in row
    assert "28.4" in row and "    -" in row and "long_scoreboard 2.04, wait 0.99" in row
    assert " 64.2     -  long_scoreboard" in row  # L2% given, L1% absent (a record from before it was read)


def _source_csv(rows, samples_column="Warp Stall Sampling (All Samples)"):
    """An ncu source page (--print-source sass) of one kernel: 'Kernel Name', the header, one line per instruction
    (address, SASS, samples, and two stall reasons as the page itemizes them)."""
    head = ["Address", "Source", samples_column, "# Samples", "stall_barrier", "stall_long_sb",
            "stall_barrier (Not Issued)"]
    lines = [["Kernel Name", "void wg_gemm_kernel<128, 128, 1, 0, 0>(GroupedGemmCommon, WgMaps)"], head]
    lines += [[f"0x{16 * i:x}", sass, str(n), str(n), str(b), str(l), "0"] for i, (sass, n, b, l) in enumerate(rows)]
    lines.append(["0x999", "a truncated line"])
    return "\n".join(",".join(f'"{c}"' for c in line) for line in lines) + "\n"


def test_counters_stall_samples_by_instruction_class(counters):
    rows = [("      LDC R1, c[0x0][0x28]", 10, 0, 0),
            ("      SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [UR8], R6", 2, 0, 0),
            ("@!P0  BRA 0x7fe237a90740", 30, 0, 29),            # the try-wait's retry: a full-barrier wait
            ("      WARPGROUP.DEPBAR.LE gsb0, 0x0", 40, 39, 0),
            ("      HGMMA.64x96x16.F32.BF16 R24, R72, gdesc[UR8], R24", 10, 0, 0),
            ("      HMUL2.BF16_V2 R93, R93, R6", 5, 0, 0),
            ("      LDS.64 R4, [R2]", 3, 0, 0),
            ("@P1   BRA 0x40", 0, 0, 0)]                         # a branch elsewhere: other (no samples here)
    [k] = counters.summarize_sources(_source_csv(rows))
    assert k["samples"] == 100
    assert k["by_class_pct"] == {"wgmma drain": 40.0, "full-barrier wait": 32.0, "other": 10.0, "wgmma": 10.0,
                                 "bf16x2 math": 5.0, "shared memory": 3.0}
    assert list(k["by_class_pct"])[:2] == ["wgmma drain", "full-barrier wait"]  # largest first
    assert [t["sass"] for t in k["top"][:2]] == ["WARPGROUP.DEPBAR.LE gsb0, 0x0", "@!P0 BRA 0x7fe237a90740"]
    assert k["top"][0]["pct"] == 40.0 and k["top"][0]["reasons_pct"] == {"barrier": 97.5}
    assert k["top"][1]["reasons_pct"] == {"long_sb": 96.7}
    assert len(k["top"]) == 7  # instructions without samples are not listed
    assert counters._sample_class("BAR.SYNC.DEFER_BLOCKING") == "block barrier"
    assert counters._sample_class("BRA") == "other" and counters._sample_class("LDSM.16.M88.4") == "shared memory"


def test_counters_source_page_without_samples_is_refused(counters):
    with pytest.raises(ValueError, match="SourceCounters"):
        counters.summarize_sources(_source_csv([("NOP", 1, 0, 0)], samples_column="Instructions Executed"))
    assert counters.summarize_sources("") == []


def test_counters_table_prints_the_stall_sample_classes(counters):
    k = {"kernel": "void wg_gemm_kernel<128, 128, 1, 0, 0>(GroupedGemmCommon, WgMaps)", "preset": "v4-flash",
         "T": 8192, "mode": "w4a16", "duration_us": 2655.2, "sm_clock_ghz": 1.72, "dram_tbps": 1.15,
         "tensor_active_pct": 70.3, "issue_active_pct": 44.1, "stalls_per_issue": {"barrier": 1.74},
         "stall_samples": {"samples": 100, "by_class_pct": {"wgmma drain": 18.8, "other": 49.1}, "top": []}}
    lines = counters.table([k]).splitlines()
    assert len(lines) == 3 and lines[2].strip() == "stall samples: wgmma drain 18.8%, other 49.1%"


def test_counters_a_failed_page_import_is_one_runtime_error(counters, tmp_path):
    ncu = tmp_path / "ncu"
    ncu.write_text("#!/bin/sh\necho 'cannot read report' >&2\nexit 3\n")
    ncu.chmod(0o755)
    with pytest.raises(RuntimeError, match=r"--page source failed \(3\): cannot read report"):
        counters._import_page(str(ncu), str(tmp_path / "rep"), "source", "--print-source", "sass")


def test_counters_a_failed_ncu_run_names_its_label_and_shape(counters, tmp_path):
    ncu = tmp_path / "ncu"
    ncu.write_text("#!/bin/sh\necho \"args: $*\"\nexit 2\n")
    ncu.chmod(0o755)
    with pytest.raises(RuntimeError, match=r"ncu --section SourceCounters on v3:8:w4a16 failed \(2\)") as e:
        counters._record(str(ncu), str(tmp_path / "rep"), "v3:8:w4a16", ["--launch-skip", "1"],
                         "ncu --section SourceCounters", 30)
    assert "--kernel-name regex:(wg_gemm|stream_gemm) --launch-skip 1 -f -o" in str(e.value)

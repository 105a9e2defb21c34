"""bench/moe_bench.py's profile accounting (host only): the exposed non-GEMM time of a forward."""
from __future__ import annotations

import importlib.util
import os

import pytest

_PATH = os.path.join(os.path.dirname(__file__), "..", "bench", "moe_bench.py")


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("moe_bench", _PATH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


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
    assert args.out.endswith("moe_h200_tp8.json")
    one = bench.parse_args(["--presets", "v4-flash"])
    assert one.configs["v4-flash"].intermediate_size == 2048 and one.out.endswith("moe_h200.json")
    pa = bench.plan_args(v4, 8192, "w4a4")
    assert (pa["k_gemm1"], pa["k_gemm2"], pa["num_experts"], pa["tokens_per_expert"]) == (4096, 256, 256, 192)
    assert pa["h_static_scale"] and not pa["w4a16"]
    # a rank's expert FLOPs (and so its floors): 1/8 of the whole layer's
    from megamoe.backends.cuda_sm90 import CudaSm90Backend

    assert CudaSm90Backend.expert_flops(v4, 64) * 8 == CudaSm90Backend.expert_flops(one.configs["v4-flash"], 64)


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

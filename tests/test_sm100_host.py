"""Host-side tests of the Blackwell (sm_100a) CUTLASS grouped GEMM path; run on the CPU.

What is checked here, without a GPU (the kernel itself never runs in CI):

* the SF layouts CUTLASS is given for A and B (CuTe's ``tile_atom_to_shape_SFA/SFB``)
  equal the docs/SPEC.md §2 closed form of :func:`megamoe.nvfp4.sf_offset` for every (m, kb),
  and span exactly the padded size;
* for the MoE shapes of docs/SPEC.md §3 and docs/FIELD_BUGS.md rows 1-12: per-group problem shapes, strides,
  pointer offsets (expert rows padded to 128), SF offsets of every group, alphas (gate and
  up separate, global scales far from 1), workspace size and CUTLASS ``can_implement``;
* the backend's MoE glue and GEMM on the CPU with :func:`emulate_grouped_gemm` in place of
  the kernel, driven by the planner's pointer offsets, against the torch reference;
* the backend reports itself unavailable here, with the reason.
"""
from __future__ import annotations

import math

import pytest
import torch

from _helpers import cosine, poison_empty, random_nvfp4
from megamoe import _ext, nvfp4
from megamoe.presets import PRESETS

pytestmark = pytest.mark.skipif(
    not _ext.has_part("sm100"),
    reason=f"megamoe._C built without sm_100a (parts {_ext.built_parts()}; {_ext.EXT_ERROR or 'no sm100 part'})",
)

SM_COUNT = 148


def _ext_mod():
    return _ext.ext


def _round_up(x: int, m: int) -> int:
    return (x + m - 1) // m * m


def _counts_from_routing(t: int, e: int, k: int, seed: int) -> list[int]:
    """Token counts per expert of a random top-k routing of T tokens (some experts empty)."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(t)]) if t else torch.zeros(0, k)
    return torch.bincount(ids.reshape(-1).long(), minlength=e).tolist()


def _plan(counts, parts, n_part, k, a_gs=None, b_gs=None, sm_count=SM_COUNT, tile_n=128):
    e = len(counts)
    a_gs = [1.0] if a_gs is None else list(a_gs)
    b_gs = [1.0] * (e * parts) if b_gs is None else list(b_gs)
    return _ext_mod().sm100_plan_moe_gemm(counts, parts, n_part, k, a_gs, b_gs, sm_count, tile_n=tile_n)


def _compact_offsets(counts) -> list[int]:
    """First compact row of each expert in A and D (and the total): sum_{j<e} count_j."""
    out = [0]
    for c in counts:
        out.append(out[-1] + c)
    return out


def _f32_mul(a: float, b: float) -> float:
    return float(torch.tensor(a, dtype=torch.float32) * torch.tensor(b, dtype=torch.float32))


def check_plan_against_spec(plan: dict, counts: list[int], a_gs: list[float], b_gs: list[float]) -> None:
    """Every per-group value of a plan against docs/SPEC.md §2 and the layout contract of
    cpp/include/megamoe/sm100_moe_groups.hpp, recomputed here from first principles."""
    parts, n_part, k = plan["parts"], plan["n_part"], plan["k"]
    e = len(counts)
    kb = k // 16
    sf_offsets = nvfp4.grouped_row_offsets(counts).tolist()  # scale factors: 128-row expert blocks
    row_offsets = _compact_offsets(counts)                  # A and D: compact
    sfb_part_bytes = math.prod(nvfp4.sf_padded_shape(n_part, kb))
    ldd = parts * n_part
    d_bytes = plan["d_element_bytes"]
    assert plan["num_groups"] == e * parts == len(plan["groups"])
    assert plan["total_rows"] == row_offsets[-1] == sum(counts)
    assert plan["sf_rows"] == sf_offsets[-1]
    assert plan["a_bytes"] == row_offsets[-1] * k // 2
    assert plan["d_elems"] == row_offsets[-1] * ldd
    assert plan["sfa_bytes"] == math.prod(nvfp4.sf_padded_shape(sf_offsets[-1], kb))
    assert plan["sfb_bytes"] == e * parts * sfb_part_bytes
    for g, grp in enumerate(plan["groups"]):
        ex, p = divmod(g, parts)
        c = counts[ex]
        assert (grp["expert"], grp["part"], grp["tokens"]) == (ex, p, c)
        assert grp["problem_shape"] == ((c, n_part, k) if c else (0, 0, 0))
        r0, s0 = row_offsets[ex], sf_offsets[ex]
        assert grp["row_offset"] == r0 and grp["sf_row_offset"] == s0 and s0 % 128 == 0
        # pointer arrays (operand bases at 0 -> byte offsets)
        assert grp["ptr_a"] == r0 * k // 2
        assert grp["ptr_sfa"] == nvfp4.sf_offset(s0, 0, kb)  # first scale of the expert in the grouped buffer
        assert grp["ptr_b"] == (ex * parts + p) * n_part * k // 2
        assert grp["ptr_sfb"] == (ex * parts + p) * sfb_part_bytes
        assert grp["ptr_d"] == (r0 * ldd + p * n_part) * d_bytes
        assert grp["ptr_alpha_index"] == g
        # strides (elements) as CuTe holds them: (rows, K, L)
        assert grp["stride_a"][:2] == [k, 1]
        assert grp["stride_b"][:2] == [k, 1]
        assert grp["stride_d"][:2] == [ldd, 1]
        # alpha = activation global scale x weight global scale of (expert, part)
        a_val = a_gs[0] if len(a_gs) == 1 else a_gs[ex]
        assert grp["alpha"] == _f32_mul(a_val, b_gs[ex * parts + p])
        # SF layouts: padded size, docs/SPEC.md §2 atom, sampled offsets = closed form
        if c:
            assert grp["sfa_bytes"] == grp["sfa_cosize"] == math.prod(nvfp4.sf_padded_shape(c, kb))
        assert grp["sfb_bytes"] == grp["sfb_cosize"] == sfb_part_bytes
        for key in ("layout_sfa", "layout_sfb"):
            assert "(_32,_4)" in grp[key] and "(_16,_4)" in grp[key] and "(_0,_1)" in grp[key], grp[key]
        for m, kk, off in grp["sfa_samples"]:
            assert off == nvfp4.sf_offset(m, kk, kb), (g, "A", m, kk)
        for m, kk, off in grp["sfb_samples"]:
            assert off == nvfp4.sf_offset(m, kk, kb), (g, "B", m, kk)
        if c:
            assert any(m == c - 1 for m, _, _ in grp["sfa_samples"])  # the last real row is sampled
        # every (m, kb) of both layouts against the C++ closed form (megamoe/sf_layout.hpp)
        assert grp["sfa_mismatches"] == 0 and grp["sfb_mismatches"] == 0, g
        assert grp["can_implement"]


# --------------------------------------------------------------------------------------------
# kernel configuration
# --------------------------------------------------------------------------------------------

def test_kernel_info_of_both_configurations():
    ext = _ext_mod()
    assert ext.sm100_kernel_info()["tile_n_options"] == (128, 64)
    narrow = ext.sm100_kernel_info(64)
    assert narrow["tile_shape"] == (128, 64, 256) and narrow["cluster_shape"] == (1, 1)
    assert narrow["schedule"] == ext.sm100_kernel_info(128)["schedule"]
    assert 0 < narrow["shared_storage_bytes"] <= narrow["smem_capacity_bytes"]
    with pytest.raises(ValueError, match="tile_n must be 64 or 128"):
        ext.sm100_kernel_info(96)


def test_kernel_info_is_the_default_config():
    info = _ext_mod().sm100_kernel_info()
    assert info["tile_shape"] == (128, 128, 256)
    assert info["cluster_shape"] == (1, 1)
    assert "KernelPtrArrayTmaWarpSpecialized1SmNvf4Sm100" in info["schedule"]
    assert info["element_a"] == info["element_b"] == "nv_float4_t<float_e2m1_t>"
    assert info["element_sf"] == "float_ue4m3_t"
    assert (info["element_d"], info["element_d_bytes"]) == ("float", 4)
    assert info["sf_vec_size"] == 16
    assert (info["alignment_a_elems"], info["alignment_b_elems"], info["alignment_d_elems"]) == (32, 32, 4)
    assert info["stages"] >= 2
    assert 0 < info["shared_storage_bytes"] <= info["smem_capacity_bytes"] == 232448
    assert info["threads_per_cta"] % 128 == 0
    assert info["expert_row_align"] == 128


# --------------------------------------------------------------------------------------------
# SF layout: CuTe (what CUTLASS reads) vs the docs/SPEC.md §2 closed form
# --------------------------------------------------------------------------------------------

SF_SHAPES = [(1, 64), (7, 208), (31, 16), (33, 464), (127, 480), (129, 7168), (300, 1856), (464, 5472),
             (2, 5472), (1040, 96)]


@pytest.mark.parametrize("operand", ["A", "B"])
@pytest.mark.parametrize("rows,k", SF_SHAPES)
def test_sf_layout_equals_spec_closed_form(rows, k, operand):
    got = torch.tensor(_ext_mod().sm100_sf_layout_offsets(rows, k, operand), dtype=torch.int64)
    kb = k // 16
    m = torch.arange(rows).unsqueeze(1)
    kk = torch.arange(kb).unsqueeze(0)
    want = nvfp4.sf_offset(m, kk, kb).reshape(-1)
    assert got.shape == want.shape
    bad = (got != want).nonzero().flatten()
    assert bad.numel() == 0, f"{bad.numel()} offsets differ, first at (m, kb) = {divmod(int(bad[0]), kb)}"
    # a bijection of the logical scales into the padded buffer (docs/FIELD_BUGS.md row 1: size vs cosize)
    padded = math.prod(nvfp4.sf_padded_shape(rows, kb))
    assert int(got.max()) < padded and int(got.min()) >= 0
    assert torch.unique(got).numel() == rows * kb


def test_sf_layout_agrees_with_compiled_closed_form():
    """The C++ closed form compiled into the kernels (megamoe._C.sf_offset) agrees too."""
    ext = _ext_mod()
    rows, k = 129, 464
    offs = ext.sm100_sf_layout_offsets(rows, k, "A")
    kb = k // 16
    for m in (0, 1, 31, 32, 127, 128):
        for kk in (0, 3, 4, kb - 1):
            assert offs[m * kb + kk] == ext.sf_offset(0, m, kk, rows, kb)


def test_sf_layout_rejects_bad_arguments():
    ext = _ext_mod()
    with pytest.raises(ValueError):
        ext.sm100_sf_layout_offsets(4, 40, "A")  # K not a multiple of 16
    with pytest.raises(ValueError):
        ext.sm100_sf_layout_offsets(4, 64, "C")


# --------------------------------------------------------------------------------------------
# plans for the MoE shapes of docs/SPEC.md §3
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("preset", ["tiny", "small", "v4-flash", "v3"])
@pytest.mark.parametrize("tokens", [1, 61, 300])
def test_preset_plans(preset, tokens):
    cfg = PRESETS[preset]
    e, h, i, k = cfg.num_experts, cfg.hidden_size, cfg.intermediate_size, cfg.top_k
    counts = _counts_from_routing(tokens, e, k, seed=tokens)
    assert sum(counts) == tokens * k
    gen = torch.Generator().manual_seed(7)
    w13_gs = (torch.rand(e, 2, generator=gen) * 2 + 0.1).tolist()
    in_gs = (torch.rand(e, generator=gen) + 0.5).tolist()
    b13 = [v for pair in w13_gs for v in pair]
    # GEMM 1: gate and up of every expert, K = H; static per-expert activation scales
    p1 = _plan(counts, 2, i, _round_up(h, 32), in_gs, b13)
    assert p1["can_implement"] and p1["problems"] == [] and p1["can_implement_status"] == "Success"
    check_plan_against_spec(p1, counts, in_gs, b13)
    # GEMM 2: down projection, K = I (padded to 32), one activation scale
    b2 = (torch.rand(e, generator=gen) + 0.5).tolist()
    p2 = _plan(counts, 1, h, _round_up(i, 32), [0.25], b2)
    assert p2["can_implement"] and p2["problems"] == []
    check_plan_against_spec(p2, counts, [0.25], b2)
    for p in (p1, p2):
        assert p["workspace_bytes"] == _ext_mod().sm100_workspace_bytes(p["num_groups"], SM_COUNT) > 0
        # the launcher passes host shapes when it has them: the buffer sized without them must suffice
        assert p["workspace_bytes_host_shapes"] <= p["workspace_bytes"]
        assert p["args_bytes"] == _ext_mod().sm100_args_bytes(p["num_groups"])
        # every per-group array section fits in the args buffer, in order, 256-byte aligned
        sections = sorted(v for kk, v in p["args_layout"].items() if kk != "total_bytes")
        assert all(s % 256 == 0 for s in sections) and sections[-1] < p["args_bytes"]


def test_tokens_not_multiple_of_128_pad_only_the_scale_factors():
    """A and D compact (vLLM-style), the scale factors in 128-row expert blocks."""
    counts = [130, 0, 1, 127, 128, 129, 0, 33]  # T*k = 548, not a multiple of 128
    for tile_n in (128, 64):
        p = _plan(counts, 2, 128, 256, tile_n=tile_n)
        check_plan_against_spec(p, counts, [1.0], [1.0] * 16)
        assert [g["row_offset"] for g in p["groups"][::2]] == [0, 130, 130, 131, 258, 386, 515, 515]
        assert [g["sf_row_offset"] for g in p["groups"][::2]] == [0, 256, 256, 384, 512, 640, 896, 896]
        assert p["total_rows"] == 548 and p["sf_rows"] == 1024 and p["tile_n"] == tile_n
        # D byte offsets of gate and up of expert 3: compact row 131, ldd = 256 floats
        g3 = p["groups"][6:8]
        assert [g["ptr_d"] for g in g3] == [131 * 256 * 4, (131 * 256 + 128) * 4]


def test_empty_experts_get_empty_problems():
    counts = [0, 5, 0, 0, 9]
    p = _plan(counts, 2, 256, 256)
    shapes = [g["problem_shape"] for g in p["groups"]]
    assert shapes == [(0, 0, 0)] * 2 + [(5, 256, 256)] * 2 + [(0, 0, 0)] * 4 + [(9, 256, 256)] * 2
    assert p["can_implement"]
    p_all_empty = _plan([0, 0, 0], 1, 64, 64)
    assert p_all_empty["total_rows"] == 0 and p_all_empty["can_implement"]


# --------------------------------------------------------------------------------------------
# FIELD_BUGS shapes (host side)
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("m", [1, 7, 31, 33, 127, 129])
def test_field_bug_5_small_and_odd_m(m):
    """M <= 32 and around 128: the SF block of A is still a full padded 128-row tile."""
    p = _plan([m], 1, 256, 512)
    check_plan_against_spec(p, [m], [1.0], [1.0])
    g = p["groups"][0]
    assert g["sfa_bytes"] == math.prod(nvfp4.sf_padded_shape(m, 512 // 16)) == _round_up(m, 128) * 32
    assert {s[0] for s in g["sfa_samples"]} >= {0, m - 1}


@pytest.mark.parametrize("inter", [464, 5472, 1856])
def test_field_bug_8_intermediate_not_multiple_of_128(inter):
    """I = 464 (10944/2 / ... TP splits), 5472, 1856: N of GEMM 1 and K of GEMM 2."""
    counts = [3, 0, 130, 17]
    h = 1024
    p1 = _plan(counts, 2, inter, h)
    assert p1["can_implement"], p1
    check_plan_against_spec(p1, counts, [1.0], [1.0] * 8)
    k2 = _round_up(inter, 32)
    p2 = _plan(counts, 1, h, k2)
    assert p2["can_implement"]
    check_plan_against_spec(p2, counts, [1.0], [1.0] * 4)
    if inter % 32:
        # unpadded K: rows of inter/2 bytes are not 16-byte aligned; CUTLASS and megamoe both refuse
        bad = _plan(counts, 1, h, inter)
        assert not bad["can_implement"]
        assert any(f"k = {inter}" in s for s in bad["problems"])
        assert not any(g["can_implement"] for g in bad["groups"] if g["tokens"])


def test_k_blocks_not_multiple_of_4():
    """K/16 = 13 or 29 (SF tile columns padded to 4): K padded to 32 keeps K/16 odd-sized tiles right."""
    for k, k_pad in ((208, 224), (464, 480)):
        assert not _plan([33], 1, 256, k)["can_implement"]
        p = _plan([33, 200], 1, 256, k_pad)
        assert p["can_implement"]
        assert (k_pad // 16) % 4 != 0
        check_plan_against_spec(p, [33, 200], [1.0], [1.0, 1.0])


def test_field_bug_9_many_experts_hidden_not_multiple_of_128():
    """Per-expert SF offsets use padded rows: activations per expert (128) and weight rows (H -> 1152)."""
    h = 1040  # H % 128 = 16
    counts = _counts_from_routing(97, 64, 6, seed=9)
    p = _plan(counts, 1, h, 512)
    check_plan_against_spec(p, counts, [1.0], [1.0] * 64)
    sfb_stride = p["groups"][1]["ptr_sfb"] - p["groups"][0]["ptr_sfb"]
    assert sfb_stride == 1152 * 512 // 16 and sfb_stride != h * 512 // 16
    # expert 63's scales start after 63 padded blocks, not after 63 * H rows
    assert p["groups"][63]["ptr_sfb"] == 63 * 1152 * 32


def test_field_bugs_10_11_gate_up_alphas_distinct_and_far_from_one():
    e = 6
    gate = [1e-3 * (j + 1) for j in range(e)]
    b_gs = [v for j in range(e) for v in (gate[j], 10 * gate[j])]  # up 10x gate
    a_gs = [1e3 / (j + 2) for j in range(e)]
    counts = [5, 0, 129, 1, 64, 300]
    p = _plan(counts, 2, 464, 1024, a_gs, b_gs)
    check_plan_against_spec(p, counts, a_gs, b_gs)
    for j in range(e):
        g_alpha, u_alpha = p["groups"][2 * j]["alpha"], p["groups"][2 * j + 1]["alpha"]
        assert g_alpha != u_alpha
        assert u_alpha == pytest.approx(10 * g_alpha, rel=1e-6)
        assert g_alpha == _f32_mul(a_gs[j], gate[j]) != 1.0


def test_workspace_depends_on_sm_count_not_on_groups_data():
    ext = _ext_mod()
    w148 = ext.sm100_workspace_bytes(16, 148)
    assert w148 > 0
    assert ext.sm100_workspace_bytes(16, 296) >= w148
    assert _plan([3, 5], 1, 128, 128, sm_count=132)["workspace_bytes"] == ext.sm100_workspace_bytes(2, 132)


def test_plan_rejects_bad_arguments():
    ext = _ext_mod()
    with pytest.raises(ValueError):
        ext.sm100_plan_moe_gemm([1, 2], 2, 128, 256, [1.0], [1.0], SM_COUNT)  # b scales: need E*parts
    with pytest.raises(ValueError):
        ext.sm100_plan_moe_gemm([1, -2], 1, 128, 256, [1.0], [1.0, 1.0], SM_COUNT)
    with pytest.raises(ValueError):
        ext.sm100_plan_moe_gemm([1, 2], 1, 128, 40, [1.0], [1.0, 1.0], SM_COUNT)  # K % 16
    with pytest.raises(ValueError):
        ext.sm100_plan_moe_gemm([1, 2], 3, 128, 256, [1.0], [1.0] * 6, SM_COUNT)  # parts
    with pytest.raises(ValueError):
        ext.sm100_plan_moe_gemm([1, 2, 3], 1, 128, 256, [1.0, 1.0], [1.0] * 3, SM_COUNT)  # a scales: 1 or E
    bad_n = _plan([4], 2, 102, 256)  # n_part % 4: the up half of D would be misaligned
    assert not bad_n["can_implement"] and any("n_part" in s for s in bad_n["problems"])


# --------------------------------------------------------------------------------------------
# the planner's offsets drive a CPU emulation of the kernel: right bytes, right places
# --------------------------------------------------------------------------------------------

def test_emulated_grouped_gemm_reads_and_writes_where_the_plan_says():
    """Compact A and D (expert j's rows at sum_{i<j} count_i), scale factors in 128-row
    expert blocks: every group reads and writes exactly its rows; one spare row after the
    last expert stays poisoned (nothing writes past the real rows)."""
    from megamoe.backends.cuda_sm100 import emulate_grouped_gemm

    gen = torch.Generator().manual_seed(11)
    counts, n_part, k = [33, 0, 129, 1], 464, 480
    e, parts = len(counts), 2
    offs = _compact_offsets(counts)
    acts = [random_nvfp4(c, k, gen, 1.0) if c else None for c in counts]
    w = [random_nvfp4(parts * n_part, k, gen, 1.0) for _ in range(e)]
    rows = offs[-1] + 1
    a_data = torch.zeros(rows, k // 2, dtype=torch.uint8)
    for j, q in enumerate(acts):
        if q is not None:
            a_data[offs[j]: offs[j] + counts[j]] = q.data
    real_scales = torch.cat([q.scale.view(torch.uint8) for q in acts if q is not None])
    a_sf = nvfp4.swizzle_scales_grouped(real_scales.view(torch.float8_e4m3fn), counts)
    b_data = torch.stack([q.data for q in w])
    b_scale = torch.stack([q.scale for q in w])  # [E, 2 * n_part, K/16]
    b_sf = nvfp4.swizzle_scales(b_scale.reshape(e * parts, n_part, k // 16)).reshape(e, parts, -1)
    a_gs = [1e-3]
    b_gs = [v for j in range(e) for v in (1e3 * (j + 1), 1e4 * (j + 1))]
    plan = _plan(counts, parts, n_part, k, a_gs, b_gs)
    assert plan["sfa_bytes"] == a_sf.numel() and plan["a_bytes"] == (rows - 1) * k // 2
    out = torch.full((rows, parts * n_part), float("nan"))  # poisoned
    emulate_grouped_gemm(plan, a_data, a_sf, b_data, b_sf, out)
    assert torch.isnan(out[-1]).all()  # past the real rows: never written
    assert not torch.isnan(out[:-1]).any()  # every real row written, both halves
    for j, c in enumerate(counts):
        block = out[offs[j]: offs[j] + c]
        for p in range(parts):
            if not c:
                continue
            bq = nvfp4.NVFP4Tensor(w[j].data[p * n_part:(p + 1) * n_part], w[j].scale[p * n_part:(p + 1) * n_part],
                                   torch.tensor(1.0))
            alpha = _f32_mul(a_gs[0], b_gs[j * parts + p])
            ref = nvfp4.gemm(acts[j], bq, alpha=alpha)
            got = block[:, p * n_part:(p + 1) * n_part]
            assert torch.allclose(got, ref, rtol=1e-5, atol=1e-6 * float(ref.abs().max())), (j, p)


# --------------------------------------------------------------------------------------------
# the backend, with the emulator standing in for the kernel
# --------------------------------------------------------------------------------------------

@pytest.fixture
def emulated():
    from megamoe.backends.cuda_sm100 import CudaSm100Backend

    return CudaSm100Backend(device="cpu", executor="emulate", sm_count=SM_COUNT)


@pytest.mark.parametrize("m,n,k", [(1, 128, 64), (33, 256, 208), (129, 464, 512), (7, 20, 96)])
def test_backend_gemm_emulated_matches_reference(emulated, m, n, k):
    gen = torch.Generator().manual_seed(m * 7 + n)
    a = random_nvfp4(m, k, gen, 1e-3)
    b = random_nvfp4(n, k, gen, 1e3)
    ref = nvfp4.gemm(a, b, compute_dtype=torch.float64)
    out = emulated.gemm(a, b)
    assert out.shape == (m, n) and out.dtype == torch.float32
    assert cosine(out, ref) > 0.999999
    assert torch.allclose(out.double(), ref.double(), rtol=1e-5, atol=1e-6 * float(ref.abs().max()))
    # per-row global scales (a tensor scale per row group) go around the scalar alpha
    a_rows = nvfp4.NVFP4Tensor(a.data, a.scale, torch.linspace(0.5, 2.0, m, dtype=torch.float32))
    ref_rows = nvfp4.gemm(a_rows, b, compute_dtype=torch.float64)
    assert cosine(emulated.gemm(a_rows, b), ref_rows) > 0.999999


def _layer(preset, be, **over):
    from megamoe.moe import MoELayer

    return MoELayer.from_preset(preset, seed=5, backend=be, **over)


@pytest.mark.parametrize("preset,over,tokens", [
    ("tiny", {}, 61),
    ("tiny", {}, 1),
    ("tiny", {"intermediate_size": 464}, 130),
    ("tiny", {"dynamic_act_scale": True}, 61),
    ("tiny", {"hidden_size": 1040, "num_experts": 16, "top_k": 4}, 37),
])
def test_moe_forward_emulated_matches_torch_backend(emulated, preset, over, tokens):
    from megamoe.backends.torch_ref import TorchBackend

    layer = _layer(preset, emulated, **over)
    gen = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, layer.config.hidden_size, generator=gen).to(torch.bfloat16)
    w, ids = layer.route(x)
    out = emulated.moe_forward(layer._prepared, layer.config, x, ids, w)
    ref = TorchBackend().moe_forward(layer.weights, layer.config, x, ids, w)
    assert out.shape == ref.shape and torch.isfinite(out).all()
    assert cosine(out, ref) > 0.99999, cosine(out, ref)


def test_moe_forward_emulated_keeps_gate_and_up_scales_apart(emulated):
    """docs/FIELD_BUGS.md rows 10 and 11: up's weight_scale_2 10x gate's, both far from 1; dropping either
    changes the output."""
    from megamoe.backends.torch_ref import TorchBackend

    layer = _layer("tiny", emulated)
    wts = layer.weights
    e = wts.w13.global_scale.shape[0]
    gs = torch.stack([torch.full((e,), 1e-3), torch.full((e,), 1e-2)], dim=1) * torch.linspace(1, 2, e)[:, None]
    wts.w13 = nvfp4.NVFP4Tensor(wts.w13.data, wts.w13.scale, gs.float())
    prepared = emulated.prepare_weights(wts)
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(45, layer.config.hidden_size, generator=gen).to(torch.bfloat16)
    w, ids = layer.route(x)
    ref = TorchBackend().moe_forward(wts, layer.config, x, ids, w)
    out = emulated.moe_forward(prepared, layer.config, x, ids, w)
    assert cosine(out, ref) > 0.99999
    assert torch.equal(prepared.w13_gs.reshape(e, 2), gs.float())
    one_scale = nvfp4.NVFP4Tensor(wts.w13.data, wts.w13.scale, gs[:, 0].float().contiguous())
    wrong = TorchBackend().moe_forward(type(wts)(**{**wts.__dict__, "w13": one_scale}), layer.config, x, ids, w)
    assert cosine(out, wrong) < 0.999  # the check above could see a dropped up scale


def test_prepare_weights_pads_k_and_swizzles_gate_up_separately(emulated):
    layer = _layer("tiny", emulated, intermediate_size=464)
    p = layer._prepared
    cfg = layer.config
    e, h, i = cfg.num_experts, cfg.hidden_size, cfg.intermediate_size
    assert (p.k1, p.k2) == (256, 480)
    assert p.w2_data.shape == (e, h, 240) and (p.w2_data[..., 232:] == 0).all()
    kb1 = p.k1 // 16
    assert p.w13_sf.shape == (e, 2, math.prod(nvfp4.sf_padded_shape(i, kb1)))
    up = nvfp4.unswizzle_scales(p.w13_sf[3, 1], i, kb1)
    assert torch.equal(up.view(torch.uint8), layer.weights.w13.scale[3, i:].view(torch.uint8))
    assert p.w2_sf.shape == (e, 1, math.prod(nvfp4.sf_padded_shape(h, p.k2 // 16)))


def test_health_checks_pass_on_the_emulated_path(emulated):
    """What `megamoe selftest` runs on a B200, here with the emulator in place of the kernel."""
    from megamoe import health

    report = health.run_checks("quick", backend=emulated, seed=1234,
                               only=["gemm_cosine_uniform", "gemm_cosine_random", "moe_vs_reference"])
    bad = [c for c in report["checks"] if c["status"] != "pass"]
    assert not bad, bad


def test_backend_unavailable_here_with_reason():
    from megamoe.backends import available_backends, get_backend
    from megamoe.backends.cuda_sm100 import CudaSm100Backend

    ok, reason = CudaSm100Backend.availability()
    if torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 10:
        pytest.skip("a Blackwell GPU is present")
    assert not ok and reason
    assert available_backends()["cuda-sm100"] == (False, reason)
    with pytest.raises(ValueError, match="emulate"):
        CudaSm100Backend(device="cpu")
    with pytest.raises(RuntimeError, match="cuda-sm100"):
        get_backend("cuda-sm100")


# --------------------------------------------------------------------------------------------
# the launcher's host side: the backend's call matches the binding, bad input is refused early
# --------------------------------------------------------------------------------------------

def _aligned_zeros(*shape, dtype=torch.uint8, align=256):
    """Zeros whose data pointer is ``align``-byte aligned (a CPU allocation is only 64-byte aligned)."""
    n = math.prod(shape)
    item = torch.empty((), dtype=dtype).element_size()
    raw = torch.zeros(n + align // item, dtype=dtype)
    skip = (-raw.data_ptr() % align) // item
    return raw[skip: skip + n].view(shape)


def _launch_operands(counts, parts, n_part, k):
    rows = int(nvfp4.grouped_row_offsets(counts)[-1])
    e = len(counts)
    a_data = _aligned_zeros(rows, k // 2)
    a_sf = _aligned_zeros(math.prod(nvfp4.sf_padded_shape(rows, k // 16)))
    b_data = _aligned_zeros(e, parts * n_part, k // 2)
    b_sf = _aligned_zeros(e, parts, math.prod(nvfp4.sf_padded_shape(n_part, k // 16)))
    out = _aligned_zeros(rows, parts * n_part, dtype=torch.float32)
    return a_data, a_sf, b_data, b_sf, out


@pytest.mark.parametrize("counts_on", ["host", "device"])
def test_launch_reaches_the_device_only_after_host_checks(counts_on):
    """On a machine without a GPU the valid call gets as far as the CUDA runtime and fails there."""
    from megamoe.backends.cuda_sm100 import launch_grouped_gemm

    if torch.cuda.is_available():
        pytest.skip("a GPU is present: this test is about the host-side path")
    counts, parts, n_part, k = [3, 0, 130], 2, 128, 256
    ops = _launch_operands(counts, parts, n_part, k)
    one = torch.ones(1)
    arg = counts if counts_on == "host" else torch.tensor(counts, dtype=torch.int32)
    with pytest.raises(RuntimeError, match="cudaGetDevice"):
        launch_grouped_gemm(_ext_mod(), arg, parts, n_part, k, *ops[:4], one, torch.ones(6), ops[4], SM_COUNT, 0)
    with pytest.raises(ValueError, match="int32"):
        launch_grouped_gemm(_ext_mod(), torch.tensor(counts), parts, n_part, k, *ops[:4], one, torch.ones(6), ops[4],
                            SM_COUNT, 0)


@pytest.mark.parametrize("case", ["k_unaligned", "n_part_unaligned", "args_too_small", "misaligned_d", "bad_out"])
def test_launch_rejects_bad_input_before_any_cuda_call(case):
    from megamoe.backends.cuda_sm100 import launch_grouped_gemm

    counts, parts, n_part, k = [3, 5], 1, 128, 256
    if case == "k_unaligned":
        k = 464
    if case == "n_part_unaligned":
        parts, n_part = 2, 102
    a_data, a_sf, b_data, b_sf, out = _launch_operands(counts, parts, n_part, k)
    ext = _ext_mod()
    b_gs = torch.ones(len(counts) * parts)
    if case in ("k_unaligned", "n_part_unaligned"):
        with pytest.raises(ValueError, match="k = 464" if case == "k_unaligned" else "n_part = 102"):
            launch_grouped_gemm(ext, counts, parts, n_part, k, a_data, a_sf, b_data, b_sf, torch.ones(1), b_gs, out,
                                SM_COUNT, 0)
    elif case == "bad_out":
        with pytest.raises(TypeError, match="float32"):
            launch_grouped_gemm(ext, counts, parts, n_part, k, a_data, a_sf, b_data, b_sf, torch.ones(1), b_gs,
                                out.to(torch.bfloat16), SM_COUNT, 0)
    else:
        args = torch.zeros(ext.sm100_args_bytes(2), dtype=torch.uint8)
        d_ptr = out.data_ptr() + (4 if case == "misaligned_d" else 0)
        kw = dict(num_experts=2, parts=parts, n_part=n_part, k=k, a_scale_count=1, a=a_data.data_ptr(),
                  a_sf=a_sf.data_ptr(), b=b_data.data_ptr(), b_sf=b_sf.data_ptr(), d=d_ptr,
                  token_counts=torch.tensor(counts, dtype=torch.int32).data_ptr(),
                  a_global_scale=torch.ones(1).data_ptr(), b_global_scale=b_gs.data_ptr(), args=args.data_ptr(),
                  args_bytes=args.numel() - (16 if case == "args_too_small" else 0), workspace=args.data_ptr(),
                  workspace_bytes=0, host_token_counts=counts, sm_count=SM_COUNT, stream=0)
        with pytest.raises(ValueError, match="args buffer" if case == "args_too_small" else "16-byte aligned"):
            ext.sm100_moe_gemm(**kw)


@pytest.mark.parametrize("dynamic", [False, True])
def test_field_bug_6_nan_token_rows_do_not_leak(emulated, dynamic):
    """Padding tokens full of NaN/Inf (CUDA-graph batches) leave the real tokens' outputs unchanged."""
    layer = _layer("tiny", emulated, dynamic_act_scale=dynamic)
    gen = torch.Generator().manual_seed(6)
    x = torch.randn(40, layer.config.hidden_size, generator=gen).to(torch.bfloat16)
    w, ids = layer.route(x)
    clean = emulated.moe_forward(layer._prepared, layer.config, x, ids, w)
    junk = torch.full((9, x.shape[1]), float("nan"), dtype=x.dtype)
    junk[::2] = float("inf")
    x_all = torch.cat([x, junk])
    ids_all = torch.cat([ids, ids[:9].flip(0)])
    w_all = torch.cat([w, w[:9]])
    out = emulated.moe_forward(layer._prepared, layer.config, x_all, ids_all, w_all)
    assert torch.allclose(out[:40], clean, rtol=1e-6, atol=1e-6 * float(clean.abs().max()))
    again = emulated.moe_forward(layer._prepared, layer.config, x_all, ids_all, w_all)
    # docs/FIELD_BUGS.md row 14: rerun, same bits
    assert torch.equal(torch.nan_to_num(out), torch.nan_to_num(again))


@pytest.mark.parametrize("dynamic,tokens", [(False, 53), (True, 53), (False, 1), (True, 130)])
def test_moe_forward_emulated_gpt_oss_glue_matches_torch_backend(emulated, monkeypatch, dynamic, tokens):
    """gpt-oss through the sm100 host glue: b13 added to the gate/up GEMM's output before the
    clamped activation (alpha 1.702, up + 1), b2 per row before the routing weight (after the
    dynamic per-row scale of GEMM 2), masked slots skipped; unwritten buffers are NaN."""
    from megamoe import checkpoint as C
    from megamoe.backends.torch_ref import TorchBackend
    from megamoe.moe import MoELayer
    from megamoe.presets import MoEConfig

    cfg = MoEConfig(256, 128, 8, 2, scoring="softmax_topk", swiglu_limit=7.0, swiglu_alpha=1.702,
                    swiglu_up_shift=1.0, dynamic_act_scale=dynamic)
    gen = torch.Generator().manual_seed(tokens + 17 * dynamic)
    wts = C.synthetic_weights(cfg, seed=tokens)
    wts.b13 = torch.randn(8, 256, generator=gen) * 2.0
    wts.b2 = torch.randn(8, 256, generator=gen) * 2.0
    wts.router_logit_bias = torch.randn(8, generator=gen) * 0.5
    layer = MoELayer(wts, cfg, backend=emulated)
    assert layer._prepared.b13.shape == (8, 256) and layer._prepared.b2.shape == (8, 256)
    x = (torch.randn(tokens, 256, generator=gen) * 3).to(torch.bfloat16)
    w, ids = layer.route(x)
    ids = ids.clone()
    ids[::3, 1] = -1  # masked slots: skipped, their bias never added
    poison_empty(monkeypatch)
    out = emulated.moe_forward(layer._prepared, cfg, x, ids, w)
    monkeypatch.undo()
    ref = TorchBackend().moe_forward(layer.weights, cfg, x, ids, w)
    assert torch.isfinite(out).all()
    assert cosine(out, ref) > 0.99999, cosine(out, ref)
    # the check can fail: the same layer without either bias, or with SwiGLU, is far off
    for drop in ("b13", "b2"):
        other = TorchBackend().moe_forward(C.MoEWeights(**{**wts.__dict__, drop: None}), cfg, x, ids, w)
        assert cosine(out, other) < 0.999, drop
    swiglu = TorchBackend().moe_forward(wts, cfg.with_(swiglu_alpha=1.0, swiglu_up_shift=0.0), x, ids, w)
    assert cosine(out, swiglu) < 0.999


def test_health_checks_catch_a_swapped_sf_layout_on_this_path():
    """docs/FIELD_BUGS.md row 2 through the sm100 path: with the M/K-swapped swizzle of megamoe.faults, uniform
    scales still pass and random scales fail, so the user's selftest would flag it."""
    from megamoe import health
    from megamoe.backends.cuda_sm100 import CudaSm100Backend
    from megamoe.faults import SwappedScaleLayout

    class Swapped(CudaSm100Backend):
        def swizzle_scales(self, scale, out=None):
            return SwappedScaleLayout.swizzle_scales(self, scale, out)

    be = Swapped(device="cpu", executor="emulate", sm_count=SM_COUNT)
    report = health.run_checks("quick", backend=be, seed=99, only=["gemm_cosine_uniform", "gemm_cosine_random"])
    status = {c["name"]: c["status"] for c in report["checks"]}
    assert status == {"gemm_cosine_uniform": "pass", "gemm_cosine_random": "fail"}, report["checks"]


def test_primitives_fall_back_to_the_reference_off_gpu(emulated):
    gen = torch.Generator().manual_seed(4)
    sizes = [5, 0, 130]
    s = (torch.rand(sum(sizes), 7, generator=gen) * 100).to(torch.float8_e4m3fn)
    buf = emulated.swizzle_scales_grouped(s, sizes)
    assert torch.equal(buf, nvfp4.swizzle_scales_grouped(s, sizes))
    back = emulated.unswizzle_scales_grouped(buf, sizes, 7)
    assert torch.equal(back.view(torch.uint8), s.view(torch.uint8))
    assert emulated.verify_sf_roundtrip(s)["mismatches"] == 0
    x = torch.randn(33, 64, generator=gen)
    q, ref = emulated.quantize(x), nvfp4.quantize(x)
    assert torch.equal(q.data, ref.data) and torch.equal(q.scale.view(torch.uint8), ref.scale.view(torch.uint8))


# --------------------------------------------------------------------------------------------
# the MoE glue around the kernel (docs/FIELD_BUGS.md rows 23, 25, 26, 28)
# --------------------------------------------------------------------------------------------

def test_routing_rows_place_each_pair_and_skip_masked_ids():
    from megamoe.backends.cuda_sm100 import routing_rows

    e = 6
    ids = torch.tensor([[0, 5], [-1, 2], [2, 7], [-1, -1], [5, 0]], dtype=torch.int32)
    rt = routing_rows(ids, e)
    assert rt.counts.tolist() == [2, 0, 2, 0, 0, 2] and rt.counts.dtype == torch.int32
    assert rt.rows == ids.numel()  # compact: T * k rows, no padding
    starts = _compact_offsets(rt.counts.tolist())
    sf_starts = nvfp4.grouped_row_offsets(rt.counts.tolist()).tolist()
    assert rt.row_offsets.tolist() == starts and rt.sf_row_offsets.tolist() == sf_starts[:-1]
    valid = ((ids >= 0) & (ids < e)).reshape(-1)
    assert torch.equal(rt.valid, valid)
    slot_rows = rt.row_of_slot.tolist()
    assert sorted(slot_rows) == list(range(rt.rows))  # a permutation: every row belongs to one slot
    seen = {}
    for slot, (ok, r) in enumerate(zip(valid.tolist(), slot_rows)):
        assert rt.token_of[r] == slot // 2
        if not ok:
            assert r >= starts[-1] and not rt.real[r]  # after every expert's rows, read by no GEMM
            assert rt.sf_row_of_row[r] == rt.sf_rows
            continue
        ex = int(ids.reshape(-1)[slot])
        assert starts[ex] <= r < starts[ex] + rt.counts[ex]
        assert rt.expert_of_row[r] == ex and bool(rt.real[r])
        assert rt.sf_row_of_row[r] == sf_starts[ex] + r - starts[ex]
        seen[r] = slot
    assert len(seen) == int(valid.sum())  # one row per valid slot
    assert int(rt.real.sum()) == len(seen) and rt.real.numel() == rt.rows
    # pairs in token order inside each expert block
    for ex in range(e):
        block = [seen[r] for r in sorted(seen) if rt.expert_of_row[r] == ex]
        assert block == sorted(block)


@pytest.mark.parametrize("t,k,e", [(1, 1, 1), (37, 8, 256), (300, 6, 60), (129, 3, 5)])
def test_routing_rows_bound_holds_even_with_every_token_on_one_expert(t, k, e):
    """docs/FIELD_BUGS.md row 25: the host bound on the scale-factor rows holds for degenerate
    routing (every slot on expert 0, as a graph captured with all-zero ids has), not only for
    real routing; A and D always have exactly T * k rows."""
    from megamoe.backends.cuda_sm100 import routing_rows

    for ids in (torch.zeros(t, k, dtype=torch.int32), torch.full((t, k), e - 1, dtype=torch.int64),
                torch.randint(-1, e, (t, k), generator=torch.Generator().manual_seed(t))):
        rt = routing_rows(ids, e)
        need = int(nvfp4.grouped_row_offsets(rt.counts.tolist())[-1])
        assert need <= rt.sf_rows and rt.rows == t * k
        real_rows = rt.sf_row_of_row[rt.real]
        assert real_rows.numel() == 0 or int(real_rows.max()) < need
        assert real_rows.unique().numel() == real_rows.numel()


def test_routing_rows_offsets_are_64_bit_past_2_31():
    """docs/FIELD_BUGS.md row 23: v3 at T = 37,500 (T*k*H > 2^31): rows times H stays exact."""
    from megamoe.backends.cuda_sm100 import routing_rows

    cfg = PRESETS["v3"]
    t, k, e, h = 37_500, cfg.top_k, cfg.num_experts, cfg.hidden_size
    assert t * k * h > 2**31
    ids = torch.stack([torch.randperm(e, generator=torch.Generator().manual_seed(1))[:k]] * t)
    ids = (ids + torch.arange(t).unsqueeze(1)) % e
    rt = routing_rows(ids, e)
    assert rt.row_of_slot.dtype == torch.int64 and rt.sf_row_of_row.dtype == torch.int64
    last = int(rt.row_of_slot.max())
    assert last * h > 2**31  # the element offsets of the last rows do not fit in int32
    assert int(nvfp4.grouped_row_offsets(rt.counts.tolist())[-1]) <= rt.sf_rows


def test_swizzle_rows_grouped_equals_the_reference_grouped_swizzle():
    """The compact rows' scales land where nvfp4.swizzle_scales_grouped puts per-expert scales
    (docs/SPEC.md §2), masked rows nowhere, every other byte zero, for K/16 not a multiple of 4."""
    from megamoe.backends.cuda_sm100 import routing_rows, swizzle_rows_grouped

    gen = torch.Generator().manual_seed(5)
    for t, k, e, kb in ((1, 6, 256, 16), (33, 3, 5, 29), (200, 2, 3, 7)):
        ids = torch.randint(-1, e, (t, k), generator=gen)
        rt = routing_rows(ids, e)
        scale = torch.randint(1, 255, (rt.rows, kb), generator=gen, dtype=torch.uint8)
        buf = swizzle_rows_grouped(scale.view(torch.float8_e4m3fn), rt).reshape(-1)
        real = int(rt.counts.sum())
        ref = nvfp4.swizzle_scales_grouped(scale[:real].view(torch.float8_e4m3fn), rt.counts.tolist()).reshape(-1)
        assert buf.numel() == math.prod(nvfp4.sf_padded_shape(rt.sf_rows, kb))
        assert torch.equal(buf[: ref.numel()], ref) and int(buf[ref.numel():].count_nonzero()) == 0


def test_plan_offsets_are_exact_past_2_31():
    """docs/FIELD_BUGS.md row 23 in the planner (the same geometry code the device argument builder
    runs): v3 GEMM 1 and GEMM 2 at T = 37,500, byte offsets past 2^31 and 2^32, exact."""
    cfg = PRESETS["v3"]
    e, h, i, k = cfg.num_experts, cfg.hidden_size, cfg.intermediate_size, cfg.top_k
    pairs = 37_500 * k
    counts = [pairs // e + (1 if j < pairs % e else 0) for j in range(e)]
    for parts, n_part, kk in ((2, i, h), (1, h, i)):
        plan = _plan(counts, parts, n_part, kk)
        check_plan_against_spec(plan, counts, [1.0], [1.0] * (e * parts))
        last = plan["groups"][-1]
        rows_before = sum(counts[: e - 1])
        assert last["ptr_d"] == (rows_before * parts * n_part + last["part"] * n_part) * 4
        assert last["ptr_a"] == rows_before * kk // 2
        assert max(g["ptr_d"] for g in plan["groups"]) > 2**32


def test_sf_pointer_offsets_keep_128_byte_alignment():
    """Every group's scale-factor block starts 128-byte aligned from a 128-byte aligned base
    (what the launcher checks of the bases), output and operand offsets 16-byte aligned."""
    for counts, parts, n_part, k in (([5, 0, 130, 1], 2, 464, 1056), ([3, 300], 1, 1040, 480),
                                     ([1] * 60, 2, 208, 416)):
        plan = _plan(counts, parts, n_part, k)
        for g in plan["groups"]:
            assert g["ptr_sfa"] % 128 == 0 and g["ptr_sfb"] % 128 == 0, g
            assert g["ptr_a"] % 16 == 0 and g["ptr_b"] % 16 == 0 and g["ptr_d"] % 16 == 0, g


def test_combine_sums_slots_in_fixed_order_without_atomics():
    """docs/FIELD_BUGS.md row 28: out[t] is the float32 sum over slots j = 0..k-1 in that order,
    bit for bit; masked slots add nothing even when their weight and row hold NaN."""
    from megamoe.backends.cuda_sm100 import combine_slots

    gen = torch.Generator().manual_seed(28)
    t, k, rows, h = 9, 4, 40, 24
    y = torch.randn(rows, h, generator=gen) * torch.exp2(torch.randint(-8, 9, (rows, 1), generator=gen).float())
    y[39] = float("nan")
    row_of = torch.randint(0, 39, (t, k), generator=gen)
    valid = torch.rand(t, k, generator=gen) > 0.25
    row_of[~valid] = 39
    w = torch.rand(t, k, generator=gen)
    w[~valid] = float("nan")
    scale = torch.rand(rows, generator=gen) + 0.5
    for rs in (None, scale):
        out = combine_slots(y, row_of, valid, w, rs)
        want = torch.zeros(t, h)
        for j in range(k):  # the order the docstring promises
            wj = w[:, j] if rs is None else w[:, j] * rs[row_of[:, j]]
            want = want + torch.where(valid[:, j:j + 1], y[row_of[:, j]] * wj[:, None], torch.zeros(()))
        assert torch.isfinite(out).all()
        assert torch.equal(out, want)


def _float_index_add_guard(monkeypatch):
    calls = []
    orig = torch.Tensor.index_add_

    def guarded(self, dim, index, source, *a, **kw):
        calls.append(self.dtype)
        return orig(self, dim, index, source, *a, **kw)

    monkeypatch.setattr(torch.Tensor, "index_add_", guarded)
    return calls


def test_moe_forward_combine_uses_no_float_index_add(emulated, monkeypatch):
    """A float `index_add_` combine is atomic on CUDA (run-to-run different bits once three or more
    experts add into a row). Integer counting may use it (exact in any order), floats not."""
    layer = _layer("tiny", emulated, top_k=4)
    x = torch.randn(33, layer.config.hidden_size, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    w, ids = layer.route(x)
    calls = _float_index_add_guard(monkeypatch)
    emulated.moe_forward(layer._prepared, layer.config, x, ids, w)
    assert not [d for d in calls if d.is_floating_point], calls


def test_moe_forward_with_no_tokens_returns_empty(emulated):
    layer = _layer("tiny", emulated)
    h = layer.config.hidden_size
    x = torch.zeros(0, h, dtype=torch.bfloat16)
    ids = torch.zeros(0, layer.config.top_k, dtype=torch.int32)
    out = emulated.moe_forward(layer._prepared, layer.config, x, ids, torch.zeros(0, layer.config.top_k))
    assert out.shape == (0, h) and out.dtype == torch.float32


@pytest.mark.parametrize("over", [{}, {"hidden_size": 1040, "intermediate_size": 464, "num_experts": 6},
                                  {"dynamic_act_scale": True, "top_k": 3}])
def test_moe_forward_compact_rows_and_padded_scale_factors(emulated, monkeypatch, over):
    """A and D hold exactly the T * k routed rows (no 128-row padding: only real rows are
    gathered, quantized, activated and combined); gu and y are `torch.empty` and, with every
    empty float buffer NaN-poisoned, the output is bit-identical. Every scale byte the GEMM can
    read (whole 128-row x 4-column atoms, K/16 = 65 or 29 not a multiple of 4 here) is defined:
    the buffer equals the reference grouped swizzle (nvfp4.swizzle_scales_grouped) of the real
    rows' scales, zero-extended to the host bound."""
    layer = _layer("tiny", emulated, **over)
    cfg = layer.config
    t = 45
    x = torch.randn(t, cfg.hidden_size, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    w, ids = layer.route(x)
    ids[3, 0] = -1  # one masked slot: sorted after every expert, read by no GEMM
    clean = emulated.moe_forward(layer._prepared, cfg, x, ids, w)
    seen, quantized, swizzled = [], [], []
    be_cls = type(emulated)
    orig_gemm, orig_q, orig_swz = be_cls._grouped_gemm, be_cls.quantize, be_cls._swizzle_rows

    def spy(self, counts, parts, n_part, k, a_data, a_sf, *rest, **kw):
        seen.append((counts.tolist(), k, a_data.clone(), a_sf.clone()))
        return orig_gemm(self, counts, parts, n_part, k, a_data, a_sf, *rest, **kw)

    def spy_q(self, xx, gs=None):
        quantized.append(xx.shape[0])
        return orig_q(self, xx, gs)

    def spy_swz(self, scale, rt):
        out = orig_swz(self, scale, rt)
        swizzled.append((scale.view(torch.uint8).clone(), out.clone()))
        return out

    monkeypatch.setattr(be_cls, "_grouped_gemm", spy)
    monkeypatch.setattr(be_cls, "quantize", spy_q)
    monkeypatch.setattr(be_cls, "_swizzle_rows", spy_swz)
    poison_empty(monkeypatch)
    out = emulated.moe_forward(layer._prepared, cfg, x, ids, w)
    monkeypatch.undo()
    assert torch.equal(out, clean)
    pairs = t * cfg.top_k
    assert quantized == [pairs, pairs]  # GEMM 1 input and SwiGLU output: the routed rows only
    assert len(seen) == 2 and len(swizzled) == 2
    for (counts, k, a_data, a_sf), (linear, buf) in zip(seen, swizzled):
        kb = k // 16
        real = sum(counts)
        assert real == pairs - 1 and a_data.shape == (pairs, k // 2)  # compact A, T * k rows
        assert torch.equal(a_sf, buf)
        ref = nvfp4.swizzle_scales_grouped(linear[:real].view(torch.float8_e4m3fn), counts).reshape(-1)
        bound = math.prod(nvfp4.sf_padded_shape(pairs + 127 * min(cfg.num_experts, pairs), kb))
        assert a_sf.numel() == bound >= ref.numel()
        assert torch.equal(a_sf.reshape(-1)[: ref.numel()], ref) and (a_sf.reshape(-1)[ref.numel():] == 0).all()
        assert not torch.isnan(linear[:real].view(torch.float8_e4m3fn).float()).any()


def test_launch_buffers_cached_per_groups_and_stream(emulated):
    a1, w1 = emulated.launch_buffers(16, 0)
    a2, w2 = emulated.launch_buffers(16, 0)
    assert a1 is a2 and w1 is w2
    assert a1.numel() == _ext_mod().sm100_args_bytes(16)
    assert w1.numel() >= _ext_mod().sm100_workspace_bytes(16, SM_COUNT)
    assert emulated.launch_buffers(8, 0)[0] is not a1 and emulated.launch_buffers(16, 7)[0] is not a1
    for g in range(1, 3 * emulated.MAX_LAUNCH_BUFFERS):
        emulated.launch_buffers(g, 1)
    assert len(emulated._buffers) == emulated.MAX_LAUNCH_BUFFERS


def _raw_launch_kwargs(counts, parts, n_part, k, **over):
    ext = _ext_mod()
    a_data, a_sf, b_data, b_sf, out = _launch_operands(counts, parts, n_part, k)
    groups = len(counts) * parts
    args = _aligned_zeros(ext.sm100_args_bytes(groups))
    ws = _aligned_zeros(ext.sm100_workspace_bytes(groups, SM_COUNT) + 256)
    keep = [a_data, a_sf, b_data, b_sf, out, args, ws, torch.tensor(counts, dtype=torch.int32), torch.ones(1),
            torch.ones(groups)]
    kw = dict(num_experts=len(counts), parts=parts, n_part=n_part, k=k, a_scale_count=1, a=a_data.data_ptr(),
              a_sf=a_sf.data_ptr(), b=b_data.data_ptr(), b_sf=b_sf.data_ptr(), d=out.data_ptr(),
              token_counts=keep[7].data_ptr(), a_global_scale=keep[8].data_ptr(), b_global_scale=keep[9].data_ptr(),
              args=args.data_ptr(), args_bytes=args.numel(), workspace=ws.data_ptr(),
              workspace_bytes=ext.sm100_workspace_bytes(groups, SM_COUNT), host_token_counts=counts,
              sm_count=SM_COUNT, stream=0)
    kw.update(over)
    return kw, keep


@pytest.mark.parametrize("case,match", [("a_sf", "a_sf .* 128-byte aligned"), ("b_sf", "b_sf .* 128-byte aligned"),
                                        ("workspace", "workspace .* 64-byte aligned"),
                                        ("workspace_bytes", "workspace has"),
                                        ("negative_count", "negative token count")])
def test_launch_checks_alignment_and_workspace_before_any_cuda_call(case, match):
    """Scale-factor bases 128-byte aligned (TMA), tensor-map workspace 64, workspace size: all checked
    on the host before the argument builder is launched (here without a GPU the first CUDA call
    would fail with 'cudaGetDevice': these errors come first)."""
    kw, keep = _raw_launch_kwargs([3, 5], 2, 128, 256)
    if case in ("a_sf", "b_sf"):
        kw[case] += 16  # 16-byte aligned, not 128
    elif case == "workspace":
        kw[case] += 32
    elif case == "workspace_bytes":
        kw[case] -= 1
    else:
        kw["host_token_counts"] = [3, -5]
    with pytest.raises(ValueError, match=match):
        _ext_mod().sm100_moe_gemm(**kw)


def test_launch_with_no_tiles_returns_without_touching_anything():
    """Host problem shapes with no tile (every expert empty): CUTLASS would get a 0-block grid.
    The launcher returns before any CUDA call (none is possible here) and writes nothing."""
    if torch.cuda.is_available():
        pytest.skip("a GPU is present: this test is about the host-side path")
    kw, keep = _raw_launch_kwargs([0, 0, 0], 2, 128, 256)
    keep[5].fill_(0xA5)
    _ext_mod().sm100_moe_gemm(**kw)  # no error: nothing to do
    assert (keep[5] == 0xA5).all()  # args untouched
    kw2, _ = _raw_launch_kwargs([0, 1, 0], 2, 128, 256)
    with pytest.raises(RuntimeError, match="cudaGetDevice"):  # one tile: it goes on to the device
        _ext_mod().sm100_moe_gemm(**kw2)


@pytest.mark.parametrize("counts", [[5, 0, 130], [(j * 7) % 5 for j in range(600)]])
def test_host_args_bytes_match_the_plan(counts):
    """The host image of the args buffer (what tests/sm100_gpu compares the device's buffer with,
    byte for byte) holds the plan's shapes, pointers, alphas, strides and layouts; 600 experts
    cross the device builder's 256-expert scan chunks."""
    import struct

    ext = _ext_mod()
    parts, n_part, k = 2, 464, 1056
    groups = len(counts) * parts
    a_gs, b_gs = [2.0], [0.5 * (j + 1) for j in range(groups)]
    bases = [1 << 40, (1 << 40) + (1 << 30), 1 << 41, (1 << 41) + (1 << 30), 1 << 42]
    args_base = 1 << 43
    buf = ext.sm100_host_args_bytes(counts, parts, n_part, k, a_gs, b_gs, bases, args_base, 0xA5)
    plan = ext.sm100_plan_moe_gemm(counts, parts, n_part, k, a_gs, b_gs, SM_COUNT)
    lay = plan["args_layout"]
    assert len(buf) == lay["total_bytes"] == ext.sm100_args_bytes(groups)
    for g, grp in enumerate(plan["groups"]):
        def u64(section):
            return struct.unpack_from("<Q", buf, lay[section] + 8 * g)[0]
        assert struct.unpack_from("<3i", buf, lay["problem_shapes"] + 12 * g) == grp["problem_shape"]
        assert u64("ptr_a") == bases[0] + grp["ptr_a"] and u64("ptr_sfa") == bases[1] + grp["ptr_sfa"]
        assert u64("ptr_b") == bases[2] + grp["ptr_b"] and u64("ptr_sfb") == bases[3] + grp["ptr_sfb"]
        assert u64("ptr_d") == bases[4] + grp["ptr_d"]
        assert struct.unpack_from("<f", buf, lay["alpha"] + 4 * g)[0] == grp["alpha"]
        assert u64("ptr_alpha") == args_base + lay["alpha"] + 4 * g
    assert buf[lay["problem_shapes"] + 12 * groups] == 0xA5  # gaps keep the fill byte


# --------------------------------------------------------------------------------------------
# small-M configuration: chosen on the host from T * k
# --------------------------------------------------------------------------------------------

def _wide_cta_bound(pairs, e, parts, n_part):
    return (min(e, pairs) + pairs // 128) * parts * -(-n_part // 128)


@pytest.mark.parametrize("pairs,e,parts,n_part,sm", [
    (6, 256, 2, 256, 148),      # V4-Flash TP=8 GEMM 1 at T = 1: 24 wide CTAs at most -> narrow
    (6, 256, 1, 4096, 148),     # its GEMM 2: 192 wide CTAs -> wide
    (48, 256, 2, 256, 148),     # T = 8: 192 -> wide
    (36, 256, 2, 256, 148),     # T = 6: 144 -> narrow
    (37, 256, 2, 256, 148),     # 148 -> wide (not below the SM count)
    (384, 256, 2, 256, 148),    # T = 64
    (8, 256, 2, 2048, 148), (1, 1, 1, 64, 148), (5000, 8, 2, 128, 148), (1, 4, 2, 128, 1)])
def test_select_tile_n_narrow_only_when_the_wide_grid_cannot_fill_the_gpu(pairs, e, parts, n_part, sm):
    got = _ext_mod().sm100_select_tile_n(pairs, e, parts, n_part, sm)
    want = 64 if _wide_cta_bound(pairs, e, parts, n_part) < sm else 128
    assert got == want


def test_select_tile_n_bound_holds_for_any_routing():
    """The bound used is an upper bound of the wide grid's CTAs for every routing of T * k pairs
    (so 'narrow' is only chosen when the wide grid really leaves SMs idle)."""
    gen = torch.Generator().manual_seed(2)
    for t, k, e, n_part in ((1, 6, 256, 256), (3, 8, 16, 512), (40, 2, 4, 128), (300, 1, 2, 64)):
        pairs = t * k
        for ids in (torch.zeros(t, k, dtype=torch.long), torch.randint(0, e, (t, k), generator=gen),
                    torch.arange(t * k).reshape(t, k) % e):
            counts = torch.bincount(ids.reshape(-1), minlength=e)
            ctas = int(((counts + 127) // 128).sum()) * 2 * -(-n_part // 128)
            assert ctas <= _wide_cta_bound(pairs, e, 2, n_part)


def test_backend_picks_the_tile_per_launch_and_plans_with_it(emulated, monkeypatch):
    """V4-Flash TP = 8 (I = 256 per rank, E = 256, k = 6): T = 1 runs GEMM 1 on the narrow tile,
    T = 64 on the wide one; the plan and the launch get the tile chosen; a fixed tile_n wins."""
    from megamoe.backends.cuda_sm100 import CudaSm100Backend

    ext = _ext_mod()
    seen = []
    orig = ext.sm100_plan_moe_gemm

    class Spy:
        def __getattr__(self, name):
            return getattr(ext, name)

        def sm100_plan_moe_gemm(self, counts, parts, n_part, k, a_gs, b_gs, sm_count, tile_n=128):
            seen.append((parts, n_part, tile_n))
            return orig(counts, parts, n_part, k, a_gs, b_gs, sm_count, tile_n=tile_n)

    layer = _layer("tiny", emulated, hidden_size=64, intermediate_size=256, num_experts=256, top_k=6)
    monkeypatch.setattr(emulated, "_ext", Spy())
    for t, want in ((1, 64), (64, 128)):
        seen.clear()
        x = torch.randn(t, 64, generator=torch.Generator().manual_seed(t)).to(torch.bfloat16)
        w, ids = layer.route(x)
        emulated.moe_forward(layer._prepared, layer.config, x, ids, w)
        assert seen[0] == (2, 256, want) and emulated.tile_n_for(t * 6, 256, 2, 256) == want
    fixed = CudaSm100Backend(device="cpu", executor="emulate", sm_count=SM_COUNT, tile_n=128)
    assert fixed.tile_n_for(1, 256, 2, 256) == 128
    with pytest.raises(ValueError, match="tile_n"):
        CudaSm100Backend(device="cpu", executor="emulate", tile_n=96)


def test_moe_forward_equal_on_both_tiles(emulated):
    """The configuration changes only the CTA tiling: the emulated result is the same bits."""
    from megamoe.backends.cuda_sm100 import CudaSm100Backend

    layer = _layer("tiny", emulated)
    x = torch.randn(5, layer.config.hidden_size, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    w, ids = layer.route(x)
    outs = []
    for tile_n in (64, 128):
        be = CudaSm100Backend(device="cpu", executor="emulate", sm_count=SM_COUNT, tile_n=tile_n)
        outs.append(be.moe_forward(be.prepare_weights(layer.weights), layer.config, x, ids, w))
        assert be.last_tile_n == tile_n
    assert torch.equal(outs[0], outs[1])


# --------------------------------------------------------------------------------------------
# device guard, graph-capturable gemm(), driver check
# --------------------------------------------------------------------------------------------

def test_every_device_kernel_runs_under_the_device_guard(emulated, monkeypatch):
    """Quantize, swizzle and the GEMM launch run inside the backend's device guard (on a GPU:
    torch.cuda.device(backend.device)), for moe_forward, gemm and prepare_weights."""
    be_cls = type(emulated)
    depth = [0]
    calls = []

    class Guard:
        def __enter__(self):
            depth[0] += 1

        def __exit__(self, *exc):
            depth[0] -= 1

    def watch(name):
        orig = getattr(be_cls, name)

        def wrapped(self, *a, **kw):
            calls.append((name, depth[0]))
            return orig(self, *a, **kw)
        monkeypatch.setattr(be_cls, name, wrapped)

    monkeypatch.setattr(be_cls, "_device_guard", lambda self: Guard())
    for name in ("quantize", "swizzle_scales", "_swizzle_rows", "_grouped_gemm"):
        watch(name)
    layer = _layer("tiny", emulated)
    x = torch.randn(3, layer.config.hidden_size, generator=torch.Generator().manual_seed(6)).to(torch.bfloat16)
    w, ids = layer.route(x)
    emulated.moe_forward(emulated.prepare_weights(layer.weights), layer.config, x, ids, w)
    gen = torch.Generator().manual_seed(7)
    emulated.gemm(random_nvfp4(3, 64, gen, 1.0), random_nvfp4(8, 64, gen, 1.0))
    names = {n for n, _ in calls}
    assert {"quantize", "swizzle_scales", "_swizzle_rows", "_grouped_gemm"} <= names
    assert all(d >= 1 for _, d in calls), [c for c in calls if c[1] < 1]


def test_gemm_keeps_the_count_on_the_device(emulated, monkeypatch):
    """gemm() gives the launcher an int32 device tensor (filled on the device, no host copy),
    so it can be graph-captured and reuses the launcher's initialized Gemm."""
    be_cls = type(emulated)
    seen = []
    orig = be_cls._grouped_gemm

    def spy(self, counts, *a, **kw):
        seen.append(counts)
        return orig(self, counts, *a, **kw)

    monkeypatch.setattr(be_cls, "_grouped_gemm", spy)
    gen = torch.Generator().manual_seed(8)
    emulated.gemm(random_nvfp4(5, 64, gen, 1.0), random_nvfp4(8, 64, gen, 1.0))
    assert len(seen) == 1 and torch.is_tensor(seen[0])
    assert seen[0].dtype == torch.int32 and seen[0].device == emulated.device and seen[0].tolist() == [5]


@pytest.mark.parametrize("runtime,driver,ok,needs", [
    (12080, 12080, True, None), (12080, 12090, True, None), (12080, 13000, True, None),
    (12080, 12060, False, "12.8 (R570"), (12090, 12080, True, None),
    (13000, 12080, False, "13.0 (R580"), (13000, 13000, True, None), (13000, 0, False, "no NVIDIA driver"),
    (12080, 0, False, "no NVIDIA driver")])
def test_driver_problem_names_what_is_needed(runtime, driver, ok, needs):
    from megamoe.backends.cuda_sm100 import driver_problem

    why = driver_problem(runtime, driver)
    assert (why == "") == ok
    if not ok:
        assert needs in why and "upgrade the driver" in why
    if runtime >= 13000 and not ok:
        assert "CUDA 12.8" in why  # the way out other than a driver upgrade


def test_cuda_versions_are_reported():
    v = _ext_mod().sm100_cuda_versions()
    assert v["runtime"] >= 12080 and v["runtime"] % 10 == 0
    assert v["driver"] >= 0


# --------------------------------------------------------------------------------------------
# `megamoe selftest --backend cuda-sm100`: what it ran, a time per shape (emulated here)
# --------------------------------------------------------------------------------------------

TINY_SHAPES = [("tiny E=16", "tiny", dict(num_experts=16, top_k=2), (1, 5))]


def test_selftest_shapes_say_what_ran_with_a_time_per_shape(emulated, monkeypatch):
    from megamoe import cli
    from megamoe.backends import cuda_sm100

    monkeypatch.setattr(cuda_sm100, "SELFTEST_SHAPES_QUICK", TINY_SHAPES)
    lines = []
    rows = cli._selftest_shapes(emulated, "quick", lines.append)
    assert [r["t"] for r in rows] == [1, 5] and all(r["status"] == "pass" for r in rows), rows
    assert all(r["cosine"] >= 0.9999 and r["repeat_bits_equal"] and r["us"] > 0 for r in rows)
    assert len(lines) == 3 and "2 runs" in lines[0]
    for line, t in zip(lines[1:], (1, 5)):
        assert line.strip().startswith("PASS") and f"T={t} " in line and "us/forward" in line
        assert "tile N 64/" in line or "tile N 128/" in line
    header = cli._selftest_header(emulated)
    assert "backend cuda-sm100 on cpu" in header and "KernelPtrArrayTmaWarpSpecialized1SmNvf4Sm100" in header
    assert "tile 128x(128/64)x256" in header and "CUDA runtime" in header and "executor emulate" in header


def test_selftest_shapes_fail_on_wrong_or_unstable_results(emulated, monkeypatch):
    """A backend whose output is off (noise) or changes between runs fails its shape rows."""
    from megamoe.backends import cuda_sm100

    orig = type(emulated).moe_forward
    gen = torch.Generator().manual_seed(0)

    def noisy(self, *a, **kw):
        out = orig(self, *a, **kw)
        return out + 0.1 * out.abs().max() * torch.randn(out.shape, generator=gen)

    monkeypatch.setattr(type(emulated), "moe_forward", noisy)
    rows = cuda_sm100.run_shapes(emulated, TINY_SHAPES, reps=2)
    assert all(r["status"] == "fail" and not r["repeat_bits_equal"] for r in rows)
    assert "FAIL" in cuda_sm100.format_shape_row(rows[0]) and "DIFFERENT BITS" in cuda_sm100.format_shape_row(rows[0])

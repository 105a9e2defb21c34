"""The cuda-sm90 dispatch plan (megamoe._C.sm90_plan, cpp/sm90/plan.cpp): host only, no GPU.

Boundaries of the one decision that picks kernel, token tile, tokens per pass and the fusions,
and the backend asking it instead of deciding itself."""
import pytest

from megamoe import _ext

pytestmark = pytest.mark.skipif(not _ext.has_part("sm90"),
                                reason=f"megamoe._C built without sm90 kernels (parts: {_ext.built_parts()})")

V4_FLASH = dict(k_gemm1=4096, k_gemm2=2048, num_experts=256)


def plan(tpe, w4a16=True, gather_input=True, **kw):
    args = {**V4_FLASH, **kw}
    return _ext.ext.sm90_plan(tokens_per_expert=tpe, w4a16=w4a16, gather_input=gather_input, **args)


def kind(name):
    return _ext.ext.Sm90GemmKernel.__members__[name]


def test_kernel_enum_is_exported_once_with_its_members():
    assert list(_ext.ext.Sm90GemmKernel.__members__) == ["auto", "stream", "wgmma32", "wgmma64", "wgmma128"]
    assert list(_ext.ext.Sm90Epilogue.__members__) == ["store", "silu_mul"]


@pytest.mark.parametrize("tpe", [0, 1, 2, 3, 4])
def test_decode_streams_one_tile_fused(tpe):
    p = plan(tpe)
    assert (p.kernel, p.token_tile, p.tokens_per_pass, p.gather_x, p.h_operand) == (kind("stream"), 8, 8, True, True), \
        (tpe, p)


def test_switch_to_wgmma_and_its_tiles():
    # 4 expected tokens per expert is the last streaming point (one token tile per pass, no multi-tile pocket)
    assert plan(4).kernel == kind("stream") and plan(4).tokens_per_pass == 8
    assert (plan(5).kernel, plan(5).token_tile) == (kind("wgmma32"), 32)
    assert (plan(28).kernel, plan(28).token_tile) == (kind("wgmma32"), 32)
    assert (plan(29).kernel, plan(29).token_tile) == (kind("wgmma64"), 64)
    assert (plan(32).kernel, plan(32).token_tile) == (kind("wgmma64"), 64)
    assert (plan(63).kernel, plan(63).token_tile) == (kind("wgmma64"), 64)
    assert (plan(64).kernel, plan(64).token_tile) == (kind("wgmma128"), 128)
    # tile 32 steps K by 256, tile 64 by 128: a K that is a multiple of 128 only runs tile 64 in tile 32's
    # range, one that is a multiple of 64 only runs tile 128 in both ranges
    assert (plan(7, k_gemm2=2176).kernel, plan(24, k_gemm1=1152).token_tile) == (kind("wgmma64"), 64)
    assert plan(9, k_gemm2=2176, kernel=kind("wgmma32")).kernel == kind("wgmma64")
    assert (plan(7, k_gemm2=2112).kernel, plan(30, k_gemm1=1088).token_tile) == (kind("wgmma128"), 128)
    assert plan(9, k_gemm2=2112, kernel=kind("wgmma32")).kernel == kind("wgmma128")
    assert plan(9, k_gemm1=1088, kernel=kind("wgmma64")).kernel == kind("wgmma128")
    assert (plan(65).kernel, plan(65).token_tile) == (kind("wgmma128"), 128)
    assert plan(100000).kernel == kind("wgmma128")
    for tpe in (7, 24, 25, 28, 29, 32, 33, 63, 64, 65, 5000):
        p = plan(tpe)
        # W4A16: tile 32 gathers the rows of x staged once ([T, H]) through row_token; tiles 64 and 128 read x
        # staged per slot (contiguous rows: TMA boxes)
        assert p.gather_x == (p.kernel == kind("wgmma32")) and p.h_operand and p.tokens_per_pass == p.token_tile, p
        # the wgmma kernels read lane-order activations, the streaming kernels operand order
        assert p.lane_order and plan(tpe, w4a16=False).lane_order, p
        assert not plan(tpe, w4a16=False).h_operand and not plan(tpe, w4a16=False).gather_x
    assert not any(plan(tpe).lane_order for tpe in range(5))
    assert not plan(100, k_gemm1=1040).lane_order


@pytest.mark.parametrize("k_gemm1,k_gemm2", [(1040, 464), (4096, 464), (1040, 2048)])
def test_k_not_multiple_of_64_streams_with_more_tiles_per_pass(k_gemm1, k_gemm2):
    for tpe, tpp in ((1, 8), (6, 8), (8, 8), (9, 32), (21, 32), (22, 64), (5000, 64)):
        p = plan(tpe, k_gemm1=k_gemm1, k_gemm2=k_gemm2)
        assert (p.kernel, p.tokens_per_pass, p.gather_x) == (kind("stream"), tpp, True), (tpe, p)
    # an explicit wgmma request cannot run such a K either
    assert plan(100, k_gemm1=k_gemm1, k_gemm2=k_gemm2, kernel=kind("wgmma128")).kernel == kind("stream")


def test_more_than_1024_experts_streams():
    assert plan(100, num_experts=1025).kernel == kind("stream")
    assert plan(100, num_experts=1024).kernel == kind("wgmma128")


def test_fusion_only_for_w4a16():
    assert not plan(3, w4a16=False).gather_x and not plan(3, w4a16=False).h_operand
    assert not plan(3, gather_input=False).gather_x and plan(3, gather_input=False).h_operand
    assert plan(3, kernel=kind("stream"), tokens_per_pass=32).gather_x


@pytest.mark.parametrize("tpe", [1, 4, 5, 40, 100, 5000])
def test_w4a4_quantizes_h_in_gemm1_only_with_a_static_scale(tpe):
    """W4A4: gemm1 writes h as the gemm2 operand (its NVFP4 decode) when h takes a static scale; the per-row dynamic
    scale needs the whole row of h first, so h goes through the quantize kernel. x is never gathered by W4A4."""
    static, dynamic = plan(tpe, w4a16=False, h_static_scale=True), plan(tpe, w4a16=False)
    assert static.h_operand and not dynamic.h_operand, (static, dynamic)
    assert not static.gather_x and (static.kernel, static.token_tile) == (dynamic.kernel, dynamic.token_tile)
    assert plan(tpe, h_static_scale=True).h_operand and plan(tpe).h_operand  # W4A16 fuses either way


def test_explicit_choices_are_kept():
    p = plan(1, kernel=kind("wgmma128"))
    assert (p.kernel, p.token_tile) == (kind("wgmma128"), 128)
    p = plan(500, kernel=kind("stream"))
    assert (p.kernel, p.tokens_per_pass) == (kind("stream"), 64)
    assert plan(3, kernel=kind("stream"), tokens_per_pass=16).tokens_per_pass == 16
    assert "kernel=stream" in repr(plan(1))


@pytest.mark.parametrize("bad", [dict(tokens_per_pass=12), dict(tokens_per_pass=-8)])
def test_bad_tokens_per_pass_names_the_value(bad):
    with pytest.raises(ValueError, match=str(bad["tokens_per_pass"])):
        plan(3, **bad)


def test_bad_problem_names_the_values():
    with pytest.raises(ValueError, match="-1"):
        plan(-1)
    with pytest.raises(ValueError, match="0"):
        plan(1, num_experts=0)


def test_grouped_gemm_takes_keywords_only():
    with pytest.raises(TypeError):
        _ext.ext.sm90_grouped_gemm(None, None, None)


def test_backend_asks_the_plan(monkeypatch):
    torch = pytest.importorskip("torch")
    from megamoe.backends import cuda_sm90

    be = cuda_sm90.CudaSm90Backend.__new__(cuda_sm90.CudaSm90Backend)
    be._device = torch.device("cuda", 0)
    be.kernel, be.tokens_per_pass, be._plans = "auto", 0, {}
    seen = []
    real = _ext.ext.sm90_plan

    def spy(**kw):
        seen.append(kw)
        return real(**kw)

    monkeypatch.setattr(_ext.ext, "sm90_plan", spy)
    p = be.plan(12, 4096, 2048, 256, True, True)
    assert p.kernel == kind("wgmma32") and len(seen) == 1
    assert be.plan(12, 4096, 2048, 256, True, True) is p and len(seen) == 1  # cached
    be.kernel = "stream"
    assert be.plan(12, 4096, 2048, 256, True, True).kernel == kind("stream") and len(seen) == 2
    with pytest.raises(ValueError, match="wgmma256"):
        be.kernel = "wgmma256"
        be.plan(12, 4096, 2048, 256, True, True)


def test_one_token_skips_the_align_kernel_only_where_its_kernels_run():
    """One token runs without the align kernel (the GEMMs read topk_ids themselves, gemm1 writes entry_row) exactly
    when its kernels take the slots: the one-tile streaming kernel with H and I multiples of 64, or wgmma tile 32 (its
    tile-8 and tile-32 kPdl instances), W4A16 with bf16 x (plan.gather_x) or W4A4 with a static scale for h
    (plan.h_operand: gemm1 quantizes h). The backend reads the plan's answer."""
    from megamoe.backends import cuda_sm90

    def skip(tokens=1, **kw):
        p = plan(1, tokens=tokens, **kw)
        assert cuda_sm90.CudaSm90Backend._without_align(p) == p.without_align
        return p.without_align

    assert skip() and skip(k_gemm1=64, k_gemm2=64)
    assert not skip(tokens=2)  # two tokens share an expert's weights: grouped rows
    assert not skip(tokens=0)  # not a forward
    assert not skip(k_gemm1=4128)  # H % 64 != 0
    assert not skip(k_gemm2=2080)  # I % 64 != 0
    assert not skip(gather_input=False)  # fp16 / fp32 x: staged per grouped row
    assert skip(kernel=kind("wgmma32")) and skip(batch_invariant=True)  # (the invariant plan runs tile 32 here)
    assert skip(kernel=kind("wgmma32"), w4a16=False, h_static_scale=True)
    assert not skip(kernel=kind("wgmma32"), w4a16=False)  # a dynamic scale for h
    assert not skip(kernel=kind("wgmma32"), gather_input=False)  # fp16 / fp32 x
    assert not skip(kernel=kind("wgmma64")) and not skip(kernel=kind("wgmma128"))
    assert not skip(batch_invariant=True, k_gemm1=4224)  # K a multiple of 128 only: tile 64
    assert not skip(tokens=2, batch_invariant=True)
    assert not skip(tokens_per_pass=16)
    for gather_input in (True, False):  # x of any dtype: quantized into the slots' rows first
        assert skip(w4a16=False, gather_input=gather_input, h_static_scale=True)
    assert not skip(w4a16=False)  # a dynamic scale for h: the quantizer of h reads grouped rows
    assert not skip(tokens=2, w4a16=False, h_static_scale=True)
    assert not skip(w4a16=False, h_static_scale=True, k_gemm1=4128)


def test_token_order_from_the_threshold_where_a_tokens_slots_stage_alike():
    """The per-slot gemm1 input goes in token order from sm90_token_order_from tokens: W4A16 always, W4A4 only where
    a token's slots quantize alike; the threshold is the C++ constant unless the caller moves it."""
    t = _ext.ext.sm90_token_order_from
    assert t == 1024
    for tpe in (1, 40, 5000):  # any kernel
        assert plan(tpe, tokens=t).token_order and not plan(tpe, tokens=t - 1).token_order
        assert plan(tpe, tokens=t, w4a16=False).token_order  # slots_quantize_alike defaults to True
        assert not plan(tpe, tokens=t, w4a16=False, slots_quantize_alike=False).token_order
        assert plan(tpe, tokens=t, slots_quantize_alike=False).token_order  # W4A16: bf16 x is the same in every slot
    assert not plan(40, tokens=0, token_order_from=1).token_order
    assert plan(40, tokens=7, token_order_from=7).token_order and not plan(40, tokens=6, token_order_from=7).token_order
    with pytest.raises(ValueError, match="token_order_from"):
        plan(40, tokens=7, token_order_from=0)
    with pytest.raises(ValueError, match="-3"):
        plan(40, tokens=-3)


def test_stage_k_and_copied_rows():
    """The wgmma kernels' K per stage: tile 32 256; tile 64 256 where K % 256 == 0 and the rows come by TMA, else
    128; tile 128 128 likewise, else 64. gemm1 copies its rows with cp.async where it gathers x (gather_x: tile 32,
    W4A16, bf16 x); gemm2 always reads staged rows by TMA. Streaming: no stages."""
    p = plan(12)  # tile 32, gathered
    assert (p.kernel, p.copied_rows_gemm1, p.stage_k_gemm1, p.stage_k_gemm2) == (kind("wgmma32"), True, 256, 256), p
    p = plan(12, gather_input=False)
    assert (p.copied_rows_gemm1, p.stage_k_gemm1, p.stage_k_gemm2) == (False, 256, 256), p
    p = plan(40)  # tile 64, x staged per slot: TMA
    assert (p.kernel, p.copied_rows_gemm1, p.stage_k_gemm1, p.stage_k_gemm2) == (kind("wgmma64"), False, 256, 256), p
    p = plan(40, k_gemm2=2176)  # I % 256 != 0
    assert (p.stage_k_gemm1, p.stage_k_gemm2) == (256, 128), p
    p = plan(100)
    assert (p.kernel, p.stage_k_gemm1, p.stage_k_gemm2) == (kind("wgmma128"), 128, 128), p
    p = plan(100, k_gemm1=1088)  # H % 128 != 0
    assert (p.stage_k_gemm1, p.stage_k_gemm2) == (64, 128), p
    p = plan(12, kernel=kind("wgmma128"))  # tile 128 never gathers x: staged rows by TMA
    assert (p.copied_rows_gemm1, p.stage_k_gemm1, p.stage_k_gemm2) == (False, 128, 128), p
    p = plan(2)
    assert (p.kernel, p.stage_k_gemm1, p.stage_k_gemm2, p.copied_rows_gemm1) == (kind("stream"), 0, 0, False), p
    assert "stage_k_gemm1=0" in repr(p) and "without_align=False" in repr(p)


def test_quantize_rows_passes_quantize_nvfp4_its_own_keywords(monkeypatch):
    """cuda_common.quantize_rows (the backend's keyword call of megamoe._C.quantize_nvfp4): every keyword it passes,
    the options included, is a parameter of the binding, and every required parameter is passed."""
    import re

    from megamoe.backends import cuda_common

    first = _ext.ext.quantize_nvfp4.__doc__.split("\n")[0]
    inner = re.match(r"quantize_nvfp4\((.*)\) -> None$", first).group(1)
    params = {part.split(":")[0]: " = " in part for part in inner.split(", ")}  # name -> has a default
    assert {"src", "global_scale", "gs_mode", "stream", "dequant_lane_order", "row_experts"} <= set(params), first
    seen = {}
    monkeypatch.setattr(_ext.ext, "quantize_nvfp4", lambda **kw: seen.update(kw))
    cuda_common.quantize_rows("x", global_scale=None, gs_mode=cuda_common.GS_PER_EXPERT, stream=0,
                              dequant_lane_order=True, scatter_rows=None, scatter_k=0, row_experts=None)
    assert set(seen) <= set(params), set(seen) - set(params)
    assert {p for p, has_default in params.items() if not has_default} <= set(seen)


FAMILY = {"stream": "stream", "wgmma32": "wgmma", "wgmma64": "wgmma", "wgmma128": "wgmma"}


def family(p):
    return FAMILY[str(p.kernel).split(".")[-1]]


@pytest.mark.parametrize("w4a16", [True, False])
@pytest.mark.parametrize("k_gemm1,k_gemm2,num_experts", [
    (4096, 2048, 256),   # V4-Flash: every tile
    (7168, 2048, 256),   # V3
    (4096, 256, 256),    # V4-Flash at TP = 8
    (1152, 2176, 64),    # K multiples of 128 only: tiles 64 and 128
    (4032, 2112, 64),    # K multiples of 64 only: tile 128
    (4128, 2048, 64),    # H % 64 != 0: streaming only
    (4096, 2048, 2048),  # E > 1024: streaming only
])
def test_batch_invariant_plan_runs_one_kernel_family_at_every_token_count(w4a16, k_gemm1, k_gemm2, num_experts):
    """The streaming kernel splits K four ways between warps and adds the partial sums; the wgmma kernels sum K in one
    sequence of k16 steps, the same for every tile and width (on an H100 the wgmma tiles give the same bits for the
    same row at every batch composition, the streaming kernel other bits for W4A16: tests/gpu/
    test_gpu_batch_invariance.py). So a batch-invariant plan never picks streaming for some token counts and wgmma
    for others, decode and the one-token path included; the measured choice (batch_invariant=False) does."""
    shape = dict(k_gemm1=k_gemm1, k_gemm2=k_gemm2, num_experts=num_experts, w4a16=w4a16, h_static_scale=not w4a16)
    counts = [0, 1, 2, 4, 5, 24, 25, 28, 29, 63, 64, 65, 1024, 100000]
    fams = {family(plan(tpe, tokens=max(1, tpe * num_experts // 8), batch_invariant=True, **shape)) for tpe in counts}
    assert len(fams) == 1, (shape, fams)
    wgmma_ok = k_gemm1 % 64 == 0 and k_gemm2 % 64 == 0 and num_experts <= 1024
    assert fams == {"wgmma" if wgmma_ok else "stream"}
    one = plan(0, tokens=1, batch_invariant=True, **shape)
    # one token skips the align kernel on the invariant plan's own kernels: wgmma tile 32 (both K multiples of 256),
    # or the streaming kernel where the wgmma kernels cannot run (K % 64 == 0 there)
    tile32 = wgmma_ok and k_gemm1 % 256 == 0 and k_gemm2 % 256 == 0
    streams_one_tile = not wgmma_ok and k_gemm1 % 64 == 0 and k_gemm2 % 64 == 0
    assert one.without_align == (tile32 or streams_one_tile), (shape, one)
    for tpe in counts:  # above the decode range the invariant plan is the measured one, field by field
        fast = plan(tpe, tokens=500, **shape)
        inv = plan(tpe, tokens=500, batch_invariant=True, **shape)
        if fast.kernel != kind("stream") or not wgmma_ok:
            assert repr(inv) == repr(fast), (tpe, inv, fast)
    if wgmma_ok:  # the measured choice does mix them: decode streams
        assert family(plan(1, tokens=1, **shape)) == "stream" and family(plan(100, tokens=5000, **shape)) == "wgmma"


def test_batch_invariant_plan_keeps_an_explicit_kernel():
    assert plan(1, kernel=kind("stream"), batch_invariant=True).kernel == kind("stream")
    assert plan(100, kernel=kind("wgmma32"), batch_invariant=True).kernel == kind("wgmma32")


def test_backend_passes_the_layers_mode_to_the_plan(monkeypatch):
    torch = pytest.importorskip("torch")
    from megamoe.backends import cuda_sm90

    be = cuda_sm90.CudaSm90Backend.__new__(cuda_sm90.CudaSm90Backend)
    be._device = torch.device("cuda", 0)
    be.kernel, be.tokens_per_pass, be._plans = "auto", 0, {}
    assert be.plan(1, 4096, 2048, 256, True, True, tokens=1).kernel == kind("wgmma32")  # default: invariant
    assert be.plan(1, 4096, 2048, 256, True, True, tokens=1, batch_invariant=False).kernel == kind("stream")
    assert be.plan(1, 4096, 2048, 256, True, True, tokens=1).kernel == kind("wgmma32")  # cached apart

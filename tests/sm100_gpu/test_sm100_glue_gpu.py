"""The cuda-sm100 backend's Python and device glue on any CUDA GPU (a Hopper included).

Everything a B200 runs except the CUTLASS kernel and its argument builder (sm_100a code)
runs here on a real GPU: routing, the gather, the shared quantize kernel, the grouped
scale-factor swizzle into 128-row expert blocks, SwiGLU, the combine, the device guard,
the launch buffers and every host-side check of ``launch_grouped_gemm``. The one call that
needs a Blackwell GPU, ``_C.sm100_moe_gemm``, is replaced by a stand-in that checks what it
is given (pointers, stream, current device, buffer sizes against the plan) and computes on
the GPU what the kernel computes, with :func:`emulate_grouped_gemm` driven by the planner's
offsets. What this does not prove: that the CUTLASS kernel computes what the emulator does
(tests/sm100_gpu/test_sm100_gpu.py, on a B200).

Skipped without a CUDA GPU or without the sm100 part in megamoe._C. Run:
``pytest tests/sm100_gpu/test_sm100_glue_gpu.py -q``.
"""
from __future__ import annotations

import pytest
import torch

from _helpers import cosine, poison_empty, random_nvfp4
from megamoe import _ext, nvfp4

pytestmark = pytest.mark.gpu


def _skip_reason() -> str | None:
    if not torch.cuda.is_available():
        return "no CUDA GPU"
    if not _ext.has_part("sm100"):
        return "megamoe._C built without the sm100 part"
    return None


class _StandInExt:
    """megamoe._C with sm100_moe_gemm replaced: checks the launch, then records it."""

    def __init__(self, ext):
        self._ext = ext
        self.launches = []

    def __getattr__(self, name):
        return getattr(self._ext, name)

    def sm100_moe_gemm(self, **kw):
        self.launches.append(kw)


@pytest.fixture
def glue(monkeypatch):
    why = _skip_reason()
    if why:
        pytest.skip(why)
    from megamoe.backends import cuda_sm100
    from megamoe.backends.cuda_sm100 import CudaSm100Backend, emulate_grouped_gemm

    real_launch = cuda_sm100.launch_grouped_gemm
    checked = []

    def launch(ext, counts, parts, n_part, k, a_data, a_sf, b_data, b_sf, a_gs, b_gs, out, sm_count, stream,
               buffers=None, tile_n=128):
        stand_in = _StandInExt(ext)
        real_launch(stand_in, counts, parts, n_part, k, a_data, a_sf, b_data, b_sf, a_gs, b_gs, out, sm_count,
                    stream, buffers=buffers, tile_n=tile_n)
        (kw,) = stand_in.launches
        dev = out.device
        # what the kernel would be handed
        assert torch.cuda.current_device() == dev.index, "launch outside the output's device"
        assert kw["stream"] == torch.cuda.current_stream(dev).cuda_stream
        assert (kw["a"], kw["a_sf"], kw["b"], kw["b_sf"], kw["d"]) == (
            a_data.data_ptr(), a_sf.data_ptr(), b_data.data_ptr(), b_sf.data_ptr(), out.data_ptr())
        assert kw["tile_n"] == tile_n and kw["sm_count"] == sm_count
        assert kw["args_bytes"] >= ext.sm100_args_bytes(kw["num_experts"] * parts)
        assert kw["workspace_bytes"] >= ext.sm100_workspace_bytes(kw["num_experts"] * parts, sm_count)
        host_counts = counts.tolist() if torch.is_tensor(counts) else list(counts)
        if torch.is_tensor(counts):
            assert kw["token_counts"] == counts.data_ptr() and counts.device == dev
        a_gs_l = a_gs.reshape(-1).float().cpu().tolist()
        plan = ext.sm100_plan_moe_gemm(host_counts, parts, n_part, k, a_gs_l, b_gs.reshape(-1).float().cpu().tolist(),
                                       sm_count, tile_n=tile_n)
        assert plan["can_implement"], plan["problems"]
        # every byte the groups span lies inside the buffers the launch got
        assert plan["a_bytes"] <= a_data.numel() and plan["sfa_bytes"] <= a_sf.numel()
        assert plan["b_bytes"] <= b_data.numel() and plan["sfb_bytes"] <= b_sf.numel()
        assert plan["d_elems"] <= out.numel()
        emulate_grouped_gemm(plan, a_data, a_sf, b_data, b_sf, out)
        checked.append((parts, n_part, k, tile_n, sum(host_counts)))

    monkeypatch.setattr(cuda_sm100, "launch_grouped_gemm", launch)
    be = CudaSm100Backend(device="cuda", executor="cutlass")
    be.checked = checked
    return be


def _layer(be, preset="tiny", **over):
    from megamoe.moe import MoELayer

    return MoELayer.from_preset(preset, seed=1, backend=be, **over)


@pytest.mark.parametrize("over", [{}, {"dynamic_act_scale": True}, {"hidden_size": 1040, "intermediate_size": 464,
                                                                      "num_experts": 6, "top_k": 3}])
def test_moe_forward_on_the_gpu_vs_torch(glue, over):
    from megamoe.backends.torch_ref import TorchBackend

    layer = _layer(glue, **over)
    cfg = layer.config
    ref_be = TorchBackend(device="cuda")
    gen = torch.Generator().manual_seed(9)
    for t in (1, 2, 7, 33, 129, 300):
        x = torch.randn(t, cfg.hidden_size, generator=gen).to(torch.bfloat16).cuda()
        w, ids = layer.route(x)
        glue.checked.clear()
        out = glue.moe_forward(layer._prepared, cfg, x, ids, w)
        ref = ref_be.moe_forward(layer.weights, cfg, x, ids, w)
        assert [c[:3] for c in glue.checked] == [(2, cfg.intermediate_size, layer._prepared.k1),
                                                 (1, cfg.hidden_size, layer._prepared.k2)]
        assert all(c[4] == t * cfg.top_k for c in glue.checked)  # compact: every routed pair, no more
        assert out.device.type == "cuda" and torch.isfinite(out).all()
        assert cosine(out, ref) >= 0.9999, t


def test_poisoned_buffers_and_masked_ids(glue, monkeypatch):
    """Every torch.empty float buffer NaN-poisoned and masked slots given NaN weights: the
    output is unchanged (nothing reads an unwritten row; masked slots contribute nothing)."""
    layer = _layer(glue, "small", top_k=4)
    cfg = layer.config
    gen = torch.Generator().manual_seed(10)
    x = torch.randn(97, cfg.hidden_size, generator=gen).to(torch.bfloat16).cuda()
    w, ids = layer.route(x)
    mask = (torch.rand(ids.shape, generator=gen) < 0.3).cuda()
    masked = torch.where(mask, torch.full_like(ids, -1), ids)
    clean = glue.moe_forward(layer._prepared, cfg, x, masked, w)
    orig = torch.empty
    poison_empty(monkeypatch)
    nan_w = torch.where(mask, torch.full((), float("nan"), device="cuda"), w)
    poisoned = glue.moe_forward(layer._prepared, cfg, x, masked, nan_w)
    monkeypatch.setattr(torch, "empty", orig)
    assert torch.equal(poisoned, clean)


def test_gpu_primitives_equal_the_reference(glue):
    """The shared CUDA quantize kernel and the grouped swizzle with device offsets give the bytes
    of the reference (the CPU path of the same backend)."""
    from megamoe.backends.cuda_sm100 import routing_rows, swizzle_rows_grouped

    assert glue._gpu_primitives
    gen = torch.Generator().manual_seed(11)
    for t, k, e, kb in ((1, 6, 256, 256), (64, 6, 256, 16), (33, 3, 5, 29)):
        ids = torch.randint(-1, e, (t, k), generator=gen)
        rt = routing_rows(ids.cuda(), e)
        scale = torch.randint(1, 255, (rt.rows, kb), generator=gen, dtype=torch.uint8)
        got = glue._swizzle_rows(scale.cuda().view(torch.float8_e4m3fn), rt).cpu()
        want = swizzle_rows_grouped(scale.view(torch.float8_e4m3fn), routing_rows(ids, e))
        assert torch.equal(got, want)


def test_gemm_on_the_gpu(glue):
    gen = torch.Generator().manual_seed(12)
    for m, n, k in ((1, 128, 64), (33, 464, 208), (129, 256, 7168)):
        a, b = random_nvfp4(m, k, gen, 1e-3), random_nvfp4(n, k, gen, 1e3)
        out = glue.gemm(a, b)
        assert out.device.type == "cuda"
        assert cosine(out.cpu(), nvfp4.gemm(a, b, compute_dtype=torch.float64)) >= 0.99999


@pytest.mark.parametrize("t", [1, 8, 64])
def test_v4_flash_tp8_shape_on_the_gpu(glue, t):
    """V4-Flash TP = 8 (H = 4096, I = 256, E = 256, k = 6): the glue at the deployment shape,
    with the tile the host picks (N = 64 for GEMM 1 at T = 1)."""
    from megamoe.backends.torch_ref import TorchBackend

    layer = _layer(glue, "v4-flash", hidden_size=4096, intermediate_size=256, num_experts=256, top_k=6)
    cfg = layer.config
    x = torch.randn(t, cfg.hidden_size, generator=torch.Generator().manual_seed(t)).to(torch.bfloat16).cuda()
    w, ids = layer.route(x)
    glue.checked.clear()
    out = glue.moe_forward(layer._prepared, cfg, x, ids, w)
    ref = TorchBackend(device="cuda").moe_forward(layer.weights, cfg, x, ids, w)
    tiles = [c[3] for c in glue.checked]
    assert tiles == [glue.tile_n_for(t * 6, 256, 2, 256), glue.tile_n_for(t * 6, 256, 1, 4096)]
    if t == 1:
        assert tiles[0] == 64
    assert cosine(out, ref) >= 0.9999


def test_device_guard_with_two_gpus(glue):
    """A backend on cuda:1 used while cuda:0 is current: every kernel lands on cuda:1 (the stand-in
    asserts the current device at the launch; quantize and swizzle would fail on a foreign stream)."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    from megamoe.backends.cuda_sm100 import CudaSm100Backend

    be1 = CudaSm100Backend(device="cuda:1")
    layer = _layer(be1)
    cfg = layer.config
    x = torch.randn(5, cfg.hidden_size).to(torch.bfloat16).to("cuda:1")
    w, ids = layer.route(x)
    with torch.cuda.device(0):
        out = be1.moe_forward(layer._prepared, cfg, x, ids, w)
    assert out.device == torch.device("cuda:1") and torch.isfinite(out).all()

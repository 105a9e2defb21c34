"""The ``cuda-sm100`` backend: NVFP4 x NVFP4 grouped GEMM on Blackwell (B200/GB200).

The expert GEMMs run in CUTLASS's block-scaled ptr-array grouped kernel
(``cpp/sm100/grouped_gemm_nvfp4.cu``, compiled for sm_100a): tcgen05 MMA reading
e2m1 codes and e4m3 block scales in the docs/SPEC.md §2 layout, fp32 accumulation, one
alpha per group, fp32 output (bf16 output before SwiGLU's re-quantization measured
cosine 0.99977 against the torch reference in CPU emulation; fp32 matches it).

This path is compiled in this project's CI with CUDA 13 and, device code, with CUDA 12.8's
headers and ptxas (the image's toolchain), and host-tested there (shapes, strides, SF layouts
against docs/SPEC.md §2, pointer offsets, alphas, workspace, ``can_implement``, the tile
choice, and the whole MoE glue on the CPU with :func:`emulate_grouped_gemm` standing in for
the kernel; ``tests/sm100_gpu/test_sm100_glue_gpu.py`` runs the glue on any CUDA GPU). The
kernel itself has never run here: no Blackwell GPU was available. It is validated on the
user's hardware by ``megamoe selftest --backend cuda-sm100`` (the docs/SPEC.md §5 health
checks and the deployment shapes) and ``pytest tests/sm100_gpu``.

How one MoE forward maps onto the kernel (see ``cpp/include/megamoe/sm100_moe_groups.hpp``):

* the T * k (token, slot) pairs are sorted by expert into a compact activation matrix
  (no padding rows: only routed rows are gathered, quantized, activated and combined;
  bytes identical to the reference quantizer); only the scale factors are placed in expert
  blocks starting on 128-row boundaries (docs/SPEC.md §2), every other scale byte zero, so
  every byte the kernel's TMA can read is defined. TMA bounds each group's A and D by its
  own row count, so tiles past an expert's rows neither read nor write its neighbours';
  ids outside ``[0, E)`` (masked, docs/SPEC.md §3.1) sort last and no GEMM reads them;
* GEMM 1 has two groups per expert, gate and up, each with its own alpha
  (``w13_weight_scale_2[e, 0]`` and ``[e, 1]``, times the static input scale), writing the
  two column halves of one ``[rows, 2I]`` output; the weight scales of gate and up are
  swizzled separately (I need not be a multiple of 128);
* K is padded with zero codes and zero scales to a multiple of 32 (16-byte fp4 rows for
  TMA), e.g. I = 464 -> 480 for GEMM 2;
* dynamic (per-row) activation scales cannot be a per-group alpha: the kernel runs with
  activation scale 1 and each output row is multiplied by its row's scale afterwards;
* no host synchronisation: token counts stay on the device, where a small kernel fills
  CUTLASS's per-group arrays (one block scan of the counts); A and D have T * k rows, the
  scale-factor rows are bounded on the host by ``T*k + 127 * min(E, T*k)``, whatever the
  routing (all tokens on one expert included);
* two kernel configurations, N tile 128 and 64, chosen on the host from T * k
  (``_C.sm100_select_tile_n``): 64 when even a bound of the 128-wide grid has fewer CTAs
  than the GPU has SMs (decode), doubling the CTAs;
* the combine gathers each token's k rows and adds them in slot order (no atomics: same
  input, same bits, docs/FIELD_BUGS.md row 28).

Quantization and SF swizzling use the shared CUDA kernels of ``cpp/common`` on a GPU
(the reference of :mod:`megamoe.nvfp4` on other devices, i.e. under the emulator).
Not on the CUTLASS path (stated in :meth:`describe`): W4A16 (bf16 activations) and
``gemm`` with a float ``a``, which run the torch reference on the GPU.
"""
from __future__ import annotations

import contextlib
import time
from collections import OrderedDict
from dataclasses import dataclass

import torch

from megamoe import _ext, nvfp4
from megamoe.backends.base import Backend
from megamoe.backends.cuda_common import CudaCommonMixin, common_ext
from megamoe.backends.torch_ref import TorchBackend, row_global_scales, swiglu

__all__ = ["CudaSm100Backend", "PreparedSm100", "RoutingRows", "combine_slots", "driver_problem",
           "emulate_grouped_gemm", "launch_buffers", "launch_grouped_gemm", "pad_k", "routing_rows",
           "swizzle_rows_grouped", "K_ALIGN", "N_ALIGN"]

K_ALIGN = 32  # fp4 elements: 16-byte rows for TMA (kernel alignment of A and B)
N_ALIGN = 4   # fp32 elements: 16-byte output rows and gate/up column offsets
ROW_ALIGN = 128  # docs/SPEC.md §2: each expert's rows start on a 128-row boundary


def _round_up(x: int, m: int) -> int:
    return (x + m - 1) // m * m


def _sm100_ext():
    return _ext.ext if _ext.has_part("sm100") else None


def pad_k(q: nvfp4.NVFP4Tensor, k_pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(data, scale)`` of ``q`` with K padded to ``k_pad`` by zero codes and zero scales.

    A zero scale decodes its whole block to zero, so the padded GEMM equals the unpadded one.
    """
    k = q.shape[-1]
    if k_pad < k or k_pad % 16:
        raise ValueError(f"pad_k: k_pad={k_pad} must be a multiple of 16 and >= K={k}")
    if k_pad == k:
        return q.data.contiguous(), q.scale.contiguous()
    lead = q.data.shape[:-1]
    data = torch.zeros((*lead, k_pad // 2), dtype=torch.uint8, device=q.device)
    data[..., : k // 2] = q.data
    scale = torch.zeros((*lead, k_pad // 16), dtype=torch.uint8, device=q.device)
    scale[..., : k // 16] = q.scale.view(torch.uint8)
    return data, scale.view(torch.float8_e4m3fn)


def _swizzle_parts(be: Backend, scale: torch.Tensor, parts: int) -> torch.Tensor:
    """Weight scales ``[E, parts * n, Kb]`` -> uint8 ``[E, parts, padded bytes]``, each part
    swizzled on its own (docs/SPEC.md §2 layout of an ``[n, Kb]`` matrix)."""
    e, rows, kb = scale.shape
    n = rows // parts
    buf = be.swizzle_scales(scale.reshape(e * parts, n, kb).contiguous())
    return buf.reshape(e, parts, -1)


#: oldest driver branch that runs each CUDA major version (Linux), and the first CUDA version with sm_100
DRIVER_BRANCH_FOR_CUDA = {12: 525, 13: 580}
BLACKWELL_MIN_CUDA = 12080  # CUDA 12.8, driver R570


def _cuda_str(v: int) -> str:
    return f"{v // 1000}.{v % 1000 // 10}"


def driver_problem(runtime: int, driver: int) -> str:
    """Why a driver supporting CUDA ``driver`` cannot run sm_100a code built with CUDA runtime
    ``runtime`` (both ``1000 * major + 10 * minor``), or ``""`` when it can.

    The statically linked runtime needs a driver of its major version (minor version
    compatibility: R525+ for 12.x, R580+ for 13.x), and Blackwell needs CUDA >= 12.8 (R570+).
    """
    need = max(runtime // 1000 * 1000, BLACKWELL_MIN_CUDA)
    if driver >= need:
        return ""
    branch = DRIVER_BRANCH_FOR_CUDA.get(need // 1000, 0)
    if need == BLACKWELL_MIN_CUDA or need // 1000 == 12:
        branch = max(branch, 570)
    have = "no NVIDIA driver found" if driver <= 0 else f"the installed driver supports CUDA {_cuda_str(driver)}"
    fix = ("upgrade the driver, or use a build of megamoe made with CUDA 12.8 (the container image; "
           "driver R570 or newer)" if runtime // 1000 > 12 else "upgrade the driver")
    return (f"megamoe._C was built with CUDA {_cuda_str(runtime)} and links its runtime statically; on Blackwell "
            f"that needs a driver for CUDA >= {_cuda_str(need)} (R{branch} or newer), and {have}: {fix}")


@dataclass
class PreparedSm100:
    """Weights laid out for the grouped kernel (built once per layer by ``prepare_weights``).

    w13_data ``[E, 2I, K1/2]`` u8, w13_sf ``[E, 2, round_up(I,128) * K1/16 (padded to 4)]`` u8,
    w13_gs ``[E * 2]`` f32 (gate, up per expert); w2_data ``[E, H, K2/2]``, w2_sf
    ``[E, 1, ...]``, w2_gs ``[E]``. K1 = H and K2 = I, each rounded up to 32. ``b13`` / ``b2``:
    the experts' biases (float32 ``[E, 2I]`` / ``[E, H]``, or None), added by the host glue.
    """

    weights: object  # the MoEWeights on the device (W4A16 fallback)
    hidden: int
    inter: int
    k1: int
    k2: int
    w13_data: torch.Tensor
    w13_sf: torch.Tensor
    w13_gs: torch.Tensor
    w2_data: torch.Tensor
    w2_sf: torch.Tensor
    w2_gs: torch.Tensor
    w13_input_scale: torch.Tensor | None
    w2_input_scale: torch.Tensor | None
    b13: torch.Tensor | None = None  # float32 [E, 2I] gate/up bias (gpt-oss), added before the activation
    b2: torch.Tensor | None = None   # float32 [E, H] down bias, added before the routing weight


def emulate_grouped_gemm(plan: dict, a_data: torch.Tensor, a_sf: torch.Tensor, b_data: torch.Tensor,
                         b_sf: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """What the grouped kernel computes, on any device, driven by a host plan.

    ``plan`` is ``megamoe._C.sm100_plan_moe_gemm(...)``: for every group it reads the
    operands at the plan's pointer offsets (the values the launcher's pointer arrays hold,
    with every base at 0), decodes the scales with the docs/SPEC.md §2 closed form, and writes
    ``alpha_g * A_g @ B_g^T`` (fp32, as the kernel's epilogue) into ``out`` at the group's
    offset with row stride ``ldd``. The tests use it to check the planner's offsets and the backend's glue
    on the CPU; it is not a performance path.
    """
    a_flat, asf_flat = a_data.reshape(-1), a_sf.reshape(-1).view(torch.uint8)
    b_flat, bsf_flat = b_data.reshape(-1), b_sf.reshape(-1).view(torch.uint8)
    d_flat = out.reshape(-1)
    k = plan["k"]
    kb = k // 16
    one = torch.ones((), dtype=torch.float32, device=out.device)
    for g in plan["groups"]:
        m, n, _ = g["problem_shape"]
        if m == 0:
            continue
        a_rows = a_flat[g["ptr_a"]: g["ptr_a"] + m * k // 2].reshape(m, k // 2)
        b_rows = b_flat[g["ptr_b"]: g["ptr_b"] + n * k // 2].reshape(n, k // 2)
        sfa = nvfp4.unswizzle_scales(asf_flat[g["ptr_sfa"]: g["ptr_sfa"] + g["sfa_bytes"]], m, kb)
        sfb = nvfp4.unswizzle_scales(bsf_flat[g["ptr_sfb"]: g["ptr_sfb"] + g["sfb_bytes"]], n, kb)
        res = nvfp4.gemm(nvfp4.NVFP4Tensor(a_rows, sfa, one), nvfp4.NVFP4Tensor(b_rows, sfb, one),
                         alpha=g["alpha"])
        elem = g["ptr_d"] // plan["d_element_bytes"]
        d_flat.as_strided((m, n), (g["ldd"], 1), elem).copy_(res.to(out.dtype))
    return out


def _primitive(name: str):
    """Backend method ``name`` from the shared CUDA kernels on a GPU, from the reference elsewhere."""

    def call(self, *args, **kwargs):
        impl = CudaCommonMixin if self._gpu_primitives else Backend
        return getattr(impl, name)(self, *args, **kwargs)

    call.__name__ = name
    call.__doc__ = getattr(Backend, name).__doc__
    return call


def launch_buffers(ext, groups: int, sm_count: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """A fresh ``(args, workspace)`` pair for a launch of ``groups`` groups on ``device``.

    ``args`` holds CUTLASS's per-group arrays (filled on the device by the argument builder),
    ``workspace`` the per-SM tensor maps; torch's allocator gives 512-byte aligned blocks, more
    than the 16 / 64 bytes the launcher checks."""
    args = torch.empty(ext.sm100_args_bytes(groups), dtype=torch.uint8, device=device)
    workspace = torch.empty(max(ext.sm100_workspace_bytes(groups, sm_count), 1), dtype=torch.uint8, device=device)
    return args, workspace


def launch_grouped_gemm(ext, counts, parts: int, n_part: int, k: int, a_data, a_sf, b_data, b_sf,
                        a_gs: torch.Tensor, b_gs: torch.Tensor, out: torch.Tensor, sm_count: int,
                        stream: int, buffers: tuple[torch.Tensor, torch.Tensor] | None = None,
                        tile_n: int = 128) -> None:
    """Call ``_C.sm100_moe_gemm`` with ``buffers`` = ``(args, workspace)`` (see :func:`launch_buffers`;
    fresh ones when None).

    Operands as in :func:`emulate_grouped_gemm`; ``out`` is fp32 ``[rows, parts * n_part]``.
    ``counts`` (tokens per expert) is a host list, then CUTLASS's ``can_implement`` also checks
    every group (the list reaches the device by a copy from pinned memory), or an int32 tensor
    on ``out``'s device, then nothing synchronises with the host. ``tile_n``: the kernel
    configuration (128, or 64 for small M). Asynchronous on ``stream``; the host-side checks
    (geometry, alignment, sizes, ``can_implement``) raise before anything is launched.
    """
    host_counts = None if torch.is_tensor(counts) else [int(c) for c in counts]
    num_experts = counts.numel() if torch.is_tensor(counts) else len(host_counts)
    groups = num_experts * parts
    dev = out.device
    tensors = [a_data, a_sf, b_data, b_sf, out]
    if not all(t.is_contiguous() and t.device == dev for t in tensors):
        raise ValueError("sm100 grouped GEMM: operands must be contiguous tensors on one device")
    if out.dtype != torch.float32:
        raise TypeError(f"sm100 grouped GEMM writes float32, got out of dtype {out.dtype}")
    if host_counts is None:
        if counts.dtype != torch.int32 or counts.device != dev or not counts.is_contiguous():
            raise ValueError(f"sm100 grouped GEMM: device counts must be contiguous int32 on {dev}, "
                             f"got {counts.dtype} on {counts.device}")
        counts_dev = counts
    else:
        host = torch.tensor(host_counts, dtype=torch.int32)
        if dev.type == "cuda":  # an asynchronous copy; the caching host allocator keeps `host` alive until done
            host = host.pin_memory()
        counts_dev = host.to(dev, non_blocking=True)
    args, workspace = launch_buffers(ext, groups, sm_count, dev) if buffers is None else buffers
    if args.device != dev or workspace.device != dev:
        raise ValueError(f"sm100 grouped GEMM: args / workspace buffers must be on {dev}")
    a_gs = a_gs.reshape(-1).float().contiguous().to(dev)
    b_gs = b_gs.reshape(-1).float().contiguous().to(dev)
    ext.sm100_moe_gemm(
        num_experts=num_experts, parts=parts, n_part=n_part, k=k, a_scale_count=a_gs.numel(),
        a=a_data.data_ptr(), a_sf=a_sf.data_ptr(), b=b_data.data_ptr(), b_sf=b_sf.data_ptr(),
        d=out.data_ptr(), token_counts=counts_dev.data_ptr(), a_global_scale=a_gs.data_ptr(),
        b_global_scale=b_gs.data_ptr(), args=args.data_ptr(), args_bytes=args.numel(),
        workspace=workspace.data_ptr(), workspace_bytes=workspace.numel(), host_token_counts=host_counts,
        sm_count=sm_count, stream=stream, tile_n=tile_n)


@dataclass
class RoutingRows:
    """Where every (token, slot) pair of a routing goes: compact expert-sorted rows for A and D,
    128-row aligned expert blocks for A's scale factors only.

    ``counts`` int32 ``[E]`` tokens per expert (masked slots not counted). ``rows`` = T * k,
    the compact row count (a host value: the sum of the counts stays on the device): row
    ``i`` holds the ``i``-th pair in (expert, token, slot) order, real pairs first, the
    pairs of masked slots after every expert (quantized like the others, read by no GEMM
    and skipped by the combine). ``token_of`` ``[rows]`` the token of each row;
    ``row_of_slot`` ``[T * k]`` the row of each slot in slot order; ``valid`` ``[T * k]``
    whether the slot's id is in ``[0, E)``; ``expert_of_row`` and ``real`` ``[rows]`` the
    expert of each row (masked: E - 1) and whether it is a real pair. ``row_offsets`` int32
    ``[E + 1]`` the first compact row of each expert (and the real-row total);
    ``sf_row_offsets`` int32 ``[E]`` the first scale-factor row of each expert
    (``sum_{j<e} round_up(count_j, 128)``, docs/SPEC.md §2); ``sf_rows`` a host bound on
    the scale-factor rows, ``T*k + 127 * min(E, T*k)`` rounded up to 128, whatever the
    routing; ``sf_row_of_row`` ``[rows]`` each row's scale-factor row (masked: ``sf_rows``).
    """

    counts: torch.Tensor
    rows: int
    sf_rows: int
    token_of: torch.Tensor
    row_of_slot: torch.Tensor
    valid: torch.Tensor
    expert_of_row: torch.Tensor
    real: torch.Tensor
    row_offsets: torch.Tensor
    sf_row_offsets: torch.Tensor
    sf_row_of_row: torch.Tensor


def routing_rows(topk_ids: torch.Tensor, num_experts: int) -> RoutingRows:
    """Compact row placement of a ``[T, k]`` routing, on the ids' device, without a host sync.

    Expert ``e``'s pairs, in (token, slot) order, take compact rows ``sum_{j<e} count_j ..``
    of A and D, and scale-factor rows ``sum_{j<e} round_up(count_j, 128) ..`` (docs/SPEC.md §2).
    Ids outside ``[0, E)`` get rows after every expert's that nothing reads.
    """
    e = num_experts
    dev = topk_ids.device
    flat = topk_ids.reshape(-1).long()
    pairs = flat.numel()
    top_k = topk_ids.shape[1] if topk_ids.dim() == 2 else 1
    valid = (flat >= 0) & (flat < e)
    key = torch.where(valid, flat, torch.full((), e, dtype=torch.long, device=dev))  # masked: after every expert
    order = torch.argsort(key, stable=True)
    sorted_key = key[order]
    # integer additions: exact, so the same in any order
    counts_all = torch.zeros(e + 1, dtype=torch.int64, device=dev).index_add_(
        0, key, torch.ones(pairs, dtype=torch.int64, device=dev))
    counts = counts_all[:e]
    padded = (counts + ROW_ALIGN - 1) // ROW_ALIGN * ROW_ALIGN
    sf_starts = torch.cumsum(padded, 0) - padded        # docs/SPEC.md §2 row_offset_e of the scale factors
    starts = torch.cumsum(counts_all, 0) - counts_all   # first compact row of each expert (and of the masked)
    # sum_e round_up(count_e, 128) <= pairs + 127 * (number of non-empty experts)
    sf_rows = _round_up(pairs + (ROW_ALIGN - 1) * min(e, pairs), ROW_ALIGN)
    is_real = sorted_key < e
    expert = sorted_key.clamp(max=e - 1)
    row = torch.arange(pairs, device=dev)
    sf_row = torch.where(is_real, sf_starts[expert] + row - starts[sorted_key],
                         torch.full((), sf_rows, dtype=torch.long, device=dev))
    row_of_slot = torch.empty(pairs, dtype=torch.long, device=dev)
    row_of_slot[order] = row  # `order` is a permutation: every slot written once
    return RoutingRows(counts=counts.to(torch.int32), rows=pairs, sf_rows=sf_rows, token_of=order // top_k,
                       row_of_slot=row_of_slot, valid=valid, expert_of_row=expert, real=is_real,
                       row_offsets=starts.to(torch.int32), sf_row_offsets=sf_starts.to(torch.int32),
                       sf_row_of_row=sf_row)


def swizzle_rows_grouped(scale: torch.Tensor, rt: RoutingRows) -> torch.Tensor:
    """Linear scales of the compact rows ``[rows, cols]`` -> the docs/SPEC.md §2 buffer of a
    ``[rt.sf_rows, cols]`` matrix with each expert's block at its scale-factor row offset.

    The reference of what ``megamoe._C.swizzle_scales_grouped`` does with ``rt.row_offsets``
    and ``rt.sf_row_offsets`` (any device): every byte of the buffer is written, rows no
    real pair fills are zero, masked rows are not placed.
    """
    u8 = scale.view(torch.uint8) if scale.dtype != torch.uint8 else scale
    rows, cols = u8.shape
    prow, pcol = nvfp4.sf_padded_shape(rt.sf_rows, cols)
    out = torch.zeros(prow * pcol + 1, dtype=torch.uint8, device=u8.device)  # last byte: where masked rows go
    kk = torch.arange(cols, device=u8.device, dtype=torch.int64).unsqueeze(0)
    idx = nvfp4.sf_offset(rt.sf_row_of_row.unsqueeze(1), kk, cols)
    idx = torch.where(rt.real.unsqueeze(1), idx, torch.full((), prow * pcol, dtype=torch.int64, device=u8.device))
    out[idx.reshape(-1)] = u8.reshape(-1)  # real rows: distinct offsets
    return out[: prow * pcol].reshape(prow, pcol)


def combine_slots(y: torch.Tensor, row_of_slot: torch.Tensor, valid: torch.Tensor, weights: torch.Tensor,
                  row_scale: torch.Tensor | None = None) -> torch.Tensor:
    """``out[t] = sum_j w[t, j] * s[r] * y[r]``, ``r = row_of_slot[t, j]``, summed in slot order j = 0..k-1.

    A gather per slot and an add, no atomics and no ``index_add_`` (atomic on CUDA): the same
    input gives the same bits on every run (docs/FIELD_BUGS.md row 28). Slots with ``valid``
    False contribute nothing, whatever their row, weight or the row's contents (masked ids).
    ``row_scale`` ``[rows]`` (dynamic activation scales of GEMM 2) multiplies each row; None: 1.
    """
    t, top_k = row_of_slot.shape
    rows = y.shape[0]
    out = torch.zeros((t, y.shape[1]), dtype=torch.float32, device=y.device)
    zero = torch.zeros((), dtype=torch.float32, device=y.device)
    for j in range(top_k):
        ok = valid[:, j]
        r = torch.where(ok, row_of_slot[:, j], torch.zeros((), dtype=row_of_slot.dtype, device=y.device))
        r = r.clamp(max=rows - 1)
        w = weights[:, j] if row_scale is None else weights[:, j] * row_scale[r]
        out = out + torch.where(ok.unsqueeze(1), y[r] * w.unsqueeze(1), zero)
    return out


class CudaSm100Backend(CudaCommonMixin, Backend):
    """NVFP4 MoE on Blackwell through CUTLASS's block-scaled grouped GEMM.

    Args:
        device: a CUDA device (default ``cuda``).
        executor: ``"cutlass"`` (the kernel) or ``"emulate"`` (:func:`emulate_grouped_gemm`,
            any device; what the CPU tests use to check everything around the kernel).
        sm_count: SMs the persistent kernel spreads over (default: the device's).
        tile_n: the kernel configuration's N tile, 128 or 64; None (default) chooses per
            launch from T * k (:meth:`tile_n_for`): 64 when the 128-wide grid cannot fill the GPU.
    """

    name = "cuda-sm100"
    #: the host glue adds the experts' biases and runs the activation (swiglu_alpha, swiglu_up_shift)
    expert_bias_and_activation = True

    def __init__(self, device: str | torch.device | None = None, executor: str = "cutlass",
                 sm_count: int | None = None, tile_n: int | None = None) -> None:
        if executor not in ("cutlass", "emulate"):
            raise ValueError(f"executor must be 'cutlass' or 'emulate', got {executor!r}")
        if tile_n not in (None, 64, 128):
            raise ValueError(f"tile_n must be None (chosen per launch from T * k), 64 or 128, got {tile_n!r}")
        self.tile_n = tile_n
        self.last_tile_n: int | None = None  # the N tile of the latest grouped GEMM
        self._ext = _sm100_ext()
        if self._ext is None:
            raise RuntimeError(f"cuda-sm100 needs megamoe._C built with sm_100a: {self.availability()[1]}")
        self._device = torch.device(device if device is not None else "cuda")
        if executor == "cutlass" and self._device.type != "cuda":
            raise ValueError(f"cuda-sm100 runs the CUTLASS kernel on a CUDA device, got {self._device} "
                             f"(executor='emulate' runs anywhere)")
        self.executor = executor
        if sm_count is None:
            sm_count = (torch.cuda.get_device_properties(self._device).multi_processor_count
                        if self._device.type == "cuda" else self._ext.sm100_kernel_info()["default_sm_count"])
        self.sm_count = int(sm_count)
        self._reference = TorchBackend(device=self._device)
        self._gpu_primitives = self._device.type == "cuda" and common_ext() is not None
        self._buffers: OrderedDict = OrderedDict()  # (groups, device, stream) -> (args, workspace)

    #: launch buffers kept per (groups, stream); the least recently used beyond this are dropped
    MAX_LAUNCH_BUFFERS = 8

    def launch_buffers(self, groups: int, stream: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The cached ``(args, workspace)`` of launches with ``groups`` groups on ``stream``.

        One pair per (groups, stream): launches on one stream run in order, so the argument
        builder of a launch never overwrites arrays an earlier launch still reads. (Under CUDA
        graph capture the backend allocates fresh buffers from the graph's pool instead.) The
        C++ launcher keys its initialized CUTLASS ``Gemm`` objects by these buffers' addresses,
        so a cached pair also skips ``Gemm::initialize``."""
        key = (groups, str(self._device), int(stream))
        bufs = self._buffers.get(key)
        if bufs is None:
            bufs = launch_buffers(self._ext, groups, self.sm_count, self._device)
            self._buffers[key] = bufs
            while len(self._buffers) > self.MAX_LAUNCH_BUFFERS:
                self._buffers.popitem(last=False)
        else:
            self._buffers.move_to_end(key)
        return bufs

    quantize = _primitive("quantize")
    swizzle_scales = _primitive("swizzle_scales")
    unswizzle_scales = _primitive("unswizzle_scales")
    swizzle_scales_grouped = _primitive("swizzle_scales_grouped")
    verify_sf_roundtrip = _primitive("verify_sf_roundtrip")
    unswizzle_scales_grouped = _primitive("unswizzle_scales_grouped")

    # ------------------------------------------------------------------ availability
    @classmethod
    def availability(cls) -> tuple[bool, str]:
        ext = _sm100_ext()
        if ext is None:
            if _ext.ext is None:
                return False, _ext.EXT_ERROR or "megamoe._C is not built"
            return False, (f"megamoe._C was built without sm_100a (parts {_ext.built_parts()}, "
                           f"archs '{getattr(_ext.ext, 'cuda_archs', '')}')")
        if not torch.cuda.is_available():
            return False, "no CUDA device visible to torch"
        major, minor = torch.cuda.get_device_capability()
        if major != 10:
            return False, (f"needs a Blackwell GPU of compute capability 10.x; this is "
                           f"{torch.cuda.get_device_name()} ({major}.{minor})")
        # arch-specific cubins (sm_100a) run only on their exact compute capability
        built = {a.strip() for a in str(getattr(ext, "cuda_archs", "")).split(",")}
        if not {f"{major}{minor}a", f"{major}{minor}f", f"{major}0f"} & built:
            return False, (f"compute capability {major}.{minor} needs sm_{major}{minor}a in MEGAMOE_CUDA_ARCHS; "
                           f"the extension was built for '{getattr(ext, 'cuda_archs', '')}'")
        versions = ext.sm100_cuda_versions() if hasattr(ext, "sm100_cuda_versions") else None
        if versions is not None:
            problem = driver_problem(versions["runtime"], versions["driver"])
            if problem:
                return False, problem
        return True, ""

    @property
    def device(self) -> torch.device:
        return self._device

    def describe(self) -> dict:
        d = super().describe()
        d.update(kernel=self._ext.sm100_kernel_info(), executor=self.executor, sm_count=self.sm_count,
                 tile_n="auto (64 or 128 from T * k)" if self.tile_n is None else self.tile_n,
                 cuda_versions=self._ext.sm100_cuda_versions() if hasattr(self._ext, "sm100_cuda_versions") else None,
                 not_on_cutlass_path=["W4A16 (bf16 activations): torch reference on the GPU",
                                      "gemm with a float `a`: torch reference on the GPU"],
                 primitives="cpp/common CUDA kernels" if self._gpu_primitives else "torch reference",
                 validated_here="compiled and host-tested in CI; the kernel never ran in CI (no Blackwell GPU)")
        return d

    # ------------------------------------------------------------------ the grouped GEMM
    def tile_n_for(self, pairs: int, num_experts: int, parts: int, n_part: int) -> int:
        """The kernel configuration's N tile for ``pairs`` = T * k routed rows (host-only):
        the backend's fixed ``tile_n``, or ``_C.sm100_select_tile_n``."""
        if self.tile_n is not None:
            return self.tile_n
        return int(self._ext.sm100_select_tile_n(int(pairs), int(num_experts), parts, n_part, self.sm_count))

    def _device_guard(self):
        """The backend's device made current (quantize, swizzle and the GEMM launch on the current device)."""
        return torch.cuda.device(self._device) if self._device.type == "cuda" else contextlib.nullcontext()

    def _grouped_gemm(self, counts, parts: int, n_part: int, k: int, a_data, a_sf, b_data, b_sf,
                      a_gs: torch.Tensor, b_gs: torch.Tensor, out: torch.Tensor,
                      pairs: int | None = None) -> torch.Tensor:
        """``out[rows of e, p*n_part:(p+1)*n_part] = alpha_{e,p} * A_e @ B_{e,p}^T`` for every group.

        ``counts``: tokens per expert, a list (host) or an int32 tensor on the device;
        ``pairs``: the host bound of their sum (T * k), which picks the kernel configuration
        (None: the sum of host counts; with device counts, the output's row count)."""
        a_gs = a_gs.reshape(-1).float().contiguous()
        b_gs = b_gs.reshape(-1).float().contiguous()
        num_experts = counts.numel() if torch.is_tensor(counts) else len(counts)
        if pairs is None:
            pairs = out.shape[0] if torch.is_tensor(counts) else sum(int(c) for c in counts)
        tile_n = self.tile_n_for(pairs, num_experts, parts, n_part)
        self.last_tile_n = tile_n
        if self.executor == "emulate":
            counts = counts.tolist() if torch.is_tensor(counts) else list(counts)
            plan = self._ext.sm100_plan_moe_gemm(counts, parts, n_part, k, a_gs.cpu().tolist(),
                                                 b_gs.cpu().tolist(), self.sm_count, tile_n=tile_n)
            if not plan["can_implement"]:
                raise RuntimeError(f"sm100 grouped GEMM cannot run this problem: {plan['problems']} "
                                   f"(CUTLASS: {plan['can_implement_status']})")
            return emulate_grouped_gemm(plan, a_data, a_sf, b_data, b_sf, out)
        dev = out.device
        with torch.cuda.device(dev):  # the launcher uses the current device and its stream
            stream = torch.cuda.current_stream(dev).cuda_stream
            buffers = None if torch.cuda.is_current_stream_capturing() else self.launch_buffers(
                num_experts * parts, stream)
            launch_grouped_gemm(self._ext, counts, parts, n_part, k, a_data, a_sf, b_data, b_sf, a_gs, b_gs, out,
                                self.sm_count, stream, buffers=buffers, tile_n=tile_n)
        return out

    # ------------------------------------------------------------------ GEMM
    def gemm(self, a, b: nvfp4.NVFP4Tensor, alpha=None, out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """``alpha * a @ b^T``; NVFP4 ``a`` runs the CUTLASS kernel (one group), float ``a`` the reference."""
        if not isinstance(a, nvfp4.NVFP4Tensor):
            return nvfp4.gemm(a.to(self._device), b.to(self._device), alpha=alpha, out_dtype=out_dtype)
        if a.data.dim() != 2 or b.data.dim() != 2 or a.shape[1] != b.shape[1]:
            raise ValueError(f"gemm: expected a [M, K] and b [N, K], got {tuple(a.shape)} and {tuple(b.shape)}")
        with self._device_guard():
            return self._gemm(a.to(self._device), b.to(self._device), alpha, out_dtype)

    def _gemm(self, a: nvfp4.NVFP4Tensor, b: nvfp4.NVFP4Tensor, alpha, out_dtype: torch.dtype) -> torch.Tensor:
        m, k = a.shape
        n = b.shape[0]
        if m == 0 or n == 0:
            return torch.zeros((m, n), dtype=out_dtype, device=self._device)
        k_pad, n_pad = _round_up(k, K_ALIGN), _round_up(n, N_ALIGN)
        a_data, a_scale = pad_k(a, k_pad)
        b_data, b_scale = pad_k(b, k_pad)
        if n_pad != n:
            b_data = torch.cat([b_data, b_data.new_zeros((n_pad - n, k_pad // 2))])
            b_scale_u8 = b_scale.view(torch.uint8)
            b_scale_u8 = torch.cat([b_scale_u8, b_scale_u8.new_zeros((n_pad - n, k_pad // 16))])
            b_scale = b_scale_u8.view(torch.float8_e4m3fn)
        a_sf = self.swizzle_scales(a_scale)
        b_sf = self.swizzle_scales(b_scale)
        scalar = a.global_scale.dim() == 0 and b.global_scale.dim() == 0
        one = torch.ones(1, dtype=torch.float32, device=self._device)
        a_gs = a.global_scale.reshape(1) if scalar else one
        b_gs = b.global_scale.reshape(1) if scalar else one
        d = torch.empty((m, n_pad), dtype=torch.float32, device=self._device)
        # the count stays on the device (a fill kernel, no host copy): graph-capturable
        counts = torch.full((1,), m, dtype=torch.int32, device=self._device)
        self._grouped_gemm(counts, 1, n_pad, k_pad, a_data, a_sf, b_data, b_sf, a_gs, b_gs, d, pairs=m)
        res = d[:, :n].float()
        if not scalar:  # per-row global scales: applied outside the kernel's scalar alpha
            res = res * nvfp4._global_scale_rows(a.global_scale.float(), (m,)).reshape(-1, 1)
            res = res * nvfp4._global_scale_rows(b.global_scale.float(), (n,)).reshape(1, -1)
        if alpha is not None:
            res = res * torch.as_tensor(alpha, dtype=torch.float32, device=self._device)
        return res.to(out_dtype)

    # ------------------------------------------------------------------ MoE
    def prepare_weights(self, weights):
        with self._device_guard():
            return self._prepare_weights(weights)

    def _prepare_weights(self, weights):
        w = weights.to(self._device)
        e, two_i, _ = w.w13.data.shape
        inter, hidden = two_i // 2, w.w13.shape[-1]
        if inter % N_ALIGN or hidden % N_ALIGN:
            raise ValueError(f"cuda-sm100 needs I and H multiples of {N_ALIGN} (16-byte fp32 output rows), "
                             f"got I={inter}, H={hidden}")
        k1, k2 = _round_up(hidden, K_ALIGN), _round_up(inter, K_ALIGN)
        w13_data, w13_scale = pad_k(w.w13, k1)
        w2_data, w2_scale = pad_k(w.w2, k2)
        w13_gs, w2_gs = w.w13.global_scale.float(), w.w2.global_scale.float()
        if w13_gs.dim() == 0 or tuple(w13_gs.shape) == (e,):
            w13_gs = w13_gs.reshape(-1, 1).expand(e, 2)  # one scale for gate and up
        elif tuple(w13_gs.shape) != (e, 2):
            raise ValueError(f"w13 global_scale must be [], [E] or [E, 2] (gate, up), got {tuple(w13_gs.shape)}")
        if w2_gs.dim() == 0:
            w2_gs = w2_gs.reshape(1).expand(e)
        elif tuple(w2_gs.shape) != (e,):
            raise ValueError(f"w2 global_scale must be [] or [E], got {tuple(w2_gs.shape)}")
        prepared = PreparedSm100(
            weights=w, hidden=hidden, inter=inter, k1=k1, k2=k2,
            w13_data=w13_data, w13_sf=_swizzle_parts(self, w13_scale, 2), w13_gs=w13_gs.contiguous().reshape(-1),
            w2_data=w2_data, w2_sf=_swizzle_parts(self, w2_scale, 1), w2_gs=w2_gs.contiguous(),
            w13_input_scale=w.w13_input_scale, w2_input_scale=w.w2_input_scale,
            b13=None if w.b13 is None else w.b13.float().contiguous(),
            b2=None if w.b2 is None else w.b2.float().contiguous())
        # Ask CUTLASS once, with odd and 128-crossing token counts, whether both GEMMs are implementable.
        for parts, n_part, k in ((2, inter, k1), (1, hidden, k2)):
            plan = self._ext.sm100_plan_moe_gemm([1, 129] + [0] * (e - 2) if e >= 2 else [129], parts, n_part, k,
                                                 [1.0], [1.0] * (max(e, 1) * parts), self.sm_count)
            if not plan["can_implement"]:
                raise ValueError(f"cuda-sm100 cannot run N={n_part}, K={k}: {plan['problems']} "
                                 f"(CUTLASS: {plan['can_implement_status']})")
        return prepared

    def _quantize_rows(self, x: torch.Tensor, k_pad: int, static_scale, rt: RoutingRows, dynamic: bool):
        """Quantize the compact rows ``x`` ``[rt.rows, K]`` (per-row global scales), K padded.

        Returns (codes ``[rows, k_pad/2]``, the swizzled scales of the real rows in their
        experts' 128-row aligned blocks (every other byte zero), per-row global scales)."""
        k = x.shape[1]
        if dynamic or static_scale is None:
            row_gs = row_global_scales(x)
        else:
            row_gs = static_scale.float()[rt.expert_of_row]
        if k_pad != k:
            x = torch.nn.functional.pad(x, (0, k_pad - k))
        q = self.quantize(x, row_gs)
        return q.data, self._swizzle_rows(q.scale, rt), row_gs

    def _swizzle_rows(self, scale: torch.Tensor, rt: RoutingRows) -> torch.Tensor:
        """:func:`swizzle_rows_grouped` with the shared CUDA kernel on a GPU (device offsets, no host sync)."""
        if not self._gpu_primitives:
            return swizzle_rows_grouped(scale, rt)
        u8 = scale.view(torch.uint8).contiguous()
        cols = u8.shape[1]
        if rt.sf_rows >= 2**31:
            raise ValueError(f"cuda-sm100: {rt.sf_rows} scale-factor rows exceed the int32 row offsets; "
                             f"split the batch (T * k = {rt.rows})")
        prow, pcol = nvfp4.sf_padded_shape(rt.sf_rows, cols)
        out = torch.empty((prow, pcol), dtype=torch.uint8, device=u8.device)  # every byte written
        common_ext().swizzle_scales_grouped(u8, rt.row_offsets, rt.sf_row_offsets, rt.sf_rows, out,
                                            torch.cuda.current_stream(u8.device).cuda_stream)
        return out

    def moe_forward(self, prepared: PreparedSm100, cfg, x, topk_ids, topk_weights, batch_invariant: bool = True):
        """Routed experts (docs/SPEC.md §3) through two grouped GEMMs; float32 ``[T, H]``.

        Ids outside ``[0, E)`` (the mask value -1, or another rank's experts) are skipped: no
        GEMM work, no contribution (docs/SPEC.md, masked expert ids). A and D hold only the
        T * k routed rows; only the scale factors have 128-row expert blocks. No host
        synchronisation: every size below is known from ``T * top_k`` (CUDA-graph safe).

        ``batch_invariant`` changes nothing here: the glue is per row (quantization, bias,
        activation, the slot-order combine), and the plan's N tile (64 or 128 by T * k) splits no
        K, so a row's sums should not depend on its batch; tests/sm100_gpu/
        test_sm100_batch_invariance.py checks that on a Blackwell GPU (not yet run).
        """
        if cfg.act_mode == "w4a16":
            return self._reference.moe_forward(prepared.weights, cfg, x, topk_ids, topk_weights)
        with self._device_guard():
            return self._moe_forward(prepared, cfg, x, topk_ids, topk_weights)

    def _moe_forward(self, prepared: PreparedSm100, cfg, x, topk_ids, topk_weights):
        p = prepared
        t, h = x.shape
        dev = x.device
        if t == 0:  # nothing to route (and no 0-row buffers reach the launcher)
            return torch.zeros((0, h), dtype=torch.float32, device=dev)
        e = cfg.num_experts
        top_k = topk_ids.shape[1]
        inter = p.inter
        rt = routing_rows(topk_ids, e)
        rows = rt.rows
        # Compact activation: the T * k routed rows in expert order (masked slots' rows last,
        # quantized like the others and read by nothing).
        static1 = None if cfg.dynamic_act_scale else p.w13_input_scale
        a1, a1_sf, gs1 = self._quantize_rows(x[rt.token_of], p.k1, static1, rt, cfg.dynamic_act_scale)
        one = torch.ones(1, dtype=torch.float32, device=dev)
        gu = torch.empty((rows, 2 * inter), dtype=torch.float32, device=dev)  # rows of masked slots: never written
        self._grouped_gemm(rt.counts, 2, inter, p.k1, a1, a1_sf, p.w13_data, p.w13_sf,
                           one if static1 is None else static1, p.w13_gs, gu, pairs=rows)
        if static1 is None:
            gu = gu * gs1.unsqueeze(1)
        if p.b13 is not None:  # gpt-oss: the gate/up bias of each row's expert, before the activation
            gu = gu + p.b13[rt.expert_of_row]
        hmid = swiglu(gu, inter, cfg.swiglu_limit, cfg.swiglu_alpha, cfg.swiglu_up_shift)
        hmid = torch.where(rt.real.unsqueeze(1), hmid, torch.zeros((), dtype=hmid.dtype, device=dev))

        static2 = None if cfg.dynamic_act_scale else p.w2_input_scale
        a2, a2_sf, gs2 = self._quantize_rows(hmid, p.k2, static2, rt, cfg.dynamic_act_scale)
        y = torch.empty((rows, h), dtype=torch.float32, device=dev)  # rows of masked slots: never written
        self._grouped_gemm(rt.counts, 1, h, p.k2, a2, a2_sf, p.w2_data, p.w2_sf,
                           one if static2 is None else static2, p.w2_gs, y, pairs=rows)
        row_scale = None if static2 is not None else gs2
        if p.b2 is not None:  # gpt-oss: the down bias of each row's expert, before the routing weight
            y = (y if row_scale is None else y * row_scale.unsqueeze(1)) + p.b2[rt.expert_of_row]
            row_scale = None
        return combine_slots(y, rt.row_of_slot.view(t, top_k), rt.valid.view(t, top_k),
                             topk_weights.reshape(t, top_k).float(), row_scale)

    def synchronize(self) -> None:
        if self._device.type == "cuda":
            torch.cuda.synchronize(self._device)


# ---------------------------------------------------------------------------------------------
# what `megamoe selftest --backend cuda-sm100` runs after the health checks
# ---------------------------------------------------------------------------------------------

#: (label, preset, config overrides, token counts) timed by :func:`run_shapes`; "full" adds the rest
SELFTEST_SHAPES_QUICK = [
    ("v4-flash TP=8", "v4-flash", dict(hidden_size=4096, intermediate_size=256, num_experts=256, top_k=6),
     (1, 8, 64)),
]
SELFTEST_SHAPES_FULL = SELFTEST_SHAPES_QUICK + [
    ("v4-flash TP=8", "v4-flash", dict(hidden_size=4096, intermediate_size=256, num_experts=256, top_k=6),
     (4, 16, 32, 256)),
    ("v4-flash TP=1", "v4-flash", dict(hidden_size=4096, intermediate_size=2048, num_experts=256, top_k=6),
     (1, 64, 1024)),
    ("v3 TP=8", "v3", dict(intermediate_size=256), (1, 64)),
]
SHAPE_COSINE_MIN = 0.9999  # docs/SPEC.md §5: moe_vs_reference


def run_shapes(be: "CudaSm100Backend", shapes, reps: int = 20, progress=None) -> list[dict]:
    """Routed experts of each shape on ``be``: cosine against the torch backend (the same NVFP4
    math in fp32), same bits on a repeat, the N tile of each GEMM and the time per forward
    (median of ``reps``; CUDA events on a GPU). ``progress(row)`` after each shape.

    Returns one dict per (shape, T): ``shape, h, i, e, k, t, tiles, cosine, min_token_cosine,
    repeat_bits_equal, us, status`` (``pass`` when the cosines reach SHAPE_COSINE_MIN and the
    repeat is bit-identical)."""
    from megamoe.moe import MoELayer

    rows = []
    ref_be = TorchBackend(device=be.device)
    for label, preset, over, tokens in shapes:
        layer = MoELayer.from_preset(preset, seed=1, backend=be, **over)
        cfg = layer.config
        for t in tokens:
            gen = torch.Generator().manual_seed(1000 + t)
            x = torch.randn(t, cfg.hidden_size, generator=gen).to(torch.bfloat16).to(be.device)
            w, ids = layer.route(x)
            tiles = [be.tile_n_for(t * cfg.top_k, cfg.num_experts, 2, cfg.intermediate_size),
                     be.tile_n_for(t * cfg.top_k, cfg.num_experts, 1, cfg.hidden_size)]
            out = be.moe_forward(layer._prepared, cfg, x, ids, w)
            again = be.moe_forward(layer._prepared, cfg, x, ids, w)
            ref = ref_be.moe_forward(layer.weights, cfg, x, ids, w)
            cos = float(torch.nn.functional.cosine_similarity(out.double().reshape(1, -1),
                                                              ref.double().reshape(1, -1)))
            per_token = float(torch.nn.functional.cosine_similarity(out.double(), ref.double(), dim=1).min())
            times = []
            for _ in range(reps):
                if be.device.type == "cuda":
                    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    start.record()
                    be.moe_forward(layer._prepared, cfg, x, ids, w)
                    stop.record()
                    stop.synchronize()
                    times.append(start.elapsed_time(stop) * 1e3)
                else:
                    t0 = time.perf_counter()
                    be.moe_forward(layer._prepared, cfg, x, ids, w)
                    times.append((time.perf_counter() - t0) * 1e6)
            same = bool(torch.equal(out, again))
            ok = cos >= SHAPE_COSINE_MIN and per_token >= 0.999 and same and bool(torch.isfinite(out).all())
            row = dict(shape=label, h=cfg.hidden_size, i=cfg.intermediate_size, e=cfg.num_experts, k=cfg.top_k, t=t,
                       tiles=tiles, cosine=cos, min_token_cosine=per_token, repeat_bits_equal=same,
                       us=float(sorted(times)[len(times) // 2]) if times else float("nan"),
                       status="pass" if ok else "fail")
            rows.append(row)
            if progress is not None:
                progress(row)
    return rows


def format_shape_row(r: dict) -> str:
    return (f"{r['status'].upper():4s}  {r['shape']:14s} H={r['h']} I={r['i']} E={r['e']} k={r['k']} T={r['t']:<5d} "
            f"tile N {r['tiles'][0]}/{r['tiles'][1]}  cosine {r['cosine']:.7f} (min token {r['min_token_cosine']:.5f})"
            f"  repeat {'same bits' if r['repeat_bits_equal'] else 'DIFFERENT BITS'}  {r['us']:.1f} us/forward")

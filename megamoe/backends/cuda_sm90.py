"""The ``cuda-sm90`` backend: NVFP4 MoE on Hopper (H100 / H200).

Weights stay NVFP4 in device memory (the checkpoint's packed data and linear e4m3
scales, unchanged); the grouped GEMMs dequantize them in registers, exactly, to bf16 and
run bf16 tensor-core MMAs with fp32 accumulation (cpp/sm90). Pipeline of one forward,
all on the current stream with no host synchronisation (CUDA-graph capturable for a
fixed T):

1. ``moe_align``      routing results -> rows grouped by expert (one kernel)
2. L1 input           W4A16: gather + bf16; W4A4: gather + NVFP4 quantize (static
                      per-expert or per-row dynamic scale), exact e2m1*e4m3 bf16 operand
3. L1 GEMM            x @ w13^T, gate/up alphas, SiLU(gate)*up in the epilogue -> h fp32
4. L2 input           as 2, from h
5. L2 GEMM            h @ w2^T -> y fp32 per (token, expert) row
6. combine            out[t] = sum_j w[t,j] * y[row(t,j)]

Workspace grows with T (rows = T*k), never with E.

Decode chain (run 7, bench/NOTES.md): the streaming GEMMs, align, bf16 staging and combine are
launched with programmatic dependent launch (cpp/sm90/pdl.cuh), so each kernel's launch and the
L2 GEMM's weight prefetch overlap the previous kernel's tail; W4A16 with one token tile per pass
gathers x inside L1 and writes h as the bf16 L2 operand (align, L1, L2, combine: 4 kernels).
Switches (read at every forward, so a process can flip them): ``MEGAMOE_SM90_PDL=0`` (C++ side,
every launch) and ``MEGAMOE_SM90_FUSE_NT1=0`` (staging kernels again for one-tile W4A16); both
at 0 give exactly the run-6 chain. ``MEGAMOE_SM90_DECODE_PERSISTENT=1`` (C++ side, every launch; off
by default until measured) runs the one-tile decode GEMMs as a persistent grid of resident blocks
looping over (expert, row block) items with an L2 prefetch of each block's next item
(``MEGAMOE_SM90_DECODE_PREFETCH_NEXT=0``: without it); bit-identical results.
"""
from __future__ import annotations

import os
from collections import OrderedDict
from dataclasses import dataclass

import torch

from megamoe import _ext, nvfp4
from megamoe.backends.base import Backend
from megamoe.backends.cuda_common import (GS_PER_EXPERT, GS_PER_ROW_DYNAMIC, CudaCommonMixin, common_ext,
                                          current_stream)

__all__ = ["CudaSm90Backend", "PreparedSm90"]

EPILOGUE_STORE, EPILOGUE_SILU_MUL = 0, 1
KERNEL_AUTO, KERNEL_STREAM, KERNEL_TILED, KERNEL_TILED_2BLOCKS = -1, 0, 1, 2
#: wgmma (sm_90a) swap-AB kernel: 3 picks its token tile (64 or 256) from the expected tokens per
#: expert, 4 forces tiles of up to 64 tokens, 5 of up to 256, 6 of up to 128 (cpp/sm90/grouped_gemm_wgmma.cuh).
KERNEL_WGMMA, KERNEL_WGMMA_SMALL, KERNEL_WGMMA_LARGE, KERNEL_WGMMA_MID = 3, 4, 5, 6
#: warp-specialized wgmma kernel (producer warpgroup decodes NVFP4 into shared memory, consumers keep
#: wgmma in flight; cpp/sm90/grouped_gemm_wgmma_ws.cuh), token tile 256 / 128, and tile 128 with two
#: producer warpgroups. Only when forced.
KERNEL_WGMMA_WS, KERNEL_WGMMA_WS_MID, KERNEL_WGMMA_WS2_MID = 7, 8, 9
KERNEL_NAMES = {KERNEL_STREAM: "stream", KERNEL_TILED: "tiled", KERNEL_TILED_2BLOCKS: "tiled2",
                KERNEL_WGMMA: "wgmma", KERNEL_WGMMA_SMALL: "wgmma64", KERNEL_WGMMA_LARGE: "wgmma256",
                KERNEL_WGMMA_MID: "wgmma128", KERNEL_WGMMA_WS: "wgmma_ws256", KERNEL_WGMMA_WS_MID: "wgmma_ws128",
                KERNEL_WGMMA_WS2_MID: "wgmma_ws128p2"}


def _u8(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype != torch.uint8 else t


@dataclass
class PreparedSm90:
    """Device-resident NVFP4 weights as the sm90 kernels read them (no copies made)."""

    w13_data: torch.Tensor   # u8 [E, 2I, H/2]
    w13_scale: torch.Tensor  # u8 (e4m3) [E, 2I, H/16]
    w13_gs: torch.Tensor     # f32 [E, 2] (gate, up)
    w2_data: torch.Tensor    # u8 [E, H, I/2]
    w2_scale: torch.Tensor   # u8 [E, H, I/16]
    w2_gs: torch.Tensor      # f32 [E]
    w13_input_scale: torch.Tensor | None
    w2_input_scale: torch.Tensor | None


class _Workspace:
    """Buffers of one forward shape (T, H, I, k, E); reused so graph replays see fixed addresses."""

    def __init__(self, t: int, h: int, i: int, k: int, e: int, device) -> None:
        r = t * k
        i32 = dict(dtype=torch.int32, device=device)
        self.expert_offsets = torch.zeros(e + 1, **i32)
        self.active = torch.zeros(e, **i32)
        self.num_active = torch.zeros(1, **i32)
        self.row_token = torch.zeros(max(r, 1), **i32)
        self.entry_row = torch.zeros(max(r, 1), **i32)
        self.a1 = torch.empty((max(r, 1), h), dtype=torch.bfloat16, device=device)
        self.a1_rs = torch.ones(max(r, 1), dtype=torch.float32, device=device)
        self.h = torch.empty((max(r, 1), i), dtype=torch.float32, device=device)
        self.a2 = torch.empty((max(r, 1), i), dtype=torch.bfloat16, device=device)
        self.a2_rs = torch.ones(max(r, 1), dtype=torch.float32, device=device)
        self.y = torch.empty((max(r, 1), h), dtype=torch.float32, device=device)


class CudaSm90Backend(CudaCommonMixin, Backend):
    """NVFP4 MoE on compute capability 9.x (see module doc)."""

    name = "cuda-sm90"

    #: Above this many expected tokens per expert (T*k/E) the wgmma kernel runs instead of the streaming one
    #: (run 6, bench/results/moe_h200.json: v4-flash 3/expert streaming 1.30 ms vs wgmma 2.28; 12/expert
    #: streaming 4.17 ms vs wgmma 2.54; v3 4/expert 2.48 vs 4.11, 16/expert 7.85 vs 4.57). 6 is where the
    #: streaming kernel leaves its one-token-tile variant (not measured between 4 and 12 per expert).
    WGMMA_ABOVE_TOKENS_PER_EXPERT = 6

    def __init__(self, device: str | torch.device | None = None, force_kernel: int = KERNEL_AUTO,
                 tokens_per_pass: int = 0) -> None:
        self._device = torch.device(device) if device is not None else torch.device("cuda", torch.cuda.current_device())
        if self._device.type != "cuda":
            raise ValueError(f"cuda-sm90 runs on a CUDA device, got {self._device}")
        self.force_kernel = force_kernel
        self.tokens_per_pass = tokens_per_pass
        self.fuse_w4a16 = True  # W4A16: gather x inside L1 and write h as the L2 operand (no staging kernels)
        # Workspaces by batch shape, least recently used first. A service sees many token
        # counts, so only MAX_WORKSPACES stay allocated; one captured into a CUDA graph is
        # pinned (the graph replays its addresses) and never evicted.
        self._workspaces: OrderedDict[tuple, _Workspace] = OrderedDict()
        self._pinned: set[tuple] = set()

    @classmethod
    def availability(cls) -> tuple[bool, str]:
        if not torch.cuda.is_available():
            return False, "no CUDA GPU visible to torch"
        if _ext.ext is None:
            return False, _ext.EXT_ERROR or "megamoe._C is not built"
        if not (_ext.has_part("sm90") and _ext.has_part("common")):
            return False, f"megamoe._C was built without sm90 kernels (parts: {_ext.built_parts()}, " \
                          f"archs: {getattr(_ext.ext, 'cuda_archs', '?')}); rebuild with MEGAMOE_CUDA_ARCHS containing 90a"
        major, minor = torch.cuda.get_device_capability()
        if major != 9:
            return False, f"compute capability {major}.{minor}: cuda-sm90 needs 9.x (Hopper)"
        return True, ""

    @property
    def device(self) -> torch.device:
        return self._device

    def describe(self) -> dict:
        return {"backend": self.name, "device": str(self.device), "gpu": torch.cuda.get_device_name(self.device),
                "cuda_archs": getattr(_ext.ext, "cuda_archs", "")}

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)

    # ---------------------------------------------------------------- GEMM
    def _operand(self, a) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """(bf16 operand [M, K], single global scale or None, per-row global scale or None)."""
        stream = current_stream(self.device)
        if isinstance(a, nvfp4.NVFP4Tensor):
            a = a.to(self.device)
            m, k = a.data.shape[0], a.data.shape[1] * 2
            op = torch.empty((m, k), dtype=torch.bfloat16, device=self.device)
            common_ext().nvfp4_to_operand(a.data.contiguous(), _u8(a.scale).contiguous(), op, stream)
            gs = a.global_scale.to(torch.float32)
            if gs.dim() == 0:
                return op, gs.reshape(1).contiguous(), None
            return op, None, nvfp4._global_scale_rows(gs, (m,)).reshape(-1).contiguous()
        a = a.to(self.device)
        if a.dim() != 2 or a.stride(-1) != 1:
            a = a.reshape(-1, a.shape[-1]).contiguous()
        op = torch.empty(a.shape, dtype=torch.bfloat16, device=self.device)
        _ext.ext.sm90_stage_bf16(a, None, None, op, stream)
        return op, None, None

    def gemm(self, a, b: nvfp4.NVFP4Tensor, alpha=None, out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """``alpha * (a @ b^T)`` with ``b`` NVFP4 ``[N, K]`` and ``a`` NVFP4 or float ``[M, K]``."""
        b = b.to(self.device)
        if b.data.dim() != 2:
            raise ValueError(f"gemm: b must be an NVFP4 [N, K] matrix, got data {tuple(b.data.shape)}")
        n, k = b.data.shape[0], b.data.shape[1] * 2
        op, a_gs, a_rs = self._operand(a)
        if op.shape[1] != k:
            raise ValueError(f"gemm: K mismatch, a {tuple(op.shape)} vs b [{n}, {k}]")
        m = op.shape[0]
        out = torch.empty((m, n), dtype=torch.float32, device=self.device)
        gs = b.global_scale.to(torch.float32)
        parts = 1 if gs.dim() == 0 else gs.shape[-1]
        if gs.dim() > 1 or (gs.dim() == 1 and n % parts):
            raise ValueError(f"gemm: b.global_scale of shape {tuple(gs.shape)} is not supported for [N, K] weights")
        offsets = torch.tensor([0, m], dtype=torch.int32, device=self.device)
        rows = n // parts
        stream = current_stream(self.device)
        for p in range(parts):
            w_gs = (gs.reshape(1) if gs.dim() == 0 else gs[p:p + 1]).contiguous()
            sl = slice(p * rows, (p + 1) * rows)
            part_out = out if parts == 1 else torch.empty((m, rows), dtype=torch.float32, device=self.device)
            _ext.ext.sm90_grouped_gemm(op, None, offsets, None, None, 1, b.data[sl].contiguous().unsqueeze(0),
                                       _u8(b.scale[sl]).contiguous().unsqueeze(0), w_gs, a_gs, False, a_rs,
                                       EPILOGUE_STORE, None, part_out, None, m, m, self.force_kernel,
                                       self.tokens_per_pass, stream)
            if parts > 1:
                out[:, sl] = part_out
        if alpha is not None:
            out = out * torch.as_tensor(alpha, dtype=torch.float32, device=self.device)
        return out.to(out_dtype)

    # ---------------------------------------------------------------- MoE
    def prepare_weights(self, weights) -> PreparedSm90:
        dev = self.device
        w = weights
        return PreparedSm90(
            w13_data=w.w13.data.to(dev).contiguous(),
            w13_scale=_u8(w.w13.scale.to(dev)).contiguous(),
            w13_gs=w.w13.global_scale.to(dev, torch.float32).reshape(-1, 2).contiguous(),
            w2_data=w.w2.data.to(dev).contiguous(),
            w2_scale=_u8(w.w2.scale.to(dev)).contiguous(),
            w2_gs=w.w2.global_scale.to(dev, torch.float32).reshape(-1).contiguous(),
            w13_input_scale=None if w.w13_input_scale is None else w.w13_input_scale.to(dev, torch.float32).contiguous(),
            w2_input_scale=None if w.w2_input_scale is None else w.w2_input_scale.to(dev, torch.float32).contiguous(),
        )

    MAX_WORKSPACES = 8

    def workspace(self, t: int, cfg) -> _Workspace:
        key = (t, cfg.hidden_size, cfg.intermediate_size, cfg.top_k, cfg.num_experts)
        ws = self._workspaces.get(key)
        if ws is None:
            ws = _Workspace(t, cfg.hidden_size, cfg.intermediate_size, cfg.top_k, cfg.num_experts, self.device)
            self._workspaces[key] = ws
            unpinned = [k for k in self._workspaces if k not in self._pinned and k != key]
            for old in unpinned[: max(0, len(self._workspaces) - self.MAX_WORKSPACES)]:
                del self._workspaces[old]
        else:
            self._workspaces.move_to_end(key)
        if torch.cuda.is_current_stream_capturing():
            self._pinned.add(key)
        return ws

    def _stage(self, src, src_rows, ws_offsets, dst, dst_rs, cfg, static_scale, stream, rows: int):
        """Activation -> bf16 GEMM operand (W4A16) or NVFP4 decode (W4A4). Returns (a_gs, per_expert, a_rs)."""
        total = ws_offsets[-1:]
        if cfg.act_mode == "w4a16":
            _ext.ext.sm90_stage_bf16(src, src_rows, total, dst, stream)
            return None, False, None
        dynamic = cfg.dynamic_act_scale or static_scale is None
        mode = GS_PER_ROW_DYNAMIC if dynamic else GS_PER_EXPERT
        common_ext().quantize_nvfp4(src, None if dynamic else static_scale, mode,
                                    src_rows, ws_offsets, None, None, None, None, 0, dst,
                                    dst_rs if dynamic else None, stream)
        if dynamic:
            return None, False, dst_rs
        return static_scale, True, None

    def moe_forward(self, prepared: PreparedSm90, cfg, x: torch.Tensor, topk_ids: torch.Tensor,
                    topk_weights: torch.Tensor) -> torch.Tensor:
        """Routed experts of SPEC §3; returns ``[T, H]`` in x's dtype (fp32 sums, one rounding)."""
        ext = _ext.ext
        t, h = x.shape
        e, k = cfg.num_experts, cfg.top_k
        if t == 0:  # the launchers refuse an empty grid; nothing to compute
            return torch.zeros((0, h), dtype=x.dtype, device=self.device)
        if x.stride(-1) != 1:
            x = x.contiguous()
        if topk_ids.dtype not in (torch.int32, torch.int64):
            topk_ids = topk_ids.to(torch.int32)
        topk_ids = topk_ids.contiguous()
        topk_weights = topk_weights.to(torch.float32).contiguous()
        ws = self.workspace(t, cfg)
        stream = current_stream(self.device)
        r = t * k
        grid_experts = min(e, r)
        ext.sm90_moe_align(topk_ids, e, ws.expert_offsets, ws.active, ws.num_active, ws.row_token, ws.entry_row,
                           stream)
        expected = -(-r // e)  # tokens per expert under uniform routing
        kernel = self.force_kernel
        if kernel == KERNEL_AUTO:
            # KERNEL_WGMMA picks its token tile from `expected` (64 up to 32 per expert, else 128; C++ side)
            kernel = KERNEL_WGMMA if expected > self.WGMMA_ABOVE_TOKENS_PER_EXPERT else KERNEL_STREAM
        limit = cfg.swiglu_limit
        tpp = self.tokens_per_pass
        # W4A16 on the streaming kernel: the L1 GEMM gathers x itself and writes h as the
        # bf16 operand of L2, so neither activation needs a staging kernel.
        # (Not with one token tile per pass: that case runs the separate decode kernel, measured
        # faster with staged operands than the fused variant; see bench/NOTES.md.)
        # Since run 7 the one-tile (decode) kernel has a fused variant too (bit-identical results);
        # MEGAMOE_SM90_FUSE_NT1=0 brings back the staged operands there.
        one_tile = (tpp or 8 * (1 if (expected * 3 + 1) // 2 <= 8 else 2)) == 8
        fuse_nt1 = os.environ.get("MEGAMOE_SM90_FUSE_NT1", "1") != "0"
        fused = (self.fuse_w4a16 and cfg.act_mode == "w4a16" and kernel == KERNEL_STREAM
                 and x.dtype == torch.bfloat16 and (fuse_nt1 or not one_tile))

        if fused:
            a1, a1_rows, a_gs, per_e, a_rs = x, ws.row_token, None, False, None
        else:
            a_gs, per_e, a_rs = self._stage(x, ws.row_token[:r], ws.expert_offsets, ws.a1[:r], ws.a1_rs,
                                            cfg, prepared.w13_input_scale, stream, r)
            a1, a1_rows = ws.a1, None
        ext.sm90_grouped_gemm(a1, a1_rows, ws.expert_offsets, ws.active, ws.num_active, grid_experts,
                              prepared.w13_data, prepared.w13_scale, prepared.w13_gs, a_gs, per_e, a_rs,
                              EPILOGUE_SILU_MUL, limit, None if fused else ws.h, ws.a2 if fused else None,
                              expected, r, kernel, tpp, stream)
        if fused:
            a_gs, per_e, a_rs = None, False, None
        else:
            a_gs, per_e, a_rs = self._stage(ws.h[:r], None, ws.expert_offsets, ws.a2[:r], ws.a2_rs,
                                            cfg, prepared.w2_input_scale, stream, r)
        ext.sm90_grouped_gemm(ws.a2, None, ws.expert_offsets, ws.active, ws.num_active, grid_experts,
                              prepared.w2_data, prepared.w2_scale, prepared.w2_gs, a_gs, per_e, a_rs,
                              EPILOGUE_STORE, None, ws.y, None, expected, r, kernel, tpp, stream)
        out = torch.empty((t, h), dtype=x.dtype, device=self.device)
        ext.sm90_moe_combine(ws.y, ws.entry_row, topk_weights, out, stream)
        return out

    @staticmethod
    def expert_flops(cfg, t: int) -> float:
        """Multiply-add FLOPs of the routed experts for T tokens (2 per MAC)."""
        return 2.0 * t * cfg.top_k * (cfg.hidden_size * 2 * cfg.intermediate_size + cfg.intermediate_size * cfg.hidden_size)

"""The ``cuda-sm90`` backend: NVFP4 MoE on Hopper (H100 / H200).

Weights stay NVFP4 in device memory (4.5 bits per weight: the packed codes with the bits of every
32-bit word permuted once by ``prepare_weights`` into the sm90 word layout, :func:`sm90_word_layout`,
and each e4m3 block scale stored once as the byte code the kernels decode with two integer
instructions, :func:`sm90_weights`; where K % 256 == 0 and the rows come in groups of 32, the bytes of each 32
rows x 256 elements stored together, :func:`sm90_tiled`; the device's only copy of them: MoELayer keeps
its standard-layout copy in host memory, ``copies_routed_weights``); the
grouped GEMMs dequantize them in registers, exactly, to bf16 and run bf16 tensor-core MMAs with
fp32 accumulation (cpp/sm90). Pipeline of one forward,
all on the current stream with no host synchronisation (CUDA-graph capturable for a
fixed T):

1. ``moe_align``      routing results -> rows grouped by expert (one kernel); not for one token on
                      the one-tile streaming kernel (H and I multiples of 64) or wgmma tile 32 (W4A16
                      with bf16 x, or W4A4 with a static scale for h): there slot j is row j of
                      expert topk_ids[0, j], which both GEMMs read themselves, and gemm1 writes the
                      token's entry_row (3 kernels: gemm1, gemm2, combine; wgmma W4A16 4, x staged
                      first; W4A4 4, x quantized into the k rows first: row j with expert
                      topk_ids[0, j]'s static scale, or all with the row's dynamic one)
2. gemm1 input        W4A16 with bf16 x up to wgmma tile 32: none (gemm1 gathers its rows
                      through row_token: the streaming kernel from x itself, the wgmma kernel
                      from x staged once as the [T, H] bf16 operand); else bf16 per slot
                      (W4A16: TMA boxes of contiguous rows for wgmma tiles 64 and 128; from
                      TOKEN_ORDER_FROM tokens in token order: each row of x read once and
                      written to its k slots through entry_row) or gather + NVFP4 quantize
                      per slot (W4A4; static per-expert or per-row dynamic scale; from
                      TOKEN_ORDER_FROM tokens, where a token's slots quantize alike -- a
                      dynamic scale, or one static scale for every expert -- once per token
                      into its k slots), exact e2m1*e4m3 bf16 operand
3. gemm1              x @ w13^T, gate/up alphas, SiLU(gate)*up in the epilogue -> h: the bf16 gemm2
                      operand (W4A16), h quantized to NVFP4 in the epilogue and written as that
                      operand (W4A4 with static input scales), else fp32
4. gemm2 input        fp32 h only (W4A4 with the per-row dynamic scale, which needs the whole row
                      first): as 2, from h
5. gemm2              h @ w2^T -> y per (token, expert) row: bf16 when x is bf16 (the output's own
                      precision; half the bytes of the combine's input), else fp32
6. combine            out[t] = sum_j w[t,j] * y[row(t,j)] in fp32, rounded once to x's dtype

Workspace grows with T (rows = T*k), never with E.

Which kernel runs, with which token tile and how many tokens per weight pass, whether
W4A16 skips the staging kernels, the K per stage and copied rows of the wgmma kernels, whether one
token runs without the align kernel and whether the gemm1 input is staged in token order is one C++
decision, ``megamoe._C.sm90_plan`` (cpp/sm90/plan.cpp; the dispatch table is in docs/PERFORMANCE.md);
this module asks it and never re-derives it. The wgmma kernels
read their bf16 operand in lane order, the streaming kernels in operand order; ``plan.lane_order``
tells every producer of it (staging, the W4A4 quantizer's decode, the gemm1 epilogue). The streaming
GEMMs, align, bf16 staging and combine are launched with programmatic dependent launch
(cpp/sm90/pdl.cuh), so each kernel's launch and gemm2's weight prefetch overlap the
previous kernel's tail. W4A16, and W4A4 with static input scales: gemm1 writes h as the bf16 gemm2 operand
(W4A4: its NVFP4 decode, bit for bit what the quantizer makes of fp32 h). W4A16 with bf16 x up to wgmma tile
32 it gathers its rows (align, gemm1, gemm2, combine: 4 kernels with the streaming kernel, 3 for one token (W4A4: 4),
plus the one-time [T, H] staging of x with the wgmma kernel; align is two kernels above 8192 rows);
tiles 64 and 128 stage x per slot instead.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch

from megamoe import _ext, nvfp4
from megamoe.backends.base import Backend
from megamoe.backends.cuda_common import (GS_PER_EXPERT, GS_SINGLE, GS_PER_ROW_DYNAMIC, CudaCommonMixin, common_ext,
                                          current_stream, quantize_rows)

__all__ = ["CudaSm90Backend", "PreparedSm90", "sm90_scale_code", "sm90_tileable", "sm90_tiled", "sm90_untiled",
           "sm90_weights", "sm90_word_layout", "sm90_word_layout_inverse"]



# From this many tokens the per-slot gemm1 input is written in token order (each row of x read once and stored into
# its k grouped rows; W4A4 where the slots of a token quantize alike: quantized once) instead of gathered per slot
# (a token's row read, and with W4A4 quantized, k times, in expert order): the plan's token_order. The value is the
# C++ plan's (megamoe/sm90_plan.h kTokenOrderFrom); the backend passes this module attribute to every plan it asks
# for, so that a test may move it.
TOKEN_ORDER_FROM = _ext.ext.sm90_token_order_from if _ext.has_part("sm90") else None


def gemm_kernel(name) -> object:
    """``megamoe._C.Sm90GemmKernel`` member from itself or its name ("auto", "stream", "wgmma32", "wgmma64", "wgmma128")."""
    kinds = _ext.ext.Sm90GemmKernel
    if isinstance(name, kinds):
        return name
    try:
        return kinds.__members__[name]
    except KeyError:
        raise ValueError(f"unknown sm90 GEMM kernel {name!r}; one of {list(kinds.__members__)}") from None


# ---------------------------------------------------------------- weight bit layout
# The sm90 word layout of the packed weights (cpp/sm90/gemm_common.cuh, "Weight bit layout"):
# the bits of every 32-bit word (8 e2m1 codes, n0 in the low nibble) permuted so that the kernels'
# dequant_word builds the bf16x2 pairs (n_j, n_{j+4}) with 8 integer instructions. Pair j's code
# bits (magnitude bits 0..2, sign) go to its slots 6, 7, 8, 15 (n_j) and 22, 23, 24, 31 (n_{j+4});
# slot s of pair j is stored at word bit _PAIR_SOURCE[j](s), the bit that the pair's decode moves to s.
_PAIR_SLOTS = (6, 7, 8, 15, 22, 23, 24, 31)
_P3_SOURCE = {6: 3, 7: 4, 8: 0, 15: 1, 22: 19, 23: 20, 24: 16, 31: 17}  # ((w & 0x001B001B) * 0x4108) & slots
_PAIR_SOURCE = (lambda s: s, lambda s: (s + 3) % 32, lambda s: (s + 6) % 32, lambda s: _P3_SOURCE[s])


def _stored_bits() -> tuple[int, ...]:
    """``[b]``: the stored word bit that holds bit b of the NVFP4 word (code b // 4, code bit b % 4)."""
    stored = [0] * 32
    for j in range(4):
        for half, code in ((0, j), (1, j + 4)):
            for bit in range(4):
                stored[4 * code + bit] = _PAIR_SOURCE[j](_PAIR_SLOTS[4 * half + bit])
    assert sorted(stored) == list(range(32)), "the sm90 word layout must be a bit permutation"
    return tuple(stored)


SM90_STORED_BITS = _stored_bits()


def _shift_groups(dest: tuple[int, ...]) -> tuple[tuple[int, int], ...]:
    """(mask, shift) per distinct move of the bit permutation ``dest`` (bit b -> bit dest[b])."""
    groups: dict[int, int] = {}
    for b, d in enumerate(dest):
        groups[d - b] = groups.get(d - b, 0) | (1 << b)
    return tuple((mask, shift) for shift, mask in sorted(groups.items()))


_TO_SM90 = _shift_groups(SM90_STORED_BITS)
_FROM_SM90 = _shift_groups(tuple(SM90_STORED_BITS.index(b) for b in range(32)))
_LAYOUT_CHUNK_WORDS = 1 << 24


def _permute_word_bits(data: torch.Tensor, groups, name: str) -> torch.Tensor:
    """A new uint8 tensor like ``data`` with the bits of every little-endian 32-bit word moved by ``groups``."""
    if data.dtype != torch.uint8:
        raise ValueError(f"{name}: packed NVFP4 data must be uint8, got {data.dtype}")
    if data.dim() == 0 or data.shape[-1] % 4:
        raise ValueError(f"{name}: the last dimension of the packed data ({tuple(data.shape)}) must be a "
                         f"multiple of 4 bytes (K a multiple of 8)")
    src = data.contiguous().view(torch.int32).reshape(-1)
    out = torch.empty_like(src)
    for i in range(0, src.numel(), _LAYOUT_CHUNK_WORDS):
        w = src[i:i + _LAYOUT_CHUNK_WORDS].to(torch.int64) & 0xFFFFFFFF
        acc = torch.zeros_like(w)
        for mask, shift in groups:
            part = w & mask
            acc |= (part << shift) if shift >= 0 else (part >> -shift)
        out[i:i + _LAYOUT_CHUNK_WORDS] = ((acc ^ 0x80000000) - 0x80000000).to(torch.int32)  # same 32 bits, signed
    return out.view(torch.uint8).reshape(data.shape)


def sm90_word_layout(data: torch.Tensor) -> torch.Tensor:
    """Packed NVFP4 weight bytes (uint8, ``[..., K/2]``, K % 8 == 0) -> a new tensor in the sm90 word
    layout the cuda-sm90 kernels read (same shape and bytes per row; ``data`` is not modified)."""
    return _permute_word_bits(data, _TO_SM90, "sm90_word_layout")


def sm90_word_layout_inverse(data: torch.Tensor) -> torch.Tensor:
    """The inverse of :func:`sm90_word_layout` (back to the NVFP4 nibble order)."""
    return _permute_word_bits(data, _FROM_SM90, "sm90_word_layout_inverse")


def sm90_scale_rows(scale: torch.Tensor) -> torch.Tensor:
    """uint8 scale bytes ``[..., K/16]`` as rows padded with zeros to a multiple of 16 bytes (the wgmma kernels read
    them through a TMA map, whose row stride must be a 16-byte multiple; the kernels read only the first K/16)."""
    u = _u8(scale)
    pad = -u.shape[-1] % 16
    if pad:
        u = torch.nn.functional.pad(u, (0, pad))
    return u.contiguous()


# ---------------------------------------------------------------- scale code
# cpp/sm90/gemm_common.cuh, "Scale code": |scale| = 2^k (1 + f/8), k in -9..8 (the e4m3 subnormals f * 2^-9
# normalized), is stored as ((k + 9) << 3) | f, so that code * 16 + 0x7680 are the bits of bf16(|scale| * 2^119);
# 145 (bits 0x7F90) is NaN. A zero scale gets code 0: the codes of its block are zeroed instead.
SM90_SCALE_NAN_CODE = 145


def _scale_code_table() -> torch.Tensor:
    table = torch.zeros(256, dtype=torch.uint8)
    for b in range(256):
        m = b & 0x7F
        if m == 0x7F:
            table[b] = SM90_SCALE_NAN_CODE
        elif m:
            e, f = m >> 3, m & 7
            if e:
                k, frac = e - 7, f
            else:  # subnormal f * 2^-9: its leading one becomes the implicit bit
                n = f.bit_length() - 1
                k, frac = n - 9, (f << (3 - n)) & 7
            table[b] = ((k + 9) << 3) | frac
    return table


_SCALE_CODE = _scale_code_table()
_FOLD_CHUNK_BLOCKS = 1 << 24


def sm90_scale_code(scale: torch.Tensor) -> torch.Tensor:
    """e4m3 block scales (float8_e4m3fn or their uint8 bits) -> the uint8 codes the cuda-sm90 kernels decode (of
    their magnitude; :func:`sm90_weights` moves the sign of a negative scale into the codes of its block)."""
    u = _u8(scale)
    return _SCALE_CODE.to(u.device)[u.long()]


def _fold_scale_signs(data: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``data`` with the sign of every negative (non-NaN) scale moved into its block's 16 codes (each code's sign bit
    flipped) and the codes of every block with a zero scale zeroed, so that code x |scale| keeps every product's
    value; ``data`` itself when no block needs it (it is never modified)."""
    u = _u8(scale)
    if data.shape[:-1] != u.shape[:-1] or data.shape[-1] != 8 * u.shape[-1]:
        raise ValueError(f"sm90_weights: packed data {tuple(data.shape)} and scales {tuple(u.shape)} do not match "
                         f"(16 codes, 8 bytes, per scale)")
    mag = u & 0x7F
    flip = (u >= 0x80) & (mag != 0x7F)
    zero = mag == 0
    if not bool((flip | zero).any()):
        return data
    out = data.clone(memory_format=torch.contiguous_format)  # one copy, contiguous for the block view
    blocks, f, z = out.view(-1, 8), flip.reshape(-1), zero.reshape(-1)
    for i in range(0, blocks.shape[0], _FOLD_CHUNK_BLOCKS):
        sl = slice(i, i + _FOLD_CHUNK_BLOCKS)
        chunk = blocks[sl]
        chunk ^= f[sl].unsqueeze(1).to(torch.uint8) * 0x88
        chunk.masked_fill_(z[sl].unsqueeze(1), 0)
    return out


def sm90_weights(data: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed NVFP4 weights (uint8 ``[..., K/2]``) and their e4m3 scales (``[..., K/16]``) -> new tensors as the
    cuda-sm90 kernels read them: the codes in the sm90 word layout (:func:`sm90_word_layout`), negative scales' signs
    and zero scales folded into them, and the scale codes (:func:`sm90_scale_code`) in rows padded to 16 bytes
    (:func:`sm90_scale_rows`). Same bytes; every decoded weight keeps its value; the inputs are not modified."""
    if data.dtype != torch.uint8:
        raise ValueError(f"sm90_weights: packed NVFP4 data must be uint8, got {data.dtype}")
    return sm90_word_layout(_fold_scale_signs(data, scale)), sm90_scale_rows(sm90_scale_code(scale))


# The tiled order (cpp/include/megamoe/sm90_kernels.h, GroupedGemmCommon::w_tiled and sm90_weight_tile_offset): rows
# in groups of 32, K in chunks of 256 elements, the bytes of each 32 rows x 256 elements contiguous.
SM90_TILE_ROWS = 32


def sm90_tileable(rows: int, k: int, gate_up: bool = False) -> bool:
    """Whether weights of ``rows`` rows (``gate_up``: w13's gate and up halves) and reduction length ``k`` can be laid
    out in the tiled order: the C++ rule the kernels check (``megamoe._C.sm90_weights_tileable``: K a multiple of 256,
    each half's rows a multiple of 32)."""
    return bool(_ext.ext.sm90_weights_tileable(rows, k, gate_up))


def _tile_permute(t: torch.Tensor, chunk: int, forward: bool) -> torch.Tensor:
    *lead, n, b = t.shape
    if n % SM90_TILE_ROWS or b % chunk:
        raise ValueError(f"sm90_tiled: rows {n} and bytes per row {b} must be multiples of {SM90_TILE_ROWS} and "
                         f"{chunk}")
    groups, chunks = n // SM90_TILE_ROWS, b // chunk
    if forward:  # [.., groups, 32, chunks, chunk] -> [.., groups, chunks, 32, chunk]
        v = t.reshape(*lead, groups, SM90_TILE_ROWS, chunks, chunk).transpose(-3, -2)
    else:
        v = t.reshape(*lead, groups, chunks, SM90_TILE_ROWS, chunk).transpose(-3, -2)
    return v.contiguous().reshape(t.shape)


def sm90_tiled(data: torch.Tensor, scale_rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Weights as :func:`sm90_weights` makes them (codes ``[..., N, K/2]``, scale codes ``[..., N, K/16]``; K % 256
    == 0, N % 32 == 0) -> new tensors of the same shapes holding the same bytes in the tiled order: the 128 code
    bytes and 16 scale bytes of each row's 256-element chunk c, for the rows of each group of 32, stored together
    (group g: its chunk 0 for rows 32g..32g+31, then chunk 1, ...), so that one stage of a kernel's weight rows is
    whole 4 KB runs of memory."""
    if data.shape[-1] % 128 or scale_rows.shape[-1] * 8 != data.shape[-1] or data.shape[:-1] != scale_rows.shape[:-1]:
        raise ValueError(f"sm90_tiled: codes {tuple(data.shape)} and scale rows {tuple(scale_rows.shape)} are not "
                         f"[..., N, K/2] and [..., N, K/16] with K % 256 == 0")
    return _tile_permute(data, 128, True), _tile_permute(_u8(scale_rows), 16, True)


def sm90_untiled(data: torch.Tensor, scale_rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse of :func:`sm90_tiled`."""
    return _tile_permute(data, 128, False), _tile_permute(_u8(scale_rows), 16, False)


def _u8(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype != torch.uint8 else t


@dataclass
class PreparedSm90:
    """Device-resident NVFP4 weights as the sm90 kernels read them (:func:`sm90_weights`, made once by
    ``prepare_weights`` into new tensors: the caller's weights are not modified): the packed data in the sm90 word
    layout, the scale codes in rows padded to 16 bytes, the global scales as given."""

    w13_data: torch.Tensor   # u8 [E, 2I, H/2], sm90 word layout
    w13_scale: torch.Tensor  # u8 scale codes [E, 2I, H/16 padded to a multiple of 16]
    w13_gs: torch.Tensor     # f32 [E, 2] (gate, up)
    w2_data: torch.Tensor    # u8 [E, H, I/2], sm90 word layout
    w2_scale: torch.Tensor   # u8 scale codes [E, H, I/16 padded to a multiple of 16]
    w2_gs: torch.Tensor      # f32 [E]
    w13_input_scale: torch.Tensor | None
    w2_input_scale: torch.Tensor | None
    # every expert's gemm1 input scale is the same value (e.g. a checkpoint loaded with input_scales="max"): a token's
    # NVFP4 gemm1 input is then the same in all its k slots, so from TOKEN_ORDER_FROM tokens it is quantized once
    w13_input_scale_uniform: bool = False
    b13: torch.Tensor | None = None  # f32 [E, 2I] expert gate/up bias (gpt-oss), added in gemm1's epilogue
    b2: torch.Tensor | None = None   # f32 [E, H] expert down bias, added in gemm2's epilogue (before the weight)
    # the data and scale codes in the tiled order (sm90_tiled), where the shape allows it (sm90_tileable)
    w13_tiled: bool = False
    w2_tiled: bool = False


def one_value(t: torch.Tensor | None) -> bool:
    """Whether t holds one value in every element (False for None or empty; NaN is never equal)."""
    return t is not None and t.numel() > 0 and bool((t == t.flatten()[0]).all())


class _Workspace:
    """Buffers of one forward shape (T, H, I, k, E); reused so graph replays see fixed addresses."""

    def __init__(self, t: int, h: int, i: int, k: int, e: int, device) -> None:
        r = max(t * k, 1)
        self.device = device
        i32 = dict(dtype=torch.int32, device=device)
        self.expert_offsets = torch.zeros(e + 1, **i32)
        self.active = torch.zeros(e, **i32)
        self.num_active = torch.zeros(1, **i32)
        self.row_token = torch.zeros(r, **i32)
        self.entry_row = torch.zeros(r, **i32)
        self.token0_rows = torch.zeros(k, **i32)  # one token's row_token (the slots' rows without the align kernel)
        self.token0_slots = torch.arange(k, **i32)  # one token's k operand rows (its entry_row without dropped slots)
        self.a2 = torch.empty((r, i), dtype=torch.bfloat16, device=device)
        # allocated on first use (only some paths need each), then kept: fixed addresses for graphs
        scratch = max(1, _ext.ext.sm90_align_scratch_size(t * k, e))
        self._shapes = {"align_scratch": ((scratch,), torch.int32), "x_op": ((max(t, 1), h), torch.bfloat16),
                        "a1": ((r, h), torch.bfloat16),
                        "a1_rs": ((r,), torch.float32), "h": ((r, i), torch.float32), "a2_rs": ((r,), torch.float32),
                        "y": ((r, h), torch.float32), "y16": ((r, h), torch.bfloat16)}

    def __getattr__(self, name: str) -> torch.Tensor:
        """First use of a buffer: allocate it and keep it as a plain attribute (later reads do not come here)."""
        shapes = self.__dict__.get("_shapes", {})
        if name not in shapes:
            raise AttributeError(name)
        shape, dtype = shapes[name]
        make = torch.ones if name.endswith("_rs") else torch.empty
        buf = make(shape, dtype=dtype, device=self.device)
        setattr(self, name, buf)
        return buf


class CudaSm90Backend(CudaCommonMixin, Backend):
    """NVFP4 MoE on compute capability 9.x (see module doc)."""

    name = "cuda-sm90"
    copies_routed_weights = True  # the packed data in the sm90 word layout (prepare_weights)
    expert_bias_and_activation = True  # b13 / b2 and swiglu_alpha / swiglu_up_shift in the GEMM epilogues (gpt-oss)

    def __init__(self, device: str | torch.device | None = None, kernel: str = "auto", tokens_per_pass: int = 0) -> None:
        """``kernel``/``tokens_per_pass``: an explicit choice for benchmarks and tests ("auto"/0: the plan's)."""
        self._device = torch.device(device) if device is not None else torch.device("cuda", torch.cuda.current_device())
        if self._device.type != "cuda":
            raise ValueError(f"cuda-sm90 runs on a CUDA device, got {self._device}")
        self.kernel = kernel
        self.tokens_per_pass = tokens_per_pass
        # Workspaces by batch shape, least recently used first. A service sees many token
        # counts, so only MAX_WORKSPACES stay allocated; one captured into a CUDA graph is
        # pinned (the graph replays its addresses) and never evicted.
        self._workspaces: OrderedDict[tuple, _Workspace] = OrderedDict()
        self._pinned: set[tuple] = set()
        self._plans: dict[tuple, object] = {}

    def plan(self, tokens_per_expert: int, k_gemm1: int, k_gemm2: int, num_experts: int, w4a16: bool,
             gather_input: bool, h_static_scale: bool = False, tokens: int = 0, slots_quantize_alike: bool = True,
             batch_invariant: bool = True):
        """The C++ dispatch plan (``megamoe._C.sm90_plan``) with this backend's explicit choices; cached. ``tokens``:
        T of a MoE forward (the one-token path and the token order need it). ``batch_invariant``: no streaming
        decode where the wgmma kernels can run (GemmProblem::batch_invariant)."""
        key = (tokens_per_expert, k_gemm1, k_gemm2, num_experts, w4a16, gather_input, h_static_scale, tokens,
               slots_quantize_alike, TOKEN_ORDER_FROM, str(self.kernel), self.tokens_per_pass, batch_invariant)
        plan = self._plans.get(key)
        if plan is None:
            plan = _ext.ext.sm90_plan(tokens_per_expert=tokens_per_expert, k_gemm1=k_gemm1, k_gemm2=k_gemm2,
                                      num_experts=num_experts, w4a16=w4a16, gather_input=gather_input, kernel=gemm_kernel(self.kernel),
                                      tokens_per_pass=self.tokens_per_pass, h_static_scale=h_static_scale,
                                      tokens=tokens, slots_quantize_alike=slots_quantize_alike,
                                      token_order_from=TOKEN_ORDER_FROM, batch_invariant=batch_invariant)
            if len(self._plans) > 256:
                self._plans.clear()
            self._plans[key] = plan
        return plan

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
    def _operand(self, a, lane_order: bool) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """(bf16 operand [M, K] in operand or lane order, single global scale or None, per-row global scale or None)."""
        stream = current_stream(self.device)
        if isinstance(a, nvfp4.NVFP4Tensor):
            a = a.to(self.device)
            m, k = a.data.shape[0], a.data.shape[1] * 2
            op = torch.empty((m, k), dtype=torch.bfloat16, device=self.device)
            common_ext().nvfp4_to_operand(a.data.contiguous(), _u8(a.scale).contiguous(), op, stream,
                                          lane_order=lane_order)
            gs = a.global_scale.to(torch.float32)
            if gs.dim() == 0:
                return op, gs.reshape(1).contiguous(), None
            return op, None, nvfp4._global_scale_rows(gs, (m,)).reshape(-1).contiguous()
        a = a.to(self.device)
        if a.dim() != 2 or a.stride(-1) != 1:
            a = a.reshape(-1, a.shape[-1]).contiguous()
        op = torch.empty(a.shape, dtype=torch.bfloat16, device=self.device)
        _ext.ext.sm90_stage_bf16(a, None, None, op, stream, lane_order=lane_order)
        return op, None, None

    def gemm(self, a, b: nvfp4.NVFP4Tensor, alpha=None, out_dtype: torch.dtype = torch.float32,
             out: torch.Tensor | None = None) -> torch.Tensor:
        """``alpha * (a @ b^T)`` with ``b`` NVFP4 ``[N, K]`` and ``a`` NVFP4 or float ``[M, K]``.

        ``out``: optional float32 ``[M, N]`` device tensor that receives the product (alpha None, float32 only).
        """
        b = b.to(self.device)
        if b.data.dim() != 2:
            raise ValueError(f"gemm: b must be an NVFP4 [N, K] matrix, got data {tuple(b.data.shape)}")
        n, k = b.data.shape[0], b.data.shape[1] * 2
        a_k = a.data.shape[-1] * 2 if isinstance(a, nvfp4.NVFP4Tensor) else a.shape[-1]
        if a_k != k:
            raise ValueError(f"gemm: K mismatch, a has K = {a_k} vs b [{n}, {k}]")
        m = a.data.shape[0] if isinstance(a, nvfp4.NVFP4Tensor) else (a.numel() // a_k if a_k else 0)
        # one expert, operand staged here; a row's result independent of M (no streaming kernel for small M)
        plan = self.plan(m, k, k, 1, w4a16=True, gather_input=False)
        op, a_gs, a_rs = self._operand(a, plan.lane_order)
        if out is not None:
            if alpha is not None or out_dtype != torch.float32 or out.dtype != torch.float32 or \
                    tuple(out.shape) != (m, n) or not out.is_contiguous() or out.device != self.device:
                raise ValueError(f"gemm: out must be a contiguous float32 [{m}, {n}] tensor on {self.device} "
                                 f"(and alpha None), got {out.dtype} {tuple(out.shape)} on {out.device}")
        else:
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
            w_data, w_scale = sm90_weights(b.data[sl], b.scale[sl])
            _ext.ext.sm90_grouped_gemm(act=op, expert_offsets=offsets, grid_experts=1,
                                       w_data=w_data.unsqueeze(0), w_scale=w_scale.unsqueeze(0), w_global_scale=w_gs,
                                       a_global_scale=a_gs, a_row_scale=a_rs, epilogue=_ext.ext.Sm90Epilogue.store,
                                       out=part_out, max_total_rows=m, plan=plan, stream=stream)
            if parts > 1:
                out[:, sl] = part_out
        if alpha is not None:
            out = out * torch.as_tensor(alpha, dtype=torch.float32, device=self.device)
        return out.to(out_dtype)

    # ---------------------------------------------------------------- MoE
    def prepare_weights(self, weights) -> PreparedSm90:
        dev = self.device
        w = weights
        in1 = None if w.w13_input_scale is None else w.w13_input_scale.to(dev, torch.float32).contiguous()
        w13_data, w13_scale = sm90_weights(w.w13.data.to(dev), w.w13.scale.to(dev))
        w2_data, w2_scale = sm90_weights(w.w2.data.to(dev), w.w2.scale.to(dev))
        hidden, inter = w13_data.shape[-1] * 2, w2_data.shape[-1] * 2
        w13_tiled = sm90_tileable(w13_data.shape[-2], hidden, gate_up=True)
        w2_tiled = sm90_tileable(w2_data.shape[-2], inter)
        if w13_tiled:
            w13_data, w13_scale = sm90_tiled(w13_data, w13_scale)
        if w2_tiled:
            w2_data, w2_scale = sm90_tiled(w2_data, w2_scale)
        return PreparedSm90(
            w13_data=w13_data,
            w13_scale=w13_scale,
            w13_gs=w.w13.global_scale.to(dev, torch.float32).reshape(-1, 2).contiguous(),
            w2_data=w2_data,
            w2_scale=w2_scale,
            w2_gs=w.w2.global_scale.to(dev, torch.float32).reshape(-1).contiguous(),
            w13_input_scale=in1,
            w2_input_scale=None if w.w2_input_scale is None else w.w2_input_scale.to(dev, torch.float32).contiguous(),
            w13_input_scale_uniform=one_value(in1),
            b13=None if w.b13 is None else w.b13.to(dev, torch.float32).contiguous(),
            b2=None if w.b2 is None else w.b2.to(dev, torch.float32).contiguous(),
            w13_tiled=w13_tiled,
            w2_tiled=w2_tiled,
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

    def _stage(self, src, src_rows, ws_offsets, dst, dst_rs, cfg, static_scale, stream, lane_order: bool,
               dst_rows=None):
        """Activation -> bf16 GEMM operand (W4A16) or NVFP4 decode (W4A4), in the plan's order.

        Grouped row r reads row ``src_rows[r]`` of src (or r); with ``dst_rows`` (moe_align's entry_row) in token
        order instead: row t of src goes to rows ``dst_rows[t * k + j]`` (W4A4: quantized once, with the per-row
        dynamic scale or the experts' one static scale). Returns (a_gs, per_expert, a_rs)."""
        total = ws_offsets[-1:]
        if cfg.act_mode == "w4a16":
            if dst_rows is not None:
                _ext.ext.sm90_scatter_bf16(src, dst_rows, cfg.top_k, dst, stream, lane_order=lane_order)
            else:
                _ext.ext.sm90_stage_bf16(src, src_rows, total, dst, stream, lane_order=lane_order)
            return None, False, None
        dynamic = self._dynamic_scale(cfg, static_scale)
        if dst_rows is not None:  # every slot of a token gets the same quantization (see _token_order)
            quantize_rows(src, global_scale=None if dynamic else static_scale[:1],
                          gs_mode=GS_PER_ROW_DYNAMIC if dynamic else GS_SINGLE, dequant=dst,
                          row_scale_out=dst_rs if dynamic else None, stream=stream, dequant_lane_order=lane_order,
                          scatter_rows=dst_rows, scatter_k=cfg.top_k)
        else:
            quantize_rows(src, global_scale=None if dynamic else static_scale,
                          gs_mode=GS_PER_ROW_DYNAMIC if dynamic else GS_PER_EXPERT, src_rows=src_rows,
                          expert_offsets=ws_offsets, dequant=dst, row_scale_out=dst_rs if dynamic else None,
                          stream=stream, dequant_lane_order=lane_order)
        if dynamic:
            return None, False, dst_rs
        return static_scale, True, None

    def moe_forward(self, prepared: PreparedSm90, cfg, x: torch.Tensor, topk_ids: torch.Tensor,
                    topk_weights: torch.Tensor, batch_invariant: bool = True) -> torch.Tensor:
        """Routed experts of docs/SPEC.md §3; returns ``[T, H]`` in x's dtype (fp32 sums; with bf16 x each expert's
        output row is rounded to bf16 before the weighted sum, the precision of the result). ``batch_invariant``
        (default): the plan runs one kernel family at every T (no streaming decode where the wgmma kernels can run),
        so a row's bits do not depend on its batch; False: the measured fastest kernel per T."""
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
        expected = -(-r // e)  # tokens per expert under uniform routing
        w4a16 = cfg.act_mode == "w4a16"
        # W4A4 with a static scale for h: gemm1 quantizes h in its epilogue (plan.h_operand), no kernel between the GEMMs
        h_static = not w4a16 and not self._dynamic_scale(cfg, prepared.w2_input_scale)
        plan = self.plan(expected, h, cfg.intermediate_size, e, w4a16, x.dtype == torch.bfloat16, h_static, t,
                         self._slots_quantize_alike(prepared, cfg), batch_invariant)
        if self._without_align(plan):
            return self._one_token(prepared, cfg, x, topk_ids, topk_weights, ws, plan, stream)
        ext.sm90_moe_align(topk_ids, e, ws.expert_offsets, ws.active, ws.num_active, ws.row_token, ws.entry_row,
                           stream, scratch=ws.align_scratch)  # (the launcher picks one or several blocks)
        # offsets_settled: a kernel (gemm1: the staging or quantizing of its input; gemm2: gemm1) lies between the
        # align kernel and each GEMM, so its wgmma kernel may read them before its programmatic-dependent-launch wait
        common = dict(expert_offsets=ws.expert_offsets, active_experts=ws.active, num_active=ws.num_active,
                      grid_experts=grid_experts, max_total_rows=r, plan=plan, stream=stream, offsets_settled=True)
        if plan.gather_x:
            a1_rows, a_gs, per_e, a_rs = ws.row_token, None, False, None
            if plan.kernel == ext.Sm90GemmKernel.stream:
                a1 = x  # the streaming kernel reads the rows of bf16 x itself
            else:  # one operand row per token (not per slot); the wgmma gemm1 gathers them through row_token
                a1 = ws.x_op[:t]
                ext.sm90_stage_bf16(x, None, None, a1, stream, lane_order=plan.lane_order)
        else:
            token_order = plan.token_order
            a_gs, per_e, a_rs = self._stage(x, None if token_order else ws.row_token[:r], ws.expert_offsets,
                                            ws.a1[:r], ws.a1_rs, cfg, prepared.w13_input_scale, stream,
                                            plan.lane_order, dst_rows=ws.entry_row[:r] if token_order else None)
            a1, a1_rows = ws.a1, None
        ext.sm90_grouped_gemm(act=a1, act_rows=a1_rows, w_data=prepared.w13_data, w_scale=prepared.w13_scale,
                              w_tiled=prepared.w13_tiled, w_global_scale=prepared.w13_gs, a_global_scale=a_gs,
                              a_gs_per_expert=per_e, a_row_scale=a_rs, **self._gemm1_epilogue(prepared, cfg),
                              out=None if plan.h_operand else ws.h, out_operand=ws.a2 if plan.h_operand else None,
                              h_quant_scale=prepared.w2_input_scale if plan.h_operand and not w4a16 else None,
                              **common)
        if plan.h_operand:  # W4A16: bf16 h; W4A4: h quantized with the experts' static scales (gemm2's alpha)
            a_gs, per_e, a_rs = (None, False, None) if w4a16 else (prepared.w2_input_scale, True, None)
        else:
            a_gs, per_e, a_rs = self._stage(ws.h[:r], None, ws.expert_offsets, ws.a2[:r], ws.a2_rs,
                                            cfg, prepared.w2_input_scale, stream, plan.lane_order)
        y = ws.y16 if x.dtype == torch.bfloat16 else ws.y  # fp16 / fp32 x: fp32 rows (more than bf16's precision)
        ext.sm90_grouped_gemm(act=ws.a2, w_data=prepared.w2_data, w_scale=prepared.w2_scale, w_tiled=prepared.w2_tiled,
                              w_global_scale=prepared.w2_gs, a_global_scale=a_gs, a_gs_per_expert=per_e, a_row_scale=a_rs,
                              epilogue=ext.Sm90Epilogue.store, bias=prepared.b2, out=y, **common)
        out = torch.empty((t, h), dtype=x.dtype, device=self.device)
        ext.sm90_moe_combine(y, ws.entry_row, topk_weights, out, stream)
        return out

    @staticmethod
    def _gemm1_epilogue(prepared: PreparedSm90, cfg) -> dict:
        """gemm1's epilogue: h = (up + shift) * gate * sigmoid(alpha * gate) of the biased, clamped gate and up
        (megamoe.reference.swiglu; SwiGLU for alpha 1, shift 0)."""
        return dict(epilogue=_ext.ext.Sm90Epilogue.silu_mul, swiglu_limit=cfg.swiglu_limit, bias=prepared.b13,
                    swiglu_alpha=cfg.swiglu_alpha, swiglu_up_shift=cfg.swiglu_up_shift)

    @staticmethod
    def _without_align(plan) -> bool:
        """Whether the forward runs without the align kernel (_one_token): the plan's without_align (one token on the
        one-tile streaming kernel, H and I multiples of 64, or on wgmma tile 32; W4A16 with bf16 x, or W4A4 with h
        quantized in gemm1)."""
        return plan.without_align

    def _one_token(self, prepared: PreparedSm90, cfg, x, topk_ids, topk_weights, ws, plan, stream) -> torch.Tensor:
        """One token on the one-tile streaming kernel or wgmma tile 32, without the align kernel: slot j of the grid is
        row j, of expert topk_ids[0, j] (no row when that id is dropped). W4A16: gemm1 gathers x's row through
        token0_rows (wgmma: x staged once in lane order first); W4A4: x's row is quantized into row j first (a static
        scale: expert topk_ids[0, j]'s; the dynamic one: once for all k rows), and gemm1 quantizes h. gemm1 writes h
        as the gemm2 operand and the token's entry_row; gemm2 writes the y rows, the combine kernel sums them (the same
        sums and roundings as the align path: bit for bit its output)."""
        ext = _ext.ext
        k = cfg.top_k
        # offsets_settled: the ids were complete before the kernel ahead of each GEMM started (the staging or
        # quantizing of x waits for whatever wrote them), so a wgmma GEMM's blocks read them before their PDL wait
        slots = dict(slot_experts=topk_ids.view(-1), grid_experts=k, max_total_rows=k, plan=plan, stream=stream,
                     offsets_settled=True)
        gemm1 = dict(w_data=prepared.w13_data, w_scale=prepared.w13_scale, w_tiled=prepared.w13_tiled,
                     w_global_scale=prepared.w13_gs,
                     **self._gemm1_epilogue(prepared, cfg), out_operand=ws.a2,
                     entry_row_out=ws.entry_row, **slots)
        if cfg.act_mode == "w4a16":
            a1 = x
            if plan.kernel != ext.Sm90GemmKernel.stream:  # the wgmma kernels read lane-order rows
                a1 = ws.x_op[:1]
                ext.sm90_stage_bf16(x, None, None, a1, stream, lane_order=plan.lane_order)
            ext.sm90_grouped_gemm(act=a1, act_rows=ws.token0_rows, **gemm1)
            a2_gs = None
        else:
            static_scale = prepared.w13_input_scale
            if self._dynamic_scale(cfg, static_scale):
                a_gs, per_e, a_rs = self._stage(x, None, ws.expert_offsets, ws.a1[:k], ws.a1_rs, cfg, static_scale,
                                                stream, plan.lane_order, dst_rows=ws.token0_slots)
            else:
                quantize_rows(x, global_scale=static_scale, gs_mode=GS_PER_EXPERT, src_rows=ws.token0_rows,
                              dequant=ws.a1, stream=stream, dequant_lane_order=plan.lane_order,
                              row_experts=topk_ids.view(-1))
                a_gs, per_e, a_rs = static_scale, True, None
            ext.sm90_grouped_gemm(act=ws.a1, a_global_scale=a_gs, a_gs_per_expert=per_e, a_row_scale=a_rs,
                                  h_quant_scale=prepared.w2_input_scale, **gemm1)
            a2_gs = prepared.w2_input_scale
        y = ws.y16 if x.dtype == torch.bfloat16 else ws.y
        ext.sm90_grouped_gemm(act=ws.a2, w_data=prepared.w2_data, w_scale=prepared.w2_scale, w_tiled=prepared.w2_tiled,
                              w_global_scale=prepared.w2_gs, a_global_scale=a2_gs, a_gs_per_expert=a2_gs is not None,
                              epilogue=ext.Sm90Epilogue.store, bias=prepared.b2, out=y, **slots)
        out = torch.empty((1, x.shape[1]), dtype=x.dtype, device=x.device)
        ext.sm90_moe_combine(y, ws.entry_row, topk_weights, out, stream)
        return out

    @staticmethod
    def _dynamic_scale(cfg, static_scale: torch.Tensor | None) -> bool:
        """W4A4: whether the activations take the per-row dynamic global scale (asked for, or no static scale)."""
        return cfg.dynamic_act_scale or static_scale is None

    @staticmethod
    def _slots_quantize_alike(prepared: PreparedSm90, cfg) -> bool:
        """Whether all k slots of a token take the same gemm1 input: W4A16, and W4A4 with a per-row dynamic scale or
        one static scale for every expert (GemmProblem::slots_quantize_alike)."""
        return (cfg.act_mode == "w4a16" or CudaSm90Backend._dynamic_scale(cfg, prepared.w13_input_scale)
                or prepared.w13_input_scale_uniform)

    @staticmethod
    def _token_order(prepared: PreparedSm90, cfg, t: int) -> bool:
        """The plan's token_order for a forward of t tokens of this layer: whether the per-slot gemm1 input is written
        in token order (each row of x read once and stored into the token's k slots through entry_row) rather than
        gathered slot by slot."""
        return _ext.ext.sm90_plan(tokens_per_expert=-(-t * cfg.top_k // cfg.num_experts), k_gemm1=cfg.hidden_size,
                                  k_gemm2=cfg.intermediate_size, num_experts=cfg.num_experts,
                                  w4a16=cfg.act_mode == "w4a16", gather_input=False, tokens=t,
                                  slots_quantize_alike=CudaSm90Backend._slots_quantize_alike(prepared, cfg),
                                  token_order_from=TOKEN_ORDER_FROM).token_order

    @staticmethod
    def expert_flops(cfg, t: int) -> float:
        """Multiply-add FLOPs of the routed experts for T tokens (2 per MAC)."""
        return 2.0 * t * cfg.top_k * (cfg.hidden_size * 2 * cfg.intermediate_size + cfg.intermediate_size * cfg.hidden_size)

"""NVFP4: the number format, the scale-factor layout, and the reference math.

This module is THE reference (docs/SPEC.md §1-§2): every backend, test and health check
compares against it, and no other copy of this math exists in the project.

Format (docs/SPEC.md §1): a tensor of logical shape ``[..., K]`` (K a multiple of 16) is

* ``data``  uint8 ``[..., K/2]``: two E2M1 codes per byte, element ``2i`` in the low nibble;
* ``scale`` float8_e4m3fn ``[..., K/16]``: one block scale per 16 consecutive elements;
* ``global_scale`` float32: multiplies on decode (ModelOpt convention). Shape ``[]``
  (one scale), ``lead`` (one per leading index, e.g. per expert) or ``(*lead, P)``
  (P row groups of equal size per leading index; ``w13`` uses P=2: gate rows, up rows).

Decoding is exact: ``x = e2m1(code) * float(scale) * global_scale``.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = [
    "E2M1_VALUES",
    "NVFP4Tensor",
    "default_global_scale",
    "quantize",
    "dequantize",
    "e2m1_encode",
    "e2m1_decode",
    "pack_codes",
    "unpack_codes",
    "sf_offset",
    "sf_padded_shape",
    "swizzle_scales",
    "unswizzle_scales",
    "swizzle_scales_grouped",
    "unswizzle_scales_grouped",
    "grouped_row_offsets",
    "verify_sf_roundtrip",
    "gemm",
    "FP4_MAX",
    "FP8_MAX",
]

FP4_MAX = 6.0
FP8_MAX = 448.0
BLOCK = 16

#: Value of each 4-bit E2M1 code (bit 3 is the sign).
E2M1_VALUES = torch.tensor(
    [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
    dtype=torch.float32,
)


@dataclass
class NVFP4Tensor:
    """An NVFP4 tensor of logical shape ``shape`` = ``[..., K]``.

    Attributes:
        data: uint8 ``[..., K/2]``, packed E2M1 codes (low nibble first).
        scale: float8_e4m3fn ``[..., K/16]``, linear (row-major) block scales.
        global_scale: float32, shape ``[]``, ``lead`` or ``(*lead, P)`` (see module doc).
    """

    data: torch.Tensor
    scale: torch.Tensor
    global_scale: torch.Tensor

    def __post_init__(self) -> None:
        if self.data.dtype != torch.uint8:
            raise TypeError(f"NVFP4Tensor.data must be uint8, got {self.data.dtype}")
        if self.scale.dtype != torch.float8_e4m3fn:
            raise TypeError(f"NVFP4Tensor.scale must be float8_e4m3fn, got {self.scale.dtype}")
        if self.data.shape[:-1] != self.scale.shape[:-1] or self.data.shape[-1] * 2 != self.scale.shape[-1] * BLOCK:
            raise ValueError(
                f"NVFP4Tensor: data {tuple(self.data.shape)} and scale {tuple(self.scale.shape)} disagree "
                f"(expected scale [..., K/16] for data [..., K/2])"
            )
        if not torch.is_tensor(self.global_scale):
            self.global_scale = torch.tensor(float(self.global_scale), dtype=torch.float32)
        if self.global_scale.dtype != torch.float32:
            raise TypeError(f"NVFP4Tensor.global_scale must be float32, got {self.global_scale.dtype}")
        _global_scale_rows(self.global_scale, tuple(self.data.shape[:-1]))  # validates the shape

    @property
    def shape(self) -> torch.Size:
        """Logical shape ``[..., K]``."""
        return torch.Size((*self.data.shape[:-1], self.data.shape[-1] * 2))

    @property
    def device(self) -> torch.device:
        return self.data.device

    def to(self, device) -> "NVFP4Tensor":
        return NVFP4Tensor(self.data.to(device), self.scale.to(device), self.global_scale.to(device))

    def __getitem__(self, idx) -> "NVFP4Tensor":
        """Index the leading (expert) dimension: ``w13[e]`` is expert e's ``[2I, H]`` NVFP4 matrix."""
        if self.data.dim() < 3:
            raise IndexError("only NVFP4 tensors with a leading batch dimension can be indexed")
        gs = self.global_scale if self.global_scale.dim() == 0 else self.global_scale[idx]
        return NVFP4Tensor(self.data[idx], self.scale[idx], gs)

    def nbytes(self) -> int:
        """Bytes of data and scales (what a kernel streams)."""
        return self.data.numel() + self.scale.numel()


def _global_scale_rows(gs: torch.Tensor, lead: tuple[int, ...]) -> torch.Tensor:
    """Return ``gs`` broadcastable to ``(*lead, 1)``: one value per row of the tensor.

    ``lead`` is the shape of everything but the last dimension (``(*batch, N)``).
    """
    if gs.dim() == 0:
        return gs.reshape([1] * (len(lead) + 1))
    if len(lead) >= 1 and tuple(gs.shape) == lead[:-1]:
        return gs.reshape(*lead[:-1], 1, 1)
    if len(lead) >= 1 and tuple(gs.shape[:-1]) == lead[:-1]:
        groups, rows = gs.shape[-1], lead[-1]
        if groups == 0 or rows % groups:
            raise ValueError(f"global_scale {tuple(gs.shape)}: {rows} rows cannot split into {groups} groups")
        return gs.repeat_interleave(rows // groups, dim=-1).unsqueeze(-1)
    raise ValueError(
        f"global_scale of shape {tuple(gs.shape)} does not fit a tensor with rows {lead}: expected [], "
        f"{list(lead[:-1])} or {list(lead[:-1]) + ['P']}"
    )


def default_global_scale(x: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """``amax(|x|) / (6 * 448)`` as float32 (1.0 where the amax is 0); NaN is ignored.

    ``dim=None``: one scale for the whole tensor; ``dim=-1``: one per row (dynamic
    activation scales).
    """
    xa = x.detach().float().abs()
    xa = torch.where(torch.isnan(xa), torch.zeros_like(xa), xa)
    if dim is None:
        amax = xa.amax() if xa.numel() else torch.zeros((), device=x.device)
    else:
        amax = xa.amax(dim=dim)
    amax = amax.to(torch.float32)
    gs = amax / torch.tensor(FP4_MAX * FP8_MAX, dtype=torch.float32, device=amax.device)
    return torch.where(amax > 0, gs, torch.ones_like(gs))


def e2m1_encode(v: torch.Tensor) -> torch.Tensor:
    """Round float32 ``v`` to the nearest E2M1 code (ties to even, saturating at ±6).

    NaN encodes as 0; the sign bit is set only for a non-zero magnitude, so -0 and
    values that round to zero are code 0. Returns uint8 codes in [0, 15].
    """
    a = v.abs()
    # Midpoints between 0, .5, 1, 1.5, 2, 3, 4, 6; '>' where the lower neighbour's code is
    # even (ties go down), '>=' where the upper neighbour's code is even (ties go up).
    mag = (
        (a > 0.25).to(torch.uint8)
        + (a >= 0.75)
        + (a > 1.25)
        + (a >= 1.75)
        + (a > 2.5)
        + (a >= 3.5)
        + (a > 5.0)
    ).to(torch.uint8)
    sign = ((v < 0) & (mag > 0)).to(torch.uint8) << 3
    return mag | sign


def e2m1_decode(codes: torch.Tensor) -> torch.Tensor:
    """Float32 value of each E2M1 code (uint8 in [0, 15])."""
    return E2M1_VALUES.to(codes.device)[codes.long()]


def pack_codes(codes: torch.Tensor) -> torch.Tensor:
    """``[..., K]`` codes -> ``[..., K/2]`` bytes, element 2i in the low nibble."""
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).to(torch.uint8)


def unpack_codes(data: torch.Tensor) -> torch.Tensor:
    """``[..., K/2]`` bytes -> ``[..., K]`` codes."""
    return torch.stack((data & 0xF, data >> 4), dim=-1).reshape(*data.shape[:-1], data.shape[-1] * 2)


def quantize(x: torch.Tensor, global_scale: torch.Tensor | float | None = None) -> NVFP4Tensor:
    """Quantize ``x`` ``[..., K]`` (any float dtype) to NVFP4 (docs/SPEC.md §1).

    Args:
        x: float tensor, K a multiple of 16.
        global_scale: decode multiplier; shape ``[]``, ``lead`` or ``(*lead, P)``
            (see :class:`NVFP4Tensor`). Default: :func:`default_global_scale` of ``x``.

    Every step is one float32 operation in the order of docs/SPEC.md §1, so that GPU
    quantizers can (and must) reproduce the bytes exactly.
    """
    if not torch.is_floating_point(x):
        raise TypeError(f"quantize expects a floating-point tensor, got {x.dtype}")
    if x.dim() < 1 or x.shape[-1] % BLOCK:
        raise ValueError(f"quantize: the last dimension must be a multiple of {BLOCK}, got shape {tuple(x.shape)}")
    xf = x.float()
    if global_scale is None:
        gs = default_global_scale(xf)
    else:
        gs = torch.as_tensor(global_scale, dtype=torch.float32, device=x.device)
    gs_rows = _global_scale_rows(gs, tuple(x.shape[:-1]))  # [..., 1]

    blocks = xf.reshape(*x.shape[:-1], x.shape[-1] // BLOCK, BLOCK)
    absb = blocks.abs()
    block_amax = torch.where(torch.isnan(absb), torch.zeros_like(absb), absb).amax(dim=-1)  # [..., K/16]
    denom = torch.tensor(FP4_MAX, dtype=torch.float32, device=x.device) * gs_rows  # fp32 6*gs
    scale_f = block_amax / denom
    scale = scale_f.clamp(max=FP8_MAX).to(torch.float8_e4m3fn)  # RNE, saturating (NaN stays NaN)
    sdec = scale.float() * gs_rows  # fp32 product, per block
    v = blocks / sdec.unsqueeze(-1)
    v = torch.where((sdec == 0).unsqueeze(-1), torch.zeros_like(v), v)
    codes = e2m1_encode(v).reshape(x.shape)
    return NVFP4Tensor(pack_codes(codes), scale, gs.clone())


def dequantize(q: NVFP4Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Decode ``q`` to ``dtype`` (float32 or float64 recommended): ``e2m1 * scale * global_scale``.

    In float64 the result is exact; in float32 only the final multiply by the global
    scale rounds.
    """
    codes = unpack_codes(q.data)
    vals = e2m1_decode(codes).to(dtype)
    lead = tuple(q.data.shape[:-1])
    k = q.data.shape[-1] * 2
    blocks = vals.reshape(*lead, k // BLOCK, BLOCK) * q.scale.to(dtype).unsqueeze(-1)
    gs = _global_scale_rows(q.global_scale.to(dtype), lead)
    return (blocks.reshape(*lead, k) * gs).to(dtype)


# ---------------------------------------------------------------------------------
# Scale-factor layout (docs/SPEC.md §2)
# ---------------------------------------------------------------------------------

def sf_padded_shape(rows: int, cols: int) -> tuple[int, int]:
    """(rows rounded up to 128, scale columns rounded up to 4)."""
    return (rows + 127) // 128 * 128, (cols + 3) // 4 * 4


def sf_offset(m: torch.Tensor | int, k: torch.Tensor | int, cols: int, rows: int | None = None,
              b: torch.Tensor | int = 0) -> torch.Tensor | int:
    """Byte offset of scale (m, k) of batch b in the swizzled buffer (docs/SPEC.md §2 closed form).

    ``cols`` is the number of scale columns (K/16); ``rows`` is needed only when b != 0.
    Equal to CuTe's ``tile_atom_to_shape_SFA(...)(m, k*16, b)`` (checked by cpp/tests).
    """
    kt = (cols + 3) // 4
    mt = 0 if rows is None else (rows + 127) // 128
    return (b * mt * kt * 512 + (m // 128) * kt * 512 + (k // 4) * 512
            + (m % 32) * 16 + ((m % 128) // 32) * 4 + (k % 4))


def _sf_index(rows: int, cols: int, device) -> torch.Tensor:
    m = torch.arange(rows, device=device, dtype=torch.int64).unsqueeze(1)
    k = torch.arange(cols, device=device, dtype=torch.int64).unsqueeze(0)
    return sf_offset(m, k, cols)  # [rows, cols]


def swizzle_scales(scale: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Linear scales ``[rows, cols]`` or ``[B, rows, cols]`` -> the swizzled SF buffer.

    Returns uint8 ``[pad_rows, pad_cols]`` (or ``[B, pad_rows, pad_cols]``), contiguous,
    whose bytes are in the tensor-core layout; padding is zero. If ``out`` is given it
    is written entirely (padding included) and returned.
    """
    if scale.dim() not in (2, 3):
        raise ValueError(f"swizzle_scales expects [rows, cols] or [B, rows, cols], got {tuple(scale.shape)}")
    batched = scale.dim() == 3
    s = scale if batched else scale.unsqueeze(0)
    nb, rows, cols = s.shape
    prow, pcol = sf_padded_shape(rows, cols)
    src = s.contiguous().view(torch.uint8) if s.dtype == torch.float8_e4m3fn else s.contiguous().to(torch.uint8)
    if out is None:
        out = torch.empty((nb, prow, pcol) if batched else (prow, pcol), dtype=torch.uint8, device=scale.device)
    elif out.numel() != nb * prow * pcol or out.dtype != torch.uint8 or not out.is_contiguous():
        raise ValueError(f"swizzle_scales: out must be contiguous uint8 with {nb * prow * pcol} bytes")
    flat = out.view(nb, prow * pcol)
    flat.zero_()
    idx = _sf_index(rows, cols, scale.device).reshape(1, -1).expand(nb, -1)
    flat.scatter_(1, idx, src.reshape(nb, -1))
    return out


def unswizzle_scales(buf: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """Swizzled SF buffer -> linear float8_e4m3fn scales ``[rows, cols]`` (``[B, rows, cols]`` if batched)."""
    prow, pcol = sf_padded_shape(rows, cols)
    per = prow * pcol
    if buf.numel() % per:
        raise ValueError(f"unswizzle_scales: buffer of {buf.numel()} bytes is not a multiple of {per} "
                         f"(rows={rows}, cols={cols})")
    nb = buf.numel() // per
    raw = buf.reshape(-1).view(torch.uint8) if buf.dtype != torch.uint8 else buf.reshape(-1)
    idx = _sf_index(rows, cols, buf.device).reshape(-1)
    out = raw.view(nb, per)[:, idx].reshape(nb, rows, cols).contiguous().view(torch.float8_e4m3fn)
    return out if buf.dim() == 3 else out[0]


def grouped_row_offsets(group_sizes: torch.Tensor | list[int]) -> torch.Tensor:
    """Start row of each group in a grouped SF buffer: ``sum_{j<e} round_up(n_j, 128)``; length E+1."""
    n = torch.as_tensor(group_sizes, dtype=torch.int64)
    padded = (n + 127) // 128 * 128
    return torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(padded, 0)])


def swizzle_scales_grouped(scale: torch.Tensor, group_sizes, out: torch.Tensor | None = None) -> torch.Tensor:
    """Per-expert activation scales -> one grouped SF buffer.

    ``scale`` is ``[sum(group_sizes), cols]`` with the rows of group e contiguous and in
    order. Group e's block starts at row ``grouped_row_offsets(group_sizes)[e]`` (a
    multiple of 128), so the buffer is ``[total_padded_rows, pad_cols]`` bytes with
    every padding byte zero.
    """
    sizes = torch.as_tensor(group_sizes, dtype=torch.int64).cpu()
    if int(sizes.sum()) != scale.shape[0]:
        raise ValueError(f"swizzle_scales_grouped: group sizes sum to {int(sizes.sum())}, scale has {scale.shape[0]} rows")
    offs = grouped_row_offsets(sizes)
    total = int(offs[-1])
    cols = scale.shape[1]
    placed = torch.zeros((max(total, 0), cols), dtype=torch.uint8, device=scale.device)
    rows_src = torch.cat([torch.arange(int(n)) + int(o) for n, o in zip(sizes, offs[:-1])]) if len(sizes) else torch.zeros(0, dtype=torch.int64)
    placed[rows_src.to(scale.device)] = scale.contiguous().view(torch.uint8)
    if total == 0:
        return torch.zeros((0, sf_padded_shape(0, cols)[1]), dtype=torch.uint8, device=scale.device)
    return swizzle_scales(placed.view(torch.float8_e4m3fn), out=out)


def unswizzle_scales_grouped(buf: torch.Tensor, group_sizes, cols: int) -> torch.Tensor:
    """Inverse of :func:`swizzle_scales_grouped`: ``[sum(group_sizes), cols]`` float8_e4m3fn."""
    sizes = torch.as_tensor(group_sizes, dtype=torch.int64).cpu()
    offs = grouped_row_offsets(sizes)
    full = unswizzle_scales(buf, int(offs[-1]), cols)
    rows_src = torch.cat([torch.arange(int(n)) + int(o) for n, o in zip(sizes, offs[:-1])]) if len(sizes) else torch.zeros(0, dtype=torch.int64)
    return full[rows_src.to(buf.device)]


def verify_sf_roundtrip(scale: torch.Tensor, swizzle=None, unswizzle=None, max_report: int = 8) -> dict:
    """docs/SPEC.md §2 verifier: check a swizzle implementation byte for byte.

    ``swizzle(scale, out=buf)`` is called on a buffer poisoned with 0x7F (NaN in e4m3),
    so an unwritten padding byte shows up. The result is compared with the closed form
    (every logical byte at its place, every padding byte zero), then ``unswizzle`` must
    give back ``scale`` exactly. Defaults are this module's functions.

    Returns ``{"mismatches": int, "first": [...], "checked_bytes": int}``; ``first`` holds up
    to ``max_report`` entries ``("layout"|"padding"|"roundtrip", row, col)``.
    """
    swizzle = swizzle or swizzle_scales
    unswizzle = unswizzle or unswizzle_scales
    if scale.dim() != 2:
        raise ValueError(f"verify_sf_roundtrip expects [rows, cols] scales, got {tuple(scale.shape)}")
    rows, cols = scale.shape
    prow, pcol = sf_padded_shape(rows, cols)
    buf = torch.full((prow, pcol), 0x7F, dtype=torch.uint8, device=scale.device)
    got = swizzle(scale, out=buf)
    got = got.reshape(-1).view(torch.uint8) if got.dtype != torch.uint8 else got.reshape(-1)
    got = got.cpu()
    expected = torch.zeros(prow * pcol, dtype=torch.uint8)
    idx = _sf_index(rows, cols, "cpu")
    expected[idx.reshape(-1)] = scale.cpu().contiguous().view(torch.uint8).reshape(-1)
    logical = torch.zeros(prow * pcol, dtype=torch.bool)
    logical[idx.reshape(-1)] = True
    first: list[tuple[str, int, int]] = []
    bad_layout = (got != expected) & logical
    bad_pad = (got != expected) & ~logical
    if bad_layout.any():
        # report logical coordinates of the scales that are not where they belong
        wrong = bad_layout[idx]  # [rows, cols]
        for r, c in wrong.nonzero()[:max_report].tolist():
            first.append(("layout", r, c))
    if bad_pad.any() and len(first) < max_report:
        for off in bad_pad.nonzero().flatten()[: max_report - len(first)].tolist():
            first.append(("padding", off // pcol, off % pcol))
    back = unswizzle(got.reshape(prow, pcol).to(scale.device), rows, cols)
    back = back.cpu().contiguous().view(torch.uint8)
    bad_rt = back != scale.cpu().contiguous().view(torch.uint8)
    if bad_rt.any() and len(first) < max_report:
        for r, c in bad_rt.nonzero()[: max_report - len(first)].tolist():
            first.append(("roundtrip", r, c))
    mismatches = int(bad_layout.sum() + bad_pad.sum() + bad_rt.sum())
    return {"mismatches": mismatches, "first": first, "checked_bytes": prow * pcol + rows * cols}


# ---------------------------------------------------------------------------------
# GEMM (reference)
# ---------------------------------------------------------------------------------

def gemm(a: NVFP4Tensor | torch.Tensor, b: NVFP4Tensor, alpha: float | torch.Tensor | None = None,
         out_dtype: torch.dtype = torch.float32, compute_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Reference ``out = alpha * (a @ b^T)`` with ``b`` NVFP4 ``[N, K]``.

    Args:
        a: NVFP4Tensor ``[M, K]`` or a float tensor ``[M, K]`` (bf16/fp16/fp32).
        b: NVFP4Tensor ``[N, K]``.
        alpha: optional extra scalar (or per-column ``[N]``) multiplier; global scales
            are already part of the decode.
        out_dtype: output dtype.
        compute_dtype: float32 (the kernels' accumulate type) or float64 for tests.
    """
    bf = dequantize(b, compute_dtype)
    af = dequantize(a, compute_dtype) if isinstance(a, NVFP4Tensor) else a.to(compute_dtype)
    if af.shape[-1] != bf.shape[-1]:
        raise ValueError(f"gemm: K mismatch, a {tuple(af.shape)} vs b {tuple(bf.shape)}")
    out = af @ bf.transpose(-1, -2)
    if alpha is not None:
        out = out * torch.as_tensor(alpha, dtype=compute_dtype, device=out.device)
    return out.to(out_dtype)

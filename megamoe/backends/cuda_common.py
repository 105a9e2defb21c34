"""NVFP4 primitives on any CUDA GPU through the shared kernels (cpp/common).

:class:`CudaCommonMixin` gives a backend the docs/SPEC.md §1-§2 primitives (quantize, SF
swizzle / unswizzle, grouped swizzle, verifier) running as CUDA kernels. The kernels are
bit-identical to :mod:`megamoe.nvfp4`; this module only allocates, checks arguments and
launches on the current torch stream.
"""
from __future__ import annotations

import torch

from megamoe import _ext, nvfp4

__all__ = ["CudaCommonMixin", "common_ext", "current_stream", "quantize_rows", "GS_SINGLE", "GS_PER_EXPERT",
           "GS_PER_ROW", "GS_PER_ROW_DYNAMIC", "E4M3_NAN_BYTE"]

# megamoe::GlobalScaleMode (cpp/include/megamoe/common_kernels.h) as the extension exports it
# (megamoe._C.GlobalScaleMode, quantize_nvfp4's gs_mode); None where cpp/common was not built.
_GS = _ext.ext.GlobalScaleMode if _ext.has_part("common") else None
GS_SINGLE, GS_PER_EXPERT, GS_PER_ROW, GS_PER_ROW_DYNAMIC = (
    (_GS.single, _GS.per_expert, _GS.per_row, _GS.per_row_dynamic) if _GS is not None else (None, None, None, None))
#: 0x7F is NaN in e4m3: the poison for buffers that a kernel must fill completely.
E4M3_NAN_BYTE = 0x7F


def common_ext():
    """The extension if its cpp/common part was built, else None."""
    return _ext.ext if _ext.has_part("common") else None


def current_stream(device: torch.device | None = None) -> int:
    return torch.cuda.current_stream(device).cuda_stream


def quantize_rows(src: torch.Tensor, *, global_scale, gs_mode, stream: int, src_rows=None, expert_offsets=None,
                  dst_offsets=None, data=None, scale=None, scale_swz=None, sf_rows: int = 0, dequant=None,
                  row_scale_out=None, **options) -> None:
    """``megamoe._C.quantize_nvfp4`` by keyword, the outputs and row maps not given left out (see
    cpp/include/megamoe/common_kernels.h QuantizeArgs; ``options``: dequant_lane_order, scatter_rows, scatter_k,
    row_experts)."""
    common_ext().quantize_nvfp4(src=src, global_scale=global_scale, gs_mode=gs_mode, src_rows=src_rows,
                                expert_offsets=expert_offsets, dst_offsets=dst_offsets, data=data, scale=scale,
                                scale_swz=scale_swz, sf_rows=sf_rows, dequant=dequant, row_scale_out=row_scale_out,
                                stream=stream, **options)


def _u8(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype != torch.uint8 else t


def _as_e4m3(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.float8_e4m3fn)


class CudaCommonMixin:
    """docs/SPEC.md §1-§2 primitives on the GPU (mixed into CUDA backends ahead of Backend)."""

    # ---------------------------------------------------------------- quantize
    def quantize(self, x: torch.Tensor, global_scale=None) -> nvfp4.NVFP4Tensor:
        """NVFP4-quantize ``x`` ``[..., K]`` on the GPU; bytes identical to :func:`nvfp4.quantize`."""
        ext = common_ext()
        if not torch.is_floating_point(x):
            raise TypeError(f"quantize expects a floating-point tensor, got {x.dtype}")
        if x.dim() < 1 or x.shape[-1] % 16:
            raise ValueError(f"quantize: the last dimension must be a multiple of 16, got shape {tuple(x.shape)}")
        x = x.to(self.device)
        if x.dtype == torch.float64:
            x = x.float()
        lead, k = tuple(x.shape[:-1]), x.shape[-1]
        x2 = x.reshape(-1, k)
        if x2.stride(-1) != 1:
            x2 = x2.contiguous()
        rows = x2.shape[0]
        stream = current_stream(x.device)
        if global_scale is None:
            gs = torch.empty((), dtype=torch.float32, device=x.device)
            scratch = torch.empty(1, dtype=torch.int32, device=x.device)
            ext.dynamic_global_scale(x2, scratch, gs.reshape(1), stream)
            mode, gs_arg = GS_SINGLE, gs.reshape(1)
        else:
            gs = torch.as_tensor(global_scale, dtype=torch.float32, device=x.device)
            if gs.dim() == 0:
                mode, gs_arg = GS_SINGLE, gs.reshape(1).contiguous()
            else:
                mode = GS_PER_ROW
                gs_arg = nvfp4._global_scale_rows(gs, lead).expand(*lead, 1).reshape(-1).contiguous()
        data = torch.full((rows, k // 2), 0xFF, dtype=torch.uint8, device=x.device)
        scale = torch.full((rows, k // 16), E4M3_NAN_BYTE, dtype=torch.uint8, device=x.device)
        quantize_rows(x2, global_scale=gs_arg, gs_mode=mode, data=data, scale=scale, stream=stream)
        return nvfp4.NVFP4Tensor(data.reshape(*lead, k // 2), _as_e4m3(scale).reshape(*lead, k // 16), gs.clone())

    # ---------------------------------------------------------------- SF layout
    def swizzle_scales(self, scale: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """docs/SPEC.md §2 swizzle on the GPU; every byte of the buffer (padding = 0) is written."""
        if scale.dim() not in (2, 3):
            raise ValueError(f"swizzle_scales expects [rows, cols] or [B, rows, cols], got {tuple(scale.shape)}")
        src = _u8(scale.to(self.device)).contiguous()
        rows, cols = src.shape[-2:]
        prow, pcol = nvfp4.sf_padded_shape(rows, cols)
        shape = (src.shape[0], prow, pcol) if src.dim() == 3 else (prow, pcol)
        if out is None:
            out = torch.empty(shape, dtype=torch.uint8, device=src.device)
        elif out.numel() != torch.Size(shape).numel() or out.dtype != torch.uint8 or not out.is_contiguous():
            raise ValueError(f"swizzle_scales: out must be contiguous uint8 with {torch.Size(shape).numel()} bytes")
        common_ext().swizzle_scales(src, out, current_stream(src.device))
        return out

    def unswizzle_scales(self, buf: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
        prow, pcol = nvfp4.sf_padded_shape(rows, cols)
        per = prow * pcol
        if buf.numel() % per:
            raise ValueError(f"unswizzle_scales: buffer of {buf.numel()} bytes is not a multiple of {per} "
                             f"(rows={rows}, cols={cols})")
        nb = buf.numel() // per
        src = _u8(buf.to(self.device)).contiguous()
        out = torch.full((nb, rows, cols), E4M3_NAN_BYTE, dtype=torch.uint8, device=src.device)
        common_ext().unswizzle_scales(src, out, current_stream(src.device))
        out = _as_e4m3(out)
        return out if buf.dim() == 3 else out[0]

    @staticmethod
    def _group_offsets(group_sizes, device):
        sizes = torch.as_tensor(group_sizes, dtype=torch.int64).cpu()
        src = torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(sizes, 0)])
        dst = nvfp4.grouped_row_offsets(sizes)
        return (src.to(device=device, dtype=torch.int32), dst[:-1].to(device=device, dtype=torch.int32),
                int(dst[-1]), int(src[-1]))

    def swizzle_scales_grouped(self, scale: torch.Tensor, group_sizes, out: torch.Tensor | None = None) -> torch.Tensor:
        """Grouped docs/SPEC.md §2 buffer (group e at row ``grouped_row_offsets(sizes)[e]``), every byte written."""
        src = _u8(scale.to(self.device)).contiguous()
        cols = src.shape[1]
        src_off, dst_off, total, n = self._group_offsets(group_sizes, src.device)
        if n != src.shape[0]:
            raise ValueError(f"swizzle_scales_grouped: group sizes sum to {n}, scale has {src.shape[0]} rows")
        prow, pcol = nvfp4.sf_padded_shape(total, cols)
        if total == 0:
            return torch.zeros((0, pcol), dtype=torch.uint8, device=src.device)
        if out is None:
            out = torch.empty((prow, pcol), dtype=torch.uint8, device=src.device)
        common_ext().swizzle_scales_grouped(src, src_off, dst_off, total, out, current_stream(src.device))
        return out

    def unswizzle_scales_grouped(self, buf: torch.Tensor, group_sizes, cols: int) -> torch.Tensor:
        src_off, dst_off, total, n = self._group_offsets(group_sizes, self.device)
        out = torch.full((n, cols), E4M3_NAN_BYTE, dtype=torch.uint8, device=self.device)
        if n:
            common_ext().unswizzle_scales_grouped(_u8(buf.to(self.device)).contiguous(), src_off, dst_off, total, out,
                                                  current_stream(self.device))
        return _as_e4m3(out)

    # ---------------------------------------------------------------- verifier
    def verify_swizzled(self, scale: torch.Tensor, buf: torch.Tensor, group_sizes=None, max_records: int = 8) -> dict:
        """Device verifier (docs/SPEC.md §2): compare a swizzled ``buf`` with linear ``scale``.

        Every logical scale is looked up through the closed form and every padding byte
        must be zero. Returns ``{"mismatches": int, "first": [(b, m, k), ...]}`` (``b`` is
        the batch or group; ``m >= rows`` or ``k >= cols`` marks a padding byte).
        """
        lin = _u8(scale.to(self.device)).contiguous()
        swz = _u8(buf.to(self.device)).contiguous()
        result = torch.zeros(1 + 3 * max_records, dtype=torch.int64, device=self.device)
        stream = current_stream(self.device)
        if group_sizes is None:
            common_ext().verify_swizzled(lin, swz, result, stream)
        else:
            src_off, dst_off, total, _ = self._group_offsets(group_sizes, self.device)
            common_ext().verify_swizzled_grouped(lin, swz, src_off, dst_off, total, result, stream)
        r = result.cpu().tolist()
        n = min(r[0], max_records)
        return {"mismatches": r[0], "first": [tuple(r[1 + 3 * i: 4 + 3 * i]) for i in range(n)]}

    def verify_sf_roundtrip(self, scale: torch.Tensor) -> dict:
        """docs/SPEC.md §2 verifier: the reference check of this backend's swizzle / unswizzle (poisoned
        buffer, closed form, round trip) plus the device verifier on the same buffer."""
        report = nvfp4.verify_sf_roundtrip(scale, self.swizzle_scales, self.unswizzle_scales)
        prow, pcol = nvfp4.sf_padded_shape(*scale.shape)
        buf = torch.full((prow, pcol), E4M3_NAN_BYTE, dtype=torch.uint8, device=self.device)
        self.swizzle_scales(scale, out=buf)
        dev = self.verify_swizzled(scale, buf)
        report["device_verifier"] = dev
        report["mismatches"] += dev["mismatches"]
        return report

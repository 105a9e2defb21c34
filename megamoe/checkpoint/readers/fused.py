"""Reader: megamoe's own fused layout (vLLM's names), which :func:`megamoe.checkpoint.save` writes
and ModelOpt's fused exports use: ``w13_weight`` u8 ``[E, 2I, H/2]``, ``w13_weight_scale`` e4m3
``[E, 2I, H/16]``, ``w13_weight_scale_2`` f32 ``[E, 2]`` (or ``[E]``), ``w13_input_scale`` f32
``[E]`` (or one value), ``w2_*`` likewise; a weight stored in a float dtype is quantized at load
and reported. Also the gate/up row orders of a fused tensor (:data:`W13_LAYOUTS`)."""
from __future__ import annotations

import torch

from megamoe import nvfp4
from megamoe.checkpoint.readers.common import _check_k, _expert_scale_check, _not_fp8
from megamoe.checkpoint.report import CheckpointError

#: fused gate/up row orders (docs/SPEC.md §3.3): ``gate-up`` = rows ``[gate; up]`` (megamoe's),
#: ``up-gate`` = ``[up; gate]``, ``interleaved`` = ``[g0, u0, g1, u1, ...]``.
W13_LAYOUTS = ("gate-up", "up-gate", "interleaved")


def _as_nvfp4(get, report, name: str, gs_name: str, gs_rows: int, prefix: str) -> nvfp4.NVFP4Tensor:
    """Read ``name`` as NVFP4 [E, N, K]; quantize (and report) if it is stored in a float dtype."""
    data = get(name)
    if data.dim() != 3:
        raise CheckpointError(f"{prefix}{name}: expected 3 dims [E, N, K/2], got shape {tuple(data.shape)}")
    _not_fp8(prefix + name, data)
    if torch.is_floating_point(data):
        _check_k(prefix + name, data, None)
        e, n, k = data.shape
        if n % gs_rows:
            raise CheckpointError(f"{prefix}{name}: {n} rows cannot split into {gs_rows} equal halves")
        rows = data.float().view(e, gs_rows, n // gs_rows, k)
        gs = torch.stack([torch.stack([nvfp4.default_global_scale(rows[a, b]) for b in range(gs_rows)])
                          for a in range(e)])  # [E, gs_rows]: gate and up keep their own scale
        q = nvfp4.quantize(data.float(), gs if gs_rows > 1 else gs[:, 0])
        report.quantized_at_load.append(prefix + name)
        report.tensors[prefix + name] = f"quantized-at-load (stored {data.dtype})"
        return q
    if data.dtype != torch.uint8:
        raise CheckpointError(f"{prefix}{name}: dtype {data.dtype}, expected uint8 (packed E2M1) or a float dtype")
    scale = get(name + "_scale")
    if scale.dtype != torch.float8_e4m3fn:
        raise CheckpointError(f"{prefix}{name}_scale: dtype {scale.dtype}, expected float8_e4m3fn")
    _check_k(prefix + name, data, scale)
    gs = get(gs_name).float()
    want = (data.shape[0], gs_rows) if gs_rows > 1 else (data.shape[0],)
    if gs_rows > 1 and tuple(gs.shape) == (data.shape[0],):
        gs = gs.unsqueeze(1).expand(-1, gs_rows).contiguous()  # one scale for gate and up
    if tuple(gs.shape) != want:
        raise CheckpointError(f"{prefix}{gs_name}: shape {tuple(gs.shape)}, expected {want}")
    _expert_scale_check(prefix + gs_name, gs, "global scale")
    report.tensors[prefix + name] = "nvfp4"
    return nvfp4.NVFP4Tensor(data, scale, gs)


def _fused_input_scale(get, name: str, e: int, prefix: str) -> torch.Tensor | None:
    t = get(name, required=False)
    if t is None:
        return None
    t = t.float()
    if t.numel() == 1:
        t = t.reshape(1).expand(e).contiguous()  # one value for the layer: shared by all experts
    elif t.dim() == 2 and t.shape[0] == e:
        t = t.amax(dim=1)  # separate gate/up values: the larger (docs/SPEC.md §3.2)
    t = t.reshape(-1)
    if t.numel() != e:
        raise CheckpointError(f"{prefix}{name}: {t.numel()} values, expected one per expert ({e}) or one")
    _expert_scale_check(prefix + name, t, "input scale")
    return t


def _load_fused(get, report, prefix):
    w13 = _as_nvfp4(get, report, "w13_weight", "w13_weight_scale_2", 2, prefix)
    w2 = _as_nvfp4(get, report, "w2_weight", "w2_weight_scale_2", 1, prefix)
    e = w13.data.shape[0]
    return w13, w2, _fused_input_scale(get, "w13_input_scale", e, prefix), _fused_input_scale(get, "w2_input_scale", e, prefix)


def _apply_w13_layout(w13: nvfp4.NVFP4Tensor, layout: str) -> nvfp4.NVFP4Tensor:
    """Rows of a fused ``[E, 2I, ...]`` gate/up tensor reordered to ``[gate; up]`` (exact: rows
    are independent in NVFP4)."""
    if layout == "gate-up":
        return w13
    n = w13.data.shape[1]
    if layout == "up-gate":
        perm = torch.cat([torch.arange(n // 2, n), torch.arange(0, n // 2)])
        gs = w13.global_scale.flip(-1) if w13.global_scale.dim() == 2 else w13.global_scale
    elif layout == "interleaved":
        perm = torch.cat([torch.arange(0, n, 2), torch.arange(1, n, 2)])
        gs = w13.global_scale
        if gs.dim() == 2 and not torch.equal(gs[:, 0], gs[:, 1]):
            raise CheckpointError("w13_weight_scale_2: separate gate/up scales cannot apply to interleaved rows")
    else:
        raise CheckpointError(f"w13_layout={layout!r}: expected one of {W13_LAYOUTS}")
    perm = perm.to(w13.data.device)
    return nvfp4.NVFP4Tensor(w13.data[:, perm].contiguous(), w13.scale[:, perm].contiguous(), gs.contiguous())

"""Reader: ModelOpt's NVFP4 export of transformers' fused, transposed experts (Llama 4):
``experts.gate_up_proj`` / ``experts.down_proj`` packed along K, with ``_weight_scale``,
``_weight_scale_2`` and ``_input_scale``; transposed to megamoe's ``[E, N, K/2]`` at load."""
from __future__ import annotations

import torch

from megamoe import nvfp4
from megamoe.checkpoint.readers.common import _check_k, _expert_scale_check
from megamoe.checkpoint.readers.fused import _fused_input_scale
from megamoe.checkpoint.report import CheckpointError


def _load_modelopt_transposed(get, report, prefix):
    """ModelOpt's export of transformers' fused, transposed experts (Llama 4): ``experts.gate_up_proj``
    u8 ``[E, H/2, 2I]`` (packed along H, the GEMM's K), ``_weight_scale`` e4m3 ``[E, H/16, 2I]``,
    ``_weight_scale_2`` and ``_input_scale`` one value (or one per expert); ``experts.down_proj``
    ``[E, I/2, H]`` likewise. Transposed to megamoe's ``[E, N, K/2]`` (exact: a byte holds two
    consecutive K values either way)."""
    out = []
    for name, gs_rows in (("experts.gate_up_proj", 2), ("experts.down_proj", 1)):
        data = get(name)
        if data.dim() != 3 or data.dtype != torch.uint8:
            raise CheckpointError(f"{prefix}{name}: {data.dtype} {tuple(data.shape)}; a ModelOpt NVFP4 fused "
                                  f"expert tensor is uint8 [E, K/2, N]")
        scale = get(name + "_weight_scale")
        if scale.dtype != torch.float8_e4m3fn or scale.dim() != 3 or scale.shape[0] != data.shape[0] \
                or scale.shape[2] != data.shape[2] or scale.shape[1] * 8 != data.shape[1]:
            raise CheckpointError(f"{prefix}{name}_weight_scale: {scale.dtype} {tuple(scale.shape)}; expected "
                                  f"float8_e4m3fn [E, K/16, N] for {name} {tuple(data.shape)}")
        e = data.shape[0]
        gs = get(name + "_weight_scale_2").float()
        if gs.numel() == 1:
            gs = gs.reshape(1).expand(e).contiguous()
        if gs.numel() != e:
            raise CheckpointError(f"{prefix}{name}_weight_scale_2: {gs.numel()} values, expected one or one per "
                                  f"expert ({e})")
        gs = gs.reshape(e)
        _expert_scale_check(prefix + name + "_weight_scale_2", gs, "global scale")
        if gs_rows > 1:
            gs = gs.unsqueeze(1).expand(e, gs_rows).contiguous()  # one scale for gate and up
        q = nvfp4.NVFP4Tensor(data.transpose(1, 2).contiguous(), scale.transpose(1, 2).contiguous(), gs)
        _check_k(prefix + name, q.data, q.scale)
        report.tensors[prefix + name] = "nvfp4"
        out.append(q)
        out.append(_fused_input_scale(get, name + "_input_scale", e, prefix))
    w13, in1, w2, in2 = out
    return w13, w2, in1, in2

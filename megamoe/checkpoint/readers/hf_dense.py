"""Reader: transformers' fused experts in a float dtype (no quantization config):
``experts.gate_up_proj [E, 2I, H]`` and ``experts.down_proj [E, H, I]``, quantized to NVFP4 at
load and reported."""
from __future__ import annotations

from megamoe.checkpoint.readers.fused import _as_nvfp4


def _load_hf_fused(get, report, prefix):
    """transformers' fused experts ``experts.gate_up_proj [E, 2I, H]`` + ``experts.down_proj
    [E, H, I]`` in a float dtype: quantized at load (reported)."""
    w13 = _as_nvfp4(lambda n, required=True: get(n.replace("w13_weight", "experts.gate_up_proj"), required),
                    report, "w13_weight", "", 2, prefix)
    w2 = _as_nvfp4(lambda n, required=True: get(n.replace("w2_weight", "experts.down_proj"), required),
                   report, "w2_weight", "", 1, prefix)
    report.quantized_at_load[:] = [n.replace("w13_weight", "experts.gate_up_proj").replace("w2_weight", "experts.down_proj")
                                   for n in report.quantized_at_load]
    return w13, w2, None, None

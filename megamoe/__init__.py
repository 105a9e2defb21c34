"""megamoe: NVFP4 Mixture-of-Experts kernels and their reference.

Public API:
    megamoe.nvfp4       NVFP4Tensor, quantize, dequantize, swizzle_scales, unswizzle_scales, gemm, ...
    megamoe.moe         MoELayer, MoEWeights, MoEConfig
    megamoe.routing     route
    megamoe.checkpoint  load, write_synthetic, synthetic_weights
    megamoe.backends    get_backend, available_backends
    megamoe.health      run_checks (docs/SPEC.md §5)
"""
__version__ = "0.1.0"

from megamoe.presets import PRESETS, MoEConfig  # noqa: E402

__all__ = ["__version__", "PRESETS", "MoEConfig"]

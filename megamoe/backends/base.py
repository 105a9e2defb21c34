"""The backend interface: the seams of a modular MoE (prepare, experts, finalize).

A backend provides the NVFP4 primitives (quantize, SF swizzle) and the routed-expert
computation; routing and the shared expert are done once, by :class:`megamoe.moe.MoELayer`,
for every backend alike. Methods not overridden fall back to the torch reference, so a new
backend can replace one piece at a time.
"""
from __future__ import annotations

import torch

from megamoe import nvfp4


class Backend:
    """Base class; see docs/ARCHITECTURE.md for the contract."""

    name = "base"
    #: prepare_weights makes device tensors of its own for the routed experts' packed data (a
    #: re-layout), rather than handing back the given tensors: MoELayer then keeps its NVFP4 copy of
    #: those experts in host memory, so that the device holds them once.
    copies_routed_weights = False

    @classmethod
    def availability(cls) -> tuple[bool, str]:
        """``(available, reason)``; reason explains why when not available."""
        return True, ""

    # ---- device ----------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    # ---- NVFP4 primitives ---------------------------------------------------------
    def quantize(self, x: torch.Tensor, global_scale=None) -> nvfp4.NVFP4Tensor:
        return nvfp4.quantize(x, global_scale)

    def swizzle_scales(self, scale: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        return nvfp4.swizzle_scales(scale, out=out)

    def unswizzle_scales(self, buf: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
        return nvfp4.unswizzle_scales(buf, rows, cols)

    def swizzle_scales_grouped(self, scale: torch.Tensor, group_sizes, out: torch.Tensor | None = None) -> torch.Tensor:
        """Per-expert activation scales -> grouped SF buffer (each group at a 128-row boundary)."""
        return nvfp4.swizzle_scales_grouped(scale, group_sizes, out=out)

    def unswizzle_scales_grouped(self, buf: torch.Tensor, group_sizes, cols: int) -> torch.Tensor:
        """Inverse of :meth:`swizzle_scales_grouped`."""
        return nvfp4.unswizzle_scales_grouped(buf, group_sizes, cols)

    def verify_sf_roundtrip(self, scale: torch.Tensor) -> dict:
        """docs/SPEC.md §2 verifier run against this backend's swizzle and unswizzle."""
        return nvfp4.verify_sf_roundtrip(scale, self.swizzle_scales, self.unswizzle_scales)

    def gemm(self, a, b: nvfp4.NVFP4Tensor, alpha=None, out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
        raise NotImplementedError

    # ---- MoE ---------------------------------------------------------------------
    def prepare_weights(self, weights):
        """Once per layer: move/convert the weights for this backend (e.g. swizzle scales); the given
        weights are not modified (see :attr:`copies_routed_weights`)."""
        return weights

    def moe_forward(self, prepared, cfg, x: torch.Tensor, topk_ids: torch.Tensor,
                    topk_weights: torch.Tensor, batch_invariant: bool = True) -> torch.Tensor:
        """Routed experts only: ``sum_j w[t,j] * expert_{ids[t,j]}(x_t)``, ``[T, H]`` float32 or x.dtype.

        Slots whose id is outside ``[0, E)`` (masked, ``-1``) contribute nothing and their weight
        is not read (docs/SPEC.md §3.1); ``T = 0`` gives an empty ``[0, H]`` result.
        ``batch_invariant`` (docs/SPEC.md §3.5): a row's output bits do not depend on the other rows; False lets a
        backend pick faster kernels whose arithmetic depends on the batch's size (cuda-sm90's streaming decode)."""
        raise NotImplementedError

    def synchronize(self) -> None:
        """Wait for queued device work (no-op on the CPU)."""

    def describe(self) -> dict:
        """Device and version facts for reports."""
        return {"backend": self.name, "device": str(self.device)}

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name} on {self.device}>"

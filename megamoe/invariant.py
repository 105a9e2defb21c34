"""Batch-invariant float GEMMs (docs/SPEC.md §3.5).

A GEMM library picks its kernel, tile and split of K from the problem's shape, so the bits of
one row of ``x @ w.T`` can change with the number of rows that come with it. The layer's
float GEMMs that run outside the NVFP4 kernels (the router, the torch backend's experts, the
shared expert) go through :func:`matmul_rows` instead: it always calls the GEMM on blocks of
exactly :data:`ROW_BLOCK` rows (the last block zero-padded), so a row's arithmetic is that of
one fixed-shape GEMM whatever the batch, and a row does not depend on its position in it
(every row of a fixed-shape GEMM reduces K in the same order; tests/test_batch_invariance.py
checks it on each device the tests run on).
"""
from __future__ import annotations

import torch

__all__ = ["ROW_BLOCK", "matmul_rows", "matmul"]

#: Rows per GEMM call.
ROW_BLOCK = 64


def matmul_rows(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``x @ w.T`` (``[T, K]`` x ``[N, K]`` -> ``[T, N]``, the dtype of ``x`` and ``w``, which must
    match), computed in blocks of :data:`ROW_BLOCK` rows so that each output row is independent of
    the other rows of ``x``."""
    if x.dtype != w.dtype:
        raise TypeError(f"matmul_rows: x is {x.dtype}, w is {w.dtype}")
    t = x.shape[0]
    wt = w.T
    if t == 0:
        return x.new_zeros((0, w.shape[0]))
    pad = (-t) % ROW_BLOCK
    if pad:
        x = torch.cat([x, x.new_zeros((pad, x.shape[1]))])
    out = torch.empty((x.shape[0], w.shape[0]), dtype=x.dtype, device=x.device)
    for i in range(0, x.shape[0], ROW_BLOCK):
        torch.matmul(x[i:i + ROW_BLOCK], wt, out=out[i:i + ROW_BLOCK])
    return out[:t]


def matmul(x: torch.Tensor, w: torch.Tensor, invariant: bool = True) -> torch.Tensor:
    """``x @ w.T``: through :func:`matmul_rows` when ``invariant`` (the default), else one GEMM over
    all rows (faster for many rows on a GPU; a row's bits may then depend on its batch)."""
    return matmul_rows(x, w) if invariant else x @ w.T

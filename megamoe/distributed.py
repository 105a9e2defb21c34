"""Expert parallelism (EP) and tensor parallelism (TP) for the MoE layer on ``torch.distributed``.

Expert parallelism (:class:`ExpertParallelMoE`)
-----------------------------------------------

Each of the ``W`` ranks of a process group holds ``E / W`` routed experts, a contiguous
block: rank ``r`` owns experts ``[r*E/W, (r+1)*E/W)``. ``E % W`` must be 0.

One forward (every rank of the group calls it, each with its own tokens, possibly none):

1. **route** on the rank that holds the tokens (router weight replicated on every rank,
   the same :func:`megamoe.routing.route` as :class:`~megamoe.moe.MoELayer`);
2. **dispatch**: a token goes *once* to each rank that owns at least one of its top-k
   experts (not once per expert), with its k slots as local expert ids (-1: not this
   rank) and weights. Split sizes are exchanged first (``all_to_all_single`` of counts),
   then rows and slot metadata travel with ``all_to_all_single`` and those split sizes;
3. **experts**: the owning rank runs the local backend's ``moe_forward`` over its
   (token, local expert) pairs, weighted, and sums each token's pairs in ascending expert
   order into one fp32 partial row;
4. **combine**: partial rows return by the reverse ``all_to_all_single`` and are added,
   in rank order, into the token's fp32 output, in its original position;
5. the **shared expert** (replicated, dense) is added on the token's own rank.

Equality with the single-process forward: the contributions of a token's experts are
added in the same (ascending expert) order and in fp32 as :class:`MoELayer` does, since
the blocks are contiguous and ranks are combined in order. What may differ is the
expert GEMM itself: a rank multiplies its expert's rows in a different order (grouped by
source rank), and the shared expert's GEMM runs over this rank's tokens only; a BLAS or
tensor-core kernel may accumulate a row differently for another M (seen on the CPU: a
few outputs differ in the last fp32 bits, e.g. M=1 takes a GEMV path). The tests assert
``|ep - ref| <= 1e-5 * (max|ref| + |ref|)`` for fp32 outputs and one bf16 ulp (2^-7
relative) for bf16 outputs: the largest difference seen is 3e-7 of max|ref|, while a
real dispatch or combine error (a row in the wrong place, a weight lost or applied twice)
moves outputs by 1e-1 of max|ref| or more. With ``combine_dtype=bfloat16`` each partial
is rounded once more, to 2^-8 relative.

Checkpoint sharding (:func:`load_shard`): each rank runs the checkpoint loader
(:func:`megamoe.checkpoint.load_open`, every file opened once) with its expert range, so
it reads only its experts' rows of every per-expert tensor (a slice of the file's memory
map, copied so the shard owns exactly its bytes); the router and the shared expert are
read whole (replicated).

Tensor parallelism (:class:`TensorParallelMoE`)
-----------------------------------------------

Every rank of a group of ``W`` holds a ``1/W`` slice of *every* expert's intermediate
dimension: rank ``r`` holds columns ``[r*I/W, (r+1)*I/W)`` of I (:func:`intermediate_range`),
that is the gate rows and the up rows of ``w13`` with those indices and the same columns
of ``w2`` (``K = I/W`` of the second GEMM), with their block scales; the per-expert global
scales and input scales are kept whole (they scale every slice alike). ``I/W`` must be a
multiple of 16, so every slice is made of whole NVFP4 blocks (V4-Flash: I = 2048 at
W = 8 gives 256 per rank; on cuda-sm90 a K that is a multiple of 64 runs the wgmma kernels,
of 256 every tile). The shared expert is sliced the same way (its own width ``/ W``); the
router, the correction bias and a hash-routing table are replicated.

One forward (every rank of the group calls it with the *same* tokens):

1. **route** on every rank (replicated router, the same float32 batch-invariant GEMM on
   the same inputs: the same experts and weights on every rank; ``ep``-style dispatch is
   not needed);
2. **partial**: the local backend's ``moe_forward`` with the rank's slices (a layer of
   intermediate size ``I/W``, :func:`tp_local_config`), plus the rank's slice of the shared
   expert, as float32 ``[T, H]``. SwiGLU is elementwise in I, so a rank's slice of the
   intermediate activation is exactly the unsharded layer's columns; the second GEMM's
   sum over I splits into the ranks' partial sums;
3. **sum over ranks** in a fixed order (:func:`sum_over_ranks`): a reduce-scatter by
   ``all_to_all_single`` (rank ``q`` receives every rank's rows of chunk ``q``) summed in
   ascending rank order in float32, then ``all_gather`` of the summed chunks. Every rank
   ends with the same bits, run after run (an ``all_reduce`` leaves the order to the
   collective library), with the traffic of a ring all-reduce.

Against the unsharded layer only the float32 order of the second GEMM's sum differs (and,
with bfloat16 activations on a kernel backend, each rank's partial is rounded to bfloat16,
as the backend's output is). One approximation is inherent to W4A4 with *dynamic*
activation scales (``dynamic_act_scale``, or no static input scales): the second GEMM's
input is quantized with a per-row global scale from the amax of the rank's slice of the
row, not of the whole row. With static input scales (as ModelOpt and compressed-tensors
checkpoints store them) the quantization is the unsharded layer's, block for block.

Checkpoint slicing (:func:`load_tp_shard`): each rank reads only its slice of every expert
tensor from the safetensors files (``get_slice`` over the memory map, through
:class:`TensorSliceCheckpoint`, a view of :class:`megamoe.checkpoint.OpenCheckpoint` that
the unchanged loader reads): gate and up rows, down columns in whole 16-value blocks, the
matching FP8 block-scale rows and columns; the global and input scales whole. Per-expert
(ModelOpt, compressed-tensors) and fused (``w13_weight``, any declared gate/up order)
layouts. Expert weights stored in a float dtype (quantized at load, with a global scale of
the whole tensor) are refused: quantize the checkpoint first.

Launch (one process per GPU, or per CPU "rank" with gloo)::

    torchrun --nproc-per-node 2 -m megamoe.distributed check --preset tiny --backend torch
    torchrun --nproc-per-node 8 -m megamoe.distributed check --checkpoint /ckpt --level full
    torchrun --nproc-per-node 8 -m megamoe.distributed check --checkpoint /ckpt --tp 8 --compare
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
import torch.distributed as dist

from megamoe import checkpoint, health, nvfp4, reference
from megamoe.backends import Backend, get_backend
from megamoe.moe import MoELayer
from megamoe.weights import MoEWeights
from megamoe.presets import MoEConfig, get_preset

__all__ = [
    "expert_range",
    "init_distributed",
    "ShardLoadReport",
    "ShardLoaded",
    "load_shard",
    "shard_weights",
    "ExpertParallelMoE",
    "intermediate_range",
    "tp_local_config",
    "tp_slice_weights",
    "TensorSliceCheckpoint",
    "TensorShardLoadReport",
    "TensorShardLoaded",
    "load_tp_shard",
    "sum_over_ranks",
    "TensorParallelMoE",
    "run_checks_all_ranks",
    "merge_rank_reports",
    "global_rank",
]

EP_THRESHOLD_COSINE = 0.9999  # EP dispatch/combine vs the all-reduce path (same NVFP4 weights and inputs)
TP_THRESHOLD_COSINE = 0.9999  # TP ordered sum vs all_reduce of the same partials


# ------------------------------------------------------------------------------------------
# process group and partition
# ------------------------------------------------------------------------------------------

def expert_range(num_experts: int, world_size: int, rank: int) -> tuple[int, int]:
    """``(start, end)`` of the contiguous block of experts rank ``rank`` owns.

    Raises ValueError when ``num_experts`` is not a multiple of ``world_size``.
    """
    if world_size <= 0 or not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not in a world of size {world_size}")
    if num_experts % world_size:
        raise ValueError(f"expert parallelism needs num_experts divisible by the world size: "
                         f"{num_experts} experts on {world_size} ranks leaves {num_experts % world_size} over")
    per = num_experts // world_size
    return rank * per, (rank + 1) * per


def init_distributed(backend: str | None = None, timeout_s: float = 1800.0) -> tuple[int, int, torch.device]:
    """Join the process group torchrun describes (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``...).

    ``backend`` None: NCCL when CUDA is available (one GPU per process, ``LOCAL_RANK``),
    else gloo. Returns ``(rank, world_size, device)``. Already initialised: no-op.
    """
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    # NVLink multicast (NVLS) stays off: on shared hosts a program using it has taken the GPUs out of
    # service; all-to-all does not use it anyway. An explicit setting in the environment is kept.
    for var, off in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
                     ("NVSHMEM_DISABLE_NVLS", "1")):
        os.environ.setdefault(var, off)
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    device = torch.device("cpu")
    if backend == "nccl":
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    if not dist.is_initialized():
        kw = {}
        if backend == "nccl":
            kw["device_id"] = device  # eager NCCL init: a broken link fails here, not at the first forward
        dist.init_process_group(backend=backend, timeout=datetime.timedelta(seconds=timeout_s), **kw)
    return dist.get_rank(), dist.get_world_size(), device


# ------------------------------------------------------------------------------------------
# checkpoint sharding
# ------------------------------------------------------------------------------------------

@dataclass
class ShardLoadReport:
    """What :func:`load_shard` read: the expert block and the bytes of expert tensors;
    ``load`` is the loader's own report (format, choices, warnings; tensors by their names
    in the file)."""

    path: str
    rank: int
    world_size: int
    expert_start: int
    expert_end: int
    num_experts: int
    layout: str = "fused"
    prefix: str = ""
    expert_bytes_read: int = 0        # bytes of expert tensors this rank read
    expert_bytes_in_file: int = 0     # bytes of all experts' tensors in the checkpoint
    replicated_bytes_read: int = 0    # router, bias, shared expert
    tensors: dict[str, str] = field(default_factory=dict)
    quantized_at_load: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    load: checkpoint.LoadReport | None = None

    def summary(self) -> str:
        return (f"rank {self.rank}/{self.world_size}: experts [{self.expert_start}, {self.expert_end}) of "
                f"{self.num_experts} from {self.path} ({self.layout}); read {self.expert_bytes_read} of "
                f"{self.expert_bytes_in_file} expert bytes, {self.replicated_bytes_read} replicated bytes")


@dataclass
class ShardLoaded:
    weights: MoEWeights   # experts [E/W, ...] of this rank; router and shared expert whole
    config: MoEConfig     # the layer's (global) config
    expert_start: int
    report: ShardLoadReport


_FUSED_EXPERT_TENSORS = ("w13_weight", "w13_weight_scale", "w13_weight_scale_2", "w13_input_scale",
                         "w2_weight", "w2_weight_scale", "w2_weight_scale_2", "w2_input_scale")


def _is_expert_tensor(name: str, prefix: str) -> bool:
    """A routed experts' tensor of the layer at ``prefix`` (fused, per expert or HF fused)."""
    if not name.startswith(prefix):
        return False
    rest = name[len(prefix):]
    return rest.startswith("experts.") or rest in _FUSED_EXPERT_TENSORS


def load_shard(path, rank: int, world_size: int, *, device="cpu", **load_kw) -> ShardLoaded:
    """Load rank ``rank``'s experts (of ``world_size``) of one NVFP4 MoE layer.

    The checkpoint loader itself (:func:`megamoe.checkpoint.load_open` with an expert range,
    on files opened once): the same formats, layouts, checks and report as
    :func:`megamoe.checkpoint.load` (``load_kw``: its keyword arguments), but every
    per-expert tensor is read as this rank's rows only (``get_slice(name)[start:end]``;
    in the per-expert layout only experts ``start..end-1``'s tensors); the router and the
    shared expert whole.

    Raises:
        ValueError: ``num_experts`` not divisible by ``world_size``.
        CheckpointError: as :func:`megamoe.checkpoint.load`.
    """
    with checkpoint.open_checkpoint(path) as ck:
        prefix, layout, num_experts = checkpoint.layer_experts(ck, load_kw.get("layer"), load_kw.pop("prefix", None))
        start, end = expert_range(num_experts, world_size, rank)
        loaded = checkpoint.load_open(ck, experts=(start, end), prefix=prefix, device=device, **load_kw)
        experts = [n for n in ck.names() if _is_expert_tensor(n, prefix)]
        rep = loaded.report
        report = ShardLoadReport(
            path=str(ck.path), rank=rank, world_size=world_size, expert_start=start, expert_end=end,
            num_experts=num_experts, layout=layout, prefix=prefix,
            expert_bytes_read=sum(ck.bytes_read.get(n, 0) for n in experts),
            expert_bytes_in_file=sum(ck.nbytes(n) for n in experts),
            replicated_bytes_read=sum(b for n, b in ck.bytes_read.items() if not _is_expert_tensor(n, prefix)),
            tensors=dict(rep.tensors), quantized_at_load=list(rep.quantized_at_load), warnings=list(rep.warnings),
            load=rep)
    return ShardLoaded(loaded.weights, loaded.config, start, report)


def _local_config(cfg: MoEConfig, experts_per_rank: int) -> MoEConfig:
    """The config the local backend sees: this rank's experts, one (token, expert) pair per row."""
    return cfg.with_(num_experts=experts_per_rank, top_k=1, n_group=None, topk_group=None,
                     n_shared_experts=0, shared_intermediate_size=None)


def _expert_part(w: MoEWeights) -> MoEWeights:
    return MoEWeights(w13=w.w13, w2=w.w2, w13_input_scale=w.w13_input_scale, w2_input_scale=w.w2_input_scale,
                      b13=w.b13, b2=w.b2)


def shard_weights(weights: MoEWeights, rank: int, world_size: int) -> tuple[MoEWeights, int]:
    """This rank's experts of full in-memory ``weights`` (copies, so the rest can be freed;
    :meth:`MoEWeights.expert_slice`) and the first expert's id; router and shared expert
    are kept whole."""
    start, end = expert_range(weights.num_experts, world_size, rank)
    return weights.expert_slice(start, end), start


# ------------------------------------------------------------------------------------------
# the expert-parallel layer
# ------------------------------------------------------------------------------------------

class ExpertParallelMoE(MoELayer):
    """An NVFP4 MoE layer whose routed experts are spread over the ranks of ``group``.

    Same interface as :class:`MoELayer` (``forward``, ``route``, ``config``, ``backend``,
    ``weights``), but ``forward`` is a *collective*: every rank of the group calls it, each
    with its own tokens (``T`` may differ per rank, and may be 0). ``weights`` holds this
    rank's experts (``E/W`` of them, from :func:`load_shard` or :func:`shard_weights`) and
    the router and shared expert whole.

    Args:
        weights: this rank's experts + replicated router/shared expert.
        config: the layer's global config (``num_experts`` = E of the whole layer).
        expert_start: the global id of ``weights``' first expert (must be ``rank * E/W``).
        group: process group (None: the default group).
        backend / device: the local backend, as for :class:`MoELayer`.
        combine_dtype: dtype of the partial sums on their way back (float32 keeps the
            single-process accumulation; bfloat16 halves the return traffic).
    """

    def __init__(self, weights: MoEWeights, config: MoEConfig, expert_start: int, *, group=None,
                 backend: str | Backend = "auto", device=None, combine_dtype: torch.dtype = torch.float32) -> None:
        if not dist.is_initialized():
            raise RuntimeError("ExpertParallelMoE needs torch.distributed initialised (see init_distributed)")
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        start, end = expert_range(config.num_experts, self.world_size, self.rank)
        if expert_start != start or weights.num_experts != end - start:
            raise ValueError(f"rank {self.rank} of {self.world_size} owns experts [{start}, {end}), but the weights "
                             f"hold {weights.num_experts} experts from {expert_start}")
        self.expert_start, self.expert_end = start, end
        self.experts_per_rank = end - start
        self.combine_dtype = combine_dtype
        super().__init__(weights, config, backend=backend, device=device)
        self.last_stats: dict = {}
        #: set to a list to record ``(phase, CUDA event or perf_counter time)`` at each phase
        #: boundary of ``forward`` (start, routed, dispatched, experts, combined, done); see bench/ep_bench.py
        self.phase_marks: list | None = None

    def _check_weights(self, weights: MoEWeights, config: MoEConfig) -> None:
        """Experts against the shard's size, router and shared expert against the global config."""
        weights.validate(config, num_local_experts=self.experts_per_rank)

    def _routed_weights(self) -> MoEWeights:
        return _expert_part(self.weights)

    @property
    def local_config(self) -> MoEConfig:
        """What the local backend sees (follows ``config``, e.g. a changed ``act_mode``)."""
        return _local_config(self.config, self.experts_per_rank)

    def _mark(self, phase: str) -> None:
        if self.phase_marks is None:
            return
        if self.device.type == "cuda":
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            self.phase_marks.append((phase, ev))
        else:
            self.phase_marks.append((phase, time.perf_counter()))

    # ------------------------------------------------------------------ builders
    @classmethod
    def from_preset(cls, preset: str, seed: int = 0, backend: str | Backend = "auto", device=None, group=None,
                    **config_overrides) -> "ExpertParallelMoE":
        """Synthetic weights (every rank generates the same full set, keeps its block)."""
        cfg = get_preset(preset).with_(**config_overrides) if config_overrides else get_preset(preset)
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        expert_range(cfg.num_experts, world, rank)  # fail before synthesizing
        be = get_backend(backend, device=device)
        # same weights as MoELayer.from_preset on this device type (synthesis is seeded per device type)
        full = checkpoint.synthetic_weights(cfg, seed=seed, device=be.device)
        local, start = shard_weights(full, rank, world)
        del full
        return cls(local, cfg, start, group=group, backend=be)

    @classmethod
    def from_checkpoint(cls, path, backend: str | Backend = "auto", device=None, group=None,
                        **load_kw) -> "ExpertParallelMoE":
        """This rank's experts of a ModelOpt checkpoint (:func:`load_shard`)."""
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        loaded = load_shard(path, rank, world, **load_kw)
        layer = cls(loaded.weights, loaded.config, loaded.expert_start, group=group, backend=backend, device=device)
        layer.load_report = loaded.report
        return layer

    # ------------------------------------------------------------------ forward
    def forward(self, hidden_states: torch.Tensor, topk_ids: torch.Tensor | None = None,
                topk_weights: torch.Tensor | None = None, router_logits: torch.Tensor | None = None,
                validate: bool = True, input_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Collective MoE forward of this rank's tokens (see :meth:`MoELayer.forward` for the arguments).

        Every rank of the group must call it, the same number of times; ``T`` may be 0.
        Returns ``[T, H]`` in the dtype of ``hidden_states``, rows in their original order.
        """
        if validate:
            self._check_inputs(hidden_states, topk_ids, topk_weights, router_logits, input_ids)
        x = hidden_states.to(self.device)
        self._mark("start")
        k = self.config.top_k
        if x.shape[0] == 0:
            topk_ids = torch.zeros((0, k), dtype=torch.int32, device=self.device)
            topk_weights = torch.zeros((0, k), dtype=torch.float32, device=self.device)
        else:
            topk_ids, topk_weights = self._routing(x, topk_ids, topk_weights, router_logits, input_ids)
        self._mark("routed")
        y = self.routed_experts(x, topk_ids, topk_weights)
        if self.config.n_shared_experts and x.shape[0]:
            y = y + self._shared_expert(x)
        y = y.to(hidden_states.dtype)
        self._mark("done")
        return y

    __call__ = forward

    def routed_experts(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        """Dispatch, local experts, combine: ``sum_j w[t,j] * expert_{ids[t,j]}(x_t)`` as float32 ``[T, H]``."""
        t_local, hidden = x.shape
        world, per = self.world_size, self.experts_per_rank
        ids = topk_ids.long()
        k = ids.shape[1]
        # [T, k] owning rank of each slot; a masked slot (id outside [0, E)) goes to row W, dropped
        dest = torch.where(reference.valid_slots(ids, self.config.num_experts), ids // per,
                           torch.full_like(ids, world))
        member = torch.zeros((world + 1, t_local), dtype=torch.bool, device=x.device)
        if t_local:
            member.scatter_(0, dest.t(), True)                              # member[r, t]: t goes to r
        member = member[:world]
        send_rank, send_tok = member.nonzero(as_tuple=True)                  # rank-major, tokens ascending
        send_counts = member.sum(1)                                         # [W]
        on_dest = dest[send_tok] == send_rank.unsqueeze(1)                  # [S, k]
        not_here = torch.full_like(on_dest, -1, dtype=torch.long)                # a slot of another rank
        local_ids = torch.where(on_dest, ids[send_tok] - send_rank.unsqueeze(1) * per, not_here)
        slot_w = torch.where(on_dest, topk_weights[send_tok].float(), torch.zeros((), device=x.device))
        # one int32 message per row: k local ids, then the k fp32 weights' bits (exact, one collective)
        meta = torch.cat([local_ids.to(torch.int32), slot_w.contiguous().view(torch.int32)], dim=1)

        recv_counts = torch.empty_like(send_counts)
        dist.all_to_all_single(recv_counts, send_counts, group=self.group)
        send_splits, recv_splits = send_counts.tolist(), recv_counts.tolist()
        n_recv = sum(recv_splits)
        x_recv = x.new_empty((n_recv, hidden))
        dist.all_to_all_single(x_recv, x[send_tok].contiguous(), recv_splits, send_splits, group=self.group)
        meta_recv = meta.new_empty((n_recv, 2 * k))
        dist.all_to_all_single(meta_recv, meta, recv_splits, send_splits, group=self.group)
        self._mark("dispatched")

        partial = self.local_experts(x_recv, meta_recv[:, :k], meta_recv[:, k:].contiguous().view(torch.float32))

        self._mark("experts")
        back = torch.empty((send_tok.numel(), hidden), dtype=self.combine_dtype, device=x.device)
        dist.all_to_all_single(back, partial.to(self.combine_dtype).contiguous(), send_splits, recv_splits,
                               group=self.group)
        out = torch.zeros((t_local, hidden), dtype=torch.float32, device=x.device)
        offset = 0
        for n in send_splits:  # rank order: contributions land in ascending expert order, as in MoELayer
            if n:
                out.index_add_(0, send_tok[offset:offset + n], back[offset:offset + n].float())
            offset += n
        self._mark("combined")
        self.last_stats = {"tokens": t_local, "rows_sent": int(send_tok.numel()), "rows_received": n_recv,
                           "send_splits": send_splits, "recv_splits": recv_splits}
        return out

    def local_experts(self, x: torch.Tensor, local_ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """This rank's experts on received rows: ``[R, H]`` rows, ``[R, k]`` local ids (-1: another
        rank's slot) and weights; returns fp32 ``[R, H]``, each row's pairs summed in expert order."""
        rows = x.shape[0]
        partial = torch.zeros((rows, x.shape[1]), dtype=torch.float32, device=x.device)
        row, slot = (local_ids >= 0).nonzero(as_tuple=True)
        if row.numel() == 0:
            return partial
        expert = local_ids[row, slot].long()
        order = torch.argsort(row * self.experts_per_rank + expert, stable=True)  # by row, then expert
        row, slot, expert = row[order], slot[order], expert[order]
        y = self.backend.moe_forward(self._prepared, self.local_config, x[row], expert.to(torch.int32).unsqueeze(1),
                                     weights[row, slot].unsqueeze(1), self.batch_invariant).float()
        # Add each row's pairs in ascending expert order (as MoELayer does), one pass per position
        # within the row: every pass touches distinct rows, so even atomic adds (CUDA) cannot reorder.
        counts = torch.bincount(row, minlength=rows)
        position = torch.arange(row.numel(), device=x.device) - (torch.cumsum(counts, 0) - counts)[row]
        for p in range(local_ids.shape[1]):
            sel = (position == p).nonzero().squeeze(1)
            if sel.numel() == 0:
                break
            partial.index_add_(0, row[sel], y[sel])
        return partial

    # ------------------------------------------------------------------ things that need every expert
    def reference_bf16(self, *args, **kwargs):
        raise NotImplementedError("reference_bf16 needs every expert; build a MoELayer from the same checkpoint")

    def expert_weight_bytes(self, topk_ids: torch.Tensor) -> int:
        """NVFP4 bytes of the experts ``topk_ids`` uses *on this rank*."""
        ids = torch.unique(topk_ids)
        used = int(((ids >= self.expert_start) & (ids < self.expert_end)).sum())
        per = (self.weights.w13.nbytes() + self.weights.w2.nbytes()) // self.experts_per_rank
        return used * per

    def describe(self) -> dict:
        return {"rank": self.rank, "world_size": self.world_size, "experts": [self.expert_start, self.expert_end],
                "num_experts": self.config.num_experts, "backend": self.backend.name, "device": str(self.device)}

    def __repr__(self) -> str:
        c = self.config
        return (f"ExpertParallelMoE(rank {self.rank}/{self.world_size}, experts [{self.expert_start}, "
                f"{self.expert_end}) of {c.num_experts}, H={c.hidden_size}, I={c.intermediate_size}, k={c.top_k}, "
                f"{c.act_mode}, backend={self.backend.name})")


# ------------------------------------------------------------------------------------------
# tensor parallelism: partition of the intermediate dimension
# ------------------------------------------------------------------------------------------

def intermediate_range(intermediate_size: int, world_size: int, rank: int, what: str = "intermediate size"
                       ) -> tuple[int, int]:
    """``(start, end)`` of the intermediate columns rank ``rank`` of ``world_size`` holds.

    Raises ValueError when ``intermediate_size / world_size`` is not a whole number of
    16-value NVFP4 blocks.
    """
    if world_size <= 0 or not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not in a world of size {world_size}")
    if intermediate_size % (16 * world_size):
        per = intermediate_size / world_size
        raise ValueError(f"tensor parallelism needs the {what} split into whole 16-value NVFP4 blocks per rank: "
                         f"{intermediate_size} on {world_size} ranks gives {per:g} per rank, not a multiple of 16")
    per = intermediate_size // world_size
    return rank * per, (rank + 1) * per


def tp_local_config(cfg: MoEConfig, world_size: int) -> MoEConfig:
    """The config of one rank's slice: intermediate size ``I / W`` (and the shared expert's width
    ``/ W``); routing, activation mode and everything else as ``cfg``."""
    _, per = intermediate_range(cfg.intermediate_size, world_size, 0)
    kw = {"intermediate_size": per}
    if cfg.n_shared_experts and cfg.shared_intermediate_size:
        kw["shared_intermediate_size"] = intermediate_range(cfg.shared_intermediate_size, world_size, 0,
                                                            "shared expert's width")[1]
    return cfg.with_(**kw)


def _own(t: torch.Tensor) -> torch.Tensor:
    """A contiguous copy that owns exactly its bytes (so the rest of the source can be freed)."""
    return t.clone(memory_format=torch.contiguous_format)


def _halves(t: torch.Tensor, dim: int, start: int, end: int) -> torch.Tensor:
    """Rows ``[start, end)`` of each half of dimension ``dim`` (gate rows, then up rows)."""
    half = t.shape[dim] // 2
    return torch.cat([t.narrow(dim, start, end - start), t.narrow(dim, half + start, end - start)], dim=dim)


def _columns(t: torch.Tensor, start: int, end: int, values_per_element: int) -> torch.Tensor:
    """Columns ``[start, end)`` (in values) of the last dimension: packed E2M1 holds 2 values a
    byte, a block scale 16."""
    a, b = start // values_per_element, end // values_per_element
    return _own(t[..., a:b])


def _slice_gate_up(w, start: int, end: int, dim: int):
    if isinstance(w, nvfp4.NVFP4Tensor):
        return nvfp4.NVFP4Tensor(_halves(w.data, dim, start, end), _halves(w.scale, dim, start, end),
                                 _own(w.global_scale))
    return _halves(w, dim, start, end)


def _slice_down(w, start: int, end: int):
    if isinstance(w, nvfp4.NVFP4Tensor):
        return nvfp4.NVFP4Tensor(_columns(w.data, start, end, 2), _columns(w.scale, start, end, nvfp4.BLOCK),
                                 _own(w.global_scale))
    return _columns(w, start, end, 1)


def tp_slice_weights(weights: MoEWeights, rank: int, world_size: int) -> MoEWeights:
    """Rank ``rank``'s slice (of ``world_size``) of full in-memory ``weights``, as copies: every
    expert's gate and up rows and down columns ``[r*I/W, (r+1)*I/W)`` with their block scales,
    the global and input scales whole; the shared expert sliced alike (its own width); router,
    correction bias and hash table whole. Every other field is kept as it is."""
    if weights.b13 is not None or weights.b2 is not None:
        raise ValueError("tensor parallelism does not slice expert biases (b13, b2; gpt-oss) yet; serve this layer "
                         "whole (one process) or with expert parallelism instead")
    i = weights.w2.data.shape[-1] * 2
    start, end = intermediate_range(i, world_size, rank)
    kw = {"w13": _slice_gate_up(weights.w13, start, end, 1), "w2": _slice_down(weights.w2, start, end)}
    if weights.shared_gate_up is not None:
        sd = weights.shared_down
        shared = sd.data.shape[-1] * 2 if isinstance(sd, nvfp4.NVFP4Tensor) else sd.shape[-1]
        s0, s1 = intermediate_range(shared, world_size, rank, "shared expert's width")
        kw["shared_gate_up"] = _slice_gate_up(weights.shared_gate_up, s0, s1, 0)
        kw["shared_down"] = _slice_down(weights.shared_down, s0, s1)
    return replace(weights, **kw)


# ------------------------------------------------------------------------------------------
# tensor parallelism: each rank reads its slices from the files
# ------------------------------------------------------------------------------------------

_SAFETENSORS_DTYPES = {"U8": torch.uint8, "I8": torch.int8, "F8_E4M3": torch.float8_e4m3fn,
                       "F8_E5M2": torch.float8_e5m2, "BF16": torch.bfloat16, "F16": torch.float16,
                       "F32": torch.float32, "F64": torch.float64, "I16": torch.int16, "I32": torch.int32,
                       "I64": torch.int64, "BOOL": torch.bool}

_PROJ_TENSOR = r"(?:weight|weight_packed|weight_scale)"
#: (pattern of a tensor's name after the layer prefix, how it is sliced, routed expert tensor?)
_TP_SLICED = (
    (re.compile(rf"experts\.\d+\.(?:gate_proj|up_proj|w1|w3)\.{_PROJ_TENSOR}"), "rows", True),
    (re.compile(rf"experts\.\d+\.(?:down_proj|w2)\.{_PROJ_TENSOR}"), "columns", True),
    (re.compile(r"w13_weight(?:_scale)?"), "halves", True),
    (re.compile(r"w2_weight(?:_scale)?"), "columns", True),
    (re.compile(r"experts\.(?:gate_up_proj|down_proj)"), "float-experts", True),
    (re.compile(rf"shared_experts\.(?:gate_proj|up_proj|w1|w3)\.{_PROJ_TENSOR}"), "rows", False),
    (re.compile(r"shared_experts\.gate_up_proj\.weight"), "halves", False),
    (re.compile(rf"shared_experts\.(?:down_proj|w2)\.{_PROJ_TENSOR}"), "columns", False),
)


def _tp_kind(name: str, prefix: str) -> tuple[str, bool] | None:
    """How tensor ``name`` of the layer at ``prefix`` is sliced under TP, or None (read whole)."""
    if not name.startswith(prefix):
        return None
    rest = name[len(prefix):]
    for pat, kind, routed in _TP_SLICED:
        if pat.fullmatch(rest):
            return kind, routed
    return None


class TensorSliceCheckpoint(checkpoint.OpenCheckpoint):
    """One rank's view of an open checkpoint under tensor parallelism: :meth:`get` and
    :meth:`get_rows` return only the rank's slice of every expert tensor of the layer at
    ``prefix`` (and of its shared expert), read from the files with safetensors ``get_slice``;
    everything else whole. :meth:`shape` gives the slice's shape. The loader
    (:func:`megamoe.checkpoint.load_open`) reads through it unchanged.

    Sliced: the gate and up rows ``[r*I/W, (r+1)*I/W)`` (``experts.{e}.{gate,up}_proj`` /
    ``w1`` / ``w3``; in a fused ``w13_weight`` those rows of each half, or the matching
    ``2*I/W`` contiguous rows of an interleaved one), the down columns (``down_proj`` /
    ``w2`` / ``w2_weight``) in whole 16-value blocks, and their FP8 block scales alike.
    Whole: global scales (``weight_scale_2``, ``weight_global_scale``), input scales, router,
    correction bias, hash table. ``bytes_read`` counts what was read.

    Args:
        ck: the open checkpoint (:func:`megamoe.checkpoint.open_checkpoint`).
        prefix: the MoE layer's tensor-name prefix.
        rank, world_size: this rank of the TP group.
        w13_layout: row order of a fused ``w13_weight`` (``megamoe.checkpoint.W13_LAYOUTS``).
        cache: tensors read whole already (name -> tensor), returned instead of read again.
    """

    def __init__(self, ck: checkpoint.OpenCheckpoint, prefix: str, rank: int, world_size: int,
                 w13_layout: str = "gate-up", cache: dict | None = None) -> None:
        super().__init__(ck.path, ck._handles)
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not in a world of size {world_size}")
        if w13_layout not in checkpoint.W13_LAYOUTS:
            raise ValueError(f"w13_layout={w13_layout!r}: expected one of {checkpoint.W13_LAYOUTS}")
        self.prefix, self.rank, self.world_size, self.w13_layout = prefix, rank, world_size, w13_layout
        self._cache = {} if cache is None else cache

    def sliced(self, name: str) -> bool:
        """Whether tensor ``name`` is read as this rank's slice."""
        return _tp_kind(name, self.prefix) is not None

    def _file_shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._file(name).get_slice(name).get_shape())

    def _plan(self, name: str) -> tuple[int, list[tuple[int, int]]] | None:
        """``(dim, [(start, end), ...])``: the index ranges of dimension ``dim`` that make the slice
        (two for the halves of a gate/up tensor); None: read whole."""
        kind = _tp_kind(name, self.prefix)
        if kind is None:
            return None
        kind, routed = kind
        sl = self._file(name).get_slice(name)
        shape, dtype = tuple(sl.get_shape()), sl.get_dtype()
        packed = dtype == "U8"
        if routed and not packed and not dtype.startswith("F8"):
            raise checkpoint.CheckpointError(
                f"{name}: expert weights stored in {dtype}: tensor parallelism reads NVFP4 expert weights only (a "
                f"float expert is quantized at load with a global scale of the whole tensor, which one rank's "
                f"slice does not see); quantize the checkpoint to NVFP4 first")
        if kind == "float-experts":  # (only reached for a packed tensor under this name)
            raise checkpoint.CheckpointError(f"{name}: dtype {dtype}: not an expert tensor megamoe reads")
        per_value = 16 if dtype.startswith("F8") else (2 if packed else 1)
        w = self.world_size
        if kind == "columns":
            dim = len(shape) - 1
            k = shape[dim] * per_value
            a, b = intermediate_range(k, w, self.rank, f"K of {name}")
            return dim, [(a // per_value, b // per_value)]
        dim = len(shape) - 2  # rows: [I, K] per expert, [E, 2I, K] fused, [2Is, K] shared
        n = shape[dim]
        if kind == "rows":
            a, b = intermediate_range(n, w, self.rank, f"rows of {name}")
            return dim, [(a, b)]
        if n % 2:
            raise checkpoint.CheckpointError(f"{name}: {n} rows do not split into gate and up halves")
        a, b = intermediate_range(n // 2, w, self.rank, f"gate/up rows of {name}")
        if self.w13_layout == "interleaved" and routed:  # [g0, u0, g1, u1, ...]: pairs a..b-1
            return dim, [(2 * a, 2 * b)]
        return dim, [(a, b), (n // 2 + a, n // 2 + b)]

    def shape(self, name: str) -> tuple[int, ...]:
        """The shape :meth:`get` returns (this rank's slice), from the header; reads no data."""
        shape = list(self._file_shape(name))
        plan = self._plan(name)
        if plan is not None:
            dim, ranges = plan
            shape[dim] = sum(b - a for a, b in ranges)
        return tuple(shape)

    def _read(self, name: str, lead: tuple[int, int] | None = None) -> torch.Tensor:
        if lead is None and name in self._cache:  # (the loader may ask for a tensor twice)
            return self._cache[name]
        plan = self._plan(name)
        if plan is None:
            if lead is None:
                self._cache[name] = super().get(name)
                return self._cache[name]
            return super().get_rows(name, *lead)
        dim, ranges = plan
        sl = self._file(name).get_slice(name)
        ndim = len(self._file_shape(name))
        parts = []
        for a, b in ranges:
            key = [slice(None)] * ndim
            if lead is not None:
                key[0] = slice(*lead)
            key[dim] = slice(a, b)
            parts.append(sl[tuple(key)])
        t = _own(parts[0]) if len(parts) == 1 else torch.cat(parts, dim=dim)
        self.bytes_read[name] = self.bytes_read.get(name, 0) + t.numel() * t.element_size()
        if lead is None:
            self._cache[name] = t
        return t

    def get(self, name: str) -> torch.Tensor:
        """This rank's slice of an expert tensor; any other tensor whole."""
        return self._read(name)

    def get_rows(self, name: str, start: int, end: int) -> torch.Tensor:
        """Rows ``[start, end)`` of the first dimension (an expert range), of this rank's slice."""
        return self._read(name, (start, end))


class _ShapesOnly(checkpoint.OpenCheckpoint):
    """A view that reads no expert weights: every tensor TP would slice is returned as zeros of
    its full shape and dtype (the loader then checks names, shapes, dtypes and the real global
    and input scales); the rest is read (and cached for the sliced read that follows)."""

    def __init__(self, ck: checkpoint.OpenCheckpoint, prefix: str, cache: dict) -> None:
        super().__init__(ck.path, ck._handles)
        self.prefix, self._cache = prefix, cache

    def _zeros(self, name: str, lead: tuple[int, int] | None = None) -> torch.Tensor:
        sl = self._file(name).get_slice(name)
        shape = list(sl.get_shape())
        if lead is not None:
            shape[0] = lead[1] - lead[0]
        return torch.zeros(shape, dtype=_SAFETENSORS_DTYPES.get(sl.get_dtype(), torch.float32))

    def get(self, name: str) -> torch.Tensor:
        if _tp_kind(name, self.prefix) is not None:
            return self._zeros(name)
        if name not in self._cache:
            self._cache[name] = super().get(name)
        return self._cache[name]

    def get_rows(self, name: str, start: int, end: int) -> torch.Tensor:
        if _tp_kind(name, self.prefix) is not None:
            return self._zeros(name, (start, end))
        return super().get_rows(name, start, end)


@dataclass
class TensorShardLoadReport:
    """What :func:`load_tp_shard` read: the rank's intermediate columns and the bytes of sliced
    tensors (routed and shared experts); ``load`` is the loader's report of the layer (format,
    choices, routing, warnings) and ``tensors`` the tensors of the sliced read."""

    path: str
    rank: int
    world_size: int
    intermediate_start: int
    intermediate_end: int
    intermediate_size: int
    layout: str = "fused"
    prefix: str = ""
    sliced_bytes_read: int = 0       # bytes of sliced tensors (routed + shared experts) this rank read
    sliced_bytes_in_file: int = 0    # bytes of those tensors in the checkpoint
    replicated_bytes_read: int = 0   # scales, router, bias, hash table
    tensors: dict[str, str] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)
    load: checkpoint.LoadReport | None = None

    def summary(self) -> str:
        return (f"rank {self.rank}/{self.world_size}: intermediate [{self.intermediate_start}, "
                f"{self.intermediate_end}) of {self.intermediate_size} from {self.path} ({self.layout}); read "
                f"{self.sliced_bytes_read} of {self.sliced_bytes_in_file} expert bytes, "
                f"{self.replicated_bytes_read} replicated bytes")


@dataclass
class TensorShardLoaded:
    weights: MoEWeights   # this rank's slices; router etc. whole
    config: MoEConfig     # the layer's (global) config
    report: TensorShardLoadReport


#: Architectures whose layer tensor parallelism cannot slice yet, and why.
TP_UNSUPPORTED = {
    "qwen2_moe": "Qwen2-MoE's singular shared_expert and its sigmoid shared_expert_gate",
    "llama4": "Llama 4's singular shared_expert, its transposed fused experts and the router weight on the input",
    "llama4_text": "Llama 4's singular shared_expert, its transposed fused experts and the router weight on the input",
    "gpt_oss": "gpt-oss's expert biases (gate_up_proj_bias, down_proj_bias) and its transposed fused experts",
}


def load_tp_shard(path, rank: int, world_size: int, *, device="cpu", **load_kw) -> TensorShardLoaded:
    """Load rank ``rank``'s slice (of ``world_size``) of every expert of one NVFP4 MoE layer.

    The checkpoint loader itself (:func:`megamoe.checkpoint.load_open`, files opened once), in
    two passes over :class:`megamoe.checkpoint.OpenCheckpoint` views: first with expert 0's
    weights as zeros of their shape (no weight bytes read), which settles the format, the
    layout and the layer's config with every check of :func:`megamoe.checkpoint.load`; then
    through :class:`TensorSliceCheckpoint` with the rank's config (:func:`tp_local_config`),
    which reads this rank's slices only. ``load_kw``: the loader's keyword arguments.

    Raises:
        ValueError: I (or the shared expert's width) not divisible into 16-value blocks per rank.
        CheckpointError: as :func:`megamoe.checkpoint.load`; expert weights in a float dtype.
    """
    load_kw = dict(load_kw)
    cfg_json = Path(path) / "config.json"
    if cfg_json.is_file():
        hf = json.loads(cfg_json.read_text())
        mt = hf.get("model_type")
        if mt in TP_UNSUPPORTED:
            raise checkpoint.CheckpointError(f"{path}: model_type={mt!r}: tensor parallelism does not slice "
                                             f"{TP_UNSUPPORTED[mt]} yet; serve this layer whole (one process) instead")
    with checkpoint.open_checkpoint(path) as ck:
        prefix, layout, _ = checkpoint.layer_experts(ck, load_kw.pop("layer", None), load_kw.pop("prefix", None))
        cache: dict = {}
        input_scales = load_kw.pop("input_scales", "per-expert")
        shapes_only = _ShapesOnly(ck, prefix, cache)
        first = checkpoint.load_open(shapes_only, experts=(0, 1), prefix=prefix, input_scales="per-expert", **load_kw)
        cfg, rep = first.config, first.report
        if cfg.shared_expert_gate or cfg.router_weight_on_input or first.weights.b13 is not None \
                or first.weights.b2 is not None:
            what = ("a gated shared expert" if cfg.shared_expert_gate else "the router weight applied on the input"
                    if cfg.router_weight_on_input else "expert biases")
            raise checkpoint.CheckpointError(f"{path}: tensor parallelism does not slice {what} yet; serve this "
                                             f"layer whole (one process) instead")
        if rep.quantized_at_load:
            raise checkpoint.CheckpointError(
                f"{rep.quantized_at_load[0]}: stored in a float dtype: tensor parallelism reads NVFP4 weights only "
                f"(a float tensor is quantized at load with a global scale of the whole tensor, which one rank's "
                f"slice does not see); quantize the checkpoint to NVFP4 first")
        start, end = intermediate_range(cfg.intermediate_size, world_size, rank)
        local_cfg = tp_local_config(cfg, world_size)
        w13_layout = rep.w13_layout if rep.w13_layout in checkpoint.W13_LAYOUTS else "gate-up"
        view = TensorSliceCheckpoint(ck, prefix, rank, world_size, w13_layout=w13_layout, cache=cache)
        loaded = checkpoint.load_open(view, prefix=prefix, config=local_cfg, input_scales=input_scales,
                                      w13_layout=load_kw.get("w13_layout"), device=device, act_mode=local_cfg.act_mode)
        sliced = [n for n in ck.names() if view.sliced(n)]
        report = TensorShardLoadReport(
            path=str(ck.path), rank=rank, world_size=world_size, intermediate_start=start, intermediate_end=end,
            intermediate_size=cfg.intermediate_size, layout=layout, prefix=prefix,
            sliced_bytes_read=sum(view.bytes_read.get(n, 0) for n in sliced),
            sliced_bytes_in_file=sum(ck.nbytes(n) for n in sliced),
            replicated_bytes_read=sum(b for bytes_read in (shapes_only.bytes_read, view.bytes_read)
                                      for n, b in bytes_read.items() if not view.sliced(n)),
            tensors=dict(loaded.report.tensors), warnings=list(rep.warnings) + list(loaded.report.warnings),
            load=rep)
    return TensorShardLoaded(loaded.weights, cfg, report)


# ------------------------------------------------------------------------------------------
# tensor parallelism: the deterministic sum and the layer
# ------------------------------------------------------------------------------------------

def sum_over_ranks(partial: torch.Tensor, group=None) -> torch.Tensor:
    """``sum_r partial_r`` of every rank's ``[T, H]`` float32 partial, the same bits on every rank.

    A reduce-scatter by ``all_to_all_single`` (rows in ``W`` chunks of ``ceil(T/W)``; rank
    ``q`` receives every rank's chunk ``q``) summed in ascending rank order, then
    ``all_gather`` of the summed chunks: a fixed order of additions, whatever the collective
    library does, with the traffic of a ring all-reduce. Collective: every rank of ``group``
    calls it with the same ``T``.
    """
    world = dist.get_world_size(group)
    if world == 1:
        return partial
    t, h = partial.shape
    c = -(-t // world)
    send = partial.new_zeros((world * c, h))
    send[:t] = partial
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    blocks = recv.view(world, c, h)
    acc = blocks[0].clone()
    for q in range(1, world):  # ascending rank order
        acc += blocks[q]
    parts = [torch.empty_like(acc) for _ in range(world)]
    dist.all_gather(parts, acc, group=group)
    return torch.cat(parts)[:t]


class TensorParallelMoE(MoELayer):
    """An NVFP4 MoE layer whose every expert is split over the ranks of ``group`` along its
    intermediate dimension (tensor parallelism; see the module documentation).

    Same interface as :class:`MoELayer`, but ``forward`` is a *collective*: every rank of the
    group calls it with the *same* tokens (and routing inputs) and gets the same output, the
    ordered sum of every rank's partial (:func:`sum_over_ranks`). ``weights`` holds this
    rank's slices (:func:`load_tp_shard` or :func:`tp_slice_weights`) and the router whole.

    Args:
        weights: this rank's slices + replicated router.
        config: the layer's global config (``intermediate_size`` = I of the whole layer).
        group: process group (None: the default group).
        backend / device: the local backend, as for :class:`MoELayer`.
    """

    def __init__(self, weights: MoEWeights, config: MoEConfig, *, group=None, backend: str | Backend = "auto",
                 device=None) -> None:
        if not dist.is_initialized():
            raise RuntimeError("TensorParallelMoE needs torch.distributed initialised (see init_distributed)")
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.intermediate_start, self.intermediate_end = intermediate_range(config.intermediate_size,
                                                                            self.world_size, self.rank)
        super().__init__(weights, config, backend=backend, device=device)
        self.last_stats: dict = {}

    def _check_weights(self, weights: MoEWeights, config: MoEConfig) -> None:
        local = tp_local_config(config, self.world_size)
        try:
            weights.validate(local)
        except ValueError as exc:
            raise ValueError(f"rank {self.rank} of {self.world_size}: the weights are not one rank's slice of this "
                             f"layer (I = {config.intermediate_size}, {local.intermediate_size} per rank): {exc}") from None

    @property
    def local_config(self) -> MoEConfig:
        """What the local backend sees: intermediate size ``I / W`` (follows ``config``)."""
        return tp_local_config(self.config, self.world_size)

    # ------------------------------------------------------------------ builders
    @classmethod
    def from_preset(cls, preset: str, seed: int = 0, backend: str | Backend = "auto", device=None, group=None,
                    **config_overrides) -> "TensorParallelMoE":
        """Synthetic weights (every rank generates the same full set, keeps its slices)."""
        cfg = get_preset(preset).with_(**config_overrides) if config_overrides else get_preset(preset)
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        tp_local_config(cfg, world)  # fail before synthesizing
        be = get_backend(backend, device=device)
        full = checkpoint.synthetic_weights(cfg, seed=seed, device=be.device)
        local = tp_slice_weights(full, rank, world)
        del full
        return cls(local, cfg, group=group, backend=be)

    @classmethod
    def from_checkpoint(cls, path, backend: str | Backend = "auto", device=None, group=None,
                        **load_kw) -> "TensorParallelMoE":
        """This rank's slices of a checkpoint (:func:`load_tp_shard`)."""
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        loaded = load_tp_shard(path, rank, world, **load_kw)
        layer = cls(loaded.weights, loaded.config, group=group, backend=backend, device=device)
        layer.load_report = loaded.report
        return layer

    # ------------------------------------------------------------------ forward
    def _check_replicated(self, x: torch.Tensor) -> None:
        """Every rank was given the same tokens (row count and two checksums); else ValueError on
        every rank. Collective."""
        xf = x.detach().to(self.device, torch.float64)
        pos = torch.arange(1, xf.shape[0] + 1, dtype=torch.float64, device=self.device).unsqueeze(1)
        mine = torch.stack([torch.tensor(float(xf.shape[0]), dtype=torch.float64, device=self.device),
                            xf.sum(), (xf * pos).sum()])
        every = [torch.empty_like(mine) for _ in range(self.world_size)]
        dist.all_gather(every, mine, group=self.group)
        differ = [q for q in range(self.world_size) if not torch.equal(every[q], every[0])]
        if differ:
            rows = [int(v[0]) for v in every]
            raise ValueError(f"tensor parallelism needs the same hidden_states on every rank: ranks {differ} differ "
                             f"from rank 0 (rows per rank: {rows})")

    def forward(self, hidden_states: torch.Tensor, topk_ids: torch.Tensor | None = None,
                topk_weights: torch.Tensor | None = None, router_logits: torch.Tensor | None = None,
                validate: bool = True, input_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Collective MoE forward (arguments as :meth:`MoELayer.forward`); every rank passes the same
        inputs and returns the same ``[T, H]``, in the dtype of ``hidden_states``. ``validate`` also
        checks, with one small collective, that every rank was given the same hidden states."""
        if validate:
            self._check_inputs(hidden_states, topk_ids, topk_weights, router_logits, input_ids)
            self._check_replicated(hidden_states)
        x = hidden_states.to(self.device)
        if x.shape[0] == 0:
            return torch.zeros_like(x)
        topk_ids, topk_weights = self._routing(x, topk_ids, topk_weights, router_logits, input_ids)
        y = sum_over_ranks(self.partial_forward(x, topk_ids, topk_weights), self.group)
        self.last_stats = {"tokens": int(x.shape[0]), "rows_summed_here": -(-int(x.shape[0]) // self.world_size)}
        return y.to(hidden_states.dtype)

    __call__ = forward

    def partial_forward(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        """This rank's share of the output, float32 ``[T, H]``: its slices of the routed experts
        (weighted, summed in ascending expert order by the backend) plus its slice of the shared
        expert. No collective."""
        y = self.backend.moe_forward(self._prepared, self.local_config, x, topk_ids, topk_weights,
                                     self.batch_invariant).float()
        if self.config.n_shared_experts:
            y = y + self._shared_expert(x)
        return y

    def reference_bf16(self, hidden_states: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        """The bf16 yardstick of :meth:`MoELayer.reference_bf16` on this rank's slices, summed over
        the ranks like :meth:`forward` (collective; every rank passes the same inputs)."""
        partial = super().reference_bf16(hidden_states, *args, **kwargs)
        return partial if partial.shape[0] == 0 else sum_over_ranks(partial, self.group)

    def describe(self) -> dict:
        return {"rank": self.rank, "world_size": self.world_size,
                "intermediate": [self.intermediate_start, self.intermediate_end],
                "intermediate_size": self.config.intermediate_size, "backend": self.backend.name,
                "device": str(self.device)}

    def __repr__(self) -> str:
        c = self.config
        return (f"TensorParallelMoE(rank {self.rank}/{self.world_size}, intermediate [{self.intermediate_start}, "
                f"{self.intermediate_end}) of I={c.intermediate_size}, H={c.hidden_size}, E={c.num_experts}, "
                f"k={c.top_k}, {c.act_mode}, backend={self.backend.name})")


# ------------------------------------------------------------------------------------------
# health: every rank runs docs/SPEC.md §5, plus one collective check of dispatch/combine
# ------------------------------------------------------------------------------------------

def check_ep_dispatch_combine(layer: ExpertParallelMoE, seed: int) -> dict:
    """The all-to-all path against an all-reduce path, on this layer's weights.

    Every rank draws its own random tokens (a prime count that differs per rank, one rank
    with none when W > 1) and routing skewed so some ranks receive nothing from some
    sources. Reference: every rank computes its experts' contribution for *all* tokens
    (all-gathered) and the contributions are summed with ``all_reduce``; no all-to-all.
    Collective: every rank must run it.
    """
    t0 = time.perf_counter()
    cfg, w, r = layer.config, layer.world_size, layer.rank
    gen = torch.Generator().manual_seed(seed * 1000003 + r)
    counts = [0 if (w > 1 and q == w - 1) else (13, 31, 7, 61, 3, 17, 41, 29)[q % 8] for q in range(w)]
    t = counts[r]
    x = torch.randn((t, cfg.hidden_size), generator=gen).to(torch.bfloat16)
    # skewed routing: half the tokens choose only among the first rank's experts
    scores = torch.rand((t, cfg.num_experts), generator=gen)
    scores[: t // 2, layer.experts_per_rank:] -= 2.0
    tw, ids = scores.topk(cfg.top_k, dim=1)
    ids = ids.to(torch.int32)
    tw = (tw.abs() + 0.1) / (tw.abs() + 0.1).sum(1, keepdim=True)
    try:
        out = layer.routed_experts(x.to(layer.device), ids.to(layer.device), tw.to(layer.device)).cpu()
        # reference: every token on every rank, this rank's contribution, all-reduce
        tmax = max(counts)
        xs, idss, tws = (_all_gather_padded(v, tmax, layer) for v in (x, ids, tw))
        x_all = torch.cat([xs[q][: counts[q]] for q in range(w)]).to(layer.device)
        ids_all = torch.cat([idss[q][: counts[q]] for q in range(w)]).to(layer.device).long()
        tw_all = torch.cat([tws[q][: counts[q]] for q in range(w)]).to(layer.device)
        local = ids_all - layer.expert_start
        mine = (local >= 0) & (local < layer.experts_per_rank)
        contrib = layer.local_experts(x_all, torch.where(mine, local, torch.full_like(local, -1)),
                                      torch.where(mine, tw_all, torch.zeros_like(tw_all)))
        dist.all_reduce(contrib, group=layer.group)
        ref = contrib[sum(counts[:r]): sum(counts[:r]) + t].cpu()
        if t == 0:
            c, e = 1.0, 0.0
            ok = out.shape == (0, cfg.hidden_size)
        else:
            c, e = health.cosine(out, ref), health.rel_err(out, ref)
            ok = c >= EP_THRESHOLD_COSINE
        status, metric = ("pass" if ok else "fail"), c
        detail = (f"{t} tokens (per rank {counts}), skewed routing; all-to-all vs all-gather + "
                  f"all-reduce: cosine {c:.7f}, rel err {e:.2e}; sent {layer.last_stats.get('send_splits')}, "
                  f"received {layer.last_stats.get('recv_splits')}")
    except Exception as exc:  # noqa: BLE001 - reported as a failed check with the reason
        status, metric, detail = "fail", None, f"{type(exc).__name__}: {exc}"
    return {"name": "ep_dispatch_combine", "status": status, "metric": metric, "threshold": EP_THRESHOLD_COSINE,
            "detail": detail, "duration_ms": round((time.perf_counter() - t0) * 1e3, 2)}


def check_tp_partial_sum(layer: "TensorParallelMoE", seed: int) -> dict:
    """The ordered sum over ranks against ``all_reduce`` of the same partials, on this layer's weights;
    every rank's output bit-identical; the router's choice identical on every rank.

    Every rank draws the same random tokens (37 rows, float32) and routing. Collective: every
    rank must run it.
    """
    t0 = time.perf_counter()
    cfg, w = layer.config, layer.world_size
    gen = torch.Generator().manual_seed(seed * 1000003 + 7)
    t = 37
    # float32 activations (bf16-representable): the sum is compared in float32, not after a bf16 rounding
    x = torch.randn((t, cfg.hidden_size), generator=gen).to(torch.bfloat16).float().to(layer.device)
    ids = torch.rand((t, cfg.num_experts), generator=gen).argsort(dim=1)[:, : cfg.top_k].to(torch.int32)
    tw = torch.rand((t, cfg.top_k), generator=gen) + 0.05
    ids, tw = ids.to(layer.device), (tw / tw.sum(1, keepdim=True)).to(layer.device)
    try:
        out = layer.forward(x, ids, tw, validate=False).float()
        ref = layer.partial_forward(x, ids, tw).contiguous()
        dist.all_reduce(ref, group=layer.group)
        outs = [torch.empty_like(out) for _ in range(w)]
        dist.all_gather(outs, out.contiguous(), group=layer.group)
        differ = [q for q in range(w) if not torch.equal(outs[q], outs[0])]
        route_note, route_differ = "caller's routing (no router)", []
        if layer.weights.router_weight is not None and not getattr(cfg, "hash_routing", False):
            _, mine = layer.route(x)
            mine = mine.to(torch.int32).contiguous()
            every = [torch.empty_like(mine) for _ in range(w)]
            dist.all_gather(every, mine, group=layer.group)
            route_differ = [q for q in range(w) if not torch.equal(every[q], every[0])]
            route_note = "router's choice identical on every rank" if not route_differ else \
                f"router's choice differs from rank 0's on ranks {route_differ}"
        c, e = health.cosine(out, ref), health.rel_err(out, ref)
        ok = c >= TP_THRESHOLD_COSINE and not differ and not route_differ
        status, metric = ("pass" if ok else "fail"), c
        detail = (f"{t} tokens on {w} ranks, I {layer.intermediate_end - layer.intermediate_start} per rank; ordered "
                  f"sum vs all_reduce: cosine {c:.7f}, rel err {e:.2e}; output "
                  + ("bit-identical on every rank" if not differ else f"differs from rank 0's on ranks {differ}")
                  + f"; {route_note}")
    except Exception as exc:  # noqa: BLE001 - reported as a failed check with the reason
        status, metric, detail = "fail", None, f"{type(exc).__name__}: {exc}"
    return {"name": "tp_partial_sum", "status": status, "metric": metric, "threshold": TP_THRESHOLD_COSINE,
            "detail": detail, "duration_ms": round((time.perf_counter() - t0) * 1e3, 2)}


def global_rank(group, group_rank: int) -> int:
    """The global rank of ``group_rank`` in ``group`` (None: the default group), as collectives' src/dst want."""
    return group_rank if group is None else dist.get_global_rank(group, group_rank)


def _all_gather_padded(v: torch.Tensor, tmax: int, layer: ExpertParallelMoE) -> list[torch.Tensor]:
    """Every rank's ``v`` (``[t_r, n]``, t_r <= tmax) padded to ``tmax`` rows, on the CPU."""
    pad = torch.zeros((tmax, v.shape[1]), dtype=v.dtype, device=layer.device)
    pad[: v.shape[0]] = v.to(layer.device)
    parts = [torch.empty_like(pad) for _ in range(layer.world_size)]
    dist.all_gather(parts, pad, group=layer.group)
    return [q.cpu() for q in parts]


def merge_rank_reports(reports: list[dict]) -> dict:
    """One report of every rank's docs/SPEC.md §5 reports.

    ``checks`` has one entry per check name (as a single-process report does, so
    dashboards keyed by check name keep working): ``fail`` if any rank failed,
    ``skip`` only if every rank skipped, the worst rank's metric, and which ranks failed;
    ``ranks`` keeps every rank's full report.
    """
    merged: dict[str, dict] = {}
    for rep in reports:
        for c in rep["checks"]:
            m = merged.setdefault(c["name"], {"name": c["name"], "statuses": [], "metrics": [], "threshold":
                                              c["threshold"], "details": [], "duration_ms": 0.0})
            m["statuses"].append((rep["rank"], c["status"]))
            m["metrics"].append(c["metric"])
            m["details"].append(c["detail"])
            m["duration_ms"] = max(m["duration_ms"], c["duration_ms"])
    checks = []
    for name, m in merged.items():
        sts = [s for _, s in m["statuses"]]
        failed = [rk for rk, s in m["statuses"] if s == "fail"]
        status = "fail" if failed else ("skip" if all(s == "skip" for s in sts) else "pass")
        nums = [v for v in m["metrics"] if isinstance(v, (int, float)) and not isinstance(v, bool)]
        metric = None
        if nums:
            # an integer metric counts bad things (bigger is worse); a float one is a cosine
            metric = max(nums) if all(isinstance(v, int) for v in nums) else min(nums)
        if len(nums) != len(m["metrics"]) and failed:
            metric = None  # a rank crashed in this check: no worst value to show
        if failed:
            why = " | ".join(f"rank {rk}: {m['details'][i]}" for i, (rk, s) in enumerate(m["statuses"]) if s == "fail")
            detail = f"{len(sts)} ranks, failed on ranks {failed}: {why[:2000]}"
        else:
            detail = f"{len(sts)} ranks; rank {m['statuses'][0][0]}: {m['details'][0]}"
        checks.append({"name": name, "status": status, "metric": metric, "threshold": m["threshold"],
                       "detail": detail, "duration_ms": m["duration_ms"]})
    first = reports[0]
    return {"status": "fail" if any(r["status"] == "fail" for r in reports) else "pass",
            "level": first["level"], "backend": first["backend"], "device": first["device"], "seed": first["seed"],
            "versions": first["versions"], "world_size": len(reports), "checks": checks,
            "ranks": reports, "duration_ms": max(r["duration_ms"] for r in reports)}


def run_checks_all_ranks(layer: "ExpertParallelMoE | TensorParallelMoE", level: str = "quick",
                         seed: int | None = None, dst: int = 0) -> dict | None:
    """docs/SPEC.md §5 on every rank (:func:`megamoe.health.run_checks` with the rank's backend) plus
    ``ep_dispatch_combine`` (expert parallelism) or ``tp_partial_sum`` (tensor parallelism);
    gathered on rank ``dst``. Collective: every rank calls it.

    Returns the merged report (:func:`merge_rank_reports`) on ``dst``, None elsewhere.
    """
    if seed is None:  # one fresh seed for all ranks (each check then offsets it by the rank)
        seed_t = torch.randint(0, 2**31 - 1, (1,), dtype=torch.int64).to(layer.device)
        dist.broadcast(seed_t, src=global_rank(layer.group, 0), group=layer.group)
        seed = int(seed_t)
    report = health.run_checks(level=level, backend=layer.backend, seed=seed + layer.rank)
    t0 = time.perf_counter()
    tp = isinstance(layer, TensorParallelMoE)
    report["checks"].append(check_tp_partial_sum(layer, seed) if tp else check_ep_dispatch_combine(layer, seed))
    report["duration_ms"] = round(report["duration_ms"] + (time.perf_counter() - t0) * 1e3, 1)
    if report["checks"][-1]["status"] == "fail":
        report["status"] = "fail"
    report.update(rank=layer.rank, world_size=layer.world_size)
    if tp:
        report.update(intermediate=[layer.intermediate_start, layer.intermediate_end])
    else:
        report.update(experts=[layer.expert_start, layer.expert_end])
    gathered = [None] * layer.world_size if layer.rank == dst else None
    dist.gather_object(report, gathered, dst=global_rank(layer.group, dst), group=layer.group)
    return merge_rank_reports(gathered) if layer.rank == dst else None


# ------------------------------------------------------------------------------------------
# python -m megamoe.distributed
# ------------------------------------------------------------------------------------------

def _build(args, world: int) -> ExpertParallelMoE | TensorParallelMoE:
    cls = ExpertParallelMoE
    if args.tp:
        if args.tp != world:
            raise SystemExit(f"--tp {args.tp}: tensor parallelism runs over every rank of the job, which has {world}; "
                             f"launch {args.tp} processes (torchrun --nproc-per-node {args.tp}) or pass --tp {world}")
        cls = TensorParallelMoE
    if args.checkpoint:
        return cls.from_checkpoint(args.checkpoint, backend=args.backend)
    return cls.from_preset(args.preset, seed=args.seed, backend=args.backend)


def _cmd_check(args) -> int:
    """Health of every rank, then the EP/TP forward vs the single-process MoELayer on the same tokens."""
    rank, world, _ = init_distributed(args.dist_backend)
    layer = _build(args, world)
    report = run_checks_all_ranks(layer, args.level)
    status = torch.zeros(1, dtype=torch.int64)
    if rank == 0:
        print(f"{layer!r} x {world} ranks")
        print(health.format_table(report))
        status[0] = 0 if report["status"] == "pass" else 1
    if args.compare:
        tp = isinstance(layer, TensorParallelMoE)
        # EP: every rank its own tokens; TP: the same tokens on every rank
        gen = torch.Generator().manual_seed(args.seed + (0 if tp else 17 * rank))
        x = torch.randn((args.tokens, layer.config.hidden_size), generator=gen).to(torch.bfloat16)
        y = layer(x)
        xs = [x] if tp else _all_gather_padded(x, args.tokens, layer)
        ys = [y.cpu()] if tp else _all_gather_padded(y, args.tokens, layer)
        if rank == 0:
            single = (MoELayer.from_checkpoint(args.checkpoint, backend=args.backend) if args.checkpoint
                      else MoELayer.from_preset(args.preset, seed=args.seed, backend=args.backend))
            ref = single(torch.cat(xs)).float().cpu()
            err = float((torch.cat(ys).float() - ref).abs().max() / ref.abs().max())
            print(f"{'TP' if tp else 'EP'} forward vs single-process MoELayer, {len(xs)} x {args.tokens} tokens "
                  f"(bf16): max |diff| / max |ref| = {err:.3e} (limit 2^-7, one bf16 ulp)")
            if err > 2 ** -7:
                status[0] = 1
    if rank == 0 and args.json:
        print(json.dumps(report, indent=1, default=str))
    status = status.to(layer.device)
    dist.broadcast(status, src=0)
    dist.destroy_process_group()
    return int(status[0])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m megamoe.distributed", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("check", help="docs/SPEC.md §5 checks on every rank + EP dispatch/combine or the TP sum "
                                     "(run under torchrun)")
    c.add_argument("--checkpoint", default=None, help="ModelOpt NVFP4 checkpoint (default: synthetic --preset)")
    c.add_argument("--preset", default="tiny")
    c.add_argument("--seed", type=int, default=0)
    c.add_argument("--backend", default="auto", help="local backend of every rank (torch, cuda-sm90, ...)")
    c.add_argument("--dist-backend", default=None, help="gloo or nccl (default: nccl with CUDA, else gloo)")
    c.add_argument("--level", choices=("quick", "full"), default="quick")
    c.add_argument("--tp", type=int, default=0, metavar="N",
                   help="tensor parallelism over the job's N ranks (N must equal the number of processes): every "
                        "rank holds 1/N of every expert's intermediate dimension; default: expert parallelism")
    c.add_argument("--compare", action="store_true",
                   help="also compare the EP/TP forward with a single-process MoELayer on rank 0 ("
                        "rank 0 must hold every expert in memory)")
    c.add_argument("--tokens", type=int, default=37, help="tokens per rank for --compare")
    c.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    return _cmd_check(args)


if __name__ == "__main__":
    sys.exit(main())

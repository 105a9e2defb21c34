"""Expert parallelism (EP) for the MoE layer on ``torch.distributed``.

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

Launch (one process per GPU, or per CPU "rank" with gloo)::

    torchrun --nproc-per-node 2 -m megamoe.distributed check --preset tiny --backend torch
    torchrun --nproc-per-node 8 -m megamoe.distributed check --checkpoint /ckpt --level full
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from megamoe import checkpoint, health, reference
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
    "run_checks_all_ranks",
    "merge_rank_reports",
    "global_rank",
]

EP_THRESHOLD_COSINE = 0.9999  # EP dispatch/combine vs the all-reduce path (same NVFP4 weights and inputs)


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
    return MoEWeights(w13=w.w13, w2=w.w2, w13_input_scale=w.w13_input_scale, w2_input_scale=w.w2_input_scale)


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
                validate: bool = True) -> torch.Tensor:
        """Collective MoE forward of this rank's tokens (see :meth:`MoELayer.forward` for the arguments).

        Every rank of the group must call it, the same number of times; ``T`` may be 0.
        Returns ``[T, H]`` in the dtype of ``hidden_states``, rows in their original order.
        """
        if validate:
            self._check_inputs(hidden_states, topk_ids, topk_weights, router_logits)
        x = hidden_states.to(self.device)
        self._mark("start")
        k = self.config.top_k
        if x.shape[0] == 0:
            topk_ids = torch.zeros((0, k), dtype=torch.int32, device=self.device)
            topk_weights = torch.zeros((0, k), dtype=torch.float32, device=self.device)
        else:
            topk_ids, topk_weights = self._routing(x, topk_ids, topk_weights, router_logits)
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
                                     weights[row, slot].unsqueeze(1)).float()
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


def run_checks_all_ranks(layer: ExpertParallelMoE, level: str = "quick", seed: int | None = None,
                         dst: int = 0) -> dict | None:
    """docs/SPEC.md §5 on every rank (:func:`megamoe.health.run_checks` with the rank's backend) plus
    ``ep_dispatch_combine``; gathered on rank ``dst``. Collective: every rank calls it.

    Returns the merged report (:func:`merge_rank_reports`) on ``dst``, None elsewhere.
    """
    if seed is None:  # one fresh seed for all ranks (each check then offsets it by the rank)
        seed_t = torch.randint(0, 2**31 - 1, (1,), dtype=torch.int64).to(layer.device)
        dist.broadcast(seed_t, src=global_rank(layer.group, 0), group=layer.group)
        seed = int(seed_t)
    report = health.run_checks(level=level, backend=layer.backend, seed=seed + layer.rank)
    t0 = time.perf_counter()
    report["checks"].append(check_ep_dispatch_combine(layer, seed))
    report["duration_ms"] = round(report["duration_ms"] + (time.perf_counter() - t0) * 1e3, 1)
    if report["checks"][-1]["status"] == "fail":
        report["status"] = "fail"
    report.update(rank=layer.rank, world_size=layer.world_size, experts=[layer.expert_start, layer.expert_end])
    gathered = [None] * layer.world_size if layer.rank == dst else None
    dist.gather_object(report, gathered, dst=global_rank(layer.group, dst), group=layer.group)
    return merge_rank_reports(gathered) if layer.rank == dst else None


# ------------------------------------------------------------------------------------------
# python -m megamoe.distributed
# ------------------------------------------------------------------------------------------

def _build(args) -> ExpertParallelMoE:
    if args.checkpoint:
        return ExpertParallelMoE.from_checkpoint(args.checkpoint, backend=args.backend)
    return ExpertParallelMoE.from_preset(args.preset, seed=args.seed, backend=args.backend)


def _cmd_check(args) -> int:
    """Health of every rank, then EP forward vs the single-process MoELayer on rank 0's tokens."""
    rank, world, _ = init_distributed(args.dist_backend)
    layer = _build(args)
    report = run_checks_all_ranks(layer, args.level)
    status = torch.zeros(1, dtype=torch.int64)
    if rank == 0:
        print(f"{layer!r} x {world} ranks")
        print(health.format_table(report))
        status[0] = 0 if report["status"] == "pass" else 1
    if args.compare:
        gen = torch.Generator().manual_seed(args.seed + 17 * rank)
        x = torch.randn((args.tokens, layer.config.hidden_size), generator=gen).to(torch.bfloat16)
        y = layer(x)
        xs = _all_gather_padded(x, args.tokens, layer)
        ys = _all_gather_padded(y, args.tokens, layer)
        if rank == 0:
            single = (MoELayer.from_checkpoint(args.checkpoint, backend=args.backend) if args.checkpoint
                      else MoELayer.from_preset(args.preset, seed=args.seed, backend=args.backend))
            ref = single(torch.cat(xs)).float().cpu()
            err = float((torch.cat(ys).float() - ref).abs().max() / ref.abs().max())
            print(f"EP forward vs single-process MoELayer, {world} x {args.tokens} tokens (bf16): "
                  f"max |diff| / max |ref| = {err:.3e} (limit 2^-7, one bf16 ulp)")
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
    c = sub.add_parser("check", help="docs/SPEC.md §5 checks on every rank + EP dispatch/combine (run under torchrun)")
    c.add_argument("--checkpoint", default=None, help="ModelOpt NVFP4 checkpoint (default: synthetic --preset)")
    c.add_argument("--preset", default="tiny")
    c.add_argument("--seed", type=int, default=0)
    c.add_argument("--backend", default="auto", help="local backend of every rank (torch, cuda-sm90, ...)")
    c.add_argument("--dist-backend", default=None, help="gloo or nccl (default: nccl with CUDA, else gloo)")
    c.add_argument("--level", choices=("quick", "full"), default="quick")
    c.add_argument("--compare", action="store_true",
                   help="also compare the EP forward with a single-process MoELayer on rank 0 ("
                        "rank 0 must hold every expert in memory)")
    c.add_argument("--tokens", type=int, default=37, help="tokens per rank for --compare")
    c.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    return _cmd_check(args)


if __name__ == "__main__":
    sys.exit(main())

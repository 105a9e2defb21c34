"""Worker side of the tensor-parallel tests in tests/test_distributed.py: one real process per
rank, real gloo (or NCCL) collectives.

``run(rank, world, port, workdir)`` (the target of ``torch.multiprocessing.spawn``) joins a
group on 127.0.0.1, loads its slices of ``workdir/tp.safetensors`` and
``workdir/tp_hash.safetensors`` (every read recorded), runs every case of
``workdir/tp_cases_w{world}.pt`` through :class:`megamoe.distributed.TensorParallelMoE` (the
same tokens on every rank), the bf16 reference, the gathered health checks (healthy, then
with a broken SF layout on the last rank), the service front end, and writes
``workdir/tp_rank{r}.pt``. The parent compares with the single-process MoELayer.
Not a test module (no ``test_`` prefix).
"""
from __future__ import annotations

import traceback

import torch
import torch.distributed as dist

from dist_ep_worker import RecordingSafeOpen, run_rank


def run(rank: int, world: int, port: int, workdir: str, dist_backend: str = "gloo", backend: str = "torch") -> None:
    run_rank(rank, world, port, workdir, dist_backend, backend, _run, f"{workdir}/tp_rank{rank}.pt")


def _run(rank: int, world: int, workdir: str, result: dict, backend: str, device) -> None:
    import safetensors

    from dist_cases import TP_VARIANTS, weight_tensors
    from megamoe import faults
    from megamoe.distributed import TensorParallelMoE, load_tp_shard, run_checks_all_ranks

    # ---- sliced loading, every read recorded
    reads: list = []
    real = safetensors.safe_open
    safetensors.safe_open = RecordingSafeOpen(real, reads)
    try:
        loaded = load_tp_shard(f"{workdir}/tp.safetensors", rank, world)
    finally:
        safetensors.safe_open = real
    hashed = load_tp_shard(f"{workdir}/tp_hash.safetensors", rank, world)
    result["load"] = {"reads": reads, "report": vars(loaded.report), "tensors": weight_tensors(loaded.weights),
                      "config": loaded.config.to_dict()}

    layer = TensorParallelMoE(loaded.weights, loaded.config, backend=backend, device=device)
    hash_layer = TensorParallelMoE(hashed.weights, hashed.config, backend=backend, device=device)
    result["repr"] = repr(layer)

    # ---- forward cases (the same inputs on every rank)
    cases = torch.load(f"{workdir}/tp_cases_w{world}.pt")
    outs, refs = {}, {}
    for name, inp in cases.items():
        lay = hash_layer if name == "hash" else layer
        base = lay.config
        lay.config = base.with_(**TP_VARIANTS.get(name, {}))
        args = {k: inp[k] for k in ("topk_ids", "topk_weights", "router_logits", "input_ids") if inp.get(k) is not None}
        try:
            outs[name] = lay(inp["x"], validate=inp.get("validate", True), **args)
            refs[name] = lay.reference_bf16(inp["x"], validate=inp.get("validate", True), **args)
        except Exception:  # noqa: BLE001 - reported by the case's test (every rank fails alike here)
            outs[name] = refs[name] = None
            result.setdefault("case_errors", {})[name] = traceback.format_exc()
        finally:
            lay.config = base
    result["outputs"], result["references"] = outs, refs
    again = layer(cases["router_bf16"]["x"])
    result["rerun_identical"] = bool(torch.equal(again, outs["router_bf16"]))

    # ---- a hash-routed layer without input_ids: the layer's own error, on every rank
    try:
        hash_layer(cases["hash"]["x"])
        result["hash_without_ids"] = None
    except ValueError as exc:
        result["hash_without_ids"] = f"{type(exc).__name__}: {exc}"

    # ---- different tokens on one rank: a clear error on every rank (validate=True)
    x = cases["router_fp32"]["x"].clone()
    if rank == world - 1:
        x[3, 5] += 1.0
    try:
        layer(x)
        result["not_replicated"] = None
    except ValueError as exc:
        result["not_replicated"] = str(exc)

    # ---- I not divisible into 16-value blocks per rank: a clear error before any collective
    try:
        TensorParallelMoE.from_preset("tiny", backend="torch", intermediate_size=16 * world + 16)
        result["indivisible"] = None
    except ValueError as exc:
        result["indivisible"] = str(exc)

    # ---- health gathered on rank 0: healthy, then a broken SF layout on the last rank only
    result["health"] = run_checks_all_ranks(layer, "quick", seed=1234)
    healthy = layer.backend
    if backend == "torch":  # the injected fault acts through the torch GEMM
        if rank == world - 1:
            layer.backend = faults.inject(healthy, "swapped-sf")
        result["health_fault"] = run_checks_all_ranks(layer, "quick", seed=1234)
        layer.backend = healthy

    # ---- the service's front end: rank 0 drives, the others loop until STOP
    from megamoe.service.distributed import DistributedFront, serve_worker

    control = dist.new_group(backend="gloo")
    if rank == 0:
        front = DistributedFront(layer, control)
        batches = torch.load(f"{workdir}/tp_front_w{world}.pt")
        result["front_outputs"] = [front(**b) for b in batches]
        result["front_health"] = front.run_checks("quick", seed=99)
        front.stop()
    else:
        result["worker_forwards"] = serve_worker(layer, control)
    # the hash-routed layer behind a front end: input_ids travel to every rank
    if rank == 0:
        front = DistributedFront(hash_layer, control)
        result["front_needs_input_ids"] = front.needs_input_ids
        result["front_hash"] = front(cases["hash"]["x"], input_ids=cases["hash"]["input_ids"])
        front.stop()
    else:
        serve_worker(hash_layer, control)

"""Worker side of tests/test_distributed.py: one real process per rank, real gloo collectives.

``run(rank, world, port, workdir)`` (the target of ``torch.multiprocessing.spawn``) joins a
gloo group on 127.0.0.1, loads its shard of ``workdir/ckpt.safetensors`` while recording
every read the loader makes, runs every case of ``workdir/cases.pt`` through the
expert-parallel layer, runs the gathered health checks (healthy, then with a broken SF
layout on the last rank), and writes ``workdir/rank{r}.pt``. The parent compares the
outputs with the single-process MoELayer: the comparison lives in the test, not here.
Also used by tests/gpu/test_distributed_nccl.py with NCCL, one GPU per rank.
Not a test module (no ``test_`` prefix).
"""
from __future__ import annotations

import datetime
import traceback

import torch
import torch.distributed as dist


class RecordingSafeOpen:
    """``safetensors.safe_open`` that records what is read: whole tensors and slices (with the key)."""

    def __init__(self, real, log: list):
        self._real, self._log = real, log

    def __call__(self, *args, **kwargs):
        return _RecordingFile(self._real(*args, **kwargs), self._log)


class _RecordingFile:
    def __init__(self, fh, log):
        self._fh, self._log = fh, log

    def __enter__(self):
        self._fh.__enter__()
        return self

    def __exit__(self, *exc):
        return self._fh.__exit__(*exc)

    def keys(self):
        return self._fh.keys()

    def metadata(self):
        return self._fh.metadata()

    def get_tensor(self, name):
        t = self._fh.get_tensor(name)
        self._log.append(("get_tensor", name, None, t.numel() * t.element_size()))
        return t

    def get_slice(self, name):
        return _RecordingSlice(self._fh.get_slice(name), name, self._log)


class _RecordingSlice:
    def __init__(self, sl, name, log):
        self._sl, self._name, self._log = sl, name, log

    def get_shape(self):
        return self._sl.get_shape()

    def get_dtype(self):
        return self._sl.get_dtype()

    def __getitem__(self, key):
        t = self._sl[key]
        rng = (key.start, key.stop) if isinstance(key, slice) else repr(key)
        self._log.append(("slice", self._name, rng, t.numel() * t.element_size()))
        return t


def _storage_bytes(t: torch.Tensor) -> int:
    return t.untyped_storage().nbytes()


def _cpu(v):
    """Results travel to the parent on the CPU."""
    if torch.is_tensor(v):
        return v.cpu()
    if isinstance(v, dict):
        return {k: _cpu(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return type(v)(_cpu(x) for x in v)
    return v


def run(rank: int, world: int, port: int, workdir: str, dist_backend: str = "gloo", backend: str = "torch") -> None:
    """One rank. ``dist_backend`` gloo (CPU) or nccl (GPU ``rank``); ``backend`` the local MoE backend."""
    run_rank(rank, world, port, workdir, dist_backend, backend, _run, f"{workdir}/rank{rank}.pt")


def run_rank(rank: int, world: int, port: int, workdir: str, dist_backend: str, backend: str, body,
             out_path: str) -> None:
    """Join the group on 127.0.0.1:``port``, run ``body(rank, world, workdir, result, backend, device)``
    and save ``result`` (on the CPU) to ``out_path``; on an exception the traceback is saved there
    for the parent to show, then raised."""
    torch.set_num_threads(1)
    kw, device = {}, None
    if dist_backend == "nccl":
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
        kw["device_id"] = device
    dist.init_process_group(dist_backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120), **kw)
    result: dict = {"rank": rank, "world": world}
    try:
        body(rank, world, workdir, result, backend, device)
        result = _cpu(result)
    except Exception:  # the parent shows the traceback instead of a bare exit code
        result["error"] = traceback.format_exc()
        torch.save(_cpu(result), out_path)
        raise
    torch.save(result, out_path)
    dist.barrier()
    dist.destroy_process_group()


def _run(rank: int, world: int, workdir: str, result: dict, backend: str, device) -> None:
    import safetensors

    from dist_cases import VARIANTS, weight_tensors
    from megamoe import faults
    from megamoe.distributed import ExpertParallelMoE, load_shard, run_checks_all_ranks

    # ---- sharded loading, with every read recorded
    reads: list = []
    real = safetensors.safe_open
    safetensors.safe_open = RecordingSafeOpen(real, reads)
    try:
        loaded = load_shard(f"{workdir}/ckpt.safetensors", rank, world)
        per_reads: list = []
        safetensors.safe_open = RecordingSafeOpen(real, per_reads)
        per_expert = load_shard(f"{workdir}/ckpt_per_expert.safetensors", rank, world)
    finally:
        safetensors.safe_open = real
    w = loaded.weights
    result["load"] = {
        "reads": reads, "per_expert_reads": per_reads, "report": vars(loaded.report),
        "expert_start": loaded.expert_start,
        "shapes": {"w13": tuple(w.w13.data.shape), "w2": tuple(w.w2.data.shape),
                   "w13_scale": tuple(w.w13.scale.shape), "w13_gs": tuple(w.w13.global_scale.shape),
                   "router": tuple(w.router_weight.shape)},
        "storage_bytes": {"w13": _storage_bytes(w.w13.data), "w13_scale": _storage_bytes(w.w13.scale),
                          "w2": _storage_bytes(w.w2.data), "w2_scale": _storage_bytes(w.w2.scale)},
        "weights": {"w13": w.w13.data, "w13_scale": w.w13.scale.view(torch.uint8), "w13_gs": w.w13.global_scale,
                    "w2": w.w2.data, "w2_gs": w.w2.global_scale, "in1": w.w13_input_scale},
        "tensors": weight_tensors(loaded.weights),
        "per_expert_tensors": weight_tensors(per_expert.weights),
        "per_expert_report": vars(per_expert.report),
        "per_expert_weights": {"w13": per_expert.weights.w13.data, "w13_gs": per_expert.weights.w13.global_scale,
                               "w2": per_expert.weights.w2.data},
    }

    # ---- forward cases
    layer = ExpertParallelMoE(loaded.weights, loaded.config, loaded.expert_start, backend=backend, device=device)
    cases = torch.load(f"{workdir}/cases_w{world}.pt")
    outs, stats = {}, {}
    for name, per_rank in cases.items():
        inp = per_rank[rank]
        overrides, combine_dtype = VARIANTS.get(name, ({}, torch.float32))
        base_config = layer.config
        layer.config, layer.combine_dtype = base_config.with_(**overrides), combine_dtype
        try:
            outs[name] = layer(inp["x"], topk_ids=inp.get("topk_ids"), topk_weights=inp.get("topk_weights"),
                               router_logits=inp.get("router_logits"), validate=inp.get("validate", True))
        except Exception:  # noqa: BLE001 - one case's failure is reported by its test, not the whole run
            # (only safe when every rank fails alike, e.g. a mode the backend lacks; else the others hang)
            outs[name] = None
            result.setdefault("case_errors", {})[name] = traceback.format_exc()
        finally:
            layer.config, layer.combine_dtype = base_config, torch.float32
        stats[name] = dict(layer.last_stats)
    # the same input again: bit-identical (docs/FIELD_BUGS.md row 14: a race shows as run-to-run differences)
    again = layer(cases["router_bf16"][rank]["x"])
    result["rerun_identical"] = bool(torch.equal(again, outs["router_bf16"]))
    result["outputs"], result["stats"] = outs, stats

    # ---- a process group that is not the default one: EP over the last two ranks only
    members = [world - 2, world - 1]
    sub = dist.new_group(members)  # every rank takes part in creating it
    if rank in members:
        shard = load_shard(f"{workdir}/ckpt.safetensors", members.index(rank), len(members))
        sublayer = ExpertParallelMoE(shard.weights, shard.config, shard.expert_start, group=sub, backend=backend,
                                     device=device)
        result["subgroup_output"] = sublayer(cases["router_fp32"][rank]["x"])
        result["subgroup_health"] = run_checks_all_ranks(sublayer, "quick", seed=7)  # on group rank 0
        del sublayer

    # ---- E not divisible by the world size: a clear error before any collective
    for what, fn in (("preset", lambda: ExpertParallelMoE.from_preset("tiny", backend="torch", num_experts=9)),
                     ("checkpoint", lambda: load_shard(f"{workdir}/ckpt_e9.safetensors", rank, world))):
        try:
            fn()
            result[f"indivisible_{what}"] = None
        except ValueError as exc:
            result[f"indivisible_{what}"] = str(exc)

    # ---- health gathered on rank 0: healthy, then a broken SF layout on the last rank only
    result["health"] = run_checks_all_ranks(layer, "quick", seed=1234)
    healthy_backend = layer.backend
    if rank == world - 1 and backend == "torch":  # the injected fault acts through the torch GEMM
        layer.backend = faults.inject(healthy_backend, "swapped-sf")
    if backend == "torch":
        result["health_fault"] = run_checks_all_ranks(layer, "quick", seed=1234)
    layer.backend = healthy_backend

    # ---- the service's front end: rank 0 drives, the others loop until STOP
    from megamoe.service.distributed import DistributedFront, serve_worker

    control = dist.new_group(backend="gloo")
    if rank == 0:
        front = DistributedFront(layer, control)
        batches = torch.load(f"{workdir}/front_w{world}.pt")
        result["front_outputs"] = [front(**b) for b in batches]
        result["front_health"] = front.run_checks("quick", seed=99)
        try:
            front(batches[0]["hidden_states"][:, :8])  # refused on rank 0, no rank involved
            result["front_bad_input"] = None
        except ValueError as exc:
            result["front_bad_input"] = str(exc)
        result["front_after_bad"] = front(**batches[0])
        front.stop()
    else:
        result["worker_forwards"] = serve_worker(layer, control)

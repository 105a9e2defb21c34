"""Expert-parallel MoE layer: all-to-all + expert compute time per layer, against one GPU.

For each T (tokens of one layer step, spread over the W ranks in equal chunks, as the
service does), every rank runs the collective :class:`megamoe.distributed.ExpertParallelMoE`
forward; phase boundaries are CUDA events (perf_counter on the CPU). Reported per T,
median over ``--iters`` after ``--warmup``, the slowest rank of each iteration (the layer
is done when its last rank is):

* ``route_ms``     router + top-k on each rank's own tokens;
* ``dispatch_ms``  split-size exchange + all-to-all of token rows and slot metadata;
* ``experts_ms``   local backend ``moe_forward`` over the received (token, expert) pairs;
* ``combine_ms``   all-to-all of the fp32 partial rows back + in-order accumulation;
* ``ep_total_ms``  the whole forward (start to done, shared expert included);
* ``single_ms``    the single-device ``MoELayer.forward`` of all T tokens on rank 0's device
  (skipped with ``--no-single`` when one device cannot hold every expert).

Runs (writes ``bench/results/ep_<device>.json``)::

    torchrun --nproc-per-node 8 bench/ep_bench.py --preset v4-flash --tokens 128 2048 8192
    torchrun --nproc-per-node 2 bench/ep_bench.py --preset tiny --tokens 16 64 --iters 3   # CPU/gloo smoke

Not yet run on GPUs: the CPU/gloo smoke run (``bench/results/ep_cpu-gloo-x2.json``) is the
only result so far, and its numbers say nothing about GPUs.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megamoe.distributed import ExpertParallelMoE, init_distributed  # noqa: E402
from megamoe.moe import MoELayer  # noqa: E402

PHASES = (("route_ms", "start", "routed"), ("dispatch_ms", "routed", "dispatched"),
          ("experts_ms", "dispatched", "experts"), ("combine_ms", "experts", "combined"),
          ("ep_total_ms", "start", "done"))


def _elapsed_ms(a, b) -> float:
    if isinstance(a, float):
        return (b - a) * 1e3
    return a.elapsed_time(b)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _device_slug(world: int, dist_backend: str) -> str:
    if torch.cuda.is_available():
        name = torch.cuda.get_device_name()
    else:
        name = f"cpu-{dist_backend}"
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") + f"-x{world}"


def bench_ep(layer: ExpertParallelMoE, tokens: int, iters: int, warmup: int, seed: int) -> dict:
    """Phase times of the EP forward; T split in equal chunks over the ranks."""
    world, rank = layer.world_size, layer.rank
    chunk = -(-tokens // world)
    mine = max(0, min(chunk, tokens - rank * chunk))
    gen = torch.Generator().manual_seed(seed * 7919 + rank)
    x = torch.randn((mine, layer.config.hidden_size), generator=gen).to(torch.bfloat16).to(layer.device)
    per_iter: list[dict] = []
    for it in range(warmup + iters):
        dist.barrier()
        layer.phase_marks = []
        layer(x)
        _sync(layer.device)
        marks = dict(layer.phase_marks)
        layer.phase_marks = None
        if it >= warmup:
            per_iter.append({name: _elapsed_ms(marks[a], marks[b]) for name, a, b in PHASES})
    # slowest rank per iteration and phase, then the median over iterations
    times_ms = torch.tensor([[p[name] for name, _, _ in PHASES] for p in per_iter], dtype=torch.float64,
                            device=layer.device)
    dist.all_reduce(times_ms, op=dist.ReduceOp.MAX)
    worst = times_ms.cpu()
    rows = torch.tensor([layer.last_stats["rows_sent"], layer.last_stats["rows_received"]], dtype=torch.float64,
                        device=layer.device)
    rows_all = [torch.empty_like(rows) for _ in range(world)]
    dist.all_gather(rows_all, rows)
    out = {name: statistics.median(worst[:, i].tolist()) for i, (name, _, _) in enumerate(PHASES)}
    out["rows_sent_per_rank"] = [int(r[0]) for r in rows_all]
    out["rows_received_per_rank"] = [int(r[1]) for r in rows_all]
    # bytes moved by the two all-to-alls (bf16 rows + int32 metadata out, fp32 partial rows back)
    h, k = layer.config.hidden_size, layer.config.top_k
    sent = sum(out["rows_sent_per_rank"])
    out["dispatch_bytes"] = sent * (2 * h + 8 * k)
    out["combine_bytes"] = sent * 4 * h
    return out


def bench_single(layer: MoELayer, tokens: int, iters: int, warmup: int, seed: int) -> float:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn((tokens, layer.config.hidden_size), generator=gen).to(torch.bfloat16).to(layer.device)
    times = []
    for it in range(warmup + iters):
        if layer.device.type == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            layer(x)
            b.record()
            torch.cuda.synchronize()
            ms = a.elapsed_time(b)
        else:
            t0 = time.perf_counter()
            layer(x)
            ms = (time.perf_counter() - t0) * 1e3
        if it >= warmup:
            times.append(ms)
    return statistics.median(times)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="v4-flash")
    p.add_argument("--checkpoint", default=None, help="a ModelOpt checkpoint instead of the synthetic preset")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--backend", default="auto", help="local backend on every rank")
    p.add_argument("--dist-backend", default=None, help="nccl or gloo (default: nccl with CUDA)")
    p.add_argument("--tokens", type=int, nargs="+", default=[128, 2048, 8192], help="T per layer step (all ranks)")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--no-single", action="store_true", help="skip the single-device baseline")
    p.add_argument("--out", default=None, help="JSON path (default bench/results/ep_<device>.json)")
    args = p.parse_args(argv)

    rank, world, device = init_distributed(args.dist_backend)
    dist_backend = dist.get_backend()
    torch.manual_seed(args.seed)
    if args.checkpoint:
        layer = ExpertParallelMoE.from_checkpoint(args.checkpoint, backend=args.backend)
    else:
        layer = ExpertParallelMoE.from_preset(args.preset, seed=args.seed, backend=args.backend)
    single = None
    if rank == 0 and not args.no_single:
        single = (MoELayer.from_checkpoint(args.checkpoint, backend=args.backend) if args.checkpoint else
                  MoELayer.from_preset(args.preset, seed=args.seed, backend=args.backend))
    results = []
    for t in args.tokens:
        ep = bench_ep(layer, t, args.iters, args.warmup, args.seed)
        row = {"tokens": t, "tokens_per_rank": -(-t // world), **ep}
        dist.barrier()
        if single is not None:
            row["single_ms"] = bench_single(single, t, args.iters, args.warmup, args.seed)
            row["speedup_vs_single"] = row["single_ms"] / row["ep_total_ms"]
        dist.barrier()
        results.append(row)
        if rank == 0:
            print(f"T={t:6d}  ep {row['ep_total_ms']:9.3f} ms  (route {row['route_ms']:.3f}, dispatch "
                  f"{row['dispatch_ms']:.3f}, experts {row['experts_ms']:.3f}, combine {row['combine_ms']:.3f})"
                  + (f"  single {row['single_ms']:9.3f} ms  x{row['speedup_vs_single']:.2f}" if "single_ms" in row
                     else ""), flush=True)
    if rank == 0:
        cfg = layer.config
        report = {
            "what": "expert-parallel MoE layer forward: phases per layer step, median over iterations of the "
                    "slowest rank; single = one-device MoELayer.forward of all T tokens",
            "device": _device_slug(world, dist_backend), "world_size": world, "dist_backend": dist_backend,
            "backend": layer.backend.name, "preset": None if args.checkpoint else args.preset,
            "checkpoint": args.checkpoint, "config": cfg.to_dict(), "iters": args.iters, "warmup": args.warmup,
            "timer": "cuda events" if layer.device.type == "cuda" else "perf_counter",
            "torch": torch.__version__, "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "nvls": os.environ.get("NCCL_NVLS_ENABLE"),
            "results": results,
        }
        default = Path(__file__).resolve().parent / "results" / f"ep_{report['device']}.json"
        out = Path(args.out) if args.out else default
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(report, indent=1) + "\n")
        print(f"wrote {out}")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())

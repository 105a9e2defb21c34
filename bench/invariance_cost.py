#!/usr/bin/env python
"""The cost of batch invariance on a GPU (docs/SPEC.md §3.5): the layer's float32 GEMMs outside the
NVFP4 kernels (the router, the shared expert) in fixed 64-row blocks (``megamoe.invariant.matmul_rows``)
against one GEMM over all rows, per T, at the v4-flash and v3 shapes. Eager launches, median of CUDA-event
times.

    python bench/invariance_cost.py --out bench/results/invariance_cost_h100.json
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from megamoe.invariant import matmul_rows  # noqa: E402

SHAPES = (("v4-flash", 4096, 256, 2048), ("v3", 7168, 256, 2048))  # name, H, E, shared width


def median_us(fn, reps: int) -> float:
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(reps):
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    times.sort()
    return times[len(times) // 2]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", nargs="+", type=int, default=[1, 8, 128, 512, 2048, 8192])
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--out", default=None, help="JSON path (default: print only)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("invariance_cost: needs a CUDA GPU", file=sys.stderr)
        return 2
    torch.backends.cuda.matmul.allow_tf32 = False  # the layer's float32 GEMMs
    rows = []
    for name, h, e, shared in SHAPES:
        router = torch.randn(e, h, device="cuda") * h ** -0.5
        gate_up = torch.randn(2 * shared, h, device="cuda") * h ** -0.5
        down = torch.randn(h, shared, device="cuda") * shared ** -0.5
        for t in args.tokens:
            x = torch.randn(t, h, device="cuda")

            def shared_expert(mm):
                gu = mm(x, gate_up)
                return mm(torch.nn.functional.silu(gu[:, :shared]) * gu[:, shared:], down)

            one = lambda a, w: a @ w.T  # noqa: E731
            row = {"preset": name, "T": t,
                   "router_blocked_us": median_us(lambda: matmul_rows(x, router), args.reps),
                   "router_one_gemm_us": median_us(lambda: one(x, router), args.reps),
                   "shared_blocked_us": median_us(lambda: shared_expert(matmul_rows), args.reps // 2),
                   "shared_one_gemm_us": median_us(lambda: shared_expert(one), args.reps // 2)}
            rows.append(row)
            print(f"{name:9} T={t:5}  router {row['router_blocked_us']:8.1f} vs {row['router_one_gemm_us']:8.1f} us"
                  f"   shared expert {row['shared_blocked_us']:9.1f} vs {row['shared_one_gemm_us']:9.1f} us", flush=True)
    if args.out:
        report = {"command": "python " + " ".join([os.path.relpath(__file__)] + (argv or sys.argv[1:])),
                  "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                  "device": torch.cuda.get_device_name(), "versions": {"torch": torch.__version__},
                  "results": rows}
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

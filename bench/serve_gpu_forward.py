"""Helper of bench/serve_gpu.sh.

``--tokens ...``: time the layer's forward alone (no HTTP; CUDA events over repeated calls after a
warm-up) at each T and write perf_analyzer data files (random inputs, routing given, raw bytes as
base64) for the same T. ``--report DIR``: gather the perf_analyzer CSVs, the server's stage metrics
and the forward timings of DIR into one JSON record with the command, device, date and versions.
"""

from __future__ import annotations

import argparse
import base64
import csv
import datetime as dt
import importlib.metadata
import json
import platform
import subprocess
import sys
from pathlib import Path

TARGETS = {"T512_fraction_of_forward": 0.60, "T1_c1_p50_ms": 3.0, "T1_c16_req_per_s": 1500.0}


def time_forward(args) -> None:
    import torch

    from megamoe.moe import MoELayer

    import time

    cuda = torch.cuda.is_available()
    layer = MoELayer.from_preset(args.preset, seed=0, backend=args.backend, device="cuda" if cuda else "cpu")
    cfg = layer.config
    out_dir = Path(args.data_dir)
    record = {"preset": args.preset, "backend": args.backend, "forward": []}
    for tokens in args.tokens:
        gen = torch.Generator().manual_seed(tokens)
        streams = []
        for _ in range(args.streams if tokens > 64 else 8):
            hidden = torch.randn(tokens, cfg.hidden_size, generator=gen)
            ids = torch.stack([torch.randperm(cfg.num_experts, generator=gen)[: cfg.top_k] for _ in range(tokens)]).int()
            weights = torch.rand(tokens, cfg.top_k, generator=gen) + 0.05
            weights = weights / weights.sum(-1, keepdim=True)
            streams.append((hidden, ids, weights))

        def entry(t):
            return {"b64": base64.b64encode(t.contiguous().numpy().tobytes()).decode(), "shape": list(t.shape)}

        doc = {"data": [{"hidden_states": entry(h), "topk_ids": entry(i), "topk_weights": entry(w)}
                        for h, i, w in streams]}
        (out_dir / f"data_T{tokens}.json").write_text(json.dumps(doc))

        hidden, ids, weights = (t.to(layer.device) for t in streams[0])
        iters = (50 if tokens > 64 else 200) if cuda else 5
        with torch.inference_mode():
            for _ in range(5 if cuda else 1):
                layer.forward(hidden, topk_ids=ids, topk_weights=weights, validate=False)
            if cuda:
                torch.cuda.synchronize()
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
            began = time.perf_counter()
            for _ in range(iters):
                layer.forward(hidden, topk_ids=ids, topk_weights=weights, validate=False)
            if cuda:
                end.record()
                torch.cuda.synchronize()
        ms = start.elapsed_time(end) / iters if cuda else (time.perf_counter() - began) * 1e3 / iters
        row = {"tokens": tokens, "input_dtype": "float32", "ms_per_forward": round(ms, 4),
               "tokens_per_s": round(tokens / ms * 1e3, 1), "iterations": iters}
        record["forward"].append(row)
        print(json.dumps(row))
    Path(args.out).write_text(json.dumps(record, indent=2))


def _stages(before: Path, after: Path) -> dict:
    from prometheus_client.parser import text_string_to_metric_families

    def read(path):
        sums = {}
        for family in text_string_to_metric_families(path.read_text()):
            for s in family.samples:
                if s.name in ("megamoe_stage_seconds_sum", "megamoe_stage_seconds_count"):
                    sums[(s.labels["stage"], s.name.rsplit("_", 1)[1])] = s.value
                elif s.name in ("megamoe_batch_size_tokens_sum", "megamoe_batch_size_tokens_count"):
                    sums[("batch_tokens", s.name.rsplit("_", 1)[1])] = s.value
        return sums

    b, a = read(before), read(after)
    out = {}
    for stage in sorted({k[0] for k in a}):
        n = a.get((stage, "count"), 0) - b.get((stage, "count"), 0)
        total = a.get((stage, "sum"), 0) - b.get((stage, "sum"), 0)
        if n > 0:
            key = "mean_tokens_per_batch" if stage == "batch_tokens" else f"{stage}_mean_ms"
            out[key] = round(total / n if stage == "batch_tokens" else total / n * 1e3, 4)
            out[f"{stage}_count"] = int(n)
    return out


def report(args) -> None:
    d = Path(args.report)
    forward = json.loads((d / "forward.json").read_text())
    fwd = {r["tokens"]: r for r in forward["forward"]}
    cases = {"T512_c4": (512, 4), "T1_c1": (1, 1), "T1_c16": (1, 16)}
    results = []
    for name, (tokens, conc) in cases.items():
        row = {"case": name, "tokens_per_request": tokens, "concurrency": conc}
        path = d / f"pa_{name}.csv"
        if path.exists() and path.stat().st_size:
            pa = next(csv.DictReader(path.open()))
            rps = float(pa["Inferences/Second"])
            row.update(requests_per_s=rps, tokens_per_s=round(rps * tokens, 1),
                       latency_ms={k: round(int(pa[f"{k} latency"]) / 1e3, 3) for k in ("p50", "p90", "p95", "p99")})
        else:
            log = (d / f"pa_{name}.log").read_text(errors="replace")[-1500:] if (d / f"pa_{name}.log").exists() else ""
            row["error"] = log
        if (d / f"metrics_{name}_after.txt").exists():
            row["server_stages"] = _stages(d / f"metrics_{name}_before.txt", d / f"metrics_{name}_after.txt")
        results.append(row)
    by = {r["case"]: r for r in results}
    checks = {}
    if "tokens_per_s" in by["T512_c4"]:
        frac = by["T512_c4"]["tokens_per_s"] / fwd[512]["tokens_per_s"]
        checks["T512_fraction_of_forward"] = {"value": round(frac, 3), "target": ">= 0.60", "met": frac >= 0.60}
    if "latency_ms" in by["T1_c1"]:
        p50 = by["T1_c1"]["latency_ms"]["p50"]
        checks["T1_c1_p50_ms"] = {"value": p50, "target": "<= 3.0", "met": p50 <= 3.0}
    if "requests_per_s" in by["T1_c16"]:
        rps = by["T1_c16"]["requests_per_s"]
        checks["T1_c16_req_per_s"] = {"value": rps, "target": ">= 1500", "met": rps >= 1500}

    def version(name):
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            return None

    import torch

    gpu = (d / "gpu.txt").read_text().strip().splitlines()[-1] if (d / "gpu.txt").exists() else None
    git = args.commit or subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip() or None
    record = {
        "command": args.command,
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "what": "perf_analyzer (binary tensors, FP32 hidden states as advertised, INT32 ids, FP32 weights, "
                f"random inputs from a data file) against megamoe serve --backend {forward['backend']} --preset "
                f"{forward['preset']} --queue-delay-ms 0 on 127.0.0.1; forward-only: the same layer's forward "
                "(CUDA events on a GPU), no HTTP",
        "device": {"gpu_csv": gpu, "torch_cuda_device": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
                   "cpus": __import__("os").cpu_count(), "platform": platform.platform()},
        "git_commit": git,
        "versions": {"python": platform.python_version(), "torch": torch.__version__, "megamoe": version("megamoe") or __import__("megamoe").__version__ + " (source tree)",
                     "fastapi": version("fastapi"), "uvicorn": version("uvicorn"), "starlette": version("starlette"),
                     "uvloop": version("uvloop"), "httptools": version("httptools"),
                     "perf_analyzer": "2.48.0 (tritonclient 2.48.0 wheel)"},
        "perf_analyzer": args.perf_analyzer,
        "forward_only": forward["forward"],
        "results": results,
        "targets": checks,
    }
    Path(args.out).write_text(json.dumps(record, indent=2) + "\n")
    print(json.dumps({"results": [{k: v for k, v in r.items() if k != "error"} for r in results],
                      "targets": checks}, indent=1))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="v4-flash")
    p.add_argument("--backend", default="cuda-sm90")
    p.add_argument("--tokens", type=int, nargs="*")
    p.add_argument("--streams", type=int, default=2, help="distinct inputs per large-T data file")
    p.add_argument("--data-dir")
    p.add_argument("--report")
    p.add_argument("--command", default="bench/serve_gpu.sh")
    p.add_argument("--perf-analyzer")
    p.add_argument("--commit", help="the commit that ran (default: git rev-parse HEAD)")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    if args.report:
        report(args)
    else:
        time_forward(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())

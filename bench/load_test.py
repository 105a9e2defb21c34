"""Bounded loopback load test of the megamoe service (Open Inference Protocol, binary tensors).

Starts ``python -m megamoe.service`` on 127.0.0.1 (or uses ``--url``), then for each T sends a fixed
number of requests from a fixed number of concurrent clients, stopping early at a time cap,
and reports requests/s, tokens/s, latency percentiles and the batch sizes the server chose
(from its /metrics). Writes a JSON record with the command, date, versions and machine.

    python bench/load_test.py                        # CPU torch backend, preset small
    python bench/load_test.py --tokens 1 32 --out /tmp/x.json
    python bench/load_test.py --client perf_analyzer   # NVIDIA's perf_analyzer as the client
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import os
import platform
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx
import torch
from prometheus_client.parser import text_string_to_metric_families

from megamoe.service import protocol

REPO = Path(__file__).resolve().parents[1]
# T -> (requests, concurrent clients)
DEFAULT_PLAN = {1: (600, 16), 32: (300, 16), 512: (60, 4)}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def binary_infer_body(hidden: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> tuple[bytes, dict]:
    body, head_len = protocol.binary_infer_body({"hidden_states": hidden, "topk_ids": ids, "topk_weights": weights})
    return body, {protocol.HEADER_LENGTH: str(head_len), "Content-Type": "application/octet-stream"}


def make_bodies(meta: dict, tokens: int, count: int = 8) -> list[tuple[bytes, dict]]:
    p = meta["parameters"]
    gen = torch.Generator().manual_seed(tokens)
    bodies = []
    for _ in range(count):
        hidden = torch.randn(tokens, p["hidden_size"], generator=gen).to(torch.bfloat16)
        ids = torch.stack([torch.randperm(p["num_experts"], generator=gen)[: p["top_k"]] for _ in range(tokens)]).int()
        weights = torch.rand(tokens, p["top_k"], generator=gen)
        bodies.append(binary_infer_body(hidden, ids, weights / weights.sum(-1, keepdim=True)))
    return bodies


_COUNTERS = ("megamoe_batch_size_requests_count", "megamoe_batch_size_requests_sum", "megamoe_batch_size_tokens_sum",
             "megamoe_compute_latency_seconds_sum", "megamoe_queue_latency_seconds_sum",
             "megamoe_queue_latency_seconds_count")


def batch_stats(metrics_text: str, model: str) -> tuple[float, ...]:
    """The server's counters named in _COUNTERS, so far."""
    values = {}
    for family in text_string_to_metric_families(metrics_text):
        for s in family.samples:
            if s.labels.get("model") == model and s.name in _COUNTERS:
                values[s.name] = s.value
    return tuple(values.get(name, 0.0) for name in _COUNTERS)


def percentile(sorted_values: list[float], q: float) -> float:
    if not sorted_values:
        return float("nan")
    pos = (len(sorted_values) - 1) * q
    lo, hi = int(pos), min(int(pos) + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


async def run_level(client: httpx.AsyncClient, url: str, model: str, tokens: int, requests: int, clients: int,
                    time_cap_s: float, headers: dict) -> dict:
    meta = (await client.get(f"{url}/v2/models/{model}")).json()
    bodies = make_bodies(meta, tokens)
    infer_url = f"{url}/v2/models/{model}/infer"
    expected_bytes = tokens * meta["parameters"]["hidden_size"] * 2

    for body, h in bodies[:2]:  # warm-up, not measured
        (await client.post(infer_url, content=body, headers={**headers, **h})).raise_for_status()

    before = batch_stats((await client.get(f"{url}/metrics")).text, model)
    latencies_s: list[float] = []
    errors: list[str] = []
    next_index = 0
    deadline = time.perf_counter() + time_cap_s

    async def worker():
        nonlocal next_index
        while next_index < requests and time.perf_counter() < deadline:
            body, h = bodies[next_index % len(bodies)]
            next_index += 1
            started = time.perf_counter()
            try:
                reply = await client.post(infer_url, content=body, headers={**headers, **h})
                head = int(reply.headers.get("Inference-Header-Content-Length", "-1"))
                if reply.status_code != 200 or len(reply.content) - head != expected_bytes:
                    errors.append(f"{reply.status_code}: {reply.content[:200]!r}")
                    continue
            except httpx.HTTPError as exc:
                errors.append(repr(exc))
                continue
            latencies_s.append(time.perf_counter() - started)

    started = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(clients)))
    wall_s = time.perf_counter() - started
    after = batch_stats((await client.get(f"{url}/metrics")).text, model)
    batches, batched_requests, batched_tokens, compute_s, queue_s, queued = (a - b for a, b in zip(after, before))
    lat_ms = sorted(x * 1e3 for x in latencies_s)
    return {
        "tokens_per_request": tokens,
        "concurrent_clients": clients,
        "requests_planned": requests,
        "requests_ok": len(latencies_s),
        "errors": len(errors),
        "first_errors": errors[:3],
        "stopped_by_time_cap": len(latencies_s) + len(errors) < requests,
        "wall_s": round(wall_s, 3),
        "requests_per_s": round(len(latencies_s) / wall_s, 2),
        "tokens_per_s": round(len(latencies_s) * tokens / wall_s, 1),
        "latency_ms": {"p50": round(percentile(lat_ms, 0.50), 2), "p90": round(percentile(lat_ms, 0.90), 2),
                       "p99": round(percentile(lat_ms, 0.99), 2),
                       "mean": round(statistics.fmean(lat_ms), 2) if lat_ms else None},
        "server_batches": int(batches),
        "mean_requests_per_batch": round(batched_requests / batches, 2) if batches else None,
        "mean_tokens_per_batch": round(batched_tokens / batches, 1) if batches else None,
        # the server's own split of the latency: the forward itself vs waiting for the device
        "mean_compute_ms_per_batch": round(1e3 * compute_s / batches, 2) if batches else None,
        "mean_queue_ms_per_request": round(1e3 * queue_s / queued, 2) if queued else None,
    }


def perf_analyzer_level(args, url: str, model: str, tokens: int, clients: int, workdir: Path) -> dict:
    """One level measured by NVIDIA's perf_analyzer (binary tensors, the advertised datatypes: FP32 hidden
    states), from a data file of random inputs with their routing; server batch counters around it."""
    import base64
    import csv

    meta = httpx.get(f"{url}/v2/models/{model}", timeout=10).json()
    p = meta["parameters"]
    gen = torch.Generator().manual_seed(tokens)

    def entry(t):
        return {"b64": base64.b64encode(t.contiguous().numpy().tobytes()).decode(), "shape": list(t.shape)}

    data = []
    for _ in range(4):
        hidden = torch.randn(tokens, p["hidden_size"], generator=gen)
        ids = torch.stack([torch.randperm(p["num_experts"], generator=gen)[: p["top_k"]] for _ in range(tokens)]).int()
        weights = torch.rand(tokens, p["top_k"], generator=gen)
        data.append({"hidden_states": entry(hidden), "topk_ids": entry(ids),
                     "topk_weights": entry(weights / weights.sum(-1, keepdim=True))})
    data_file = workdir / f"data_T{tokens}.json"
    data_file.write_text(json.dumps({"data": data}))
    report = workdir / f"pa_T{tokens}.csv"
    cmd = [args.perf_analyzer, "-m", model, "-u", url.removeprefix("http://"), "-i", "http",
           "--input-data", str(data_file), "--concurrency-range", f"{clients}:{clients}",
           # large T: few requests per window, so a longer one
           "--measurement-interval", str(args.pa_window_ms * (4 if tokens >= 256 else 1)),
           "--stability-percentage", "50", "--max-trials", "8",
           "-f", str(report)]
    if args.token:
        cmd += ["-H", f"Authorization: Bearer {args.token}"]
    before = batch_stats(httpx.get(f"{url}/metrics", timeout=10).text, model)
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    after = batch_stats(httpx.get(f"{url}/metrics", timeout=10).text, model)
    batches, batched_requests, batched_tokens, compute_s, queue_s, queued = (a - b for a, b in zip(after, before))
    result = {"tokens_per_request": tokens, "concurrency": clients, "perf_analyzer_rc": out.returncode}
    if out.returncode != 0 or not report.exists():
        result["error"] = (out.stdout + out.stderr)[-1500:]
        return result
    row = next(csv.DictReader(report.open()))
    rps = float(row["Inferences/Second"])
    result.update({
        "requests_per_s": rps, "tokens_per_s": round(rps * tokens, 1),
        "latency_ms": {k: round(int(row[f"{k} latency"]) / 1e3, 2) for k in ("p50", "p90", "p95", "p99")},
        "server_batches": int(batches),
        "mean_requests_per_batch": round(batched_requests / batches, 2) if batches else None,
        "mean_tokens_per_batch": round(batched_tokens / batches, 1) if batches else None,
        "mean_compute_ms_per_batch": round(1e3 * compute_s / batches, 2) if batches else None,
        "mean_queue_ms_per_request": round(1e3 * queue_s / queued, 2) if queued else None,
    })
    return result


def machine() -> dict:
    info = {"platform": platform.platform(), "python": platform.python_version(), "cpus": os.cpu_count(),
            "torch_threads": torch.get_num_threads(), "gpu": None,
            # the machine is shared: a load average above the core count means the figures are low
            "load_average_1m_at_start": round(os.getloadavg()[0], 2)}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                info["cpu"] = line.split(":", 1)[1].strip()
                break
        mem_kb = int(next(l for l in Path("/proc/meminfo").read_text().splitlines() if l.startswith("MemTotal")).split()[1])
        info["memory_gib"] = round(mem_kb / 2**20, 1)
    except (OSError, StopIteration, ValueError):
        pass
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
    return info


def versions() -> dict:
    from importlib import metadata

    out = {"torch": torch.__version__}
    for dist in ("fastapi", "uvicorn", "starlette", "httpx"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[dist] = None
    return out


def start_server(args) -> tuple[subprocess.Popen, str]:
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("MEGAMOE_")}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    cmd = [sys.executable, "-m", "megamoe.service", "--host", "127.0.0.1", "--port", str(port), "--preset", args.preset,
           "--backend", args.backend, "--queue-delay-ms", str(args.queue_delay_ms), "--log-level", "warning",
           "--max-tokens-per-request", str(max(args.tokens)), "--max-batch-tokens", str(args.max_batch_tokens),
           "--torch-threads", str(args.torch_threads)]
    proc = subprocess.Popen(cmd, cwd=REPO, env=env)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + args.start_timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"server exited with {proc.returncode}")
        try:
            if httpx.get(f"{url}/v2/health/ready", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise SystemExit(f"server not ready within {args.start_timeout_s}s")


async def run_all(args, url: str, model: str) -> list[dict]:
    headers = {"Authorization": f"Bearer {args.token}"} if args.token else {}
    limits = httpx.Limits(max_connections=64, max_keepalive_connections=64)
    results = []
    async with httpx.AsyncClient(timeout=120, limits=limits) as client:
        for tokens in args.tokens:
            requests, clients = DEFAULT_PLAN.get(tokens, (100, 8))
            requests = max(1, int(requests * args.scale))
            result = await run_level(client, url, model, tokens, requests, clients, args.time_cap_s, headers)
            print(json.dumps(result), flush=True)
            results.append(result)
    return results


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", help="use this running server (loopback) instead of starting one")
    ap.add_argument("--model", help="model name (default: the preset)")
    ap.add_argument("--token", default=os.environ.get("MEGAMOE_TOKEN"), help="bearer token, if the server wants one")
    ap.add_argument("--preset", default="small")
    ap.add_argument("--backend", default="torch")
    ap.add_argument("--queue-delay-ms", type=float, default=2.0)
    ap.add_argument("--max-batch-tokens", type=int, default=8192)
    ap.add_argument("--torch-threads", type=int, default=0, help="server's torch CPU threads (0: the server's default)")
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 32, 512], help="T per request, one level each")
    ap.add_argument("--scale", type=float, default=1.0, help="multiply every level's request count")
    ap.add_argument("--time-cap-s", type=float, default=60.0, help="stop a level after this long")
    ap.add_argument("--start-timeout-s", type=float, default=180.0)
    ap.add_argument("--client", choices=["httpx", "perf_analyzer"], default="httpx",
                    help="httpx: this script's own asyncio client (BF16 hidden states); perf_analyzer: NVIDIA's "
                         "load generator (scripts/install_perf_analyzer.sh), FP32 hidden states as advertised")
    ap.add_argument("--perf-analyzer", default=str(Path(sys.prefix) / "bin" / "perf_analyzer"))
    ap.add_argument("--pa-window-ms", type=int, default=3000, help="perf_analyzer's measurement window")
    ap.add_argument("--out", default=str(REPO / "bench" / "results" / "serve_cpu.json"))
    args = ap.parse_args(argv)

    proc = None
    url = args.url
    if url is None:
        proc, url = start_server(args)
    if not url.startswith(("http://127.0.0.1", "http://localhost", "http://[::1]")):
        raise SystemExit("this load test only talks to loopback addresses")
    model = args.model or args.preset
    try:
        server_meta = httpx.get(f"{url}/v2/models/{model}", timeout=10).json()
        server_version = httpx.get(f"{url}/v2", timeout=10).json().get("version")
        if args.client == "perf_analyzer":
            import tempfile

            results = []
            with tempfile.TemporaryDirectory() as tmp:
                for tokens in args.tokens:
                    clients = DEFAULT_PLAN.get(tokens, (100, 8))[1]
                    results.append(perf_analyzer_level(args, url, model, tokens, clients, Path(tmp)))
                    print(json.dumps(results[-1]), flush=True)
        else:
            results = asyncio.run(run_all(args, url, model))
    finally:
        if proc is not None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(60)

    record = {
        "command": "python " + " ".join(shlex.quote(a) for a in [os.path.relpath(__file__, REPO), *(argv or sys.argv[1:])]),
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "what": "loopback HTTP load: binary v2 infer (" + ("FP32" if args.client == "perf_analyzer" else "BF16")
                + " hidden, INT32 ids, FP32 weights), one server process",
        "server": {"url": url if args.url else "started by this script", "model": model, "preset": args.preset,
                   "backend": server_meta.get("parameters", {}).get("backend"),
                   "device": server_meta.get("parameters", {}).get("device"),
                   "queue_delay_ms": args.queue_delay_ms, "max_batch_tokens": args.max_batch_tokens,
                   "torch_threads": server_meta.get("parameters", {}).get("torch_threads"),
                   "shape": {k: server_meta.get("parameters", {}).get(k)
                             for k in ("hidden_size", "intermediate_size", "num_experts", "top_k")}},
        "client": ("perf_analyzer 2.48.0 (tritonclient 2.48.0 wheel)" if args.client == "perf_analyzer"
                   else "httpx.AsyncClient") + " in the same machine (shares its CPU with the server)",
        "versions": {**versions(), "megamoe": server_version},
        "machine": machine(),
        "results": results,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

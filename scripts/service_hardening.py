"""Hostile-client runs against ``megamoe serve`` on 127.0.0.1 (bounded in count and time).

    python scripts/service_hardening.py [--out bench/results/service_hardening_cpu.json] [--quick]

1. fuzz: schema-fuzzed infer requests, metadata and health URLs, mutated JSON and binary
   bodies; counts responses >= 500 (there must be none) and connection failures.
2. memory: the server's resident memory (its process and children, sampled every 10 ms)
   while the largest JSON body it decodes is processed, and while a body just under the JSON
   limit that holds too many values is refused.
3. latency: T=1 requests one after another, alone, while large JSON bodies are processed,
   and while a full kernel-health run is in progress (p50 / p99).
4. SIGTERM: runs of 16 keep-alive clients, SIGTERM mid-load; requests sent but never
   answered ("lost") must be 0.
5. idle and slow connections: how long until the server closed them all.
6. before authorization: connections declaring large binary bodies to an unknown route and
   without the token (the server's memory, virtual and resident, must not grow), a client that
   never reads its answers (how long until the write timeout closes it), ``Upgrade: h2c``.
7. instances: ``--instances 2``, one SIGSTOPped under 2,000 idle connections (the parent must keep
   answering), then restarted after its heartbeat timeout; one killed while fresh connections
   arrive (503 or 200, never a reset).

Every server is the tiny preset on the torch backend; the figures in service/README.md come
from this script.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "service"))
sys.path.insert(1, str(REPO / "tests"))  # _helpers, which the service tests' kit imports

from test_service_hardening import _mutations, _schema_requests, json_body  # noqa: E402

TOKEN = "hardening-token-7c1"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
PRESET = "tiny"
INFER = f"/v2/models/{PRESET}/infer"
H, E, K = 256, 8, 2


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, *args: str, token: bool = True, log: Path):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = {k: v for k, v in os.environ.items() if not k.startswith("MEGAMOE_")}
        if token:
            env["MEGAMOE_TOKEN"] = TOKEN
        self._log = open(log, "wb")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "megamoe.service", "--host", "127.0.0.1", "--port", str(self.port),
             "--preset", PRESET, "--backend", "torch", "--log-level", "warning", *args],
            cwd=REPO, env=env, stdout=self._log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited {self.proc.returncode}: {log.read_text()[-2000:]}")
            try:
                if httpx.get(self.url + "/v2/health/ready", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise RuntimeError("server not ready")

    def rss_bytes(self, field: str = "VmRSS:") -> int:
        """Resident memory (``VmSize:``: virtual) of the server and every descendant (the JSON decoder process)."""
        total, todo = 0, [self.proc.pid]
        while todo:
            pid = todo.pop()
            try:
                for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                    if line.startswith(field):
                        total += int(line.split()[1]) * 1024
                for task in Path(f"/proc/{pid}/task").iterdir():
                    todo += [int(c) for c in (task / "children").read_text().split()]
            except (FileNotFoundError, ProcessLookupError):
                continue
        return total

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self._log.close()
        return self.proc.returncode


def pct(values, q):
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q * (len(values) - 1))))] if values else None


# --- 1. fuzz ----------------------------------------------------------------------------------------

def fuzz(srv: Server, counts: dict, budget_s: float) -> dict:
    rng = random.Random(1201)
    base_json = json.dumps(json_body(tokens=3)).encode()
    hidden = torch.randn(3, H).numpy().tobytes()
    ids = torch.randint(0, E, (3, K), dtype=torch.int32).numpy().tobytes()
    weights = torch.rand(3, K).numpy().tobytes()
    head = json.dumps({"inputs": [
        {"name": "hidden_states", "datatype": "FP32", "shape": [3, H], "parameters": {"binary_data_size": len(hidden)}},
        {"name": "topk_ids", "datatype": "INT32", "shape": [3, K], "parameters": {"binary_data_size": len(ids)}},
        {"name": "topk_weights", "datatype": "FP32", "shape": [3, K], "parameters": {"binary_data_size": len(weights)}},
    ], "outputs": [{"name": "output", "parameters": {"binary_data": True}}]}).encode()
    binary = head + hidden + ids + weights
    statuses: dict[str, int] = {}
    fives, failures = [], []
    deadline = time.monotonic() + budget_s
    urls = [f"/v2/models/{PRESET}", f"/v2/models/{PRESET}/versions/1", f"/v2/models/{PRESET}/versions/2",
            f"/v2/models/{PRESET}/ready", "/v2/models/%ff", "/v2", "/v2/health/ready", "/v2/health/live",
            "/v1/health/kernels?level=quick", "/v1/health/kernels?level=%00", "/v1/health/kernels?level=",
            "/v1/health/kernels?level=" + "f" * 9000, f"/v2/models/{'m' * 4000}/ready", "/metrics"]

    def requests():
        for body in _schema_requests(rng, counts["schema"]):
            yield "POST", INFER, body, {**AUTH, "Content-Type": "application/json"}
        for body in _mutations(rng, base_json, counts["json"]):
            yield "POST", INFER, body, {**AUTH, "Content-Type": "application/json"}
        for body in _mutations(rng, binary, counts["binary"]):
            length = str(rng.choice([len(head), len(head) + rng.randint(-9, 9), len(body), 0, len(body) + 1]))
            yield "POST", INFER, body, {**AUTH, "Inference-Header-Content-Length": length}
        for i in range(counts["urls"]):
            url = rng.choice(urls)
            if rng.random() < 0.5:
                url = url[: rng.randrange(1, len(url) + 1)] + rng.choice(["", "/", "%", "?a=b", "/infer", "\u00e9"])
            yield rng.choice(["GET", "GET", "POST", "PUT", "DELETE"]), url, b"", \
                rng.choice([AUTH, {}, {"Authorization": "Bearer " + "x" * rng.randint(0, 300)}])

    sent = 0
    with httpx.Client(base_url=srv.url, timeout=60) as client:
        for method, url, body, headers in requests():
            if time.monotonic() > deadline:
                break
            if url.startswith("/v1/health/kernels?level=quick") and rng.random() < 0.9:
                continue  # a quick run takes seconds here: a few are enough
            try:
                reply = client.request(method, url, content=body, headers=headers)
            except httpx.HTTPError as exc:
                failures.append(f"{method} {url[:80]}: {type(exc).__name__}: {exc}"[:300])
                continue
            sent += 1
            key = str(reply.status_code)
            statuses[key] = statuses.get(key, 0) + 1
            if reply.status_code >= 500:
                fives.append({"url": url, "status": reply.status_code, "body": reply.text[:300]})
    return {"requests": sent, "responses_5xx": len(fives), "first_5xx": fives[:5],
            "connection_failures": len(failures), "first_connection_failures": failures[:5],
            "statuses": dict(sorted(statuses.items()))}


# --- 2 and 3. memory and latency ------------------------------------------------------------------------

class Sampler(threading.Thread):
    def __init__(self, srv: Server):
        super().__init__(daemon=True)
        self.srv, self.peak, self.running = srv, 0, True

    def run(self):
        while self.running:
            self.peak = max(self.peak, self.srv.rss_bytes())
            time.sleep(0.01)


def t1_latencies(srv: Server, stop: threading.Event, out: list):
    body = json.dumps(json_body(tokens=1, seed=3)).encode()
    with httpx.Client(base_url=srv.url, timeout=120) as client:
        while not stop.is_set():
            t0 = time.perf_counter()
            reply = client.post(INFER, content=body, headers={**AUTH, "Content-Type": "application/json"})
            assert reply.status_code == 200, reply.text
            out.append(time.perf_counter() - t0)


def big_json(tokens: int) -> bytes:
    gen = torch.Generator().manual_seed(tokens)
    hidden = torch.randn(tokens, H, generator=gen)
    ids = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(tokens)])
    weights = torch.rand(tokens, K, generator=gen)
    return json.dumps({"inputs": [
        {"name": "hidden_states", "datatype": "FP32", "shape": [tokens, H], "data": hidden.flatten().tolist()},
        {"name": "topk_ids", "datatype": "INT32", "shape": [tokens, K], "data": ids.flatten().tolist()},
        {"name": "topk_weights", "datatype": "FP32", "shape": [tokens, K], "data": weights.flatten().tolist()},
    ]}).encode()


def too_many_values_json(size: int) -> bytes:
    head = b'{"inputs":[{"name":"hidden_states","datatype":"FP32","shape":[250000,256],"data":['
    return head + b"0.1234567," * ((size - len(head) - 10) // 10) + b"0]}]}"


def memory_and_latency(srv: Server, tokens: int, repeats: int, health_full: bool, samples_alone: int) -> dict:
    result: dict = {}
    # T=1 alone
    alone: list = []
    stop = threading.Event()
    th = threading.Thread(target=t1_latencies, args=(srv, stop, alone))
    th.start()
    while len(alone) < samples_alone:
        time.sleep(0.05)
    stop.set()
    th.join()
    result["t1_alone"] = {"n": len(alone), "p50_ms": 1e3 * pct(alone, 0.5), "p99_ms": 1e3 * pct(alone, 0.99)}

    body = big_json(tokens)
    baseline = srv.rss_bytes()
    sampler = Sampler(srv)
    sampler.start()
    during: list = []
    stop = threading.Event()
    th = threading.Thread(target=t1_latencies, args=(srv, stop, during))
    th.start()
    big_s = []
    with httpx.Client(base_url=srv.url, timeout=600) as client:
        for _ in range(repeats):
            t0 = time.perf_counter()
            reply = client.post(INFER, content=body, headers={**AUTH, "Content-Type": "application/json"})
            assert reply.status_code == 200, reply.text[:300]
            big_s.append(time.perf_counter() - t0)
    stop.set()
    th.join()
    sampler.running = False
    sampler.join()
    result["largest_decoded_json"] = {
        "tokens": tokens, "body_bytes": len(body), "reply_bytes": len(reply.content), "requests": repeats,
        "seconds_each": [round(s, 2) for s in big_s], "rss_before_bytes": baseline, "rss_peak_bytes": sampler.peak,
        "rss_growth_over_body": round((sampler.peak - baseline) / len(body), 2)}
    result["t1_during_large_json"] = {"n": len(during), "p50_ms": 1e3 * pct(during, 0.5),
                                      "p99_ms": 1e3 * pct(during, 0.99), "max_ms": 1e3 * max(during)}

    refused = too_many_values_json(63 << 20)
    baseline = srv.rss_bytes()
    sampler = Sampler(srv)
    sampler.start()
    t0 = time.perf_counter()
    reply = httpx.post(srv.url + INFER, content=refused, headers={**AUTH, "Content-Type": "application/json"},
                       timeout=600)
    took = time.perf_counter() - t0
    sampler.running = False
    sampler.join()
    result["too_many_values_json"] = {"body_bytes": len(refused), "status": reply.status_code,
                                      "error": reply.json()["error"][:120], "seconds": round(took, 2),
                                      "rss_before_bytes": baseline, "rss_peak_bytes": sampler.peak}
    over = httpx.post(srv.url + INFER, content=b" " * ((64 << 20) + 1), timeout=600,
                      headers={**AUTH, "Content-Type": "application/json"})
    result["json_over_limit"] = {"status": over.status_code, "error": over.json()["error"]}

    if health_full:
        during = []
        stop = threading.Event()
        th = threading.Thread(target=t1_latencies, args=(srv, stop, during))
        th.start()
        t0 = time.perf_counter()
        reports = []

        def full():
            reports.append(httpx.get(srv.url + "/v1/health/kernels?level=full", headers=AUTH, timeout=900))

        callers = [threading.Thread(target=full) for _ in range(3)]
        for c in callers:
            c.start()
        for c in callers:
            c.join(900)
        run_s = time.perf_counter() - t0
        stop.set()
        th.join()
        result["t1_during_full_health"] = {
            "health_seconds": round(run_s, 1), "health_statuses": [r.status_code for r in reports],
            "shared_one_run": len({r.json().get("seed") for r in reports if r.status_code == 200}) == 1,
            "n": len(during), "p50_ms": 1e3 * pct(during, 0.5), "p99_ms": 1e3 * pct(during, 0.99),
            "max_ms": 1e3 * max(during)}
    return result


def binary_body(tokens: int) -> tuple[bytes, dict]:
    gen = torch.Generator().manual_seed(tokens)
    hidden = torch.randn(tokens, H, generator=gen).numpy().tobytes()
    ids = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(tokens)]).int().numpy().tobytes()
    weights = torch.rand(tokens, K, generator=gen).numpy().tobytes()
    head = json.dumps({"inputs": [
        {"name": "hidden_states", "datatype": "FP32", "shape": [tokens, H], "parameters": {"binary_data_size": len(hidden)}},
        {"name": "topk_ids", "datatype": "INT32", "shape": [tokens, K], "parameters": {"binary_data_size": len(ids)}},
        {"name": "topk_weights", "datatype": "FP32", "shape": [tokens, K], "parameters": {"binary_data_size": len(weights)}},
    ], "parameters": {"binary_data_output": True}}).encode()
    return head + hidden + ids + weights, {**AUTH, "Inference-Header-Content-Length": str(len(head))}


def memory_per_format(tokens: int, log_dir: Path) -> dict:
    """Peak resident growth of a fresh server for one T=tokens request, binary and JSON: the
    difference is what the JSON path costs beyond the forward itself."""
    result = {}
    for fmt in ("binary", "json"):
        srv = Server("--selftest-level", "off", log=log_dir / f"memory_{fmt}.log")
        try:
            time.sleep(3)  # the decoder process has started
            if fmt == "binary":
                body, headers = binary_body(tokens)
            else:
                body, headers = big_json(tokens), {**AUTH, "Content-Type": "application/json"}
            baseline = srv.rss_bytes()
            sampler = Sampler(srv)
            sampler.start()
            reply = httpx.post(srv.url + INFER, content=body, headers=headers, timeout=600)
            sampler.running = False
            sampler.join()
            assert reply.status_code == 200, reply.text[:300]
            result[fmt] = {"body_bytes": len(body), "rss_before_bytes": baseline, "rss_peak_bytes": sampler.peak,
                           "growth_bytes": sampler.peak - baseline,
                           "growth_over_body": round((sampler.peak - baseline) / len(body), 2)}
        finally:
            srv.stop()
    result["json_beyond_binary_over_json_body"] = round(
        (result["json"]["growth_bytes"] - result["binary"]["growth_bytes"]) / result["json"]["body_bytes"], 2)
    return result


# --- 4. SIGTERM ----------------------------------------------------------------------------------------------

def sigterm_runs(runs: int, log_dir: Path) -> dict:
    totals = {"ok": 0, "refused": 0, "lost": 0, "other": 0, "exit_codes": [], "why_lost": []}
    body = json.dumps(json_body(tokens=1)).encode()
    for run in range(runs):
        srv = Server("--selftest-level", "off", token=False, log=log_dir / f"sigterm_{run}.log")
        counts = {"ok": 0, "refused": 0, "lost": 0, "other": 0}
        lock = threading.Lock()
        stop_at = time.monotonic() + 40

        def client():
            with httpx.Client(base_url=srv.url, timeout=60) as c:
                while time.monotonic() < stop_at:
                    try:
                        reply = c.post(INFER, content=body, headers={"Content-Type": "application/json"})
                        kind = "ok" if reply.status_code == 200 else "other"
                    except httpx.ConnectError:
                        kind = "refused"
                    except (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError) as exc:
                        kind = "lost"
                        totals["why_lost"].append(f"{type(exc).__name__}: {exc}")
                    with lock:
                        counts[kind] += 1
                    if kind == "refused":
                        return

        threads = [threading.Thread(target=client) for _ in range(16)]
        for t in threads:
            t.start()
        while counts["ok"] < 48 and time.monotonic() < stop_at - 20:
            time.sleep(0.01)
        time.sleep(random.random() * 0.5)
        t_term = time.monotonic()
        srv.proc.send_signal(signal.SIGTERM)
        for t in threads:
            t.join(60)
        try:
            srv.proc.wait(60)
        except subprocess.TimeoutExpired:
            pass
        totals.setdefault("seconds_sigterm_to_exit", []).append(round(time.monotonic() - t_term, 2))
        totals["exit_codes"].append(srv.stop())
        for k, v in counts.items():
            totals[k] += v
    totals["runs"] = runs
    return totals


# --- 5. idle and slow connections ----------------------------------------------------------------------------

def idle_and_slow(srv: Server, idle: int, slow: int, keep_alive_s: float, head_s: float) -> dict:
    socks = [socket.create_connection(("127.0.0.1", srv.port), timeout=30) for _ in range(idle)]
    t0 = time.monotonic()
    open_after = None
    for s in socks:
        s.settimeout(max(0.1, keep_alive_s + 20 - (time.monotonic() - t0)))
        try:
            s.recv(1)
        except OSError:
            pass
        s.close()
    idle_s = time.monotonic() - t0

    slow_socks = [socket.create_connection(("127.0.0.1", srv.port), timeout=30) for _ in range(slow)]
    for s in slow_socks:
        s.sendall(b"GET /v2/health/live HTTP/1.1\r\n")
        s.setblocking(False)
    t0 = time.monotonic()
    alive = set(range(slow))
    i = 0
    while alive and time.monotonic() - t0 < head_s + 30:
        time.sleep(2.0)  # one header line every 2 s, as the hostile client did
        i += 1
        for k in list(alive):
            try:
                slow_socks[k].sendall(f"X-Slow-{i}: {i}\r\n".encode())
                if slow_socks[k].recv(1) == b"":
                    alive.discard(k)
            except BlockingIOError:
                pass
            except OSError:
                alive.discard(k)
    slow_s = time.monotonic() - t0
    for s in slow_socks:
        s.close()
    open_after = len(alive)
    return {"idle_connections": idle, "seconds_until_all_idle_closed": round(idle_s, 1),
            "timeout_keep_alive_s": keep_alive_s, "slow_header_connections": slow,
            "seconds_until_all_slow_closed": round(slow_s, 1), "timeout_request_head_s": head_s,
            "slow_still_open": open_after}


# --- 6. before authorization --------------------------------------------------------------------------------

def _binary_head(path: str, declared: int, token: str | None) -> bytes:
    lines = [f"POST {path} HTTP/1.1", "Host: x", f"Content-Length: {declared}", "Inference-Header-Content-Length: 200"]
    if token:
        lines.append(f"Authorization: Bearer {token}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def _status_of(sock: socket.socket, timeout_s: float = 10.0) -> int | str:
    sock.settimeout(timeout_s)
    try:
        data = sock.recv(4096)
    except OSError as exc:
        return type(exc).__name__
    return int(data.split()[1]) if data.startswith(b"HTTP/1.1 ") else repr(data[:40])


def before_authorization(srv: Server, connections: int) -> dict:
    declared = 200 * 1024 * 1024
    out: dict = {"connections": connections, "declared_bytes_each": declared}
    for name, path, token in (("unknown_route", "/no/such/route/infer", TOKEN), ("no_token", INFER, None)):
        vms0, rss0 = srv.rss_bytes("VmSize:"), srv.rss_bytes()
        socks = []
        for _ in range(connections):
            s = socket.create_connection(("127.0.0.1", srv.port), timeout=30)
            s.sendall(_binary_head(path, declared, token) + b"x" * 65536)
            socks.append(s)
        statuses = [_status_of(s) for s in socks]
        time.sleep(1.0)
        vms1, rss1 = srv.rss_bytes("VmSize:"), srv.rss_bytes()
        for s in socks:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
            s.close()  # reset
        out[name] = {"statuses": {str(k): statuses.count(k) for k in set(statuses)},
                     "virtual_growth_bytes": vms1 - vms0, "resident_growth_bytes": rss1 - rss0}
    # a client that never reads: pipelined requests for 4 MiB answers
    hidden = torch.zeros(4096, H)
    ids = torch.zeros(4096, K, dtype=torch.int32)
    ids[:, 1] = 1
    from megamoe.service.protocol import binary_infer_body

    body, header_length = binary_infer_body({"hidden_states": hidden, "topk_ids": ids,
                                             "topk_weights": torch.full((4096, K), 0.5)})
    head = (f"POST {INFER} HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n"
            f"Inference-Header-Content-Length: {header_length}\r\nAuthorization: Bearer {TOKEN}\r\n\r\n").encode()
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s.connect(("127.0.0.1", srv.port))
    s.settimeout(1.0)
    t0 = time.monotonic()
    sent = 0
    closed_after = None
    while time.monotonic() - t0 < 120:
        try:
            if sent < 8:
                s.sendall(head + body)
                sent += 1
            else:
                time.sleep(0.2)
                s.sendall(b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\n\r\n")  # fails once it is closed
        except TimeoutError:
            continue  # the server does not read while its answers wait: a full send buffer, still open
        except OSError:
            closed_after = round(time.monotonic() - t0, 1)
            break
    s.close()
    out["unread_answers"] = {"requests_sent": sent, "seconds_until_closed": closed_after}
    # Upgrade: h2c on a valid JSON infer
    doc = json.dumps(json_body(tokens=1)).encode()
    with socket.create_connection(("127.0.0.1", srv.port), timeout=30) as u:
        u.sendall((f"POST {INFER} HTTP/1.1\r\nHost: x\r\nContent-Length: {len(doc)}\r\nAuthorization: Bearer "
                   f"{TOKEN}\r\nConnection: Upgrade, HTTP2-Settings\r\nUpgrade: h2c\r\n"
                   "HTTP2-Settings: AAMAAABkAAQAAP__\r\n\r\n").encode() + doc)
        out["upgrade_h2c_status"] = _status_of(u)
    return out


# --- 7. instances ----------------------------------------------------------------------------------------------

def _instance_pids(srv: Server) -> dict[str, int]:
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(srv.url + "/metrics", timeout=10).text
    return {s.labels["instance"]: int(s.labels["pid"]) for f in text_string_to_metric_families(text)
            for s in f.samples if s.name == "megamoe_instance_ready"}


def _wait_ready(srv: Server, timeout_s: float) -> float | None:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        try:
            if httpx.get(srv.url + "/v2/health/ready", timeout=2).status_code == 200:
                return round(time.monotonic() - t0, 1)
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    return None


def instances(log_dir: Path, idle: int, fresh: int) -> dict:
    srv = Server("--selftest-level", "off", "--instances", "2", "--instance-heartbeat-timeout-s", "10",
                 "--timeout-keep-alive-s", "60", token=False, log=log_dir / "instances.log")
    out: dict = {}
    try:
        _wait_ready(srv, 120)
        victim = _instance_pids(srv)["1"]
        os.kill(victim, signal.SIGSTOP)
        t_stop = time.monotonic()
        socks = []
        for _ in range(idle):
            s = socket.socket()
            s.setblocking(False)
            s.connect_ex(("127.0.0.1", srv.port))
            socks.append(s)
        time.sleep(max(0.0, 4.0 - (time.monotonic() - t_stop)))
        latencies, statuses = [], []
        for _ in range(20):
            t0 = time.monotonic()
            try:
                reply = httpx.get(srv.url + "/v2/health/live", timeout=30)
                statuses.append(reply.headers.get("megamoe-instance", "?") + ":" + str(reply.status_code))
            except httpx.HTTPError as exc:
                statuses.append(type(exc).__name__)
            latencies.append(time.monotonic() - t0)
        ready_again = _wait_ready(srv, 180)
        out["hung"] = {"idle_connections": idle, "fresh_after_4s": {k: statuses.count(k) for k in set(statuses)},
                       "fresh_p50_ms": round(1000 * statistics.median(latencies), 1),
                       "fresh_max_ms": round(1000 * max(latencies), 1),
                       "seconds_from_sigstop_to_ready_again": (round(time.monotonic() - t_stop, 1)
                                                              if ready_again is not None else None),
                       "restarted": _instance_pids(srv).get("1") != victim}
        try:
            os.kill(victim, signal.SIGCONT)
        except ProcessLookupError:
            pass
        for s in socks:
            s.close()
        time.sleep(1.0)
        # one instance killed while fresh connections arrive
        victim = _instance_pids(srv)["0"]
        results: list = []
        lock = threading.Lock()

        def one():
            try:
                reply = httpx.get(srv.url + "/v2/health/live", timeout=60)
                kind = str(reply.status_code)
            except httpx.HTTPError as exc:
                kind = type(exc).__name__
            with lock:
                results.append(kind)

        threads = [threading.Thread(target=one) for _ in range(fresh)]
        for k, t in enumerate(threads):
            t.start()
            if k == fresh // 4:
                os.kill(victim, signal.SIGKILL)
        for t in threads:
            t.join(90)
        ready_again = _wait_ready(srv, 180)
        out["killed"] = {"fresh_connections": fresh, "answers": {k: results.count(k) for k in set(results)},
                         "ready_again": ready_again is not None}
    finally:
        out["exit_code"] = srv.stop()
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=str(REPO / "bench" / "results" / "service_hardening_cpu.json"))
    p.add_argument("--quick", action="store_true", help="small counts (a smoke run, not the figures)")
    p.add_argument("--skip", default="", help="comma-separated parts to skip: fuzz,memory,health,conn,auth,format,sigterm,instances")
    args = p.parse_args()
    skip = set(filter(None, args.skip.split(",")))
    log_dir = Path("/tmp/megamoe_hardening")
    log_dir.mkdir(exist_ok=True)
    q = args.quick
    out: dict = {"machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
                             "load_average_at_start": os.getloadavg(), "torch": torch.__version__},
                 "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    srv = Server("--selftest-level", "off", "--timeout-keep-alive-s", "5", "--timeout-request-head-s", "10",
                 "--timeout-write-s", "5", log=log_dir / "main.log")
    try:
        if "fuzz" not in skip:
            counts = {"schema": 300, "json": 200, "binary": 100, "urls": 100} if q else \
                {"schema": 5000, "json": 2000, "binary": 1000, "urls": 1000}
            out["fuzz"] = fuzz(srv, counts, budget_s=60 if q else 900)
            print("fuzz", json.dumps(out["fuzz"])[:400], flush=True)
        if "memory" not in skip:
            out["memory_latency"] = memory_and_latency(
                srv, tokens=256 if q else 4096, repeats=1 if q else 3, health_full="health" not in skip,
                samples_alone=20 if q else 100)
            print("memory", json.dumps(out["memory_latency"])[:1200], flush=True)
        if "conn" not in skip:
            out["connections"] = idle_and_slow(srv, idle=50 if q else 500, slow=20 if q else 200, keep_alive_s=5,
                                               head_s=10)
            print("connections", out["connections"], flush=True)
        if "auth" not in skip:
            out["before_authorization"] = before_authorization(srv, connections=10 if q else 40)
            print("before authorization", out["before_authorization"], flush=True)
    finally:
        out["server_exit_code"] = srv.stop()
    if "format" not in skip:
        out["memory_per_format"] = memory_per_format(256 if q else 4096, log_dir)
        print("memory per format", out["memory_per_format"], flush=True)
    if "sigterm" not in skip:
        out["sigterm"] = sigterm_runs(2 if q else 10, log_dir)
        print("sigterm", out["sigterm"], flush=True)
    if "instances" not in skip:
        out["instances"] = instances(log_dir, idle=200 if q else 2000, fresh=50 if q else 200)
        print("instances", out["instances"], flush=True)
    out["load_average_at_end"] = os.getloadavg()
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    print("wrote", args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())

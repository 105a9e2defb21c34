"""``--instances N``: several serving processes behind one port (service/instances.py). Both
instances answer (their index in the ``megamoe-instance`` header, their process ids in
``/metrics``), ``/metrics`` sums over both, the model configuration reports the count, SIGTERM
drains every instance with the requests in flight answered and exits 0, an instance that dies
more often than --instance-restarts makes the server exit non-zero, torchrun serving refuses the
option (restarts, heartbeats and the parent's queues: test_service_supervision.py)."""

from __future__ import annotations

import csv
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
import torch

from service_testkit import HERE, PRESET, REPO, TOKEN, ServerProcess, infer_body, json_output, metric_samples

AUTH = {"Authorization": f"Bearer {TOKEN}"}
INFER = f"/v2/models/{PRESET}/infer"
INSTANCES = 2


def start(tmp_path: Path, name: str, *args: str) -> ServerProcess:
    srv = ServerProcess(tmp_path / f"{name}.log", env={"MEGAMOE_TOKEN": TOKEN},
                        args=["--backend", "torch", "--instances", str(INSTANCES), "--log-level", "info", *args])
    srv.wait_for("/v2/health/ready")  # every instance ready
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        ready = metric_samples(srv, "megamoe_instance_ready")
        if len(ready) == INSTANCES and all(s.value == 1.0 for s in ready):
            break
        time.sleep(0.2)
    else:
        raise AssertionError(f"not every instance became ready: {ready}\n{srv.log()}")
    time.sleep(0.5)  # the probes' connections are closed and counted by the parent
    return srv


@pytest.fixture(scope="module")
def multi(tmp_path_factory):
    srv = start(tmp_path_factory.mktemp("instances"), "server", "--queue-delay-ms", "300")
    try:
        yield srv
    finally:
        srv.stop()


def log_of(server: ServerProcess) -> str:
    """The server's log, also after stop() (which closes the testkit's handle)."""
    return server.log_path.read_text(errors="replace")


def instance_pids(server) -> dict[str, str]:
    return {s.labels["instance"]: s.labels["pid"] for s in metric_samples(server, "megamoe_instance_ready")}


def test_both_instances_answer_and_metrics_sum_over_them(multi, layer):
    pids = instance_pids(multi)
    assert sorted(pids) == [str(i) for i in range(INSTANCES)] and len(set(pids.values())) == INSTANCES, pids
    assert multi.proc.pid not in {int(p) for p in pids.values()}  # the parent serves nothing itself
    status, config = multi.get(f"/v2/models/{PRESET}/config")
    assert status == 200 and config["instance_group"][0]["count"] == INSTANCES, config

    def count(code: str) -> float:
        return sum(s.value for s in metric_samples(multi, "megamoe_requests_total")
                   if s.labels == {"route": "/v2/models/{model_name}/infer", "code": code})

    before = count("200")
    time.sleep(0.3)  # that connection's close has reached the parent's count
    # one keep-alive connection per client, opened at the same time: the parent spreads them
    clients = [httpx.Client(base_url=multi.url, headers=AUTH, timeout=30) for _ in range(INSTANCES)]
    answered: dict[int, set[str]] = {}
    errors = []

    def run(k: int, client: httpx.Client) -> None:
        try:
            for j in range(3):
                body, expected = infer_body(layer, tokens=3 + k, seed=100 * k + j)
                reply = client.post(INFER, json=body)
                torch.testing.assert_close(json_output(reply, expected), expected, rtol=0, atol=0)
                answered.setdefault(k, set()).add(reply.headers["megamoe-instance"])
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(k, c)) for k, c in enumerate(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    for c in clients:
        c.close()
    assert not errors, errors
    # a connection stays with its instance; the two connections went to different ones
    assert all(len(v) == 1 for v in answered.values()), answered
    assert set().union(*answered.values()) == {str(i) for i in range(INSTANCES)}, answered
    # /metrics, whichever instance answers it, counts the requests of both
    assert count("200") - before == 3 * INSTANCES
    tokens = sum(s.value for s in metric_samples(multi, "megamoe_tokens_processed_total"))
    assert tokens >= 3 * (3 + 4)


def test_perf_analyzer_against_two_instances(multi, layer, tmp_path):
    pa = Path(sys.prefix) / "bin" / "perf_analyzer"
    if not pa.exists():
        pytest.skip("perf_analyzer is not installed (scripts/install_perf_analyzer.sh)")
    from test_perf_analyzer import WINDOWS, write_data_file

    data = write_data_file(tmp_path / "data.json", layer, 4, streams=2, seed=5)
    report = tmp_path / "pa.csv"
    out = subprocess.run([str(pa), "-m", PRESET, "-u", multi.url.removeprefix("http://"), "-i", "http",
                          "-H", f"Authorization: Bearer {TOKEN}", "-f", str(report), *WINDOWS,
                          "--concurrency-range", "4:4", "--input-data", str(data)],
                         capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert out.returncode == 0, (out.stdout + out.stderr)[-3000:]
    row = next(csv.DictReader(report.open()))
    assert float(row["Inferences/Second"]) > 0, row


def test_sigterm_drains_every_instance_and_exits_0(multi, layer):
    """Runs last on the module's server: requests in flight on both instances are answered."""
    # the batcher holds a request 300 ms: SIGTERM arrives while both are queued
    time.sleep(0.3)  # earlier connections' closes have reached the parent's count
    clients = [httpx.Client(base_url=multi.url, headers=AUTH, timeout=30) for _ in range(INSTANCES)]
    for c in clients:
        assert c.get("/v2/health/live").status_code == 200  # open the connections first
    replies: dict[int, tuple] = {}

    def run(k: int) -> None:
        body, expected = infer_body(layer, tokens=2, seed=900 + k)
        try:
            replies[k] = (clients[k].post(INFER, json=body), expected)
        except Exception as exc:  # noqa: BLE001 - reported below
            replies[k] = (exc, expected)

    threads = [threading.Thread(target=run, args=(k,)) for k in range(INSTANCES)]
    for t in threads:
        t.start()
    time.sleep(0.1)
    multi.proc.send_signal(signal.SIGTERM)
    for t in threads:
        t.join(30)
    for c in clients:
        c.close()
    code = multi.stop()
    assert code == 0, log_of(multi)
    seen = set()
    for k, (reply, expected) in replies.items():
        assert isinstance(reply, httpx.Response), (reply, log_of(multi))
        torch.testing.assert_close(json_output(reply, expected), expected, rtol=0, atol=0)
        seen.add(reply.headers["megamoe-instance"])
    assert seen == {str(i) for i in range(INSTANCES)}, seen
    assert "drained and exited" in log_of(multi)


def test_connections_go_to_the_ready_instance_only(tmp_path, layer):
    """While one instance is ready and the other still loads, every new connection goes to the
    ready one; once both are ready, the next connection goes to the one with fewer open."""
    gate = tmp_path / "gate"
    srv = ServerProcess(tmp_path / "gated.log", env={"MEGAMOE_TOKEN": TOKEN, "MEGAMOE_TEST_GATE": str(gate)},
                        args=["--backend", "megamoe_test_backends:FirstLoadsBackend", "--instances", str(INSTANCES),
                              "--no-share-weights",  # every instance loads (prepares) its own layer: one waits
                              "--queue-delay-ms", "1", "--log-level", "info"])
    clients = []
    try:
        srv.wait_for("/v2/health/live")
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:  # the loading one has reported its (not ready) gauge too
            ready = {s.labels["instance"]: s.value for s in metric_samples(srv, "megamoe_instance_ready")}
            if len(ready) == INSTANCES and 1.0 in ready.values():  # one ready, the other loading
                break
            time.sleep(0.1)
        assert sorted(ready.values()) == [0.0, 1.0], ready
        first = next(k for k, v in ready.items() if v == 1.0)
        # the server is not ready while it runs an instance short: the ready one says so
        status, body = srv.get("/v2/health/ready")
        assert status == 503 and "1 of 2 instances ready" in body["error"], body
        assert [s.value for s in metric_samples(srv, "megamoe_ready")] == [0.0]
        for k in range(3):  # connections kept open: still every one to the ready instance
            client = httpx.Client(base_url=srv.url, headers=AUTH, timeout=30)
            clients.append(client)
            body, expected = infer_body(layer, tokens=2, seed=300 + k)
            reply = client.post(INFER, json=body)
            torch.testing.assert_close(json_output(reply, expected), expected, rtol=0, atol=0)
            assert reply.headers["megamoe-instance"] == first, (k, reply.headers)
        gate.touch()
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            ready = {s.labels["instance"]: s.value for s in metric_samples(srv, "megamoe_instance_ready")}
            if list(ready.values()) == [1.0] * INSTANCES:
                break
            time.sleep(0.2)
        assert list(ready.values()) == [1.0] * INSTANCES, (ready, log_of(srv))
        time.sleep(0.3)  # the probes' connections are closed and counted
        late = httpx.Client(base_url=srv.url, headers=AUTH, timeout=30)
        clients.append(late)
        reply = late.get("/v2/health/ready")
        assert reply.status_code == 200 and reply.headers["megamoe-instance"] != first, reply.headers
    finally:
        for c in clients:
            c.close()
        code = srv.stop()
    assert code == 0, log_of(srv)


def test_an_instance_killed_beyond_its_restarts_stops_the_server_nonzero(tmp_path):
    srv = start(tmp_path, "killed", "--queue-delay-ms", "1", "--instance-restarts", "0")
    try:
        victim = int(instance_pids(srv)["1"])
        os.kill(victim, signal.SIGKILL)
        srv.proc.wait(60)
        assert srv.proc.returncode not in (0, None), log_of(srv)
        log = log_of(srv)
        assert f"instance 1 (pid {victim}) exited with status -9" in log, log
        assert "drained and exited" in log, log  # the other one was stopped, not left behind
    finally:
        srv.stop()


def test_torchrun_serving_refuses_instances():
    env = {k: v for k, v in os.environ.items() if not k.startswith("MEGAMOE_")}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), str(HERE), env.get("PYTHONPATH", "")])
    out = subprocess.run([sys.executable, "-m", "megamoe.service.distributed", "--preset", PRESET, "--backend", "torch",
                          "--instances", "2"], capture_output=True, text=True, timeout=120, env=env, cwd=REPO)
    assert out.returncode == 2, out.stdout + out.stderr
    assert "--instances 2 is not supported with torchrun" in out.stderr, out.stderr

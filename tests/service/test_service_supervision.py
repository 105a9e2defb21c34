"""``--instances N`` supervised (service/instances.py): an instance that is killed is restarted and
the server is unready meanwhile; a hung one (SIGSTOP) gets no new connections and is restarted; the
parent never blocks on a hung instance, however many connections arrive; an instance whose device
fails turns unready, closes its keep-alive connections with ``Connection: close``, exits and is
restarted; connections the parent cannot place are answered 503, not reset."""

from __future__ import annotations

import os
import signal
import socket
import time

import httpx
import pytest

from service_testkit import PRESET, TOKEN, ServerProcess, infer_body

AUTH = {"Authorization": f"Bearer {TOKEN}"}
INFER = f"/v2/models/{PRESET}/infer"
pytestmark = pytest.mark.slow


def start(tmp_path, name: str, *args: str, env: dict | None = None) -> ServerProcess:
    srv = ServerProcess(tmp_path / f"{name}.log", env={"MEGAMOE_TOKEN": TOKEN, **(env or {})},
                        args=["--backend", "torch", "--instances", "2", "--log-level", "info", "--selftest-level", "off",
                              "--queue-delay-ms", "1", *args])
    srv.wait_for("/v2/health/ready", timeout_s=120)  # every instance ready
    return srv


def pids(srv: ServerProcess) -> dict[str, int]:
    from prometheus_client.parser import text_string_to_metric_families

    _, text = srv.get("/metrics")
    return {s.labels["instance"]: int(s.labels["pid"]) for f in text_string_to_metric_families(text)
            for s in f.samples if s.name == "megamoe_instance_ready"}


def wait_until(predicate, timeout_s: float, what: str, srv: ServerProcess):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"{what} within {timeout_s} s\n{srv.log_path.read_text(errors='replace')[-4000:]}")


def test_a_killed_instance_is_restarted_and_the_server_unready_meanwhile(tmp_path, layer):
    srv = start(tmp_path, "restart")
    try:
        victim = pids(srv)["1"]
        os.kill(victim, signal.SIGKILL)
        status, body = wait_until(lambda: (lambda r: r if r[0] == 503 else None)(srv.get("/v2/health/ready")),
                                  10, "readiness turned 503", srv)
        assert "instances ready" in body["error"], body
        wait_until(lambda: srv.get("/v2/health/ready")[0] == 200, 120, "ready again", srv)
        assert pids(srv)["1"] != victim
        seen = set()
        clients = [httpx.Client(base_url=srv.url, headers=AUTH, timeout=30) for _ in range(4)]
        try:  # connections held open: the fewest-open instance gets the next, so both serve
            for k, client in enumerate(clients):
                body, expected = infer_body(layer, tokens=2, seed=40 + k)
                reply = client.post(INFER, json=body)
                assert reply.status_code == 200, reply.text
                seen.add(reply.headers["megamoe-instance"])
        finally:
            for client in clients:
                client.close()
        assert seen == {"0", "1"}, seen
        assert f"instance 1 (pid {victim}) exited with status -9" in srv.log() and "restarting it" in srv.log()
    finally:
        assert srv.stop() == 0, srv.log_path.read_text(errors="replace")[-4000:]


def test_a_hung_instance_gets_no_connections_the_parent_never_blocks_and_it_is_restarted(tmp_path):
    srv = start(tmp_path, "hung", "--instance-heartbeat-timeout-s", "12", "--timeout-keep-alive-s", "30")
    victim = pids(srv)["1"]
    idle: list[socket.socket] = []
    try:
        os.kill(victim, signal.SIGSTOP)
        # at once, a burst of idle connections: the parent hands some to the hung instance until its
        # socket and its queue are full, and never blocks on it
        for _ in range(1500):
            s = socket.socket()
            s.setblocking(False)
            s.connect_ex(("127.0.0.1", srv.port))
            idle.append(s)
        # 200 of them send a request: those handed to the hung instance wait, intact, in its socket
        asking = idle[:200]
        for s in asking:
            s.setblocking(True)
            s.settimeout(30)
            s.sendall(b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\n\r\n")
        time.sleep(4.0)  # past the 3 s of silence: no new connection goes to the hung instance
        answered = []
        for _ in range(6):
            started = time.monotonic()
            reply = httpx.get(srv.url + "/v2/health/ready", timeout=10)
            answered.append((reply.status_code, reply.headers.get("megamoe-instance"), time.monotonic() - started))
        assert all(instance == "0" and status == 503 and seconds < 5 for status, instance, seconds in answered), answered
        assert "1 of 2 instances ready" in reply.json()["error"], reply.text
        # the heartbeat timeout: killed and restarted
        wait_until(lambda: pids(srv).get("1") not in (None, victim), 120, "a new instance 1", srv)
        wait_until(lambda: srv.get("/v2/health/ready")[0] == 200, 120, "ready again", srv)
        log = srv.log()
        assert "sent no heartbeat" in log and "restarting it" in log, log
        # every request was answered, those the hung instance never took by the other one: none reset
        answers = []
        for s in asking:
            try:
                answers.append(s.recv(4096).split(b"\r\n")[0])
            except OSError as exc:
                answers.append(type(exc).__name__.encode())
        assert answers == [b"HTTP/1.1 200 OK"] * len(asking), {a: answers.count(a) for a in set(answers)}
    finally:
        try:
            os.kill(victim, signal.SIGCONT)
        except ProcessLookupError:
            pass
        for s in idle:
            s.close()
        srv.stop()


def test_an_instance_whose_device_fails_leaves_with_connection_close_and_is_restarted(tmp_path, layer):
    broken = tmp_path / "break"
    srv = start(tmp_path, "device", "--backend", "megamoe_test_backends:DeviceDiesOnFileBackend",
                env={"MEGAMOE_TEST_BREAK": str(broken)})
    try:
        before = pids(srv)
        body, expected = infer_body(layer, tokens=2, seed=7)
        with httpx.Client(base_url=srv.url, headers=AUTH, timeout=30) as client:
            broken.touch()
            reply = client.post(INFER, json=body)
            broken.unlink()
            assert reply.status_code == 500 and "illegal memory access" in reply.text, reply.text
            assert reply.headers.get("connection") == "close", reply.headers
            failed = reply.headers["megamoe-instance"]
            # the keep-alive client reconnects: to an instance that can serve
            wait_until(lambda: client.post(INFER, json=body).status_code == 200, 60, "served again", srv)
        wait_until(lambda: pids(srv).get(failed) not in (None, before[failed]), 120, "the instance restarted", srv)
        wait_until(lambda: srv.get("/v2/health/ready")[0] == 200, 120, "ready again", srv)
        log = srv.log()
        assert "leaves after a device error" in log and "restarting it" in log, log
    finally:
        assert srv.stop() == 0, srv.log_path.read_text(errors="replace")[-4000:]


def test_connections_in_the_backlog_at_stop_are_answered_503_not_reset():
    """The parent's own refusal (no instance involved): the clients waiting in the listen backlog, their
    requests already sent, each read a whole 503 with Connection: close, and no reset."""
    from megamoe.service.instances import _Supervisor, listen_socket
    from megamoe.service.settings import ServiceSettings

    listener = listen_socket("127.0.0.1", 0)
    listener.setblocking(False)
    port = listener.getsockname()[1]
    clients = []
    for k in range(20):
        c = socket.create_connection(("127.0.0.1", port), timeout=10)
        c.sendall(b"POST /v2/models/x/infer HTTP/1.1\r\nHost: x\r\nContent-Length: 5000\r\n\r\n" + b"x" * 5000)
        clients.append(c)
    supervisor = _Supervisor(listener, ServiceSettings(instances=2), [])
    supervisor.stop()  # nothing started: the backlog is answered, the socket closed
    assert len(supervisor.refusing) == 20
    for c in clients:
        data = b""
        while True:
            chunk = c.recv(65536)  # a reset would raise ConnectionResetError here
            if not chunk:
                break
            data += chunk
        assert data.startswith(b"HTTP/1.1 503 ") and b"connection: close" in data and b"shutting down" in data, data
        c.close()
    assert supervisor.run() == 0  # reads what the clients sent until they close, then ends
    assert not supervisor.refusing

"""A server's life: not ready while loading, ready after the self-test, not ready when a
later check fails, a broken SF layout caught by the kernel-health report, SIGTERM
finishing the requests in flight."""

from __future__ import annotations

import signal
import threading
import time

import httpx
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from service_testkit import PRESET, TOKEN, ServerProcess, infer_body

AUTH = {"Authorization": f"Bearer {TOKEN}"}
INFER = f"/v2/models/{PRESET}/infer"


def metric(server, name: str, **labels) -> float | None:
    _, text = server.get("/metrics")
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return sample.value
    return None


def wait_until(predicate, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")


def test_readiness_follows_startup_and_checks_and_sigterm_drains(tmp_path, layer):
    gate, broken = tmp_path / "gate", tmp_path / "broken"
    srv = ServerProcess(
        tmp_path / "server.log",
        env={"MEGAMOE_TOKEN": TOKEN, "MEGAMOE_TEST_GATE": str(gate), "MEGAMOE_TEST_BREAK": str(broken)},
        args=["--backend", "megamoe_test_backends:ControlledTorchBackend", "--queue-delay-ms", "1500"],
    )
    try:
        # 1. loading (held at the gate): alive, not ready, infer refused with 503
        srv.wait_for("/v2/health/live")
        status, body = srv.get("/v2/health/ready")
        assert status == 503 and "loading" in body["error"], body
        assert srv.get(f"/v2/models/{PRESET}/ready")[0] == 503
        request, expected = infer_body(layer, tokens=4, seed=1)
        reply = httpx.post(srv.url + INFER, json=request, headers=AUTH, timeout=10)
        assert reply.status_code == 503 and "error" in reply.json()
        assert metric(srv, "megamoe_ready") == 0.0

        # 2. loaded and self-tested: ready
        gate.touch()
        srv.wait_for("/v2/health/ready", 200)
        assert srv.get(f"/v2/models/{PRESET}/ready")[0] == 200
        assert metric(srv, "megamoe_ready") == 1.0

        # 3. a later check fails (the SF swizzle breaks): the report says so, readiness turns 503
        broken.touch()
        status, report = srv.get("/v1/health/kernels?level=quick", token=TOKEN, timeout=60)
        assert status == 200 and report["status"] == "fail", report
        status, body = srv.get("/v2/health/ready")
        assert status == 503 and "self-test failed" in body["error"], body
        assert metric(srv, "megamoe_selftest_check_status", level="quick", check="sf_roundtrip") == 0.0

        # 4. fixed: the next check passes and the server is ready again
        broken.unlink()
        status, report = srv.get("/v1/health/kernels?level=quick", token=TOKEN, timeout=60)
        assert report["status"] == "pass", report
        assert srv.get("/v2/health/ready")[0] == 200

        # 5. SIGTERM while a request waits in the batcher (1.5 s window): it still completes
        result = {}

        def call():
            result["reply"] = httpx.post(srv.url + INFER, json=request, headers=AUTH, timeout=60)

        caller = threading.Thread(target=call)
        caller.start()
        wait_until(lambda: metric(srv, "megamoe_batcher_queued_requests") == 1.0, 20, "the request to be queued")
        srv.proc.send_signal(signal.SIGTERM)
        caller.join(60)
        reply = result["reply"]
        assert reply.status_code == 200, reply.text
        out = reply.json()["outputs"][0]
        assert torch.equal(torch.tensor(out["data"]).reshape(out["shape"]), expected)
        assert srv.proc.wait(30) == 0, srv.log()
    finally:
        srv.stop()


def test_broken_swizzle_fails_selftest_and_health_report(tmp_path, layer):
    """docs/FIELD_BUGS.md row 2 (M and K swapped in the SF swizzle): never ready; the report shows which checks."""
    srv = ServerProcess(tmp_path / "server.log", env={"MEGAMOE_TOKEN": TOKEN},
                        args=["--backend", "megamoe_test_backends:swapped_swizzle_backend",
                              "--selftest-interval-s", "2"])
    try:
        srv.wait_for("/v2/health/live")
        wait_until(lambda: "self-test failed" in str(srv.get("/v2/health/ready")[1]), 90, "the start-up self-test")
        assert srv.get("/v2/health/ready")[0] == 503
        # the periodic re-check runs on its own, and keeps failing
        wait_until(lambda: (metric(srv, "megamoe_selftest_runs_total", level="quick", status="fail") or 0) >= 2, 90,
                   "a periodic self-test")

        status, report = srv.get("/v1/health/kernels?level=quick", token=TOKEN, timeout=60)
        assert status == 200
        assert report["status"] == "fail"
        checks = {c["name"]: c for c in report["checks"]}
        assert checks["sf_roundtrip"]["status"] == "fail" and checks["sf_roundtrip"]["metric"] > 0
        assert checks["gemm_cosine_random"]["status"] == "fail"
        # the case that hid the bug: uniform scales still look perfect
        assert checks["gemm_cosine_uniform"]["status"] == "pass"

        request, _ = infer_body(layer, tokens=2, seed=3)
        reply = httpx.post(srv.url + INFER, json=request, headers=AUTH, timeout=10)
        assert reply.status_code == 503 and "self-test failed" in reply.json()["error"]
        assert metric(srv, "megamoe_selftest_runs_total", level="quick", status="fail") >= 3
        assert metric(srv, "megamoe_ready") == 0.0
    finally:
        assert srv.stop() == 0


def test_sticky_device_error_turns_readiness_off(tmp_path, layer):
    srv = ServerProcess(tmp_path / "server.log", args=["--backend", "megamoe_test_backends:StickyDeviceErrorBackend",
                                                       "--selftest-level", "off"])
    try:
        srv.wait_for("/v2/health/ready", 200)
        request, _ = infer_body(layer, tokens=2, seed=4)
        reply = httpx.post(srv.url + INFER, json=request, timeout=30)
        assert reply.status_code == 500 and "illegal memory access" in reply.json()["error"]
        status, body = srv.get("/v2/health/ready")
        assert status == 503 and "device reported an error" in body["error"], body
        reply = httpx.post(srv.url + INFER, json=request, timeout=30)
        assert reply.status_code == 503
        assert srv.get("/v2/health/live")[0] == 200  # alive: the orchestrator decides, from readiness
        assert metric(srv, "megamoe_ready") == 0.0
        assert metric(srv, "megamoe_request_failures_total", route="/v2/models/{model_name}/infer", reason="internal") == 1.0
    finally:
        assert srv.stop() == 0


@pytest.mark.parametrize("argv", [["--help"]])
def test_help_answers(argv):
    import subprocess
    import sys

    from service_testkit import REPO

    out = subprocess.run([sys.executable, "-m", "megamoe.service", *argv], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    for flag in ("--checkpoint", "--preset", "--backend", "--host", "--port", "--token", "--max-body-bytes",
                 "--max-tokens-per-request", "--queue-delay-ms", "--max-batch-tokens"):
        assert flag in out.stdout, flag


def test_single_process_serve_refuses_tensor_parallel(capsys):
    """--tp N > 1 runs under torchrun, one process per rank; a single-process server would
    silently serve the whole layer, so it refuses with the command to run instead."""
    from megamoe.service import main

    assert main(["--tp", "4"]) == 2
    err = capsys.readouterr().err
    assert "--tp 4" in err and "torchrun --nproc-per-node 4 -m megamoe.service.distributed" in err

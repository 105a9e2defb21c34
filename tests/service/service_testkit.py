"""Helpers for the service tests: a real ``python -m megamoe.service`` process on 127.0.0.1
(free port, bounded waits), and random inputs. Imported by conftest and the tests.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import torch

from _helpers import random_inputs  # noqa: F401 - one copy for every test folder; the service tests import it from here

REPO = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
if str(REPO) not in sys.path:  # the service and megamoe packages, when not installed
    sys.path.insert(0, str(REPO))

TOKEN = "test-token-3f9a"
PRESET = "tiny"
START_TIMEOUT_S = 90.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """``python -m megamoe.service`` in a child process, with its log kept for failure messages."""

    def __init__(self, log_path: Path, *, env: dict[str, str] | None = None, args: list[str] | None = None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        child_env = {k: v for k, v in os.environ.items() if not k.startswith("MEGAMOE_")}
        child_env["PYTHONPATH"] = os.pathsep.join([str(REPO), str(HERE), child_env.get("PYTHONPATH", "")])
        child_env.update(env or {})
        # the test process's thread count: CPU GEMMs sum in an order that depends on it, and the
        # tests compare the server's results bit for bit with this process's forward
        cmd = [sys.executable, "-m", "megamoe.service", "--host", "127.0.0.1", "--port", str(self.port),
               "--preset", PRESET, "--log-level", "warning", "--torch-threads", str(torch.get_num_threads()),
               *(args or [])]
        self._log = open(log_path, "wb")
        self.proc = subprocess.Popen(cmd, cwd=REPO, env=child_env, stdout=self._log, stderr=subprocess.STDOUT)

    def log(self) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")[-4000:]

    def get(self, path: str, token: str | None = None, timeout: float = 10.0) -> tuple[int, dict | str]:
        request = urllib.request.Request(self.url + path)
        if token:
            request.add_header("Authorization", f"Bearer {token}")
        try:
            with urllib.request.urlopen(request, timeout=timeout) as reply:
                return reply.status, _decode(reply.read(), reply.headers.get("content-type", ""))
        except urllib.error.HTTPError as exc:
            return exc.code, _decode(exc.read(), exc.headers.get("content-type", ""))

    def wait_for(self, path: str, status: int = 200, timeout_s: float = START_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout_s
        last = None
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"server exited with {self.proc.returncode}:\n{self.log()}")
            try:
                last = self.get(path, timeout=2.0)
                if last[0] == status:
                    return
            except OSError as exc:
                last = exc
            time.sleep(0.1)
        raise AssertionError(f"{path} never answered {status} within {timeout_s}s (last: {last}):\n{self.log()}")

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 30.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self._log.close()
        return self.proc.returncode


class LocalServer:
    """The service's server on a thread of this process (see the module doc)."""

    def __init__(self, layer, **overrides):
        fields = dict(host="127.0.0.1", port=free_port(), preset=PRESET, backend="torch", selftest_level="off",
                      log_level="warning", max_tokens_per_request=64, queue_delay_ms=2.0)
        fields.update(overrides)
        from megamoe.service.server import build_server
        from megamoe.service.settings import ServiceSettings

        self.settings = ServiceSettings(**fields)
        self.server = build_server(self.settings, layer=layer)
        self.state = self.server.service_state
        self.plane = self.server.config.app.state.dataplane
        self.port = self.settings.port
        self.url = f"http://127.0.0.1:{self.port}"
        self.thread = threading.Thread(target=self.server.run, name="local-server", daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 60
        while not (self.server.started and self.state.batcher is not None):
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise AssertionError("the local server did not start")
            time.sleep(0.02)

    def sigterm(self) -> None:
        self.server.handle_exit(signal.SIGTERM, None)

    def stop(self, timeout_s: float = 60) -> None:
        if self.thread.is_alive():
            self.sigterm()
            self.thread.join(timeout_s)
        assert not self.thread.is_alive(), "the local server did not stop"

    def metric(self, name: str, **labels) -> float:
        from prometheus_client.parser import text_string_to_metric_families

        text = self.state.metrics.render().decode()
        total = 0.0
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                    total += s.value
        return total


def _decode(raw: bytes, content_type: str):
    if "json" in content_type:
        return json.loads(raw)
    return raw.decode(errors="replace")



def metric_samples(server: "ServerProcess", name: str) -> list:
    """The samples called ``name`` in ``server``'s ``/metrics``, whichever instance answers it."""
    from prometheus_client.parser import text_string_to_metric_families

    _, text = server.get("/metrics")
    return [s for family in text_string_to_metric_families(text) for s in family.samples if s.name == name]


def json_output(reply, like: torch.Tensor) -> torch.Tensor:
    """The first output of a 200 JSON infer reply (an ``httpx.Response``), in ``like``'s dtype."""
    assert reply.status_code == 200, reply.text[:500]
    out = reply.json()["outputs"][0]
    return torch.tensor(out["data"], dtype=torch.float32).reshape(out["shape"]).to(like.dtype)


def infer_body(layer, tokens: int, seed: int):
    """A JSON infer request of random inputs (FP32 hidden states, routing given) and ``layer``'s output for it."""
    hidden, ids, weights = random_inputs(layer, tokens, seed)
    body = {"inputs": [
        {"name": "hidden_states", "datatype": "FP32", "shape": list(hidden.shape), "data": hidden.flatten().tolist()},
        {"name": "topk_ids", "datatype": "INT32", "shape": list(ids.shape), "data": ids.flatten().tolist()},
        {"name": "topk_weights", "datatype": "FP32", "shape": list(weights.shape), "data": weights.flatten().tolist()},
    ]}
    return body, layer.forward(hidden, topk_ids=ids, topk_weights=weights)

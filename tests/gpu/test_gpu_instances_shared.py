"""``megamoe serve --instances N`` on the GPU holds one copy of the layer's device weights (service/shared_weights.py:
the weights process prepares the layer once, the instances map it through CUDA IPC), not N.

The device memory in use (``torch.cuda.mem_get_info``, the whole device, over what was in use before the server
started) is measured for one instance, two instances with their own copies (``--no-share-weights``) and two
sharing one copy; the figures are printed (run with ``-s``), with the per-process figures of nvidia-smi where it
is installed. Two instances sharing the weights use less than one instance plus half a copy of the weights (the
difference is CUDA contexts and workspaces), and at least 0.75 of a copy less than two with their own; the two
instances answer a request bit for bit alike, and like an instance with its own copy.

The README's figure (instances = 1, 2, 4, shared and not)::

    python tests/gpu/test_gpu_instances_shared.py --preset v3 --instances 1 2 4
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
#: the layer measured by the test: v3's ~6 GB of NVFP4 weights dwarf a CUDA context
PRESET = "v3"
START_TIMEOUT_S = 600.0
GiB = 2**30


def _service_importable() -> bool:
    try:
        import megamoe.service  # noqa: F401 - the installed layout (wheel or editable install)
    except Exception:  # noqa: BLE001 - missing extras or a source tree without the install
        return False
    return True


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url: str, timeout: float = 5.0) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as reply:
            return reply.status, reply.read().decode(errors="replace")
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode(errors="replace")


def _post(url: str, body: dict, timeout: float = 120.0) -> tuple[int, dict, str]:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as reply:
            return reply.status, json.loads(reply.read()), reply.headers.get("megamoe-instance", "")
    except urllib.error.HTTPError as exc:
        return exc.code, {"error": exc.read().decode(errors="replace")}, ""


def device_used_bytes() -> int:
    free, total = torch.cuda.mem_get_info()
    return total - free


def nvidia_smi_apps() -> dict[int, int]:
    """{pid: MiB used} of the compute processes on the GPUs (empty without nvidia-smi)."""
    if shutil.which("nvidia-smi") is None:
        return {}
    out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                         capture_output=True, text=True, timeout=30)
    apps = {}
    for line in out.stdout.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) == 2 and parts[0].isdigit() and parts[1].isdigit():
            apps[int(parts[0])] = int(parts[1])
    return apps


class Server:
    """``python -m megamoe.service`` with N instances, until every instance is ready."""

    def __init__(self, preset: str, instances: int, share: bool, log_dir: Path):
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.preset = preset
        self.log_path = log_dir / f"serve-{preset}-{instances}-{'shared' if share else 'own'}.log"
        env = {k: v for k, v in os.environ.items() if not k.startswith("MEGAMOE_")}
        cmd = [sys.executable, "-m", "megamoe.service", "--host", "127.0.0.1", "--port", str(self.port),
               "--preset", preset, "--instances", str(instances), "--selftest-level", "off", "--log-level", "info",
               "--share-weights" if share else "--no-share-weights"]
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=self._log, stderr=subprocess.STDOUT)
        self.instances = instances

    def log(self) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")

    def wait_ready(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"the server exited with {self.proc.returncode}:\n{self.log()[-4000:]}")
            try:
                if _get(self.url + "/v2/health/ready")[0] == 200:
                    if self.instances == 1 or self.log().count("): ready after") >= self.instances:
                        time.sleep(1.0)
                        return
            except OSError:
                pass
            time.sleep(0.5)
        raise AssertionError(f"the server was not ready within {START_TIMEOUT_S} s:\n{self.log()[-4000:]}")

    def pids(self) -> list[int]:
        """The server's processes: itself, and (several instances) the instances and the weights process."""
        found = [int(p) for p in re.findall(r"\(pid (\d+)\): (?:loading|mapping)", self.log())]
        return [self.proc.pid, *found]

    def shared_bytes(self) -> int | None:
        found = re.findall(r"device_bytes=(\d+)", self.log())
        return int(found[-1]) if found else None

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(120)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(30)
        self._log.close()
        return self.proc.returncode


def measure(preset: str, instances: int, share: bool, log_dir: Path, request: dict | None = None) -> dict:
    """Device memory of a server with ``instances`` instances, once every one is ready (and, given a
    ``request``, the answers of every instance to it)."""
    torch.cuda.synchronize()
    base = device_used_bytes()
    server = Server(preset, instances, share, log_dir)
    try:
        server.wait_ready()
        used = device_used_bytes() - base
        apps = nvidia_smi_apps()
        answers = {}
        if request is not None:
            for _ in range(4 * instances):  # new connections go to the instance with the fewest open: all answer
                status, reply, instance = _post(f"{server.url}/v2/models/{preset}/infer", request)
                assert status == 200, reply
                answers.setdefault(instance, reply["outputs"][0]["data"])
                if len(answers) == instances:
                    break
        figure = {"instances": instances, "shared": share and instances > 1, "used_bytes": used,
                  "weights_bytes": server.shared_bytes(), "answers": answers,
                  "processes_mib": {pid: apps.get(pid) for pid in server.pids() if pid in apps}}
    finally:
        code = server.stop()
    assert code == 0, server.log()[-4000:]
    time.sleep(2.0)  # the driver has taken the contexts back
    return figure


def describe(f: dict) -> str:
    mode = "shared copy" if f["shared"] else ("own copies" if f["instances"] > 1 else "one process")
    per = ", ".join(f"pid {pid}: {mib} MiB" for pid, mib in f["processes_mib"].items()) or "nvidia-smi not available"
    return f"instances={f['instances']} ({mode}): {f['used_bytes'] / GiB:.2f} GiB in use on the device ({per})"


def _request(preset: str, tokens: int = 8) -> dict:
    from megamoe.presets import get_preset

    cfg = get_preset(preset)
    g = torch.Generator().manual_seed(1234)
    hidden = torch.randn(tokens, cfg.hidden_size, generator=g)
    ids = torch.stack([torch.randperm(cfg.num_experts, generator=g)[: cfg.top_k] for _ in range(tokens)])
    weights = torch.rand(tokens, cfg.top_k, generator=g)
    return {"inputs": [
        {"name": "hidden_states", "datatype": "FP32", "shape": list(hidden.shape), "data": hidden.flatten().tolist()},
        {"name": "topk_ids", "datatype": "INT32", "shape": list(ids.shape), "data": ids.flatten().tolist()},
        {"name": "topk_weights", "datatype": "FP32", "shape": list(weights.shape), "data": weights.flatten().tolist()},
    ]}


def test_two_instances_hold_one_copy_of_the_device_weights(tmp_path):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    if not _service_importable():
        pytest.skip("the service is not installed (pip install -e '.[service]')")
    request = _request(PRESET)
    one = measure(PRESET, 1, True, tmp_path)
    own = measure(PRESET, 2, False, tmp_path, request)
    shared = measure(PRESET, 2, True, tmp_path, request)
    weights = shared["weights_bytes"]
    print(f"\n{PRESET}: {weights / GiB:.2f} GiB of device weights held once by the weights process")
    for f in (one, own, shared):
        print("  " + describe(f))
    print(f"  two instances, before (own copies) -> after (shared): {own['used_bytes'] / GiB:.2f} -> "
          f"{shared['used_bytes'] / GiB:.2f} GiB")
    assert weights and weights > 4 * GiB, shared  # v3's experts are ~6 GB
    assert shared["used_bytes"] <= own["used_bytes"] - 0.75 * weights, (own, shared)
    assert shared["used_bytes"] - one["used_bytes"] < 0.5 * weights, (one, shared)
    # an instance with its own copy holds about its weights plus its context, not its loading peak: the loading
    # temporaries go back to the device (one H100, v3: 17.42 GiB for two, 40.75 before the cache was emptied)
    assert own["used_bytes"] < 2 * 1.6 * weights, (own, weights)
    # the two instances read the same memory: the same bits, and those of an instance with its own copy
    assert len(shared["answers"]) == 2 and len(own["answers"]) == 2, (shared["answers"].keys(), own["answers"].keys())
    first = next(iter(own["answers"].values()))
    for answers in (shared["answers"], own["answers"]):
        for instance, data in answers.items():
            assert data == first, instance


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Device memory of megamoe serve --instances N, with the weights "
                                                 "shared (one copy) and not (a copy per instance).")
    parser.add_argument("--preset", default=PRESET)
    parser.add_argument("--instances", type=int, nargs="+", default=[1, 2, 4])
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA device", file=sys.stderr)
        return 1
    torch.cuda.init()
    print(f"{torch.cuda.get_device_name()}, preset {args.preset}; device memory in use once every instance is ready")
    print(f"{'instances':>9}  {'own copies GiB':>14}  {'shared GiB':>10}  weights held once")
    def used(n: int, share: bool, tmp: Path):
        """The measurement, or None where the server cannot start because the device runs out of memory."""
        try:
            return measure(args.preset, n, share, tmp)
        except AssertionError as exc:
            if "out of memory" not in str(exc):
                raise
            return None

    def gib(m) -> str:
        return "does not fit" if m is None else f"{m['used_bytes'] / GiB:.2f}"

    with tempfile.TemporaryDirectory() as tmp:
        for n in args.instances:
            own = used(n, False, Path(tmp))
            shared = own if n == 1 else used(n, True, Path(tmp))
            weights = "-" if n == 1 or shared is None else f"{shared['weights_bytes'] / GiB:.2f} GiB"
            print(f"{n:>9}  {gib(own):>14}  {gib(shared):>10}  {weights}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""``--instances N`` share one copy of the layer (service/shared_weights.py), here on the CPU, where the
copy is torch's shared host memory: the instances answer bit for bit what the library's layer answers,
every instance maps the very shared-memory files the weights process made (the same inodes), an
instance's private memory holds no copy of the weights (against a ``--no-share-weights`` server whose
instances each hold one), a full kernel-health run leaves the answers unchanged, an instance killed
and restarted maps the same files again, a checkpoint is loaded once and served by both, and the server
stops (exit 1) when the weights process dies, cannot load the model or cannot share what its backend
prepared. The GPU counterpart: tests/gpu/test_gpu_instances_shared.py."""

from __future__ import annotations

import os
import re
import signal
import sys
import threading
import time
import types
from pathlib import Path

import httpx
import pytest
import torch

from service_testkit import TOKEN, ServerProcess, infer_body, json_output, metric_samples

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc (Linux)")

#: 219 MiB of weights on the torch backend (its decoded experts included): large beside a process's own memory
PRESET = "small"
INSTANCES = 2
AUTH = {"Authorization": f"Bearer {TOKEN}"}
INFER = f"/v2/models/{PRESET}/infer"


def instance_pids(server: ServerProcess) -> dict[str, int]:
    return {s.labels["instance"]: int(s.labels["pid"]) for s in metric_samples(server, "megamoe_instance_ready")}


def log_of(server: ServerProcess) -> str:
    return server.log_path.read_text(errors="replace")


def exit_1_log(server: ServerProcess) -> str:
    """The log of a server that stops on its own with status 1 (within 120 s)."""
    server.proc.wait(120)
    assert server.proc.returncode == 1, log_of(server)[-3000:]
    return log_of(server)


def weights_pid(server: ServerProcess) -> int:
    found = re.findall(r"weights process \(pid (\d+)\): loading the model once", log_of(server))
    assert len(found) == 1, log_of(server)[-3000:]
    return int(found[0])


def wait_all_ready(server: ServerProcess, timeout_s: float = 150, not_pids: set[int] = frozenset()) -> dict[str, int]:
    """Every instance ready (and none of ``not_pids`` among them: a killed one was replaced)."""
    deadline = time.monotonic() + timeout_s
    ready = []
    while time.monotonic() < deadline:
        try:
            ready = metric_samples(server, "megamoe_instance_ready")
        except OSError:
            ready = []
        pids = {s.labels["instance"]: int(s.labels["pid"]) for s in ready}
        if (len(ready) == INSTANCES and all(s.value == 1.0 for s in ready) and not set(pids.values()) & set(not_pids)
                and server.get("/v2/health/ready")[0] == 200):
            time.sleep(0.5)  # the probes' connections are closed and counted by the parent
            return pids
        time.sleep(0.3)
    raise AssertionError(f"not every instance became ready: {ready}\n{server.log()}")


def start(tmp_path: Path, name: str, *args: str, preset: str = PRESET, wait: bool = True) -> ServerProcess:
    srv = ServerProcess(tmp_path / f"{name}.log", env={"MEGAMOE_TOKEN": TOKEN},
                        args=["--backend", "torch", "--preset", preset, "--instances", str(INSTANCES),
                              "--log-level", "info", "--selftest-level", "off", "--queue-delay-ms", "1", *args])
    if wait:
        srv.wait_for("/v2/health/live", timeout_s=150)
        wait_all_ready(srv)
    return srv


def shm_files(pid: int, perms: str | None = None) -> dict[int, int]:
    """{inode: bytes mapped} of the torch shared-memory files that process ``pid`` maps (``perms``: only
    mappings with these permissions, e.g. ``r--s``)."""
    files: dict[int, int] = {}
    for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
        parts = line.split(maxsplit=5)
        if len(parts) == 6 and "/torch_" in parts[5] and parts[5].startswith("/dev/shm/"):
            if perms is not None and parts[1] != perms:
                continue
            start, end = (int(x, 16) for x in parts[0].split("-"))
            inode = int(parts[4])
            files[inode] = files.get(inode, 0) + end - start
    return files


def private_bytes(pid: int) -> int:
    """What process ``pid`` alone holds in memory (its unique set size: private clean + dirty pages)."""
    fields = {}
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()[1:]:
        key, value = line.split(":", 1)
        fields[key] = int(value.split()[0]) * 1024
    return fields["Private_Clean"] + fields["Private_Dirty"]


def layer_bytes(layer) -> int:
    """Bytes of the layer's tensors (weights, the backend's prepared form, the float32 copies of the dense
    weights), each storage once."""
    from megamoe.service.shared_weights import iter_tensors, storage_bytes

    return sum(storage_bytes(iter_tensors((layer.weights, layer._prepared, layer.dense_float32()))).values())


def answer_on_every_instance(server: ServerProcess, layer, seed: int, infer: str = INFER) -> set[str]:
    """Requests on one keep-alive connection per instance (opened at once: the parent spreads them), each
    answer compared bit for bit with ``layer``'s; returns the instances that answered."""
    clients = [httpx.Client(base_url=server.url, headers=AUTH, timeout=60) for _ in range(INSTANCES)]
    answered: dict[int, str] = {}
    errors: list = []

    def run(k: int) -> None:
        try:
            for j in range(2):
                body, expected = infer_body(layer, tokens=3 + k, seed=seed + 10 * k + j)
                reply = clients[k].post(infer, json=body)
                torch.testing.assert_close(json_output(reply, expected), expected, rtol=0, atol=0)
                answered[k] = reply.headers["megamoe-instance"]
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    for c in clients:
        assert c.get("/v2/health/live").status_code == 200  # every connection open before the requests
    threads = [threading.Thread(target=run, args=(k,)) for k in range(INSTANCES)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    for c in clients:
        c.close()
    assert not errors, errors
    return set(answered.values())


@pytest.fixture(scope="module")
def small_layer():
    from megamoe.moe import MoELayer

    return MoELayer.from_preset(PRESET, seed=0, backend="torch")


@pytest.fixture(scope="module")
def shared(tmp_path_factory):
    srv = start(tmp_path_factory.mktemp("shared"), "shared")
    try:
        yield srv
    finally:
        srv.stop()


def test_every_instance_answers_bit_identically_from_the_weights_process_files(shared, small_layer):
    assert answer_on_every_instance(shared, small_layer, seed=11) == {str(i) for i in range(INSTANCES)}
    holder = weights_pid(shared)
    pids = instance_pids(shared)
    assert holder not in pids.values() and holder != shared.proc.pid
    want = layer_bytes(small_layer)
    held = shm_files(holder)
    assert sum(held.values()) >= want, (sum(held.values()), want)
    for index, pid in pids.items():
        # the instance maps the weights process's files, all of them, and no shared-memory file of its own,
        # every page read-only
        assert shm_files(pid) == held, (index, shm_files(pid), held)
        assert shm_files(pid, "r--s") == held, (index, shm_files(pid, "r--s"), held)
    log = log_of(shared)
    assert f"the model is loaded once for the {INSTANCES} instances" in log, log[-3000:]
    assert f"host_bytes={want}" in log, (want, log[-3000:])


def test_an_instance_holds_no_private_copy_of_the_weights(shared, small_layer, tmp_path):
    """Before/after: each instance's private memory with its own copy (--no-share-weights) and with the
    shared one; the difference is the weights, per instance."""
    want = layer_bytes(small_layer)
    answer_on_every_instance(shared, small_layer, seed=21)  # every instance has run a forward
    shared_private = {i: private_bytes(p) for i, p in instance_pids(shared).items()}
    own = start(tmp_path, "private", "--no-share-weights")
    try:
        assert "weights process" not in log_of(own)
        answer_on_every_instance(own, small_layer, seed=21)
        own_private = {i: private_bytes(p) for i, p in instance_pids(own).items()}
        assert all(shm_files(p) == {} for p in instance_pids(own).values())
    finally:
        assert own.stop() == 0, log_of(own)[-3000:]
    print(f"\nweights: {want / 2**20:.1f} MiB; private memory per instance, MiB (instance: own copy -> shared):")
    for i in sorted(shared_private):
        print(f"  {i}: {own_private[i] / 2**20:.1f} -> {shared_private[i] / 2**20:.1f}")
    for i in shared_private:
        assert own_private[i] - shared_private[i] >= 0.8 * want, (i, own_private, shared_private, want)
        assert shared_private[i] < own_private[i] - 0.8 * want


def test_a_full_kernel_health_run_leaves_the_shared_weights_as_they_were(shared, small_layer):
    with httpx.Client(base_url=shared.url, headers=AUTH, timeout=600) as client:
        reply = client.get("/v1/health/kernels", params={"level": "full"})
    assert reply.status_code == 200 and reply.json()["status"] == "pass", reply.text[:2000]
    assert answer_on_every_instance(shared, small_layer, seed=31) == {str(i) for i in range(INSTANCES)}


def test_a_killed_instance_is_restarted_and_maps_the_same_copy(shared, small_layer):
    holder = weights_pid(shared)
    files = shm_files(holder)
    victim = instance_pids(shared)["1"]
    os.kill(victim, signal.SIGKILL)
    pids = wait_all_ready(shared, not_pids={victim})
    assert pids["1"] != victim and weights_pid(shared) == holder and os.path.exists(f"/proc/{holder}")
    assert shm_files(pids["1"]) == files, (shm_files(pids["1"]), files)
    assert answer_on_every_instance(shared, small_layer, seed=41) == {str(i) for i in range(INSTANCES)}
    log = log_of(shared)
    assert f"instance 1 (pid {victim}) exited with status -9" in log, log[-3000:]
    assert "mapping the weights process's layer" in log


def test_sigterm_ends_the_weights_process_after_the_instances(tmp_path):
    srv = start(tmp_path, "stop", preset="tiny")
    holder, pids = weights_pid(srv), instance_pids(srv)
    assert srv.stop() == 0, log_of(srv)[-3000:]
    for pid in [holder, *pids.values()]:
        assert not os.path.exists(f"/proc/{pid}") or "zombie" in Path(f"/proc/{pid}/status").read_text().lower(), pid
    assert log_of(srv).count("drained and exited") == INSTANCES


def test_the_weights_process_dying_stops_the_server_with_status_1(tmp_path):
    srv = start(tmp_path, "holder-killed", preset="tiny")
    try:
        holder = weights_pid(srv)
        os.kill(holder, signal.SIGKILL)
        srv.proc.wait(60)
        assert srv.proc.returncode == 1, log_of(srv)[-3000:]
        log = log_of(srv)
        assert f"weights process (pid {holder}) exited with status -9: the instances' shared weights are gone" in log, \
            log[-3000:]
        assert "drained and exited" in log  # on the CPU the shared pages outlive it: the instances drain
    finally:
        srv.stop()


def test_a_model_that_cannot_be_loaded_stops_the_server_with_status_1(tmp_path):
    srv = start(tmp_path, "bad", "--checkpoint", str(tmp_path / "no-such-checkpoint"), wait=False)
    try:
        log = exit_1_log(srv)
        assert "[weights] megamoe.service.weights: the model cannot be loaded" in log, log[-3000:]
        assert "no-such-checkpoint" in log
    finally:
        srv.stop()


def test_a_prepared_layer_that_cannot_be_shared_stops_the_server_and_names_the_way_out(tmp_path):
    srv = start(tmp_path, "unpicklable", "--backend", "megamoe_test_backends:UnpicklablePreparedBackend",
                preset="tiny", wait=False)
    try:
        log = exit_1_log(srv)
        assert "the prepared layer cannot be shared with the instances" in log, log[-3000:]
        assert "serve with --no-share-weights" in log
    finally:
        srv.stop()


def test_a_checkpoint_is_loaded_once_and_served_by_every_instance(tmp_path):
    from megamoe.cli import main as cli_main
    from megamoe.moe import MoELayer

    path = tmp_path / "layer.safetensors"
    assert cli_main(["synth", "--preset", "tiny", "--seed", "7", "--out", str(path), "--quiet"]) == 0
    local = MoELayer.from_checkpoint(path, backend="torch")
    srv = start(tmp_path, "checkpoint", "--checkpoint", str(path), preset="tiny")
    try:
        # the model is named after the checkpoint file
        answered = answer_on_every_instance(srv, local, seed=71, infer="/v2/models/layer/infer")
        assert answered == {str(i) for i in range(INSTANCES)}
        assert log_of(srv).count("layer mapped from the weights process") == INSTANCES
    finally:
        assert srv.stop() == 0, log_of(srv)[-3000:]


def test_ctrl_c_to_the_whole_process_group_drains_every_process_quietly(tmp_path, small_layer):
    """A Ctrl-C in a terminal reaches every process of its group at once (parent, instances, the weights
    process, the instances' JSON decoders): the instances drain, the weights process waits for them, no
    process prints a traceback, and the server exits 0."""
    import subprocess

    from megamoe.moe import MoELayer
    from service_testkit import HERE, REPO, free_port

    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("MEGAMOE_")}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), str(HERE), env.get("PYTHONPATH", "")])
    log_path = tmp_path / "ctrl-c.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "megamoe.service", "--host", "127.0.0.1", "--port", str(port),
                                 "--preset", "tiny", "--backend", "torch", "--instances", str(INSTANCES),
                                 "--selftest-level", "off", "--log-level", "info",
                                 "--torch-threads", str(torch.get_num_threads())],
                                cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            srv = types.SimpleNamespace(proc=proc, url=f"http://127.0.0.1:{port}", log_path=log_path)
            deadline = time.monotonic() + 150
            while time.monotonic() < deadline and "all 2 instances ready" not in log_path.read_text(errors="replace"):
                assert proc.poll() is None, log_path.read_text(errors="replace")[-3000:]
                time.sleep(0.3)
            tiny = MoELayer.from_preset("tiny", seed=0, backend="torch")
            # JSON requests on both instances: each has started its decoder process
            assert answer_on_every_instance(srv, tiny, seed=81, infer="/v2/models/tiny/infer") == {"0", "1"}
            os.killpg(proc.pid, signal.SIGINT)
            assert proc.wait(90) == 0, log_path.read_text(errors="replace")[-3000:]
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(30)
    text = log_path.read_text(errors="replace")
    assert "Traceback" not in text and "KeyboardInterrupt" not in text, text[-3000:]
    assert text.count("drained and exited") == INSTANCES, text[-3000:]

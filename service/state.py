"""What the routes read: the served model once loaded, why the server is not ready when it is not,
and the device thread's work beside inference (start-up, self-tests, kernel-health runs, probes).

Readiness is 503 while loading, when the latest self-test failed, after the device reported a
sticky error, and once shutdown began. An instance of several (service/instances.py) tells the
parent its readiness, each connection that closed, and a heartbeat (service/channel.py).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import secrets
import socket
import time
from concurrent.futures import ThreadPoolExecutor

import torch

from megamoe.backends.base import Backend

from .batching import DynamicBatcher
from .channel import EXIT_LEFT, MSG_CLOSED, MSG_HEARTBEAT, MSG_LEAVING, MSG_NOT_READY, MSG_READY, MSG_TAKEN
from .metrics import ServiceMetrics
from .model import ServedModel, load_layer
from .protocol import ProtocolError, aligned_body
from .runner import BatchRunner
from .settings import ServiceSettings

log = logging.getLogger("megamoe.service")

#: a kernel-health run waits for queued inference before each device call, at most this long
HEALTH_YIELD_MAX_S = 1.0


class ServiceState:
    """What the routes read: the model once loaded, and why the server is not ready when it is not."""

    def __init__(self, settings: ServiceSettings, layer=None, instance: int | None = None, load=None):
        self.settings = settings
        #: how the layer is loaded (``load(settings)``, on the device thread) when none is given: the
        #: settings' checkpoint or preset (model.load_layer), or the weights process's shared copy
        #: (service/shared_weights.py)
        self.load = load if load is not None else load_layer
        #: this process's index among ``settings.instances`` serving processes (None: the only one)
        self.instance = instance
        self.metrics = ServiceMetrics(multiprocess=instance is not None, instance=instance or 0)
        #: an instance of several: the Unix socket to the parent (readiness, closed connections)
        self._parent: socket.socket | None = None
        self._reported_ready: bool | None = None
        #: an instance of several: why not every instance is ready (from the parent), None when all are
        self.peers_short: str | None = None if instance is None else "the other instances are starting"
        #: an instance of several that left (see leave)
        self.left = False
        #: an instance of several names itself in every response (which one answered)
        self.instance_header = (b"megamoe-instance", str(instance).encode()) if instance is not None else None
        self.model_name = settings.served_model_name()
        token = settings.token_value()
        self.token_bytes = token.encode("ascii") if token is not None else None
        # one device thread: forwards and self-test calls never overlap on the device
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="megamoe-device")
        self.preloaded_layer = layer
        self.model: ServedModel | None = None
        #: the batched forward on the device (pinned pool, graphs, device copies), once the model is loaded
        self.runner: BatchRunner | None = None
        self.batcher: DynamicBatcher | None = None
        self.loading = True
        self.load_error: str | None = None
        self.selftest_error: str | None = None
        self.device_error: str | None = None
        self._last_forward_failure: BaseException | None = None
        #: infer requests between their decode and their reply (read by the health runs' yield)
        self.infer_active = 0
        #: level -> the health run in progress (requests of that level share it)
        self.health_runs: dict[str, asyncio.Task] = {}
        #: set by SIGTERM (see begin_shutdown); announce_close once the listening socket is closed
        self.draining = False
        self.announce_close = False
        self.shutdown_deadline: float | None = None
        #: the process's exit status, and how to ask the server to stop (set by build_server)
        self.exit_code = 0
        self.request_exit = lambda: None
        #: runs a callable on the event loop from any thread (set once the loop runs)
        self.call_in_loop = lambda fn, *args: fn(*args)

    def not_ready_reason(self, *, serving: bool = False) -> str | None:
        """Why readiness is 503 (None: ready). ``serving``: why an infer request cannot run now
        (requests still arriving during shutdown are served). An instance of several is ready only
        while every instance is (the parent says so: service/instances.py), so that the server never
        reports ready while it runs an instance short."""
        reason = self.own_not_ready_reason(serving=serving)
        if reason is None and not serving and self.peers_short is not None:
            return self.peers_short
        return reason

    def own_not_ready_reason(self, *, serving: bool = False) -> str | None:
        """Why this process cannot serve (what an instance of several reports to the parent)."""
        if self.load_error:
            return f"model failed to load: {self.load_error}"
        if self.draining and not serving:
            return "server is shutting down"
        if self.loading:
            return "model is loading and self-testing"
        if self.device_error:
            return f"device reported an error: {self.device_error}"
        if self.selftest_error:
            return f"kernel self-test failed: {self.selftest_error}"
        return None

    def refresh_ready_gauge(self) -> None:
        self.metrics.set_ready(self.not_ready_reason() is None, own=self.own_not_ready_reason() is None)
        self.report_readiness(self.own_not_ready_reason() is None)

    # --- an instance of several (service/instances.py) ----------------------------------------

    def attach_parent(self, channel: socket.socket) -> None:
        self._parent = channel

    def _tell_parent(self, message: bytes) -> None:
        try:
            self._parent.send(message)
        except (BlockingIOError, InterruptedError):
            log.warning("the parent process is not reading: a message to it was dropped")
        except OSError:
            pass  # the parent is gone: the server notices on its channel and drains

    def report_readiness(self, ready: bool | None = None, force: bool = False) -> None:
        """Tell the parent whether this instance is ready (it hands new connections to ready ones), when
        that changed or with ``force``; ``ready``: already known to the caller (else worked out here)."""
        if self._parent is None:
            return
        if ready is None:
            ready = self.own_not_ready_reason() is None
        if force or ready != self._reported_ready:
            self._reported_ready = ready
            self._tell_parent(bytes([MSG_READY if ready else MSG_NOT_READY]))

    def connection_closed(self) -> None:
        if self._parent is not None:
            self._tell_parent(bytes([MSG_CLOSED]))

    def connections_taken(self, count: int) -> None:
        """Connections received from the parent: it keeps its copy of each until told."""
        if self._parent is not None:
            self._tell_parent(bytes([MSG_TAKEN]) * count)

    def heartbeat(self) -> None:
        """Called by the event loop every HEARTBEAT_S: the parent takes silence for a hung instance."""
        if self._parent is not None:
            self._tell_parent(bytes([MSG_HEARTBEAT]))

    def set_peers(self, short: str | None) -> None:
        """What the parent says of the instances: None when every one is ready, else why not."""
        if short != self.peers_short:
            self.peers_short = short
            self.refresh_ready_gauge()

    def leave(self, why: str) -> None:
        """An instance of several that cannot serve any more (its device failed for good): it is
        unready at once, every response from now on says ``Connection: close`` (keep-alive clients
        reconnect, to an instance that can serve), the parent hands it no more connections and
        restarts it once this process has drained and exited (status EXIT_LEFT)."""
        if self._parent is None or self.left:
            return
        self.left = True
        log.error("this instance leaves (%s): it drains and exits, to be restarted", why)
        self.announce_close = True
        self.exit_code = EXIT_LEFT
        self.refresh_ready_gauge()
        self._tell_parent(bytes([MSG_LEAVING]))
        self.request_exit()

    def begin_shutdown(self) -> None:
        """SIGTERM: readiness turns 503, and a body still arriving when the grace period ends is
        answered 503; once the server closed its listening socket, every response says
        ``Connection: close``. (Called from the signal handler: only plain assignments here.)"""
        if not self.draining:
            self.draining = True
            self.shutdown_deadline = time.monotonic() + self.settings.graceful_shutdown_s

    def authorized(self, authorization: bytes | None) -> bool:
        """Whether an ``Authorization`` header's raw bytes carry the bearer token (always, without one)."""
        if self.token_bytes is None:
            return True
        scheme, _, given = (authorization or b"").partition(b" ")
        return scheme.lower() == b"bearer" and secrets.compare_digest(given.strip(), self.token_bytes)

    def admits_body(self, path: str, authorization: bytes | None) -> bool:
        """Whether a request's body may be given a buffer before the app reads it: it is bound for
        this model's infer route, with the token. Any other request is answered (404, 401) before
        anything is reserved for its body, which is discarded as it arrives."""
        if self.model is None:
            return False
        prefix = f"/v2/models/{self.model_name}/"
        if path not in (prefix + "infer", f"{prefix}versions/{ServedModel.version}/infer"):
            return False
        return self.authorized(authorization)

    def body_buffer(self, declared: int, header_length: int) -> memoryview:
        """Where a binary infer body of ``declared`` bytes is read to (the HTTP protocol reads it
        there directly): pinned host memory once the model is on a CUDA device (its rows are copied
        to the device from there), its binary part aligned for the tensors that view it."""
        runner = self.runner
        if runner is not None:
            return runner.body_buffer(declared, header_length)
        return aligned_body(declared, header_length)

    # --- device-thread work -------------------------------------------------

    def wait_for_idle_device(self, max_wait_s: float) -> None:
        """Called by a health run (not on the device thread) before each device call: let the
        inference that is waiting go first, but not for longer than ``max_wait_s``."""
        deadline = time.monotonic() + max_wait_s
        while time.monotonic() < deadline:
            batcher = self.batcher
            if self.infer_active == 0 and (batcher is None or batcher.queued_requests == 0):
                return
            time.sleep(0.002)

    def run_selftest(self, level: str, *, yielding: bool = False) -> dict:
        """The health checks on the served backend. ``yielding``: run in the caller's thread,
        each backend call on the device thread after the waiting inference (a run that takes
        minutes must not hold the device thread that every infer request needs)."""
        started = time.time()
        layer = self.model.layer
        if callable(getattr(layer, "run_checks", None)):
            # a layer spread over several processes (service/distributed.py) checks every rank
            report = layer.run_checks(level) if not yielding else \
                self.executor.submit(layer.run_checks, level).result()
        else:
            from megamoe import health

            backend = _DeviceThreadBackend(layer.backend, self) if yielding else layer.backend
            report = health.run_checks(level=level, backend=backend)
        report["batch_invariant"] = self.model.batch_invariant
        self.metrics.record_selftest(level, report, started)
        if report.get("status") == "pass":
            self.selftest_error = None
        else:
            failed = [c.get("name") for c in report.get("checks", []) if c.get("status") == "fail"]
            self.selftest_error = f"{level} check(s) failed: {failed}"
        self.refresh_ready_gauge()
        return report

    async def health_report(self, level: str) -> dict:
        """One run per level at a time: concurrent requests of that level share it; a request for
        the other level while one runs is refused (429)."""
        task = self.health_runs.get(level)
        if task is None:
            running = sorted(self.health_runs)
            if running:
                raise ProtocolError(f"a {running[0]} kernel-health run is in progress; retry when it is done", 429)
            task = asyncio.get_running_loop().create_task(
                asyncio.to_thread(self.run_selftest, level, yielding=True), name=f"megamoe-health-{level}")
            self.health_runs[level] = task
            task.add_done_callback(lambda _t, level=level: self.health_runs.pop(level, None))
        return await asyncio.shield(task)

    def first_report_of(self, exc: BaseException) -> bool:
        """Every request of a failed batch receives the same exception: log and probe once."""
        if exc is self._last_forward_failure:
            return False
        self._last_forward_failure = exc
        return True

    def probe_device(self) -> None:
        """After a failed forward: is the device still usable? A sticky CUDA error (illegal
        address, ECC) makes every later call fail; then readiness stays 503 for good."""
        if self.model is None:
            return
        device = self.model.device
        try:
            self.model.layer.backend.synchronize()
            (torch.ones(1, device=device) + 1).item()
        except Exception as exc:  # noqa: BLE001 - any failure here means the device is gone
            self.device_error = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            log.error("device probe failed, readiness is now 503: %s", self.device_error)
        self.refresh_ready_gauge()
        if self.device_error and self._parent is not None:
            # an instance of several is replaced rather than kept unready: its loop does the leaving
            self.call_in_loop(self.leave, f"device reported an error: {self.device_error}")

    def load_and_selftest(self) -> None:
        layer = self.preloaded_layer if self.preloaded_layer is not None else self.load(self.settings)
        self.model = ServedModel(self.model_name, layer, self.settings.max_tokens_per_request,
                                 self.settings.hidden_datatype)
        self.runner = BatchRunner(self.model)
        if self.settings.torch_threads:
            # set here, on the device thread that runs every forward (the setting is per thread)
            torch.set_num_threads(self.settings.torch_threads)
            self.model.torch_threads = torch.get_num_threads()
        log.info("model %r loaded: backend %s on %s", self.model_name, self.model.backend_name, self.model.device)
        if self.settings.selftest_level != "off":
            try:
                report = self.run_selftest(self.settings.selftest_level)
            except Exception as exc:  # noqa: BLE001 - a self-test that cannot run is a failed one
                self.selftest_error = f"{self.settings.selftest_level} self-test raised {type(exc).__name__}: {exc}"
                log.exception("start-up self-test raised")
                return
            log.info("start-up self-test (%s): %s", self.settings.selftest_level, report.get("status"))


    # --- the lifespan (app.py) -------------------------------------------------------------

    async def start(self) -> None:
        """Start-up, in the background: load and self-test on the device thread, then the batcher.
        A model that cannot be loaded ends the process with exit status 1."""
        loop = asyncio.get_running_loop()
        try:
            await loop.run_in_executor(self.executor, self.load_and_selftest)
        except Exception as exc:  # noqa: BLE001 - a model that cannot be loaded ends the process
            self.load_error = f"{type(exc).__name__}: {exc}"
            log.error("start-up failed, the server stops: model %r cannot be loaded: %s", self.model_name,
                      self.load_error)
            log.debug("traceback of the start-up failure", exc_info=exc)
            self.exit_code = 1
            self.request_exit()
        else:
            model, runner, metrics = self.model, self.runner, self.metrics
            self.batcher = DynamicBatcher(
                runner.launch_batch,
                self.executor,
                finish=runner.finish_batch,  # the next batch is staged while the device runs this one
                max_batch_tokens=self.settings.max_batch_tokens,
                queue_delay_s=self.settings.queue_delay_ms / 1000.0,
                on_batch=lambda n, t, s: metrics.record_batch(model.name, n, t, s),
                on_stages=lambda stages: metrics.record_stages(model.name, stages),
            )
            self.batcher.on_queue = metrics.queued.set  # called whenever the queue changes
            self.batcher.start()
        finally:
            self.loading = False
            self.refresh_ready_gauge()
            if self.own_not_ready_reason() is None:
                log.info("ready: serving model %r", self.model_name)

    async def periodic_selftest(self) -> None:
        """Every ``selftest_interval_s``: probe the device and run the quick checks (readiness follows)."""
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(self.settings.selftest_interval_s)
            if self.model is None:
                continue
            try:
                await loop.run_in_executor(self.executor, self.probe_device)
                await self.health_report("quick")
            except ProtocolError:
                continue  # a full run is in progress: it checks the device too
            except Exception as exc:  # noqa: BLE001
                self.selftest_error = f"quick self-test raised {type(exc).__name__}: {exc}"
                self.refresh_ready_gauge()

    async def stop(self) -> None:
        """After uvicorn let the requests in flight finish: run what is queued, wait for health runs,
        end the device thread."""
        if self.batcher is not None:
            await self.batcher.stop()
        for task in list(self.health_runs.values()):
            await asyncio.gather(task, return_exceptions=True)
        self.executor.shutdown(wait=True)


class _DeviceThreadBackend(Backend):
    """The served backend as a health run sees it: every call runs on the device thread, after
    the inference waiting for it (at most HEALTH_YIELD_MAX_S per call). The checks' own
    reference math runs in the health run's thread, beside inference."""

    #: the Backend methods that do not touch the device (run where they are called)
    _HERE = frozenset({"describe"})

    def __init__(self, inner: Backend, state: ServiceState):
        self.inner = inner
        self.name = inner.name
        self._state = state

    @property
    def device(self):
        return self.inner.device

    def _on_device(self, fn, *args, **kwargs):
        self._state.wait_for_idle_device(HEALTH_YIELD_MAX_S)
        return self._state.executor.submit(fn, *args, **kwargs).result()

    def __getattribute__(self, name):
        # every callable of the inner backend, the abstract methods that Backend defines on this
        # class too, runs on the device thread: one rule, no forwarder per method
        if name.startswith("_") or name in ("inner", "name", "device"):
            return object.__getattribute__(self, name)
        attr = getattr(object.__getattribute__(self, "inner"), name)
        if callable(attr) and name not in _DeviceThreadBackend._HERE:
            return functools.partial(object.__getattribute__(self, "_on_device"), attr)
        return attr


# every method is the inner backend's (see __getattribute__): none is left abstract here
_DeviceThreadBackend.__abstractmethods__ = frozenset()


__all__ = ["ServiceState", "HEALTH_YIELD_MAX_S"]

"""FastAPI app: Open Inference Protocol v2 routes, kernel health, metrics.

Start-up (in the background, so liveness answers at once): load the model, run
the self-test (docs/SPEC.md §5), then report ready. Readiness is 503 while loading,
when the latest self-test failed, after the device reported a sticky error, and once
shutdown began. A model that cannot be loaded (missing or broken checkpoint) stops the
process with exit status 1.

Client input never causes a 5xx: every request is answered by the outermost middleware,
which counts it and turns an unexpected exception into one JSON 500 and one log line.
"""

from __future__ import annotations

import asyncio
import functools
import importlib.metadata
import logging
import multiprocessing
import os
import secrets
import socket
import threading
import time
import traceback
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from contextlib import asynccontextmanager

import torch
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from megamoe.backends.base import Backend

from .batching import DynamicBatcher, ShuttingDown
from .instances import MSG_CLOSED, MSG_NOT_READY, MSG_READY
from .jsoncodec import exit_with_parent
from .metrics import ServiceMetrics
from .model import OUTPUT_NAME, ServedModel, load_layer
from .protocol import (
    HEADER_LENGTH,
    BodyBuffer,
    ProtocolError,
    aligned_body,
    binary_aligned,
    build_request,
    count_json_values_bound,
    decode_json_request,
    encode_json_response,
    parse_header_length,
    response_parts,
    response_pieces,
    strict_json,
    too_many_values,
)
from .settings import ServiceSettings

log = logging.getLogger("megamoe.service")

SERVER_NAME = "megamoe"
_REASON_OF_STATUS = {400: "bad_request", 401: "unauthorized", 403: "forbidden", 404: "not_found",
                     405: "bad_method", 408: "timeout", 413: "too_large", 429: "busy", 503: "not_ready"}
#: a JSON text this long or longer is decoded in the decoder process (json holds the interpreter
#: lock for its whole decode: ~1 s per million values here, which would stall every connection)
OFFLOAD_JSON_BYTES = 256 * 1024
#: a JSON output with this many values or more is encoded there too
OFFLOAD_JSON_VALUES = 16 * 1024
#: values an infer request's JSON may hold beyond its tensors' (shapes, sizes, parameters)
JSON_VALUES_SLACK = 1024
#: a kernel-health run waits for queued inference before each device call, at most this long
HEALTH_YIELD_MAX_S = 1.0
#: the body reader re-checks the shutdown deadline at least this often
_BODY_POLL_S = 0.25


if hasattr(asyncio, "timeout"):  # Python 3.11+
    async def _receive_within(receive, seconds: float):
        """``await receive()``, TimeoutError after ``seconds``: asyncio.timeout costs a timer per
        call where wait_for also makes a task (~11 vs ~39 us per body chunk here)."""
        async with asyncio.timeout(seconds):
            return await receive()
else:
    def _receive_within(receive, seconds: float):
        return asyncio.wait_for(receive(), seconds)


class ServiceState:
    """What the routes read: the model once loaded, and why the server is not ready when it is not."""

    def __init__(self, settings: ServiceSettings, layer=None, instance: int | None = None):
        self.settings = settings
        #: this process's index among ``settings.instances`` serving processes (None: the only one)
        self.instance = instance
        self.metrics = ServiceMetrics(multiprocess=instance is not None, instance=instance or 0)
        #: an instance of several: the Unix socket to the parent (readiness, closed connections)
        self._parent: socket.socket | None = None
        self._reported_ready: bool | None = None
        #: an instance of several names itself in every response (which one answered)
        self.instance_header = (b"megamoe-instance", str(instance).encode()) if instance is not None else None
        self.model_name = settings.served_model_name()
        token = settings.token_value()
        self.token_bytes = token.encode("ascii") if token is not None else None
        # one device thread: forwards and self-test calls never overlap on the device
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="megamoe-device")
        self.preloaded_layer = layer
        self.model: ServedModel | None = None
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
        self.decoder: ProcessPoolExecutor | None = None
        self._decoder_lock = threading.Lock()
        self._decoder_unavailable_logged = False
        #: set by SIGTERM (see begin_shutdown); announce_close once the listening socket is closed
        self.draining = False
        self.announce_close = False
        self.shutdown_deadline: float | None = None
        #: the process's exit status, and how to ask the server to stop (set by main())
        self.exit_code = 0
        self.request_exit = lambda: None

    def not_ready_reason(self, *, serving: bool = False) -> str | None:
        """Why readiness is 503 (None: ready). ``serving``: why an infer request cannot run now
        (requests still arriving during shutdown are served)."""
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
        ready = self.not_ready_reason() is None
        self.metrics.set_ready(ready)
        self.report_readiness(ready)

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
            ready = self.not_ready_reason() is None
        if force or ready != self._reported_ready:
            self._reported_ready = ready
            self._tell_parent(bytes([MSG_READY if ready else MSG_NOT_READY]))

    def connection_closed(self) -> None:
        if self._parent is not None:
            self._tell_parent(bytes([MSG_CLOSED]))

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

    @property
    def json_value_limit(self) -> int:
        """The most values one request's JSON may hold: every input at the largest T, plus slack
        (some clients, perf_analyzer among them, send all the optional inputs)."""
        cfg = self.model.config
        per_row = cfg.hidden_size + 2 * cfg.top_k + cfg.num_experts + 1  # + 1: input_ids
        return self.settings.max_tokens_per_request * per_row + JSON_VALUES_SLACK

    def body_buffer(self, declared: int, header_length: int) -> memoryview:
        """Where a binary infer body of ``declared`` bytes is read to (the HTTP protocol reads it
        there directly): pinned host memory once the model is on a CUDA device (its rows are copied
        to the device from there), its binary part aligned for the tensors that view it."""
        model = self.model
        if model is not None:
            return model.body_buffer(declared, header_length)
        return aligned_body(declared, header_length)

    # --- decoder process ----------------------------------------------------------------

    def decoder_pool(self) -> ProcessPoolExecutor:
        with self._decoder_lock:
            if self.decoder is None:
                # spawn: a fresh interpreter (no copy of this process's threads or torch state)
                self.decoder = ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn"),
                                                   initializer=exit_with_parent, initargs=(os.getpid(),))
            return self.decoder

    async def in_decoder(self, fn, *args):
        """``fn(*args)`` in the decoder process; a lost process is replaced and the call refused (503)."""
        try:
            pool = self.decoder_pool()
            future = pool.submit(fn, *args)
        except (OSError, RuntimeError) as exc:  # no processes here (a sandbox without semaphores, say)
            if not self._decoder_unavailable_logged:
                log.warning("no JSON decoder process (%s): large JSON bodies are decoded in a thread", exc)
                self._decoder_unavailable_logged = True
            return await asyncio.to_thread(fn, *args)
        try:
            return await asyncio.wrap_future(future)
        except BrokenProcessPool:
            with self._decoder_lock:
                if self.decoder is pool:
                    self.decoder = None
            pool.shutdown(wait=False)
            log.error("the JSON decoder process ended unexpectedly; a new one is started")
            raise ProtocolError("the JSON decoder process ended unexpectedly; retry", 503) from None

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

    def load_and_selftest(self) -> None:
        layer = self.preloaded_layer if self.preloaded_layer is not None else load_layer(self.settings)
        self.model = ServedModel(self.model_name, layer, self.settings.max_tokens_per_request,
                                 self.settings.hidden_datatype)
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


class _DeviceThreadBackend(Backend):
    """The served backend as a health run sees it: every call runs on the device thread, after
    the inference waiting for it (at most HEALTH_YIELD_MAX_S per call). The checks' own
    reference math runs in the health run's thread, beside inference."""

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

    def __getattr__(self, name):
        if name in ("inner", "_state"):
            raise AttributeError(name)
        attr = getattr(self.inner, name)
        return functools.partial(self._on_device, attr) if callable(attr) else attr

    def quantize(self, *args, **kwargs):
        return self._on_device(self.inner.quantize, *args, **kwargs)

    def swizzle_scales(self, *args, **kwargs):
        return self._on_device(self.inner.swizzle_scales, *args, **kwargs)

    def unswizzle_scales(self, *args, **kwargs):
        return self._on_device(self.inner.unswizzle_scales, *args, **kwargs)

    def swizzle_scales_grouped(self, *args, **kwargs):
        return self._on_device(self.inner.swizzle_scales_grouped, *args, **kwargs)

    def unswizzle_scales_grouped(self, *args, **kwargs):
        return self._on_device(self.inner.unswizzle_scales_grouped, *args, **kwargs)

    def verify_sf_roundtrip(self, *args, **kwargs):
        return self._on_device(self.inner.verify_sf_roundtrip, *args, **kwargs)

    def gemm(self, *args, **kwargs):
        return self._on_device(self.inner.gemm, *args, **kwargs)

    def prepare_weights(self, *args, **kwargs):
        return self._on_device(self.inner.prepare_weights, *args, **kwargs)

    def moe_forward(self, *args, **kwargs):
        return self._on_device(self.inner.moe_forward, *args, **kwargs)

    def synchronize(self):
        return self._on_device(self.inner.synchronize)

    def describe(self):
        return self.inner.describe()


def _package_version() -> str:
    import megamoe

    version = getattr(megamoe, "__version__", None)
    if version:
        return str(version)
    try:
        return importlib.metadata.version("megamoe")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def _error(status: int, message: str, headers: dict | None = None, close: bool = False) -> JSONResponse:
    if close:
        headers = {**(headers or {}), "Connection": "close"}
    return JSONResponse({"error": message}, status_code=status, headers=headers)


def _where(exc: BaseException) -> str:
    frames = traceback.extract_tb(exc.__traceback__)
    return f"{frames[-1].filename}:{frames[-1].lineno}" if frames else "?"


class _PiecesResponse(Response):
    """A response whose body is sent as pieces in order (a JSON header, then the binary outputs
    from the output tensor's memory): no copy of a large output into one body."""

    def __init__(self, pieces: list, headers: dict[str, str]):
        self._pieces = pieces
        super().__init__(content=b"", media_type=headers["content-type"],
                         headers={**headers, "content-length": str(sum(len(p) for p in pieces))})

    async def __call__(self, scope, receive, send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        last = len(self._pieces) - 1
        for index, piece in enumerate(self._pieces):
            await send({"type": "http.response.body", "body": piece, "more_body": index < last})


class ServiceMiddleware:
    """The outermost layer of every HTTP request: counts it by route and status, adds
    ``Connection: close`` during shutdown, and answers an exception that escaped a route
    with a JSON 500 and a single log line (the traceback only at debug level)."""

    def __init__(self, app, state: ServiceState):
        self.app = app
        self.state = state

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        state, status = self.state, None

        async def send_counted(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                self.count(scope, status)  # before the client can see the response
                if state.announce_close or state.instance_header is not None:
                    extra = [state.instance_header] if state.instance_header is not None else []
                    if state.announce_close:
                        extra.append((b"connection", b"close"))
                    message = {**message, "headers": [*message.get("headers", []), *extra]}
            await send(message)

        try:
            await self.app(scope, receive, send_counted)
        except Exception as exc:  # noqa: BLE001 - the one place that answers what escaped a route
            log.error("internal error on %s %s: %s: %s (at %s)", scope.get("method"), scope.get("path"),
                      type(exc).__name__, str(exc).splitlines()[0][:200] if str(exc) else "", _where(exc))
            log.debug("traceback of the internal error", exc_info=exc)
            if status is None:
                response = _error(500, f"internal error: {type(exc).__name__}")
                await response(scope, receive, send_counted)

    def count(self, scope, status: int) -> None:
        path = getattr(scope.get("route"), "path", "unmatched")
        self.state.metrics.requests.labels(path, str(status)).inc()
        if status >= 400:
            self.state.metrics.failures.labels(path, _REASON_OF_STATUS.get(status, "internal")).inc()


def create_app(settings: ServiceSettings, *, layer=None, instance: int | None = None) -> FastAPI:
    """The service app; ``layer`` (a MoELayer) skips loading from the settings; ``instance``: this
    process's index among several serving processes (service/instances.py)."""
    state = ServiceState(settings, layer, instance)
    metrics = state.metrics
    token = settings.token_value()

    async def startup() -> None:
        loop = asyncio.get_running_loop()
        try:
            await loop.run_in_executor(state.executor, state.load_and_selftest)
        except Exception as exc:  # noqa: BLE001 - a model that cannot be loaded ends the process
            state.load_error = f"{type(exc).__name__}: {exc}"
            log.error("start-up failed, the server stops: model %r cannot be loaded: %s", state.model_name,
                      state.load_error)
            log.debug("traceback of the start-up failure", exc_info=exc)
            state.exit_code = 1
            state.request_exit()
        else:
            model = state.model
            state.batcher = DynamicBatcher(
                model.launch_batch,
                state.executor,
                finish=model.finish_batch,  # the next batch is staged while the device runs this one
                max_batch_tokens=settings.max_batch_tokens,
                queue_delay_s=settings.queue_delay_ms / 1000.0,
                on_batch=lambda n, t, s: metrics.record_batch(model.name, n, t, s),
                on_stages=lambda stages: metrics.record_stages(model.name, stages),
            )
            state.batcher.on_queue = metrics.queued.set  # called whenever the queue changes
            state.batcher.start()
        finally:
            state.loading = False
            state.refresh_ready_gauge()
            if state.not_ready_reason() is None:
                log.info("ready: serving model %r", state.model_name)

    async def periodic_selftest() -> None:
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(settings.selftest_interval_s)
            if state.model is None:
                continue
            try:
                await loop.run_in_executor(state.executor, state.probe_device)
                await state.health_report("quick")
            except ProtocolError:
                continue  # a full run is in progress: it checks the device too
            except Exception as exc:  # noqa: BLE001
                state.selftest_error = f"quick self-test raised {type(exc).__name__}: {exc}"
                state.refresh_ready_gauge()

    def start_decoder() -> None:
        # started at once, so the first large JSON body does not pay for the process start-up
        try:
            state.decoder_pool().submit(decode_json_request, b"{}").add_done_callback(lambda f: f.exception())
        except Exception as exc:  # noqa: BLE001 - large JSON bodies will retry; small ones never need it
            log.warning("the JSON decoder process did not start: %s", exc)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        state.refresh_ready_gauge()
        if token is None:
            log.warning("authentication is off (no MEGAMOE_TOKEN): infer and quick kernel health are open to "
                        "anyone who reaches %s:%s; full kernel health is refused", settings.host, settings.port)
        else:
            log.info("authentication is on: infer and kernel health need the bearer token")
        background = [asyncio.create_task(startup(), name="megamoe-startup")]
        if settings.selftest_interval_s > 0:
            background.append(asyncio.create_task(periodic_selftest(), name="megamoe-selftest"))
        start_decoder()
        try:
            yield
        finally:
            # uvicorn has already let in-flight requests finish; drain the queue, then stop.
            for task in background[1:]:
                task.cancel()
            await asyncio.gather(background[0], return_exceptions=True)
            if state.batcher is not None:
                await state.batcher.stop()
            for task in list(state.health_runs.values()):
                await asyncio.gather(task, return_exceptions=True)
            state.executor.shutdown(wait=True)
            if state.decoder is not None:
                state.decoder.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="megamoe", description="NVFP4 MoE layer over the Open Inference Protocol (KServe v2)",
                  lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.megamoe = state
    app.add_middleware(ServiceMiddleware, state=state)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        return _error(exc.status_code, str(exc.detail), getattr(exc, "headers", None))

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError):
        return _error(400, f"invalid request: {exc.errors()}")

    def authorized(request: Request) -> bool:
        # the header's raw bytes (Starlette decodes headers as latin-1): no re-encoding guesses
        return state.authorized(request.headers.get("authorization", "").encode("latin-1"))

    def unauthorized() -> JSONResponse:
        return _error(401, "missing or invalid bearer token", {"WWW-Authenticate": "Bearer"})

    def unknown_model(name: str, version: str | None) -> JSONResponse | None:
        """None when ``name`` (and ``version``, if given) is what this server serves."""
        if name != state.model_name:
            return _error(404, f"unknown model {name!r}; this server serves {state.model_name!r}")
        if version is not None and version != ServedModel.version:
            return _error(404, f"model {name!r} has no version {version!r}; this server serves version "
                               f"{ServedModel.version!r}")
        return None

    # --- health and metadata --------------------------------------------------

    @app.get("/v2/health/live")
    async def live():
        return {"live": True}

    @app.get("/v2/health/ready")
    async def ready():
        reason = state.not_ready_reason()
        if reason:
            return JSONResponse({"ready": False, "error": reason}, status_code=503)
        return {"ready": True}

    @app.get("/v2")
    async def server_metadata():
        return {"name": SERVER_NAME, "version": _package_version(), "extensions": ["binary_tensor_data", "model_configuration"]}

    @app.get("/v2/models/{model_name}")
    @app.get("/v2/models/{model_name}/versions/{model_version}")
    async def model_metadata(model_name: str, model_version: str | None = None):
        refused = unknown_model(model_name, model_version)
        if refused is not None:
            return refused
        if state.model is None:
            return _error(503, state.not_ready_reason() or "model not loaded")
        return state.model.metadata()

    @app.get("/v2/models/{model_name}/config")
    @app.get("/v2/models/{model_name}/versions/{model_version}/config")
    async def model_config(model_name: str, model_version: str | None = None):
        # Triton's model-configuration extension (perf_analyzer reads it after the metadata)
        refused = unknown_model(model_name, model_version)
        if refused is not None:
            return refused
        if state.model is None:
            return _error(503, state.not_ready_reason() or "model not loaded")
        return state.model.triton_config(settings.queue_delay_ms, settings.max_batch_tokens, settings.instances)

    @app.get("/v2/models/{model_name}/ready")
    @app.get("/v2/models/{model_name}/versions/{model_version}/ready")
    async def model_ready(model_name: str, model_version: str | None = None):
        refused = unknown_model(model_name, model_version)
        if refused is not None:
            return refused
        reason = state.not_ready_reason()
        if reason:
            return JSONResponse({"name": model_name, "ready": False, "error": reason}, status_code=503)
        return {"name": model_name, "ready": True}

    # --- inference --------------------------------------------------------------

    async def read_body(request: Request, count_values: bool, header_length: int | None = None):
        """The body, refused as soon as it is too large (413), holds too many JSON values (400),
        is not complete within ``timeout_body_s`` (408), or is still arriving when the shutdown
        grace period ends (503). ``count_values``: the body is all JSON (a bytearray); otherwise, with
        a Content-Length, a writable memoryview whose binary part after ``header_length`` bytes is
        aligned (protocol.BodyBuffer)."""
        limit = min(settings.max_json_body_bytes, settings.max_body_bytes) if count_values else settings.max_body_bytes
        what = "JSON body" if count_values else "body"
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise ProtocolError(f"{what} of {declared} bytes exceeds the limit of {limit}", 413)
        max_values = state.json_value_limit
        known = declared is not None and declared.isascii() and declared.isdigit() and not count_values
        body, values = BodyBuffer(int(declared) if known else None, header_length), 0
        deadline = time.monotonic() + settings.timeout_body_s
        while True:
            now = time.monotonic()
            if state.shutdown_deadline is not None and now >= state.shutdown_deadline:
                raise ProtocolError("the server is shutting down and the request body was still arriving", 503,
                                    close=True)
            if now >= deadline:
                raise ProtocolError(f"the request body did not arrive within {settings.timeout_body_s:g} s", 408,
                                    close=True)
            try:
                message = await _receive_within(request.receive, min(deadline - now, _BODY_POLL_S))
            except asyncio.TimeoutError:
                continue
            if message["type"] == "http.disconnect":
                raise ProtocolError("client disconnected before sending the whole body", 400, close=True)
            chunk = message.get("body", b"")
            if body.size + len(chunk) > limit:
                raise ProtocolError(f"{what} exceeds the limit of {limit} bytes", 413)
            if (not count_values and not body.size and not message.get("more_body", False)
                    and isinstance(chunk, memoryview) and not chunk.readonly):
                return chunk  # read whole by the HTTP protocol, into the buffer from body_buffer()
            if count_values:
                values += count_json_values_bound(chunk)
                if values > max_values:
                    raise too_many_values(max_values)
            body.append(chunk)
            if not message.get("more_body", False):
                return body.body()

    async def decode(body, header_length: int | None):
        if header_length is None:
            json_part, binary = body, b""
        else:
            view = memoryview(body)
            json_part, binary = view[:header_length], view[header_length:]
            if header_length > settings.max_json_body_bytes:
                raise ProtocolError(f"JSON header of {header_length} bytes exceeds the limit of "
                                    f"{settings.max_json_body_bytes}", 413)
        plain = header_length is None
        if len(json_part) >= OFFLOAD_JSON_BYTES:
            payload = json_part if isinstance(json_part, bytearray) else bytes(json_part)  # no copy of a JSON body
            decoded = await state.in_decoder(decode_json_request, payload, state.json_value_limit, plain)
        else:
            decoded = decode_json_request(json_part, state.json_value_limit, plain)
        if len(binary) >= OFFLOAD_JSON_BYTES and not binary_aligned(binary):
            # misaligned (a chunked body): the tensors are copies, made in a thread (torch copies without the lock)
            return await asyncio.to_thread(build_request, decoded, binary)
        return build_request(decoded, binary)

    async def encode(model: ServedModel, request_id, output: torch.Tensor, as_binary: bool):
        header, packed, blobs = response_parts(model.name, model.version, request_id,
                                               [(OUTPUT_NAME, output, as_binary)])
        if packed and output.numel() >= OFFLOAD_JSON_VALUES:
            head = await state.in_decoder(encode_json_response, header, packed)
        else:
            head = encode_json_response(header, packed)
        return response_pieces(head, blobs)

    @app.post("/v2/models/{model_name}/infer")
    @app.post("/v2/models/{model_name}/versions/{model_version}/infer")
    async def infer(request: Request, model_name: str, model_version: str | None = None):
        started = time.perf_counter()
        if not authorized(request):
            return unauthorized()
        refused = unknown_model(model_name, model_version)
        if refused is not None:
            return refused
        reason = state.not_ready_reason(serving=True)
        if reason or state.batcher is None:
            return _error(503, reason or "not ready")
        encoding = request.headers.get("content-encoding", "identity").lower()
        if encoding != "identity":
            return _error(400, f"Content-Encoding {encoding!r} is not supported; send the body uncompressed")
        model = state.model
        try:
            header_value = request.headers.get(HEADER_LENGTH)
            body = await read_body(request, count_values=header_value is None,
                                   header_length=parse_header_length(header_value, settings.max_body_bytes))
            decode_started = time.perf_counter()
            parsed = await decode(body, parse_header_length(header_value, len(body)))
            del body
            unknown_outputs = sorted(set(parsed.outputs) - {OUTPUT_NAME})
            if unknown_outputs:
                raise ProtocolError(f"unknown output(s) {unknown_outputs}; this model has {[OUTPUT_NAME]}")
            model_request = model.validate(parsed.inputs, parsed.datatypes)
            metrics.record_stage(model.name, "decode", time.perf_counter() - decode_started)
        except ProtocolError as exc:
            return _error(exc.status, exc.message, close=exc.close)
        state.infer_active += 1
        try:
            result = await state.batcher.submit(model_request)
        except ShuttingDown as exc:
            return _error(503, str(exc))
        except ProtocolError as exc:  # the caller's input, found on the device (non-finite hidden_states)
            return _error(exc.status, exc.message)
        except Exception as exc:  # noqa: BLE001 - a device failure, not the caller's input
            if state.first_report_of(exc):
                log.error("forward failed: %s: %s", type(exc).__name__, exc)
                await asyncio.get_running_loop().run_in_executor(state.executor, state.probe_device)
            return _error(500, f"forward failed: {type(exc).__name__}: {exc}")
        finally:
            state.infer_active -= 1
        as_binary = parsed.outputs.get(OUTPUT_NAME, parsed.binary_output_default)
        try:
            encode_started = time.perf_counter()
            content, headers = await encode(model, parsed.request_id, result.output, as_binary)
            metrics.record_stage(model.name, "encode", time.perf_counter() - encode_started)
        except ProtocolError as exc:
            return _error(exc.status, exc.message)
        metrics.queue_latency.labels(model.name).observe(result.queue_s)
        metrics.request_latency.labels(model.name).observe(time.perf_counter() - started)
        return _PiecesResponse(content, headers)

    # --- kernel health and metrics -----------------------------------------------

    @app.get("/v1/health/kernels")
    async def kernel_health(request: Request, level: str = "quick"):
        if not authorized(request):
            return unauthorized()
        if level not in ("quick", "full"):
            return _error(400, f"level must be 'quick' or 'full', got {level!r}")
        if level == "full" and token is None:
            return _error(403, "level=full runs the long checks on the serving device; this server has no "
                               "token (MEGAMOE_TOKEN), so it refuses them")
        if state.model is None:
            return _error(503, state.not_ready_reason() or "model not loaded")
        try:
            report = await state.health_report(level)
        except ProtocolError as exc:
            return _error(exc.status, exc.message, {"Retry-After": "5"} if exc.status == 429 else None)
        return JSONResponse(strict_json(report))

    @app.get("/metrics")
    async def prometheus_metrics():
        state.refresh_ready_gauge()
        return Response(content=metrics.render(), media_type=metrics.content_type)

    return app


__all__ = ["create_app", "ServiceState", "ServiceMiddleware"]

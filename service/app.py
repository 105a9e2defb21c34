"""FastAPI app: Open Inference Protocol v2 routes, kernel health, metrics.

Start-up (in the background, so liveness answers at once): load the model, run
the self-test (SPEC §5), then report ready. Readiness is 503 while loading, when
the latest self-test failed, or after the device reported a sticky error.
"""

from __future__ import annotations

import asyncio
import importlib.metadata
import logging
import secrets
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager

import torch
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from .batching import DynamicBatcher, ShuttingDown
from .metrics import ServiceMetrics
from .model import OUTPUT_NAME, ServedModel, default_model_name, load_layer
from .protocol import HEADER_LENGTH, ProtocolError, encode_infer_response, parse_header_length, parse_infer_request
from .settings import ServiceSettings

log = logging.getLogger("megamoe.service")

SERVER_NAME = "megamoe"
_REASON_OF_STATUS = {400: "bad_request", 401: "unauthorized", 404: "not_found", 405: "bad_method",
                     413: "too_large", 503: "not_ready"}


class ServiceState:
    """What the routes read: the model once loaded, and why the server is not ready when it is not."""

    def __init__(self, settings: ServiceSettings, layer=None):
        self.settings = settings
        self.metrics = ServiceMetrics()
        self.model_name = default_model_name(settings)
        # one device thread: forwards and self-tests never overlap on the device
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="megamoe-device")
        self.preloaded_layer = layer
        self.model: ServedModel | None = None
        self.batcher: DynamicBatcher | None = None
        self.loading = True
        self.load_error: str | None = None
        self.selftest_error: str | None = None
        self.device_error: str | None = None
        self._last_forward_failure: BaseException | None = None

    def not_ready_reason(self) -> str | None:
        if self.load_error:
            return f"model failed to load: {self.load_error}"
        if self.loading:
            return "model is loading and self-testing"
        if self.device_error:
            return f"device reported an error: {self.device_error}"
        if self.selftest_error:
            return f"kernel self-test failed: {self.selftest_error}"
        return None

    def refresh_ready_gauge(self) -> None:
        self.metrics.ready.set(0.0 if self.not_ready_reason() else 1.0)

    # --- device-thread work -------------------------------------------------

    def run_selftest(self, level: str) -> dict:
        started = time.time()
        layer = self.model.layer
        if callable(getattr(layer, "run_checks", None)):
            # a layer spread over several processes (service/distributed.py) checks every rank
            report = layer.run_checks(level)
        else:
            from megamoe import health

            report = health.run_checks(level=level, backend=layer.backend)
        self.metrics.record_selftest(level, report, started)
        if report.get("status") == "pass":
            self.selftest_error = None
        else:
            failed = [c.get("name") for c in report.get("checks", []) if c.get("status") == "fail"]
            self.selftest_error = f"{level} check(s) failed: {failed}"
        self.refresh_ready_gauge()
        return report

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
        self.model = ServedModel(self.model_name, layer, self.settings.max_tokens_per_request)
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


def _package_version() -> str:
    import megamoe

    version = getattr(megamoe, "__version__", None)
    if version:
        return str(version)
    try:
        return importlib.metadata.version("megamoe")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def _error(status: int, message: str, headers: dict | None = None) -> JSONResponse:
    return JSONResponse({"error": message}, status_code=status, headers=headers)


def create_app(settings: ServiceSettings, *, layer=None) -> FastAPI:
    """The service app; ``layer`` (a MoELayer) skips loading from the settings."""
    state = ServiceState(settings, layer)
    metrics = state.metrics
    token = settings.token_value()

    async def startup() -> None:
        loop = asyncio.get_running_loop()
        try:
            await loop.run_in_executor(state.executor, state.load_and_selftest)
        except Exception as exc:  # noqa: BLE001 - reported through readiness, the process stays up
            state.load_error = f"{type(exc).__name__}: {exc}"
            log.exception("start-up failed")
        else:
            model = state.model
            state.batcher = DynamicBatcher(
                model.forward_batch,
                state.executor,
                max_batch_tokens=settings.max_batch_tokens,
                queue_delay_s=settings.queue_delay_ms / 1000.0,
                on_batch=lambda n, t, s: metrics.record_batch(model.name, n, t, s),
            )
            state.batcher.start()
            metrics.queued.set_function(lambda: state.batcher.queued_requests)
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
                await loop.run_in_executor(state.executor, state.run_selftest, "quick")
            except Exception as exc:  # noqa: BLE001
                state.selftest_error = f"quick self-test raised {type(exc).__name__}: {exc}"
                state.refresh_ready_gauge()

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        state.refresh_ready_gauge()
        background = [asyncio.create_task(startup(), name="megamoe-startup")]
        if settings.selftest_interval_s > 0:
            background.append(asyncio.create_task(periodic_selftest(), name="megamoe-selftest"))
        try:
            yield
        finally:
            # uvicorn has already let in-flight requests finish; drain the queue, then stop.
            for task in background[1:]:
                task.cancel()
            await asyncio.gather(background[0], return_exceptions=True)
            if state.batcher is not None:
                await state.batcher.stop()
            state.executor.shutdown(wait=True)

    app = FastAPI(title="megamoe", description="NVFP4 MoE layer over the Open Inference Protocol (KServe v2)",
                  lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.megamoe = state

    @app.middleware("http")
    async def count_requests(request: Request, call_next):
        response = await call_next(request)
        route = request.scope.get("route")
        path = getattr(route, "path", "unmatched")
        metrics.requests.labels(path, str(response.status_code)).inc()
        if response.status_code >= 400:
            reason = _REASON_OF_STATUS.get(response.status_code, "internal")
            metrics.failures.labels(path, reason).inc()
        return response

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        return _error(exc.status_code, str(exc.detail), getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def unexpected_error(request: Request, exc: Exception):
        log.exception("unhandled error on %s", request.url.path)
        return _error(500, f"internal error: {type(exc).__name__}: {exc}")

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError):
        return _error(400, f"invalid request: {exc.errors()}")

    def authorized(request: Request) -> bool:
        if token is None:
            return True
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        return scheme.lower() == "bearer" and secrets.compare_digest(given.strip().encode(), token.encode())

    def unauthorized() -> JSONResponse:
        return _error(401, "missing or invalid bearer token", {"WWW-Authenticate": "Bearer"})

    def unknown_model(name: str) -> JSONResponse:
        return _error(404, f"unknown model {name!r}; this server serves {state.model_name!r}")

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
        return {"name": SERVER_NAME, "version": _package_version(), "extensions": ["binary_tensor_data"]}

    @app.get("/v2/models/{model_name}")
    @app.get("/v2/models/{model_name}/versions/{model_version}")
    async def model_metadata(model_name: str, model_version: str | None = None):
        if model_name != state.model_name or model_version not in (None, ServedModel.version):
            return unknown_model(model_name if model_version is None else f"{model_name}/{model_version}")
        if state.model is None:
            return _error(503, state.not_ready_reason() or "model not loaded")
        return state.model.metadata()

    @app.get("/v2/models/{model_name}/ready")
    @app.get("/v2/models/{model_name}/versions/{model_version}/ready")
    async def model_ready(model_name: str, model_version: str | None = None):
        if model_name != state.model_name or model_version not in (None, ServedModel.version):
            return unknown_model(model_name)
        reason = state.not_ready_reason()
        if reason:
            return JSONResponse({"name": model_name, "ready": False, "error": reason}, status_code=503)
        return {"name": model_name, "ready": True}

    # --- inference --------------------------------------------------------------

    async def read_body(request: Request) -> bytes:
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > settings.max_body_bytes:
            raise ProtocolError(f"body of {declared} bytes exceeds the limit of {settings.max_body_bytes}", 413)
        chunks, received = [], 0
        async for chunk in request.stream():
            received += len(chunk)
            if received > settings.max_body_bytes:
                raise ProtocolError(f"body exceeds the limit of {settings.max_body_bytes} bytes", 413)
            chunks.append(chunk)
        return b"".join(chunks)

    async def off_loop_if_large(size_bytes: int, fn, *args):
        """Decoding or encoding a large tensor (JSON above all) would stall every other
        connection: above 64 KiB it runs in a worker thread (not the device thread)."""
        if size_bytes < 64 * 1024:
            return fn(*args)
        return await asyncio.to_thread(fn, *args)

    @app.post("/v2/models/{model_name}/infer")
    @app.post("/v2/models/{model_name}/versions/{model_version}/infer")
    async def infer(request: Request, model_name: str, model_version: str | None = None):
        started = time.perf_counter()
        if not authorized(request):
            return unauthorized()
        if model_name != state.model_name or model_version not in (None, ServedModel.version):
            return unknown_model(model_name)
        reason = state.not_ready_reason()
        if reason or state.batcher is None:
            return _error(503, reason or "not ready")
        encoding = request.headers.get("content-encoding", "identity").lower()
        if encoding != "identity":
            return _error(400, f"Content-Encoding {encoding!r} is not supported; send the body uncompressed")
        model = state.model

        def decode(body: bytes):
            parsed = parse_infer_request(body, parse_header_length(request.headers.get(HEADER_LENGTH), len(body)))
            unknown_outputs = sorted(set(parsed.outputs) - {OUTPUT_NAME})
            if unknown_outputs:
                raise ProtocolError(f"unknown output(s) {unknown_outputs}; this model has {[OUTPUT_NAME]}")
            return parsed, model.validate(parsed.inputs, parsed.datatypes)

        try:
            body = await read_body(request)
            parsed, model_request = await off_loop_if_large(len(body), decode, body)
        except ProtocolError as exc:
            return _error(exc.status, exc.message)
        try:
            result = await state.batcher.submit(model_request)
        except ShuttingDown as exc:
            return _error(503, str(exc))
        except Exception as exc:  # noqa: BLE001 - a device failure, not the caller's input
            if state.first_report_of(exc):
                log.exception("forward failed")
                await asyncio.get_running_loop().run_in_executor(state.executor, state.probe_device)
            return _error(500, f"forward failed: {type(exc).__name__}: {exc}")
        as_binary = parsed.outputs.get(OUTPUT_NAME, parsed.binary_output_default)
        body, headers = await off_loop_if_large(
            result.output.numel() * (1 if as_binary else 8), encode_infer_response,
            model.name, model.version, parsed.request_id, [(OUTPUT_NAME, result.output, as_binary)],
        )
        metrics.queue_latency.labels(model.name).observe(result.queue_s)
        metrics.request_latency.labels(model.name).observe(time.perf_counter() - started)
        return Response(content=body, headers=headers, media_type=headers["content-type"])

    # --- kernel health and metrics -----------------------------------------------

    @app.get("/v1/health/kernels")
    async def kernel_health(request: Request, level: str = "quick"):
        if not authorized(request):
            return unauthorized()
        if level not in ("quick", "full"):
            return _error(400, f"level must be 'quick' or 'full', got {level!r}")
        if state.model is None:
            return _error(503, state.not_ready_reason() or "model not loaded")
        report = await asyncio.get_running_loop().run_in_executor(state.executor, state.run_selftest, level)
        return report

    @app.get("/metrics")
    async def prometheus_metrics():
        state.refresh_ready_gauge()
        return Response(content=metrics.render(), media_type=metrics.content_type)

    return app

"""FastAPI app: the Open Inference Protocol v2 routes, kernel health, metrics.

The routes are thin: each checks its route's model and, where it needs one, the bearer token, then
answers from the service state (state.py) or hands an infer request to the data plane
(dataplane.py: read, decode, validate, submit, encode), whose batcher (batching.py) runs batches
through the batch runner (runner.py) on the served model (model.py).

Start-up (in the background, so liveness answers at once): load the model, run the self-test
(docs/SPEC.md section 5), then report ready. A model that cannot be loaded (missing or broken
checkpoint) stops the process with exit status 1.

Client input never causes a 5xx: every request is answered by the outermost middleware,
which counts it and turns an unexpected exception into one JSON 500 and one log line.
"""

from __future__ import annotations

import asyncio
import importlib.metadata
import logging
import traceback
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from .dataplane import DataPlane, JSONAnswer, error_response
from .model import ServedModel
from .protocol import ProtocolError, strict_json
from .settings import ServiceSettings
from .state import ServiceState

log = logging.getLogger("megamoe.service")

SERVER_NAME = "megamoe"
_REASON_OF_STATUS = {400: "bad_request", 401: "unauthorized", 403: "forbidden", 404: "not_found",
                     405: "bad_method", 408: "timeout", 413: "too_large", 429: "busy", 503: "not_ready"}


def _package_version() -> str:
    import megamoe

    version = getattr(megamoe, "__version__", None)
    if version:
        return str(version)
    try:
        return importlib.metadata.version("megamoe")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def _where(exc: BaseException) -> str:
    frames = traceback.extract_tb(exc.__traceback__)
    return f"{frames[-1].filename}:{frames[-1].lineno}" if frames else "?"


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
                response = error_response(500, f"internal error: {type(exc).__name__}")
                await response(scope, receive, send_counted)

    def count(self, scope, status: int) -> None:
        path = getattr(scope.get("route"), "path", "unmatched")
        self.state.metrics.requests.labels(path, str(status)).inc()
        if status >= 400:
            self.state.metrics.failures.labels(path, _REASON_OF_STATUS.get(status, "internal")).inc()


def create_app(settings: ServiceSettings, *, layer=None, instance: int | None = None, load=None) -> FastAPI:
    """The service app; ``layer`` (a MoELayer) skips loading from the settings; ``instance``: this
    process's index among several serving processes (service/instances.py); ``load``: how the layer is
    loaded instead of from the settings (``load(settings)``, e.g. the shared copy: service/shared_weights.py)."""
    state = ServiceState(settings, layer, instance, load)
    plane = DataPlane(state, settings)
    metrics = state.metrics
    token = settings.token_value()


    @asynccontextmanager
    async def lifespan(app: FastAPI):
        state.refresh_ready_gauge()
        if token is None:
            log.warning("authentication is off (no MEGAMOE_TOKEN): infer and quick kernel health are open to "
                        "anyone who reaches %s:%s; full kernel health is refused", settings.host, settings.port)
        else:
            log.info("authentication is on: infer and kernel health need the bearer token")
        background = [asyncio.create_task(state.start(), name="megamoe-startup")]
        if settings.selftest_interval_s > 0:
            background.append(asyncio.create_task(state.periodic_selftest(), name="megamoe-selftest"))
        plane.start_decoder()
        try:
            yield
        finally:
            # uvicorn has already let in-flight requests finish; drain the queue, then stop.
            for task in background[1:]:
                task.cancel()
            await asyncio.gather(background[0], return_exceptions=True)
            await state.stop()
            plane.stop_decoder()

    app = FastAPI(title="megamoe", description="NVFP4 MoE layer over the Open Inference Protocol (KServe v2)",
                  lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.megamoe = state
    app.state.dataplane = plane
    app.add_middleware(ServiceMiddleware, state=state)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        return error_response(exc.status_code, str(exc.detail), getattr(exc, "headers", None))

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError):
        return error_response(400, f"invalid request: {exc.errors()}")

    def authorized(request: Request) -> bool:
        # the header's raw bytes (Starlette decodes headers as latin-1): no re-encoding guesses
        return state.authorized(request.headers.get("authorization", "").encode("latin-1"))

    def unauthorized() -> JSONResponse:
        return error_response(401, "missing or invalid bearer token", {"WWW-Authenticate": "Bearer"})

    def unknown_model(name: str, version: str | None) -> JSONResponse | None:
        """None when ``name`` (and ``version``, if given) is what this server serves."""
        if name != state.model_name:
            return error_response(404, f"unknown model {name!r}; this server serves {state.model_name!r}")
        if version is not None and version != ServedModel.version:
            return error_response(404, f"model {name!r} has no version {version!r}; this server serves version "
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
            return error_response(503, state.not_ready_reason() or "model not loaded")
        return state.model.metadata()

    @app.get("/v2/models/{model_name}/config")
    @app.get("/v2/models/{model_name}/versions/{model_version}/config")
    async def model_config(model_name: str, model_version: str | None = None):
        # Triton's model-configuration extension (perf_analyzer reads it after the metadata)
        refused = unknown_model(model_name, model_version)
        if refused is not None:
            return refused
        if state.model is None:
            return error_response(503, state.not_ready_reason() or "model not loaded")
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

    @app.post("/v2/models/{model_name}/infer")
    @app.post("/v2/models/{model_name}/versions/{model_version}/infer")
    async def infer(request: Request, model_name: str, model_version: str | None = None):
        if not authorized(request):
            return unauthorized()
        refused = unknown_model(model_name, model_version)
        if refused is not None:
            return refused
        return await plane.infer(request)

    # --- kernel health and metrics -----------------------------------------------

    @app.get("/v1/health/kernels")
    async def kernel_health(request: Request, level: str = "quick"):
        if not authorized(request):
            return unauthorized()
        if level not in ("quick", "full"):
            return error_response(400, f"level must be 'quick' or 'full', got {level!r}")
        if level == "full" and token is None:
            return error_response(403, "level=full runs the long checks on the serving device; this server has no "
                               "token (MEGAMOE_TOKEN), so it refuses them")
        if state.model is None:
            return error_response(503, state.not_ready_reason() or "model not loaded")
        try:
            report = await state.health_report(level)
        except ProtocolError as exc:
            return error_response(exc.status, exc.message, {"Retry-After": "5"} if exc.status == 429 else None)
        return JSONAnswer(strict_json(report))

    @app.get("/metrics")
    async def prometheus_metrics():
        state.refresh_ready_gauge()
        return Response(content=metrics.render(), media_type=metrics.content_type)

    return app


__all__ = ["create_app", "ServiceState", "ServiceMiddleware", "SERVER_NAME"]

"""The data plane of an infer request: read the body, decode it, validate it against the model,
submit it to the batcher, encode the answer. The routes (app.py) check route and token, then hand
the request here; nothing here knows a route.

Large JSON is decoded (and large JSON answers encoded) in a decoder process: json holds the
interpreter lock for its whole decode (~1 s per million values here), which would stall every
connection of the event loop.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import os
import threading
import time
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool

import torch
from fastapi import Request
from fastapi.responses import JSONResponse, Response

from .batching import ShuttingDown
from .jsoncodec import dumps, exit_with_parent
from .model import OUTPUT_NAME, ServedModel
from .protocol import (
    HEADER_LENGTH,
    BodyBuffer,
    ProtocolError,
    binary_aligned,
    build_request,
    count_json_values_bound,
    decode_json_request,
    encode_json_response,
    parse_header_length,
    response_parts,
    response_pieces,
    too_many_values,
)
from .settings import ServiceSettings

log = logging.getLogger("megamoe.service")

#: a JSON text this long or longer is decoded in the decoder process
OFFLOAD_JSON_BYTES = 256 * 1024
#: a JSON output with this many values or more is encoded there too
OFFLOAD_JSON_VALUES = 16 * 1024
#: values an infer request's JSON may hold beyond its tensors' (shapes, sizes, parameters)
JSON_VALUES_SLACK = 1024
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


def error_response(status: int, message: str, headers: dict | None = None, close: bool = False) -> JSONResponse:
    """The JSON error answer ``{"error": message}``; ``close``: with ``Connection: close``."""
    if close:
        headers = {**(headers or {}), "Connection": "close"}
    return JSONResponse({"error": message}, status_code=status, headers=headers)



class JSONAnswer(Response):
    """A JSON answer encoded with orjson where it is installed (service/jsoncodec.py ``dumps``)."""

    media_type = "application/json"

    def render(self, content) -> bytes:
        return dumps(content)


class PiecesResponse(Response):
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


class DataPlane:
    """Read, decode, validate, submit, encode (see the module doc) for one served model; ``state``:
    the service state (model, batcher, readiness, metrics)."""

    def __init__(self, state, settings: ServiceSettings):
        self.state, self.settings, self.metrics = state, settings, state.metrics
        self.decoder: ProcessPoolExecutor | None = None
        self._decoder_lock = threading.Lock()
        self._decoder_unavailable_logged = False

    @property
    def json_value_limit(self) -> int:
        """The most values one request's JSON may hold: every input at the largest T, plus slack
        (some clients, perf_analyzer among them, send all the optional inputs)."""
        cfg = self.state.model.config
        per_row = cfg.hidden_size + 2 * cfg.top_k + cfg.num_experts + 1  # + 1: input_ids
        return self.settings.max_tokens_per_request * per_row + JSON_VALUES_SLACK

    # --- the decoder process ------------------------------------------------------------

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

    def start_decoder(self) -> None:
        """Started at once, so that the first large JSON body does not pay for the process start-up."""
        try:
            self.decoder_pool().submit(decode_json_request, b"{}").add_done_callback(lambda f: f.exception())
        except Exception as exc:  # noqa: BLE001 - large JSON bodies will retry; small ones never need it
            log.warning("the JSON decoder process did not start: %s", exc)

    def stop_decoder(self) -> None:
        if self.decoder is not None:
            self.decoder.shutdown(wait=False, cancel_futures=True)

    # --- read, decode, encode -----------------------------------------------------------

    async def read_body(self, request: Request, count_values: bool, header_length: int | None = None):
        """The body, refused as soon as it is too large (413), holds too many JSON values (400),
        is not complete within ``timeout_body_s`` (408), or is still arriving when the shutdown
        grace period ends (503). ``count_values``: the body is all JSON (a bytearray); otherwise, with
        a Content-Length, a writable memoryview whose binary part after ``header_length`` bytes is
        aligned (protocol.BodyBuffer)."""
        settings = self.settings
        limit = min(settings.max_json_body_bytes, settings.max_body_bytes) if count_values else settings.max_body_bytes
        what = "JSON body" if count_values else "body"
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise ProtocolError(f"{what} of {declared} bytes exceeds the limit of {limit}", 413)
        max_values = self.json_value_limit
        known = declared is not None and declared.isascii() and declared.isdigit() and not count_values
        body, values = BodyBuffer(int(declared) if known else None, header_length), 0
        deadline = time.monotonic() + self.settings.timeout_body_s
        while True:
            now = time.monotonic()
            if self.state.shutdown_deadline is not None and now >= self.state.shutdown_deadline:
                raise ProtocolError("the server is shutting down and the request body was still arriving", 503,
                                    close=True)
            if now >= deadline:
                raise ProtocolError(f"the request body did not arrive within {self.settings.timeout_body_s:g} s", 408,
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

    async def decode(self, body, header_length: int | None):
        if header_length is None:
            json_part, binary = body, b""
        else:
            view = memoryview(body)
            json_part, binary = view[:header_length], view[header_length:]
            if header_length > self.settings.max_json_body_bytes:
                raise ProtocolError(f"JSON header of {header_length} bytes exceeds the limit of "
                                    f"{self.settings.max_json_body_bytes}", 413)
        plain = header_length is None
        if len(json_part) >= OFFLOAD_JSON_BYTES:
            payload = json_part if isinstance(json_part, bytearray) else bytes(json_part)  # no copy of a JSON body
            decoded = await self.in_decoder(decode_json_request, payload, self.json_value_limit, plain)
        else:
            decoded = decode_json_request(json_part, self.json_value_limit, plain)
        if len(binary) >= OFFLOAD_JSON_BYTES and not binary_aligned(binary):
            # misaligned (a chunked body): the tensors are copies, made in a thread (torch copies without the lock)
            return await asyncio.to_thread(build_request, decoded, binary)
        return build_request(decoded, binary)

    async def encode(self, model: ServedModel, request_id, output: torch.Tensor, as_binary: bool):
        header, packed, blobs = response_parts(model.name, model.version, request_id,
                                               [(OUTPUT_NAME, output, as_binary)])
        if packed and output.numel() >= OFFLOAD_JSON_VALUES:
            head = await self.in_decoder(encode_json_response, header, packed)
        else:
            head = encode_json_response(header, packed)
        return response_pieces(head, blobs)

    # --- the request ---------------------------------------------------------------

    async def infer(self, request: Request) -> Response:
        """One infer request whose route and token were checked: read, decode, validate, submit, encode."""
        started = time.perf_counter()
        state, settings, metrics = self.state, self.settings, self.metrics
        reason = state.not_ready_reason(serving=True)
        if reason or state.batcher is None:
            return error_response(503, reason or "not ready")
        encoding = request.headers.get("content-encoding", "identity").lower()
        if encoding != "identity":
            return error_response(400, f"Content-Encoding {encoding!r} is not supported; send the body uncompressed")
        model = state.model
        try:
            header_value = request.headers.get(HEADER_LENGTH)
            body = await self.read_body(request, count_values=header_value is None,
                                   header_length=parse_header_length(header_value, settings.max_body_bytes))
            decode_started = time.perf_counter()
            parsed = await self.decode(body, parse_header_length(header_value, len(body)))
            del body
            unknown_outputs = sorted(set(parsed.outputs) - {OUTPUT_NAME})
            if unknown_outputs:
                raise ProtocolError(f"unknown output(s) {unknown_outputs}; this model has {[OUTPUT_NAME]}")
            model_request = model.validate(parsed.inputs, parsed.datatypes)
            metrics.record_stage(model.name, "decode", time.perf_counter() - decode_started)
        except ProtocolError as exc:
            return error_response(exc.status, exc.message, close=exc.close)
        state.infer_active += 1
        try:
            result = await state.batcher.submit(model_request)
        except ShuttingDown as exc:
            return error_response(503, str(exc))
        except ProtocolError as exc:  # the caller's input, found on the device (non-finite hidden_states)
            return error_response(exc.status, exc.message)
        except Exception as exc:  # noqa: BLE001 - a device failure, not the caller's input
            if state.first_report_of(exc):
                log.error("forward failed: %s: %s", type(exc).__name__, exc)
                await asyncio.get_running_loop().run_in_executor(state.executor, state.probe_device)
            return error_response(500, f"forward failed: {type(exc).__name__}: {exc}")
        finally:
            state.infer_active -= 1
        as_binary = parsed.outputs.get(OUTPUT_NAME, parsed.binary_output_default)
        try:
            encode_started = time.perf_counter()
            content, headers = await self.encode(model, parsed.request_id, result.output, as_binary)
            metrics.record_stage(model.name, "encode", time.perf_counter() - encode_started)
        except ProtocolError as exc:
            return error_response(exc.status, exc.message)
        metrics.queue_latency.labels(model.name).observe(result.queue_s)
        metrics.request_latency.labels(model.name).observe(time.perf_counter() - started)
        return PiecesResponse(content, headers)


__all__ = ["DataPlane", "PiecesResponse", "JSONAnswer", "error_response", "OFFLOAD_JSON_BYTES", "OFFLOAD_JSON_VALUES"]

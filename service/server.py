"""Running the app: uvicorn with the service's connection timeouts and its shutdown.

uvicorn's own options do most of it: ``timeout_keep_alive`` closes idle keep-alive
connections, ``h11_max_incomplete_event_size`` bounds a request head (16 KiB),
``timeout_graceful_shutdown`` bounds the drain. Three things it lacks are added to its h11
protocol class here, and nowhere else:

- a connection that never sends a byte is closed after ``timeout_keep_alive_s`` (uvicorn
  arms that timer only after a first response);
- a request head (request line and headers) must be complete within
  ``timeout_request_head_s`` of its first byte (a client sending one header line every few
  seconds is cut off), and the rest of a body that the app answered early (a 413, say) within
  ``timeout_body_s``;
- at shutdown an idle keep-alive connection is not closed at once (a request may already be
  on the wire: closing would lose it); it lingers for :data:`SHUTDOWN_LINGER_S`, and a
  request that arrives meanwhile is served with ``Connection: close``.

SIGTERM: readiness turns 503 (``ServiceState.begin_shutdown``), the listening socket
closes, then responses carry ``Connection: close``; requests in flight and those that
arrive on open connections finish, a body still arriving when
``graceful_shutdown_s`` ends is answered 503, then the batcher drains and the process
exits 0. A model that cannot be loaded exits 1.
"""

from __future__ import annotations

import json
import logging
import signal

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from .app import create_app
from .settings import ServiceSettings

#: how long an idle connection stays open once shutdown began
SHUTDOWN_LINGER_S = 1.0
#: uvicorn cancels what still runs this long after the app's own grace period
_CANCEL_AFTER_GRACE_S = 2.0


def protocol_class(settings: ServiceSettings, state=None) -> type[H11Protocol]:
    """uvicorn's h11 protocol with the service's timeouts; ``state`` (ServiceState) counts the
    requests that are not even HTTP."""
    head_timeout_s = settings.timeout_request_head_s
    body_timeout_s = settings.timeout_body_s

    class ServiceH11Protocol(H11Protocol):
        _head_timer = None
        _draining = False

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            # no request yet: the same limit as an idle keep-alive connection
            self.timeout_keep_alive_task = self.loop.call_later(self.timeout_keep_alive,
                                                                self.timeout_keep_alive_handler)

        def _reading_unanswered(self) -> bool:
            """A head is arriving, or the rest of a body that was already answered."""
            their = self.conn.their_state
            return their is h11.IDLE or (their is h11.SEND_BODY and self.cycle is not None
                                         and self.cycle.response_complete)

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if self.transport.is_closing():
                return
            if self._reading_unanswered():
                if self._head_timer is None:
                    limit_s = head_timeout_s if self.conn.their_state is h11.IDLE else body_timeout_s
                    self._head_timer = self.loop.call_later(limit_s, self._head_timed_out)
            elif self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None
            if self._draining and self.cycle is not None and not self.cycle.response_complete:
                self.cycle.keep_alive = False

        def _head_timed_out(self) -> None:
            self._head_timer = None
            if self._reading_unanswered() and not self.transport.is_closing():
                self.transport.close()

        def connection_lost(self, exc) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None
            super().connection_lost(exc)

        def send_400_response(self, msg: str) -> None:
            # a request h11 cannot parse: the error in JSON like every other, and counted
            body = json.dumps({"error": f"malformed HTTP request: {msg}"}).encode()
            headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                       (b"connection", b"close")]
            for event in (h11.Response(status_code=400, headers=headers, reason=b"Bad Request"), h11.Data(data=body),
                          h11.EndOfMessage()):
                self.transport.write(self.conn.send(event))
            self.transport.close()
            if state is not None:
                state.metrics.requests.labels("unparsed", "400").inc()
                state.metrics.failures.labels("unparsed", "bad_request").inc()

        def shutdown(self) -> None:
            self._draining = True
            if self.cycle is None or self.cycle.response_complete:
                # idle: answer what may already be on its way, then close
                self._unset_keepalive_if_required()
                self.timeout_keep_alive_task = self.loop.call_later(SHUTDOWN_LINGER_S,
                                                                    self.timeout_keep_alive_handler)
            else:
                self.cycle.keep_alive = False

    return ServiceH11Protocol


class ServiceServer(uvicorn.Server):
    """uvicorn's server; SIGTERM/SIGINT start the service's shutdown and end in exit status 0
    (the signal is not re-raised after the drain)."""

    def __init__(self, config: uvicorn.Config, state):
        super().__init__(config)
        self.service_state = state

    def handle_exit(self, sig, frame) -> None:
        if self.should_exit and sig == signal.SIGINT:
            self.force_exit = True
            return
        self.service_state.begin_shutdown()
        self.should_exit = True

    async def shutdown(self, sockets=None) -> None:
        # Close the listening sockets first, and only then tell clients to close their
        # connections: a client told earlier would reconnect into the listen backlog, which
        # closing the socket resets (the request is lost); told now, its reconnect is refused.
        for server in self.servers:
            server.close()
        self.service_state.announce_close = True
        await super().shutdown(sockets)


def build_server(settings: ServiceSettings, *, layer=None) -> ServiceServer:
    """The uvicorn server of the app (``layer``: a loaded MoELayer, as create_app takes)."""
    app = create_app(settings, layer=layer)
    state = app.state.megamoe
    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        log_level=settings.log_level,
        access_log=False,
        http=protocol_class(settings, state),
        timeout_keep_alive=settings.timeout_keep_alive_s,
        timeout_graceful_shutdown=settings.graceful_shutdown_s + _CANCEL_AFTER_GRACE_S,
        lifespan="on",
    )
    server = ServiceServer(config, state)

    def stop_for_failure() -> None:
        server.should_exit = True

    state.request_exit = stop_for_failure
    return server


def serve(settings: ServiceSettings) -> int:
    """Serve until SIGTERM/SIGINT (0) or a failed model load (1)."""
    logging.basicConfig(level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    server = build_server(settings)
    server.run()
    # drained: uvicorn has put back the default handlers, and a second SIGTERM from an impatient
    # supervisor would now end the exit with status 143; the drain is done, so let it go by
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    return server.service_state.exit_code


__all__ = ["serve", "build_server", "protocol_class", "ServiceServer", "SHUTDOWN_LINGER_S"]

"""Running the app: uvicorn with the service's connection timeouts and its shutdown.

The HTTP protocol is uvicorn's httptools one where httptools is installed (a C parser), else
its h11 one. uvicorn's own options do most of it: ``timeout_keep_alive`` closes idle keep-alive
connections, a request head is bounded to 16 KiB (h11's ``h11_max_incomplete_event_size``;
:data:`MAX_HEAD_BYTES` with httptools), ``timeout_graceful_shutdown`` bounds the drain. Three
things it lacks are added to both protocol classes here, and nowhere else:

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

import asyncio
import functools
import json
import logging
import signal
import socket
import weakref

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from .app import create_app
from .channel import HEARTBEAT_S, MSG_ALL_READY, MSG_SHORT
from .settings import ServiceSettings, configure_logging

log = logging.getLogger("megamoe.service.server")

#: how long an idle connection stays open once shutdown began
SHUTDOWN_LINGER_S = 1.0
#: uvicorn cancels what still runs this long after the app's own grace period
_CANCEL_AFTER_GRACE_S = 2.0


#: the longest request head (request line and headers) a connection may send: uvicorn's h11 bound
MAX_HEAD_BYTES = 16 * 1024


def _error_400(msg: str) -> bytes:
    body = json.dumps({"error": f"malformed HTTP request: {msg}"}).encode()
    return (b"HTTP/1.1 400 Bad Request\r\ncontent-type: application/json\r\ncontent-length: "
            + str(len(body)).encode() + b"\r\nconnection: close\r\n\r\n" + body)


class _ServiceProtocol:
    """What the service adds to either uvicorn protocol (mixed in before it): the keep-alive
    limit before a first request too, head and unanswered-body timers, a counted JSON 400 for a
    request the parser refuses, and the shutdown linger. A protocol class says whether a head is
    arriving (``_head_arriving``) and whether the connection is reading something no response
    will answer (``_reading_unanswered``)."""

    head_timeout_s: float
    body_timeout_s: float
    write_timeout_s: float
    state = None  # ServiceState: counts the requests that are not even HTTP
    _head_timer = None
    _write_timer = None
    _draining = False

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        # no request yet: the same limit as an idle keep-alive connection
        self.timeout_keep_alive_task = self.loop.call_later(self.timeout_keep_alive,
                                                            self.timeout_keep_alive_handler)

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._after_read()

    def _after_read(self) -> None:
        """After bytes arrived: the head/unanswered-body timer, and the shutdown's Connection: close."""
        if self.transport.is_closing():
            return
        if self._reading_unanswered():
            if self._head_timer is None:
                limit_s = self.head_timeout_s if self._head_arriving() else self.body_timeout_s
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

    def pause_writing(self) -> None:
        # the client is not reading what it is sent: it has write_timeout_s to start again
        super().pause_writing()
        if self._write_timer is None:
            self._write_timer = self.loop.call_later(self.write_timeout_s, self._write_timed_out)

    def resume_writing(self) -> None:
        super().resume_writing()
        if self._write_timer is not None:
            self._write_timer.cancel()
            self._write_timer = None

    def _write_timed_out(self) -> None:
        self._write_timer = None
        if not self.transport.is_closing() or self.flow.write_paused:
            self.transport.abort()  # what it has not read is dropped, and the response's buffers with it

    def connection_lost(self, exc) -> None:
        for timer in (self._head_timer, self._write_timer):
            if timer is not None:
                timer.cancel()
        self._head_timer = self._write_timer = None
        super().connection_lost(exc)
        if self.state is not None:
            self.state.connection_closed()  # an instance of several tells the parent (instances.py)

    def send_400_response(self, msg: str) -> None:
        # a request the parser cannot read: the error in JSON like every other, and counted
        self.transport.write(_error_400(msg))
        self.transport.close()
        if self.state is not None:
            self.state.metrics.requests.labels("unparsed", "400").inc()
            self.state.metrics.failures.labels("unparsed", "bad_request").inc()

    def shutdown(self) -> None:
        self._draining = True
        if self.cycle is None or self.cycle.response_complete:
            # idle: answer what may already be on its way, then close
            self._unset_keepalive_if_required()
            self.timeout_keep_alive_task = self.loop.call_later(SHUTDOWN_LINGER_S,
                                                                self.timeout_keep_alive_handler)
        else:
            self.cycle.keep_alive = False


def h11_protocol_class(settings: ServiceSettings, state=None) -> type[H11Protocol]:
    """uvicorn's h11 protocol with the service's timeouts, 400 answer and shutdown."""

    class ServiceH11Protocol(_ServiceProtocol, H11Protocol):
        head_timeout_s = settings.timeout_request_head_s
        body_timeout_s = settings.timeout_body_s
        write_timeout_s = settings.timeout_write_s

        def _head_arriving(self) -> bool:
            return self.conn.their_state is h11.IDLE

        def _reading_unanswered(self) -> bool:
            """A head is arriving, or the rest of a body that was already answered."""
            their = self.conn.their_state
            return their is h11.IDLE or (their is h11.SEND_BODY and self.cycle is not None
                                         and self.cycle.response_complete)

    ServiceH11Protocol.state = state
    return ServiceH11Protocol


#: bytes the transport reads at once into a connection's buffer outside a direct body
READ_CHUNK = 256 * 1024
#: a binary infer body this long or longer is read directly into its buffer (a shorter one comes
#: with its head in a read or two: the parser's way costs less than a buffer of its own)
DIRECT_BODY_MIN_BYTES = 256 * 1024


class _DirectBody:
    """A binary infer body read by the transport straight into its buffer (``recv_into``), past the
    HTTP parser: no bytes objects per chunk, no copies between them, no wake-up of the app per chunk."""

    __slots__ = ("view", "filled", "length", "_cycle", "done", "delivered", "plain")

    def __init__(self, view: memoryview | None, cycle, length: int | None = None, plain: bool = False):
        """``view``: the buffer the body is read into; None: the body is discarded as it arrives
        (``length`` bytes: a request that gets no buffer, see ServiceState.admits_body). ``plain``:
        ``view`` is a bytearray's, delivered as that bytearray (a JSON body)."""
        # the cycle's receive holds this object: a weak reference back, so that no reference cycle
        # keeps the body's buffer (a pooled pinned block) alive until the garbage collector runs
        self.view, self.filled, self._cycle = view, 0, weakref.ref(cycle)
        self.length = len(view) if view is not None else length
        self.done = self.delivered = False
        self.plain = plain

    def take(self, chunk) -> int:
        """Bytes of ``chunk`` that belong to this body, stored (or discarded); returns how many."""
        n = min(len(chunk), self.length - self.filled)
        if self.view is not None:
            self.view[self.filled:self.filled + n] = chunk[:n]
        self.filled += n
        return n

    @property
    def cycle(self):
        return self._cycle()


def _content_length(headers) -> int | None:
    """A request's one plain-decimal Content-Length, 0 without a body, None when chunked or unclear."""
    declared = None
    for name, value in headers:
        if name == b"content-length":
            if declared is not None or not value.isdigit():
                return None
            declared = int(value)
        elif name == b"transfer-encoding":
            return None
    return declared or 0


def _direct_length(headers, max_body_bytes: int) -> tuple[int, int] | None:
    """(Content-Length, Inference-Header-Content-Length) of a request whose body can be read
    directly: a binary infer body of a declared length within the limit, not chunked; else None
    (the app reads it chunk by chunk and answers what is wrong with it)."""
    declared = header_length = None
    for name, value in headers:
        if name == b"content-length":
            if declared is not None or not value.isdigit():
                return None
            declared = int(value)
        elif name == b"inference-header-content-length":
            if header_length is not None or not value.isdigit():
                return None
            header_length = int(value)
        elif name in (b"transfer-encoding", b"content-encoding"):
            return None
    if (declared is None or header_length is None or not DIRECT_BODY_MIN_BYTES <= declared <= max_body_bytes
            or header_length > declared):
        return None
    return declared, header_length


async def _direct_receive(direct: _DirectBody):
    """The ASGI receive of a request whose body is read directly: one message with the whole body
    (a writable memoryview of its buffer), then, like uvicorn's, a disconnect once the response is
    done or the client went away."""
    cycle = direct.cycle
    if cycle is None:
        return {"type": "http.disconnect"}
    if cycle.waiting_for_100_continue and not cycle.transport.is_closing():
        cycle.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        cycle.waiting_for_100_continue = False
    while (not direct.done or direct.delivered) and not cycle.disconnected and not cycle.response_complete:
        cycle.flow.resume_reading()
        await cycle.message_event.wait()
        cycle.message_event.clear()
    if cycle.disconnected or cycle.response_complete:
        return {"type": "http.disconnect"}
    direct.delivered = True
    view, direct.view = direct.view, None  # the app holds it from here on
    if view is None:  # discarded (the request was answered without its body)
        return {"type": "http.request", "body": b"", "more_body": False}
    return {"type": "http.request", "body": view.obj if direct.plain else view, "more_body": False}


def httptools_protocol_class(settings: ServiceSettings, state=None):
    """uvicorn's httptools protocol (a C parser: far less CPU per request than h11) with the same
    timeouts, head bound, 400 answer and shutdown as :func:`h11_protocol_class`.

    It is also a buffered protocol: the transport reads into the connection's buffer, and the body
    of a binary infer request with a declared length goes straight into the buffer that its tensors
    will live in (``ServiceState.body_buffer``: pinned host memory on a CUDA device), past the parser,
    which is replaced by a fresh one for the next request on the connection."""
    import httptools
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    class ServiceHttpToolsProtocol(_ServiceProtocol, HttpToolsProtocol, asyncio.BufferedProtocol):
        head_timeout_s = settings.timeout_request_head_s
        body_timeout_s = settings.timeout_body_s
        write_timeout_s = settings.timeout_write_s
        _in_head = False
        _head_bytes = 0
        _direct: _DirectBody | None = None
        _scratch: memoryview | None = None

        # --- the buffered protocol ------------------------------------------------------

        def get_buffer(self, sizehint: int) -> memoryview:
            direct = self._direct
            if direct is not None and direct.view is not None:
                return direct.view[direct.filled:]
            if self._scratch is None:
                self._scratch = memoryview(bytearray(READ_CHUNK))
            return self._scratch

        def buffer_updated(self, nbytes: int) -> None:
            direct = self._direct
            if direct is None:
                # the parser copies what it keeps: the buffer is free again when this returns
                self.data_received(self._scratch[:nbytes])
                return
            self._unset_keepalive_if_required()
            if direct.view is not None:
                direct.filled += nbytes
                rest = b""
            else:  # discarded: read into the scratch buffer, which may also hold the next request
                taken = direct.take(self._scratch[:nbytes])
                rest = bytes(self._scratch[taken:nbytes])
            if direct.filled == direct.length:
                # the parser saw the head only: a fresh one reads the next request
                self._fresh_parser()
                self._direct_done()
            self._after_read()
            if rest:
                self.data_received(rest)

        def _fresh_parser(self) -> None:
            self.parser = httptools.HttpRequestParser(self)
            try:
                self.parser.set_dangerous_leniencies(lenient_data_after_close=True)
            except AttributeError:
                pass

        def data_received(self, data) -> None:
            # uvicorn's, but an Upgrade this server does not speak (h2c, say) is ignored (RFC 9110
            # section 7.8): the parser stops at such a request's head, so its body is read here and the
            # parser replaced for the next request
            self._unset_keepalive_if_required()
            try:
                self.parser.feed_data(data)
            except httptools.HttpParserError:
                msg = "Invalid HTTP request received."
                self.logger.warning(msg)
                self.send_400_response(msg)
                return
            except httptools.HttpParserUpgrade as exc:
                rest = memoryview(data)[exc.args[0]:]
                self._fresh_parser()
                direct = self._direct
                if direct is not None:
                    rest = rest[direct.take(rest):]
                    if direct.filled == direct.length:
                        self._direct_done()
                if rest:
                    self._after_read()
                    self.data_received(bytes(rest))
                    return
            self._after_read()

        def _direct_done(self) -> None:
            direct, self._direct = self._direct, None
            direct.done = True
            cycle = direct.cycle
            if cycle is None:
                return
            if cycle.response_complete:
                # answered before its body was in (401, 404, ...): the connection is idle now
                if not self.pipeline and self.timeout_keep_alive_task is None and not self.transport.is_closing():
                    self.timeout_keep_alive_task = self.loop.call_later(self.timeout_keep_alive,
                                                                        self.timeout_keep_alive_handler)
            else:
                cycle.more_body = False
            cycle.message_event.set()

        def connection_lost(self, exc) -> None:
            direct, self._direct = self._direct, None
            if direct is not None and not direct.delivered:
                direct.view = None  # the buffer of a body that will not complete: freed now
            super().connection_lost(exc)

        def on_body(self, body: bytes) -> None:
            direct = self._direct
            if direct is None:
                super().on_body(body)
                return
            # the part of the body that came with the head (the parser never passes the declared length)
            direct.take(body)

        def on_message_complete(self) -> None:
            direct = self._direct
            if direct is not None:
                if direct.filled == direct.length:
                    self._direct_done()  # the whole body came with the head: the parser is at the next request
                # else an ignored Upgrade: the parser stopped at the head, data_received reads the body
                return
            super().on_message_complete()

        def _count_head(self, n: int) -> None:
            self._head_bytes += n
            if self._head_bytes > MAX_HEAD_BYTES:
                raise httptools.HttpParserError(f"request head longer than {MAX_HEAD_BYTES} bytes")

        def on_message_begin(self) -> None:
            super().on_message_begin()
            self._in_head, self._head_bytes = True, 0

        def on_url(self, url: bytes) -> None:
            self._count_head(len(url))
            super().on_url(url)

        def on_header(self, name: bytes, value: bytes) -> None:
            self._count_head(len(name) + len(value) + 4)
            super().on_header(name, value)

        def on_headers_complete(self) -> None:
            self._in_head = False
            super().on_headers_complete()
            cycle = self.cycle
            if self.state is None or cycle is None or cycle.scope is not self.scope:
                return
            upgrade = self.parser.should_upgrade()  # one this server does not speak: ignored, see data_received
            path = self.scope.get("path", "")
            authorization = next((v for n, v in self.headers if n == b"authorization"), None)
            # route and token first: no request that will be refused gets a body buffer
            admitted = self.scope.get("method") == "POST" and self.state.admits_body(path, authorization)
            lengths = _direct_length(self.headers, settings.max_body_bytes) if admitted else None
            if lengths is not None:
                direct = _DirectBody(self.state.body_buffer(*lengths), cycle)
            elif upgrade:
                declared = _content_length(self.headers)
                if declared is None:
                    self.send_400_response("an Upgrade request with a body of no declared length is not served")
                    return
                if not declared:
                    return  # no body: the parser's on_message_complete ends the request
                fits = admitted and declared <= min(settings.max_body_bytes, settings.max_json_body_bytes)
                if fits:
                    direct = _DirectBody(memoryview(bytearray(declared)), cycle, plain=True)
                else:  # discarded as it arrives, and the connection closed after the answer
                    direct = _DirectBody(None, cycle, declared)
                    cycle.keep_alive = False
            else:
                return
            self._direct = direct
            # the cycle's task has not started yet: its receive is the direct body's
            cycle.receive = functools.partial(_direct_receive, direct)

        def _head_arriving(self) -> bool:
            return self._in_head

        def _reading_unanswered(self) -> bool:
            """A head is arriving, or the rest of a body that was already answered."""
            cycle = self.cycle
            direct = self._direct
            return self._in_head or (cycle is not None and cycle.response_complete and cycle.more_body) or (
                direct is not None and getattr(direct.cycle, "response_complete", False))

    ServiceHttpToolsProtocol.state = state
    return ServiceHttpToolsProtocol


def protocol_class(settings: ServiceSettings, state=None):
    """The HTTP protocol the server runs: httptools' where it is installed, else h11's."""
    try:
        return httptools_protocol_class(settings, state)
    except ImportError:
        return h11_protocol_class(settings, state)


class ServiceServer(uvicorn.Server):
    """uvicorn's server; SIGTERM/SIGINT start the service's shutdown and end in exit status 0
    (the signal is not re-raised after the drain).

    ``channel``: an instance of several (service/instances.py) serves the connections the parent
    process hands it over this Unix socket (file descriptors), not a listening socket of its own;
    it tells the parent its readiness and each connection that closed."""

    def __init__(self, config: uvicorn.Config, state, channel: socket.socket | None = None):
        super().__init__(config)
        self.service_state = state
        self.channel = channel
        self._connecting: set[asyncio.Task] = set()
        self._loop = None
        self._beat = None
        self._news = bytearray()

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets=[] if self.channel is not None else sockets)
        if self.channel is None or not self.started:
            return
        self._loop = asyncio.get_running_loop()
        self._protocol = functools.partial(self.config.http_protocol_class, config=self.config,
                                           server_state=self.server_state, app_state=self.lifespan.state)
        self.channel.setblocking(False)
        self._loop.add_reader(self.channel.fileno(), self._take_connections)
        loop = self._loop
        self.service_state.call_in_loop = lambda fn, *args: loop.call_soon_threadsafe(fn, *args)
        self.service_state.report_readiness(force=True)  # serving: the parent may hand us connections
        self._heartbeat()

    def _heartbeat(self) -> None:
        """Every HEARTBEAT_S while the event loop turns (also while draining): silence is a hung instance."""
        self.service_state.heartbeat()
        self._beat = self._loop.call_later(HEARTBEAT_S, self._heartbeat)

    def _parent_news(self, data: bytes) -> None:
        """The parent's word on the instances (service/channel.py): every one ready, or why not."""
        self._news += data
        while self._news:
            kind = self._news[0]
            if kind == MSG_SHORT:
                end = self._news.find(b"\n")
                if end < 0:
                    return  # the rest of the reason comes with the next read
                self.service_state.set_peers(self._news[1:end].decode("utf-8", "replace") or "an instance is down")
                del self._news[:end + 1]
                continue
            if kind == MSG_ALL_READY:
                self.service_state.set_peers(None)
            del self._news[:1]  # (a connection's byte, or one this version does not know)

    def _take_connections(self) -> None:
        """Connections from the parent: each becomes a connection of this server, as if accepted here."""
        while True:
            try:
                data, fds, _flags, _addr = socket.recv_fds(self.channel, 64, 64)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                data, fds = b"", []
            if data:
                self._parent_news(data)
            if fds:
                # taken: the parent lets go of its copies (until then it can hand them to another instance)
                self.service_state.connections_taken(len(fds))
            for fd in fds:
                sock = socket.socket(fileno=fd)
                sock.setblocking(False)
                task = self._loop.create_task(self._loop.connect_accepted_socket(self._protocol, sock))
                self._connecting.add(task)
                task.add_done_callback(self._connected)
            if not data:  # the parent is gone: nobody hands out connections any more
                self._loop.remove_reader(self.channel.fileno())
                if not self.should_exit:
                    log.error("the parent process is gone: this instance drains and exits")
                    self.handle_exit(signal.SIGTERM, None)
                return

    def _connected(self, task: asyncio.Task) -> None:
        self._connecting.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.warning("a connection from the parent could not be served: %s", task.exception())
            self.service_state.connection_closed()

    def handle_exit(self, sig, frame) -> None:
        # A second Ctrl-C forces the exit of a server of its own. An instance of several is stopped by its parent: a
        # terminal's Ctrl-C reaches the whole process group, so the instance gets SIGINT beside the parent's SIGTERM,
        # in either order, and both only start the drain.
        if self.should_exit and sig == signal.SIGINT and self.channel is None:
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
        if self.channel is not None and self._loop is not None:
            # the parent has closed the listening socket before signalling: take what it handed out
            self._take_connections()
            self._loop.remove_reader(self.channel.fileno())
            if self._connecting:
                await asyncio.gather(*self._connecting, return_exceptions=True)
        self.service_state.announce_close = True
        await super().shutdown(sockets)


def build_server(settings: ServiceSettings, *, layer=None, instance: tuple[int, socket.socket] | None = None,
                 load=None) -> ServiceServer:
    """The uvicorn server of the app (``layer``: a loaded MoELayer, and ``load``, as create_app takes;
    ``instance``: (index, channel) of an instance of several, see service/instances.py)."""
    app = create_app(settings, layer=layer, instance=instance[0] if instance is not None else None, load=load)
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
    channel = instance[1] if instance is not None else None
    server = ServiceServer(config, state, channel)
    if channel is not None:
        state.attach_parent(channel)

    def stop_for_failure() -> None:
        server.should_exit = True

    state.request_exit = stop_for_failure
    return server


def serve(settings: ServiceSettings, *, instance: tuple[int, socket.socket] | None = None, load=None) -> int:
    """Serve in this process until SIGTERM/SIGINT (0) or a failed model load (1); ``instance``: this
    process is one instance of several (service/instances.py supervises them); ``load``: as create_app."""
    configure_logging(settings, instance[0] if instance is not None else None)
    server = build_server(settings, instance=instance, load=load)
    server.run()
    # drained: uvicorn has put back the default handlers, and a second SIGTERM from an impatient
    # supervisor would now end the exit with status 143; the drain is done, so let it go by
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    return server.service_state.exit_code


__all__ = ["serve", "build_server", "protocol_class", "h11_protocol_class", "httptools_protocol_class", "ServiceServer",
           "SHUTDOWN_LINGER_S"]

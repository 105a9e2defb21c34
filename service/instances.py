"""Several serving processes ("model instances", Triton's instance_group count) behind one port.

``megamoe serve --instances N``: this process (the parent) binds and listens on the port once and
starts N instance processes (multiprocessing "spawn": fresh interpreters, each with its own CUDA
context). Every instance runs the unchanged service (:func:`megamoe.service.server.serve`: its own
event loop, batcher, device thread, CUDA graphs), so N event loops share the HTTP work that one loop
alone cannot keep up with.

Weights (``--share-weights``, the default): one more process, the weights process, loads and prepares
the layer once; every instance maps its tensors (service/shared_weights.py), so the device holds one copy
of the weights however many instances run, and a restarted instance maps the same copy again. The weights
process starts first and ends last (after every instance exited). If it dies while the server runs, the
instances' weights are gone: the server goes unready, answers the connections in the backlog 503 and exits
1 (on a GPU the instances are killed at once, since their device memory is no longer guaranteed; on the CPU
the shared pages outlive it and the instances drain). With ``--no-share-weights`` every instance loads its
own copy.

Connections: the parent accepts them and hands each one (its file descriptor, over a Unix socket
pair) to the instance with the fewest open connections among those that can take one: ready ones
first; while none is ready, one that is serving but still loading (it answers liveness, and 503 for
readiness and infer, as a single process does while it loads); while none serves yet, connections
wait in the listen backlog. The parent handing connections out, rather than every instance accepting
on the shared socket, spreads a burst of connections evenly (an instance that wakes first would
otherwise accept all of them).

The parent never blocks on one instance: it passes descriptors without blocking, and what an instance
does not take at once waits in that instance's bounded queue; an instance whose queue is full gets
no more, and a connection that no instance can take is answered 503 (``Retry-After``, ``Connection:
close``) by the parent itself, its request read and dropped, never reset. The parent keeps its copy
of each connection until the instance says it took it: the connections an instance never took when
it dies or hangs (in its socket, or queued here) go to another instance, their requests intact.

Supervision (messages in service/channel.py):

- every instance sends a heartbeat from its event loop every HEARTBEAT_S. An instance silent for
  STALE_S gets no new connections; silent for ``instance_heartbeat_timeout_s`` it is hung: killed
  and restarted;
- an instance whose device failed leaves (it turns unready, closes its keep-alive connections with
  ``Connection: close``, drains and exits with EXIT_LEFT) and is restarted;
- an instance that exits on its own (a crash, a kill) is restarted;
- one instance restarted more than ``instance_restarts`` times within RESTART_WINDOW_S: the server
  goes unready, every other instance drains, the connections waiting in the backlog are answered
  503, and the parent exits 1 (a failed model load is no better the second time: exits 1 at once);
- readiness: the parent tells every instance whether all N instances are ready; each instance
  answers readiness 200 (and ``megamoe_ready`` 1) only then, so the server never reports ready while
  it runs an instance short.

SIGTERM/SIGINT: the connections waiting in the backlog are answered 503, the listening socket
closes, every instance gets SIGTERM and drains (requests in flight and those on open connections
are answered, see server.py); the parent exits 0 once all of them exited 0.

Metrics: the parent points prometheus_client's multiprocess mode at a fresh directory
(``PROMETHEUS_MULTIPROC_DIR``, removed at exit); every instance writes its samples there and
``/metrics``, whichever instance answers it, reports counters and histograms summed over all
instances (gauges by their ``multiprocess_mode``, see metrics.py).
"""

from __future__ import annotations

import json
import logging
import multiprocessing
import os
import selectors
import shutil
import signal
import socket
import tempfile
import time
from collections import deque

from .channel import (
    EXIT_LEFT,
    MSG_ALL_READY,
    MSG_CLOSED,
    MSG_HEARTBEAT,
    MSG_LEAVING,
    MSG_NOT_READY,
    MSG_READY,
    MSG_SHORT,
    MSG_TAKEN,
    recv_ready,
)
from .settings import ServiceSettings

log = logging.getLogger("megamoe.service.instances")

#: accepted connections handed out per wake-up of the parent at most (then it reads the instances' news)
_ACCEPT_BURST = 64
#: an instance still running this long after the drain should have ended is killed
_KILL_AFTER_S = 10.0
#: an instance silent (no heartbeat) this long gets no new connections
STALE_S = 3.0
#: connections waiting in the parent for one instance that did not take them at once, at most
PENDING_MAX = 64
#: the window over which an instance's restarts are counted (settings.instance_restarts)
RESTART_WINDOW_S = 600.0
#: a connection the parent answers 503 itself: its request is read and dropped this long at most
_REFUSE_LINGER_S = 2.0
#: the exit status of an instance whose model could not be loaded (server.serve: state.exit_code)
_EXIT_LOAD_FAILED = 1


def _refusal(reason: str) -> bytes:
    body = json.dumps({"error": reason}).encode()
    return (b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\ncontent-length: "
            + str(len(body)).encode() + b"\r\nretry-after: 1\r\nconnection: close\r\n\r\n" + body)


class _Instance:
    def __init__(self, index: int, process, channel: socket.socket):
        self.index, self.process, self.channel = index, process, channel
        self.serving = self.ready = self.exited = False
        self.was_ready = False
        self.leaving: str | None = None  # why it gets no more connections (left, hung, killed)
        self.open = 0       # connections handed to it and not yet closed
        self.handed = 0     # connections handed to it in all
        self.started_s = self.last_news_s = time.monotonic()
        self.stale_logged = False
        #: what waits to be sent to it, in order: ("fd", socket) or ("data", bytes)
        self.outbox: deque = deque()
        self.waiting_fds = 0
        #: connections sent and not yet taken (``T``), in order: the parent keeps its copies
        self.unacked: deque = deque()
        self.told: bytes | None = None  # the readiness word it was last sent


def listen_socket(host: str, port: int, backlog: int = 2048) -> socket.socket:
    """The listening socket every instance's connections come from (bound once, here)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    return socket.create_server((host, port), family=family, backlog=backlog)


def _instance_main(settings: ServiceSettings, index: int, channel: socket.socket, weights: str | None = None) -> None:
    """An instance process: the single-process service, fed connections by the parent; ``weights``: the
    weights process's socket, where its layer comes from (else it loads its own)."""
    import sys

    from .server import serve

    load = None
    if weights is not None:
        from .shared_weights import SharedLayerLoader

        load = SharedLayerLoader(weights)
    code = serve(settings, instance=(index, channel), load=load)
    # Drained. The JSON decoder process (a child of this one) is ended here: multiprocessing would
    # join it before the interpreter's exit hooks run, and one of those is what tells it to stop.
    for child in multiprocessing.active_children():
        child.terminate()
        child.join(5)
    sys.exit(code)


def serve_instances(settings: ServiceSettings) -> int:
    """Run ``settings.instances`` instance processes behind one listening socket until SIGTERM/SIGINT (0)
    or until an instance cannot be kept running (1)."""
    count = settings.instances
    try:
        listener = listen_socket(settings.host, settings.port)
    except OSError as exc:
        log.error("cannot listen on %s:%s: %s", settings.host, settings.port, exc)
        return 1
    listener.setblocking(False)
    host, port = listener.getsockname()[:2]
    metrics_dir = tempfile.mkdtemp(prefix="megamoe-metrics-")
    # read by prometheus_client when it is imported, in each instance (they inherit the environment)
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = metrics_dir
    signals: list[int] = []
    previous = {sig: signal.signal(sig, lambda s, _f: signals.append(s)) for sig in (signal.SIGTERM, signal.SIGINT)}
    supervisor = _Supervisor(listener, settings, signals)
    weights_dir = tempfile.mkdtemp(prefix="megamoe-weights-") if settings.share_weights else None  # mode 0700
    try:
        if weights_dir is not None:
            path = os.path.join(weights_dir, "weights.sock")
            try:
                supervisor.start_weights(path)
            except OSError as exc:  # a Unix socket path is at most 107 bytes: TMPDIR too deep, say
                log.error("cannot start the weights process (its socket %s: %s); serve with --no-share-weights or "
                          "set TMPDIR to a shorter path", path, exc)
                return 1
        for index in range(count):
            supervisor.start(index)
        log.info("listening on http://%s:%d for %d instances (%s)", host, port, count,
                 "sharing one copy of the weights" if weights_dir else "each holds its own copy of the weights")
        return supervisor.run()
    finally:
        listener.close()
        supervisor.close()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        shutil.rmtree(metrics_dir, ignore_errors=True)
        if weights_dir is not None:
            shutil.rmtree(weights_dir, ignore_errors=True)


class _Supervisor:
    def __init__(self, listener: socket.socket, settings: ServiceSettings, signals: list[int]):
        self.listener, self.settings, self.signals = listener, settings, signals
        self.count = settings.instances
        self.instances: list[_Instance | None] = [None] * self.count
        self.restarts: list[deque] = [deque() for _ in range(self.count)]
        self.selector = selectors.DefaultSelector()
        self.context = multiprocessing.get_context("spawn")
        self.accepting = False
        self.stopping = False
        self.failed = False
        self.deadline: float | None = None
        self.all_ready_logged = False
        self.refusing: dict[socket.socket, float] = {}  # answered 503 here: when to close at the latest
        #: the weights process (--share-weights): its socket path, process, channel, and what it said
        self.weights_path: str | None = None
        self.weights: multiprocessing.Process | None = None
        self.weights_channel: socket.socket | None = None
        self.weights_news = b""
        self.weights_loaded: dict | None = None

    # --- instances ---------------------------------------------------------------------

    def start_weights(self, path: str) -> None:
        """The weights process (service/shared_weights.py), listening on ``path`` before any instance starts:
        an instance that connects while it loads waits for the layer."""
        from .shared_weights import holder_main

        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.bind(path)
        sock.listen(self.count * 4)
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        process = self.context.Process(target=holder_main, args=(self.settings, sock, theirs), name="megamoe-weights")
        process.start()
        sock.close()
        theirs.close()
        ours.setblocking(False)
        self.weights_path, self.weights, self.weights_channel = path, process, ours
        self.selector.register(ours, selectors.EVENT_READ, ("weights-news", None))
        self.selector.register(process.sentinel, selectors.EVENT_READ, ("weights-exit", None))
        log.info("weights process (pid %d): loading the model once for the %d instances", process.pid, self.count)

    def start(self, index: int) -> _Instance:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        process = self.context.Process(target=_instance_main, args=(self.settings, index, theirs, self.weights_path),
                                       name=f"megamoe-instance-{index}")
        process.start()
        theirs.close()
        ours.setblocking(False)  # the parent never waits on an instance
        inst = _Instance(index, process, ours)
        self.instances[index] = inst
        self.selector.register(ours, selectors.EVENT_READ, ("news", inst))
        self.selector.register(process.sentinel, selectors.EVENT_READ, ("exit", inst))
        log.info("instance %d of %d (pid %d): %s", index, self.count, process.pid,
                 "mapping the weights process's layer" if self.weights_path else "loading the model")
        return inst

    def close(self) -> None:
        for inst in self.instances:
            if inst is None:
                continue
            if inst.process.is_alive():
                inst.process.kill()
            inst.process.join(5)
            self._drop_outbox(inst, "the server stopped", untaken=True)
            inst.channel.close()
        for conn in list(self.refusing):
            conn.close()
        self.refusing.clear()
        self._end_weights()

    def _end_weights(self) -> None:
        """The weights process leaves once this channel closes and no instance is connected (every instance
        has exited by now): wait for that, then kill it if it is still there."""
        process = self.weights
        if process is None:
            return
        self._unregister_weights()
        if self.weights_channel is not None:
            self.weights_channel.close()
            self.weights_channel = None
        process.join(_KILL_AFTER_S)
        if process.is_alive():
            log.error("the weights process (pid %d) did not end: killed", process.pid)
            process.kill()
            process.join(5)

    def _unregister_weights(self) -> None:
        for source in (self.weights.sentinel, self.weights_channel):
            if source is None:
                continue
            try:
                self.selector.unregister(source)
            except (KeyError, ValueError):
                pass

    def _live(self) -> list[_Instance]:
        return [i for i in self.instances if i is not None and not i.exited]

    # --- the loop ---------------------------------------------------------------------

    def run(self) -> int:
        while self._live() or self.refusing:
            if self.signals and not self.stopping:
                log.info("signal %d: every instance drains, then the server exits", self.signals[0])
                self.stop()
            if not self._live() and self.stopping:
                self._linger_refused(block_s=0.05)
                if all(deadline < time.monotonic() for deadline in self.refusing.values()):
                    break
                continue
            self._set_accepting(not self.stopping and self._target() is not None)
            for key, mask in self.selector.select(timeout=0.25):
                what, item = key.data
                if what == "accept":
                    self._accept()
                elif what == "news":
                    if mask & selectors.EVENT_READ:
                        self._news(item)
                    if mask & selectors.EVENT_WRITE and not item.exited:
                        self._flush(item)
                elif what == "refused":
                    self._read_refused(item)
                elif what == "weights-news":
                    self._weights_news()
                elif what == "weights-exit":
                    self._weights_exited()
                else:
                    self._exited(item)
            now = time.monotonic()
            self._check_heartbeats(now)
            self._publish_readiness()
            self._linger_refused()
            if self.deadline is not None and now > self.deadline:
                for inst in self._live():
                    if inst.process.is_alive():
                        log.error("instance %d (pid %d) did not finish its drain in time: killed",
                                  inst.index, inst.process.pid)
                        inst.process.kill()
                self.failed = True
                self.deadline = None
        return 1 if self.failed else 0

    def stop(self) -> None:
        """Answer the connections waiting in the backlog 503, close the listening socket (new
        connections are refused), then every instance drains."""
        self.stopping = True
        self._set_accepting(False)
        while True:
            try:
                conn, _ = self.listener.accept()
            except (BlockingIOError, InterruptedError, OSError):
                break
            self._refuse(conn, "the server is shutting down")
        self.listener.close()
        for inst in self._live():
            if inst.process.is_alive():
                os.kill(inst.process.pid, signal.SIGTERM)
        self.deadline = time.monotonic() + self.settings.graceful_shutdown_s + _KILL_AFTER_S

    def _set_accepting(self, on: bool) -> None:
        if on == self.accepting:
            return
        if on:
            self.selector.register(self.listener, selectors.EVENT_READ, ("accept", None))
        else:
            self.selector.unregister(self.listener)
        self.accepting = on

    # --- connections ----------------------------------------------------------------------

    def _can_take(self, inst: _Instance, now: float) -> bool:
        return (not inst.exited and inst.serving and inst.leaving is None and now - inst.last_news_s <= STALE_S
                and inst.waiting_fds < PENDING_MAX)

    def _target(self) -> _Instance | None:
        now = time.monotonic()
        able = [i for i in self.instances if i is not None and self._can_take(i, now)]
        pool = [i for i in able if i.ready] or able
        return min(pool, key=lambda i: (i.open + i.waiting_fds, i.handed)) if pool else None

    def _accept(self) -> None:
        for _ in range(_ACCEPT_BURST):
            target = self._target()
            if target is None:
                return  # the rest wait in the backlog
            try:
                conn, _ = self.listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:  # out of file descriptors, say: the connection stays in the backlog
                log.warning("accept failed: %s", exc)
                return
            self._hand(target, conn)

    def _hand(self, inst: _Instance, conn: socket.socket) -> None:
        inst.outbox.append(("fd", conn))
        inst.waiting_fds += 1
        inst.open += 1
        inst.handed += 1
        self._flush(inst)

    def _send(self, inst: _Instance, data: bytes) -> None:
        inst.outbox.append(("data", data))
        self._flush(inst)

    def _flush(self, inst: _Instance) -> None:
        """Send what waits for ``inst`` without blocking; what it does not take now waits (EVENT_WRITE)."""
        while inst.outbox:
            kind, item = inst.outbox[0]
            try:
                if kind == "fd":
                    socket.send_fds(inst.channel, [b"c"], [item.fileno()])
                else:
                    sent = inst.channel.send(item)
                    if sent < len(item):
                        inst.outbox[0] = ("data", item[sent:])
                        continue
            except (BlockingIOError, InterruptedError):
                break
            except OSError as exc:  # the instance is going away: its exit comes through the sentinel
                log.warning("instance %d (pid %d) does not take what it is sent (%s): it gets no more connections",
                            inst.index, inst.process.pid, exc)
                if inst.leaving is None:
                    inst.leaving = f"its channel failed: {exc}"
                self._drop_outbox(inst, None)
                return
            inst.outbox.popleft()
            if kind == "fd":
                inst.waiting_fds -= 1
                inst.unacked.append(item)  # closed once the instance says it took it
        self._want_write(inst, bool(inst.outbox))

    def _want_write(self, inst: _Instance, on: bool) -> None:
        events = selectors.EVENT_READ | (selectors.EVENT_WRITE if on else 0)
        try:
            if self.selector.get_key(inst.channel).events != events:
                self.selector.modify(inst.channel, events, ("news", inst))
        except (KeyError, ValueError):
            pass  # unregistered: the instance is gone

    def _drop_outbox(self, inst: _Instance, reason: str | None, untaken: bool = False) -> None:
        """The connections that were waiting for ``inst`` (``untaken``: and those it was sent but never
        took, once it is gone): to another instance, else answered 503."""
        waiting = [item for kind, item in inst.outbox if kind == "fd"]
        if untaken:
            waiting = list(inst.unacked) + waiting
            inst.unacked.clear()
        inst.outbox.clear()
        inst.open = max(0, inst.open - len(waiting))
        inst.waiting_fds = 0
        for conn in waiting:
            target = None if self.stopping or reason is not None else self._target()
            if target is not None and target is not inst:
                self._hand(target, conn)
            else:
                self._refuse(conn, reason or "no instance can take the connection now")

    def _refuse(self, conn: socket.socket, reason: str) -> None:
        """Answer 503 here, then read and drop what the client sent until it closes (closing with its
        request unread would reset the connection, and the client might lose the answer)."""
        try:
            conn.setblocking(False)
            conn.send(_refusal(reason))
            conn.shutdown(socket.SHUT_WR)
        except OSError:
            conn.close()
            return
        self.refusing[conn] = time.monotonic() + _REFUSE_LINGER_S
        self.selector.register(conn, selectors.EVENT_READ, ("refused", conn))

    def _read_refused(self, conn: socket.socket) -> None:
        data = recv_ready(conn, 65536)
        if data is None:
            return
        if not data:
            self._close_refused(conn)

    def _close_refused(self, conn: socket.socket) -> None:
        self.refusing.pop(conn, None)
        try:
            self.selector.unregister(conn)
        except (KeyError, ValueError):
            pass
        conn.close()

    def _linger_refused(self, block_s: float = 0.0) -> None:
        if block_s and self.refusing:
            for key, _ in self.selector.select(timeout=block_s):
                if key.data[0] == "refused":
                    self._read_refused(key.data[1])
        now = time.monotonic()
        for conn, deadline in list(self.refusing.items()):
            if now > deadline:
                self._close_refused(conn)

    # --- news from the instances -----------------------------------------------------------

    def _channel_data(self, channel: socket.socket, size: int) -> bytes:
        """What a child's channel has (b"" for nothing now); at its end the channel leaves the selector (the child's
        exit comes through its sentinel)."""
        data = recv_ready(channel, size)
        if data is None:
            return b""
        if not data:
            try:
                self.selector.unregister(channel)
            except (KeyError, ValueError):
                pass
        return data

    def _news(self, inst: _Instance) -> None:
        data = self._channel_data(inst.channel, 4096)
        if not data:
            return
        inst.last_news_s = time.monotonic()
        if inst.stale_logged:
            inst.stale_logged = False
            log.warning("instance %d (pid %d) is heard from again", inst.index, inst.process.pid)
        for byte in data:
            if byte == MSG_TAKEN:
                if inst.unacked:
                    inst.unacked.popleft().close()  # the instance has its own descriptor now
            elif byte == MSG_CLOSED:
                inst.open = max(0, inst.open - 1)
            elif byte == MSG_LEAVING:
                if inst.leaving is None:
                    inst.leaving = "it left (its device reported an error)"
                    log.error("instance %d (pid %d) leaves after a device error: it gets no new connections and is "
                              "restarted once it has drained", inst.index, inst.process.pid)
                inst.ready = False
            elif byte in (MSG_READY, MSG_NOT_READY):
                ready = byte == MSG_READY and inst.leaving is None
                if not inst.serving:
                    inst.serving = True
                if ready and not inst.was_ready:
                    log.info("instance %d of %d (pid %d): ready after %.1f s", inst.index, self.count,
                             inst.process.pid, time.monotonic() - inst.started_s)
                elif not ready and inst.ready and not self.stopping:
                    log.warning("instance %d (pid %d) reports not ready: it gets no new connections while "
                                "another instance is ready", inst.index, inst.process.pid)
                inst.ready = ready
                inst.was_ready |= ready
        live = self._live()
        if not self.all_ready_logged and len(live) == self.count and all(i.ready for i in live):
            self.all_ready_logged = True
            log.info("all %d instances ready", self.count)

    def _check_heartbeats(self, now: float) -> None:
        if self.stopping:
            return
        for inst in self._live():
            if not inst.serving or inst.leaving is not None:
                continue
            silent = now - inst.last_news_s
            if silent > self.settings.instance_heartbeat_timeout_s:
                inst.leaving = f"it sent no heartbeat for {silent:.1f} s"
                log.error("instance %d (pid %d) sent no heartbeat for %.1f s: hung; it is killed and restarted",
                          inst.index, inst.process.pid, silent)
                self._drop_outbox(inst, None)
                inst.process.kill()
            elif silent > STALE_S and not inst.stale_logged:
                inst.stale_logged = True
                log.warning("instance %d (pid %d) sent no heartbeat for %.1f s: it gets no new connections",
                            inst.index, inst.process.pid, silent)

    def _readiness_word(self) -> bytes:
        now = time.monotonic()
        down = []
        for index, inst in enumerate(self.instances):
            if inst is None or inst.exited:
                down.append(f"instance {index} is restarting")
            elif inst.leaving is not None:
                down.append(f"instance {index} is being replaced: {inst.leaving}")
            elif now - inst.last_news_s > STALE_S and inst.serving:
                down.append(f"instance {index} is not heard from")
            elif not inst.ready:
                down.append(f"instance {index} is " + ("not ready" if inst.serving else "starting"))
        if not down:
            return bytes([MSG_ALL_READY])
        reason = f"{self.count - len(down)} of {self.count} instances ready ({'; '.join(down)})"
        return bytes([MSG_SHORT]) + reason.replace("\n", " ").encode() + b"\n"

    def _publish_readiness(self) -> None:
        word = self._readiness_word()
        for inst in self._live():
            if inst.serving and inst.told != word:
                inst.told = word
                self._send(inst, word)

    def _weights_news(self) -> None:
        data = self._channel_data(self.weights_channel, 65536)
        if not data:
            return
        self.weights_news += data
        while b"\n" in self.weights_news:
            line, _, self.weights_news = self.weights_news.partition(b"\n")
            try:
                news = json.loads(line)
            except ValueError:
                continue
            if "loaded" in news:
                self.weights_loaded = loaded = news["loaded"]
                from .shared_weights import describe_bytes

                log.info("weights process (pid %d): the model is loaded once for the %d instances in %.1f s: %s "
                         "(device_bytes=%d host_bytes=%d)", self.weights.pid, self.count, loaded["seconds"],
                         describe_bytes(loaded["device"], loaded["device_bytes"], loaded["host_bytes"]),
                         loaded["device_bytes"], loaded["host_bytes"])
            elif "failed" in news and not self.stopping:
                log.error("weights process (pid %d) failed: %s: stopping the instances (the server exits 1)",
                          self.weights.pid, news["failed"])
                self.failed = True
                self.stop()

    def _weights_exited(self) -> None:
        process = self.weights
        self._unregister_weights()
        process.join()
        code = process.exitcode
        if self.stopping:
            if self._live():
                # every instance is stopping already; on a GPU their weights are gone now
                self._weights_lost(code)
            return
        self.failed = True
        if self.weights_loaded is None:
            log.error("weights process (pid %d) exited with status %s before the model was loaded: stopping the "
                      "instances (the server exits 1)", process.pid, code)
            self.stop()
            return
        log.error("weights process (pid %d) exited with status %s: the instances' shared weights are gone; the server "
                  "goes unready and exits 1", process.pid, code)
        self.stop()
        self._weights_lost(code)

    def _weights_lost(self, code) -> None:
        """The weights process is gone while instances run: on a GPU their device memory is not guaranteed any
        more, so they are killed at once; on the CPU the shared pages outlive it and they drain."""
        loaded = self.weights_loaded or {}
        if str(loaded.get("device", "cpu")).startswith("cpu"):
            return
        for inst in self._live():
            if inst.process.is_alive():
                log.error("instance %d (pid %d) is killed: its weights (the weights process's device memory) are gone",
                          inst.index, inst.process.pid)
                inst.process.kill()

    def _exited(self, inst: _Instance) -> None:
        for source in (inst.process.sentinel, inst.channel):
            try:
                self.selector.unregister(source)
            except (KeyError, ValueError):
                pass
        inst.process.join()
        inst.exited, inst.ready, inst.serving = True, False, False
        code = inst.process.exitcode
        # what it never took (still in its socket, or queued here) is intact: to the others
        self._drop_outbox(inst, "the server is shutting down" if self.stopping else None, untaken=True)
        inst.channel.close()
        try:
            from prometheus_client import multiprocess

            multiprocess.mark_process_dead(inst.process.pid)  # its live gauges leave /metrics
        except Exception:  # noqa: BLE001 - metrics must not stop the supervision
            pass
        if self.stopping:
            if code != 0:
                log.error("instance %d (pid %d) exited with status %s during the drain", inst.index,
                          inst.process.pid, code)
                self.failed = True
            else:
                log.info("instance %d (pid %d) drained and exited", inst.index, inst.process.pid)
            return
        why = inst.leaving or f"exited with status {code}"
        if code == _EXIT_LOAD_FAILED and not inst.was_ready and inst.leaving is None:
            log.error("instance %d (pid %d) exited with status %s before it was ready (its model could not be "
                      "loaded): stopping the other instances (the server exits 1)", inst.index, inst.process.pid, code)
            self.failed = True
            self.stop()
            return
        now = time.monotonic()
        history = self.restarts[inst.index]
        while history and now - history[0] > RESTART_WINDOW_S:
            history.popleft()
        if len(history) >= self.settings.instance_restarts:
            log.error("instance %d (pid %d) exited with status %s (%s), and it was restarted %d times in %.0f "
                      "minutes already: the server goes unready, stops the other instances and exits 1",
                      inst.index, inst.process.pid, code, why, len(history), RESTART_WINDOW_S / 60)
            self.failed = True
            self.stop()
            return
        history.append(now)
        log.error("instance %d (pid %d) exited with status %s (%s): restarting it (restart %d of at most %d in "
                  "%.0f minutes)", inst.index, inst.process.pid, code, why if code != EXIT_LEFT else "it left",
                  len(history), self.settings.instance_restarts, RESTART_WINDOW_S / 60)
        self.start(inst.index)


__all__ = ["serve_instances", "listen_socket", "STALE_S", "PENDING_MAX", "RESTART_WINDOW_S"]

"""Several serving processes ("model instances", Triton's instance_group count) behind one port.

``megamoe serve --instances N``: this process (the parent) binds and listens on the port once and
starts N instance processes (multiprocessing "spawn": fresh interpreters, each with its own CUDA
context). Every instance loads its own copy of the layer onto the device and runs the unchanged
service (:func:`megamoe.service.server.serve`: its own event loop, batcher, device thread, CUDA
graphs), so N event loops share the HTTP work that one loop alone cannot keep up with.

Connections: the parent accepts them and hands each one (its file descriptor, over a Unix socket
pair) to the instance with the fewest open connections among those that are ready; while none is
ready, to one that is serving but still loading (it answers liveness, and 503 for readiness and
infer, as a single process does while it loads); while none serves yet, connections wait in the
listen backlog. A request is never handed to an instance that is loading while another one is
ready, and an instance whose readiness turns 503 later (a failed periodic self-test, a device
error) gets no new connections. The parent handing connections out, rather than every instance
accepting on the shared socket, spreads a burst of connections evenly (an instance that wakes first
would otherwise accept all of them).

Messages from an instance to the parent, one byte each on its socket pair: ``R`` ready, ``N``
serving but not ready, ``C`` a connection closed.

Supervision: SIGTERM/SIGINT closes the listening socket, then every instance gets SIGTERM and drains
(requests in flight and those on open connections are answered, see server.py); the parent exits 0
once all of them exited 0. An instance that exits on its own (a failed model load, a crash, a
kill) makes the parent stop the others and exit 1, so that the container is restarted rather than
serving with fewer instances than configured.

Metrics: the parent points prometheus_client's multiprocess mode at a fresh directory
(``PROMETHEUS_MULTIPROC_DIR``, removed at exit); every instance writes its samples there and
``/metrics``, whichever instance answers it, reports counters and histograms summed over all
instances (gauges by their ``multiprocess_mode``, see metrics.py).
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import selectors
import shutil
import signal
import socket
import tempfile
import time

from .channel import MSG_CLOSED, MSG_NOT_READY, MSG_READY
from .settings import ServiceSettings

log = logging.getLogger("megamoe.service.instances")

#: accepted connections handed out per wake-up of the parent at most (then it reads the instances' news)
_ACCEPT_BURST = 64
#: an instance still running this long after the drain should have ended is killed
_KILL_AFTER_S = 10.0


class _Instance:
    def __init__(self, index: int, process, channel: socket.socket):
        self.index, self.process, self.channel = index, process, channel
        self.serving = self.ready = self.exited = False
        self.was_ready = False
        self.open = 0       # connections handed to it and not yet closed
        self.handed = 0     # connections handed to it in all
        self.started_s = time.monotonic()


def listen_socket(host: str, port: int, backlog: int = 2048) -> socket.socket:
    """The listening socket every instance's connections come from (bound once, here)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    return socket.create_server((host, port), family=family, backlog=backlog)


def _instance_main(settings: ServiceSettings, index: int, channel: socket.socket) -> None:
    """An instance process: the single-process service, fed connections by the parent."""
    import sys

    from .server import serve

    code = serve(settings, instance=(index, channel))
    # Drained. The JSON decoder process (a child of this one) is ended here: multiprocessing would
    # join it before the interpreter's exit hooks run, and one of those is what tells it to stop.
    for child in multiprocessing.active_children():
        child.terminate()
        child.join(5)
    sys.exit(code)


def serve_instances(settings: ServiceSettings) -> int:
    """Run ``settings.instances`` instance processes behind one listening socket until SIGTERM/SIGINT (0)
    or until one of them exits on its own (1)."""
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
    context = multiprocessing.get_context("spawn")
    instances: list[_Instance] = []
    try:
        for index in range(count):
            ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
            process = context.Process(target=_instance_main, args=(settings, index, theirs),
                                      name=f"megamoe-instance-{index}")
            process.start()
            theirs.close()
            instances.append(_Instance(index, process, ours))
            log.info("instance %d of %d (pid %d): loading the model", index, count, process.pid)
        log.info("listening on http://%s:%d for %d instances (each holds its own copy of the weights)",
                 host, port, count)
        return _Supervisor(listener, instances, settings, signals).run()
    finally:
        listener.close()
        for inst in instances:
            if inst.process.is_alive():
                inst.process.kill()
            inst.process.join(5)
            inst.channel.close()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        shutil.rmtree(metrics_dir, ignore_errors=True)


class _Supervisor:
    def __init__(self, listener: socket.socket, instances: list[_Instance], settings: ServiceSettings,
                 signals: list[int]):
        self.listener, self.instances, self.settings, self.signals = listener, instances, settings, signals
        self.selector = selectors.DefaultSelector()
        self.accepting = False
        self.stopping = False
        self.failed = False
        self.deadline: float | None = None
        self.all_ready_logged = False
        for inst in instances:
            self.selector.register(inst.channel, selectors.EVENT_READ, ("news", inst))
            self.selector.register(inst.process.sentinel, selectors.EVENT_READ, ("exit", inst))

    # --- the loop ---------------------------------------------------------------------

    def run(self) -> int:
        while not all(inst.exited for inst in self.instances):
            if self.signals and not self.stopping:
                log.info("signal %d: every instance drains, then the server exits",
                         self.signals[0])
                self.stop()
            self._set_accepting(not self.stopping and any(i.serving for i in self.instances if not i.exited))
            for key, _ in self.selector.select(timeout=0.25):
                what, inst = key.data
                if what == "accept":
                    self._accept()
                elif what == "news":
                    self._news(inst)
                else:
                    self._exited(inst)
            if self.deadline is not None and time.monotonic() > self.deadline:
                for inst in self.instances:
                    if not inst.exited and inst.process.is_alive():
                        log.error("instance %d (pid %d) did not finish its drain in time: killed",
                                  inst.index, inst.process.pid)
                        inst.process.kill()
                self.failed = True
                self.deadline = None
        return 1 if self.failed else 0

    def stop(self) -> None:
        """Close the listening socket (new connections are refused), then every instance drains."""
        self.stopping = True
        self._set_accepting(False)
        self.listener.close()
        for inst in self.instances:
            if not inst.exited and inst.process.is_alive():
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

    # --- events -------------------------------------------------------------------------

    def _target(self) -> _Instance | None:
        live = [i for i in self.instances if not i.exited and i.serving]
        ready = [i for i in live if i.ready]
        pool = ready or live
        return min(pool, key=lambda i: (i.open, i.handed)) if pool else None

    def _accept(self) -> None:
        for _ in range(_ACCEPT_BURST):
            target = self._target()
            if target is None:
                return
            try:
                conn, _ = self.listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:  # out of file descriptors, say: the connection stays in the backlog
                log.warning("accept failed: %s", exc)
                return
            try:
                socket.send_fds(target.channel, [b"c"], [conn.fileno()])
                target.open += 1
                target.handed += 1
            except OSError as exc:  # the instance is going away: the client sees its connection close
                log.warning("could not hand a connection to instance %d: %s", target.index, exc)
            finally:
                conn.close()

    def _news(self, inst: _Instance) -> None:
        try:
            data = inst.channel.recv(4096)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:
            self.selector.unregister(inst.channel)  # its exit comes through the sentinel
            return
        for byte in data:
            if byte == MSG_CLOSED:
                inst.open = max(0, inst.open - 1)
            elif byte in (MSG_READY, MSG_NOT_READY):
                ready = byte == MSG_READY
                if not inst.serving:
                    inst.serving = True
                if ready and not inst.was_ready:
                    log.info("instance %d of %d (pid %d): ready after %.1f s", inst.index, len(self.instances),
                             inst.process.pid, time.monotonic() - inst.started_s)
                elif not ready and inst.ready and not self.stopping:
                    log.warning("instance %d (pid %d) reports not ready: it gets no new connections while "
                                "another instance is ready", inst.index, inst.process.pid)
                inst.ready = ready
                inst.was_ready |= ready
        if not self.all_ready_logged and all(i.ready for i in self.instances):
            self.all_ready_logged = True
            log.info("all %d instances ready", len(self.instances))

    def _exited(self, inst: _Instance) -> None:
        self.selector.unregister(inst.process.sentinel)
        inst.process.join()
        inst.exited, inst.ready, inst.serving = True, False, False
        code = inst.process.exitcode
        try:
            from prometheus_client import multiprocess

            multiprocess.mark_process_dead(inst.process.pid)  # its live gauges leave /metrics
        except Exception:  # noqa: BLE001 - metrics must not stop the supervision
            pass
        if not self.stopping:
            log.error("instance %d (pid %d) exited with status %s: stopping the other instances (the server "
                      "exits 1)", inst.index, inst.process.pid, code)
            self.failed = True
            self.stop()
        elif code != 0:
            log.error("instance %d (pid %d) exited with status %s during the drain", inst.index,
                      inst.process.pid, code)
            self.failed = True
        else:
            log.info("instance %d (pid %d) drained and exited", inst.index, inst.process.pid)


__all__ = ["serve_instances", "listen_socket"]

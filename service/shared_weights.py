"""One copy of the layer's weights for all the instances of a server (``--instances N``, ``--share-weights``).

The weights process, started and supervised by the parent (service/instances.py), loads the layer and
prepares it for the backend once, then keeps it: the device tensors of the prepared layer, the dense
weights (router, shared expert) with the float32 copies of them that the forward's GEMMs read, and the
tables. Each instance connects to it over a Unix socket and
receives the layer through torch.multiprocessing's sharing: CUDA tensors as CUDA IPC handles (the
instance maps the same device memory), host tensors as shared-memory files (on the CPU, the instance
maps the same pages). The instance then builds its layer with :meth:`megamoe.moe.MoELayer.from_prepared`
and its own backend (workspaces, CUDA graphs, pinned buffers stay per instance).

Why a process of its own rather than instance 0: torch's rule for shared CUDA memory is that the process
that allocated it stays alive while others use it. An instance is restarted when it fails (a crash, a hang,
a device error); a dedicated process that runs no requests, no kernels after the preparation and no health
checks does not fail that way, and an instance restarted beside it maps the same memory again. The price is
one more CUDA context on the device (a few hundred MiB), against one copy of the weights per extra instance.

Lifetime: the weights process ignores SIGINT and SIGTERM (a Ctrl-C reaches every process of the
terminal's group, and the instances may still be draining); it leaves once the parent is gone (its channel
closed) and no instance holds its connection any more: an instance keeps that connection open for as long as
it lives, so the memory it maps outlives it. If the weights process dies anyway, the parent stops the server
(service/instances.py).

The shared tensors are only read, and on the CPU an instance maps them read-only (``mprotect``): a write
into the one copy would fault in that instance (which is then restarted) rather than change the weights of
every instance. (CUDA IPC has no read-only mapping.) Nothing writes them: the kernels read weights, the health checks run on data of their own
(megamoe.health builds its inputs and weights itself, never the served layer's), and fault-injecting
backends (``--backend module:factory`` wrapping megamoe.faults) change how a backend computes, never a
tensor of the layer.

What an instance's layer does not get: the host copy of the routed experts that a CUDA layer keeps beside
the backend's own device layout (``Backend.copies_routed_weights``, read only by
``MoELayer.reference_bf16``, which the service never calls): the instance's layer holds meta-device
placeholders of the same shapes instead, so N instances do not hold N host copies either.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import selectors
import signal
import socket
import sys
import time

from .channel import recv_ready

log = logging.getLogger("megamoe.service.weights")

#: the exit status of a weights process whose layer could not be loaded
EXIT_LOAD_FAILED = 1
#: where torch keeps the shared-memory files of shared host tensors (file_descriptor strategy)
SHM_DIR = "/dev/shm"


@dataclasses.dataclass
class SharedLayer:
    """What the weights process sends an instance: enough for ``MoELayer.from_prepared``."""

    weights: object        # MoEWeights
    config: object         # MoEConfig
    prepared: object       # what the backend's prepare_weights returned
    float32: dict          # the float32 copies of the dense weights (MoELayer.dense_float32)
    load_report: object | None
    device: str
    device_bytes: int      # bytes of the shared tensors on the device
    host_bytes: int        # bytes of the shared tensors in host (shared) memory


def iter_tensors(obj, _seen: set | None = None):
    """Every torch tensor reachable from ``obj`` through dataclass fields, attributes, dicts, lists and tuples."""
    import torch

    seen = set() if _seen is None else _seen
    if id(obj) in seen or obj is None or isinstance(obj, (str, bytes, int, float, bool, torch.device, torch.dtype)):
        return
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for value in obj.values():
            yield from iter_tensors(value, seen)
    elif isinstance(obj, (list, tuple, set, frozenset)):
        for value in obj:
            yield from iter_tensors(value, seen)
    elif hasattr(obj, "__dict__"):
        for value in vars(obj).values():
            yield from iter_tensors(value, seen)


def storage_bytes(tensors) -> dict[str, int]:
    """Bytes of the distinct storages behind ``tensors``, by device type (a storage shared by several
    views counts once; meta tensors hold none)."""
    totals: dict[str, int] = {}
    seen = set()
    for t in tensors:
        if t.device.type == "meta":
            continue
        storage = t.untyped_storage()
        key = (t.device.type, t.device.index, storage.data_ptr())
        if key in seen or storage.nbytes() == 0:
            continue
        seen.add(key)
        totals[t.device.type] = totals.get(t.device.type, 0) + storage.nbytes()
    return totals


def _placeholder(q):
    """An NVFP4 tensor of the same shapes with no memory (the meta device)."""
    from megamoe import nvfp4

    return nvfp4.NVFP4Tensor(q.data.to("meta"), q.scale.to("meta"), q.global_scale.to("meta"))


def package_layer(layer) -> SharedLayer:
    """The layer as the instances receive it. A CUDA layer's host copy of the routed experts (see the module
    doc) becomes meta placeholders; every host tensor left is moved to shared memory here, once (after a
    check that ``SHM_DIR`` has room for it: a container's default /dev/shm is 64 MiB)."""
    weights = layer.weights
    if layer.device.type != "cpu" and getattr(layer.backend, "copies_routed_weights", False):
        weights = dataclasses.replace(weights, w13=_placeholder(weights.w13) if weights.w13.device.type == "cpu"
                                      else weights.w13,
                                      w2=_placeholder(weights.w2) if weights.w2.device.type == "cpu" else weights.w2)
    package = SharedLayer(weights=weights, config=layer.config, prepared=layer._prepared,
                          float32=layer.dense_float32(), load_report=getattr(layer, "load_report", None),
                          device=str(layer.device), device_bytes=0, host_bytes=0)
    tensors = list(iter_tensors((package.weights, package.prepared, package.float32)))
    totals = storage_bytes(tensors)
    host = totals.pop("cpu", 0)
    if host:
        try:
            stat = os.statvfs(SHM_DIR)
            free = stat.f_bavail * stat.f_frsize
        except OSError:
            free = None
        if free is not None and host > free:
            raise RuntimeError(
                f"the shared weights need {host / 2**20:.0f} MiB of shared memory ({SHM_DIR}), which has "
                f"{free / 2**20:.0f} MiB free: give the container more (docker run --shm-size, compose shm_size) "
                f"or serve with --no-share-weights (each instance then loads its own copy)")
        for t in tensors:
            if t.device.type == "cpu" and not t.is_shared():
                t.share_memory_()
    package.device_bytes = sum(totals.values())
    package.host_bytes = host
    return package


# --- the weights process ---------------------------------------------------------------------------


def _return_freed_memory() -> None:
    """Give the host memory freed after loading (the loader's temporaries, the tensors moved to shared
    memory) back to the system: glibc keeps freed heap pages otherwise, and this process lives as long as
    the server."""
    import ctypes
    import gc

    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass  # not glibc: nothing to do


def _tell(channel: socket.socket, message: dict) -> None:
    try:
        channel.sendall(json.dumps(message).encode() + b"\n")
    except OSError:
        pass  # the parent is gone: noticed on the channel


def holder_main(settings, listener: socket.socket, channel: socket.socket) -> None:
    """The weights process: load and prepare the layer once, then hand it to every instance that connects
    on ``listener`` until the parent is gone (``channel`` closed) and no instance is connected."""
    from .settings import configure_logging

    signal.signal(signal.SIGINT, signal.SIG_IGN)   # see the module doc: the parent decides when it ends
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    configure_logging(settings, "weights")
    started = time.monotonic()
    try:
        import torch
        import torch.multiprocessing  # noqa: F401 - registers torch's tensor sharing with multiprocessing's pickler

        from .model import load_layer

        layer = load_layer(settings)
        if layer.device.type == "cuda":
            torch.cuda.synchronize(layer.device)
        package = package_layer(layer)
        cuda = layer.device.type == "cuda"
        del layer  # what the instances do not receive (a CUDA layer's host copy of the experts) is freed
        _return_freed_memory()
        if cuda:
            torch.cuda.empty_cache()  # the preparation's temporaries: the device keeps only the shared tensors
    except Exception as exc:  # noqa: BLE001 - reported to the parent, which stops the server
        log.error("the model cannot be loaded: %s: %s", type(exc).__name__, exc)
        log.debug("traceback", exc_info=exc)
        _tell(channel, {"failed": f"{type(exc).__name__}: {exc}"})
        sys.exit(EXIT_LOAD_FAILED)
    _tell(channel, {"loaded": {"device": package.device, "device_bytes": package.device_bytes,
                               "host_bytes": package.host_bytes, "seconds": round(time.monotonic() - started, 1)}})
    _serve_package(package, listener, channel)
    sys.exit(0)


def _serve_package(package: SharedLayer, listener: socket.socket, channel: socket.socket) -> None:
    from multiprocessing.connection import Connection

    selector = selectors.DefaultSelector()
    listener.setblocking(False)
    selector.register(listener, selectors.EVENT_READ, "accept")
    selector.register(channel, selectors.EVENT_READ, "parent")
    consumers: dict[int, Connection] = {}
    parent_gone = False
    while not (parent_gone and not consumers):
        for key, _ in selector.select(timeout=1.0):
            if key.data == "accept":
                try:
                    sock, _ = listener.accept()
                except (BlockingIOError, InterruptedError):
                    continue
                sock.setblocking(True)
                conn = Connection(sock.detach())
                try:
                    conn.send(("layer", package))
                except Exception as exc:  # noqa: BLE001 - a prepared layer that cannot be pickled, a gone instance
                    if isinstance(exc, OSError):
                        conn.close()
                        continue
                    why = (f"the prepared layer cannot be shared with the instances ({type(exc).__name__}: {exc}): "
                           f"serve with --no-share-weights")
                    log.error("%s", why)
                    _try_send(conn, ("error", why))
                    conn.close()
                    _tell(channel, {"failed": why})
                    sys.exit(EXIT_LOAD_FAILED)
                consumers[conn.fileno()] = conn
                selector.register(conn.fileno(), selectors.EVENT_READ, "consumer")
            elif key.data == "consumer":
                conn = consumers.pop(key.fd)
                selector.unregister(key.fd)
                conn.close()  # the instance is gone (its connection closed): it maps nothing any more
            else:
                data = recv_ready(channel, 4096)
                if data is None:
                    continue
                if not data:
                    parent_gone = True
                    selector.unregister(channel)
                    selector.unregister(listener)
                    listener.close()


def _try_send(conn, message) -> None:
    try:
        conn.send(message)
    except Exception:  # noqa: BLE001 - best effort: the instance fails on a closed connection too
        pass


def describe_bytes(device: str, device_bytes: int, host_bytes: int) -> str:
    """"3712.5 MiB on cuda:0", "219.1 MiB of shared host memory", or both."""
    parts = []
    if device_bytes or not device.startswith("cpu"):
        parts.append(f"{device_bytes / 2**20:.1f} MiB on {device}")
    if host_bytes or device.startswith("cpu"):
        parts.append(f"{host_bytes / 2**20:.1f} MiB of shared host memory")
    return " and ".join(parts)


def protect_read_only(tensors) -> int:
    """Map the pages of the shared host tensors among ``tensors`` read-only in this process; returns the bytes
    protected. Only storages that start on a page (a shared-memory file's mapping) are touched."""
    import ctypes
    import mmap

    libc = ctypes.CDLL(None, use_errno=True)
    libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    page = mmap.PAGESIZE
    done, protected = set(), 0
    for t in tensors:
        if t.device.type != "cpu" or not t.is_shared():
            continue
        storage = t.untyped_storage()
        ptr, size = storage.data_ptr(), storage.nbytes()
        if not size or ptr in done or ptr % page:
            continue
        done.add(ptr)
        length = size + (-size) % page
        if libc.mprotect(ctypes.c_void_p(ptr), length, mmap.PROT_READ) != 0:
            errno = ctypes.get_errno()
            raise OSError(errno, f"mprotect of a shared weight ({size} bytes): {os.strerror(errno)}")
        protected += size
    return protected


# --- in an instance ---------------------------------------------------------------------------------


class SharedLayerLoader:
    """An instance's way to its layer: the weights process's (``path``: its Unix socket). Called with the
    settings on the device thread, as ``load_layer`` is; waits while the weights process loads."""

    def __init__(self, path: str):
        self.path = path
        #: the connection to the weights process, open for as long as this process lives (see the module doc)
        self.connection = None

    def __call__(self, settings):
        import torch.multiprocessing  # noqa: F401 - the rebuild side of torch's tensor sharing
        from multiprocessing.connection import Connection

        from megamoe.moe import MoELayer

        from .model import resolve_backend

        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.connect(self.path)
        except OSError as exc:
            sock.close()
            raise RuntimeError(f"the weights process cannot be reached at {self.path}: {exc}") from exc
        conn = Connection(sock.detach())
        try:
            kind, payload = conn.recv()
        except EOFError:
            conn.close()
            raise RuntimeError("the weights process ended before it sent the layer (see its log lines)") from None
        if kind != "layer":
            conn.close()
            raise RuntimeError(str(payload))
        layer = MoELayer.from_prepared(payload.weights, payload.config, payload.prepared,
                                       backend=resolve_backend(settings.backend), device=settings.device,
                                       float32=payload.float32)
        layer.batch_invariant = settings.batch_invariant
        if payload.load_report is not None:
            layer.load_report = payload.load_report
        layer.shared_weights = {"device_bytes": payload.device_bytes, "host_bytes": payload.host_bytes}
        protect_read_only(iter_tensors((payload.weights, payload.prepared, payload.float32)))
        self.connection = conn
        log.info("layer mapped from the weights process, not copied: %s", describe_bytes(payload.device,
                                                                                        payload.device_bytes,
                                                                                        payload.host_bytes))
        return layer


__all__ = ["SharedLayer", "SharedLayerLoader", "holder_main", "package_layer", "iter_tensors", "storage_bytes",
           "protect_read_only", "EXIT_LOAD_FAILED"]

"""The batch runner: one forward of a batch of validated requests on the device.

It owns what the device work needs beside the model: the pinned host pool that request bodies and
staged rows live in, the CUDA graphs of bucketed batch sizes, and the copies to and from the device.
:class:`megamoe.service.model.ServedModel` is only the model (metadata, validation); the batcher
(service/batching.py) calls :meth:`BatchRunner.launch_batch` on the device thread and
:meth:`BatchRunner.finish_batch` in its completion thread.

launch_batch (device thread): stack the requests' rows, copy them to the device, enqueue the forward
and the copy back; on a CUDA device nothing waits for the device, so the next batch is gathered and
staged while this one runs. finish_batch (any thread): wait for the copy back, split the rows per
request. Stage times (stage, h2d, compute, d2h) are device-event times on CUDA, host times on the CPU.
"""

from __future__ import annotations

import inspect
import logging
import sys
import time
import weakref
from dataclasses import dataclass

import numpy as np
import torch

from .model import ModelRequest, ServedModel, nonfinite_errors
from .protocol import BODY_ALIGN, aligned_body

log = logging.getLogger("megamoe.service.runner")


class BatchRunner:
    """The batched forward of a :class:`ServedModel` on its layer's device."""

    def __init__(self, model: ServedModel):
        self.model = model
        self.layer = model.layer
        self.config = model.config
        self.device = model.device
        # validate() has checked every request already; the layer's own check of topk_ids
        # would cost a device sync per batch, so it is skipped where the layer allows it
        params = inspect.signature(self.layer.forward).parameters
        self._forward_kwargs = {"validate": False} if "validate" in params else {}
        self._graphs: dict[tuple, _Graph | None] = {}
        self._pad_ids: dict[int, torch.Tensor] = {}
        self._pinned = PinnedPool()
        if self.device.type == "cuda":
            # The device thread's batch is ~25 short torch calls, each releasing the interpreter
            # lock; with the event loop busy (many connections), taking it back waits up to the
            # switch interval (default 5 ms) each time. A shorter interval keeps the device fed.
            sys.setswitchinterval(min(sys.getswitchinterval(), SWITCH_INTERVAL_S))

    @property
    def backend_name(self) -> str:
        return self.model.backend_name

    def body_buffer(self, declared: int, header_length: int) -> memoryview:
        """A request body's buffer (see ServiceState.body_buffer). On a CUDA device it is pinned host
        memory from the pool (blocks are reused, not allocated per request): the request's rows go to
        the device straight from it, without a staging copy. The tensors decoded from it keep it
        alive; launch_batch keeps them until the device has read them."""
        if self.device.type != "cuda":
            return aligned_body(declared, header_length)
        return aligned_body(declared, header_length, self._pinned.take(declared + BODY_ALIGN))

    # launch_batch (device thread): stack the requests' rows, copy them to the device, enqueue
    # the forward and the copy back; on a CUDA device nothing waits for the device, so the
    # next batch is gathered and staged while this one runs. finish_batch (any thread): wait
    # for the copy back, split the rows per request. Stage times (stage, h2d, compute, d2h) are
    # device-event times on CUDA, host times on the CPU.

    def forward_batch(self, requests: list[ModelRequest]) -> list[torch.Tensor]:
        """One forward over the requests' rows stacked; each caller gets back exactly its own rows (CPU)."""
        return self.finish_batch(self.launch_batch(requests))[0]

    def launch_batch(self, requests: list[ModelRequest]) -> "_Launched":
        started = time.perf_counter()
        sizes = [r.tokens for r in requests]
        if self.device.type != "cuda":
            with torch.inference_mode():
                hidden, ids, weights, logits, token_ids = self._stacked(requests)
                out = self.layer.forward(hidden, ids, weights, logits, **self._forward_kwargs,
                                         **({"input_ids": token_ids} if token_ids is not None else {}))
            done = time.perf_counter()
            return _Launched(out, sizes, None, {"compute": done - started})
        return self._launch_cuda(requests, sizes, started)

    def finish_batch(self, launched: "_Launched") -> tuple[list, dict[str, float]]:
        """Each request's output rows, or the ProtocolError (400) of a request whose hidden_states the
        device found non-finite (its rows ran with the others: rows are independent, docs/FIELD_BUGS.md
        row 6, so the other requests' results are what they would be without it)."""
        stages = dict(launched.stages)
        errors = {}
        if launched.events is not None:
            start, h2d, compute, d2h = launched.events
            d2h.synchronize()
            if launched.finite is not None:
                errors = nonfinite_errors(launched.requests, launched.sizes, launched.finite)
            launched.keep = launched.requests = None  # the device has read the inputs: their buffers may be reused
            stages.update(h2d=start.elapsed_time(h2d) / 1e3, compute=h2d.elapsed_time(compute) / 1e3,
                          d2h=compute.elapsed_time(d2h) / 1e3)
        outputs = list(launched.output.split(launched.sizes))
        for index, error in errors.items():
            outputs[index] = error
        return outputs, stages

    def _stacked(self, requests: list[ModelRequest]):
        def stacked(attr):
            parts = [getattr(r, attr) for r in requests]
            if parts[0] is None:
                return None
            return parts[0] if len(parts) == 1 else torch.cat(parts)

        hidden = stacked("hidden_states")
        return hidden, stacked("topk_ids"), stacked("topk_weights"), stacked("router_logits"), stacked("input_ids")

    def _launch_cuda(self, requests: list[ModelRequest], sizes: list[int], started: float) -> "_Launched":
        tokens = sum(sizes)
        head = requests[0]
        key = (head.mode, head.hidden_states.dtype)
        # (token ids route a hash layer on the device: not captured in the bucketed graphs)
        graph = self._graph_for(key, tokens) if head.input_ids is None else None
        rows = graph.rows if graph is not None else tokens
        names = ROUTING_INPUTS.get(head.mode, ()) + ("hidden_states",)
        # Large batches: each request's rows go to the device straight from its body (pinned host
        # memory, see body_buffer), one copy per request and input. Small ones: their rows are first
        # stacked into one pooled pinned buffer per input, with numpy (few torch calls, few copies).
        direct = tokens >= DIRECT_COPY_ROWS
        host = {}
        if not direct:
            # numpy copies into pooled pinned memory: no torch call (each one hands the interpreter
            # lock to the busy event loop and waits to get it back) until the copy to the device
            for name in names:
                parts = [_as_numpy(getattr(r, name)) for r in requests]
                dtype, width = parts[0].dtype, parts[0].shape[1]
                staged_np = self._pinned.take(rows * width * dtype.itemsize).view(dtype).reshape(rows, width)
                np.concatenate(parts, out=staged_np[:tokens])
                if rows > tokens:
                    _fill_padding(name, staged_np[tokens:], self.config)
                staged_t = torch.from_numpy(staged_np)
                host[name] = staged_t.view(torch.bfloat16) if getattr(head, name).dtype == torch.bfloat16 else staged_t
        staged = time.perf_counter()
        events = tuple(torch.cuda.Event(enable_timing=True) for _ in range(4))
        events[0].record()
        with torch.inference_mode():
            if graph is not None:
                dev = graph.inputs
            elif direct:
                dev = {name: torch.empty((rows, getattr(head, name).shape[1]), dtype=getattr(head, name).dtype,
                                         device=self.device) for name in names}
            else:
                dev = {name: buf.to(self.device, non_blocking=True) for name, buf in host.items()}
            if direct:
                for name in names:
                    target, offset = dev[name], 0
                    for request, n in zip(requests, sizes):
                        target[offset:offset + n].copy_(getattr(request, name), non_blocking=True)
                        offset += n
                    if rows > tokens:
                        self._pad_on_device(name, target[tokens:])
            elif graph is not None:
                for name, buf in host.items():
                    graph.inputs[name].copy_(buf, non_blocking=True)
            events[1].record()
            finite = None
            if any(r.finite_on_device for r in requests):
                # one flag per row, in the stream after the copy; read back with the output
                rows_ok = torch.isfinite(dev["hidden_states"][:tokens]).all(dim=1)
                finite = torch.empty(tokens, dtype=torch.bool, pin_memory=True)
                finite.copy_(rows_ok, non_blocking=True)
            if graph is not None:
                graph.graph.replay()
                out_dev = graph.output
            else:
                extra = {}
                if head.input_ids is not None:  # [T] int64, small: one host concat and copy
                    token_ids = torch.cat([r.input_ids for r in requests]) if len(requests) > 1 else head.input_ids
                    extra["input_ids"] = token_ids.to(self.device, non_blocking=False)
                out_dev = self.layer.forward(dev["hidden_states"], topk_ids=dev.get("topk_ids"),
                                             topk_weights=dev.get("topk_weights"),
                                             router_logits=dev.get("router_logits"), **self._forward_kwargs, **extra)
            events[2].record()
            out = torch.empty((tokens, out_dev.shape[1]), dtype=out_dev.dtype, pin_memory=True)
            out.copy_(out_dev[:tokens], non_blocking=True)
            events[3].record()
        # the requests' bodies (and the staging buffers) stay alive until the device has read them
        return _Launched(out, sizes, events, {"stage": staged - started}, keep=host, requests=requests, finite=finite)

    def _pad_on_device(self, name: str, rows: torch.Tensor) -> None:
        """The padding rows of a graph bucket, filled on the device (as _fill_padding does on the host)."""
        if name != "topk_ids":
            rows.zero_()
            return
        n = rows.shape[0]
        pattern = self._pad_ids.get(n)
        if pattern is None:
            pattern = np.empty((n, self.config.top_k), dtype=np.int32)
            _fill_padding(name, pattern, self.config)
            pattern = self._pad_ids[n] = torch.from_numpy(pattern).to(self.device)
        rows.copy_(pattern)

    # --- CUDA graphs for bucketed batch sizes ------------------------------------------
    #
    # A batch of T tokens runs in the graph captured for the smallest bucket >= T (powers of
    # two up to GRAPH_MAX_TOKENS), the extra rows padded (zero hidden states, zero top-k weights,
    # ids spread over the experts: rows are independent, the padding rows are dropped). A
    # bucket is captured on first use, after a replay of random inputs matched the eager forward
    # bit for bit; a capture that fails or does not match leaves that key eager for good.

    GRAPH_MAX_TOKENS = 256

    def _graphs_supported(self) -> bool:
        return self.device.type == "cuda" and self.backend_name in GRAPH_BACKENDS

    def _graph_for(self, key: tuple, tokens: int):
        if tokens > self.GRAPH_MAX_TOKENS or key[0] not in GRAPH_MODES or not self._graphs_supported():
            return None
        rows = 1 << max(0, (tokens - 1).bit_length())
        gkey = (*key, rows)
        if gkey not in self._graphs:
            self._graphs[gkey] = self._capture(key[0], key[1], rows)
        return self._graphs[gkey]

    def _capture(self, mode: str, dtype: torch.dtype, rows: int):
        cfg = self.config
        device = self.device
        gen = torch.Generator(device="cpu").manual_seed(rows)
        inputs = {"hidden_states": torch.zeros((rows, cfg.hidden_size), dtype=dtype, device=device)}
        if mode == "topk":
            inputs["topk_ids"] = torch.zeros((rows, cfg.top_k), dtype=torch.int32, device=device)
            inputs["topk_weights"] = torch.zeros((rows, cfg.top_k), dtype=torch.float32, device=device)

        def forward():
            return self.layer.forward(inputs["hidden_states"], topk_ids=inputs.get("topk_ids"),
                                      topk_weights=inputs.get("topk_weights"), validate=False)

        def fill_random():
            inputs["hidden_states"].copy_(torch.randn((rows, cfg.hidden_size), generator=gen).to(dtype))
            if mode == "topk":
                ids = torch.stack([torch.randperm(cfg.num_experts, generator=gen)[: cfg.top_k] for _ in range(rows)])
                inputs["topk_ids"].copy_(ids.int())
                inputs["topk_weights"].copy_(torch.rand((rows, cfg.top_k), generator=gen))

        try:
            torch.cuda.synchronize(device)  # nothing of an earlier batch in flight while capturing
            with torch.inference_mode():
                fill_random()
                stream = torch.cuda.Stream(device)
                stream.wait_stream(torch.cuda.current_stream(device))
                with torch.cuda.stream(stream):
                    forward()  # warm-up on the capture stream: workspaces, plans, lazy set-up
                torch.cuda.current_stream(device).wait_stream(stream)
                graph = torch.cuda.CUDAGraph()
                # thread_local: the completion thread may wait on an earlier batch's event meanwhile
                with torch.cuda.graph(graph, capture_error_mode="thread_local"):
                    output = forward()
                fill_random()
                graph.replay()
                eager = forward()
                torch.cuda.synchronize(device)
                if not torch.equal(output, eager):
                    log.warning("CUDA graph of %s/%s T=%d differs from the eager forward: that batch size stays eager",
                                mode, dtype, rows)
                    return None
        except Exception as exc:  # noqa: BLE001 - a forward that cannot be captured runs eagerly
            log.warning("CUDA graph capture of %s/%s T=%d failed (%s: %s): that batch size stays eager",
                        mode, dtype, rows, type(exc).__name__, exc)
            torch.cuda.synchronize(device)
            return None
        log.info("CUDA graph captured: %s/%s T=%d (replay matches the eager forward bit for bit)", mode, dtype, rows)
        return _Graph(graph, inputs, output, rows)


#: a CUDA batch of this many tokens or more copies each request's rows to the device from its body
DIRECT_COPY_ROWS = 64
#: interpreter switch interval while serving on a CUDA device (see BatchRunner.__init__)
SWITCH_INTERVAL_S = 0.0005
#: inputs staged per routing mode (besides hidden_states)
ROUTING_INPUTS = {"topk": ("topk_ids", "topk_weights"), "logits": ("router_logits",), "router": ()}
GRAPH_MODES = ("topk", "router")
GRAPH_BACKENDS = ("cuda-sm90",)


def _pinned_block(nbytes: int) -> np.ndarray:
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True).numpy()


def _release_pinned() -> None:
    """Give torch's cached, unused pinned host blocks back to the system (torch keeps them otherwise)."""
    empty = getattr(torch._C, "_host_emptyCache", None)
    if empty is not None:
        empty()


class _Lease(np.ndarray):
    """A view of a pooled block (see PinnedPool.take)."""


class PinnedPool:
    """Pinned host memory blocks (power-of-two sizes from 64 KiB), reused without a torch call:
    :meth:`take` hands out a numpy view of a free block (allocating one only when none is free),
    and the block is free again once that view and everything made from it (memoryviews, tensors)
    are gone. Taken from the event loop (request bodies) and the device thread (staging)."""

    MIN_BYTES = 64 * 1024
    #: free blocks kept for reuse, in bytes at most: a block given back beyond it is released
    MAX_POOLED_BYTES = 1 << 30

    def __init__(self, allocate=None, max_pooled_bytes: int | None = None, release=None) -> None:
        """``allocate(nbytes)``: a new block as a uint8 numpy array (default: pinned host memory);
        ``release()``: called after a block was let go (default: torch's host cache emptied, so that
        pinned memory goes back to the system)."""
        self._free: dict[int, list] = {}
        self._allocate = allocate or _pinned_block
        self._release = release if release is not None else (_release_pinned if allocate is None else None)
        self.max_pooled_bytes = self.MAX_POOLED_BYTES if max_pooled_bytes is None else max_pooled_bytes
        self._pooled = 0
        self._released = False

    def take(self, nbytes: int) -> np.ndarray:
        size = max(self.MIN_BYTES, 1 << max(0, nbytes - 1).bit_length())
        free = self._free.setdefault(size, [])
        if self._released and self._release is not None:
            self._released = False
            self._release()  # the blocks let go since the last call: back to the system
        try:
            block = free.pop()
        except IndexError:
            block = self._allocate(size)
        else:
            self._pooled -= size
        # a subclass view: numpy points every view made from it at it (not past it, at the block),
        # so it lives exactly as long as anything that uses its memory
        view = block[:nbytes].view(_Lease)
        weakref.finalize(view, self._give_back, size, block)
        return view

    def _give_back(self, size: int, block) -> None:
        if self._pooled + size <= self.max_pooled_bytes:
            self._free[size].append(block)
            self._pooled += size
            return
        self._released = True  # beyond the cap: let go (pinned memory is locked memory), returned at the next take

    @property
    def pooled_bytes(self) -> int:
        return sum(size * len(blocks) for size, blocks in self._free.items())


def _as_numpy(tensor: torch.Tensor) -> np.ndarray:
    """A host tensor's memory as numpy (bfloat16, which numpy lacks, as its int16 bit patterns)."""
    return (tensor.view(torch.int16) if tensor.dtype == torch.bfloat16 else tensor).numpy()


def _fill_padding(name: str, rows: np.ndarray, cfg) -> None:
    """Padding rows of a graph bucket: contribute nothing to real rows (rows are independent)."""
    if name == "topk_ids":
        # distinct valid experts per row, spread round-robin so no expert gets all the padding
        n = rows.shape[0]
        rows[...] = (np.arange(n * cfg.top_k).reshape(n, cfg.top_k) % cfg.num_experts).astype(rows.dtype)
    else:
        rows.fill(0)


@dataclass
class _Launched:
    output: torch.Tensor          # [sum(sizes), H] on the host (pinned on CUDA)
    sizes: list[int]
    events: tuple | None          # CUDA: start, after h2d, after compute, after d2h
    stages: dict[str, float]
    keep: object = None           # CUDA: the staging buffers the device reads from until the batch is done
    requests: list | None = None  # CUDA: the batch's requests (the device reads their tensors too; named in errors)
    finite: torch.Tensor | None = None  # CUDA: per row, hidden_states finite (host, valid after d2h)


@dataclass
class _Graph:
    graph: "torch.cuda.CUDAGraph"
    inputs: dict[str, torch.Tensor]
    output: torch.Tensor
    rows: int

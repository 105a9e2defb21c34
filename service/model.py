"""The served MoE model: loading, v2 metadata, and validation of one request's tensors.

Validation happens here, before a request joins a batch, so a bad request is
answered 400 and never reaches the device or anyone else's batch; the one exception is
below.

NaN/Inf policy: rejected with 400, the error naming where. Callers share a batch, and so the
kernels' buffers: a NaN that reached a shared scale or padding row would corrupt other callers'
rows (docs/FIELD_BUGS.md row 6). The exception: on a CUDA device the hidden_states of a request of
DEVICE_FINITE_MIN_ROWS rows or more are checked on the device, one flag per row in the batch's
stream after the copy there (a host pass over them cost the event loop ~1.3 ms per T=512
request). Such a request's rows do run with its batch; the kernels keep rows independent (per-row
activation scales, padding rows that leave real rows bit-identical: docs/FIELD_BUGS.md row 6,
tests/gpu/test_gpu_moe.py::test_nan_padding_rows_do_not_leak), so the other callers get exactly
the rows they would get without it, and that request gets its 400 (finish_batch).
"""

from __future__ import annotations

import importlib
import inspect
import logging
import sys
import time
import weakref
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from .protocol import BODY_ALIGN, ProtocolError, aligned_body
from .settings import HIDDEN_DATATYPES, ServiceSettings

log = logging.getLogger("megamoe.service.model")

FLOAT_TYPES = ("BF16", "FP16", "FP32")
INT_TYPES = ("INT32", "INT64")
#: the datatype the routing inputs are advertised with: one that every standard client sends in
#: every tensor format (perf_analyzer and tritonclient refuse BF16 in JSON); the server accepts all
#: of ``parameters.datatypes`` regardless. hidden_states and output are advertised with the
#: hidden_datatype setting (FP32, or BF16), and every answer is in the dtype of hidden_states.
ADVERTISED = {"topk_ids": "INT32", "topk_weights": "FP32", "router_logits": "FP32", "input_ids": "INT32"}
INPUT_NAMES = ("hidden_states", "topk_ids", "topk_weights", "router_logits", "input_ids")
OUTPUT_NAME = "output"


@dataclass
class ModelRequest:
    """One caller's validated tensors (CPU). ``mode``: 'topk', 'logits' or 'router'."""

    hidden_states: torch.Tensor
    mode: str
    topk_ids: torch.Tensor | None = None
    topk_weights: torch.Tensor | None = None
    router_logits: torch.Tensor | None = None
    #: hidden_states is checked for NaN/Inf on the device after its copy there (see launch_batch)
    finite_on_device: bool = False
    #: [T] int64 token ids, kept only where the layer routes by them (hash routing, own router or logits)
    input_ids: torch.Tensor | None = None

    @property
    def tokens(self) -> int:
        return self.hidden_states.shape[0]

    @property
    def batch_key(self) -> tuple:
        """Requests batch together only when one forward call can serve them all."""
        return (self.hidden_states.dtype, self.mode, self.input_ids is not None)


def resolve_backend(spec: str):
    """A registered backend name (passed through), or 'package.module:attr' called to make a Backend
    (a Backend subclass, or a factory such as one wrapping a backend with megamoe.faults)."""
    if ":" not in spec:
        return spec
    module_name, _, class_name = spec.partition(":")
    try:
        cls = getattr(importlib.import_module(module_name), class_name)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"backend {spec!r} cannot be imported: {exc}") from exc
    return cls()


def load_layer(settings: ServiceSettings):
    """The MoELayer the settings name (checkpoint or synthetic preset)."""
    from megamoe.moe import MoELayer

    backend = resolve_backend(settings.backend)
    if settings.checkpoint:
        return MoELayer.from_checkpoint(settings.checkpoint, backend=backend, device=settings.device,
                                        layer=settings.layer)
    return MoELayer.from_preset(settings.preset, seed=settings.seed, backend=backend, device=settings.device)


def default_model_name(settings: ServiceSettings) -> str:
    if settings.model_name:
        return settings.model_name
    if settings.checkpoint:
        return Path(settings.checkpoint).resolve().name or "megamoe"
    return settings.preset


def layer_device(layer) -> torch.device:
    """Where the layer's weights live (inputs are moved there before forward)."""
    return torch.device(layer.device)


class ServedModel:
    """A loaded MoELayer under a name, with the checks that guard its forward."""

    version = "1"

    def __init__(self, name: str, layer, max_tokens_per_request: int, hidden_datatype: str = "FP32"):
        if hidden_datatype not in HIDDEN_DATATYPES:
            raise ValueError(f"hidden_datatype {hidden_datatype!r}: one of {', '.join(HIDDEN_DATATYPES)}")
        self.name = name
        self.hidden_datatype = hidden_datatype
        self.layer = layer
        self.config = layer.config
        self.device = layer_device(layer)
        self.max_tokens_per_request = max_tokens_per_request
        self.torch_threads = torch.get_num_threads()  # of the device thread; the app may change it
        # validate() has checked every request already; the layer's own check of topk_ids
        # would cost a device sync per batch, so it is skipped where the layer allows it
        params = inspect.signature(layer.forward).parameters
        self._forward_kwargs = {"validate": False} if "validate" in params else {}
        #: the layer's forward takes token ids (``input_ids``); a hash-routed layer needs them to route
        self.takes_input_ids = "input_ids" in params
        self.needs_input_ids = self.takes_input_ids and bool(getattr(layer, "needs_input_ids", False))
        self._graphs: dict[tuple, _Graph | None] = {}
        self._pad_ids: dict[int, torch.Tensor] = {}
        self._pinned = PinnedPool()
        if self.device.type == "cuda":
            # The device thread's batch is ~25 short torch calls, each releasing the interpreter
            # lock; with the event loop busy (many connections), taking it back waits up to the
            # switch interval (default 5 ms) each time. A shorter interval keeps the device fed.
            sys.setswitchinterval(min(sys.getswitchinterval(), SWITCH_INTERVAL_S))

    def body_buffer(self, declared: int, header_length: int) -> memoryview:
        """A request body's buffer (see ServiceState.body_buffer). On a CUDA device it is pinned host
        memory from torch's caching host allocator (blocks are reused, not allocated per request):
        the request's rows go to the device straight from it, without a staging copy. The tensors
        decoded from it keep it alive; launch_batch keeps them until the device has read them."""
        if self.device.type != "cuda":
            return aligned_body(declared, header_length)
        return aligned_body(declared, header_length, self._pinned.take(declared + BODY_ALIGN))

    @property
    def has_router(self) -> bool:
        return self.layer.weights.router_weight is not None

    @property
    def backend_name(self) -> str:
        backend = self.layer.backend
        return getattr(backend, "name", str(backend))

    def _tensors(self) -> tuple[list[tuple], tuple]:
        """(name, advertised datatype, accepted datatypes, row width, optional) of the inputs, and of the output."""
        cfg = self.config
        inputs = [
            ("hidden_states", self.hidden_datatype, FLOAT_TYPES, cfg.hidden_size, False),
            # routing: topk_ids + topk_weights, or router_logits, or neither (the layer's router)
            ("topk_ids", ADVERTISED["topk_ids"], INT_TYPES, cfg.top_k, True),
            ("topk_weights", ADVERTISED["topk_weights"], FLOAT_TYPES, cfg.top_k, True),
            ("router_logits", ADVERTISED["router_logits"], FLOAT_TYPES, cfg.num_experts, True),
        ]
        if self.takes_input_ids:
            # [T] token ids: a hash-routed layer's experts are tid2eid[input_ids] (required when it routes
            # itself, by its router or router_logits); other layers accept and ignore them
            inputs.append(("input_ids", ADVERTISED["input_ids"], INT_TYPES, None, not self.needs_input_ids))
        return inputs, (OUTPUT_NAME, self.hidden_datatype, FLOAT_TYPES, cfg.hidden_size, False)

    def metadata(self) -> dict:
        cfg = self.config
        hidden, experts, top_k = cfg.hidden_size, cfg.num_experts, cfg.top_k
        inputs, (out_name, out_type, _, out_width, _) = self._tensors()
        return {
            "name": self.name,
            "versions": [self.version],
            "platform": "megamoe",
            "inputs": [
                {"name": name, "datatype": datatype, "shape": [-1] if width is None else [-1, width],
                 **({"optional": True} if optional else {}), "parameters": {"datatypes": list(accepted)}}
                for name, datatype, accepted, width, optional in inputs
            ],
            "outputs": [
                {"name": out_name, "datatype": out_type, "shape": [-1, out_width],
                 "parameters": {"datatype": "same as hidden_states"}},
            ],
            "parameters": {
                "backend": self.backend_name,
                "device": str(self.device),
                "hidden_size": hidden,
                "intermediate_size": cfg.intermediate_size,
                "num_experts": experts,
                "top_k": top_k,
                "has_router": self.has_router,
                "hash_routing": self.needs_input_ids,
                "max_tokens_per_request": self.max_tokens_per_request,
                "torch_threads": self.torch_threads,
            },
        }

    def triton_config(self, queue_delay_ms: float, max_batch_tokens: int, instances: int = 1) -> dict:
        """The model configuration in Triton's JSON form (model-configuration extension,
        ``GET /v2/models/{m}/config``), which Triton's tools (perf_analyzer, model_analyzer) read
        after the metadata. ``max_batch_size`` 0: the token dimension T is part of each tensor's
        shape (``dims`` [-1, width]), so a request carries T distinct rows; the server's own
        dynamic batcher stacks requests along T (its settings are in ``parameters``). The routing
        inputs are optional: topk_ids + topk_weights, else router_logits, else the layer's router."""
        inputs, output = self._tensors()

        def tensor(name, datatype, width, optional=None):
            entry = {"name": name, "data_type": f"TYPE_{datatype}", "format": "FORMAT_NONE",
                     "dims": [-1] if width is None else [-1, width],
                     "is_shape_tensor": False}
            if optional is not None:
                entry.update(allow_ragged_batch=False, optional=optional)
            return entry

        cfg = self.config
        cuda = self.device.type == "cuda"
        return {
            "name": self.name,
            "platform": "",
            "backend": "megamoe",
            "version_policy": {"specific": {"versions": [int(self.version)]}},
            "max_batch_size": 0,
            "input": [tensor(n, d, w, opt) for n, d, _, w, opt in inputs],
            "output": [tensor(output[0], output[1], output[3])],
            # --instances: that many serving processes, each with its own copy of the layer
            "instance_group": [{"name": f"{self.name}_0", "kind": "KIND_GPU" if cuda else "KIND_CPU", "count": instances,
                                "gpus": [self.device.index or 0] if cuda else []}],
            # Triton's parameters map: every value is {"string_value": ...}
            "parameters": {key: {"string_value": str(value)} for key, value in {
                "backend": self.backend_name, "device": str(self.device), "hidden_size": cfg.hidden_size,
                "intermediate_size": cfg.intermediate_size, "num_experts": cfg.num_experts, "top_k": cfg.top_k,
                "has_router": self.has_router, "max_tokens_per_request": self.max_tokens_per_request,
                "max_batch_tokens": max_batch_tokens, "queue_delay_ms": queue_delay_ms,
                "accepted_float_datatypes": ",".join(FLOAT_TYPES), "accepted_int_datatypes": ",".join(INT_TYPES),
                "routing": "topk_ids + topk_weights if given, else router_logits if given, else the layer's router",
                "hash_routing": self.needs_input_ids,
            }.items()},
        }

    def validate(self, inputs: dict[str, torch.Tensor], datatypes: dict[str, str]) -> ModelRequest:
        """Check one request against the model; raises ProtocolError(400) with the offending value."""
        unknown = sorted(set(inputs) - set(INPUT_NAMES))
        if unknown:
            raise ProtocolError(f"unknown input(s) {unknown}; this model takes {list(INPUT_NAMES)}")
        if "hidden_states" not in inputs:
            raise ProtocolError("input 'hidden_states' is required")
        cfg = self.config
        hidden = inputs["hidden_states"]
        _expect_dtype("hidden_states", datatypes["hidden_states"], FLOAT_TYPES)
        if hidden.dim() != 2:
            raise ProtocolError(f"hidden_states must be 2-D [T, {cfg.hidden_size}], got shape {list(hidden.shape)}")
        tokens, width = hidden.shape
        if width != cfg.hidden_size:
            raise ProtocolError(f"hidden size mismatch: hidden_states has {width} columns, the model's hidden_size is {cfg.hidden_size}")
        if tokens == 0:
            raise ProtocolError("hidden_states has no rows (T = 0)")
        if tokens > self.max_tokens_per_request:
            raise ProtocolError(f"hidden_states has {tokens} rows; this server takes at most {self.max_tokens_per_request} per request")
        # a large request on a CUDA device is checked there, after its copy (a pass over its rows here
        # costs the event loop ~1.3 ms for T=512, H=4096); the others here (a few microseconds)
        on_device = self.device.type == "cuda" and tokens >= DEVICE_FINITE_MIN_ROWS
        if not on_device:
            _expect_finite("hidden_states", hidden)

        # Routing, all inputs optional: topk_ids + topk_weights if given, else router_logits if
        # given, else the layer's router. Every input sent is checked, also one that routing then
        # does not use (Triton's tools send every optional input, e.g. perf_analyzer --input-data zero).
        token_ids = self._token_ids(inputs, datatypes, tokens)
        has_ids, has_weights, has_logits = ("topk_ids" in inputs), ("topk_weights" in inputs), ("router_logits" in inputs)
        if has_ids != has_weights:
            raise ProtocolError("topk_ids and topk_weights go together: send both or neither")
        if has_logits:
            logits = inputs["router_logits"]
            _expect_dtype("router_logits", datatypes["router_logits"], FLOAT_TYPES)
            want = [tokens, cfg.num_experts]
            if list(logits.shape) != want:
                raise ProtocolError(f"router_logits must have shape {want}, got {list(logits.shape)}")
            _expect_finite("router_logits", logits)

        if has_ids:
            ids, weights = inputs["topk_ids"], inputs["topk_weights"]
            _expect_dtype("topk_ids", datatypes["topk_ids"], INT_TYPES)
            _expect_dtype("topk_weights", datatypes["topk_weights"], FLOAT_TYPES)
            want = [tokens, cfg.top_k]
            if list(ids.shape) != want:
                raise ProtocolError(f"topk_ids must have shape {want}, got {list(ids.shape)}")
            if list(weights.shape) != want:
                raise ProtocolError(f"topk_weights must have shape {want}, got {list(weights.shape)}")
            low, high = (int(v) for v in torch.aminmax(ids))
            if low < 0 or high >= cfg.num_experts:
                bad = low if low < 0 else high
                raise ProtocolError(f"topk_ids out of range: {bad} (experts are 0..{cfg.num_experts - 1})")
            _expect_finite("topk_weights", weights)
            return ModelRequest(hidden, "topk", topk_ids=ids.to(torch.int32), topk_weights=weights.float(),
                                finite_on_device=on_device)
        if self.needs_input_ids and token_ids is None:
            raise ProtocolError("input 'input_ids' is required: this model routes by token id (hash routing, experts = "
                                "tid2eid[input_ids]); send input_ids [T], or topk_ids and topk_weights")
        if has_logits:
            return ModelRequest(hidden, "logits", router_logits=logits.float(), finite_on_device=on_device,
                                input_ids=token_ids if self.needs_input_ids else None)
        if not self.has_router:
            raise ProtocolError("this model has no router: send topk_ids and topk_weights, or router_logits")
        return ModelRequest(hidden, "router", finite_on_device=on_device,
                            input_ids=token_ids if self.needs_input_ids else None)

    def _token_ids(self, inputs: dict, datatypes: dict, tokens: int) -> torch.Tensor | None:
        """``input_ids`` checked (integers, shape [T], within the layer's vocabulary when it has a
        tid2eid table) as int64, or None when not sent."""
        if "input_ids" not in inputs:
            return None
        if not self.takes_input_ids:
            raise ProtocolError("this model takes no input_ids (its layer's forward has no token-id input)")
        ids = inputs["input_ids"]
        _expect_dtype("input_ids", datatypes["input_ids"], INT_TYPES)
        if list(ids.shape) != [tokens]:
            raise ProtocolError(f"input_ids must have shape [{tokens}] (one token id per row of hidden_states), "
                                f"got {list(ids.shape)}")
        table = getattr(getattr(self.layer, "weights", None), "tid2eid", None)
        if table is not None and tokens:
            low, high = (int(v) for v in torch.aminmax(ids))
            vocab = int(table.shape[0])
            if low < 0 or high >= vocab:
                raise ProtocolError(f"input_ids out of range: {low if low < 0 else high} (the model's token ids are "
                                    f"0..{vocab - 1})")
        return ids.to(torch.int64)

    # --- the batched forward -------------------------------------------------------
    #
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
#: on a CUDA device, a request of this many rows or more has its hidden_states checked for NaN/Inf
#: there (ServedModel.validate, launch_batch), smaller ones on the host
DEVICE_FINITE_MIN_ROWS = 32
#: interpreter switch interval while serving on a CUDA device (see ServedModel.__init__)
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


def _expect_dtype(name: str, datatype: str, allowed: tuple[str, ...]) -> None:
    if datatype not in allowed:
        raise ProtocolError(f"{name} must be one of {list(allowed)}, got {datatype}")


def _all_finite(tensor: torch.Tensor) -> bool:
    """Whether every element is finite. numpy's single pass over the host tensor: torch's
    isfinite + all costs two kernels, a temporary and an intra-op thread hand-off, ~30x slower
    on a shared 2-core CPU for a [512, 4096] tensor, and this runs on the event loop."""
    if tensor.device.type == "cpu" and tensor.is_contiguous():
        if tensor.dtype == torch.bfloat16:  # numpy has no bfloat16: NaN/Inf have all 8 exponent bits set
            return not bool(np.any((tensor.view(torch.int16).numpy() & 0x7F80) == 0x7F80))
        if tensor.dtype in (torch.float16, torch.float32, torch.float64):
            return bool(np.isfinite(tensor.numpy()).all())
    return bool(torch.isfinite(tensor).all())


def nonfinite_errors(requests: list[ModelRequest], sizes: list[int], rows_finite: torch.Tensor) -> dict:
    """{index: ProtocolError} of the requests checked on the device (``finite_on_device``) whose rows
    ``rows_finite`` (one flag per row of the batch, host) flags as holding NaN or Inf; the error
    names the first such element, found on the host in that request's own tensor (rare)."""
    errors, offset = {}, 0
    for index, (request, n) in enumerate(zip(requests, sizes)):
        if request.finite_on_device and not bool(rows_finite[offset:offset + n].all()):
            try:
                _expect_finite("hidden_states", request.hidden_states)
                errors[index] = ProtocolError("hidden_states contains NaN or Inf (found on the device); this "
                                              "server rejects non-finite inputs")
            except ProtocolError as exc:
                errors[index] = exc
        offset += n
    return errors


def _expect_finite(name: str, tensor: torch.Tensor) -> None:
    if not _all_finite(tensor):
        where = (~torch.isfinite(tensor)).nonzero()[0].tolist()
        raise ProtocolError(f"{name} contains NaN or Inf (first at {where}); this server rejects non-finite inputs "
                            "(random bit patterns, such as perf_analyzer's --input-data random, include them: "
                            "send finite values, e.g. --input-data zero or a data file)")

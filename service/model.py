"""The served MoE model: loading, v2 metadata, and validation of one request's tensors (the batched
forward on the device, its staging buffers and CUDA graphs are the batch runner's: service/runner.py).

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
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from .protocol import ProtocolError
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
        layer = MoELayer.from_checkpoint(settings.checkpoint, backend=backend, device=settings.device,
                                         layer=settings.layer)
    else:
        layer = MoELayer.from_preset(settings.preset, seed=settings.seed, backend=backend, device=settings.device)
    layer.batch_invariant = settings.batch_invariant
    if layer.device.type == "cuda":
        # the loading and preparing temporaries (v3: ~11 GiB on top of its 6 GiB of weights) back to the device, so
        # that each of several instances with its own copy holds about its weights, not its peak
        torch.cuda.synchronize(layer.device)
        torch.cuda.empty_cache()
    return layer


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
        params = inspect.signature(layer.forward).parameters
        #: the layer's forward takes token ids (``input_ids``); a hash-routed layer needs them to route
        self.takes_input_ids = "input_ids" in params
        self.needs_input_ids = self.takes_input_ids and bool(getattr(layer, "needs_input_ids", False))

    @property
    def batch_invariant(self) -> bool:
        """Whether the layer's float GEMMs outside the kernels run batch-invariant (docs/SPEC.md §3.5)."""
        return bool(getattr(self.layer, "batch_invariant", True))

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
                "batch_invariant": self.batch_invariant,
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
            # --instances: that many serving processes (sharing one copy of the weights unless --no-share-weights)
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
                "batch_invariant": self.batch_invariant,
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


#: on a CUDA device, a request of this many rows or more has its hidden_states checked for NaN/Inf
#: there (ServedModel.validate, BatchRunner.launch_batch), smaller ones on the host
DEVICE_FINITE_MIN_ROWS = 32


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

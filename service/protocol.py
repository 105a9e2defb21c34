"""Open Inference Protocol (KServe v2) request/response codec, JSON and binary tensor extension.

Pure functions over bytes and torch tensors; no web framework here, so the codec
is tested on its own and the app stays a thin layer of routes.

Binary extension (as Triton and tritonclient speak it): the body is a JSON header
of ``Inference-Header-Content-Length`` bytes followed by the raw tensors, in the
order of the inputs that carry ``parameters.binary_data_size``. Raw tensors are
little-endian, row-major; BF16 is the 2-byte bfloat16 pattern.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field

import torch

HEADER_LENGTH = "Inference-Header-Content-Length"

#: v2 datatype name -> torch dtype (the ones this server reads and writes)
DATATYPES: dict[str, torch.dtype] = {
    "BF16": torch.bfloat16,
    "FP16": torch.float16,
    "FP32": torch.float32,
    "INT32": torch.int32,
    "INT64": torch.int64,
}
DATATYPE_OF: dict[torch.dtype, str] = {dtype: name for name, dtype in DATATYPES.items()}
_INT_LIMITS = {"INT32": (-(2**31), 2**31 - 1), "INT64": (-(2**63), 2**63 - 1)}


class ProtocolError(Exception):
    """A request the server will not run; ``status`` is the HTTP status to answer with."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status
        self.message = message


@dataclass
class InferRequest:
    """A decoded infer request: CPU tensors by input name, and how each output is wanted."""

    inputs: dict[str, torch.Tensor]
    datatypes: dict[str, str]
    request_id: str | None = None
    #: output name -> send as binary; empty: every output, in the request-level default
    outputs: dict[str, bool] = field(default_factory=dict)
    binary_output_default: bool = False


def parse_header_length(value: str | None, body_bytes: int) -> int | None:
    """The JSON header's length from ``Inference-Header-Content-Length`` (None: a plain JSON body)."""
    if value is None:
        return None
    try:
        length = int(value)
    except ValueError:
        raise ProtocolError(f"{HEADER_LENGTH} must be an integer, got {value!r}") from None
    if length < 0 or length > body_bytes:
        raise ProtocolError(f"{HEADER_LENGTH} is {length} but the body has {body_bytes} bytes")
    return length


def _shape_of(spec: dict, name: str) -> list[int]:
    shape = spec.get("shape")
    if not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
        raise ProtocolError(f"input {name!r}: shape must be a list of non-negative integers, got {shape!r}")
    return shape


def _tensor_from_json(data, datatype: str, shape: list[int], name: str) -> torch.Tensor:
    # torch.tensor walks (possibly nested) lists in C; ragged lists, strings and nulls raise.
    try:
        values = torch.tensor(data, dtype=torch.float64).reshape(-1)
    except (TypeError, ValueError, RuntimeError) as exc:
        raise ProtocolError(f"input {name!r}: data must be a (nested) list of numbers: {exc}") from None
    expected = math.prod(shape)
    if values.numel() != expected:
        raise ProtocolError(f"input {name!r}: data has {values.numel()} elements, shape {shape} needs {expected}")
    if datatype in _INT_LIMITS:
        low, high = _INT_LIMITS[datatype]
        finite = torch.isfinite(values)
        if not bool(finite.all()) or not bool((values == values.round()).all()):
            raise ProtocolError(f"input {name!r}: {datatype} data must be integers")
        if values.numel() and (float(values.min()) < low or float(values.max()) > high):
            raise ProtocolError(f"input {name!r}: value out of {datatype} range")
    converted = values.to(DATATYPES[datatype])
    if converted.is_floating_point():
        overflow = torch.isfinite(values) & ~torch.isfinite(converted)
        if bool(overflow.any()):
            raise ProtocolError(f"input {name!r}: value {float(values[overflow][0])} is out of {datatype} range")
    return converted.reshape(shape)


def _tensor_from_bytes(raw: bytes, datatype: str, shape: list[int], name: str) -> torch.Tensor:
    dtype = DATATYPES[datatype]
    itemsize = torch.empty((), dtype=dtype).element_size()
    expected = math.prod(shape) * itemsize
    if len(raw) != expected:
        raise ProtocolError(
            f"input {name!r}: binary_data_size is {len(raw)} bytes, shape {shape} of {datatype} needs {expected}"
        )
    if expected == 0:
        return torch.empty(shape, dtype=dtype)
    # bytearray: a writable copy that the tensor owns (frombuffer shares memory)
    return torch.frombuffer(bytearray(raw), dtype=dtype).reshape(shape)


def parse_infer_request(body: bytes, header_length: int | None) -> InferRequest:
    """Decode a v2 infer body (``header_length`` from :func:`parse_header_length`)."""
    json_part = body if header_length is None else body[:header_length]
    binary = b"" if header_length is None else body[header_length:]
    try:
        doc = json.loads(json_part)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        hint = "" if header_length is not None else f" (a binary body needs the {HEADER_LENGTH} header)"
        raise ProtocolError(f"malformed JSON in request: {exc}{hint}") from None
    if not isinstance(doc, dict):
        raise ProtocolError(f"request must be a JSON object, got {type(doc).__name__}")
    specs = doc.get("inputs")
    if not isinstance(specs, list) or not specs:
        raise ProtocolError("request needs a non-empty 'inputs' list")

    inputs: dict[str, torch.Tensor] = {}
    datatypes: dict[str, str] = {}
    offset = 0
    for spec in specs:
        if not isinstance(spec, dict) or not isinstance(spec.get("name"), str):
            raise ProtocolError(f"each input must be an object with a string 'name', got {spec!r:.80}")
        name = spec["name"]
        if name in inputs:
            raise ProtocolError(f"input {name!r} appears twice")
        datatype = spec.get("datatype")
        if datatype not in DATATYPES:
            raise ProtocolError(f"input {name!r}: datatype {datatype!r} is not one of {sorted(DATATYPES)}")
        shape = _shape_of(spec, name)
        params = spec.get("parameters") or {}
        if not isinstance(params, dict):
            raise ProtocolError(f"input {name!r}: parameters must be an object")
        size = params.get("binary_data_size")
        if size is not None:
            if "data" in spec:
                raise ProtocolError(f"input {name!r} has both 'data' and binary_data_size")
            if not isinstance(size, int) or isinstance(size, bool) or size < 0:
                raise ProtocolError(f"input {name!r}: binary_data_size must be a non-negative integer, got {size!r}")
            if offset + size > len(binary):
                raise ProtocolError(
                    f"binary body truncated: input {name!r} declares {size} bytes at offset {offset} "
                    f"but only {len(binary) - offset} remain"
                )
            tensor = _tensor_from_bytes(binary[offset : offset + size], datatype, shape, name)
            offset += size
        elif "data" in spec:
            tensor = _tensor_from_json(spec["data"], datatype, shape, name)
        else:
            raise ProtocolError(f"input {name!r} has neither 'data' nor parameters.binary_data_size")
        inputs[name] = tensor
        datatypes[name] = datatype
    if offset != len(binary):
        raise ProtocolError(f"binary body has {len(binary) - offset} bytes beyond the declared binary_data_size")

    req_params = doc.get("parameters") or {}
    if not isinstance(req_params, dict):
        raise ProtocolError("request parameters must be an object")
    binary_default = bool(req_params.get("binary_data_output", False))
    outputs: dict[str, bool] = {}
    out_specs = doc.get("outputs")
    if out_specs is not None:
        if not isinstance(out_specs, list):
            raise ProtocolError("'outputs' must be a list")
        for spec in out_specs:
            if not isinstance(spec, dict) or not isinstance(spec.get("name"), str):
                raise ProtocolError(f"each output must be an object with a string 'name', got {spec!r:.80}")
            oparams = spec.get("parameters") or {}
            if not isinstance(oparams, dict):
                raise ProtocolError(f"output {spec['name']!r}: parameters must be an object")
            outputs[spec["name"]] = bool(oparams.get("binary_data", binary_default))
    request_id = doc.get("id")
    if request_id is not None and not isinstance(request_id, str):
        raise ProtocolError("'id' must be a string")
    return InferRequest(inputs, datatypes, request_id, outputs, binary_default)


def encode_infer_response(
    model_name: str,
    model_version: str,
    request_id: str | None,
    outputs: list[tuple[str, torch.Tensor, bool]],
) -> tuple[bytes, dict[str, str]]:
    """Encode ``(name, tensor, as_binary)`` outputs; returns the body and the headers it needs."""
    header: dict = {"model_name": model_name, "model_version": model_version}
    if request_id is not None:
        header["id"] = request_id
    header["outputs"] = []
    blobs: list[bytes] = []
    for name, tensor, as_binary in outputs:
        tensor = tensor.detach().contiguous().cpu()
        entry: dict = {"name": name, "datatype": DATATYPE_OF[tensor.dtype], "shape": list(tensor.shape)}
        if as_binary:
            raw = tensor.reshape(-1).view(torch.uint8).numpy().tobytes()
            entry["parameters"] = {"binary_data_size": len(raw)}
            blobs.append(raw)
        elif tensor.dtype.is_floating_point:
            # BF16/FP16 values are exact in float32, so JSON carries them without rounding
            entry["data"] = tensor.reshape(-1).float().tolist()
        else:
            entry["data"] = tensor.reshape(-1).tolist()
        header["outputs"].append(entry)
    head = json.dumps(header, separators=(",", ":")).encode()
    if not blobs:
        return head, {"content-type": "application/json"}
    return head + b"".join(blobs), {
        "content-type": "application/octet-stream",
        HEADER_LENGTH: str(len(head)),
    }

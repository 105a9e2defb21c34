"""Open Inference Protocol (KServe v2) request/response codec, JSON and binary tensor extension.

Pure functions over bytes and torch tensors; no web framework here, so the codec
is tested on its own and the app stays a thin layer of routes.

Binary extension (as Triton and tritonclient speak it): the body is a JSON header
of ``Inference-Header-Content-Length`` bytes followed by the raw tensors, in the
order of the inputs that carry ``parameters.binary_data_size``. Raw tensors are
little-endian, row-major; BF16 is the 2-byte bfloat16 pattern.

Decoding is in two steps. :func:`decode_json_request` (in :mod:`.jsoncodec`) reads the
JSON document with the standard library only (no torch), packs every ``data`` list into a compact
array and checks the document's types strictly; the app runs it in a worker process
for large bodies, so a big JSON body never holds the server's interpreter lock.
:func:`build_request` turns the result (plus the binary part) into tensors.

Strictness (service/README.md, "Strict JSON in"; the contract is docs/SPEC.md §6):
booleans must be JSON booleans, objects must be objects
(``null`` or ``0`` is not an empty one), a key may appear once per object, integers
(INT32/INT64 data, shapes, sizes) must be JSON integers and are never passed through
float64, ``NaN``/``Infinity`` tokens are not JSON and are refused. Every refusal is a
:class:`ProtocolError` (a 4xx), never another exception.

Non-finite outputs (an FP16 result beyond 65504, say) cannot be JSON numbers; they are
written as the JSON strings ``"Infinity"``, ``"-Infinity"`` and ``"NaN"``, which every
strict JSON parser reads and numpy, JavaScript's ``Number()`` and Go's ``ParseFloat``
turn back into the values (tritonclient's ``as_numpy`` does). Binary outputs carry them
as raw bits.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field

import numpy as np
import torch

from .jsoncodec import (  # noqa: F401 - re-exported: the codec's one public surface
    _PACKED_TYPECODE,
    DATATYPE_NAMES,
    HEADER_LENGTH,
    MAX_DIM,
    MAX_DIMS,
    DecodedInput,
    DecodedRequest,
    ProtocolError,
    count_json_values_bound,
    decode_json_request,
    encode_json_response,
    parse_header_length,
    strict_json,
    too_many_values,
)

#: v2 datatype name -> torch dtype (the ones this server reads and writes)
DATATYPES: dict[str, torch.dtype] = {
    "BF16": torch.bfloat16,
    "FP16": torch.float16,
    "FP32": torch.float32,
    "INT32": torch.int32,
    "INT64": torch.int64,
}
DATATYPE_OF: dict[torch.dtype, str] = {dtype: name for name, dtype in DATATYPES.items()}
_PACKED_DTYPE = {"d": torch.float64, "i": torch.int32, "q": torch.int64}


# --- request bodies ---------------------------------------------------------------------------

#: the binary part of a body read into a :class:`BodyBuffer` starts at a multiple of this address
BODY_ALIGN = 64


def _address(view) -> int:
    return np.frombuffer(view, dtype=np.uint8).ctypes.data if len(view) else 0


def aligned_body(declared: int, header_length: int, raw: np.ndarray | None = None) -> memoryview:
    """A writable buffer of ``declared`` bytes whose binary part (after a JSON header of
    ``header_length`` bytes) starts ``BODY_ALIGN``-aligned, placed in ``raw`` (a uint8 array of at
    least ``declared + BODY_ALIGN`` bytes: pinned host memory, say), else in a new uninitialized one."""
    if raw is None:
        raw = np.empty(declared + BODY_ALIGN, dtype=np.uint8)
    if len(raw) < declared + BODY_ALIGN:
        raise ValueError(f"body buffer of {len(raw)} bytes is too small for {declared} + {BODY_ALIGN}")
    start = -(raw.ctypes.data + header_length) % BODY_ALIGN
    return memoryview(raw[start:start + declared])


class BodyBuffer:
    """A request body as its chunks arrive. With a declared length it is one uninitialized buffer
    allocated at the first chunk (no regrowth, no copy of what arrived so far), placed so that the
    binary part after a JSON header of ``header_length`` bytes starts ``BODY_ALIGN``-aligned: the
    binary tensors then decode without a copy (:func:`_tensor_from_bytes`). Without a declared
    length (chunked transfer) it is a bytearray that grows."""

    def __init__(self, declared: int | None = None, header_length: int | None = None):
        self._declared = declared
        self._header_length = header_length or 0
        self._view: memoryview | None = None  # the fixed buffer, once allocated
        self._grown = bytearray()
        self.size = 0

    def append(self, chunk) -> None:
        n = len(chunk)
        if not n:
            return
        if self._view is None and self._declared is not None and not self._grown:
            self._view = aligned_body(self._declared, self._header_length)
        if self._view is not None:
            if self.size + n <= len(self._view):
                self._view[self.size:self.size + n] = chunk
                self.size += n
                return
            # more than declared (the HTTP layer does not let this happen): grow from here on
            self._grown = bytearray(self._view[:self.size])
            self._view = None
        self._grown += chunk
        self.size += n

    def body(self):
        """What arrived: a writable memoryview (declared length) or a bytearray."""
        if self._view is not None:
            return self._view[:self.size]
        return self._grown


def binary_aligned(view) -> bool:
    """Whether the binary part ``view`` starts ``BODY_ALIGN``-aligned in writable memory (its
    tensors then decode without a copy)."""
    view = memoryview(view)
    return not view.readonly and _address(view) % BODY_ALIGN == 0


# --- tensors ---------------------------------------------------------------------------------

@dataclass
class InferRequest:
    """A decoded infer request: CPU tensors by input name, and how each output is wanted."""

    inputs: dict[str, torch.Tensor]
    datatypes: dict[str, str]
    request_id: str | None = None
    #: output name -> send as binary; empty: every output, in the request-level default
    outputs: dict[str, bool] = field(default_factory=dict)
    binary_output_default: bool = False


def _tensor_from_packed(entry: DecodedInput) -> torch.Tensor:
    name, datatype, shape = entry.name, entry.datatype, entry.shape
    expected = math.prod(shape)
    if entry.count != expected:
        raise ProtocolError(f"input {name!r}: data has {entry.count} elements, shape {shape} needs {expected}")
    dtype = DATATYPES[datatype]
    if expected == 0:
        return torch.empty(shape, dtype=dtype)
    values = torch.frombuffer(bytearray(entry.packed), dtype=_PACKED_DTYPE[_PACKED_TYPECODE[datatype]])
    if not dtype.is_floating_point:
        return values.reshape(shape)  # exact: INT32 and INT64 were packed as such
    converted = values.to(dtype)
    overflow = torch.isfinite(values) & ~torch.isfinite(converted)
    if bool(overflow.any()):
        raise ProtocolError(f"input {name!r}: value {float(values[overflow][0])} is out of {datatype} range")
    return converted.reshape(shape)


def _tensor_from_bytes(raw: memoryview, datatype: str, shape: list[int], name: str) -> torch.Tensor:
    dtype = DATATYPES[datatype]
    itemsize = dtype.itemsize  # (no tensor made per input just to learn it)
    expected = math.prod(shape) * itemsize
    if len(raw) != expected:
        raise ProtocolError(
            f"input {name!r}: binary_data_size is {len(raw)} bytes, shape {shape} of {datatype} needs {expected}"
        )
    if expected == 0:
        return torch.empty(shape, dtype=dtype)
    if raw.readonly:
        owned = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    else:
        owned = torch.frombuffer(raw, dtype=torch.uint8)
        if owned.data_ptr() % itemsize:
            # misaligned for its dtype: a copy that the tensor owns (torch copies without the interpreter lock)
            owned = owned.clone()
        # else zero-copy: the tensor shares the (writable) request body, which it keeps alive
    return owned.view(dtype).reshape(shape)


def build_request(decoded: DecodedRequest, binary=b"") -> InferRequest:
    """Tensors of a decoded request; ``binary`` is the body after the JSON header."""
    binary = memoryview(binary).cast("B")
    inputs: dict[str, torch.Tensor] = {}
    datatypes: dict[str, str] = {}
    offset = 0
    for entry in decoded.inputs:
        if entry.binary_size is not None:
            size = entry.binary_size
            if offset + size > len(binary):
                raise ProtocolError(
                    f"binary body truncated: input {entry.name!r} declares {size} bytes at offset {offset} "
                    f"but only {len(binary) - offset} remain"
                )
            tensor = _tensor_from_bytes(binary[offset: offset + size], entry.datatype, entry.shape, entry.name)
            offset += size
        else:
            tensor = _tensor_from_packed(entry)
        inputs[entry.name] = tensor
        datatypes[entry.name] = entry.datatype
    if offset != len(binary):
        raise ProtocolError(f"binary body has {len(binary) - offset} bytes beyond the declared binary_data_size")
    return InferRequest(inputs, datatypes, decoded.request_id, decoded.outputs, decoded.binary_output_default)


def parse_infer_request(body: bytes, header_length: int | None, max_values: int | None = None) -> InferRequest:
    """Decode a v2 infer body (``header_length`` from :func:`parse_header_length`)."""
    if header_length is None:
        return build_request(decode_json_request(body, max_values, plain_body=True))
    view = memoryview(body)
    return build_request(decode_json_request(view[:header_length], max_values), view[header_length:])


# --- responses -------------------------------------------------------------------------------

def response_parts(
    model_name: str,
    model_version: str,
    request_id: str | None,
    outputs: list[tuple[str, torch.Tensor, bool]],
) -> tuple[dict, list[tuple[int, str, bytes]], list[memoryview]]:
    """The response header, the JSON outputs packed for :func:`encode_json_response`, the binary blobs
    (views of the output tensors' bytes, sent from there: see :func:`response_pieces`)."""
    header: dict = {"model_name": model_name, "model_version": model_version}
    if request_id is not None:
        header["id"] = request_id
    header["outputs"] = []
    packed: list[tuple[int, str, bytes]] = []
    blobs: list[memoryview] = []
    for index, (name, tensor, as_binary) in enumerate(outputs):
        tensor = tensor.detach().contiguous().cpu()
        entry: dict = {"name": name, "datatype": DATATYPE_OF[tensor.dtype], "shape": list(tensor.shape)}
        if as_binary:
            raw = memoryview(tensor.reshape(-1).view(torch.uint8).numpy())  # no copy; keeps the tensor alive
            entry["parameters"] = {"binary_data_size": raw.nbytes}
            blobs.append(raw)
        elif tensor.dtype.is_floating_point:
            # BF16/FP16 values are exact in float32, so JSON carries them without rounding
            packed.append((index, "f", tensor.reshape(-1).float().numpy().tobytes()))
        else:
            packed.append((index, "q", tensor.reshape(-1).long().numpy().tobytes()))
        header["outputs"].append(entry)
    return header, packed, blobs


#: a response body this short is sent as one piece (one write); a longer one as its JSON header and
#: then each binary output from the output tensor's own memory (no copy into a body)
JOIN_BELOW_BYTES = 64 * 1024


def response_pieces(head: bytes, blobs: list) -> tuple[list, dict[str, str]]:
    """The body of a response as the pieces to send in order (their lengths add up to the
    Content-Length), and its headers: large binary outputs are not copied into one body."""
    if not blobs:
        return [head], {"content-type": "application/json"}
    total = len(head) + sum(len(b) for b in blobs)
    headers = {"content-type": "application/octet-stream", HEADER_LENGTH: str(len(head))}
    if total < JOIN_BELOW_BYTES:
        return [b"".join([head, *blobs])], headers
    return [head, *blobs], headers


def encode_infer_response(
    model_name: str,
    model_version: str,
    request_id: str | None,
    outputs: list[tuple[str, torch.Tensor, bool]],
) -> tuple[bytes, dict[str, str]]:
    """Encode ``(name, tensor, as_binary)`` outputs; returns the body and the headers it needs."""
    header, packed, blobs = response_parts(model_name, model_version, request_id, outputs)
    pieces, headers = response_pieces(encode_json_response(header, packed), blobs)
    return b"".join(pieces), headers


# --- client side -----------------------------------------------------------------------------


def binary_infer_body(inputs: dict[str, torch.Tensor], output: str = "output") -> tuple[bytes, int]:
    """A client's binary-extension infer request: every input's raw bytes after the JSON header (its
    datatype from the tensor's dtype), ``output`` asked for as binary. Returns the body and the JSON
    header's length (the value of ``Inference-Header-Content-Length``); used by the benchmarks and tests."""
    blobs = [t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes() for t in inputs.values()]
    head = json.dumps({
        "inputs": [{"name": name, "datatype": DATATYPE_OF[t.dtype], "shape": list(t.shape),
                    "parameters": {"binary_data_size": len(b)}} for (name, t), b in zip(inputs.items(), blobs)],
        "outputs": [{"name": output, "parameters": {"binary_data": True}}],
    }).encode()
    return head + b"".join(blobs), len(head)

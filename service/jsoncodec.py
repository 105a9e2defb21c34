"""The JSON half of the v2 codec, on the standard library only (no torch).

The app runs :func:`decode_json_request` and :func:`encode_json_response` in a separate
decoder process for large bodies; that process imports this module and nothing heavy.
See :mod:`megamoe.service.protocol` for the whole codec and its rules.
"""

from __future__ import annotations

import json
import math
import re
from array import array
from dataclasses import dataclass, field
from itertools import chain

try:  # encodes large answers several times faster than json, where it is installed (optional)
    import orjson as _orjson
except ImportError:
    _orjson = None

HEADER_LENGTH = "Inference-Header-Content-Length"

#: the v2 datatypes this server reads and writes
DATATYPE_NAMES = ("BF16", "FP16", "FP32", "INT32", "INT64")
#: array typecode of each datatype's JSON values as decoded (floats as double, ints exact)
_PACKED_TYPECODE = {"BF16": "d", "FP16": "d", "FP32": "d", "INT32": "i", "INT64": "q"}

#: the most dimensions an input may have, and the largest dimension
MAX_DIMS = 8
MAX_DIM = 2**31 - 1
#: the longest integer literal read (INT64's range has 19 digits, plus a sign)
_MAX_INT_CHARS = 20
#: the deepest nesting of ``data`` lists (one level per dimension)
_MAX_DATA_DEPTH = MAX_DIMS
_DECIMAL = re.compile(r"[0-9]{1,18}")
_NON_FINITE_TEXT = {math.inf: "Infinity", -math.inf: "-Infinity"}


class ProtocolError(Exception):
    """A request the server will not run; ``status`` is the HTTP status to answer with.

    ``close``: answer with ``Connection: close`` (the request's body was not read to its end)."""

    def __init__(self, message: str, status: int = 400, close: bool = False):
        super().__init__(message)
        self.status = status
        self.message = message
        self.close = close

    def __reduce__(self):  # keeps status and close across the decoder process
        return (ProtocolError, (self.message, self.status, self.close))


def exit_with_parent(parent_pid: int) -> None:
    """Initializer of the JSON decoder process: it exits once the serving process that started it is
    gone (one that was killed has nobody left to stop its decoder). It ignores SIGINT: a Ctrl-C in a
    terminal reaches every process of the group, and the serving process ends its decoder itself once
    it has drained (a decoder interrupted first printed a KeyboardInterrupt traceback)."""
    import os
    import signal
    import threading
    import time

    signal.signal(signal.SIGINT, signal.SIG_IGN)

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(1.0)
        os._exit(0)

    threading.Thread(target=watch, name="megamoe-parent-watch", daemon=True).start()


def _brief(value, limit: int = 60) -> str:
    """A short description of a client's value for an error message (never raises)."""
    if isinstance(value, (list, dict)) and len(value) > 8:
        return f"a {type(value).__name__} of {len(value)} items"
    try:
        text = repr(value)
    except RecursionError:
        return f"a deeply nested {type(value).__name__}"
    return text if len(text) <= limit else text[:limit] + "..."


def parse_header_length(value: str | None, body_bytes: int) -> int | None:
    """The JSON header's length from ``Inference-Header-Content-Length`` (None: a plain JSON body).

    Only plain decimal digits: ``int()`` would also take ``3_67``, `` 367`` or ``+367``."""
    if value is None:
        return None
    if not _DECIMAL.fullmatch(value):
        raise ProtocolError(f"{HEADER_LENGTH} must be a decimal number of bytes, got {_brief(value, 40)}")
    length = int(value)
    if length > body_bytes:
        raise ProtocolError(f"{HEADER_LENGTH} is {length} but the body has {body_bytes} bytes")
    return length


def count_json_values_bound(chunk) -> int:
    """An upper bound of the values a JSON text adds: one per comma (an array of n items has
    n - 1 of them). Counted per received chunk, so a body with too many values is refused
    while it still arrives, before anything is decoded."""
    return chunk.count(b",")


# --- JSON document (standard library only: this part runs in the decoder process) ------------

@dataclass
class DecodedInput:
    name: str
    datatype: str
    shape: list[int]
    #: bytes of the binary part (binary extension), else None
    binary_size: int | None = None
    #: JSON data packed as an array (typecode ``_PACKED_TYPECODE[datatype]``), else None
    packed: bytes | None = None
    count: int = 0


@dataclass
class DecodedRequest:
    inputs: list[DecodedInput]
    request_id: str | None = None
    outputs: dict[str, bool] = field(default_factory=dict)
    binary_output_default: bool = False


def _reject_constant(token: str):
    raise ProtocolError(f"{token} is not a JSON number, and this server rejects NaN or Inf inputs anyway")


def _exact_int(text: str) -> int:
    if len(text) > _MAX_INT_CHARS:
        raise ProtocolError(f"integer literal of {len(text)} characters is out of the INT64 range")
    return int(text)


def _unique_keys(pairs: list[tuple[str, object]]) -> dict:
    obj = dict(pairs)
    if len(obj) != len(pairs):
        seen = set()
        for key, _ in pairs:
            if key in seen:
                raise ProtocolError(f"key {_brief(key, 40)} appears twice in one JSON object")
            seen.add(key)
    return obj


_DECODER = json.JSONDecoder(parse_int=_exact_int, parse_constant=_reject_constant, object_pairs_hook=_unique_keys)


def _loads(text: bytes, hint: str = "") -> object:
    try:
        return _DECODER.decode(text.decode("utf-8"))
    except ProtocolError:
        raise
    except RecursionError:
        raise ProtocolError("JSON nested too deeply") from None
    except UnicodeDecodeError as exc:
        raise ProtocolError(f"malformed JSON in request: not UTF-8: {exc}{hint}") from None
    except (json.JSONDecodeError, ValueError) as exc:
        raise ProtocolError(f"malformed JSON in request: {exc}{hint}") from None


def _flat_values(data, name: str) -> list:
    """The numbers of a (nested) ``data`` list, row-major; ints stay ints."""
    if not isinstance(data, list):
        raise ProtocolError(f"input {name!r}: data must be a (nested) list of numbers, got {_brief(data)}")
    values = data
    for _ in range(_MAX_DATA_DEPTH + 1):
        kinds = {type(v) for v in values}
        if kinds <= {int, float}:
            return values
        if kinds == {list}:
            if len({len(v) for v in values}) > 1:
                raise ProtocolError(f"input {name!r}: data must be a (nested) list of numbers with rows of one "
                                    "length; these are ragged")
            values = list(chain.from_iterable(values))
            continue
        bad = next(v for v in values if type(v) not in (int, float, list))
        raise ProtocolError(f"input {name!r}: data must be a (nested) list of numbers, found {_brief(bad)}")
    raise ProtocolError(f"input {name!r}: data is nested more than {_MAX_DATA_DEPTH} levels deep")


def _pack(values: list, datatype: str, name: str) -> bytes:
    typecode = _PACKED_TYPECODE[datatype]
    if typecode != "d" and not all(type(v) is int for v in values):
        bad = next(v for v in values if type(v) is not int)
        raise ProtocolError(f"input {name!r}: {datatype} data must be JSON integers, found {_brief(bad)}")
    try:
        return array(typecode, values).tobytes()
    except OverflowError:
        if typecode == "d":
            raise ProtocolError(f"input {name!r}: a value is beyond the range of a double") from None
        low, high = (-(2**31), 2**31 - 1) if typecode == "i" else (-(2**63), 2**63 - 1)
        bad = next(v for v in values if not low <= v <= high)
        raise ProtocolError(f"input {name!r}: value {bad} out of {datatype} range") from None


def _object(value, what: str) -> dict:
    if not isinstance(value, dict):
        raise ProtocolError(f"{what} must be a JSON object, got {_brief(value)}")
    return value


def _bool(value, what: str) -> bool:
    if not isinstance(value, bool):
        raise ProtocolError(f"{what} must be true or false (a JSON boolean), got {_brief(value)}")
    return value


def _shape_of(spec: dict, name: str) -> list[int]:
    shape = spec.get("shape")
    if (not isinstance(shape, list) or len(shape) > MAX_DIMS
            or not all(type(d) is int and 0 <= d <= MAX_DIM for d in shape)):
        raise ProtocolError(f"input {name!r}: shape must be a list of at most {MAX_DIMS} integers in "
                            f"[0, {MAX_DIM}], got {_brief(shape)}")
    return shape


def too_many_values(max_values: int) -> ProtocolError:
    return ProtocolError(f"the request's JSON holds more than {max_values} values, more than this model "
                         "takes in one request")


def decode_json_request(text, max_values: int | None = None, plain_body: bool = False) -> DecodedRequest:
    """The JSON part of an infer request, checked and with its data packed (no torch).

    ``max_values``: refuse a text that may hold more values than this (see
    :func:`count_json_values_bound`) before decoding it. ``plain_body``: the text is the
    whole body (no binary extension header), said in the error for malformed JSON."""
    if isinstance(text, memoryview):
        text = text.tobytes()
    if max_values is not None and count_json_values_bound(text) > max_values:
        raise too_many_values(max_values)
    hint = f" (a binary body needs the {HEADER_LENGTH} header)" if plain_body else ""
    doc = _object(_loads(text, hint), "the request")
    specs = doc.get("inputs")
    if not isinstance(specs, list) or not specs:
        raise ProtocolError("request needs a non-empty 'inputs' list")
    inputs: list[DecodedInput] = []
    names: set[str] = set()
    for spec in specs:
        if not isinstance(spec, dict) or not isinstance(spec.get("name"), str):
            raise ProtocolError(f"each input must be an object with a string 'name', got {_brief(spec)}")
        name = spec["name"]
        if name in names:
            raise ProtocolError(f"input {name!r} appears twice")
        names.add(name)
        datatype = spec.get("datatype")
        if not isinstance(datatype, str) or datatype not in DATATYPE_NAMES:
            raise ProtocolError(f"input {name!r}: datatype {_brief(datatype)} is not one of {sorted(DATATYPE_NAMES)}")
        shape = _shape_of(spec, name)
        params = _object(spec["parameters"], f"input {name!r}: parameters") if "parameters" in spec else {}
        entry = DecodedInput(name, datatype, shape)
        if "binary_data_size" in params:
            size = params["binary_data_size"]
            if "data" in spec:
                raise ProtocolError(f"input {name!r} has both 'data' and binary_data_size")
            if type(size) is not int or size < 0:
                raise ProtocolError(f"input {name!r}: binary_data_size must be a non-negative integer, got {_brief(size)}")
            entry.binary_size = size
        elif "data" in spec:
            values = _flat_values(spec["data"], name)
            entry.packed, entry.count = _pack(values, datatype, name), len(values)
        else:
            raise ProtocolError(f"input {name!r} has neither 'data' nor parameters.binary_data_size")
        inputs.append(entry)

    req_params = _object(doc["parameters"], "request parameters") if "parameters" in doc else {}
    binary_default = (_bool(req_params["binary_data_output"], "parameters.binary_data_output")
                      if "binary_data_output" in req_params else False)
    outputs: dict[str, bool] = {}
    if "outputs" in doc:
        out_specs = doc["outputs"]
        if not isinstance(out_specs, list):
            raise ProtocolError(f"'outputs' must be a list, got {_brief(out_specs)}")
        for spec in out_specs:
            if not isinstance(spec, dict) or not isinstance(spec.get("name"), str):
                raise ProtocolError(f"each output must be an object with a string 'name', got {_brief(spec)}")
            oname = spec["name"]
            oparams = _object(spec["parameters"], f"output {oname!r}: parameters") if "parameters" in spec else {}
            outputs[oname] = (_bool(oparams["binary_data"], f"output {oname!r}: parameters.binary_data")
                              if "binary_data" in oparams else binary_default)
    request_id = doc.get("id")
    if "id" in doc and not isinstance(request_id, str):
        raise ProtocolError(f"'id' must be a string, got {_brief(request_id)}")
    return DecodedRequest(inputs, request_id, outputs, binary_default)


def strict_json(value):
    """``value`` with every non-finite float replaced by its JSON string (see the module doc)."""
    if isinstance(value, float):
        if math.isfinite(value):
            return value
        return "NaN" if math.isnan(value) else _NON_FINITE_TEXT[value]
    if isinstance(value, dict):
        return {k: strict_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [strict_json(v) for v in value]
    return value


def _json_numbers(values: list) -> list:
    if all(map(math.isfinite, values)):
        return values
    return [v if math.isfinite(v) else ("NaN" if math.isnan(v) else _NON_FINITE_TEXT[v]) for v in values]


def encode_json_response(header: dict, data: list[tuple[int, str, bytes]]) -> bytes:
    """The JSON response: ``header`` with ``outputs[i]["data"]`` filled from packed arrays
    ``(i, typecode, raw)`` (standard library only: runs in the decoder process for large outputs)."""
    for index, typecode, raw in data:
        values = array(typecode, raw).tolist()
        header["outputs"][index]["data"] = _json_numbers(values) if typecode in "fd" else values
    return dumps(header)


def dumps(document) -> bytes:
    """Compact JSON of a document holding no non-finite float (strict_json and _json_numbers turn
    those into strings first): with orjson where it is installed, else the standard library."""
    if _orjson is not None:
        return _orjson.dumps(document)
    return json.dumps(document, separators=(",", ":"), allow_nan=False).encode()

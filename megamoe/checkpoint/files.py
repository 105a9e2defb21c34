"""The files of a checkpoint and the MoE layers in them: :func:`open_checkpoint` (a folder, a
sharded folder through its index, or one ``.safetensors`` file; every file opened once),
:class:`OpenCheckpoint` (tensors by name, whole or by a range of experts), :func:`moe_layers`
(every MoE layer, from the tensor names) and the choice of one layer (:func:`layer_experts`)."""
from __future__ import annotations

import contextlib
import json
import math
import re
from pathlib import Path

import torch

from megamoe.checkpoint.report import CheckpointError


def _files(path: Path) -> list[Path]:
    if path.is_dir():
        index = path / "model.safetensors.index.json"
        if index.exists():  # a sharded checkpoint: exactly the files its index names
            try:
                names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
            except (OSError, ValueError, KeyError, AttributeError) as exc:
                raise CheckpointError(f"{index}: unreadable ({exc})") from None
            missing = [n for n in names if not (path / n).exists()]
            if missing:
                raise CheckpointError(f"{path / missing[0]}: named by {index.name} but missing")
            return [path / n for n in names]
        files = sorted(path.glob("*.safetensors"))
        if not files:
            raise CheckpointError(f"{path}: no .safetensors files in this directory")
        return files
    if not path.exists():
        raise CheckpointError(f"{path}: no such checkpoint")
    return [path]


_DTYPE_BYTES = {"U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "BOOL": 1, "BF16": 2, "F16": 2, "I16": 2,
                "F32": 4, "I32": 4, "U32": 4, "F64": 8, "I64": 8, "U64": 8}


class OpenCheckpoint:
    """The ``.safetensors`` files of one checkpoint, each opened once (its header parsed
    once), from :func:`open_checkpoint`. Tensors are read whole (:meth:`get`) or by a range
    of their first dimension (:meth:`get_rows`, an expert range); ``bytes_read`` counts
    what was read, per tensor name."""

    def __init__(self, path: Path, handles: dict) -> None:
        self.path = path
        self.meta: dict[str, str] = {}
        self.where: dict[str, Path] = {}  # tensor name -> file
        self._handles = handles
        for f, fh in handles.items():
            self.meta.update(fh.metadata() or {})
            for k in fh.keys():
                self.where[k] = f
        self.bytes_read: dict[str, int] = {}

    def names(self) -> list[str]:
        return list(self.where)

    def __contains__(self, name: str) -> bool:
        return name in self.where

    def _file(self, name: str):
        if name not in self.where:
            raise CheckpointError(f"{name}: missing from {self.path}")
        return self._handles[self.where[name]]

    def shape(self, name: str) -> tuple[int, ...]:
        """From the header; reads no data."""
        return tuple(self._file(name).get_slice(name).get_shape())

    def dtype(self, name: str) -> str:
        """The safetensors dtype name (``"U8"``, ``"BF16"``, ...) from the header; reads no data."""
        return self._file(name).get_slice(name).get_dtype()

    def nbytes(self, name: str) -> int:
        """Bytes the tensor takes in the file (from the header)."""
        return math.prod(self.shape(name)) * _DTYPE_BYTES.get(self._file(name).get_slice(name).get_dtype(), 4)

    def get(self, name: str) -> torch.Tensor:
        """The whole tensor."""
        t = self._file(name).get_tensor(name)
        self.bytes_read[name] = self.bytes_read.get(name, 0) + t.numel() * t.element_size()
        return t

    def get_rows(self, name: str, start: int, end: int) -> torch.Tensor:
        """Rows ``[start, end)`` of the first dimension. safetensors returns a view into a
        memory map of the file, so only those rows' pages are read; the copy owns exactly
        its bytes."""
        t = self._file(name).get_slice(name)[start:end].clone()
        self.bytes_read[name] = self.bytes_read.get(name, 0) + t.numel() * t.element_size()
        return t


@contextlib.contextmanager
def open_checkpoint(path):
    """``with open_checkpoint(path) as ck:`` an :class:`OpenCheckpoint` of a checkpoint folder
    (every ``*.safetensors`` in it) or one file; closed on leaving the block."""
    from safetensors import safe_open  # looked up at call time

    path = Path(path)
    files = _files(path)
    # Each file is opened once: re-opening re-parses the header, which for a sharded model
    # file of ~15k tensors costs ~20 ms a tensor (minutes for a per-expert layout).
    with contextlib.ExitStack() as stack:
        handles = {f: stack.enter_context(safe_open(str(f), framework="pt", device="cpu")) for f in files}
        yield OpenCheckpoint(path, handles)


def layer_experts(ck: OpenCheckpoint, layer: int | str | None = None, prefix: str | None = None
                  ) -> tuple[str, str, int]:
    """``(prefix, layout, number of routed experts)`` of the MoE layer :func:`load` would read
    (``layer`` / ``prefix`` as for :func:`load`), from the tensor names and headers only."""
    prefix, layout, _ = _choose_layer(ck.names(), layer, prefix)
    if layout == "fused":
        return prefix, layout, ck.shape(prefix + "w13_weight")[0]
    if layout == "hf-fused":
        return prefix, layout, ck.shape(prefix + "experts.gate_up_proj")[0]
    ids = _expert_ids(prefix, ck.where)
    return prefix, layout, (ids[-1] + 1) if ids else 0


_PER_EXPERT = re.compile(r"^(?P<prefix>.*?)experts\.(?P<e>\d+)\.(?P<proj>gate_proj|up_proj|down_proj|w1|w2|w3)\.")
_FUSED = re.compile(r"^(?P<prefix>.*?)w13_weight$")
_HF_FUSED = re.compile(r"^(?P<prefix>.*?)experts\.gate_up_proj$")
#: the layer number in a prefix: ``layers.N.`` (transformers) or ``blocks.N.`` (Kimi-K2.5 as llmcompressor
#: saves it: ``language_model.model.blocks.N.``)
_LAYER_NO = re.compile(r"(?:^|\.)(?:layers|blocks)\.(\d+)\.")


def moe_layers(keys) -> list[tuple[str, str]]:
    """``(prefix, layout)`` of every MoE layer among tensor names ``keys``, in layer order.
    ``layout`` is ``fused`` (``w13_weight``), ``per-expert`` or ``hf-fused``
    (``experts.gate_up_proj``)."""
    found: dict[str, str] = {}
    for k in keys:
        for pat, layout in ((_FUSED, "fused"), (_PER_EXPERT, "per-expert"), (_HF_FUSED, "hf-fused")):
            m = pat.match(k)
            if m and not m.group("prefix").endswith("shared_"):
                found.setdefault(m.group("prefix"), layout)
                break

    def order(p: str):
        m = _LAYER_NO.search(p)
        return (int(m.group(1)) if m else -1, p)

    return sorted(found.items(), key=lambda kv: order(kv[0]))


def _find_prefix(keys: list[str]) -> tuple[str, str]:
    """The first MoE layer's ``(prefix, layout)``."""
    layers = moe_layers(keys)
    if not layers:
        raise CheckpointError("no MoE expert tensors found (looked for '*w13_weight', "
                              "'*experts.{e}.{gate,up,down}_proj.*' and '*experts.gate_up_proj')")
    return layers[0]


def _choose_layer(keys: list[str], layer, prefix) -> tuple[str, str, list[str]]:
    layers = moe_layers(keys)
    names = [p for p, _ in layers]
    if prefix is not None:
        for p, lay in layers:
            if p == prefix:
                return p, lay, names
        raise CheckpointError(f"prefix {prefix!r}: no MoE layer there (MoE layers: {names or 'none'})")
    if not layers:
        _find_prefix(keys)
    if layer is None:
        return layers[0][0], layers[0][1], names
    if isinstance(layer, str) and not layer.isdigit():
        return _choose_layer(keys, None, layer if layer.endswith(".") else layer + ".")
    n = int(layer)
    for p, lay in layers:
        m = _LAYER_NO.search(p)
        if m and int(m.group(1)) == n:
            return p, lay, names
    raise CheckpointError(f"layer {n}: not a MoE layer of this checkpoint (MoE layers: {names})")


def _layer_number(prefix: str) -> int | None:
    """The model's layer number in a layer prefix (``model.layers.3.mlp.`` -> 3), or None."""
    m = _LAYER_NO.search(prefix)
    return int(m.group(1)) if m else None


def _expert_ids(prefix: str, where) -> list[int]:
    ids = set()
    n = len(prefix)
    for k in where:
        if k.startswith(prefix + "experts."):
            head = k[n + len("experts."):].split(".", 1)[0]
            if head.isdigit():
                ids.add(int(head))
    return sorted(ids)

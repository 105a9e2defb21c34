"""The readers of the routed experts, one per way a format stores them, in one table
(:data:`READERS`). A reader turns a layer's expert tensors into megamoe's
``(w13, w2, w13_input_scale, w2_input_scale)``: ``w13`` NVFP4 ``[E, 2I, H/2]`` (rows in the
stored order; :func:`megamoe.checkpoint.readers.fused._apply_w13_layout` puts them in
``[gate; up]`` order), ``w2`` NVFP4 ``[E, H, I/2]``, the input scales float32 ``[E]`` or None.

To read a new format: write its reader (a function of :class:`LayerTensors`, reading every
tensor through ``get`` / ``get_experts``, which record what was read for the load report) and
add one :class:`Reader` row; teach :func:`megamoe.checkpoint.formats._detect_format` its
quantization config if it has one.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from megamoe.checkpoint.readers.fused import _load_fused
from megamoe.checkpoint.readers.hf_dense import _load_hf_fused
from megamoe.checkpoint.readers.modelopt_fused import _load_modelopt_transposed
from megamoe.checkpoint.readers.per_expert import _load_per_expert
from megamoe.checkpoint.report import CheckpointError

__all__ = ["Reader", "LayerTensors", "READERS", "choose_reader"]


@dataclass
class LayerTensors:
    """What a reader reads from: one layer of an open checkpoint.

    ``get(name, required=True)`` returns the tensor ``prefix + name`` (None, or a
    CheckpointError naming it, when absent); ``get_experts`` the same, but a stacked per-expert
    tensor ``[E, ...]`` only as the rows ``experts`` (a rank's expert range; None: all). Both
    have ``.has(name)`` and record every tensor read in ``report.tensors``. ``where`` is every
    tensor name of the checkpoint, ``fmt_name`` the format (:mod:`megamoe.checkpoint.formats`)."""

    get: Callable
    get_experts: Callable
    report: object
    prefix: str
    where: object
    fmt_name: str
    experts: tuple[int, int] | None


@dataclass(frozen=True)
class Reader:
    """One way the routed experts are stored: the tensor ``layout`` it reads
    (:func:`megamoe.checkpoint.moe_layers`: ``fused``, ``per-expert`` or ``hf-fused``), the
    ``formats`` that store that layout this way, the safetensors dtype its first expert tensor
    must have (``stored``; None: any), the function that reads it, and the layout as the load
    report names it (None: ``layout``)."""

    name: str
    layout: str
    formats: tuple[str, ...]
    read: Callable[[LayerTensors], tuple]
    stored: str | None = None
    report_layout: str | None = None


#: every format megamoe detects (:func:`megamoe.checkpoint.formats._detect_format`)
FORMATS = ("megamoe", "modelopt", "compressed-tensors", "unlabelled", "hf-dense")

#: (format, layout) -> reader: the first row whose layout, formats and stored dtype match.
#: A format and layout no row reads is refused, naming the layout.
READERS = (
    # megamoe's own writer (vLLM's names) and ModelOpt's fused export: w13_weight, w2_weight
    Reader("fused", "fused", ("megamoe", "modelopt", "unlabelled", "hf-dense"),
           lambda t: _load_fused(t.get_experts, t.report, t.prefix)),
    # ModelOpt's export of transformers' fused, transposed experts (Llama 4): packed uint8
    Reader("modelopt-fused-transposed", "hf-fused", ("modelopt",),
           lambda t: _load_modelopt_transposed(t.get_experts, t.report, t.prefix), stored="U8",
           report_layout="modelopt fused transposed (experts.gate_up_proj [E, H/2, 2I])"),
    # transformers' fused experts in a float dtype, quantized at load
    Reader("hf-dense", "hf-fused", ("megamoe", "unlabelled", "hf-dense"),
           lambda t: _load_hf_fused(t.get_experts, t.report, t.prefix)),
    # experts.{e}.{gate,up,down}_proj.*: ModelOpt's and compressed-tensors' names
    Reader("per-expert", "per-expert", FORMATS,
           lambda t: _load_per_expert(t.get, t.report, t.prefix, t.where, t.fmt_name, t.experts)),
)

_FIRST_TENSOR = {"fused": "w13_weight", "hf-fused": "experts.gate_up_proj"}


def choose_reader(fmt_name: str, layout: str, prefix: str, dtype: Callable[[str], str]) -> Reader:
    """The :data:`READERS` row for a layer of format ``fmt_name`` whose experts are stored in
    ``layout``; ``dtype(name)`` is the safetensors dtype of tensor ``prefix + name`` (read
    from the header, only where a row asks).

    Raises:
        CheckpointError: no reader reads this format's experts in this layout.
    """
    for r in READERS:
        if r.layout == layout and fmt_name in r.formats and \
                (r.stored is None or dtype(prefix + _FIRST_TENSOR[layout]) == r.stored):
            return r
    raise CheckpointError(f"{prefix}: a {fmt_name} checkpoint with {layout} expert tensors "
                          f"({'w13_weight' if layout == 'fused' else 'experts.gate_up_proj'}): megamoe reads "
                          f"this format's per-expert layout (experts.{{e}}.gate_proj...)")

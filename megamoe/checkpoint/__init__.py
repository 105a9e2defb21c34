"""NVFP4 MoE checkpoints: loading, validation, synthetic checkpoints (docs/SPEC.md §3.4).

The loader reads one MoE layer from a checkpoint folder (or one .safetensors file), from
the folder alone: the format from the quantization config, the routing from the
architecture named in ``config.json``, the activation mode from the quantization config,
the ``w13`` layout from the format or the architecture. Everything it decides is listed in
the load report (:class:`LoadReport`, ``megamoe info --checkpoint DIR``); what it cannot
read it refuses with a :class:`CheckpointError` naming the tensor or the config key.

Formats (:func:`load`; detected by :mod:`~megamoe.checkpoint.formats`, read by the readers of
:data:`megamoe.checkpoint.readers.READERS`):

* **ModelOpt NVFP4** (``hf_quant_config.json`` and/or ``quantization_config.quant_method =
  "modelopt"``; ``quant_algo`` ``NVFP4`` = W4A4, ``W4A16_NVFP4`` = weights only), per-expert
  layout ``experts.{e}.{gate,up,down}_proj.{weight, weight_scale, weight_scale_2,
  input_scale}``; the global scales multiply on decode.
* **compressed-tensors** ``nvfp4-pack-quantized`` (``quant_method = "compressed-tensors"``;
  ``input_activations`` present = W4A4, absent = W4A16), per-expert layout
  ``experts.{e}.{gate,up,down}_proj.{weight_packed, weight_scale, weight_global_scale,
  input_global_scale}``; the global scales are stored as **divisors** (shape ``[1]``) and
  are inverted at load (docs/FIELD_BUGS.md row 22).
* **fused** (megamoe's own writer, vLLM names): ``w13_weight`` u8 ``[E, 2I, H/2]``,
  ``w13_weight_scale`` e4m3 ``[E, 2I, H/16]``, ``w13_weight_scale_2`` f32 ``[E, 2]``,
  ``w13_input_scale`` f32 ``[E]``, ``w2_*`` likewise; the layer config in the file's
  ``megamoe.config`` metadata.
* **Hugging Face dense** fused experts (``experts.gate_up_proj`` ``[E, 2I, H]``,
  ``experts.down_proj``) in a float dtype: quantized at load, and reported.

Around the experts (:data:`ROUTER_NAMES`, :data:`SHARED_NAMINGS`): ``gate.weight`` (router),
``gate.e_score_correction_bias`` (DeepSeek's upstream name ``gate.bias``), ``gate.tid2eid``
(DeepSeek-V4 hash layers), the shared expert ``shared_experts.{gate,up,down}_proj`` (upstream
``shared_experts.w1/w3/w2``) in bf16 or NVFP4 (either format). Routed experts may be named
``experts.{e}.w1/w3/w2`` too. An expert weight stored in a float dtype is quantized at load
time and *reported* (never silently).

Per family (docs/SPEC.md §3.4.1): Llama 4's and gpt-oss's router ``router.weight``; MiniMax-M2's
block-level ``e_score_correction_bias``; Qwen2-MoE's and Llama 4's singular ``shared_expert.*``
and Qwen2-MoE's unquantized ``shared_expert_gate.weight``; ModelOpt's fused, transposed Llama 4
experts ``experts.gate_up_proj`` u8 ``[E, H/2, 2I]`` with ``_weight_scale`` / ``_weight_scale_2``
/ ``_input_scale`` (gpt-oss's with interleaved gate/up columns, reordered at load); gpt-oss's
expert biases (``experts.gate_up_proj_bias`` / ``experts.down_proj_bias``, per expert
``experts.{e}.{gate,up,down}_proj.bias``, megamoe's own ``w13_bias`` / ``w2_bias``;
:mod:`~megamoe.checkpoint.readers.biases`) and its router bias ``router.bias``; layers numbered
``layers.N`` or ``blocks.N``.

Every tensor under the layer's prefix is read, or the load fails naming the first that is
not (with or without ``config=``): a layer is never computed without one of its tensors. A
router tensor the routing would not use (a hash table in a top-k layer, a bias in a hash
layer, a shared expert with ``n_shared_experts=0``) fails the same way. The report lists every
tensor read and how (:attr:`LoadReport.read_as`).

The package, by part of the problem:

* :mod:`~megamoe.checkpoint.files`: the checkpoint's files (:func:`open_checkpoint`,
  :class:`OpenCheckpoint`) and its MoE layers (:func:`moe_layers`, :func:`layer_experts`);
* :mod:`~megamoe.checkpoint.formats`: the format, from the quantization config;
* :mod:`~megamoe.checkpoint.readers`: one reader per way the experts are stored, in the table
  :data:`~megamoe.checkpoint.readers.READERS` (``fused``: megamoe's own and ModelOpt's fused
  export; ``modelopt_fused``: ModelOpt's fused, transposed Llama 4 experts; ``per_expert``:
  ModelOpt's and compressed-tensors' per-expert tensors; ``hf_dense``: float experts
  quantized at load);
* :mod:`~megamoe.checkpoint.dense`: the router, its bias and hash table, the shared expert;
* :mod:`~megamoe.checkpoint.loader`: :func:`load` / :func:`load_open`, which put these
  together with the architecture's routing (one rule per ``model_type`` in
  :data:`megamoe.architectures.ARCHITECTURES`);
* :mod:`~megamoe.checkpoint.report`: :class:`LoadReport`, :class:`Loaded`, :class:`CheckpointError`;
* :mod:`~megamoe.checkpoint.synthetic`: :func:`synthetic_weights`, :func:`save`, :func:`write_synthetic`.
"""
from __future__ import annotations

from megamoe import nvfp4, reference  # noqa: F401  (names this module has always had)
from megamoe.architectures import UNSUPPORTED, UnknownArchitecture, architecture_routing  # noqa: F401
from megamoe.checkpoint.dense import ROUTER_NAMES, SHARED_NAMINGS, read_dense_tensors
from megamoe.checkpoint.files import OpenCheckpoint, layer_experts, moe_layers, open_checkpoint
from megamoe.checkpoint.loader import INPUT_SCALE_MODES, assemble_weights, load, load_open
from megamoe.checkpoint.readers.fused import W13_LAYOUTS
from megamoe.checkpoint.report import CheckpointError, Loaded, LoadReport
from megamoe.checkpoint.synthetic import SYNTHETIC_VOCAB, save, synthetic_weights, write_synthetic
from megamoe.presets import MoEConfig, get_preset  # noqa: F401
from megamoe.weights import MoEWeights  # noqa: F401

__all__ = ["CheckpointError", "LoadReport", "Loaded", "load", "moe_layers", "save", "write_synthetic",
           "synthetic_weights", "W13_LAYOUTS", "INPUT_SCALE_MODES", "OpenCheckpoint", "open_checkpoint",
           "layer_experts", "load_open", "SYNTHETIC_VOCAB", "ROUTER_NAMES", "SHARED_NAMINGS",
           "read_dense_tensors", "assemble_weights"]

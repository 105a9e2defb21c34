"""NVFP4 MoE checkpoints: loading, validation, synthetic checkpoints (docs/SPEC.md §3.4).

The loader reads one MoE layer from a checkpoint folder (or one .safetensors file), from
the folder alone: the format from the quantization config, the routing from the
architecture named in ``config.json``, the activation mode from the quantization config,
the ``w13`` layout from the format or the architecture. Everything it decides is listed in
the load report (:class:`LoadReport`, ``megamoe info --checkpoint DIR``); what it cannot
read it refuses with a :class:`CheckpointError` naming the tensor or the config key.

Formats (:func:`load`):

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
/ ``_input_scale``; layers numbered ``layers.N`` or ``blocks.N``. gpt-oss is refused with or
without ``config=``, naming what it needs and the tensors that would be dropped.

Every tensor under the layer's prefix is read, or the load fails naming the first that is
not (with or without ``config=``): a layer is never computed without one of its tensors. A
router tensor the routing would not use (a hash table in a top-k layer, a bias in a hash
layer, a shared expert with ``n_shared_experts=0``) fails the same way. The report lists every
tensor read and how (:attr:`LoadReport.read_as`).
"""
from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

from megamoe import nvfp4, reference
from megamoe.presets import MoEConfig, get_preset
from megamoe.routing import UNSUPPORTED, UnknownArchitecture, architecture_routing
from megamoe.weights import MoEWeights

log = logging.getLogger("megamoe.checkpoint")

__all__ = ["CheckpointError", "LoadReport", "Loaded", "load", "moe_layers", "save", "write_synthetic",
           "synthetic_weights", "W13_LAYOUTS", "INPUT_SCALE_MODES", "OpenCheckpoint", "open_checkpoint",
           "layer_experts", "load_open"]

#: fused gate/up row orders (docs/SPEC.md §3.3): ``gate-up`` = rows ``[gate; up]`` (megamoe's),
#: ``up-gate`` = ``[up; gate]``, ``interleaved`` = ``[g0, u0, g1, u1, ...]``.
W13_LAYOUTS = ("gate-up", "up-gate", "interleaved")
#: input-scale conventions (docs/SPEC.md §3.2): ``per-expert`` = as stored (a value shared by
#: all experts is broadcast); ``max`` = one value per GEMM, the max over all experts.
INPUT_SCALE_MODES = ("per-expert", "max")


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded; the message names the tensor or the config key."""


@dataclass
class LoadReport:
    """What the loader found, and every choice it made (``choices``, in order)."""

    path: str
    layout: str = "fused"
    prefix: str = ""
    format: str = "megamoe"
    producer: str = ""
    act_mode: str = ""
    w13_layout: str = "gate-up"
    input_scales: str = ""
    shared_expert: str = "none"
    moe_layers: list[str] = field(default_factory=list)
    routing: dict = field(default_factory=dict)
    choices: list[str] = field(default_factory=list)
    tensors: dict[str, str] = field(default_factory=dict)  # name -> "nvfp4" | "quantized-at-load" | dtype
    quantized_at_load: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    read_as: dict[str, str] = field(default_factory=dict)  # every tensor read -> "<role>: <how>"

    def summary(self) -> str:
        q = ", ".join(self.quantized_at_load) or "none"
        lines = [f"{self.path}: {self.format} ({self.producer or 'producer not stated'}), {self.layout} layout, "
                 f"layer {self.prefix!r}, {len(self.tensors)} tensors; quantized at load: {q}"]
        if self.moe_layers:
            lines.append(f"  MoE layers in the checkpoint: {', '.join(repr(p) for p in self.moe_layers)}")
        if self.act_mode:
            lines.append(f"  activations: {self.act_mode}; input scales: {self.input_scales or '-'}; "
                         f"w13 layout: {self.w13_layout}; shared expert: {self.shared_expert}")
        if self.routing:
            lines.append("  routing: " + ", ".join(f"{k}={v}" for k, v in self.routing.items()))
        lines += [f"  choice: {c}" for c in self.choices]
        lines += [f"  warning: {w}" for w in self.warnings]
        lines += [f"  read: {name}: {how}" for name, how in self.read_grouped()]
        return "\n".join(lines)

    def read_grouped(self) -> list[tuple[str, str]]:
        """:attr:`read_as` with the per-expert tensors of all experts on one line each
        (``experts.{0..7}.gate_proj.weight``), in name order."""
        groups: dict[tuple[str, str], list[int]] = {}
        for name, how in self.read_as.items():
            m = re.search(r"experts\.(\d+)\.", name)
            if m:
                key = (name[:m.start()] + "experts.{}." + name[m.end():], re.sub(r"^expert \d+ ", "experts' ", how))
                groups.setdefault(key, []).append(int(m.group(1)))
            else:
                groups.setdefault((name, how), [])
        out = []
        for (name, how), ids in sorted(groups.items()):
            if ids:
                ids.sort()
                span = f"{ids[0]}..{ids[-1]}" if ids == list(range(ids[0], ids[-1] + 1)) else ",".join(map(str, ids))
                name = name.replace("{}", "{" + span + "}")
            out.append((name, how))
        return out


@dataclass
class Loaded:
    weights: MoEWeights
    config: MoEConfig
    report: LoadReport


# ------------------------------------------------------------------------------------------
# synthetic weights
# ------------------------------------------------------------------------------------------

def _with_outliers(shape, std, gen, device, frac=1e-3, lo=5.0, hi=20.0):
    w = torch.randn(shape, generator=gen, device=device) * std
    mask = torch.rand(shape, generator=gen, device=device) < frac
    boost = lo + (hi - lo) * torch.rand(shape, generator=gen, device=device)
    return torch.where(mask, w * boost, w)


def _amax_scale(x: torch.Tensor) -> torch.Tensor:
    return nvfp4.default_global_scale(x)


#: Token ids in a synthetic hash-routed layer's ``tid2eid`` table.
SYNTHETIC_VOCAB = 4096


def synthetic_weights(cfg: MoEConfig, seed: int = 0, device=None, progress: bool = False,
                      static_input_scales: bool = True) -> MoEWeights:
    """Realistic random NVFP4 weights for ``cfg``.

    Gaussian weights with 0.1% outliers (5-20x), per-expert global scales from each
    tensor's amax, gate and up of an expert scaled differently (up/gate magnitude ratio
    between 0.1 and 10, so their ``weight_scale_2`` differ), static input scales calibrated
    on 64-512 random tokens per expert (more for small shapes), a router (and correction bias for sigmoid scoring), and
    the shared expert in bf16. Deterministic for a given ``seed`` and device type.
    """
    device = torch.device(device or "cpu")
    gen = torch.Generator(device=device).manual_seed(seed)
    e, h, i = cfg.num_experts, cfg.hidden_size, cfg.intermediate_size
    w13_data = torch.empty((e, 2 * i, h // 2), dtype=torch.uint8, device=device)
    w13_scale = torch.empty((e, 2 * i, h // 16), dtype=torch.float8_e4m3fn, device=device)
    w13_gs = torch.empty((e, 2), dtype=torch.float32, device=device)
    w2_data = torch.empty((e, h, i // 2), dtype=torch.uint8, device=device)
    w2_scale = torch.empty((e, h, i // 16), dtype=torch.float8_e4m3fn, device=device)
    w2_gs = torch.empty((e,), dtype=torch.float32, device=device)
    in1 = torch.empty((e,), dtype=torch.float32, device=device)
    in2 = torch.empty((e,), dtype=torch.float32, device=device)
    calib_tokens = max(64, min(512, 2**27 // (h * i)))
    ratio = 10 ** (2 * torch.rand((e,), generator=gen, device=device) - 1)  # up/gate in [0.1, 10]

    it = range(e)
    if progress:
        from tqdm import tqdm

        it = tqdm(it, desc=f"synthesizing {e} experts", unit="expert")
    for ex in it:
        gate = _with_outliers((i, h), h ** -0.5, gen, device)
        up = _with_outliers((i, h), h ** -0.5, gen, device) * ratio[ex]
        down = _with_outliers((h, i), i ** -0.5, gen, device)
        gs = torch.stack([_amax_scale(gate), _amax_scale(up)])
        q13 = nvfp4.quantize(torch.cat([gate, up]), gs)
        q2 = nvfp4.quantize(down, _amax_scale(down))
        w13_data[ex], w13_scale[ex], w13_gs[ex] = q13.data, q13.scale, q13.global_scale
        w2_data[ex], w2_scale[ex], w2_gs[ex] = q2.data, q2.scale, q2.global_scale
        # calibration: amax of this expert's inputs over a few hundred tokens, as ModelOpt records
        xc = _with_outliers((calib_tokens, h), 1.0, gen, device, frac=1e-3, lo=3.0, hi=8.0)
        in1[ex] = _amax_scale(xc)
        gu = nvfp4.dequantize(nvfp4.quantize(xc, in1[ex])) @ nvfp4.dequantize(q13).T
        hmid = reference.swiglu(gu, i, cfg.swiglu_limit)
        in2[ex] = _amax_scale(hmid)

    router = (torch.randn((e, h), generator=gen, device=device) * h ** -0.5).to(torch.bfloat16)
    bias = (torch.randn((e,), generator=gen, device=device) * 0.01) if cfg.scoring != "softmax" else None
    if cfg.hash_routing:
        bias = None  # (drawn all the same: the seed's later draws stay those without hash routing)
    shared_gu = shared_down = None
    if cfg.n_shared_experts:
        is_ = (cfg.shared_intermediate_size or i) * cfg.n_shared_experts
        shared_gu = (torch.randn((2 * is_, h), generator=gen, device=device) * h ** -0.5).to(torch.bfloat16)
        shared_down = (torch.randn((h, is_), generator=gen, device=device) * is_ ** -0.5).to(torch.bfloat16)
    tid2eid = None
    if cfg.hash_routing:
        # a token-id table of SYNTHETIC_VOCAB ids, each with top_k distinct experts (drawn last, so
        # the other weights of a seed are those of the same config without hash routing)
        tid2eid = torch.rand((SYNTHETIC_VOCAB, e), generator=gen, device=device).argsort(dim=1)[:, :cfg.top_k]
    return MoEWeights(
        w13=nvfp4.NVFP4Tensor(w13_data, w13_scale, w13_gs),
        w2=nvfp4.NVFP4Tensor(w2_data, w2_scale, w2_gs),
        w13_input_scale=in1 if static_input_scales else None,
        w2_input_scale=in2 if static_input_scales else None,
        router_weight=router,
        router_bias=bias,
        shared_gate_up=shared_gu,
        shared_down=shared_down,
        tid2eid=tid2eid,
    )


# ------------------------------------------------------------------------------------------
# writing
# ------------------------------------------------------------------------------------------

def save(path, weights: MoEWeights, cfg: MoEConfig) -> Path:
    """Write ``weights`` in the fused ModelOpt layout, with ``cfg`` in the metadata."""
    from safetensors.torch import save_file

    t = {
        "w13_weight": weights.w13.data,
        "w13_weight_scale": weights.w13.scale,
        "w13_weight_scale_2": weights.w13.global_scale,
        "w2_weight": weights.w2.data,
        "w2_weight_scale": weights.w2.scale,
        "w2_weight_scale_2": weights.w2.global_scale,
    }
    optional = {
        "w13_input_scale": weights.w13_input_scale,
        "w2_input_scale": weights.w2_input_scale,
        "gate.weight": weights.router_weight,
        "gate.e_score_correction_bias": weights.router_bias,
        "gate.tid2eid": weights.tid2eid,
        "shared_experts.gate_up_proj.weight": weights.shared_gate_up,
        "shared_experts.down_proj.weight": weights.shared_down,
    }
    t.update({k: v for k, v in optional.items() if v is not None})
    t = {k: v.detach().cpu().contiguous() for k, v in t.items()}
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".partial")
    save_file(t, str(tmp), metadata={"format": "modelopt-nvfp4", "quant_algo": "NVFP4",
                                     "megamoe.config": json.dumps(cfg.to_dict())})
    os.replace(tmp, path)  # a crash never leaves a half-written checkpoint under the real name
    return path


def write_synthetic(path, preset: str = "tiny", seed: int = 0, progress: bool = False, device=None,
                    **config_overrides) -> Path:
    """Write a synthetic checkpoint of ``preset`` (docs/SPEC.md §3) to ``path`` (.safetensors)."""
    cfg = get_preset(preset).with_(**config_overrides) if config_overrides else get_preset(preset)
    w = synthetic_weights(cfg, seed=seed, device=device, progress=progress)
    return save(path, w, cfg)


# ------------------------------------------------------------------------------------------
# loading
# ------------------------------------------------------------------------------------------

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


# ---------------------------------------------------------------- open checkpoint (public)

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


# ---------------------------------------------------------------- formats

@dataclass
class _Format:
    name: str                 # "modelopt" | "compressed-tensors" | "megamoe" | "unlabelled" | "hf-dense"
    producer: str = ""
    act_mode: str | None = None   # declared by the quantization config; None: not declared
    divisor: bool = False         # global scales stored as divisors (compressed-tensors)
    source: str = ""


def _read_json(p: Path, report: "LoadReport") -> dict | None:
    if not p.exists():
        return None
    try:
        return json.loads(p.read_text())
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{p}: unreadable JSON ({exc})") from None


def _detect_format(meta: dict, hf: dict | None, hq: dict | None, layout: str) -> _Format:
    qc = (hf or {}).get("quantization_config")
    if "megamoe.config" in meta:
        return _Format("megamoe", "megamoe", None, False, "safetensors metadata megamoe.config")
    if hq is not None or (qc and qc.get("quant_method") == "modelopt"):
        algo_hq = ((hq or {}).get("quantization") or {}).get("quant_algo")
        algo_qc = (qc or {}).get("quant_algo") if qc and qc.get("quant_method") == "modelopt" else None
        if algo_hq and algo_qc and algo_hq != algo_qc:
            raise CheckpointError(f"hf_quant_config.json quantization.quant_algo={algo_hq!r} but config.json "
                                  f"quantization_config.quant_algo={algo_qc!r}")
        algo = algo_hq or algo_qc
        where = "hf_quant_config.json quantization.quant_algo" if algo_hq else "config.json quantization_config.quant_algo"
        modes = {"NVFP4": "w4a4", "W4A16_NVFP4": "w4a16"}
        if algo not in modes:
            raise CheckpointError(f"{where}={algo!r}: not an NVFP4 MoE checkpoint megamoe reads "
                                  f"(supported: {', '.join(modes)})")
        prod = ((hq or {}).get("producer") or (qc or {}).get("producer") or {})
        return _Format("modelopt", f"{prod.get('name', 'modelopt')} {prod.get('version', '')}".strip(),
                       modes[algo], False, f"{where}={algo!r}")
    if qc:
        qm = qc.get("quant_method")
        if qm != "compressed-tensors":
            raise CheckpointError(f"config.json quantization_config.quant_method={qm!r}: not supported "
                                  f"(modelopt, compressed-tensors)")
        return _ct_format(qc)
    if layout == "hf-fused":
        return _Format("hf-dense", "", None, False, "no quantization config; expert weights in a float dtype")
    return _Format("unlabelled", "", None, False, "no quantization config; naming from the tensors")


def _ct_format(qc: dict) -> _Format:
    groups = qc.get("config_groups") or {}
    if not groups:
        raise CheckpointError("config.json quantization_config.config_groups: missing (compressed-tensors)")
    found = None
    others = []
    for gname, g in groups.items():
        fmt = g.get("format") or qc.get("format")
        w = g.get("weights") or {}
        key = f"config.json quantization_config.config_groups.{gname}"
        if fmt != "nvfp4-pack-quantized":
            # another scheme for other layers (e.g. FP8 attention); the expert tensors' names and
            # dtypes show whether the experts are NVFP4 (anything else is refused at the tensor)
            others.append(f"{gname} ({fmt})")
            continue
        if (w.get("num_bits"), w.get("type"), w.get("group_size"), w.get("strategy", "tensor_group")) != \
                (4, "float", 16, "tensor_group"):
            raise CheckpointError(f"{key}.weights={w!r}: not NVFP4 (4-bit float, group 16, tensor_group)")
        ia = g.get("input_activations")
        if ia is None:
            mode = "w4a16"
        else:
            if (ia.get("num_bits"), ia.get("type"), ia.get("group_size"), ia.get("strategy", "tensor_group")) != \
                    (4, "float", 16, "tensor_group"):
                raise CheckpointError(f"{key}.input_activations={ia!r}: not NVFP4 activations")
            if ia.get("dynamic") not in ("local", False):
                raise CheckpointError(f"{key}.input_activations.dynamic={ia.get('dynamic')!r}: megamoe needs a "
                                      f"static global scale (input_global_scale; dynamic 'local')")
            mode = "w4a4"
        if found is not None and found[0] != mode:
            raise CheckpointError(f"{key}: activation mode {mode} differs from group {found[1]}'s {found[0]}")
        found = (mode, gname)
    if found is None:
        raise CheckpointError(f"config.json quantization_config.config_groups: no 'nvfp4-pack-quantized' group "
                              f"({', '.join(others)}): megamoe reads NVFP4 experts only")
    ver = qc.get("version", "")
    return _Format("compressed-tensors", f"compressed-tensors {ver}".strip(), found[0], True,
                   f"config.json quantization_config (nvfp4-pack-quantized, "
                   f"input_activations {'present' if found[0] == 'w4a4' else 'null'}"
                   + (f"; other groups not NVFP4: {', '.join(others)}" if others else "") + ")")


# ---------------------------------------------------------------- scale checks

def _check_scales(name: str, t: torch.Tensor, what: str) -> None:
    """Every value of a global / input scale finite and > 0, else a CheckpointError naming
    ``name`` (docs/FIELD_BUGS.md row 17)."""
    tf = t.float()
    bad = ~(torch.isfinite(tf) & (tf > 0))
    if bool(bad.any()):
        idx = [int(i) for i in bad.nonzero()[0].tolist()] if tf.dim() else []
        v = float(tf[tuple(idx)]) if idx else float(tf)
        at = f" at index {tuple(idx)}" if idx else ""
        raise CheckpointError(f"{name}: {what} {v!r}{at}; every {what} must be finite and > 0")


def _expert_scale_check(name: str, t: torch.Tensor, what: str) -> None:
    """Like :func:`_check_scales` for a stacked ``[E]`` / ``[E, 2]`` tensor; names the expert."""
    tf = t.float()
    bad = ~(torch.isfinite(tf) & (tf > 0))
    if bool(bad.any()):
        idx = bad.nonzero()[0].tolist()
        e = idx[0] if idx else 0
        part = {0: " (gate)", 1: " (up)"}.get(idx[1], "") if len(idx) > 1 else ""
        raise CheckpointError(f"{name}: expert {e}{part}: {what} {float(tf[tuple(idx)])!r}; "
                              f"every {what} must be finite and > 0")


# ---------------------------------------------------------------- fused layout

_FP8 = {torch.float8_e4m3fn, torch.float8_e5m2, getattr(torch, "float8_e4m3fnuz", None),
        getattr(torch, "float8_e5m2fnuz", None)} - {None}


def _not_fp8(name: str, data: torch.Tensor) -> None:
    """An FP8 weight needs its own scales: never 'quantized at load' as if it were plain floats."""
    if data.dtype in _FP8:
        raise CheckpointError(f"{name}: dtype {data.dtype}: FP8 expert weights are not read (NVFP4 or "
                              f"bf16/fp16/fp32 only)")


def _check_k(name: str, data: torch.Tensor, scale: torch.Tensor | None) -> int:
    k = data.shape[-1] * 2 if data.dtype == torch.uint8 else data.shape[-1]
    if k % 16:
        raise CheckpointError(f"{name}: K={k} is not a multiple of 16 (NVFP4 blocks of 16)")
    if scale is not None and scale.shape[-1] * 16 != k:
        raise CheckpointError(f"{name}_scale: shape {tuple(scale.shape)} does not match K={k} (expected K/16={k // 16})")
    if scale is not None and scale.shape[:-1] != data.shape[:-1]:
        raise CheckpointError(f"{name}_scale: shape {tuple(scale.shape)} does not match {name} {tuple(data.shape)}")
    return k


def _as_nvfp4(get, report, name: str, gs_name: str, gs_rows: int, prefix: str) -> nvfp4.NVFP4Tensor:
    """Read ``name`` as NVFP4 [E, N, K]; quantize (and report) if it is stored in a float dtype."""
    data = get(name)
    if data.dim() != 3:
        raise CheckpointError(f"{prefix}{name}: expected 3 dims [E, N, K/2], got shape {tuple(data.shape)}")
    _not_fp8(prefix + name, data)
    if torch.is_floating_point(data):
        _check_k(prefix + name, data, None)
        e, n, k = data.shape
        if n % gs_rows:
            raise CheckpointError(f"{prefix}{name}: {n} rows cannot split into {gs_rows} equal halves")
        rows = data.float().view(e, gs_rows, n // gs_rows, k)
        gs = torch.stack([torch.stack([nvfp4.default_global_scale(rows[a, b]) for b in range(gs_rows)])
                          for a in range(e)])  # [E, gs_rows]: gate and up keep their own scale
        q = nvfp4.quantize(data.float(), gs if gs_rows > 1 else gs[:, 0])
        report.quantized_at_load.append(prefix + name)
        report.tensors[prefix + name] = f"quantized-at-load (stored {data.dtype})"
        return q
    if data.dtype != torch.uint8:
        raise CheckpointError(f"{prefix}{name}: dtype {data.dtype}, expected uint8 (packed E2M1) or a float dtype")
    scale = get(name + "_scale")
    if scale.dtype != torch.float8_e4m3fn:
        raise CheckpointError(f"{prefix}{name}_scale: dtype {scale.dtype}, expected float8_e4m3fn")
    _check_k(prefix + name, data, scale)
    gs = get(gs_name).float()
    want = (data.shape[0], gs_rows) if gs_rows > 1 else (data.shape[0],)
    if gs_rows > 1 and tuple(gs.shape) == (data.shape[0],):
        gs = gs.unsqueeze(1).expand(-1, gs_rows).contiguous()  # one scale for gate and up
    if tuple(gs.shape) != want:
        raise CheckpointError(f"{prefix}{gs_name}: shape {tuple(gs.shape)}, expected {want}")
    _expert_scale_check(prefix + gs_name, gs, "global scale")
    report.tensors[prefix + name] = "nvfp4"
    return nvfp4.NVFP4Tensor(data, scale, gs)


def _fused_input_scale(get, name: str, e: int, prefix: str) -> torch.Tensor | None:
    t = get(name, required=False)
    if t is None:
        return None
    t = t.float()
    if t.numel() == 1:
        t = t.reshape(1).expand(e).contiguous()  # one value for the layer: shared by all experts
    elif t.dim() == 2 and t.shape[0] == e:
        t = t.amax(dim=1)  # separate gate/up values: the larger (docs/SPEC.md §3.2)
    t = t.reshape(-1)
    if t.numel() != e:
        raise CheckpointError(f"{prefix}{name}: {t.numel()} values, expected one per expert ({e}) or one")
    _expert_scale_check(prefix + name, t, "input scale")
    return t


def _load_fused(get, report, prefix):
    w13 = _as_nvfp4(get, report, "w13_weight", "w13_weight_scale_2", 2, prefix)
    w2 = _as_nvfp4(get, report, "w2_weight", "w2_weight_scale_2", 1, prefix)
    e = w13.data.shape[0]
    return w13, w2, _fused_input_scale(get, "w13_input_scale", e, prefix), _fused_input_scale(get, "w2_input_scale", e, prefix)


def _load_hf_fused(get, report, prefix):
    """transformers' fused experts ``experts.gate_up_proj [E, 2I, H]`` + ``experts.down_proj
    [E, H, I]`` in a float dtype: quantized at load (reported)."""
    w13 = _as_nvfp4(lambda n, required=True: get(n.replace("w13_weight", "experts.gate_up_proj"), required),
                    report, "w13_weight", "", 2, prefix)
    w2 = _as_nvfp4(lambda n, required=True: get(n.replace("w2_weight", "experts.down_proj"), required),
                   report, "w2_weight", "", 1, prefix)
    report.quantized_at_load[:] = [n.replace("w13_weight", "experts.gate_up_proj").replace("w2_weight", "experts.down_proj")
                                   for n in report.quantized_at_load]
    return w13, w2, None, None


def _load_modelopt_transposed(get, report, prefix):
    """ModelOpt's export of transformers' fused, transposed experts (Llama 4): ``experts.gate_up_proj``
    u8 ``[E, H/2, 2I]`` (packed along H, the GEMM's K), ``_weight_scale`` e4m3 ``[E, H/16, 2I]``,
    ``_weight_scale_2`` and ``_input_scale`` one value (or one per expert); ``experts.down_proj``
    ``[E, I/2, H]`` likewise. Transposed to megamoe's ``[E, N, K/2]`` (exact: a byte holds two
    consecutive K values either way)."""
    out = []
    for name, gs_rows in (("experts.gate_up_proj", 2), ("experts.down_proj", 1)):
        data = get(name)
        if data.dim() != 3 or data.dtype != torch.uint8:
            raise CheckpointError(f"{prefix}{name}: {data.dtype} {tuple(data.shape)}; a ModelOpt NVFP4 fused "
                                  f"expert tensor is uint8 [E, K/2, N]")
        scale = get(name + "_weight_scale")
        if scale.dtype != torch.float8_e4m3fn or scale.dim() != 3 or scale.shape[0] != data.shape[0] \
                or scale.shape[2] != data.shape[2] or scale.shape[1] * 8 != data.shape[1]:
            raise CheckpointError(f"{prefix}{name}_weight_scale: {scale.dtype} {tuple(scale.shape)}; expected "
                                  f"float8_e4m3fn [E, K/16, N] for {name} {tuple(data.shape)}")
        e = data.shape[0]
        gs = get(name + "_weight_scale_2").float()
        if gs.numel() == 1:
            gs = gs.reshape(1).expand(e).contiguous()
        if gs.numel() != e:
            raise CheckpointError(f"{prefix}{name}_weight_scale_2: {gs.numel()} values, expected one or one per "
                                  f"expert ({e})")
        gs = gs.reshape(e)
        _expert_scale_check(prefix + name + "_weight_scale_2", gs, "global scale")
        if gs_rows > 1:
            gs = gs.unsqueeze(1).expand(e, gs_rows).contiguous()  # one scale for gate and up
        q = nvfp4.NVFP4Tensor(data.transpose(1, 2).contiguous(), scale.transpose(1, 2).contiguous(), gs)
        _check_k(prefix + name, q.data, q.scale)
        report.tensors[prefix + name] = "nvfp4"
        out.append(q)
        out.append(_fused_input_scale(get, name + "_input_scale", e, prefix))
    w13, in1, w2, in2 = out
    return w13, w2, in1, in2


def _apply_w13_layout(w13: nvfp4.NVFP4Tensor, layout: str) -> nvfp4.NVFP4Tensor:
    """Rows of a fused ``[E, 2I, ...]`` gate/up tensor reordered to ``[gate; up]`` (exact: rows
    are independent in NVFP4)."""
    if layout == "gate-up":
        return w13
    n = w13.data.shape[1]
    if layout == "up-gate":
        perm = torch.cat([torch.arange(n // 2, n), torch.arange(0, n // 2)])
        gs = w13.global_scale.flip(-1) if w13.global_scale.dim() == 2 else w13.global_scale
    elif layout == "interleaved":
        perm = torch.cat([torch.arange(0, n, 2), torch.arange(1, n, 2)])
        gs = w13.global_scale
        if gs.dim() == 2 and not torch.equal(gs[:, 0], gs[:, 1]):
            raise CheckpointError("w13_weight_scale_2: separate gate/up scales cannot apply to interleaved rows")
    else:
        raise CheckpointError(f"w13_layout={layout!r}: expected one of {W13_LAYOUTS}")
    perm = perm.to(w13.data.device)
    return nvfp4.NVFP4Tensor(w13.data[:, perm].contiguous(), w13.scale[:, perm].contiguous(), gs.contiguous())


# ---------------------------------------------------------------- per-expert layout

# tensor names of one projection, per format: (data, block scales, global scale, input scale)
_NAMES = {
    "modelopt": ("weight", "weight_scale", "weight_scale_2", "input_scale"),
    "compressed-tensors": ("weight_packed", "weight_scale", "weight_global_scale", "input_global_scale"),
}


def _has(get, name: str) -> bool:
    """Whether tensor ``name`` exists, without reading it where ``get`` can tell (``get.has``)."""
    has = getattr(get, "has", None)
    return has(name) if has is not None else get(name, required=False) is not None


def _proj_names(get, base: str) -> tuple[str, tuple]:
    """The naming of projection ``base`` (ModelOpt or compressed-tensors), from its tensors."""
    if _has(get, base + "weight_packed"):
        return "compressed-tensors", _NAMES["compressed-tensors"]
    return "modelopt", _NAMES["modelopt"]


def _scalar_scale(name: str, t: torch.Tensor, divisor: bool, what: str) -> torch.Tensor:
    """A per-tensor scale (shape [], [1]) as a float32 decode multiplier; a divisor is inverted."""
    if t.numel() != 1:
        raise CheckpointError(f"{name}: shape {tuple(t.shape)}, expected one value ([] or [1])")
    _check_scales(name, t, what + (" (a divisor)" if divisor else ""))
    v = t.float().reshape(())
    return torch.reciprocal(v) if divisor else v


def _read_proj(get, report, prefix: str, base: str, fmt_name: str | None = None):
    """One projection ``base`` (e.g. ``experts.3.gate_proj.``) -> (NVFP4Tensor [N, K],
    input decode scale or None, naming used, shapes {suffix: shape})."""
    naming, (dn, sn, gn, inn) = _proj_names(get, base)
    if fmt_name is not None and fmt_name in _NAMES and naming != fmt_name and not _has(get, base + "weight"):
        raise CheckpointError(f"{prefix}{base}: {naming} tensor names in a {fmt_name} checkpoint")
    divisor = naming == "compressed-tensors"
    full = prefix + base
    data = get(base + dn, required=False)
    shapes: dict[str, tuple] = {}
    if data is None and naming == "compressed-tensors":
        data = get(base + "weight")  # an unquantized (ignored) module
    elif data is None:
        data = get(base + dn)  # raises, naming it
    shapes[dn] = tuple(data.shape)
    if data.dim() != 2:
        raise CheckpointError(f"{full}{dn}: expected 2 dims [N, K/2], got shape {tuple(data.shape)}")
    _not_fp8(full + dn, data)
    if torch.is_floating_point(data):
        _check_k(full + dn, data, None)
        q = nvfp4.quantize(data.float(), nvfp4.default_global_scale(data))
        report.quantized_at_load.append(full + dn)
        report.tensors[full + dn] = f"quantized-at-load (stored {data.dtype})"
    else:
        if data.dtype != torch.uint8:
            raise CheckpointError(f"{full}{dn}: dtype {data.dtype}, expected uint8 (packed E2M1) or a float dtype")
        scale = get(base + sn)
        shapes[sn] = tuple(scale.shape)
        if scale.dtype != torch.float8_e4m3fn:
            raise CheckpointError(f"{full}{sn}: dtype {scale.dtype}, expected float8_e4m3fn")
        _check_k(full + dn, data, scale)
        gs_t = get(base + gn)
        shapes[gn] = tuple(gs_t.shape)
        q = nvfp4.NVFP4Tensor(data, scale, _scalar_scale(full + gn, gs_t, divisor, "global scale"))
        report.tensors[full + dn] = "nvfp4"
    isc = get(base + inn, required=False)
    if isc is not None:
        shapes[inn] = tuple(isc.shape)
        isc = _scalar_scale(full + inn, isc, divisor, "input scale")
    return q, isc, naming, shapes


def _expert_ids(prefix: str, where) -> list[int]:
    ids = set()
    n = len(prefix)
    for k in where:
        if k.startswith(prefix + "experts."):
            head = k[n + len("experts."):].split(".", 1)[0]
            if head.isdigit():
                ids.add(int(head))
    return sorted(ids)


def _load_per_expert(get, report, prefix, where, fmt_name: str | None = None, experts=None):
    """Experts ``experts = (start, end)`` (default all) of the per-expert layout, stacked."""
    ids = _expert_ids(prefix, where)
    if not ids:
        raise CheckpointError(f"{prefix}experts.0.*: no expert tensors")
    e = ids[-1] + 1
    missing = sorted(set(range(e)) - set(ids))
    if missing:
        raise CheckpointError(f"{prefix}experts.{missing[0]}.*: expert {missing[0]} is missing "
                              f"(experts 0..{e - 1} expected; none of its tensors are in the checkpoint)")
    projs = {"gate": ("gate_proj", "w1"), "up": ("up_proj", "w3"), "down": ("down_proj", "w2")}

    def base_of(ex, proj):
        for name in projs[proj]:
            b = f"experts.{ex}.{name}."
            if any(_has(get, b + s) for s in ("weight", "weight_packed")):
                return b
        return f"experts.{ex}.{projs[proj][0]}."

    parts: dict[str, list] = {"gate": [], "up": [], "down": []}
    inputs: dict[str, list] = {"gate": [], "up": [], "down": []}
    first_shapes: dict[str, dict] = {}
    for ex in range(*(experts or (0, e))):
        for proj in ("gate", "up", "down"):
            base = base_of(ex, proj)
            try:
                q, isc, naming, shapes = _read_proj(get, report, prefix, base, fmt_name)
            except CheckpointError as exc:
                msg = str(exc)
                if ": missing" in msg:
                    raise CheckpointError(f"{msg} (expert {ex}; the checkpoint has experts 0..{e - 1})") from None
                raise CheckpointError(f"{msg} (expert {ex})") from None
            ref = first_shapes.setdefault(proj, {"shapes": shapes, "expert": ex, "input": isc is not None})
            for suffix, shp in shapes.items():
                want = ref["shapes"].get(suffix)
                if want is not None and want != shp:
                    raise CheckpointError(f"{prefix}{base}{suffix}: shape {shp} for expert {ex}, but expert "
                                          f"{ref['expert']} has {want}: experts disagree")
            if set(shapes) != set(ref["shapes"]) or (isc is not None) != ref["input"]:
                have = set(ref["shapes"]) | ({_NAMES[naming][3]} if ref["input"] else set())
                mine = set(shapes) | ({_NAMES[naming][3]} if isc is not None else set())
                gone = sorted(have - mine) or sorted(mine - have)
                who = ex if have - mine else ref["expert"]
                raise CheckpointError(f"{prefix}experts.{who}.{base.split('.')[2]}.{gone[0]}: missing for expert "
                                      f"{who} (present for expert {ex if who != ex else ref['expert']})")
            parts[proj].append(q)
            inputs[proj].append(isc)
    for proj in ("gate", "up", "down"):
        shapes = {tuple(q.data.shape) for q in parts[proj]}
        if len(shapes) != 1:
            raise CheckpointError(f"{prefix}experts.*.{proj}_proj.weight: experts disagree on shape: {sorted(shapes)}")
    if parts["gate"][0].data.shape != parts["up"][0].data.shape:
        raise CheckpointError(f"{prefix}experts.0.up_proj: shape {tuple(parts['up'][0].shape)} differs from "
                              f"gate_proj {tuple(parts['gate'][0].shape)}")
    w13 = nvfp4.NVFP4Tensor(
        torch.stack([torch.cat([g.data, u.data]) for g, u in zip(parts["gate"], parts["up"])]),
        torch.stack([torch.cat([g.scale, u.scale]) for g, u in zip(parts["gate"], parts["up"])]),
        torch.stack([torch.stack([g.global_scale, u.global_scale]) for g, u in zip(parts["gate"], parts["up"])]),
    )
    w2 = nvfp4.NVFP4Tensor(torch.stack([d.data for d in parts["down"]]), torch.stack([d.scale for d in parts["down"]]),
                           torch.stack([d.global_scale for d in parts["down"]]))
    s1 = s2 = None
    if inputs["gate"][0] is not None or inputs["up"][0] is not None:
        g = torch.stack(inputs["gate"])
        u = torch.stack(inputs["up"])
        differ = [(experts or (0,))[0] + j for j in (g != u).nonzero().flatten().tolist()]
        if differ:
            report.warnings.append(f"experts {differ[:8]}{'...' if len(differ) > 8 else ''}: gate and up input "
                                   f"scales differ; using the larger (docs/SPEC.md §3.2)")
        s1 = torch.maximum(g, u)
    if inputs["down"][0] is not None:
        s2 = torch.stack(inputs["down"])
    return w13, w2, s1, s2


# ---------------------------------------------------------------- dense parts

#: names of the router tensors after the layer prefix, in the order they are looked for:
#: transformers' names first, then DeepSeek's upstream ones (llmcompressor's save of DeepSeek-V4).
ROUTER_NAMES = {
    # Llama 4 and gpt-oss name the router "router"
    "router": ("gate.weight", "router.weight"),
    # MiniMax-M2 keeps the bias in the block, not the router
    "bias": ("gate.e_score_correction_bias", "gate.bias", "e_score_correction_bias"),
    "tid2eid": ("gate.tid2eid",),
    # Qwen2-MoE: the shared expert's output scaled by sigmoid(x · g)
    "shared_gate": ("shared_expert_gate.weight",),
}
#: the shared expert's projections, per naming: transformers' (gate/up/down_proj), DeepSeek's
#: upstream (w1 = gate, w3 = up, w2 = down), and the singular ``shared_expert`` of Qwen2-MoE
#: and Llama 4.
SHARED_NAMINGS = (("shared_experts.gate_proj.", "shared_experts.up_proj.", "shared_experts.down_proj."),
                  ("shared_experts.w1.", "shared_experts.w3.", "shared_experts.w2."),
                  ("shared_expert.gate_proj.", "shared_expert.up_proj.", "shared_expert.down_proj."))


def _has_name(get_optional, name: str) -> bool:
    has = getattr(get_optional, "has", None)
    return has(name) if has is not None else get_optional(name) is not None


def _one_of(get_optional, prefix: str, names: tuple[str, ...]):
    """The tensor stored under one of ``names`` (aliases), or None; two of them present is refused."""
    present = [n for n in names if _has_name(get_optional, n)]
    if len(present) > 1:
        raise CheckpointError(f"{prefix}{present[0]} and {prefix}{present[1]}: both present; they are two names "
                              f"for one tensor, and megamoe does not choose between them")
    return get_optional(present[0]) if present else None


def _shared_naming(get_optional, prefix: str) -> tuple[str, str, str] | None:
    """The shared expert's projection bases (gate, up, down) under the naming the checkpoint
    uses, or None when it has no such tensors."""
    found = [bases for bases in SHARED_NAMINGS
             if any(_has_name(get_optional, b + s) for b in bases for s in ("weight", "weight_packed"))]
    if len(found) > 1:
        raise CheckpointError(f"{prefix}{found[0][0]}* and {prefix}{found[1][0]}*: two shared experts under two "
                              f"namings")
    return found[0] if found else None


def _shared_nvfp4(get_optional, prefix: str, bases=SHARED_NAMINGS[0]):
    """An NVFP4 shared expert (``bases``: its gate, up and down projections), either format's
    naming -> (gate_up NVFP4 [2Is, H] with global scale [2], down NVFP4 [H, Is], in1, in2)."""
    report = LoadReport(path="")

    def get(name, required=True):
        t = get_optional(name)
        if t is None and required:
            raise CheckpointError(f"{prefix}{name}: missing")
        return t

    get.has = getattr(get_optional, "has", None)

    g, ig, _, _ = _read_proj(get, report, prefix, bases[0])
    u, iu, _, _ = _read_proj(get, report, prefix, bases[1])
    d, idn, _, _ = _read_proj(get, report, prefix, bases[2])
    if g.data.shape != u.data.shape:
        raise CheckpointError(f"{prefix}{bases[1]}: shape {tuple(u.shape)} differs from {bases[0]} {tuple(g.shape)}")
    gu = nvfp4.NVFP4Tensor(torch.cat([g.data, u.data]), torch.cat([g.scale, u.scale]),
                           torch.stack([g.global_scale.reshape(()), u.global_scale.reshape(())]))
    in1 = None if ig is None and iu is None else torch.maximum(ig, iu) if ig is not None and iu is not None else (ig if ig is not None else iu)
    return gu, d, in1, idn, report


def read_dense_tensors(get_optional, prefix: str) -> dict:
    """Router, correction bias, hash table and shared expert (every rank keeps these whole).

    ``get_optional(name)`` returns the tensor or None. Names after the prefix
    (:data:`ROUTER_NAMES`, :data:`SHARED_NAMINGS`): the router ``gate.weight``; the correction
    bias ``gate.e_score_correction_bias`` (DeepSeek's upstream ``gate.bias``); the hash table
    ``gate.tid2eid`` (DeepSeek-V4 hash layers); the shared expert
    ``shared_experts.{gate,up,down}_proj`` (upstream ``shared_experts.w1/w3/w2``) or
    ``shared_experts.gate_up_proj`` + ``down_proj``, in a float dtype or in NVFP4 (ModelOpt or
    compressed-tensors naming; then ``shared_kind`` is ``"nvfp4"`` and the input scales come along).
    """
    out = {"router": _one_of(get_optional, prefix, ROUTER_NAMES["router"]),
           "bias": _one_of(get_optional, prefix, ROUTER_NAMES["bias"]),
           "tid2eid": _one_of(get_optional, prefix, ROUTER_NAMES["tid2eid"]),
           "shared_gate": _one_of(get_optional, prefix, ROUTER_NAMES["shared_gate"]),
           "shared_gate_up": None, "shared_down": None, "shared_in1": None, "shared_in2": None,
           "shared_kind": "none", "shared_report": None}
    g = out["shared_gate"]
    if g is not None and (not torch.is_floating_point(g) or g.dim() != 2 or g.shape[0] != 1):
        raise CheckpointError(f"{prefix}{ROUTER_NAMES['shared_gate'][0]}: {g.dtype} {tuple(g.shape)}; expected an "
                              f"unquantized [1, H] gate (bf16/fp16/fp32)")
    t = out["tid2eid"]
    if t is not None and (t.dim() != 2 or torch.is_floating_point(t) or t.dtype == torch.bool):
        raise CheckpointError(f"{prefix}{ROUTER_NAMES['tid2eid'][0]}: {t.dtype} {tuple(t.shape)}; expected an "
                              f"integer table [vocab, top_k]")
    bases = _shared_naming(get_optional, prefix) or SHARED_NAMINGS[0]
    gname, uname, dname = bases
    packed = _has_name(get_optional, gname + "weight_packed")
    plain = None if packed else get_optional(gname + "weight")
    if packed or (plain is not None and plain.dtype == torch.uint8):
        gu, d, in1, in2, rep = _shared_nvfp4(get_optional, prefix, bases)
        out.update(shared_gate_up=gu, shared_down=d, shared_in1=in1, shared_in2=in2, shared_kind="nvfp4",
                   shared_report=rep)
        return out
    shared_gu = get_optional("shared_experts.gate_up_proj.weight")
    if shared_gu is None:
        u = get_optional(uname + "weight")
        if (plain is None) != (u is None):
            have, miss = (gname, uname) if u is None else (uname, gname)
            raise CheckpointError(f"{prefix}{miss}weight: missing (the shared expert's {have}weight is there)")
        shared_gu = torch.cat([plain, u]) if plain is not None else None
    elif plain is not None:
        raise CheckpointError(f"{prefix}shared_experts.gate_up_proj.weight and {prefix}{gname}weight: the shared "
                              f"expert's gate stored twice")
    shared_down = get_optional(dname + "weight")
    if (shared_gu is None) != (shared_down is None):
        miss = dname + "weight" if shared_down is None else gname + "weight"
        raise CheckpointError(f"{prefix}{miss}: missing (the shared expert is incomplete)")
    for name, t in ((gname + "weight", shared_gu), (dname + "weight", shared_down)):
        if t is not None and not torch.is_floating_point(t):
            raise CheckpointError(f"{prefix}{name}: dtype {t.dtype}: a shared expert is bf16/fp16/fp32 or NVFP4 "
                                  f"with its scales")
    out.update(shared_gate_up=shared_gu, shared_down=shared_down,
               shared_kind="none" if shared_gu is None else str(shared_gu.dtype).replace("torch.", ""))
    return out


def assemble_weights(w13, w2, in1, in2, dense: dict) -> MoEWeights:
    bias, gu, down = dense["bias"], dense["shared_gate_up"], dense["shared_down"]
    kw = {}
    if dense.get("shared_kind") == "nvfp4":
        kw = {"shared_gate_up_input_scale": dense["shared_in1"], "shared_down_input_scale": dense["shared_in2"]}
    else:
        gu = None if gu is None else gu.to(torch.bfloat16)
        down = None if down is None else down.to(torch.bfloat16)
    return MoEWeights(
        w13=w13, w2=w2, w13_input_scale=in1, w2_input_scale=in2, router_weight=dense["router"],
        router_bias=None if bias is None else bias.float(), shared_gate_up=gu, shared_down=down,
        tid2eid=None if dense.get("tid2eid") is None else dense["tid2eid"].long(),
        shared_expert_gate=None if dense.get("shared_gate") is None else dense["shared_gate"].float(), **kw,
    )


# ---------------------------------------------------------------- load

def load(path, *, layer: int | str | None = None, config: MoEConfig | None = None, top_k: int | None = None,
         prefix: str | None = None, w13_layout: str | None = None, input_scales: str = "per-expert",
         device="cpu", **config_overrides) -> Loaded:
    """Load one NVFP4 MoE layer from a checkpoint folder or file (docs/SPEC.md §3.4).

    Args:
        path: a checkpoint folder (``*.safetensors`` + ``config.json`` + any
            ``hf_quant_config.json``) or one ``.safetensors`` file.
        layer: the model's layer number (``model.layers.N``) or a tensor-name prefix;
            default: the first MoE layer.
        config: the layer config, overriding what the checkpoint implies (then the
            architecture need not be known).
        top_k: experts per token, where nothing in the checkpoint says it.
        prefix: tensor name prefix of the layer (alternative to ``layer``).
        w13_layout: the row order of a fused gate/up tensor (``W13_LAYOUTS``) where the
            checkpoint does not declare it; refused where the gate and up projections are
            separate tensors.
        input_scales: ``per-expert`` (as stored) or ``max`` (one value per GEMM: the max over
            all experts), docs/SPEC.md §3.2.
        device: where the tensors go.
        config_overrides: MoEConfig fields to override (reported).

    Raises:
        CheckpointError naming the tensor or config key: a missing tensor, an expert missing
        one tensor, experts whose tensors disagree in shape, a wrong dtype, a K that is not
        a multiple of 16, a global or input scale that is zero, negative, NaN or inf, an
        unknown quantization method or architecture, an undeclared fused gate/up layout,
        an activation mode the quantization config contradicts.
    """
    with open_checkpoint(path) as ck:
        return load_open(ck, layer=layer, config=config, top_k=top_k, prefix=prefix, w13_layout=w13_layout,
                         input_scales=input_scales, device=device, **config_overrides)


def load_open(ck: OpenCheckpoint, *, experts: tuple[int, int] | None = None, layer: int | str | None = None,
              config: MoEConfig | None = None, top_k: int | None = None, prefix: str | None = None,
              w13_layout: str | None = None, input_scales: str = "per-expert", device="cpu",
              **config_overrides) -> Loaded:
    """:func:`load` on an open checkpoint (:func:`open_checkpoint`); same arguments, plus:

    Args:
        experts: ``(start, end)``: only routed experts ``start..end-1`` (a rank's shard under
            expert parallelism, :func:`megamoe.distributed.load_shard`). Every per-expert
            tensor (weights, block scales, global scales, input scales) is read as those rows
            only; the router and the shared expert whole; the config stays the layer's (all
            experts); the report names tensors by their names in the file.
    """
    path, where, meta = ck.path, ck.where, ck.meta
    if input_scales not in INPUT_SCALE_MODES:
        raise CheckpointError(f"input_scales={input_scales!r}: expected one of {INPUT_SCALE_MODES}")
    if w13_layout is not None and w13_layout not in W13_LAYOUTS:
        raise CheckpointError(f"w13_layout={w13_layout!r}: expected one of {W13_LAYOUTS}")
    prefix_asked = prefix
    prefix, layout, names = _choose_layer(list(where), layer, prefix)
    e_file = layer_experts(ck, prefix=prefix)[2]
    if experts is not None and not 0 <= experts[0] < experts[1] <= e_file:
        raise CheckpointError(f"{prefix}: experts [{experts[0]}, {experts[1]}) asked, the layer has {e_file}")
    folder = path if path.is_dir() else path.parent
    report = LoadReport(path=str(path), layout=layout, prefix=prefix, moe_layers=names)
    hf = _read_json(folder / "config.json", report)
    hq = _read_json(folder / "hf_quant_config.json", report)
    fmt = _detect_format(meta, hf, hq, layout)
    report.format, report.producer = fmt.name, fmt.producer
    report.choices.append(f"format {fmt.name} ({fmt.source})")
    if len(names) > 1:
        how = (f"layer={layer!r}" if layer is not None else f"prefix={prefix!r}" if prefix_asked is not None
               else "the first MoE layer")
        report.choices.append(f"layer {prefix!r} ({how}; the checkpoint has {len(names)} MoE layers)")

    def get(name: str, required: bool = True):
        full = prefix + name
        if full not in where:
            if required:
                raise CheckpointError(f"{full}: missing from {path}")
            return None
        t = ck.get(full)
        report.tensors[full] = str(t.dtype).replace("torch.", "")
        return t

    def get_experts(name: str, required: bool = True):
        """A stacked per-expert tensor ``[E, ...]``: rows ``experts`` only (a tensor without
        a leading expert dimension, e.g. one scale for every expert, whole)."""
        full = prefix + name
        if experts is None or full not in where or ck.shape(full)[:1] != (e_file,):
            return get(name, required)
        t = ck.get_rows(full, *experts)
        report.tensors[full] = str(t.dtype).replace("torch.", "")
        return t

    get_experts.has = lambda name: prefix + name in where

    get.has = lambda name: prefix + name in where

    # ModelOpt keeps transformers' fused, transposed experts (Llama 4) fused: packed uint8
    modelopt_transposed = (fmt.name == "modelopt" and layout == "hf-fused"
                           and ck.dtype(prefix + "experts.gate_up_proj") == "U8")
    if (fmt.name == "compressed-tensors" and layout != "per-expert") or \
            (fmt.name == "modelopt" and layout == "hf-fused" and not modelopt_transposed):
        raise CheckpointError(f"{prefix}: a {fmt.name} checkpoint with {layout} expert tensors "
                              f"({'w13_weight' if layout == 'fused' else 'experts.gate_up_proj'}): megamoe reads "
                              f"this format's per-expert layout (experts.{{e}}.gate_proj...)")
    mt = (hf or {}).get("model_type")
    if mt in UNSUPPORTED and fmt.name != "megamoe":
        dropped = _would_drop(where, prefix)
        raise CheckpointError(f"{folder / 'config.json'}: model_type {mt!r} is not supported"
                              + (" (config= does not change what the checkpoint holds)" if config is not None else "")
                              + f": {UNSUPPORTED[mt]}. Loading it would drop "
                              + (", ".join(dropped) if dropped else "these parts of the layer"))
    arch = None
    if hf is not None and config is None and fmt.name != "megamoe":
        try:
            arch = architecture_routing(hf, _layer_number(prefix))
        except UnknownArchitecture as exc:
            raise CheckpointError(f"{folder / 'config.json'}: {exc}") from None

    if layout == "fused":
        w13, w2, in1, in2 = _load_fused(get_experts, report, prefix)
    elif modelopt_transposed:
        w13, w2, in1, in2 = _load_modelopt_transposed(get_experts, report, prefix)
        report.layout = "modelopt fused transposed (experts.gate_up_proj [E, H/2, 2I])"
    elif layout == "hf-fused":
        w13, w2, in1, in2 = _load_hf_fused(get_experts, report, prefix)
    else:
        w13, w2, in1, in2 = _load_per_expert(get, report, prefix, where, fmt.name, experts)

    # ---- w13 layout (docs/SPEC.md §3.3)
    if layout == "per-expert":
        if w13_layout is not None:
            raise CheckpointError(f"w13_layout={w13_layout!r}: this checkpoint stores gate and up as separate "
                                  f"tensors ({prefix}experts.{{e}}.gate_proj / up_proj); there is no fused order")
        report.w13_layout = "separate gate/up tensors, stacked [gate; up]"
    else:
        declared, why = None, ""
        if fmt.name == "megamoe":
            declared, why = "gate-up", "megamoe's own writer (docs/SPEC.md §3.3)"
        elif layout == "hf-fused" and arch is not None:
            declared, why = arch.w13_layout, f"{arch.model_type} fused gate_up_proj"
        elif modelopt_transposed and config is not None:
            src_arch = _arch_or_none(hf, prefix)
            if src_arch is not None:
                declared, why = src_arch.w13_layout, f"{src_arch.model_type} fused gate_up_proj (config.json)"
        chosen = w13_layout or declared
        if chosen is None:
            raise CheckpointError(f"{prefix}w13_weight: the gate/up row order of this fused tensor is not declared "
                                  f"by the checkpoint; pass w13_layout= one of {W13_LAYOUTS}")
        if w13_layout is not None and declared is not None and w13_layout != declared:
            report.warnings.append(f"w13 layout {w13_layout!r} as asked, though the checkpoint declares {declared!r}")
        report.w13_layout = chosen
        report.choices.append(f"w13 layout {chosen} ({'as asked' if w13_layout else why})")
        w13 = _apply_w13_layout(w13, chosen)

    e = e_file  # the layer's; the tensors hold w13.data.shape[0] (all, or the expert range)
    h = w13.data.shape[2] * 2
    i = w2.data.shape[2] * 2

    def get_opt(name):
        return get(name, required=False)

    get_opt.has = get.has

    dense = read_dense_tensors(get_opt, prefix)
    if dense["shared_report"] is not None:
        report.tensors.update({prefix + k if not k.startswith(prefix) else k: v
                               for k, v in dense["shared_report"].tensors.items()})
        report.quantized_at_load += dense["shared_report"].quantized_at_load

    # ---- activation mode (docs/SPEC.md §3.4)
    has_inputs = in1 is not None or in2 is not None
    if (in1 is None) != (in2 is None):
        name = "w13 (gate/up)" if in1 is None else "w2 (down)"
        raise CheckpointError(f"{prefix}: input scales present for one GEMM but missing for {name}")
    if fmt.act_mode == "w4a4" and not has_inputs:
        n = _NAMES.get(fmt.name, ("", "", "", "input_scale"))[3]
        raise CheckpointError(f"{prefix}experts.0.gate_proj.{n}: missing; {fmt.source} declares NVFP4 "
                              f"activations (W4A4), which need the static input scales")
    if fmt.act_mode == "w4a16" and has_inputs:
        raise CheckpointError(f"{prefix}: input scales present but {fmt.source} declares weight-only NVFP4 (W4A16)")
    if dense["shared_kind"] == "nvfp4" and (dense["shared_in1"] is None) != (not has_inputs):
        raise CheckpointError(f"{prefix}shared_experts: input scales {'missing' if has_inputs else 'present'} while the "
                              f"routed experts' are {'present' if has_inputs else 'missing'}")

    # ---- layer config: routing from the architecture
    cfg_src = ""
    if config is not None:
        cfg_src = "given by the caller"
    elif fmt.name == "megamoe" or "megamoe.config" in meta:
        config = MoEConfig.from_dict(json.loads(meta["megamoe.config"]))
        cfg_src = "safetensors metadata megamoe.config"
    else:
        config, cfg_src = _config_from_arch(arch, hf, path, e, h, i, top_k, dense, report)
    if "act_mode" not in config_overrides:
        if fmt.act_mode is not None:
            want = fmt.act_mode  # declared by the quantization config
        elif cfg_src.startswith("config.json") or cfg_src.startswith("the tensors"):
            want = "w4a4" if has_inputs else "w4a16"  # no quantization config: input scales decide
        else:
            want = config.act_mode  # megamoe metadata or the caller's config
        if want != config.act_mode:
            config = config.with_(act_mode=want)
    if top_k is not None and config.top_k != top_k:
        config = config.with_(top_k=top_k)
        report.choices.append(f"top_k={top_k} (as asked)")
    if config_overrides:
        config = config.with_(**config_overrides)
        report.choices.append("overridden by the caller: " + ", ".join(f"{k}={v!r}" for k, v in config_overrides.items()))
    report.choices.append(f"layer config: {cfg_src}")
    if (config.hidden_size, config.intermediate_size, config.num_experts) != (h, i, e):
        raise CheckpointError(f"{path}: config says H={config.hidden_size}, I={config.intermediate_size}, "
                              f"E={config.num_experts} but the tensors of {prefix!r} have H={h}, I={i}, E={e}")
    report.act_mode = config.act_mode + (" (dynamic per-row scales)" if config.act_mode == "w4a4" and not has_inputs else "")
    report.choices.append(f"activations {report.act_mode} ("
                          + (fmt.source if fmt.act_mode else ("input scales present" if has_inputs else "no input scales"))
                          + ")")

    # ---- input-scale convention (docs/SPEC.md §3.2)
    if has_inputs:
        shared_all = bool(torch.all(in1 == in1[0])) and bool(torch.all(in2 == in2[0]))
        if input_scales == "max":
            if experts is not None:  # the max over ALL experts, not over the range
                if layout == "per-expert":
                    raise CheckpointError(f"{prefix}: input_scales='max' with an expert range needs every expert's "
                                          f"input scales; load the per-expert layout whole, or use 'per-expert'")
                in1 = _fused_input_scale(get, "w13_input_scale", e, prefix)
                in2 = _fused_input_scale(get, "w2_input_scale", e, prefix)
            n_local = w13.data.shape[0]
            in1 = in1.amax().expand(n_local).contiguous()
            in2 = in2.amax().expand(n_local).contiguous()
            report.input_scales = "max over all experts (as asked)"
        else:
            report.input_scales = "per expert, as stored" + (" (one value shared by all experts)" if shared_all else "")
        report.choices.append(f"input scales {report.input_scales}")

    # ---- shared expert
    report.shared_expert = dense["shared_kind"] if dense["shared_gate_up"] is not None else "none"
    if config.n_shared_experts and dense["shared_gate_up"] is None:
        raise CheckpointError(f"{prefix}shared_experts.gate_proj: missing; the config has n_shared_experts="
                              f"{config.n_shared_experts}")
    if dense["shared_gate_up"] is not None:
        report.choices.append(f"shared expert {report.shared_expert}"
                              + (", activations quantized with its own input scales" if dense["shared_in1"] is not None else ""))
    _check_router_tensors(config, dense, arch, prefix)
    report.routing = {k: getattr(config, k) for k in ("num_experts", "top_k", "scoring", "hash_routing", "n_group",
                                                       "topk_group", "renormalize", "routed_scaling_factor",
                                                       "n_shared_experts", "swiglu_limit")}
    report.routing["correction_bias"] = dense["bias"] is not None
    report.routing["router"] = dense["router"] is not None
    if cfg_src == "given by the caller" and fmt.name != "megamoe":
        implied = _arch_or_none(hf, prefix)
        if implied is not None:
            for k in _SEMANTIC_FIELDS:
                if k in implied.fields and implied.fields[k] != getattr(config, k):
                    msg = (f"config= has {k}={getattr(config, k)!r}, but config.json model_type "
                           f"{implied.model_type!r} computes {k}={implied.fields[k]!r}")
                    report.warnings.append(msg)
                    log.warning("%s: %s", path, msg)
    if experts is None:
        _check_every_tensor_read(where, prefix, report)
    report.read_as = {n: _how_read(n[len(prefix):], v) for n, v in report.tensors.items()}

    weights = assemble_weights(w13, w2, in1, in2, dense)
    try:
        weights.validate(config, num_local_experts=None if experts is None else experts[1] - experts[0])
    except ValueError as exc:
        raise CheckpointError(f"{path}: {prefix}{exc}") from None
    if report.quantized_at_load:
        log.warning("quantized at load time (stored in higher precision): %s", ", ".join(report.quantized_at_load))
    return Loaded(weights.to(device), config, report)


def _arch_or_none(hf, prefix: str):
    """The routing config.json's architecture implies for the layer, or None (no config.json,
    an unknown architecture)."""
    if not hf:
        return None
    try:
        return architecture_routing(hf, _layer_number(prefix))
    except UnknownArchitecture:
        return None


def _would_drop(where, prefix: str) -> list[str]:
    """The layer's tensors megamoe's experts and router have no place for (biases of the experts'
    GEMMs and of the router), per-expert names folded to ``experts.{N}``."""
    names = {re.sub(r"experts\.\d+\.", "experts.{N}.", n) for n in where if n.startswith(prefix)
             and (n.endswith(".bias") or n.endswith("_bias")) and "e_score_correction_bias" not in n}
    return sorted(names)


#: MoEConfig fields where a caller's config= differing from what config.json's architecture
#: implies computes another layer (reported as warnings)
_SEMANTIC_FIELDS = ("scoring", "hash_routing", "renormalize", "routed_scaling_factor", "n_group", "topk_group",
                    "swiglu_limit", "shared_expert_gate", "router_weight_on_input")


def _layer_number(prefix: str) -> int | None:
    """The model's layer number in a layer prefix (``model.layers.3.mlp.`` -> 3), or None."""
    m = _LAYER_NO.search(prefix)
    return int(m.group(1)) if m else None


def _check_router_tensors(config: MoEConfig, dense: dict, arch, prefix: str) -> None:
    """The router tensors the routing needs are there, and none is there that it would not use."""
    bias_name, table_name = ROUTER_NAMES["bias"][0], ROUTER_NAMES["tid2eid"][0]
    why = f"{arch.model_type} routing" if arch is not None else "the layer config"
    for need in (arch.requires if arch is not None else ()):
        if need == "correction_bias" and dense["bias"] is None:
            raise CheckpointError(f"{prefix}{bias_name}: missing; {why} selects the top-k of scores + this bias")
        if need == "tid2eid" and dense["tid2eid"] is None:
            raise CheckpointError(f"{prefix}{table_name}: missing; {why} chooses the experts by token id "
                                  f"(hash routing: experts = tid2eid[input_ids])")
    if arch is not None and "correction_bias" not in arch.requires and not config.hash_routing \
            and dense["bias"] is not None:
        raise CheckpointError(f"{prefix}{bias_name}: present but not used: {why} selects experts without a "
                              f"correction bias")
    if config.hash_routing:
        if dense["tid2eid"] is None:
            raise CheckpointError(f"{prefix}{table_name}: missing; the layer config routes by token id (hash_routing)")
        if dense["bias"] is not None:
            raise CheckpointError(f"{prefix}{bias_name}: present but not used: a hash-routed layer chooses its experts "
                                  f"from {table_name}, so a selection bias would be ignored")
    elif dense["tid2eid"] is not None:
        raise CheckpointError(f"{prefix}{table_name}: present but not used: {why} chooses experts by top-k "
                              f"(hash_routing=False); a layer routed by token id needs hash_routing=True")
    if dense["shared_gate_up"] is not None and not config.n_shared_experts:
        raise CheckpointError(f"{prefix}shared_experts: present but not used: the layer config has n_shared_experts=0")
    gate_name = ROUTER_NAMES["shared_gate"][0]
    if config.shared_expert_gate and dense.get("shared_gate") is None:
        raise CheckpointError(f"{prefix}{gate_name}: missing; {why} scales the shared expert by sigmoid(x · gate)")
    if dense.get("shared_gate") is not None and not config.shared_expert_gate:
        raise CheckpointError(f"{prefix}{gate_name}: present but not used: the layer config has shared_expert_gate="
                              f"False (the shared expert's output scaled per token by sigmoid(x · gate), as "
                              f"qwen2_moe does, needs shared_expert_gate=True)")


def _check_every_tensor_read(where, prefix: str, report: "LoadReport") -> None:
    """Every tensor under the layer's prefix was read (``report.tensors``), or a CheckpointError
    names the first that was not: a tensor megamoe does not know how to use is never dropped."""
    unread = sorted(n for n in where if n.startswith(prefix) and n not in report.tensors)
    if unread:
        more = f" (and {len(unread) - 1} more: {', '.join(unread[1:4])}{', ...' if len(unread) > 4 else ''})" \
            if len(unread) > 1 else ""
        biases = _would_drop(unread, prefix)
        hint = (f" (biases of the experts' GEMMs or of the router, as gpt-oss has, are not supported: "
                f"{', '.join(biases)})" if biases else "")
        raise CheckpointError(f"{unread[0]}: a tensor of the MoE layer {prefix!r} that megamoe does not read{more}; "
                              f"the layer would be computed without it, so it is not loaded{hint}")


#: what a tensor is, by its name after the layer prefix (names that are no projection's)
_ROLES = {
    "gate.weight": "router weight (logits computed in float32)",
    "gate.e_score_correction_bias": "correction bias (added to the scores for selection only)",
    "gate.bias": "correction bias (added to the scores for selection only)",
    "gate.tid2eid": "hash table: the experts of each token id",
    "router.weight": "router weight (logits computed in float32)",
    "e_score_correction_bias": "correction bias (added to the scores for selection only)",
    "shared_expert_gate.weight": "shared expert gate (output scaled by sigmoid(x · gate), float32)",
    "w13_weight": "experts' gate/up weights (fused)", "w13_weight_scale": "experts' gate/up block scales",
    "w13_weight_scale_2": "experts' gate/up global scales", "w13_input_scale": "experts' gate/up input scales",
    "w2_weight": "experts' down weights (fused)", "w2_weight_scale": "experts' down block scales",
    "w2_weight_scale_2": "experts' down global scales", "w2_input_scale": "experts' down input scales",
    "experts.gate_up_proj": "experts' gate/up weights (fused)", "experts.down_proj": "experts' down weights (fused)",
    "experts.gate_up_proj_weight_scale": "experts' gate/up block scales (transposed [E, K/16, N])",
    "experts.gate_up_proj_weight_scale_2": "experts' gate/up global scale (a multiplier)",
    "experts.gate_up_proj_input_scale": "experts' gate/up input scale (a multiplier)",
    "experts.down_proj_weight_scale": "experts' down block scales (transposed [E, K/16, N])",
    "experts.down_proj_weight_scale_2": "experts' down global scale (a multiplier)",
    "experts.down_proj_input_scale": "experts' down input scale (a multiplier)",
}
#: what a projection's tensor is, by its suffix
_SUFFIXES = {
    "weight": "weights", "weight_packed": "weights",
    "weight_scale": "block scales (one per 16 values)",
    "weight_scale_2": "global scale (a multiplier)",
    "weight_global_scale": "global scale (stored as a divisor; inverted)",
    "input_scale": "input scale (a multiplier)",
    "input_global_scale": "input scale (stored as a divisor; inverted)",
}
_PROJ_NAMES = {"gate_proj": "gate", "w1": "gate", "up_proj": "up", "w3": "up", "down_proj": "down", "w2": "down",
               "gate_up_proj": "gate/up"}


def _how_read(rel: str, stored: str) -> str:
    """``"<what it is>: <how it was read>"`` for the tensor ``rel`` (its name after the layer
    prefix) read as ``stored`` (``report.tensors``: ``nvfp4``, ``quantized-at-load (...)`` or a dtype)."""
    how = {"nvfp4": "NVFP4 (packed E2M1, two values a byte)"}.get(stored, stored)
    if rel in ("experts.gate_up_proj", "experts.down_proj") and stored == "nvfp4":  # ModelOpt's Llama 4 export
        return f"{_ROLES[rel][:-1]}, stored transposed [E, K/2, N]): {how}, transposed at load"
    if rel in _ROLES:
        return f"{_ROLES[rel]}: {how}"
    base, _, suffix = rel.rpartition(".")
    m = re.fullmatch(r"experts\.(\d+)\.(\w+)", base)
    if m and m.group(2) in _PROJ_NAMES:
        who = f"expert {m.group(1)} {_PROJ_NAMES[m.group(2)]}"
    elif base.partition(".")[0] in ("shared_experts", "shared_expert") and base.partition(".")[2] in _PROJ_NAMES:
        who = f"shared expert {_PROJ_NAMES[base.partition('.')[2]]}"
    else:
        return f"{rel}: {how}"
    what = _SUFFIXES.get(suffix, suffix)
    if suffix in ("input_scale", "input_global_scale") and _PROJ_NAMES.get(base.rpartition(".")[2]) in ("gate", "up"):
        what += ", the larger of gate's and up's used for both"
    return f"{who} {what}: {how}"


def _config_from_arch(arch, hf, path: Path, e, h, i, top_k, dense, report) -> tuple[MoEConfig, str]:
    d: dict = {"hidden_size": h, "intermediate_size": i, "num_experts": e}
    if arch is not None:
        f = dict(arch.fields)
        report.choices += [f"routing: {c}" for c in arch.choices]
        report.warnings += [f"{arch.model_type}: {n}" for n in arch.notes if "required" not in n]
        stated = getattr(arch, "stated", {})
        # the tensors give the expert count and the width; config.json, where it states them, must agree
        for k in ("num_experts", "intermediate_size"):
            if f.get(k) is None or f[k] == d[k]:
                continue
            if k not in stated:
                report.choices.append(f"{k}={d[k]} (the tensors; config.json states none, the {arch.model_type} "
                                      f"default {f[k]} is not used)")
                f[k] = d[k]
                continue
            key = f"config.json {stated[k]}={f[k]}"
            if k == "num_experts" and f[k] > e:
                raise CheckpointError(f"{report.prefix}experts.{e}.*: missing ({key}, the checkpoint has experts "
                                      f"0..{e - 1})")
            raise CheckpointError(f"{path}: {key} but the tensors of {report.prefix!r} have {k}={d[k]}")
        d.update({k: v for k, v in f.items() if v is not None})
        src = f"config.json model_type {arch.model_type!r}"
    else:
        src = "the tensors" + (" and top_k as given" if top_k is not None else "")
    if top_k is not None:
        d["top_k"] = top_k
    if "top_k" not in d:
        raise CheckpointError(f"{path}: top_k is unknown (no megamoe.config metadata, no config.json with a "
                              f"known model_type): pass top_k= or config=")
    gu = dense["shared_gate_up"]
    if gu is not None:
        n = d.get("n_shared_experts") or 1
        d["n_shared_experts"] = n
        d["shared_intermediate_size"] = gu.shape[0] // 2 // n
    elif arch is None:
        d["n_shared_experts"] = 0
    if arch is None:
        d.setdefault("scoring", "softmax")
        report.choices.append("routing: softmax top-k (no architecture given; the caller declared top_k)")
    return MoEConfig.from_dict(d), src

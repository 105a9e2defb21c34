"""ModelOpt-format NVFP4 MoE checkpoints: loading, validation, synthetic checkpoints.

Two tensor layouts are read (an optional common prefix such as ``model.layers.3.mlp.`` is
found automatically):

* fused (vLLM / SPEC §3 names): ``w13_weight`` u8 ``[E, 2I, H/2]``, ``w13_weight_scale`` e4m3
  ``[E, 2I, H/16]``, ``w13_weight_scale_2`` f32 ``[E, 2]``, ``w13_input_scale`` f32 ``[E]``,
  ``w2_weight`` ``[E, H, I/2]``, ``w2_weight_scale`` ``[E, H, I/16]``, ``w2_weight_scale_2`` ``[E]``,
  ``w2_input_scale`` ``[E]``;
* per expert (ModelOpt's Hugging Face export): ``experts.{e}.{gate,up,down}_proj.{weight,
  weight_scale, weight_scale_2, input_scale}``, stacked at load; gate and up keep their own
  ``weight_scale_2``.

Optional: ``gate.weight`` ``[E, H]`` router, ``gate.e_score_correction_bias`` ``[E]``,
``shared_experts.gate_up_proj.weight`` ``[2Is, H]`` (or ``gate_proj`` + ``up_proj``) and
``shared_experts.down_proj.weight`` ``[H, Is]``. An expert weight stored in bf16/fp16/fp32 is
quantized at load time and *reported* (never silently). The layer's config comes from the
file's ``megamoe.config`` metadata, a ``config.json`` beside it, or keyword arguments.
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch

from megamoe import nvfp4
from megamoe.presets import MoEConfig, get_preset
from megamoe.weights import MoEWeights

log = logging.getLogger("megamoe.checkpoint")

__all__ = ["CheckpointError", "LoadReport", "Loaded", "load", "save", "write_synthetic", "synthetic_weights"]


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded; the message names the tensor."""


@dataclass
class LoadReport:
    """What the loader found and did."""

    path: str
    layout: str = "fused"
    prefix: str = ""
    tensors: dict[str, str] = field(default_factory=dict)  # name -> "nvfp4" | "quantized-at-load" | dtype
    quantized_at_load: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)

    def summary(self) -> str:
        q = ", ".join(self.quantized_at_load) or "none"
        return (f"{self.path}: {self.layout} layout, prefix {self.prefix!r}, {len(self.tensors)} tensors; "
                f"quantized at load: {q}" + ("".join(f"\n  warning: {w}" for w in self.warnings)))


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
        hmid = torch.nn.functional.silu(gu[:, :i]) * gu[:, i:]
        in2[ex] = _amax_scale(hmid)

    router = (torch.randn((e, h), generator=gen, device=device) * h ** -0.5).to(torch.bfloat16)
    bias = (torch.randn((e,), generator=gen, device=device) * 0.01) if cfg.scoring == "sigmoid" else None
    shared_gu = shared_down = None
    if cfg.n_shared_experts:
        is_ = (cfg.shared_intermediate_size or i) * cfg.n_shared_experts
        shared_gu = (torch.randn((2 * is_, h), generator=gen, device=device) * h ** -0.5).to(torch.bfloat16)
        shared_down = (torch.randn((h, is_), generator=gen, device=device) * is_ ** -0.5).to(torch.bfloat16)
    return MoEWeights(
        w13=nvfp4.NVFP4Tensor(w13_data, w13_scale, w13_gs),
        w2=nvfp4.NVFP4Tensor(w2_data, w2_scale, w2_gs),
        w13_input_scale=in1 if static_input_scales else None,
        w2_input_scale=in2 if static_input_scales else None,
        router_weight=router,
        router_bias=bias,
        shared_gate_up=shared_gu,
        shared_down=shared_down,
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
    """Write a synthetic checkpoint of ``preset`` (SPEC §3) to ``path`` (.safetensors)."""
    cfg = get_preset(preset).with_(**config_overrides) if config_overrides else get_preset(preset)
    w = synthetic_weights(cfg, seed=seed, device=device, progress=progress)
    return save(path, w, cfg)


# ------------------------------------------------------------------------------------------
# loading
# ------------------------------------------------------------------------------------------

_HF_KEYS = {  # Hugging Face config.json -> MoEConfig
    "hidden_size": "hidden_size",
    "moe_intermediate_size": "intermediate_size",
    "n_routed_experts": "num_experts",
    "num_experts": "num_experts",
    "num_experts_per_tok": "top_k",
    "scoring_func": "scoring",
    "n_group": "n_group",
    "topk_group": "topk_group",
    "norm_topk_prob": "renormalize",
    "routed_scaling_factor": "routed_scaling_factor",
    "n_shared_experts": "n_shared_experts",
}


def _files(path: Path) -> list[Path]:
    if path.is_dir():
        files = sorted(path.glob("*.safetensors"))
        if not files:
            raise CheckpointError(f"{path}: no .safetensors files in this directory")
        return files
    if not path.exists():
        raise CheckpointError(f"{path}: no such checkpoint")
    return [path]


def _find_prefix(keys: list[str]) -> tuple[str, str]:
    for k in keys:
        if k.endswith("w13_weight"):
            return k[: -len("w13_weight")], "fused"
    for k in keys:
        if k.endswith("experts.0.gate_proj.weight"):
            return k[: -len("experts.0.gate_proj.weight")], "per-expert"
    raise CheckpointError("no MoE expert tensors found (looked for '*w13_weight' and '*experts.0.gate_proj.weight')")


def load(path, *, config: MoEConfig | None = None, top_k: int | None = None, prefix: str | None = None,
         device="cpu", **config_overrides) -> Loaded:
    """Load one NVFP4 MoE layer.

    Args:
        path: a .safetensors file or a directory of them.
        config: the layer config; by default read from the file's metadata or config.json.
        top_k: needed only when neither the metadata nor config.json says it.
        prefix: tensor name prefix; found automatically when None.
        device: where the tensors go.

    Raises:
        CheckpointError naming the tensor for a missing tensor, a wrong shape or dtype, or
        a K that is not a multiple of 16.
    """
    from safetensors import safe_open

    path = Path(path)
    files = _files(path)
    where: dict[str, Path] = {}
    meta: dict[str, str] = {}
    # Each file is opened once: re-opening re-parses the header, which for a sharded model
    # file of ~15k tensors costs ~20 ms a tensor (minutes for a per-expert layout).
    with contextlib.ExitStack() as stack:
        handles = {}
        for f in files:
            fh = handles[f] = stack.enter_context(safe_open(str(f), framework="pt", device="cpu"))
            meta.update(fh.metadata() or {})
            for k in fh.keys():
                where[k] = f
        return _load_opened(path, where, meta, handles, config, top_k, prefix, device, config_overrides)


def _load_opened(path, where, meta, handles, config, top_k, prefix, device, config_overrides) -> Loaded:
    if prefix is None:
        prefix, layout = _find_prefix(list(where))
    else:
        layout = "fused" if prefix + "w13_weight" in where else "per-expert"
    report = LoadReport(path=str(path), layout=layout, prefix=prefix)

    def get(name: str, required: bool = True):
        full = prefix + name
        if full not in where:
            if required:
                raise CheckpointError(f"{full}: missing from {path}")
            return None
        t = handles[where[full]].get_tensor(full)
        report.tensors[full] = str(t.dtype).replace("torch.", "")
        return t

    if layout == "fused":
        w13, w2, in1, in2 = _load_fused(get, report, prefix)
    else:
        w13, w2, in1, in2 = _load_per_expert(get, report, prefix, where)

    e = w13.data.shape[0]
    h = w13.data.shape[2] * 2
    i = w2.data.shape[2] * 2
    dense = read_dense_tensors(lambda name: get(name, required=False), prefix)
    if config is None:
        config = _config_from(meta, path, e, h, i, top_k, dense["shared_gate_up"], config_overrides)
    elif config_overrides:
        config = config.with_(**config_overrides)
    weights = assemble_weights(w13, w2, in1, in2, dense)
    try:
        weights.validate(config)
    except ValueError as exc:
        raise CheckpointError(f"{path}: {prefix}{exc}") from None
    if report.quantized_at_load:
        log.warning("quantized at load time (stored in higher precision): %s", ", ".join(report.quantized_at_load))
    return Loaded(weights.to(device), config, report)


def read_dense_tensors(get_optional, prefix: str) -> dict:
    """Router, correction bias and shared expert (every rank keeps these whole).

    ``get_optional(name)`` returns the tensor or None. The shared expert may be stored as
    ``gate_up_proj`` or as ``gate_proj`` + ``up_proj``; it must be a float dtype.
    """
    shared_gu = get_optional("shared_experts.gate_up_proj.weight")
    if shared_gu is None:
        g = get_optional("shared_experts.gate_proj.weight")
        u = get_optional("shared_experts.up_proj.weight")
        shared_gu = torch.cat([g, u]) if g is not None and u is not None else None
    shared_down = get_optional("shared_experts.down_proj.weight")
    for name, t in (("shared_experts.gate_up_proj.weight", shared_gu), ("shared_experts.down_proj.weight", shared_down)):
        if t is not None and t.dtype == torch.uint8:
            raise CheckpointError(f"{prefix}{name}: NVFP4 shared experts are not supported; store them in bf16")
    return {"router": get_optional("gate.weight"), "bias": get_optional("gate.e_score_correction_bias"),
            "shared_gate_up": shared_gu, "shared_down": shared_down}


def assemble_weights(w13, w2, in1, in2, dense: dict) -> MoEWeights:
    bias, gu, down = dense["bias"], dense["shared_gate_up"], dense["shared_down"]
    return MoEWeights(
        w13=w13, w2=w2, w13_input_scale=in1, w2_input_scale=in2, router_weight=dense["router"],
        router_bias=None if bias is None else bias.float(),
        shared_gate_up=None if gu is None else gu.to(torch.bfloat16),
        shared_down=None if down is None else down.to(torch.bfloat16),
    )


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
    if tuple(gs.shape) != want:
        raise CheckpointError(f"{prefix}{gs_name}: shape {tuple(gs.shape)}, expected {want}")
    report.tensors[prefix + name] = "nvfp4"
    return nvfp4.NVFP4Tensor(data, scale, gs)


def _load_fused(get, report, prefix):
    w13 = _as_nvfp4(get, report, "w13_weight", "w13_weight_scale_2", 2, prefix)
    w2 = _as_nvfp4(get, report, "w2_weight", "w2_weight_scale_2", 1, prefix)
    in1 = get("w13_input_scale", required=False)
    in2 = get("w2_input_scale", required=False)
    return w13, w2, None if in1 is None else in1.float().reshape(-1), None if in2 is None else in2.float().reshape(-1)


def _load_per_expert(get, report, prefix, where):
    e = 0
    while f"{prefix}experts.{e}.gate_proj.weight" in where:
        e += 1
    parts: dict[str, list] = {"gate": [], "up": [], "down": []}
    in1, in2 = [], []
    for ex in range(e):
        for proj in ("gate", "up", "down"):
            base = f"experts.{ex}.{proj}_proj."
            data = get(base + "weight")
            if torch.is_floating_point(data):
                q = nvfp4.quantize(data.float(), nvfp4.default_global_scale(data))
                report.quantized_at_load.append(prefix + base + "weight")
                report.tensors[prefix + base + "weight"] = f"quantized-at-load (stored {data.dtype})"
            else:
                scale = get(base + "weight_scale")
                if scale.dtype != torch.float8_e4m3fn:
                    raise CheckpointError(f"{prefix}{base}weight_scale: dtype {scale.dtype}, expected float8_e4m3fn")
                _check_k(prefix + base + "weight", data, scale)
                q = nvfp4.NVFP4Tensor(data, scale, get(base + "weight_scale_2").float().reshape(()))
                report.tensors[prefix + base + "weight"] = "nvfp4"
            parts[proj].append(q)
            isc = get(base + "input_scale", required=False)
            if isc is not None:
                (in2 if proj == "down" else in1).append((ex, proj, float(isc.float().reshape(()))))
    for proj in ("gate", "up", "down"):
        shapes = {tuple(q.data.shape) for q in parts[proj]}
        if len(shapes) != 1:
            raise CheckpointError(f"{prefix}experts.*.{proj}_proj.weight: experts disagree on shape: {sorted(shapes)}")
    w13 = nvfp4.NVFP4Tensor(
        torch.stack([torch.cat([g.data, u.data]) for g, u in zip(parts["gate"], parts["up"])]),
        torch.stack([torch.cat([g.scale, u.scale]) for g, u in zip(parts["gate"], parts["up"])]),
        torch.stack([torch.stack([g.global_scale, u.global_scale]) for g, u in zip(parts["gate"], parts["up"])]),
    )
    w2 = nvfp4.NVFP4Tensor(torch.stack([d.data for d in parts["down"]]), torch.stack([d.scale for d in parts["down"]]),
                           torch.stack([d.global_scale for d in parts["down"]]))
    s1 = s2 = None
    if in1:
        s1 = torch.zeros(e)
        for ex, proj, v in in1:
            if s1[ex] and s1[ex] != v:
                report.warnings.append(f"expert {ex}: gate and up input_scale differ; using the larger")
            s1[ex] = max(float(s1[ex]), v)
    if in2:
        s2 = torch.zeros(e)
        for ex, _, v in in2:
            s2[ex] = v
    return w13, w2, s1, s2


def _config_from(meta, path: Path, e, h, i, top_k, shared_gu, overrides) -> MoEConfig:
    if "megamoe.config" in meta:
        cfg = MoEConfig.from_dict(json.loads(meta["megamoe.config"]))
    else:
        d: dict = {"hidden_size": h, "intermediate_size": i, "num_experts": e}
        cj = (path if path.is_dir() else path.parent) / "config.json"
        if cj.exists():
            hf = json.loads(cj.read_text())
            for k, v in hf.items():
                if k in _HF_KEYS and v is not None:
                    d[_HF_KEYS[k]] = v
            d.update({"hidden_size": h, "intermediate_size": i, "num_experts": e})
        if top_k is not None:
            d["top_k"] = top_k
        if "top_k" not in d:
            raise CheckpointError(f"{path}: top_k is unknown (no megamoe.config metadata, no config.json "
                                  f"num_experts_per_tok): pass top_k=")
        if shared_gu is not None:
            d.setdefault("n_shared_experts", 1)
            d["shared_intermediate_size"] = shared_gu.shape[0] // 2 // d["n_shared_experts"]
        cfg = MoEConfig.from_dict(d)
    if (cfg.hidden_size, cfg.intermediate_size, cfg.num_experts) != (h, i, e):
        raise CheckpointError(f"{path}: config says H={cfg.hidden_size}, I={cfg.intermediate_size}, "
                              f"E={cfg.num_experts} but the tensors have H={h}, I={i}, E={e}")
    return cfg.with_(**overrides) if overrides else cfg

"""The format of a checkpoint, from its quantization config: ModelOpt (``hf_quant_config.json``
or ``quantization_config.quant_method = "modelopt"``), compressed-tensors
(``nvfp4-pack-quantized``), megamoe's own (``megamoe.config`` in the safetensors metadata),
Hugging Face dense (no quantization config, fused float experts) or unlabelled. The format
says the activation mode (W4A4 / W4A16) where the config declares it; which reader reads the
experts is :data:`megamoe.checkpoint.readers.READERS`'s choice from the format and the layout."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from megamoe.checkpoint.report import CheckpointError, LoadReport


@dataclass
class _Format:
    name: str                 # "modelopt" | "compressed-tensors" | "megamoe" | "unlabelled" | "hf-dense"
    producer: str = ""
    act_mode: str | None = None   # declared by the quantization config; None: not declared
    divisor: bool = False         # global scales stored as divisors (compressed-tensors)
    source: str = ""


def _read_json(p: Path, report: LoadReport) -> dict | None:
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

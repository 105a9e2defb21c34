"""The load report: what the loader found, every choice it made, and how each tensor was read
(``megamoe info --checkpoint DIR`` prints it); the loader's error; what :func:`~megamoe.checkpoint.load`
returns."""
from __future__ import annotations

import re
from dataclasses import dataclass, field

from megamoe.presets import MoEConfig
from megamoe.weights import MoEWeights


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


#: what a tensor is, by its name after the layer prefix (names that are no projection's)
_ROLES = {
    "gate.weight": "router weight (logits computed in float32)",
    "gate.e_score_correction_bias": "correction bias (added to the scores for selection only)",
    "gate.bias": "correction bias (added to the scores for selection only)",
    "gate.tid2eid": "hash table: the experts of each token id",
    "router.weight": "router weight (logits computed in float32)",
    "router.bias": "router bias (added to the logits, float32)",
    "w13_bias": "experts' gate/up biases (added before the activation, float32)",
    "w2_bias": "experts' down biases (added before the routing weight, float32)",
    "experts.gate_up_proj_bias": "experts' gate/up biases (added before the activation, float32)",
    "experts.down_proj_bias": "experts' down biases (added before the routing weight, float32)",
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
    "bias": "bias (added to the GEMM's output, float32)",
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

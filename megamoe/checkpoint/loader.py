"""Loading one MoE layer (docs/SPEC.md §3.4): :func:`load` / :func:`load_open` find the layer, the
format (:mod:`megamoe.checkpoint.formats`) and the architecture's routing
(:mod:`megamoe.architectures`), read the experts with the format's reader
(:data:`megamoe.checkpoint.readers.READERS`) and the tensors around them
(:mod:`megamoe.checkpoint.dense`), check that every tensor of the layer was read and that the
routing has the tensors it needs, and assemble :class:`~megamoe.weights.MoEWeights` with a
:class:`~megamoe.checkpoint.LoadReport` of every choice."""
from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import torch

from megamoe.architectures import UNSUPPORTED, UnknownArchitecture, architecture_routing
from megamoe.checkpoint.dense import ROUTER_NAMES, read_dense_tensors
from megamoe.checkpoint.files import OpenCheckpoint, _choose_layer, _layer_number, layer_experts, open_checkpoint
from megamoe.checkpoint.formats import _detect_format, _read_json
from megamoe.checkpoint.readers import LayerTensors, choose_reader
from megamoe.checkpoint.readers.biases import apply_b13_layout, read_expert_biases
from megamoe.checkpoint.readers.fused import W13_LAYOUTS, _apply_w13_layout, _fused_input_scale
from megamoe.checkpoint.readers.per_expert import _NAMES
from megamoe.checkpoint.report import CheckpointError, Loaded, LoadReport, _how_read
from megamoe.presets import MoEConfig
from megamoe.weights import MoEWeights

log = logging.getLogger("megamoe.checkpoint")

#: input-scale conventions (docs/SPEC.md §3.2): ``per-expert`` = as stored (a value shared by
#: all experts is broadcast); ``max`` = one value per GEMM, the max over all experts.
INPUT_SCALE_MODES = ("per-expert", "max")


def assemble_weights(w13, w2, in1, in2, dense: dict, b13=None, b2=None) -> MoEWeights:
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
        shared_expert_gate=None if dense.get("shared_gate") is None else dense["shared_gate"].float(),
        b13=b13, b2=b2, router_logit_bias=None if dense.get("logit_bias") is None else dense["logit_bias"].float(),
        **kw,
    )


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

    # the reader of this format's experts in this layout (readers.READERS), or the refusal
    reader = choose_reader(fmt.name, layout, prefix, ck.dtype)
    modelopt_transposed = reader.name == "modelopt-fused-transposed"
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

    w13, w2, in1, in2 = reader.read(LayerTensors(get, get_experts, report, prefix, where, fmt.name, experts))
    if reader.report_layout is not None:
        report.layout = reader.report_layout
    # the experts' biases (gpt-oss), in the stored row order of w13
    b13, b2 = read_expert_biases(get, get_experts, prefix, where, layout, e_file, w13.data.shape[1],
                                 w13.data.shape[2] * 2, experts)

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
        report.choices.append(f"w13 layout {chosen} ({'as asked' if w13_layout else why})"
                              + (", the gate/up biases reordered with the rows" if b13 is not None
                                 and chosen != "gate-up" else ""))
        w13 = _apply_w13_layout(w13, chosen)
        b13 = apply_b13_layout(b13, chosen)

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
    _check_expert_biases(b13, b2, arch, prefix, layout)
    report.routing = {k: getattr(config, k) for k in ("num_experts", "top_k", "scoring", "hash_routing", "n_group",
                                                       "topk_group", "renormalize", "routed_scaling_factor",
                                                       "n_shared_experts", "swiglu_limit")}
    if (config.swiglu_alpha, config.swiglu_up_shift) != (1.0, 0.0):
        report.routing.update(swiglu_alpha=config.swiglu_alpha, swiglu_up_shift=config.swiglu_up_shift)
    report.routing["correction_bias"] = dense["bias"] is not None
    report.routing["router"] = dense["router"] is not None
    if dense.get("logit_bias") is not None or b13 is not None or b2 is not None:
        report.routing["router_logit_bias"] = dense.get("logit_bias") is not None
        report.routing["expert_biases"] = "+".join(n for n, b in (("gate/up", b13), ("down", b2)) if b is not None) \
            or "none"
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

    weights = assemble_weights(w13, w2, in1, in2, dense, b13, b2)
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
                    "swiglu_limit", "shared_expert_gate", "router_weight_on_input", "swiglu_alpha", "swiglu_up_shift")


def _check_expert_biases(b13, b2, arch, prefix: str, layout: str) -> None:
    """The expert biases the architecture computes with are there (gpt-oss: both GEMMs' biases),
    and none is there that it has no place for (without an architecture, the layer config given
    by the caller, the biases present are used)."""
    if arch is None:
        return
    names = {"fused": ("w13_bias", "w2_bias"),
             "hf-fused": ("experts.gate_up_proj_bias", "experts.down_proj_bias")}.get(
        layout, ("experts.0.gate_proj.bias", "experts.0.down_proj.bias"))
    needed = "expert_biases" in arch.requires
    for b, name, what in ((b13, names[0], "gate/up"), (b2, names[1], "down")):
        if b is None and needed:
            raise CheckpointError(f"{prefix}{name}: missing; {arch.model_type} experts add a bias to the {what} "
                                  f"GEMM's output")
        if b is not None and not needed:
            raise CheckpointError(f"{prefix}{name}: present but not used: {arch.model_type} experts have no biases "
                                  f"(pass config= to compute the layer with them)")


def _check_router_tensors(config: MoEConfig, dense: dict, arch, prefix: str) -> None:
    """The router tensors the routing needs are there, and none is there that it would not use."""
    bias_name, table_name = ROUTER_NAMES["bias"][0], ROUTER_NAMES["tid2eid"][0]
    why = f"{arch.model_type} routing" if arch is not None else "the layer config"
    if arch is not None and "router_logit_bias" in arch.requires and dense.get("logit_bias") is None:
        raise CheckpointError(f"{prefix}{ROUTER_NAMES['logit_bias'][0]}: missing; {why} adds the router's bias to "
                              f"the logits")
    if arch is not None and "router_logit_bias" not in arch.requires and dense.get("logit_bias") is not None:
        raise CheckpointError(f"{prefix}{ROUTER_NAMES['logit_bias'][0]}: present but not used: {why} adds no bias "
                              f"to the router logits (pass config= to compute the layer with it)")
    if dense.get("logit_bias") is not None and dense["router"] is None:
        raise CheckpointError(f"{prefix}{ROUTER_NAMES['logit_bias'][0]}: present without the router weight "
                              f"({' or '.join(prefix + n for n in ROUTER_NAMES['router'])}); the bias is added to "
                              f"the logits the router computes")
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


def _check_every_tensor_read(where, prefix: str, report: LoadReport) -> None:
    """Every tensor under the layer's prefix was read (``report.tensors``), or a CheckpointError
    names the first that was not: a tensor megamoe does not know how to use is never dropped."""
    unread = sorted(n for n in where if n.startswith(prefix) and n not in report.tensors)
    if unread:
        more = f" (and {len(unread) - 1} more: {', '.join(unread[1:4])}{', ...' if len(unread) > 4 else ''})" \
            if len(unread) > 1 else ""
        biases = _would_drop(unread, prefix)
        hint = (f" (biases megamoe reads are the experts' gate/up and down biases and the router's bias, under "
                f"the names of docs/SPEC.md §3.4; not these: {', '.join(biases)})" if biases else "")
        raise CheckpointError(f"{unread[0]}: a tensor of the MoE layer {prefix!r} that megamoe does not read{more}; "
                              f"the layer would be computed without it, so it is not loaded{hint}")


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

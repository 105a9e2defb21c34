"""Reader: one tensor per expert and projection, ``experts.{e}.{gate,up,down}_proj.*`` (or
``experts.{e}.w1/w3/w2``), stacked into megamoe's fused ``[E, 2I, H/2]`` / ``[E, H, I/2]``. Two
formats store this layout, with their own tensor names (:data:`_NAMES`):

* **ModelOpt NVFP4**: ``weight``, ``weight_scale``, ``weight_scale_2`` and ``input_scale``;
  the global scales multiply on decode.
* **compressed-tensors** ``nvfp4-pack-quantized``: ``weight_packed``, ``weight_scale``,
  ``weight_global_scale`` and ``input_global_scale``; the global scales are stored as
  **divisors** (shape ``[1]``) and are inverted at load (docs/FIELD_BUGS.md row 22).

A format with this layout and other names is one more entry of :data:`_NAMES`."""
from __future__ import annotations

import torch

from megamoe import nvfp4
from megamoe.checkpoint.files import _expert_ids
from megamoe.checkpoint.readers.common import _check_k, _has, _not_fp8, _scalar_scale
from megamoe.checkpoint.report import CheckpointError

#: tensor names of one projection, per format: (data, block scales, global scale, input scale)
_NAMES = {
    "modelopt": ("weight", "weight_scale", "weight_scale_2", "input_scale"),
    "compressed-tensors": ("weight_packed", "weight_scale", "weight_global_scale", "input_global_scale"),
}


def _proj_names(get, base: str) -> tuple[str, tuple]:
    """The naming of projection ``base`` (ModelOpt or compressed-tensors), from its tensors."""
    if _has(get, base + "weight_packed"):
        return "compressed-tensors", _NAMES["compressed-tensors"]
    return "modelopt", _NAMES["modelopt"]


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

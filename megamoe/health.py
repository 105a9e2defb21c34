"""Kernel health checks (docs/SPEC.md §5), run by ``megamoe selftest`` and the service.

Every check draws fresh random data (seeded per run, so a failure can be replayed with
the seed in the report), compares a backend against the reference of
:mod:`megamoe.nvfp4`, and returns ``{name, status, metric, threshold, detail,
duration_ms}``. ``status`` is ``pass``, ``fail`` or ``skip``; a skip is never a pass.
"""
from __future__ import annotations

import platform
import random
import time
from typing import Callable

import torch

import megamoe
from megamoe import nvfp4, reference
from megamoe.backends import Backend, get_backend

__all__ = ["run_checks", "CHECKS", "THRESHOLDS", "cosine", "rel_err", "random_scales", "random_nvfp4",
           "within_static_range", "random_rows_within_static_range"]

THRESHOLDS = {
    "sf_roundtrip": 0,  # mismatching bytes
    "gemm_cosine": 0.9999,  # vs the dequantized reference from the same NVFP4 inputs
    "moe_vs_reference": 0.9999,  # backend vs torch reference, same weights and inputs
    "moe_deepseek_v4": 0.9999,  # the whole V4 layer vs its float64 definition, same NVFP4 weights
    # MoE vs the BF16 reference (dequantized weights, no activation quantization). W4A4
    # quantizes two activations to NVFP4; on Gaussian activations each costs ~0.0045 of
    # cosine (measured 0.9955 per quantization), so the format itself lands near 0.987.
    # Its tail is long: a token whose SwiGLU product is one spike loses the rest of that
    # 16-value block. Over 6,000 quick-level draws (rows past the static range redrawn, see
    # check_moe_cosine) the lowest was 0.9758, and the tail falls by about e per 0.003 of
    # cosine, so 0.95 keeps a readiness gate from flapping; kernel errors are the job of
    # moe_vs_reference and the GEMM checks (0.9999).
    "moe_cosine_w4a4": 0.95,
    "moe_cosine_w4a16": 0.999,
}


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    a = a.double().flatten().cpu()
    b = b.double().flatten().cpu()
    if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
        return float("nan")
    den = a.norm() * b.norm()
    if den == 0:
        return 1.0 if torch.equal(a, b) else 0.0
    return float((a @ b) / den)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    ref = ref.double().cpu()
    return float((out.double().cpu() - ref).norm() / ref.norm().clamp_min(1e-300))


def random_scales(rows: int, cols: int, gen: torch.Generator) -> torch.Tensor:
    """Random finite, non-negative e4m3 block scales ``[rows, cols]`` (every exponent, zeros included)."""
    raw = torch.randint(0, 0x7F, (rows, cols), generator=gen, dtype=torch.int32).to(torch.uint8)
    return raw.view(torch.float8_e4m3fn)


def random_nvfp4(rows: int, cols: int, gen: torch.Generator, global_scale: float | None = 1.0) -> nvfp4.NVFP4Tensor:
    """Random NVFP4 matrix ``[rows, cols]``: Gaussian data whose per-block magnitudes vary over
    ~6 binades (so the block scales are not uniform), quantized with ``global_scale``
    (None: the default global scale of the data)."""
    x = torch.randn((rows, cols), generator=gen)
    block_mag = torch.exp2(torch.randint(-3, 4, (rows, cols // 16), generator=gen).float())
    gs = 1.0 if global_scale is None else global_scale
    x = x * block_mag.repeat_interleave(16, dim=1) * gs * 60  # block scales ~3..200, unsaturated
    return nvfp4.quantize(x, None if global_scale is None else torch.tensor(global_scale, dtype=torch.float32))


def _check(name: str, fn: Callable[[], tuple[str, float, float | int, str]]) -> dict:
    t0 = time.perf_counter()
    try:
        status, metric, threshold, detail = fn()
    except Exception as exc:  # a crashing kernel is a failed check, with the reason
        status, metric, threshold, detail = "fail", None, None, f"{type(exc).__name__}: {exc}"
    return {"name": name, "status": status, "metric": metric, "threshold": threshold, "detail": detail,
            "duration_ms": round((time.perf_counter() - t0) * 1e3, 2)}


# ----------------------------------------------------------------------------------------------
# the checks
# ----------------------------------------------------------------------------------------------

SF_SHAPES_QUICK = [(1, 1), (7, 3), (31, 5), (33, 4), (127, 29), (129, 13), (300, 7)]
SF_SHAPES_FULL = SF_SHAPES_QUICK + [(464, 448), (4096, 128), (1, 448), (2048, 256)]


def check_sf_roundtrip(be: Backend, gen: torch.Generator, full: bool):
    total, first, shapes = 0, [], SF_SHAPES_FULL if full else SF_SHAPES_QUICK
    for rows, cols in shapes:
        s = random_scales(rows, cols, gen).to(be.device)
        r = be.verify_sf_roundtrip(s)
        total += r["mismatches"]
        if r["mismatches"] and len(first) < 4:
            first.append(f"[{rows}x{cols}] {r['mismatches']} bad, first {r['first'][:3]}")
    # grouped activations (docs/SPEC.md §2): each expert's rows start at a 128-row boundary
    sizes = [5, 0, 130, 1, 33]
    s = random_scales(sum(sizes), 7, gen).to(be.device)
    expected = nvfp4.swizzle_scales_grouped(s.cpu(), sizes)
    poisoned = torch.full_like(expected, 0x7F).to(be.device)
    got = be.swizzle_scales_grouped(s, sizes, out=poisoned).cpu()
    bad = int((got.reshape(-1) != expected.reshape(-1)).sum())
    total += bad
    if bad:
        first.append(f"[grouped {sizes}x7] {bad} bad bytes")
    detail = f"{len(shapes)} shapes + 1 grouped, rows not multiples of 128, cols not multiples of 4"
    if first:
        detail += "; " + "; ".join(first)
    return ("pass" if total == 0 else "fail"), total, THRESHOLDS["sf_roundtrip"], detail


def check_gemm_uniform(be: Backend, gen: torch.Generator, full: bool):
    m, n, k = 33, 256, 256
    a = nvfp4.quantize(torch.ones(m, k))
    b = nvfp4.quantize(torch.ones(n, k))
    out = be.gemm(a.to(be.device), b.to(be.device))
    ref = nvfp4.gemm(a, b, compute_dtype=torch.float64)
    c = cosine(out, ref)
    ok = c >= THRESHOLDS["gemm_cosine"]
    return ("pass" if ok else "fail"), c, THRESHOLDS["gemm_cosine"], \
        f"all-ones {m}x{n}x{k}, uniform scales (cannot see a scale permutation; see gemm_cosine_random)"


GEMM_SHAPES_QUICK = [(1, 128, 64), (33, 256, 208), (129, 464, 512)]
GEMM_SHAPES_FULL = GEMM_SHAPES_QUICK + [(7, 4096, 2048), (300, 2048, 7168), (256, 928, 4096)]


def check_gemm_random(be: Backend, gen: torch.Generator, full: bool):
    worst, worst_rel, notes = 1.0, 0.0, []
    col_ratio = 1.0
    for (m, n, k) in (GEMM_SHAPES_FULL if full else GEMM_SHAPES_QUICK):
        # global scales far from 1 (docs/FIELD_BUGS.md row 11): activations 1e-3, weights 1e3
        a = random_nvfp4(m, k, gen, 1e-3)
        b = random_nvfp4(n, k, gen, 1e3)
        ref = nvfp4.gemm(a, b, compute_dtype=torch.float64)
        for mode, a_in in (("w4a4", a), ("w4a16", nvfp4.dequantize(a).to(torch.bfloat16))):
            a_dev = a_in.to(be.device)
            out = be.gemm(a_dev, b.to(be.device)).float().cpu()
            r = ref if mode == "w4a4" else nvfp4.gemm(a_in.float(), b, compute_dtype=torch.float64)
            c, e = cosine(out, r), rel_err(out, r)
            if c < worst:
                worst = c
            worst_rel = max(worst_rel, e)
            if c < THRESHOLDS["gemm_cosine"]:
                notes.append(f"{mode} {m}x{n}x{k}: cosine {c:.6f}")
            if full and n >= 64:
                # docs/FIELD_BUGS.md row 12: a structured error shows as one column position (mod 32) far worse
                per_col = (out.double() - r).abs().amax(0).view(-1, 32).amax(0) if n % 32 == 0 else None
                if per_col is not None and per_col.median() > 0:
                    col_ratio = max(col_ratio, float(per_col.max() / per_col.median()))
    detail = f"random data, per-block scales over 6 binades, global scales 1e-3/1e3, W4A4 and W4A16; " \
             f"max relative error {worst_rel:.2e}"
    if full:
        detail += f"; worst column-position (mod 32) error ratio {col_ratio:.2f}"
    if notes:
        detail += "; " + "; ".join(notes[:4])
    ok = worst >= THRESHOLDS["gemm_cosine"]
    return ("pass" if ok else "fail"), worst, THRESHOLDS["gemm_cosine"], detail


def _moe_setup(be: Backend, gen: torch.Generator, full: bool):
    from megamoe.moe import MoELayer

    preset = "small" if full else "tiny"
    seed = int(torch.randint(0, 2**31 - 1, (1,), generator=gen))
    layer = MoELayer.from_preset(preset, seed=seed, backend=be)
    t = 97 if full else 61  # primes: not a multiple of any tile
    x = torch.randn((t, layer.config.hidden_size), generator=gen).to(torch.bfloat16).to(be.device)
    return layer, x, preset


def within_static_range(layer, x: torch.Tensor) -> torch.Tensor:
    """Boolean ``[T]``: the rows of ``x`` whose activations stay inside the static NVFP4 range
    of every routed expert the layer's router sends them to (``|x| <= 2688 * w13_input_scale``
    and, for the BF16 yardstick's intermediate, ``|silu(gate) * up| <= 2688 * w2_input_scale``).
    A row outside saturates (docs/SPEC.md §3): the format clips it wherever it runs, so it says
    nothing of a kernel. All rows pass with per-row (dynamic) scales."""
    w, cfg = layer.weights, layer.config
    ok = torch.ones(x.shape[0], dtype=torch.bool, device=x.device)
    if cfg.dynamic_act_scale or w.w13_input_scale is None:
        return ok
    lim = nvfp4.FP4_MAX * nvfp4.FP8_MAX
    xf = x.float()
    ids = layer.route(xf)[1]
    for e in torch.unique(ids[reference.valid_slots(ids, cfg.num_experts)]).tolist():
        rows = (ids == e).any(1)
        xr = xf[rows]
        fits = xr.abs().amax(1) <= lim * float(w.w13_input_scale[e])
        if w.w2_input_scale is not None:  # the intermediate only where a static scale bounds it
            hmid = reference.swiglu(xr @ nvfp4.dequantize(w.w13[e].to(x.device)).T, cfg.intermediate_size,
                                    cfg.swiglu_limit)
            fits &= hmid.abs().amax(1) <= lim * float(w.w2_input_scale[e])
        ok[rows] &= fits
    return ok


def random_rows_within_static_range(layer, t: int, gen: torch.Generator,
                                    first: torch.Tensor | None = None) -> tuple[torch.Tensor, int]:
    """``t`` Gaussian bf16 rows ``[t, H]`` that :func:`within_static_range` keeps (the rows of
    ``first`` first, then fresh draws from ``gen``; on ``first``'s device, else the layer's), and
    how many drawn rows were left out. Static activation scales clip a row beyond their
    calibrated range (a SwiGLU product can exceed it by 2-3x now and then), and the format clips
    it on every backend: comparing such a row with the BF16 reference measures the calibration,
    not a kernel."""
    h = layer.config.hidden_size
    x = first if first is not None else torch.empty((0, h), dtype=torch.bfloat16, device=layer.device)
    keep = within_static_range(layer, x)
    left_out, x = int((~keep).sum()), x[keep]
    for _ in range(16):
        if x.shape[0] >= t:
            break
        fresh = torch.randn((t - x.shape[0], h), generator=gen).to(torch.bfloat16).to(x.device)
        keep = within_static_range(layer, fresh)
        left_out, x = left_out + int((~keep).sum()), torch.cat([x, fresh[keep]])
    if x.shape[0] < t:
        raise RuntimeError(f"only {x.shape[0]} of {t} random rows stay inside the static activation range")
    return x[:t], left_out


def check_moe_cosine(be: Backend, gen: torch.Generator, full: bool):
    layer, x, preset = _moe_setup(be, gen, full)
    # rows past the static activation range are redrawn (moe_vs_reference still runs such rows)
    x, redrawn = random_rows_within_static_range(layer, x.shape[0], gen, first=x)
    ref = layer.reference_bf16(x)
    results, ok = [], True
    modes = ("w4a4", "w4a16")
    metric = None
    for mode in modes:
        layer.config = layer.config.with_(act_mode=mode)
        c = cosine(layer(x), ref)
        thr = THRESHOLDS[f"moe_cosine_{mode}"]
        ok &= c >= thr
        results.append(f"{mode} {c:.5f} (>= {thr})")
        metric = c if metric is None else metric
    return ("pass" if ok else "fail"), metric, THRESHOLDS["moe_cosine_w4a4"], \
        f"preset {preset}, T={x.shape[0]}, vs BF16 reference: " + ", ".join(results) + \
        f"; rows redrawn (outside the static activation range): {redrawn}"


def check_moe_vs_reference(be: Backend, gen: torch.Generator, full: bool):
    if be.name == "torch":
        return "skip", None, THRESHOLDS["moe_vs_reference"], "this backend is the reference"
    from megamoe.backends.torch_ref import TorchBackend

    layer, x, preset = _moe_setup(be, gen, full)
    ref_be = TorchBackend(device=be.device)
    ref_weights = layer.weights.to(be.device)  # (the routed experts may sit in host memory)
    worst, parts = 1.0, []
    for mode in ("w4a4", "w4a16"):
        layer.config = layer.config.with_(act_mode=mode)
        ids_w = layer.route(x)
        ref = ref_be.moe_forward(ref_weights, layer.config, x, ids_w[1], ids_w[0]).float()
        # both plans (docs/SPEC.md §3.5), on all rows and on one row: the batch-invariant plan and the one
        # --no-batch-invariant runs, which picks other kernels for few rows (cuda-sm90's streaming decode)
        for invariant in (True, False):
            for rows in (slice(None), slice(0, 1)):
                out = layer.backend.moe_forward(layer._prepared, layer.config, x[rows], ids_w[1][rows],
                                                ids_w[0][rows], invariant).float()
                c = cosine(out, ref[rows])
                worst = min(worst, c)
                parts.append(f"{mode}{'' if invariant else ' not batch-invariant'} T={out.shape[0]} cosine {c:.6f} "
                             f"rel err {rel_err(out, ref[rows]):.2e}")
    ok = worst >= THRESHOLDS["moe_vs_reference"]
    return ("pass" if ok else "fail"), worst, THRESHOLDS["moe_vs_reference"], \
        f"preset {preset}, T={x.shape[0]}, same NVFP4 weights and routing: " + "; ".join(parts)


def _v4_definition(layer, x: torch.Tensor, input_ids: torch.Tensor | None):
    """DeepSeek-V4's layer written out from its definition in float64 (docs/SPEC.md §3), apart
    from megamoe.routing and megamoe.reference's SwiGLU: scores sqrt(softplus(float32 logits)),
    experts tid2eid[input_ids] or the top-k of scores + bias, weights the chosen scores / (sum +
    1e-20) * scale; h = silu(min(gate, L)) * clamp(up, -L, L) in the routed experts (activations
    quantized as §3) and in the shared expert. Returns (output, expert ids, clamped values)."""
    cfg, w = layer.config, layer.weights
    lim = cfg.swiglu_limit
    xd = x.double()
    logits = (x.float() @ w.router_weight.float().T).double()
    scores = torch.sqrt(torch.nn.functional.softplus(logits))
    if cfg.hash_routing:
        ids = w.tid2eid[input_ids.to(w.tid2eid.device)].to(x.device).long()
    else:
        sel = scores + (0 if w.router_bias is None else w.router_bias.double())
        ids = sel.argsort(dim=-1, descending=True, stable=True)[:, :cfg.top_k]
    wt = scores.gather(1, ids)
    wt = wt / (wt.sum(-1, keepdim=True) + 1e-20) * cfg.routed_scaling_factor
    clamped = 0

    def glu(gu, n):
        nonlocal clamped
        gate, up = gu[:, :n], gu[:, n:]
        clamped += int((gate > lim).sum() + (up.abs() > lim).sum())
        return torch.nn.functional.silu(gate.clamp(max=lim)) * up.clamp(-lim, lim)

    out = torch.zeros_like(xd)
    for e in torch.unique(ids).tolist():
        tok, slot = (ids == e).nonzero(as_tuple=True)
        w13 = nvfp4.dequantize(w.w13[e].to(x.device), torch.float64)
        w2 = nvfp4.dequantize(w.w2[e].to(x.device), torch.float64)
        in1 = None if w.w13_input_scale is None else w.w13_input_scale[e]
        in2 = None if w.w2_input_scale is None else w.w2_input_scale[e]
        a1 = reference.activation_to_gemm_input(x[tok].float(), cfg, in1, torch.float64)
        h = glu(a1 @ w13.T, cfg.intermediate_size)
        a2 = reference.activation_to_gemm_input(h.float(), cfg, in2, torch.float64)
        out.index_add_(0, tok, (a2 @ w2.T) * wt[tok, slot].unsqueeze(1))
    n = w.shared_down.shape[1]
    out += glu(xd @ w.shared_gate_up.double().T, n) @ w.shared_down.double().T
    return out, ids, clamped


def check_moe_deepseek_v4(be: Backend, gen: torch.Generator, full: bool):
    """DeepSeek-V4's semantics on the backend: a top-k layer (sqrt(softplus) + correction bias)
    and a hash layer (tid2eid by token id), SwiGLU clamped (a low limit, so it bites on many
    values) in the routed and the shared expert, W4A4 and W4A16, against the float64 definition."""
    from megamoe.moe import MoELayer

    preset = "small" if full else "tiny"
    t = 97 if full else 61
    worst, parts, ok = 1.0, [], True
    for hash_routing in (False, True):
        seed = int(torch.randint(0, 2**31 - 1, (1,), generator=gen))
        layer = MoELayer.from_preset(preset, seed=seed, backend=be, scoring="sqrtsoftplus", hash_routing=hash_routing,
                                     swiglu_limit=1.0, n_shared_experts=1, routed_scaling_factor=1.5)
        x = (torch.randn((t, layer.config.hidden_size), generator=gen) * 2).to(torch.bfloat16).to(be.device)
        input_ids = None
        if hash_routing:
            input_ids = torch.randint(0, layer.weights.tid2eid.shape[0], (t,), generator=gen).to(be.device)
        for mode in ("w4a4", "w4a16"):
            layer.config = layer.config.with_(act_mode=mode)
            out = layer(x, input_ids=input_ids).double()
            ref, ids, clamped = _v4_definition(layer, x, input_ids)
            same_ids = bool(torch.equal(layer.route(x, input_ids=input_ids)[1].long(), ids))
            c = cosine(out, ref)
            unclamped = MoELayer(layer.weights, layer.config.with_(swiglu_limit=None), backend=be)
            sees_clamp = clamped > 0 and rel_err(unclamped(x, input_ids=input_ids).double(), ref) > 4 * rel_err(out, ref)
            ok &= same_ids and sees_clamp and c >= THRESHOLDS["moe_deepseek_v4"]
            worst = min(worst, c)
            parts.append(f"{'hash' if hash_routing else 'top-k'} {mode} cosine {c:.6f}"
                         + ("" if same_ids else " EXPERTS DIFFER") + ("" if sees_clamp else " CLAMP NOT SEEN"))
    return ("pass" if ok else "fail"), worst, THRESHOLDS["moe_deepseek_v4"], \
        f"preset {preset} as DeepSeek-V4 (sqrt(softplus), clamp 1.0 biting, shared expert), T={t}: " + "; ".join(parts)


CHECKS: dict[str, Callable] = {
    "sf_roundtrip": check_sf_roundtrip,
    "gemm_cosine_uniform": check_gemm_uniform,
    "gemm_cosine_random": check_gemm_random,
    "moe_cosine": check_moe_cosine,
    "moe_vs_reference": check_moe_vs_reference,
    "moe_deepseek_v4": check_moe_deepseek_v4,
}


def versions(be: Backend | None = None) -> dict:
    from megamoe import _ext

    v = {"megamoe": megamoe.__version__, "torch": torch.__version__, "python": platform.python_version(),
         "cuda_runtime": torch.version.cuda, "extension_parts": _ext.built_parts(),
         "extension_archs": getattr(_ext.ext, "cuda_archs", "") if _ext.ext else "",
         "extension_error": _ext.EXT_ERROR}
    if torch.cuda.is_available():
        v["gpu"] = torch.cuda.get_device_name()
        v["compute_capability"] = ".".join(map(str, torch.cuda.get_device_capability()))
    return v


def run_checks(level: str = "quick", backend: str | Backend | None = None, device=None,
               seed: int | None = None, only: list[str] | None = None,
               progress: Callable[[dict], None] | None = None) -> dict:
    """Run the docs/SPEC.md §5 checks on one backend.

    Args:
        level: ``"quick"`` (seconds; gates the service's readiness) or ``"full"``.
        backend: a name, a :class:`Backend` instance (e.g. one with an injected fault), or
            None for ``auto``.
        seed: random seed (default: fresh); recorded in the report so a failure replays.
        only: run only these check names.
        progress: called with each check's result as soon as it is done (e.g. to print it).

    Returns:
        ``{"status": "pass"|"fail", "level", "backend", "device", "seed", "versions",
        "checks": [...], "duration_ms"}``; ``status`` is ``fail`` if any check failed.
    """
    if level not in ("quick", "full"):
        raise ValueError(f"level must be 'quick' or 'full', got {level!r}")
    be = get_backend(backend if backend is not None else "auto", device=device)
    seed = random.SystemRandom().randrange(2**31) if seed is None else int(seed)
    gen = torch.Generator().manual_seed(seed)
    t0 = time.perf_counter()
    names = list(CHECKS) if only is None else only
    unknown = [n for n in names if n not in CHECKS]
    if unknown:
        raise ValueError(f"unknown checks {unknown}; known: {list(CHECKS)}")
    checks = []
    for n in names:
        checks.append(_check(n, lambda n=n: CHECKS[n](be, gen, level == "full")))
        if progress is not None:
            progress(checks[-1])
    be.synchronize()
    status = "fail" if any(c["status"] == "fail" for c in checks) else "pass"
    return {"status": status, "level": level, "backend": be.name, "device": str(be.device), "seed": seed,
            "versions": versions(be), "checks": checks,
            "duration_ms": round((time.perf_counter() - t0) * 1e3, 1)}


def format_table(report: dict) -> str:
    """The report as a fixed-width table (what ``megamoe selftest`` prints)."""
    rows = [("check", "status", "metric", "threshold", "ms", "detail")]
    for c in report["checks"]:
        m = c["metric"]
        ms = "-" if m is None else (f"{m:.6f}" if isinstance(m, float) else str(m))
        rows.append((c["name"], c["status"].upper(), ms, str(c["threshold"]), f"{c['duration_ms']:.0f}", c["detail"]))
    widths = [max(len(r[i]) for r in rows) for i in range(5)]
    lines = [f"backend {report['backend']} on {report['device']}, level {report['level']}, seed {report['seed']}"]
    for r in rows:
        lines.append("  ".join(r[i].ljust(widths[i]) for i in range(5)) + "  " + r[5])
    lines.append(f"overall: {report['status'].upper()} ({report['duration_ms']:.0f} ms)")
    return "\n".join(lines)

"""Whole-MoE-forward benchmark on one GPU: cuda-sm90 (W4A16, W4A4) against torch bf16
``torch._grouped_mm`` on the same shapes and routing, next to the measured floors.

    python bench/moe_bench.py                      # full run (see bench/README.md)
    python bench/moe_bench.py --quick --tokens 1 32 # smoke run
    python bench/moe_bench.py --tp 8               # one tensor-parallel rank's shapes (I / 8 per expert)

``--tp N``: the shapes one rank of N-way tensor parallelism runs (``megamoe.distributed``): every
expert's intermediate size I / N (V4-Flash at N = 8: I = 256, so GEMM 1 has N = 512 rows per expert
and GEMM 2 has K = 256), H, E and the routing unchanged; each row records the dispatch plan the
backend picks at those shapes (``sm90_<mode>_plan``). The partial sums' all-reduce is not timed.

``--top-k K [K ...]``: each preset once per K experts per token (rows ``<preset>/k<K>``), the GEMM shapes
unchanged: at one token the grid of each GEMM is k experts' row blocks, so its time against k tells whether the
busiest SM or DRAM sets it (docs/PERFORMANCE.md, Floors).

For each preset (docs/SPEC.md §3) and T: routed experts only (the shared expert and the router
are identical for every path and left out), uniform random top-k routing, CUDA-graph
replays timed one by one with CUDA events after warm-up; the median is reported. Between
replays the routing/activations are rotated over several pre-drawn sets so that small-T
runs do not read the same experts from L2 every time. Each replay is launched onto an idle GPU
(``*_us``: the interval also holds the launch of the replay) and, timed again, queued behind a
device-side spin (``*_queued_us``: the graph's device time alone, as inside a longer stream of work),
the two alternately.

Floors, measured in the same run: HBM copy bandwidth (device-to-device copy, bytes read +
written) and the bf16 matmul rate (8192^3 torch.matmul). Weight floor = NVFP4 bytes of the
experts the routing uses / copy bandwidth; compute floor = expert FLOPs / bf16 rate; roofline =
the larger of the two, and ``roofline_frac_<mode>`` = roofline / measured time.

Rates beside each time (bench/README.md defines them): ``*_weight_GBps`` = NVFP4 bytes (codes + E4M3 block
scales; torch: bf16) of the experts the routing touches / time, ``*_tflops`` = expert FLOPs 2*T*k*(H*2I + I*H) / time.

``--profile``: per-kernel device times from ``torch.profiler`` (eager forwards of the first routing set): each GEMM
kernel's duration and rates (``*_gemm1_us``, ``*_gemm1_weight_GBps``, ``*_gemm1_tflops``, the same for gemm2: its
weight bytes and FLOPs / its duration), the GEMM kernels together (``*_gemm_us``, ``*_gemm_tflops``,
``*_gemm_weight_GBps``), for ours and torch's ``_grouped_mm`` alike; everything else (align, staging, combine,
quantizers) as ``*_other_us`` (the sum of those kernels' own durations, which with programmatic dependent launch
include the time they wait for the GEMM before them), ``*_other_exposed_us`` (the time a non-GEMM kernel runs while
no GEMM kernel does) and ``*_other_share`` (that time / ``*_busy_us``, the forward's kernel time: the union of its
kernels' intervals); every kernel's time in ``*_kernels_us``.

The printed table has one line per preset x path x T; the JSON record holds every field.
"""
from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import re
import statistics
import subprocess
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from megamoe import nvfp4  # noqa: E402
from megamoe.moe import MoEWeights  # noqa: E402
from megamoe.presets import MoEConfig, get_preset  # noqa: E402

ROTATE = 8
PROFILE_REPS = 5  # eager forwards per torch.profiler run
VARIANT_KERNELS = ("stream", "wgmma32", "wgmma64", "wgmma128")  # megamoe._C.Sm90GemmKernel members the plan chooses from


# ----------------------------------------------------------------------------- floors
def measure_copy_bw(nbytes: int = 2 << 30, reps: int = 20) -> float:
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda").random_(0, 255)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        dst.copy_(src)
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    del src, dst
    return 2 * nbytes / statistics.median(times)  # bytes read + written per second


def measure_bf16_rate(n: int = 8192, reps: int = 10) -> float:
    a = torch.randn((n, n), device="cuda", dtype=torch.bfloat16)
    b = torch.randn((n, n), device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    times = []
    for _ in range(reps):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        a @ b
        e1.record()
        e1.synchronize()
        times.append(e0.elapsed_time(e1) / 1e3)
    return 2 * n**3 / statistics.median(times)


# ----------------------------------------------------------------------------- shapes
def bench_config(preset: str, tp: int = 1) -> MoEConfig:
    """The routed experts' shape of ``preset`` as one of ``tp`` tensor-parallel ranks runs it: every
    expert's intermediate size ``I / tp`` (whole 16-value blocks, else ValueError), the rest unchanged."""
    from megamoe.distributed import tp_local_config

    cfg = get_preset(preset)
    if tp < 1:
        raise ValueError(f"--tp {tp}: expected 1 or more ranks")
    return cfg if tp == 1 else tp_local_config(cfg, tp)


def plan_args(cfg: MoEConfig, t: int, mode: str) -> dict:
    """The arguments of the sm90 dispatch plan ``moe_forward`` asks for at ``t`` bf16 tokens (static
    activation scales, as the benchmark's weights have): expected tokens per expert, both GEMMs' K."""
    w4a16 = mode == "w4a16"
    return dict(tokens_per_expert=-(-t * cfg.top_k // cfg.num_experts), k_gemm1=cfg.hidden_size,
                k_gemm2=cfg.intermediate_size, num_experts=cfg.num_experts, w4a16=w4a16, gather_input=True,
                h_static_scale=not w4a16)


def plan_summary(plan) -> str:
    """``kernel/token tile/tokens per pass`` of a dispatch plan, e.g. ``wgmma64/64/64``."""
    return f"{str(plan.kernel).split('.')[-1]}/{plan.token_tile}/{plan.tokens_per_pass}"


# ----------------------------------------------------------------------------- weights
def random_weights(cfg, gen: torch.Generator, device="cuda") -> MoEWeights:
    """Random NVFP4 weights on the GPU (codes uniform, block scales spread, gate/up global
    scales apart, static input scales) - fast to make at v3 size, same bytes as real ones."""
    e, h, i = cfg.num_experts, cfg.hidden_size, cfg.intermediate_size
    dev = device

    def q(rows, k, gs):
        data = torch.randint(0, 256, (e, rows, k // 2), dtype=torch.uint8, device=dev, generator=gen)
        sc = (torch.rand((e, rows, k // 16), device=dev, generator=gen) * 200 + 8).to(torch.float8_e4m3fn)
        return nvfp4.NVFP4Tensor(data, sc, gs)

    w13_gs = torch.stack([torch.full((e,), 2e-4, device=dev), torch.full((e,), 9e-4, device=dev)], dim=1)
    w13 = q(2 * i, h, w13_gs)
    w2 = q(h, i, torch.full((e,), 3e-4, device=dev))
    return MoEWeights(w13=w13, w2=w2, w13_input_scale=torch.full((e,), 4.0 / 2688, device=dev),
                      w2_input_scale=torch.full((e,), 1.0 / 2688, device=dev))


def bf16_weights(cfg, gen: torch.Generator):
    e, h, i = cfg.num_experts, cfg.hidden_size, cfg.intermediate_size
    w13 = torch.randn((e, 2 * i, h), device="cuda", dtype=torch.bfloat16, generator=gen) * 0.02
    w2 = torch.randn((e, h, i), device="cuda", dtype=torch.bfloat16, generator=gen) * 0.02
    return w13, w2


def random_routing(t: int, cfg, gen: torch.Generator):
    scores = torch.rand((t, cfg.num_experts), device="cuda", generator=gen)
    ids = scores.topk(cfg.top_k, dim=1).indices.to(torch.int32)
    w = torch.softmax(torch.randn((t, cfg.top_k), device="cuda", generator=gen), dim=1)
    x = (torch.randn((t, cfg.hidden_size), device="cuda", generator=gen)).to(torch.bfloat16)
    return x, ids, w


# ----------------------------------------------------------------------------- torch bf16 path
def torch_grouped_moe(x, ids, w, w13, w2, cfg):
    """Routed experts in bf16 with torch._grouped_mm; device-only ops (graph capturable)."""
    t, k = ids.shape
    e, i = cfg.num_experts, cfg.intermediate_size
    flat = ids.reshape(-1).long()
    order = torch.argsort(flat)
    counts = torch.zeros(e, dtype=torch.int32, device=x.device).scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))
    offs = torch.cumsum(counts, 0, dtype=torch.int32)
    tok = order // k
    xs = x[tok]
    gu = torch._grouped_mm(xs, w13.transpose(-2, -1), offs=offs)
    hmid = F.silu(gu[:, :i]) * gu[:, i:]
    y = torch._grouped_mm(hmid, w2.transpose(-2, -1), offs=offs)
    y = y.float() * w.reshape(-1)[order].unsqueeze(1)
    out = torch.zeros((t, x.shape[1]), dtype=torch.float32, device=x.device)
    out.index_add_(0, tok, y)
    return out.to(x.dtype)


# ----------------------------------------------------------------------------- timing
QUEUE_CYCLES = 200_000  # GPU clock cycles of the spin queued before a timed replay (queued=True): ~100 us


def time_graph(fn, inputs_sets, buffers, reps: int, warmup: int = 3, queued: bool = False):
    """Capture fn() reading `buffers`, replay with the sets copied in turn; seconds per replay.

    Each replay is launched onto an idle GPU, so the interval also holds the time from the first event to the graph's
    first kernel (the host's launch of the replay). queued=True: every set is also replayed, right after, behind a
    device-side spin long enough for the replay to be queued behind it, so that the interval is the device time of
    the graph alone, as inside a model's longer stream of work; returns (idle times, queued times), the two taken
    alternately so that clock drift over the run falls on both alike."""
    for dst, src in zip(buffers, inputs_sets[0]):
        dst.copy_(src)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    for _ in range(warmup):
        g.replay()
    times, queued_times = [], []
    for r in range(reps):
        for q in (False, True) if queued else (False,):
            for dst, src in zip(buffers, inputs_sets[r % len(inputs_sets)]):
                dst.copy_(src)
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            if q:
                torch.cuda._sleep(QUEUE_CYCLES)
            a.record()
            g.replay()
            b.record()
            b.synchronize()
            (queued_times if q else times).append(a.elapsed_time(b) / 1e3)
    del g
    return (times, queued_times) if queued else times


def profile_kernels(fn, reps: int = PROFILE_REPS) -> tuple[dict[str, float], list[tuple[str, float, float]]]:
    """Device microseconds per call of each kernel fn launches (eager, torch.profiler), by kernel name, and every
    kernel's (name, start, end) interval in microseconds."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    per_call = {ev.key: ev.device_time_total / reps for ev in prof.key_averages() if ev.device_time_total > 0}
    spans = [(ev.name, float(ev.time_range.start), float(ev.time_range.end)) for ev in prof.events()
             if ev.device_type == torch.autograd.DeviceType.CUDA and ev.time_range.end > ev.time_range.start]
    return per_call, spans


def is_gemm_kernel(name: str) -> bool:
    """Our grouped-GEMM kernels (stream_gemm*, wg_gemm*) and torch's _grouped_mm (a CUTLASS sm90 GEMM)."""
    return "stream_gemm" in name or "wg_gemm" in name or ("cutlass" in name and "Gemm" in name)


def union_length(spans: list[tuple[float, float]]) -> float:
    """Length of the union of [start, end) intervals."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(spans):
        if end <= reach:
            continue
        total += end - max(start, reach)
        reach = end
    return total


def exposed_other_us(spans: list[tuple[str, float, float]], reps: int) -> float:
    """Microseconds per call during which a non-GEMM kernel runs and no GEMM kernel does: the union of all kernel
    intervals minus the union of the GEMM kernels'. Kernels launched with programmatic dependent launch start
    before their predecessor ends and wait inside; that overlap counts in their own durations (``*_other_us``)
    but not here."""
    every = union_length([(a, b) for _, a, b in spans])
    gemm = union_length([(a, b) for n, a, b in spans if is_gemm_kernel(n)])
    return (every - gemm) / reps


def short_kernel_name(name: str) -> str:
    """A profiler kernel name without its return type, megamoe::sm90 / anonymous namespaces and parameter list."""
    return name.replace("(anonymous namespace)::", "").split("(")[0].replace("void ", "").replace("megamoe::sm90::", "")


def kernel_table(per_call: dict[str, float]) -> dict[str, float]:
    """Per-call microseconds by short kernel name."""
    out: dict[str, float] = {}
    for k, v in per_call.items():
        name = short_kernel_name(k)
        out[name] = round(out.get(name, 0.0) + v, 2)
    return out


def split_profile(kernels: dict[str, float]) -> tuple[float, float, str]:
    gemm = {k: v for k, v in kernels.items() if is_gemm_kernel(k)}
    names = sorted({short_kernel_name(k)[:40] for k in gemm})
    return sum(gemm.values()), sum(kernels.values()) - sum(gemm.values()), ",".join(names)


# ----------------------------------------------------------------------------- bytes, FLOPs and rates
GEMMS = ("gemm1", "gemm2")  # the forward's two grouped GEMMs: gate/up (w13, SiLU*up epilogue), then down (w2)


def expert_weight_bytes(cfg: MoEConfig, dtype: str = "nvfp4") -> dict[str, int]:
    """Bytes one expert's weights occupy, per GEMM: ``nvfp4`` = packed E2M1 codes (half a byte per weight) plus the
    E4M3 block scales (one byte per 16 weights), the per-expert float32 global scales left out (a few bytes);
    ``bf16`` = two bytes per weight. gemm1 reads w13 [2I, H], gemm2 reads w2 [H, I]."""
    h, i = cfg.hidden_size, cfg.intermediate_size
    if dtype == "nvfp4":
        per = lambda n: n // 2 + n // 16  # noqa: E731
    elif dtype == "bf16":
        per = lambda n: 2 * n  # noqa: E731
    else:
        raise ValueError(f"expert_weight_bytes: dtype {dtype!r}, expected 'nvfp4' or 'bf16'")
    return {"gemm1": per(2 * i * h), "gemm2": per(h * i)}


def gemm_flops(cfg: MoEConfig, t: int) -> dict[str, float]:
    """Expert FLOPs of each GEMM for t tokens (2 per multiply-add, every one of the t * k routed rows):
    gemm1 2*t*k*H*2I, gemm2 2*t*k*I*H; their sum is ``CudaSm90Backend.expert_flops``."""
    rows = t * cfg.top_k
    return {"gemm1": 2.0 * rows * cfg.hidden_size * 2 * cfg.intermediate_size,
            "gemm2": 2.0 * rows * cfg.intermediate_size * cfg.hidden_size}


def experts_touched(topk_ids: torch.Tensor, num_experts: int) -> int:
    """How many distinct experts in [0, num_experts) the routing sends a row to (ids outside, dropped slots, don't
    count)."""
    ids = topk_ids.reshape(-1).long()
    ids = ids[(ids >= 0) & (ids < num_experts)]
    return int(torch.unique(ids).numel())


def rates(nbytes: float, flops: float, seconds: float) -> tuple[float, float]:
    """(GB/s, TFLOP/s) of moving ``nbytes`` and doing ``flops`` in ``seconds``."""
    if not seconds > 0:
        raise ValueError(f"rates: time {seconds!r} s, expected > 0")
    return nbytes / seconds / 1e9, flops / seconds / 1e12


def shape_row(preset: str, cfg: MoEConfig, t: int, tp: int, routing_ids: list[torch.Tensor], copy_bw: float,
              bf16_rate: float) -> dict:
    """A record row's fields that follow from the shapes and the routing alone: the experts touched (mean over the
    rotated sets ``routing_ids``, and those of the first set, which the profiled forwards run), the weight bytes they
    hold (NVFP4 and bf16), the expert FLOPs (all and per GEMM) and the floors at the measured copy bandwidth
    (bytes read + written per second) and bf16 matmul rate (FLOP/s)."""
    nvfp4_b, bf16_b = expert_weight_bytes(cfg), expert_weight_bytes(cfg, "bf16")
    used = statistics.mean(experts_touched(ids, cfg.num_experts) for ids in routing_ids)
    used0 = experts_touched(routing_ids[0], cfg.num_experts)
    fl = gemm_flops(cfg, t)
    wbytes, flops = used * sum(nvfp4_b.values()), sum(fl.values())
    row = {"preset": preset, "tp": tp, "I": cfg.intermediate_size, "T": t, "experts_used": used,
           "nvfp4_weight_bytes": wbytes, "bf16_weight_bytes": used * sum(bf16_b.values()),
           "flops": flops, "gemm1_flops": fl["gemm1"], "gemm2_flops": fl["gemm2"],
           "floor_weight_us": wbytes / copy_bw * 1e6, "floor_compute_us": flops / bf16_rate * 1e6,
           "profile_experts_used": used0}
    for g in GEMMS:
        row[f"profile_{g}_weight_bytes"] = used0 * nvfp4_b[g]
        row[f"profile_{g}_bf16_weight_bytes"] = used0 * bf16_b[g]
    return row


def timed_fields(row: dict, path: str, times: list[float], queued: list[float], copy_bw: float) -> dict:
    """The fields of one timed path (``sm90_<mode>`` or ``torch_bf16``) from its per-replay times in seconds (onto an
    idle GPU, and queued behind device work): the median and 10th percentile in microseconds, the weight-streaming
    rate (the row's NVFP4 bytes, torch: bf16 bytes / median) and the TFLOP/s; for ours also the share of the copy
    bandwidth and ``roofline_frac_<mode>`` (the larger floor / median)."""
    med = statistics.median(times)
    nbytes = row["bf16_weight_bytes" if path == "torch_bf16" else "nvfp4_weight_bytes"]
    out = {f"{path}_us": med * 1e6, f"{path}_p10_us": sorted(times)[len(times) // 10] * 1e6,
           f"{path}_queued_us": statistics.median(queued) * 1e6}
    out[f"{path}_weight_GBps"], out[f"{path}_tflops"] = rates(nbytes, row["flops"], med)
    if path.startswith("sm90_"):
        out[f"{path}_pct_copy_bw"] = 100 * nbytes / med / copy_bw
        out[f"roofline_frac_{path[5:]}"] = max(row["floor_weight_us"], row["floor_compute_us"]) / (med * 1e6)
    return out


def profile_record(row: dict, path: str, per_call: dict[str, float],
                   spans: list[tuple[str, float, float]], reps: int) -> dict:
    """The fields of one profiled path (:func:`profile_kernels`' output over ``reps`` forwards of the row's first
    routing set): the GEMM kernels' and the other kernels' summed durations, every kernel's by name, the GEMM
    kernels together as rates, and :func:`profile_fields` (per GEMM, the non-GEMM share)."""
    bf16 = path == "torch_bf16"
    nbytes = {g: row[f"profile_{g}_bf16_weight_bytes" if bf16 else f"profile_{g}_weight_bytes"] for g in GEMMS}
    fl = {g: row[f"{g}_flops"] for g in GEMMS}
    g_us, o_us, names = split_profile(per_call)
    out = {f"{path}_gemm_us": g_us, f"{path}_other_us": o_us, f"{path}_kernels_us": kernel_table(per_call),
           f"{path}_gemm_kernels": names}
    if g_us > 0:
        out[f"{path}_gemm_weight_GBps"], out[f"{path}_gemm_tflops"] = \
            rates(sum(nbytes.values()), sum(fl.values()), g_us * 1e-6)
    out.update(profile_fields(path, spans, reps, nbytes, fl))
    return out


def kernel_launches(spans: list[tuple[str, float, float]], reps: int) -> tuple[list[dict], float]:
    """The GEMM launches of one forward, from ``reps`` identical forwards' kernel intervals (name, start, end in
    microseconds): for the p-th GEMM kernel of a forward (in launch order, i.e. by start: one stream), its short
    name, its mean duration ``us`` (start to end, so with programmatic dependent launch it holds the wait for the
    kernel before it) and its mean ``exclusive_us`` (from the later of its start and the end of every kernel
    launched before it, to its end: the time the forward spends on it alone). Also the busy time per forward (the
    union of all kernels' intervals / reps; the exclusive times of all kernels add up to it).
    ValueError when the GEMM kernels are not a whole number per forward."""
    if reps < 1:
        raise ValueError(f"kernel_launches: reps {reps}, expected >= 1")
    reach = float("-inf")
    gemm = []
    for name, start, end in sorted(spans, key=lambda s: (s[1], s[2])):
        exclusive = max(0.0, end - max(start, reach))
        reach = max(reach, end)
        if is_gemm_kernel(name):
            gemm.append((short_kernel_name(name), end - start, exclusive))
    if not gemm or len(gemm) % reps:
        raise ValueError(f"{len(gemm)} GEMM kernels in {reps} forwards: not a whole number per forward")
    per = len(gemm) // reps
    launches = []
    for p in range(per):
        mine = gemm[p::per]
        launches.append({"kernel": ",".join(sorted({n for n, _, _ in mine})),
                         "us": sum(d for _, d, _ in mine) / reps, "exclusive_us": sum(x for _, _, x in mine) / reps})
    return launches, union_length([(a, b) for _, a, b in spans]) / reps


def profile_fields(prefix: str, spans: list[tuple[str, float, float]], reps: int, gemm_bytes: dict[str, float],
                   flops: dict[str, float]) -> dict:
    """The record's per-GEMM and non-GEMM figures of one profiled path (``prefix``: ``sm90_w4a16``,
    ``torch_bf16``...) from its kernel intervals over ``reps`` forwards, the weight bytes each GEMM reads and the
    FLOPs it does: ``<prefix>_<gemm>_{kernel,us,exclusive_us,weight_GBps,tflops}`` for gemm1 and gemm2 (rates from
    ``us``), ``<prefix>_busy_us`` (the union of the forward's kernel intervals), ``<prefix>_other_exposed_us`` (the
    part of it when no GEMM kernel runs) and ``<prefix>_other_share`` (their ratio). A forward with other than two
    GEMM launches gets ``<prefix>_gemm_split_error`` in place of the per-GEMM fields."""
    out: dict = {}
    exposed = exposed_other_us(spans, reps)
    try:
        launches, busy = kernel_launches(spans, reps)
    except ValueError as exc:
        launches, busy = None, union_length([(a, b) for _, a, b in spans]) / reps
        out[f"{prefix}_gemm_split_error"] = str(exc)
    out[f"{prefix}_busy_us"] = busy
    out[f"{prefix}_other_exposed_us"] = exposed
    out[f"{prefix}_other_share"] = exposed / busy if busy > 0 else float("nan")
    if launches is None:
        return out
    if len(launches) != len(GEMMS):
        out[f"{prefix}_gemm_split_error"] = (f"{len(launches)} GEMM kernels per forward "
                                             f"({', '.join(x['kernel'] for x in launches)}), expected gemm1 and gemm2")
        return out
    for g, launch in zip(GEMMS, launches):
        out[f"{prefix}_{g}_kernel"] = launch["kernel"]
        out[f"{prefix}_{g}_us"] = launch["us"]
        out[f"{prefix}_{g}_exclusive_us"] = launch["exclusive_us"]
        gbps, tflops = rates(gemm_bytes[g], flops[g], launch["us"] * 1e-6)
        out[f"{prefix}_{g}_weight_GBps"], out[f"{prefix}_{g}_tflops"] = gbps, tflops
    return out


def versions() -> dict:
    v = {"torch": torch.__version__, "cuda": torch.version.cuda, "python": platform.python_version(),
         "gpu": torch.cuda.get_device_name(), "capability": list(torch.cuda.get_device_capability())}
    try:
        v["driver"] = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                     capture_output=True, text=True, timeout=20).stdout.strip()
    except Exception as exc:  # noqa: BLE001 - informational only
        v["driver"] = f"unknown ({exc})"
    # GIT_COMMIT names the commit of a copied tree (no .git of its own, or another checkout's)
    v["git"] = os.environ.get("GIT_COMMIT", "")[:12]
    if not v["git"]:
        try:
            v["git"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                      cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip() or "unknown"
        except Exception:  # noqa: BLE001
            v["git"] = "unknown"
    return v


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--presets", nargs="+", default=["v4-flash", "v3"])
    ap.add_argument("--tokens", nargs="+", type=int, default=[1, 8, 32, 128, 512, 2048, 8192])
    ap.add_argument("--modes", nargs="+", default=["w4a16", "w4a4"])
    ap.add_argument("--tp", type=int, default=1, metavar="N",
                    help="the shapes of one of N tensor-parallel ranks: intermediate size I / N per expert "
                         "(V4-Flash at 8: I = 256, GEMM 2 with K = 256)")
    ap.add_argument("--top-k", type=int, nargs="+", default=None, metavar="K",
                    help="route each token to K experts, for each K given, in place of the preset's top_k (rows "
                         "<preset>/k<K>): the same GEMM shapes with more or fewer blocks per SM")
    ap.add_argument("--out", default=None,
                    help="JSON path (default: bench/results/moe_<gpu>.json, or moe_<gpu>_tp<N>.json with --tp N, "
                         "moe_<gpu>_topk.json with --top-k; <gpu> h100, h200, ... from the device's name)")
    ap.add_argument("--plot", default=None, help="PNG path (default: next to --out)")
    ap.add_argument("--quick", action="store_true", help="fewer repetitions")
    ap.add_argument("--no-torch", action="store_true", help="skip the torch bf16 baseline")
    ap.add_argument("--kernel", default="auto", help="auto (the dispatch plan), stream, wgmma32, wgmma64 or wgmma128")
    ap.add_argument("--tokens-per-pass", type=int, default=0, help="streaming kernel: 8, 16, 32 or 64 (0: the plan's)")
    ap.add_argument("--variants", action="store_true",
                    help="also time every GEMM kernel forced (T >= 128, and the stream tokens-per-pass choices below)")
    ap.add_argument("--profile", action="store_true", help="per-kernel times from torch.profiler (GEMM vs the rest)")
    ap.add_argument("--no-batch-invariant", dest="batch_invariant", action="store_false",
                    help="the plan's fastest kernel per T (streaming decode), as MoELayer.batch_invariant = False; "
                         "default: the batch-invariant plan (docs/SPEC.md §3.5)")
    args = ap.parse_args(argv)
    try:
        args.configs = {}
        for p in args.presets:
            cfg = bench_config(p, args.tp)
            for k in args.top_k or [None]:
                if k is None:
                    args.configs[p] = cfg
                elif not 1 <= k <= cfg.num_experts:
                    raise ValueError(f"--top-k {k}: expected 1 to {cfg.num_experts} (the experts of {p})")
                else:
                    args.configs[f"{p}/k{k}"] = cfg.with_(top_k=k)
    except ValueError as exc:
        ap.error(str(exc))
    if args.out is None:
        gpu = gpu_tag(torch.cuda.get_device_name() if torch.cuda.is_available() else "")
        suffix = (f"_tp{args.tp}" if args.tp != 1 else "") + ("_topk" if args.top_k else "")
        args.out = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", f"moe_{gpu}{suffix}.json")
    return args


def gpu_tag(device_name: str) -> str:
    """The record's GPU in its default file name: ``h100`` for "NVIDIA H100 80GB HBM3", ``h200``, ``b200``, ...; the
    sanitized name for another card, ``gpu`` without one (so one card's run never overwrites another's record)."""
    m = re.search(r"\b([A-Z]{1,2}\d{2,4}[A-Z]?)\b", device_name.upper())
    if m:
        return m.group(1).lower()
    tag = re.sub(r"[^a-z0-9]+", "_", device_name.lower()).strip("_")
    return tag or "gpu"



def main(argv=None) -> int:
    args = parse_args(argv)

    from megamoe.backends import get_backend

    torch.backends.cuda.matmul.allow_tf32 = False
    gen = torch.Generator(device="cuda").manual_seed(1234)
    be = get_backend("cuda-sm90")
    be.kernel, be.tokens_per_pass = args.kernel, args.tokens_per_pass
    copy_bw = measure_copy_bw()
    bf16_rate = measure_bf16_rate()
    print(f"floors: copy {copy_bw / 1e12:.2f} TB/s (read+write), bf16 matmul {bf16_rate / 1e12:.0f} TFLOP/s", flush=True)
    # the rows as they are measured ("row" in place of "preset": the table at the end is the one that starts with it)
    print(TABLE_HEADER.replace("preset", "row   ", 1), flush=True)

    results = []
    for preset, base in args.configs.items():
        weights = random_weights(base, gen)
        prepared = be.prepare_weights(weights)
        per_expert_nvfp4 = sum(expert_weight_bytes(base).values())
        if per_expert_nvfp4 * base.num_experts != weights.w13.nbytes() + weights.w2.nbytes():
            raise RuntimeError(f"{preset}: the weights hold {weights.w13.nbytes() + weights.w2.nbytes()} bytes, "
                               f"expected {per_expert_nvfp4} per expert x {base.num_experts}")
        tw13 = tw2 = None
        if not args.no_torch:
            tw13, tw2 = bf16_weights(base, gen)
        for t in args.tokens:
            sets = [random_routing(t, base, gen) for _ in range(ROTATE)]
            row = shape_row(preset, base, t, args.tp, [s[1] for s in sets], copy_bw, bf16_rate)
            reps = 30 if args.quick else (200 if t <= 128 else (50 if t <= 2048 else 20))
            bufs = [s.clone() for s in sets[0]]
            for mode in args.modes:
                cfg = base.with_(act_mode=mode)
                try:
                    pa = plan_args(cfg, t, mode)
                    row[f"sm90_{mode}_plan"] = plan_summary(be.plan(**pa, batch_invariant=args.batch_invariant))
                    times, queued = time_graph(lambda: be.moe_forward(prepared, cfg, bufs[0], bufs[1], bufs[2], args.batch_invariant), sets,
                                               bufs, reps, queued=True)
                    row.update(timed_fields(row, f"sm90_{mode}", times, queued, copy_bw))
                except Exception as exc:  # noqa: BLE001 - report and carry on with the other rows
                    row[f"sm90_{mode}_error"] = repr(exc)
            if args.profile:
                for mode in args.modes:
                    cfg = base.with_(act_mode=mode)
                    x0, ids0, w0 = sets[0]
                    try:
                        per_call, spans = profile_kernels(lambda: be.moe_forward(prepared, cfg, x0, ids0, w0, args.batch_invariant))
                        row.update(profile_record(row, f"sm90_{mode}", per_call, spans, PROFILE_REPS))
                    except Exception as exc:  # noqa: BLE001
                        row[f"sm90_{mode}_profile_error"] = repr(exc)
            if args.variants:
                # every GEMM kernel at the same shape (W4A16), to place the switch; streaming with each
                # tokens-per-pass choice up to 32 expected tokens per expert
                choices = []
                if t >= 128:
                    choices += [(k, 0) for k in VARIANT_KERNELS if not (k == "stream" and t > 2048)]
                tpe = -(-t * base.top_k // base.num_experts)
                if tpe <= 32:
                    choices += [("stream", tpp) for tpp in (8, 16, 32) if tpp <= 4 * max(tpe, 2)]
                for kernel, tpp in choices:
                    if "w4a16" not in args.modes:
                        break
                    cfg = base.with_(act_mode="w4a16")
                    be.kernel, be.tokens_per_pass = kernel, tpp
                    key = f"sm90_w4a16_{kernel}{tpp or ''}_us"
                    try:
                        times = time_graph(lambda: be.moe_forward(prepared, cfg, bufs[0], bufs[1], bufs[2], args.batch_invariant), sets,
                                           bufs, max(10, reps // 2))
                        row[key] = statistics.median(times) * 1e6
                    except Exception as exc:  # noqa: BLE001
                        row[key.replace("_us", "_error")] = repr(exc)
                    finally:
                        be.kernel, be.tokens_per_pass = args.kernel, args.tokens_per_pass
            if tw13 is not None:
                try:
                    times, queued = time_graph(lambda: torch_grouped_moe(bufs[0], bufs[1], bufs[2], tw13, tw2, base), sets,
                                               bufs, reps, queued=True)
                    row.update(timed_fields(row, "torch_bf16", times, queued, copy_bw))
                    if args.profile:
                        x0, ids0, w0 = sets[0]
                        per_call, spans = profile_kernels(lambda: torch_grouped_moe(x0, ids0, w0, tw13, tw2, base))
                        row.update(profile_record(row, "torch_bf16", per_call, spans, PROFILE_REPS))
                    for mode in args.modes:
                        if f"sm90_{mode}_us" in row:
                            row[f"speedup_{mode}_vs_torch"] = row["torch_bf16_us"] / row[f"sm90_{mode}_us"]
                except Exception as exc:  # noqa: BLE001
                    row["torch_bf16_error"] = repr(exc)
            results.append(row)
            print("\n".join(row_lines(row, args.modes)), flush=True)
            write_report(args, argv, copy_bw, bf16_rate, results)  # after every row: a killed run keeps its rows
        del weights, prepared, tw13, tw2
        be._workspaces.clear()
        torch.cuda.empty_cache()

    report = write_report(args, argv, copy_bw, bf16_rate, results)
    plot = args.plot or os.path.splitext(args.out)[0] + ".png"
    try:
        make_plot(report, plot, args.modes)
    except Exception as exc:  # noqa: BLE001
        print(f"plot failed: {exc!r}")
    print_table(report, args.modes)
    return 0


def write_report(args, argv, copy_bw, bf16_rate, results) -> dict:
    report = {
        "command": "python " + " ".join([os.path.relpath(__file__)] + (argv if argv is not None else sys.argv[1:])),
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name(),
        "tp": args.tp,
        "batch_invariant": getattr(args, "batch_invariant", True),
        "versions": versions(),
        "floors": {"copy_bw_Bps_read_plus_write": copy_bw, "bf16_matmul_flops": bf16_rate},
        "method": "median of per-replay CUDA-event times of a captured CUDA graph of the routed-expert forward; "
                  f"{ROTATE} routing/activation sets rotated between replays; *_us: each replay launched onto an idle "
                  "GPU, *_queued_us: queued behind a device-side spin (the graph's device time alone), the two "
                  "alternately; weight floor = NVFP4 bytes of used "
                  "experts / copy bandwidth; torch baseline = bf16 torch._grouped_mm on bf16 weights, same routing; "
                  "*_weight_GBps, *_tflops, *_gemm1_*, *_gemm2_*, *_other_share: bench/README.md, 'Rates beside each "
                  "time'",
        "results": results,
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out + ".tmp", "w") as f:
        json.dump(report, f, indent=1)
    os.replace(args.out + ".tmp", args.out)
    return report


def make_plot(report, path, modes):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    presets = sorted({r["preset"] for r in report["results"]}, key=lambda p: [r["preset"] for r in report["results"]].index(p))
    fig, axes = plt.subplots(1, len(presets), figsize=(6 * len(presets), 4.5), squeeze=False)
    for ax, p in zip(axes[0], presets):
        rows = [r for r in report["results"] if r["preset"] == p]
        ts = [r["T"] for r in rows]
        for key, label in [(f"sm90_{m}_us", f"cuda-sm90 {m.upper()}") for m in modes] + [("torch_bf16_us", "torch bf16 _grouped_mm")]:
            pts = [(r["T"], r[key]) for r in rows if key in r]
            if pts:
                ax.plot(*zip(*pts), marker="o", label=label)
        ax.plot(ts, [max(r["floor_weight_us"], r["floor_compute_us"]) for r in rows], "k--", label="floor (NVFP4 bytes / copy BW, FLOPs / bf16 rate)")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("tokens T")
        ax.set_ylabel("routed-expert forward time (us)")
        ax.set_title(f"{p}{'' if report.get('tp', 1) == 1 else ' (one of %d TP ranks)' % report['tp']} on {report['device']}")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def print_table(report, modes):
    print("\n".join(table_lines(report, modes)))


TABLE_LEGEND = (
    "us: median forward (CUDA graph, onto an idle GPU); queued: behind device work; %roof: roofline / us",
    "GB/s, TF/s: weight bytes of the experts touched (NVFP4; torch: bf16), expert FLOPs, / us",
    "g1, g2 (--profile): each GEMM kernel's weight bytes, FLOPs / its duration; other% (--profile): share of the",
    "forward's kernel time when no GEMM kernel runs; xtorch: torch us / us. Definitions: bench/README.md")
TABLE_HEADER = (f"{'preset':9} {'T':>5} {'path':6} {'us':>9} {'queued':>9} {'%roof':>5} {'GB/s':>6} {'TF/s':>6} "
                f"{'g1GB/s':>6} {'g1TF/s':>6} {'g2GB/s':>6} {'g2TF/s':>6} {'other%':>6} {'xtorch':>6}  plan")


def _cell(v, width: int, fmt: str) -> str:
    return f"{v:>{width}{fmt}}" if isinstance(v, (int, float)) and v == v else f"{'-':>{width}}"


def row_lines(r: dict, modes) -> list[str]:
    """The table's lines of one record row: one per mode that ran, and one for torch bf16 when it ran."""
    lines = []
    for path in [f"sm90_{m}" for m in modes] + ["torch_bf16"]:
        if path == "torch_bf16" and not any(k.startswith("torch_bf16_") for k in r):
            continue
        mode = path[5:] if path.startswith("sm90_") else None
        us = r.get(f"{path}_us")
        share = r.get(f"{path}_other_share")
        cells = [f"{r['preset']:9} {r['T']:>5} {mode or 'torch':6}",
                 _cell(us, 9, ".1f") if us is not None else f"{'err':>9}",
                 _cell(r.get(f"{path}_queued_us"), 9, ".1f"),
                 _cell(100 * r[f"roofline_frac_{mode}"] if f"roofline_frac_{mode}" in r else None, 5, ".0f"),
                 _cell(r.get(f"{path}_weight_GBps"), 6, ".0f"), _cell(r.get(f"{path}_tflops"), 6, ".1f"),
                 _cell(r.get(f"{path}_gemm1_weight_GBps"), 6, ".0f"), _cell(r.get(f"{path}_gemm1_tflops"), 6, ".1f"),
                 _cell(r.get(f"{path}_gemm2_weight_GBps"), 6, ".0f"), _cell(r.get(f"{path}_gemm2_tflops"), 6, ".1f"),
                 _cell(100 * share if share is not None else None, 6, ".1f"),
                 _cell(r.get(f"speedup_{mode}_vs_torch"), 6, ".2f")]
        lines.append(" ".join(cells) + f"  {r.get(f'{path}_plan', '-')}")
    return lines


def error_lines(report) -> list[str]:
    """One line per error a row records (a path that failed, a profile that could not be split), shortened."""
    out = []
    for r in report["results"]:
        for k, v in r.items():
            if k.endswith("_error"):
                out.append(f"{r['preset']} T={r['T']} {k}: {str(v)[:160]}")
    return out


def table_lines(report, modes) -> list[str]:
    """The printed summary: one line per preset x path x T (bench/README.md defines the columns), the errors, and
    with --variants the forced kernels' times."""
    lines = [*TABLE_LEGEND, TABLE_HEADER]
    for r in report["results"]:
        lines += row_lines(r, modes)
    errors = error_lines(report)
    if errors:
        lines += ["errors:"] + ["  " + e for e in errors]
    keys = sorted({k for r in report["results"] for k in r
                   if k.startswith("sm90_w4a16_") and k.endswith("_us") and k[11:-3].startswith(VARIANT_KERNELS)
                   and not k.endswith(("gemm_us", "other_us", "p10_us"))})
    if keys:
        lines.append("variants (W4A16 us): " + " ".join(k[11:-3] for k in keys))
        for r in report["results"]:
            if any(k in r for k in keys):
                lines.append(f"{r['preset']:9} {r['T']:>5} " + " ".join(f"{r[k]:>10.1f}" if k in r else f"{'-':>10}"
                                                                        for k in keys)
                             + f"  auto {r.get('sm90_w4a16_us', float('nan')):.1f}")
    return lines


if __name__ == "__main__":
    raise SystemExit(main())

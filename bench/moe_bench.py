"""Whole-MoE-forward benchmark on one GPU: cuda-sm90 (W4A16, W4A4) against torch bf16
``torch._grouped_mm`` on the same shapes and routing, next to the measured floors.

    python bench/moe_bench.py                      # full run (see bench/README.md)
    python bench/moe_bench.py --quick --tokens 1 32 # smoke run
    python bench/moe_bench.py --tp 8               # one tensor-parallel rank's shapes (I / 8 per expert)

``--tp N``: the shapes one rank of N-way tensor parallelism runs (``megamoe.distributed``): every
expert's intermediate size I / N (V4-Flash at N = 8: I = 256, so GEMM 1 has N = 512 rows per expert
and GEMM 2 has K = 256), H, E and the routing unchanged; each row records the dispatch plan the
backend picks at those shapes (``sm90_<mode>_plan``). The partial sums' all-reduce is not timed.

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

``--profile``: per-kernel device times from ``torch.profiler`` (eager forwards): the grouped-GEMM
kernels' own time and rate (``*_gemm_us``, ``*_gemm_tflops``, ``*_gemm_weight_GBps``) next to
torch's ``_grouped_mm`` kernels, and everything else (align, staging, combine) as ``*_other_us`` (the sum of
those kernels' own durations, which with programmatic dependent launch include the time they wait for the GEMM
before them), ``*_other_exposed_us`` (the time a non-GEMM kernel runs while no GEMM kernel does) and every kernel's
time in ``*_kernels_us``.
"""
from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import statistics
import subprocess
import sys
import time

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
    ap.add_argument("--out", default=None,
                    help="JSON path (default: bench/results/moe_h200.json, or moe_h200_tp<N>.json with --tp N)")
    ap.add_argument("--plot", default=None, help="PNG path (default: next to --out)")
    ap.add_argument("--quick", action="store_true", help="fewer repetitions")
    ap.add_argument("--no-torch", action="store_true", help="skip the torch bf16 baseline")
    ap.add_argument("--kernel", default="auto", help="auto (the dispatch plan), stream, wgmma32, wgmma64 or wgmma128")
    ap.add_argument("--tokens-per-pass", type=int, default=0, help="streaming kernel: 8, 16, 32 or 64 (0: the plan's)")
    ap.add_argument("--variants", action="store_true",
                    help="also time every GEMM kernel forced (T >= 128, and the stream tokens-per-pass choices below)")
    ap.add_argument("--profile", action="store_true", help="per-kernel times from torch.profiler (GEMM vs the rest)")
    args = ap.parse_args(argv)
    try:
        args.configs = {p: bench_config(p, args.tp) for p in args.presets}
    except ValueError as exc:
        ap.error(str(exc))
    if args.out is None:
        args.out = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                "moe_h200.json" if args.tp == 1 else f"moe_h200_tp{args.tp}.json")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)

    from megamoe.backends import get_backend
    from megamoe.backends.cuda_sm90 import CudaSm90Backend

    torch.backends.cuda.matmul.allow_tf32 = False
    gen = torch.Generator(device="cuda").manual_seed(1234)
    be = get_backend("cuda-sm90")
    be.kernel, be.tokens_per_pass = args.kernel, args.tokens_per_pass
    copy_bw = measure_copy_bw()
    bf16_rate = measure_bf16_rate()
    print(f"floors: copy {copy_bw / 1e12:.2f} TB/s (read+write), bf16 matmul {bf16_rate / 1e12:.0f} TFLOP/s", flush=True)

    results = []
    for preset in args.presets:
        base = args.configs[preset]
        weights = random_weights(base, gen)
        prepared = be.prepare_weights(weights)
        per_expert_nvfp4 = (weights.w13.nbytes() + weights.w2.nbytes()) // base.num_experts
        tw13 = tw2 = None
        if not args.no_torch:
            tw13, tw2 = bf16_weights(base, gen)
        for t in args.tokens:
            sets = [random_routing(t, base, gen) for _ in range(ROTATE)]
            used = statistics.mean(int(torch.unique(s[1]).numel()) for s in sets)
            wbytes = used * per_expert_nvfp4
            flops = CudaSm90Backend.expert_flops(base, t)
            reps = 30 if args.quick else (200 if t <= 128 else (50 if t <= 2048 else 20))
            row = {"preset": preset, "tp": args.tp, "I": base.intermediate_size, "T": t, "experts_used": used,
                   "nvfp4_weight_bytes": wbytes, "flops": flops,
                   "floor_weight_us": wbytes / copy_bw * 1e6,
                   "floor_compute_us": flops / bf16_rate * 1e6}
            bufs = [s.clone() for s in sets[0]]
            for mode in args.modes:
                cfg = base.with_(act_mode=mode)
                try:
                    pa = plan_args(cfg, t, mode)
                    row[f"sm90_{mode}_plan"] = plan_summary(be.plan(**pa))
                    times, queued = time_graph(lambda: be.moe_forward(prepared, cfg, bufs[0], bufs[1], bufs[2]), sets,
                                               bufs, reps, queued=True)
                    med = statistics.median(times)
                    row[f"sm90_{mode}_us"] = med * 1e6
                    row[f"sm90_{mode}_p10_us"] = sorted(times)[len(times) // 10] * 1e6
                    row[f"sm90_{mode}_weight_GBps"] = wbytes / med / 1e9
                    row[f"sm90_{mode}_pct_copy_bw"] = 100 * wbytes / med / copy_bw
                    row[f"sm90_{mode}_tflops"] = flops / med / 1e12
                    row[f"roofline_frac_{mode}"] = max(row["floor_weight_us"], row["floor_compute_us"]) / (med * 1e6)
                    row[f"sm90_{mode}_queued_us"] = statistics.median(queued) * 1e6
                except Exception as exc:  # noqa: BLE001 - report and carry on with the other rows
                    row[f"sm90_{mode}_error"] = repr(exc)
            if args.profile:
                for mode in args.modes:
                    cfg = base.with_(act_mode=mode)
                    x0, ids0, w0 = sets[0]
                    try:
                        per_call, spans = profile_kernels(lambda: be.moe_forward(prepared, cfg, x0, ids0, w0))
                        g_us, o_us, names = split_profile(per_call)
                        row[f"sm90_{mode}_gemm_us"], row[f"sm90_{mode}_other_us"] = g_us, o_us
                        row[f"sm90_{mode}_other_exposed_us"] = exposed_other_us(spans, PROFILE_REPS)
                        row[f"sm90_{mode}_kernels_us"] = kernel_table(per_call)
                        row[f"sm90_{mode}_gemm_kernels"] = names
                        row[f"sm90_{mode}_gemm_tflops"] = flops / (g_us * 1e-6) / 1e12
                        row[f"sm90_{mode}_gemm_weight_GBps"] = wbytes / (g_us * 1e-6) / 1e9
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
                        times = time_graph(lambda: be.moe_forward(prepared, cfg, bufs[0], bufs[1], bufs[2]), sets,
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
                    med = statistics.median(times)
                    row["torch_bf16_us"] = med * 1e6
                    row["torch_bf16_queued_us"] = statistics.median(queued) * 1e6
                    row["torch_bf16_tflops"] = flops / med / 1e12
                    row["torch_bf16_weight_GBps"] = used * 3 * base.hidden_size * base.intermediate_size * 2 / med / 1e9
                    if args.profile:
                        x0, ids0, w0 = sets[0]
                        per_call, _ = profile_kernels(lambda: torch_grouped_moe(x0, ids0, w0, tw13, tw2, base))
                        g_us, o_us, _ = split_profile(per_call)
                        row["torch_bf16_gemm_us"], row["torch_bf16_other_us"] = g_us, o_us
                        row["torch_bf16_gemm_tflops"] = flops / (g_us * 1e-6) / 1e12
                    for mode in args.modes:
                        if f"sm90_{mode}_us" in row:
                            row[f"speedup_{mode}_vs_torch"] = row["torch_bf16_us"] / row[f"sm90_{mode}_us"]
                except Exception as exc:  # noqa: BLE001
                    row["torch_bf16_error"] = repr(exc)
            results.append(row)
            print(json.dumps({k: (round(v, 3) if isinstance(v, float) else v) for k, v in row.items()}), flush=True)
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
        "versions": versions(),
        "floors": {"copy_bw_Bps_read_plus_write": copy_bw, "bf16_matmul_flops": bf16_rate},
        "method": "median of per-replay CUDA-event times of a captured CUDA graph of the routed-expert forward; "
                  f"{ROTATE} routing/activation sets rotated between replays; *_us: each replay launched onto an idle "
                  "GPU, *_queued_us: queued behind a device-side spin (the graph's device time alone), the two "
                  "alternately; weight floor = NVFP4 bytes of used "
                  "experts / copy bandwidth; torch baseline = bf16 torch._grouped_mm on bf16 weights, same routing",
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
    hdr = f"{'preset':9} {'T':>5} " + " ".join(f"{m + '_us':>10} {'%roof':>5} {'TF/s':>6}" for m in modes) + \
          f" {'torch_us':>10} " + " ".join(f"{'x_' + m:>8}" for m in modes) + f" {'floor_us':>9}"
    print(hdr)
    for r in report["results"]:
        cells = [f"{r['preset']:9} {r['T']:>5} "]
        for m in modes:
            us = r.get(f"sm90_{m}_us")
            cells.append(f"{us:>10.1f} {100 * r[f'roofline_frac_{m}']:>5.0f} {r[f'sm90_{m}_tflops']:>6.1f}" if us
                         else f"{'err':>10} {'':>5} {'':>6}")
        tu = r.get("torch_bf16_us")
        cells.append(f" {tu:>10.1f} " if tu else f" {'-':>10} ")
        for m in modes:
            sp = r.get(f"speedup_{m}_vs_torch")
            cells.append(f"{sp:>8.2f}" if sp else f"{'-':>8}")
        cells.append(f" {max(r['floor_weight_us'], r['floor_compute_us']):>9.1f}")
        print(" ".join(cells))
    if any("sm90_w4a16_queued_us" in r for r in report["results"]):
        print("queued behind device work (the graph's device time alone, us): " + " ".join(modes) + " torch")
        for r in report["results"]:
            print(f"{r['preset']:9} {r['T']:>5} " + " ".join(f"{r.get(f'sm90_{m}_queued_us', float('nan')):>10.1f}" for m in modes)
                  + f" {r.get('torch_bf16_queued_us', float('nan')):>10.1f}")
    if any("sm90_w4a16_gemm_us" in r for r in report["results"]):
        print("GEMM kernels' own time (torch.profiler, W4A16): ours us / TF/s / weight GB/s, other kernels us "
              "(their durations; exposed) | torch _grouped_mm us / TF/s, other us")
        for r in report["results"]:
            if "sm90_w4a16_gemm_us" in r:
                print(f"{r['preset']:9} {r['T']:>5} {r['sm90_w4a16_gemm_us']:>9.1f} {r['sm90_w4a16_gemm_tflops']:>6.1f} "
                      f"{r['sm90_w4a16_gemm_weight_GBps']:>7.0f} {r['sm90_w4a16_other_us']:>8.1f} "
                      f"{r.get('sm90_w4a16_other_exposed_us', float('nan')):>7.1f} | "
                      f"{r.get('torch_bf16_gemm_us', float('nan')):>9.1f} {r.get('torch_bf16_gemm_tflops', float('nan')):>6.1f} "
                      f"{r.get('torch_bf16_other_us', float('nan')):>8.1f}  {r.get('sm90_w4a16_gemm_kernels', '')}")
    keys = sorted({k for r in report["results"] for k in r
                   if k.startswith("sm90_w4a16_") and k.endswith("_us") and k[11:-3].startswith(VARIANT_KERNELS)
                   and not k.endswith(("gemm_us", "other_us", "p10_us"))})
    if keys:
        print("variants (W4A16 us): " + " ".join(k[11:-3] for k in keys))
        for r in report["results"]:
            if any(k in r for k in keys):
                print(f"{r['preset']:9} {r['T']:>5} " + " ".join(f"{r[k]:>10.1f}" if k in r else f"{'-':>10}" for k in keys)
                      + f"  auto {r.get('sm90_w4a16_us', float('nan')):.1f}")


if __name__ == "__main__":
    raise SystemExit(main())

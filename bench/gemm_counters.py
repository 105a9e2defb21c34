"""Hardware counters of the sm90 GEMM kernels of one MoE forward, read by Nsight Compute (ncu).

    python bench/gemm_counters.py                          # v4-flash T = 1, v3 T = 1, v4-flash T = 2048 and 8192
    python bench/gemm_counters.py --shapes v4-flash:1:w4a4 --out /tmp/c.json

For each shape (preset:T[:mode], mode w4a16 by default) it runs ncu on this script's ``--forward`` child: three
eager forwards of random NVFP4 weights and routing (bench/moe_bench.py's), then one between
cudaProfilerStart/Stop, whose wgmma and streaming GEMM kernels ncu profiles one at a time (no overlap with the
kernels around them, so durations run longer than in the CUDA-graph forward). ncu runs with ``--clock-control
none``: the GPU keeps its own clocks, as in the benchmarks. Per kernel it keeps the duration, the SM clock, DRAM
bytes per second and the share of cycles DRAM was active, the tensor pipe's and the issue slots' active shares,
warps per scheduler, the L2 hit rate, the L2, L1, memory and SM throughput as shares of their peaks (where this ncu
reports them), the launch (grid, registers, shared memory, waves) and the stall reasons per issued instruction,
largest first; it prints a table and writes bench/results/gemm_counters_<gpu>.json.

``--sources`` also profiles each GEMM kernel once more with ncu's SourceCounters section and sums its warp stall
samples per SASS instruction by what the instruction does (``stall_samples``: the wgmma drain, wgmma issue, waits on
the stage ring's full barriers, bf16x2 math, shared and global memory, block barriers, the rest), with the
instructions that hold the most samples and their stall reasons: where the warps of a kernel wait, not only why.
"""
from __future__ import annotations

import argparse
import csv
import datetime
import io
import json
import os
import shutil
import subprocess
import sys
import tempfile

SECTIONS = ("SpeedOfLight", "WarpStateStats", "SchedulerStats", "MemoryWorkloadAnalysis", "Occupancy", "LaunchStats")
DEFAULT_SHAPES = ("v4-flash:1", "v3:1", "v4-flash:2048", "v4-flash:8192")
KERNEL_REGEX = "regex:(wg_gemm|stream_gemm)"
# JSON field <- ncu raw metric
METRICS = {
    "duration_us": "gpu__time_duration.sum",
    "sm_clock_ghz": "gpc__cycles_elapsed.max.per_second",
    "dram_tbps": "dram__bytes.sum.per_second",
    "dram_active_pct": "dram__cycles_active.avg.pct_of_peak_sustained_elapsed",
    "tensor_active_pct": "sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_elapsed",
    "issue_active_pct": "smsp__issue_active.avg.pct_of_peak_sustained_active",
    "warps_per_scheduler": "smsp__warps_active.avg.per_cycle_active",
    "l2_hit_pct": "lts__t_sector_hit_rate.pct",
    "grid_blocks": "launch__grid_size",
    "block_threads": "launch__block_size",
    "registers": "launch__registers_per_thread",
    "smem_kb_per_block": "launch__shared_mem_per_block",
    "waves": "launch__waves_per_multiprocessor",
}
# Read when the raw page has them (SpeedOfLight's throughput breakdown, % of each unit's peak), else None: is a
# kernel bound by the L2 (lts: the activation tiles every row block of an expert re-reads, and the weights), by L1 and
# shared memory (l1tex: the TMA writes, the weight reads and the wgmma operand reads), or by neither?
OPTIONAL_METRICS = {
    "l2_throughput_pct": "lts__throughput.avg.pct_of_peak_sustained_elapsed",
    "l1_throughput_pct": "l1tex__throughput.avg.pct_of_peak_sustained_active",
    "memory_throughput_pct": "gpu__compute_memory_throughput.avg.pct_of_peak_sustained_elapsed",
    "sm_throughput_pct": "sm__throughput.avg.pct_of_peak_sustained_elapsed",
}
STALL_PREFIX = "smsp__average_warps_issue_stalled_"
STALL_SUFFIX = "_per_issue_active.ratio"
# --sources: SASS instructions by what they do (the first class whose opcode prefix matches; the branch right after a
# full-barrier try-wait, its retry loop, counts with it); the rest is "other" (integer decode, addressing, control).
SAMPLE_CLASSES = (
    ("wgmma drain", ("WARPGROUP.DEPBAR",)),
    ("wgmma", ("HGMMA",)),
    ("full-barrier wait", ("SYNCS.PHASECHK",)),
    ("bf16x2 math", ("HMUL2", "HFMA2", "HADD2")),
    ("shared memory", ("LDS", "STS", "ATOMS", "LDSM")),
    ("global memory", ("LDG", "STG", "RED", "ATOMG", "UTMALDG", "UBLKCP")),
    ("block barrier", ("BAR",)),
)
SOURCE_SAMPLES = "Warp Stall Sampling (All Samples)"
TOP_INSTRUCTIONS = 8


def parse_shape(spec: str) -> tuple[str, int, str]:
    parts = spec.split(":")
    if len(parts) not in (2, 3) or not parts[1].isdigit() or int(parts[1]) < 1:
        raise argparse.ArgumentTypeError(f"{spec!r}: expected preset:T or preset:T:mode, e.g. v4-flash:1:w4a16")
    mode = parts[2] if len(parts) == 3 else "w4a16"
    if mode not in ("w4a16", "w4a4"):
        raise argparse.ArgumentTypeError(f"{spec!r}: mode {mode!r} is not w4a16 or w4a4")
    return parts[0], int(parts[1]), mode


def _unit_scale(unit: str) -> float:
    """Factor from ncu's unit to the JSON's (µs, GHz, TB/s, KB)."""
    return {"nsecond": 1e-3, "usecond": 1.0, "msecond": 1e3, "second": 1e6, "ns": 1e-3, "us": 1.0, "ms": 1e3,
            "s": 1e6,
            "hz": 1e-9, "khz": 1e-6, "mhz": 1e-3, "ghz": 1.0,
            "byte/s": 1e-12, "kbyte/s": 1e-9, "mbyte/s": 1e-6, "gbyte/s": 1e-3, "tbyte/s": 1.0,
            "byte/block": 1e-3, "kbyte/block": 1.0, "mbyte/block": 1e3}.get(unit.lower().replace("/second", "/s"), 1.0)


def _number(text: str) -> float | None:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return None


def summarize(raw_csv: str) -> list[dict]:
    """One dict per profiled kernel from ``ncu --import REP --page raw --csv``: METRICS' fields (the page must hold
    them), OPTIONAL_METRICS' fields (None where the page lacks one) and the stall reasons per issued instruction
    (``stalls``: reason -> ratio, largest first)."""
    rows = list(csv.reader(io.StringIO(raw_csv)))
    if len(rows) < 3:
        return []
    header, units = rows[0], rows[1]
    col = {name: i for i, name in enumerate(header)}
    missing = [m for m in ("Kernel Name", *METRICS.values()) if m not in col]
    if missing:
        raise ValueError(f"ncu's raw page lacks {', '.join(missing)}: an ncu without these sections or metrics")
    out = []
    for r in rows[2:]:
        if len(r) != len(header):
            continue
        k = {"kernel": r[col["Kernel Name"]]}
        for field, metric in {**METRICS, **OPTIONAL_METRICS}.items():
            v = _number(r[col[metric]]) if metric in col else None
            k[field] = None if v is None else round(v * _unit_scale(units[col[metric]]), 4)
        stalls = {}
        for name, i in col.items():
            if name.startswith(STALL_PREFIX) and name.endswith(STALL_SUFFIX):
                v = _number(r[i])
                if v is not None and v > 0:
                    stalls[name[len(STALL_PREFIX):-len(STALL_SUFFIX)]] = round(v, 3)
        k["stalls_per_issue"] = dict(sorted(stalls.items(), key=lambda kv: -kv[1]))
        out.append(k)
    return out


def _opcode(sass: str) -> str:
    """The opcode of one SASS line: '@!P0  BRA 0x7f..' -> 'BRA', 'WARPGROUP.DEPBAR.LE gsb0, 0x0' -> its first word."""
    words = sass.split()
    if words and words[0].startswith("@"):
        words = words[1:]
    return words[0] if words else ""


def _sample_class(op: str) -> str:
    for name, prefixes in SAMPLE_CLASSES:
        if any(op == p or op.startswith(p + ".") for p in prefixes):
            return name
    return "other"


def summarize_sources(source_csv: str) -> list[dict]:
    """One dict per kernel from ``ncu --import REP --page source --csv --print-source sass`` (a 'Kernel Name' line,
    then a header line and one line per instruction): the total of warp stall samples, their shares by
    SAMPLE_CLASSES (``by_class_pct``, largest first) and the TOP_INSTRUCTIONS instructions that hold the most, each with
    its share and its three largest stall reasons (shares of its own samples)."""
    kernels, header = [], None
    for r in csv.reader(io.StringIO(source_csv)):
        if r and r[0] == "Kernel Name":
            kernels.append({"kernel": r[1] if len(r) > 1 else "?", "rows": []})
            header = None
        elif kernels and header is None:
            header = r
            if "Source" not in r or SOURCE_SAMPLES not in r:
                raise ValueError(f"ncu's source page lacks 'Source' or {SOURCE_SAMPLES!r}: run it with SourceCounters "
                                 "and --print-source sass")
        elif kernels and len(r) == len(header):
            kernels[-1]["rows"].append(dict(zip(header, r)))
    out = []
    for k in kernels:
        rows = k["rows"]
        samples = [_number(r[SOURCE_SAMPLES]) or 0.0 for r in rows]
        total = sum(samples)
        by_class: dict[str, float] = {}
        prev = ""
        for r, n in zip(rows, samples):
            op = _opcode(r["Source"])
            cls = "full-barrier wait" if op == "BRA" and prev.startswith("SYNCS.PHASECHK") else _sample_class(op)
            by_class[cls] = by_class.get(cls, 0.0) + n
            prev = op
        top = []
        for i in sorted(range(len(rows)), key=lambda i: -samples[i])[:TOP_INSTRUCTIONS]:
            if samples[i] <= 0:
                break
            reasons = {c[len("stall_"):]: _number(v) or 0.0 for c, v in rows[i].items()
                       if c.startswith("stall_") and "(" not in c}
            best = sorted(((n, v) for n, v in reasons.items() if v > 0), key=lambda nv: -nv[1])[:3]
            top.append({"sass": " ".join(rows[i]["Source"].split()), "pct": round(100 * samples[i] / total, 2),
                        "reasons_pct": {n: round(100 * v / samples[i], 1) for n, v in best}})
        out.append({"kernel": k["kernel"], "samples": int(total),
                    "by_class_pct": {c: round(100 * v / total, 2) for c, v in
                                     sorted(by_class.items(), key=lambda cv: -cv[1])} if total else {},
                    "top": top})
    return out


def _moe_bench():
    """bench/moe_bench.py, whose shapes, random weights and routing, versions and GPU tag this script reuses."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import moe_bench

    return moe_bench


def forward(shapes: list[tuple[str, int, str]]) -> None:
    """The profiled child: per shape three warm-up forwards, then one between cudaProfilerStart and Stop."""
    import torch

    from megamoe.backends import get_backend

    mb = _moe_bench()

    gen = torch.Generator(device="cuda").manual_seed(1234)
    be = get_backend("cuda-sm90")
    for preset, t, mode in shapes:
        base = mb.bench_config(preset)
        prepared = be.prepare_weights(mb.random_weights(base, gen))
        cfg = base.with_(act_mode=mode)
        x, ids, w = mb.random_routing(t, base, gen)
        for _ in range(3):
            be.moe_forward(prepared, cfg, x, ids, w)
        torch.cuda.synchronize()
        torch.cuda.profiler.start()
        be.moe_forward(prepared, cfg, x, ids, w)
        torch.cuda.synchronize()
        torch.cuda.profiler.stop()
        del prepared
        torch.cuda.empty_cache()


def find_ncu() -> str:
    for path in (shutil.which("ncu"), "/usr/local/cuda/bin/ncu"):
        if path and os.path.exists(path):
            return path
    raise SystemExit("gemm_counters: ncu (Nsight Compute) not found on PATH or in /usr/local/cuda/bin")


def _import_page(ncu: str, rep: str, page: str, *extra: str) -> str:
    """One page of a report as CSV (``ncu --import REP.ncu-rep --page PAGE --csv``); RuntimeError when ncu fails."""
    run = subprocess.run([ncu, "--import", rep + ".ncu-rep", "--page", page, "--csv", *extra], capture_output=True,
                         text=True)
    if run.returncode != 0:
        raise RuntimeError(f"ncu --import --page {page} failed ({run.returncode}): {run.stderr[-1000:]}")
    return run.stdout


def _record(ncu: str, rep: str, spec: str, options: list[str], label: str, timeout: float) -> None:
    """Run ncu with `options` (sections, launch filters) on this script's ``--forward spec`` child, the GEMM kernels of
    its profiled forward, into REP.ncu-rep; RuntimeError (naming `label`) when it times out, fails or writes none."""
    cmd = [ncu, "--clock-control", "none", "--profile-from-start", "off", "--kernel-name", KERNEL_REGEX, *options,
           "-f", "-o", rep, sys.executable, os.path.abspath(__file__), "--forward", spec]
    try:
        run = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"{label} on {spec} ran past --timeout {timeout:g} s") from None
    if run.returncode != 0 or not os.path.exists(rep + ".ncu-rep"):
        raise RuntimeError(f"{label} on {spec} failed ({run.returncode}):\n{run.stdout[-2000:]}{run.stderr[-2000:]}")


def profile(ncu: str, shape: tuple[str, int, str], timeout: float) -> list[dict]:
    spec = ":".join(map(str, shape))
    with tempfile.TemporaryDirectory() as tmp:
        rep = os.path.join(tmp, "gemms")
        _record(ncu, rep, spec, [a for s in SECTIONS for a in ("--section", s)], "ncu", timeout)
        raw = _import_page(ncu, rep, "raw")
    kernels = summarize(raw)
    for k in kernels:
        k.update(preset=shape[0], T=shape[1], mode=shape[2])
    return kernels


def profile_sources(ncu: str, shape: tuple[str, int, str], launches: int, timeout: float) -> list[dict]:
    """stall_samples of each of the shape's first `launches` GEMM kernels: one ncu run each (SourceCounters)."""
    spec = ":".join(map(str, shape))
    out = []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(launches):
            rep = os.path.join(tmp, f"src{i}")
            _record(ncu, rep, spec, ["--launch-skip", str(i), "--launch-count", "1", "--section", "SourceCounters"],
                    "ncu --section SourceCounters", timeout)
            page = _import_page(ncu, rep, "source", "--print-source", "sass")
            found = summarize_sources(page)
            if len(found) != 1:
                raise RuntimeError(f"ncu's source page of {spec}, GEMM launch {i}: {len(found)} kernels, expected 1")
            out.append(found[0])
    return out


def _cell(v, width: int, digits: int) -> str:
    return f"{v:{width}.{digits}f}" if isinstance(v, (int, float)) else f"{'-':>{width}s}"


def table(kernels: list[dict]) -> str:
    lines = [f"{'shape':22s} {'kernel':40s} {'µs':>8s} {'GHz':>5s} {'DRAM TB/s':>9s} {'tensor%':>7s} "
             f"{'issue%':>6s} {'L2%':>5s} {'L1%':>5s}  top stalls per issue"]
    for k in kernels:
        name = k["kernel"].split("(")[0].replace("void ", "")[:40]
        stalls = ", ".join(f"{n} {v:.2f}" for n, v in list(k["stalls_per_issue"].items())[:4])
        lines.append(f"{k['preset'] + ':' + str(k['T']) + ':' + k['mode']:22s} {name:40s} "
                     f"{_cell(k['duration_us'], 8, 1)} {_cell(k['sm_clock_ghz'], 5, 2)} {_cell(k['dram_tbps'], 9, 2)} "
                     f"{_cell(k['tensor_active_pct'], 7, 1)} {_cell(k['issue_active_pct'], 6, 1)} "
                     f"{_cell(k.get('l2_throughput_pct'), 5, 1)} {_cell(k.get('l1_throughput_pct'), 5, 1)}  {stalls}")
        if k.get("stall_samples"):
            shares = ", ".join(f"{c} {v:.1f}%" for c, v in k["stall_samples"]["by_class_pct"].items())
            lines.append(f"{'':22s} stall samples: {shares}")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", nargs="+", type=parse_shape, default=[parse_shape(s) for s in DEFAULT_SHAPES],
                   metavar="PRESET:T[:MODE]", help=f"shapes to profile (default: {' '.join(DEFAULT_SHAPES)})")
    p.add_argument("--out", help="JSON path (default: bench/results/gemm_counters_<gpu>.json)")
    p.add_argument("--timeout", type=float, default=300, help="seconds per shape's ncu run (default 300)")
    p.add_argument("--sources", action="store_true",
                   help="also sum each GEMM kernel's warp stall samples per SASS instruction (one more ncu run per "
                        "kernel, SourceCounters): stall_samples in the JSON, one line per kernel in the table")
    p.add_argument("--forward", nargs="+", type=parse_shape, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.forward:
        forward(args.forward)
        return 0

    import torch

    mb = _moe_bench()
    for preset, _, _ in args.shapes:
        try:
            mb.bench_config(preset)
        except (KeyError, ValueError) as e:
            p.error(f"--shapes: preset {preset!r}: {e}")
    if not torch.cuda.is_available():
        raise SystemExit("gemm_counters: needs a CUDA GPU (Hopper) and megamoe._C built for 90a")
    ncu = find_ncu()
    kernels = []
    for i, shape in enumerate(args.shapes, 1):
        print(f"[{i}/{len(args.shapes)}] ncu on {':'.join(map(str, shape))} ...", flush=True)
        try:
            found = profile(ncu, shape, args.timeout)
            if args.sources:
                print(f"      stall samples per instruction of {len(found)} kernels ...", flush=True)
                for k, src in zip(found, profile_sources(ncu, shape, len(found), args.timeout)):
                    k["stall_samples"] = src
            kernels += found
        except RuntimeError as e:
            raise SystemExit(f"gemm_counters: {e}") from None
    ncu_version = subprocess.run([ncu, "--version"], capture_output=True, text=True).stdout.strip().splitlines()
    device = torch.cuda.get_device_name()
    out = args.out or os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                   f"gemm_counters_{mb.gpu_tag(device)}.json")
    report = {
        "command": "python bench/gemm_counters.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": device,
        "versions": {**mb.versions(), "ncu": ncu_version[-1] if ncu_version else "?"},
        "method": "ncu --clock-control none, sections " + ", ".join(SECTIONS) + "; each GEMM kernel of one eager "
                  "forward (after three warm-up forwards) profiled alone, replayed per pass"
                  + ("; stall_samples: SourceCounters in one more run per kernel, samples per SASS instruction summed "
                     "by SAMPLE_CLASSES" if args.sources else ""),
        "kernels": kernels,
    }
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w") as f:
        json.dump(report, f, indent=1)
    print(table(kernels))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

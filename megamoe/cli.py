"""The ``megamoe`` command line: ``info``, ``selftest``, ``synth``, ``serve`` (see :func:`build_parser`)."""
from __future__ import annotations

import argparse
import json
import os
import sys


def _cmd_info_checkpoint(args) -> int:
    """What the loader decides for a checkpoint (docs/SPEC.md §3.4): format, layer, routing,
    activation mode, input scales, w13 layout, shared expert, what it quantized at load."""
    from megamoe import checkpoint

    try:
        loaded = checkpoint.load(args.checkpoint, layer=args.layer)
    except checkpoint.CheckpointError as exc:
        print(f"info: {exc}", file=sys.stderr)
        return 1
    c = loaded.config
    print(loaded.report.summary())
    print(f"  layer shape: H={c.hidden_size}, I={c.intermediate_size}, E={c.num_experts}, k={c.top_k}, "
          f"{c.act_mode}, shared experts {c.n_shared_experts}")
    return 0


def _cmd_info(args) -> int:
    if getattr(args, "checkpoint", None):
        return _cmd_info_checkpoint(args)
    import torch

    from megamoe import health
    from megamoe.backends import auto_backend_name, available_backends

    print(f"megamoe {health.versions()['megamoe']}, torch {torch.__version__}")
    v = health.versions()
    print(f"extension: parts {v['extension_parts'] or 'none'}, archs {v['extension_archs'] or '-'}"
          + (f" ({v['extension_error']})" if v["extension_error"] else ""))
    if torch.cuda.is_available():
        print(f"GPU: {v['gpu']} (compute capability {v['compute_capability']})")
    else:
        print("GPU: none visible to torch")
    for name, (ok, why) in available_backends().items():
        print(f"  {name:11s} {'available' if ok else 'unavailable'}{'' if ok else ': ' + why}")
    print(f"auto -> {auto_backend_name()}")
    return 0


def _selftest_header(be) -> str:
    """What the self-test runs on: the backend, its device and, for cuda-sm100, the kernel build."""
    lines = [f"selftest: backend {be.name} on {be.device}"]
    describe = getattr(be, "describe", None)
    d = describe() if callable(describe) else {}
    if be.name == "cuda-sm100" and d:
        from megamoe import _ext

        kernel = d.get("kernel", {})
        v = d.get("cuda_versions") or {}

        def fmt(n: int) -> str:
            return f"{n // 1000}.{n % 1000 // 10}" if n else "none"

        tiles = "/".join(str(n) for n in kernel.get("tile_n_options", ()))
        lines.append(f"  kernel: CUTLASS {kernel.get('schedule')}, tile 128x({tiles})x256 (N tile {d.get('tile_n')}), "
                     f"executor {d.get('executor')}, {d.get('sm_count')} SMs")
        lines.append(f"  megamoe._C: archs {getattr(_ext.ext, 'cuda_archs', '')}, CUDA runtime {fmt(v.get('runtime', 0))} "
                     f"(static), driver supports CUDA {fmt(v.get('driver', 0))}")
    return "\n".join(lines)


def _cmd_selftest(args) -> int:
    from megamoe import faults, health
    from megamoe.backends import available_backends, get_backend

    if args.all_backends:
        names = [n for n, (ok, _) in available_backends().items() if ok]
    else:
        names = [args.backend]
    reports, failed = [], False
    # progress lines go to stderr with --json (stdout stays one JSON document)
    say = (lambda msg: print(msg, file=sys.stderr, flush=True)) if args.json else (lambda msg: print(msg, flush=True))
    for name in names:
        try:
            be = get_backend(name, device=args.device)
        except (RuntimeError, ValueError) as exc:
            print(f"selftest: {exc}", file=sys.stderr)
            return 2
        say(_selftest_header(be))
        if args.inject_fault:
            be = faults.inject(be, args.inject_fault)
        progress = None
        if args.level == "full":
            count = [0]

            def progress(check, count=count):
                count[0] += 1
                metric = check["metric"]
                shown = "-" if metric is None else (f"{metric:.6f}" if isinstance(metric, float) else str(metric))
                say(f"  [{count[0]}/{len(health.CHECKS)}] {check['name']}: {check['status'].upper()} {shown} "
                    f"({check['duration_ms']:.0f} ms)")

            say(f"selftest: {len(health.CHECKS)} checks, level full (this takes a while)")
        report = health.run_checks(args.level, backend=be, seed=args.seed, progress=progress)
        if args.inject_fault:
            report["injected_fault"] = args.inject_fault
        shapes = _selftest_shapes(be, args.level, say)
        if shapes is not None:
            report["shapes"] = shapes
            if any(r["status"] != "pass" for r in shapes):
                report["status"] = "fail"
        reports.append(report)
        failed |= report["status"] != "pass"
        if not args.json:
            print(health.format_table(report))
            if shapes is not None:
                print(f"shapes: {sum(r['status'] == 'pass' for r in shapes)}/{len(shapes)} passed "
                      f"(routed experts vs the torch backend, cosine >= 0.9999, same bits on a repeat)")
            print()
    if args.json:
        print(json.dumps(reports if len(reports) > 1 else reports[0], indent=2))
    return 1 if failed else 0


def _selftest_shapes(be, level: str, say):
    """cuda-sm100: the routed experts at deployment shapes, one line per shape as it finishes
    (what ran, the N tile of each GEMM, cosine vs the torch backend, time per forward)."""
    from megamoe.backends.cuda_sm100 import (SELFTEST_SHAPES_FULL, SELFTEST_SHAPES_QUICK, CudaSm100Backend,
                                             format_shape_row, run_shapes)

    if not isinstance(be, CudaSm100Backend):
        return None
    shapes = SELFTEST_SHAPES_FULL if level == "full" else SELFTEST_SHAPES_QUICK
    say(f"selftest: cuda-sm100 deployment shapes ({sum(len(s[3]) for s in shapes)} runs, median of 20 forwards each)")
    return run_shapes(be, shapes, progress=lambda row: say("  " + format_shape_row(row)))


def _cmd_synth(args) -> int:
    from megamoe import checkpoint
    from megamoe.presets import PRESETS

    if args.preset not in PRESETS:
        print(f"synth: unknown preset {args.preset!r}; choose one of {sorted(PRESETS)}", file=sys.stderr)
        return 2
    cfg = PRESETS[args.preset]
    print(f"writing preset {args.preset} (H={cfg.hidden_size}, I={cfg.intermediate_size}, E={cfg.num_experts}, "
          f"k={cfg.top_k}) seed {args.seed} -> {args.out}", file=sys.stderr)
    path = checkpoint.write_synthetic(args.out, args.preset, seed=args.seed, progress=not args.quiet,
                                      device=args.device)
    # the mode any new file gets (0644 under the usual umask 022), not safetensors' private 0600:
    # a server that runs as another user (the container's) must be able to read the checkpoint
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(path, 0o666 & ~umask)
    loaded = checkpoint.load(path)
    print(loaded.report.summary())
    return 0


def _cmd_serve(argv: list[str]) -> int:
    try:
        from megamoe import service
    except ImportError as exc:
        print(f"serve: the service needs its extras: pip install 'megamoe[service]' ({exc})", file=sys.stderr)
        return 2
    return service.main(argv)


def _version() -> str:
    from megamoe import __version__

    return __version__


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="megamoe", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="NVFP4 Mixture-of-Experts kernels (Hopper, Blackwell, torch reference), their\n"
                    "health checks and an inference service. Each command answers --help.",
        epilog="examples:\n"
               "  megamoe info                                  what is built, which backends run here\n"
               "  megamoe selftest --backend auto --level full  kernel health checks (docs/SPEC.md §5)\n"
               "  megamoe synth --preset tiny --out tiny.safetensors\n"
               "  megamoe serve --help                          the HTTP service (KServe v2) and its settings")
    p.add_argument("--version", action="version", version=f"megamoe {_version()}",
                   help="print megamoe's version and exit")
    sub = p.add_subparsers(dest="cmd", metavar="COMMAND")

    inf = sub.add_parser("info", help="show the build, the GPU and the backends available here; with "
                                      "--checkpoint, what the loader decides for a checkpoint")
    inf.add_argument("--checkpoint", default=None, metavar="DIR",
                     help="checkpoint folder or .safetensors file: print the load report (format, layer, routing, "
                          "activation mode, input scales, w13 layout, shared expert, what was quantized at load)")
    inf.add_argument("--layer", default=None, metavar="N",
                     help="with --checkpoint: the model's layer number (model.layers.N) or a tensor-name prefix "
                          "(default: the first MoE layer)")

    st = sub.add_parser("selftest", help="run the kernel health checks (docs/SPEC.md §5); exit 1 on failure",
                        description="Run the kernel health checks of docs/SPEC.md §5 (SF round trip, GEMM cosine on uniform and random "
                                    "data, MoE vs the BF16 reference, backend vs the torch reference) and print "
                                    "a table. Exit status: 0 all passed, 1 a check failed, 2 bad usage.")
    st.add_argument("--backend", default="auto", help="torch, cuda-sm90, cuda-sm100 or auto (default: auto)")
    st.add_argument("--all-backends", action="store_true", help="run on every backend available here")
    st.add_argument("--level", choices=("quick", "full"), default="quick", help="quick (seconds) or full")
    st.add_argument("--seed", type=int, default=None, help="random seed (default: fresh; printed in the report)")
    st.add_argument("--device", default=None, help="torch device for the torch backend (default: cuda if present)")
    st.add_argument("--json", action="store_true", help="print the report as JSON")
    st.add_argument("--inject-fault", choices=("swapped-sf",), default=None,
                    help="run against a deliberately broken scale layout, to see the checks catch it")

    sy = sub.add_parser("synth", help="write a synthetic NVFP4 checkpoint of a preset",
                        description="Write one synthetic NVFP4 MoE layer with random weights (outliers, per-expert "
                                    "global scales, gate/up scales that differ) as one .safetensors file in "
                                    "megamoe's own format: the packed NVFP4 tensors under the fused ModelOpt "
                                    "tensor names (w13_weight, w13_weight_scale, ...), the layer's config in the "
                                    "file's metadata. megamoe's loader, megamoe serve --checkpoint and "
                                    "megamoe info --checkpoint read it; it is not a ModelOpt export (no "
                                    "config.json or hf_quant_config.json).")
    sy.add_argument("--preset", default="tiny", help="tiny, small, v4-flash or v3 (default: tiny)")
    sy.add_argument("--seed", type=int, default=0)
    sy.add_argument("--out", required=True, help="output .safetensors path")
    sy.add_argument("--device", default=None, help="device to generate on (cuda is much faster for v3)")
    sy.add_argument("--quiet", action="store_true", help="no progress bar")

    sub.add_parser("serve", help="run the HTTP service (KServe v2; megamoe serve --help)", add_help=False)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "serve":
        return _cmd_serve(argv[1:])
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.cmd is None:
        parser.print_help()
        return 2
    return {"info": _cmd_info, "selftest": _cmd_selftest, "synth": _cmd_synth}[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())

"""megamoe HTTP service: the MoE layer over the Open Inference Protocol (KServe v2).

Import name: ``megamoe.service`` (the sources live in the repository's top-level
``service/`` folder; the wheel and the editable install map them under ``megamoe``).
Entry point: :func:`main` (``megamoe serve`` and ``python -m megamoe.service`` call it).
"""

from __future__ import annotations

if __name__ != "megamoe.service":
    # One import name: a second one (a checkout's top-level `service` on sys.path) would load
    # every module twice, each copy with its own metrics registry and settings.
    raise ImportError(f"the megamoe service is imported as megamoe.service, not as {__name__!r} "
                      "(install the package: pip install -e . or the wheel)")

# Fail at import when the service extras are missing (`megamoe serve` turns this into
# "pip install 'megamoe[service]'"), not halfway through start-up.
import fastapi  # noqa: F401
import uvicorn  # noqa: F401


def main(argv: list[str] | None = None) -> int:
    """Parse settings (env ``MEGAMOE_*``, then flags in ``argv``), serve until SIGTERM/SIGINT.

    Exit status: 0 after a stop by signal, 1 when the model cannot be loaded, 2 for bad settings."""
    import sys

    from pydantic import ValidationError

    from .settings import parse_settings

    try:
        settings = parse_settings(argv)
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'settings'}: {e['msg']}" for e in exc.errors())
        print(f"megamoe serve: invalid settings: {problems}", file=sys.stderr)
        return 2
    if settings.tp > 1:
        # tensor parallelism spans the ranks of a torchrun job; one process serves the whole layer
        print(f"megamoe serve: --tp {settings.tp} needs one process per rank: torchrun --nproc-per-node "
              f"{settings.tp} -m megamoe.service.distributed --tp {settings.tp} ... (a single-process server "
              f"serves the whole layer: leave --tp at 1)", file=sys.stderr)
        return 2
    if settings.instances > 1:
        from .instances import serve_instances  # the parent: it supervises the instance processes
        from .settings import configure_logging

        configure_logging(settings)
        return serve_instances(settings)
    from .server import serve  # torch and the app: after the settings are known to be good

    return serve(settings)


__all__ = ["main"]

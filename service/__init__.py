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
    """Parse settings (env ``MEGAMOE_*``, then flags in ``argv``), serve until SIGTERM/SIGINT."""
    import logging
    import signal

    from .app import create_app
    from .settings import parse_settings

    settings = parse_settings(argv)
    # uvicorn drains on SIGTERM, then re-raises it under the handler it found installed:
    # make that one a clean exit, so a stop by the orchestrator reads as success (0), not 143.
    signal.signal(signal.SIGTERM, _exit_after_drain)
    logging.basicConfig(level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    app = create_app(settings)
    uvicorn.run(
        app,
        host=settings.host,
        port=settings.port,
        log_level=settings.log_level,
        timeout_graceful_shutdown=settings.graceful_shutdown_s,
        access_log=False,
    )
    return 0


def _exit_after_drain(signum, frame):
    raise SystemExit(0)


__all__ = ["main"]

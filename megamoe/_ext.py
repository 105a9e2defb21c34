"""The compiled extension ``megamoe._C``, if it was built, and why not otherwise."""
from __future__ import annotations

try:  # pragma: no cover - depends on the build
    from megamoe import _C as ext  # type: ignore[attr-defined]
    EXT_ERROR: str | None = None
except ImportError as exc:  # built without a compiler, or not built at all (source checkout)
    ext = None
    EXT_ERROR = f"megamoe._C is not importable: {exc}"


def built_parts() -> list[str]:
    """Kernel families compiled into the extension: subset of ["common", "sm90", "sm100"]."""
    return list(getattr(ext, "built_parts", [])) if ext is not None else []


def has_part(part: str) -> bool:
    return part in built_parts()

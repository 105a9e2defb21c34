"""Backend registry: ``get_backend(name)`` and ``available_backends()``.

Names: ``torch`` (reference, anywhere), ``cuda-sm90`` (Hopper), ``cuda-sm100`` (Blackwell).
``auto`` picks cuda-sm100 on compute capability 10.x, cuda-sm90 on 9.x, else torch.
"""
from __future__ import annotations

import importlib

import torch

from megamoe.backends.base import Backend
from megamoe.backends.torch_ref import TorchBackend

_MODULES = {
    "cuda-sm100": ("megamoe.backends.cuda_sm100", "CudaSm100Backend"),
    "cuda-sm90": ("megamoe.backends.cuda_sm90", "CudaSm90Backend"),
}
BACKEND_NAMES = ("torch", "cuda-sm90", "cuda-sm100")


def _backend_class(name: str):
    if name == "torch":
        return TorchBackend, ""
    if name not in _MODULES:
        raise ValueError(f"unknown backend {name!r}; choose one of {list(BACKEND_NAMES)} or 'auto'")
    mod_name, cls_name = _MODULES[name]
    try:
        mod = importlib.import_module(mod_name)
        return getattr(mod, cls_name), ""
    except (ImportError, AttributeError) as exc:
        return None, f"{mod_name} is not usable: {exc}"


def available_backends() -> dict[str, tuple[bool, str]]:
    """``{name: (available, reason)}`` for every backend name."""
    result = {}
    for name in BACKEND_NAMES:
        cls, why = _backend_class(name)
        result[name] = (False, why) if cls is None else cls.availability()
    return result


def auto_backend_name() -> str:
    if torch.cuda.is_available():
        major = torch.cuda.get_device_capability()[0]
        for cand, ok_major in (("cuda-sm100", 10), ("cuda-sm90", 9)):
            if major == ok_major and available_backends()[cand][0]:
                return cand
    return "torch"


def get_backend(name: str | Backend = "auto", device=None) -> Backend:
    """An instance of backend ``name`` (or ``name`` itself if it already is a Backend).

    Raises ValueError for an unknown name and RuntimeError, with the reason, for a
    backend that is not available here.
    """
    if isinstance(name, Backend):
        return name
    if name in (None, "auto"):
        name = auto_backend_name()
        if name == "torch" and device is None and torch.cuda.is_available():
            device = "cuda"
    cls, why = _backend_class(name)
    if cls is None:
        raise RuntimeError(f"backend {name!r} is not available: {why}")
    ok, reason = cls.availability()
    if not ok:
        raise RuntimeError(f"backend {name!r} is not available: {reason}")
    if name == "torch":
        return cls(device=device)
    return cls() if device is None else cls(device=device)


__all__ = ["Backend", "TorchBackend", "get_backend", "available_backends", "auto_backend_name", "BACKEND_NAMES"]

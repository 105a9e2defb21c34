"""The GPU tests' skip rule, on top of the shared helpers (tests/_helpers.py)."""
from __future__ import annotations

from _helpers import backend_or_skip, capture_graph, cosine, random_nvfp4, rel_err  # noqa: F401


def sm90_backend():
    """The cuda-sm90 backend, or a pytest skip that says why it is not here."""
    return backend_or_skip("cuda-sm90")

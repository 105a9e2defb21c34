"""Fixtures for the service tests (see service_testkit for the server process helper).

No ``__init__.py`` here on purpose: this folder must not become an importable package
called ``service`` shadowing the real one. Test modules are named ``test_service_*``.
"""

from __future__ import annotations

import pytest

from service_testkit import PRESET, TOKEN, ServerProcess

@pytest.fixture(scope="session")
def server(tmp_path_factory):
    """The main test server: tiny preset, torch backend, bearer token, small limits."""
    srv = ServerProcess(
        tmp_path_factory.mktemp("server") / "server.log",
        env={"MEGAMOE_TOKEN": TOKEN},
        args=["--backend", "torch", "--queue-delay-ms", "20", "--max-tokens-per-request", "64",
              "--max-body-bytes", str(1 << 20), "--max-batch-tokens", "1024"],
    )
    try:
        srv.wait_for("/v2/health/ready")
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="session")
def layer():
    """The library's layer with the server's weights: the yardstick for every result."""
    from megamoe.moe import MoELayer

    return MoELayer.from_preset(PRESET, seed=0, backend="torch")


@pytest.fixture(scope="session")
def auth_headers():
    return {"Authorization": f"Bearer {TOKEN}"}



import os
import sysconfig

import pytest
import torch

from _helpers import SEED

# The interpreter's own scripts folder (``.venv/bin`` for ``.venv/bin/python -m pytest``) comes
# first on PATH, as if the venv were activated: tools installed with the test extras (hadolint,
# megamoe, torchrun) are found by shutil.which and by subprocesses even when the caller's PATH
# lacks that folder.
_SCRIPTS = sysconfig.get_path("scripts")
if _SCRIPTS and _SCRIPTS not in os.environ.get("PATH", "").split(os.pathsep):
    os.environ["PATH"] = _SCRIPTS + os.pathsep + os.environ.get("PATH", "")


def _seed_line() -> str:
    return f"megamoe test seed: {SEED} (set MEGAMOE_TEST_SEED={SEED} to replay)"


def pytest_report_header(config):
    return _seed_line()


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_terminal_summary(terminalreporter, exitstatus, config):
    # Around the terminal reporter's own summary, so the seed is the line just above the final
    # counts (after the short test summary of -ra), with -q too, where the header is not shown.
    try:
        return (yield)
    finally:
        terminalreporter.write_line(_seed_line())


@pytest.fixture
def gen():
    return torch.Generator().manual_seed(SEED)

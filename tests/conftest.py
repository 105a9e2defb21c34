import pytest
import torch

from _helpers import SEED


def pytest_report_header(config):
    return f"megamoe test seed: {SEED} (set MEGAMOE_TEST_SEED to replay)"


@pytest.fixture
def gen():
    return torch.Generator().manual_seed(SEED)

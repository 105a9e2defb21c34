"""Helpers shared by the tests (a unique module name: tests/service has its own conftest)."""
import os

import torch

# Fresh random data each run, but reproducible when a test fails: the seed is printed.
SEED = int(os.environ.get("MEGAMOE_TEST_SEED", torch.seed() % 2**31))


def cosine(a, b):
    a = a.double().flatten()
    b = b.double().flatten()
    return float(a @ b / (a.norm() * b.norm()))


def rel_err(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm())

"""Backends with faults, for the service tests (the server loads them as ``--backend module:factory``).

The broken swizzle is the library's own fault injection (megamoe.faults), so the test
exercises the same bug that ``megamoe selftest --inject-fault swapped-sf`` shows.
"""

from __future__ import annotations

import os
import time

from megamoe import faults
from megamoe.backends.torch_ref import TorchBackend


def swapped_swizzle_backend():
    """The torch backend whose SF swizzle swaps M and K (docs/FIELD_BUGS.md row 2)."""
    return faults.inject(TorchBackend(), "swapped-sf")


class ControlledTorchBackend(TorchBackend):
    """The torch backend steered by files, so a test can drive the server through its life:

    - ``$MEGAMOE_TEST_GATE``: loading waits (at most 120 s) until this file exists;
    - ``$MEGAMOE_TEST_BREAK``: while this file exists, the SF swizzle is the broken one.
    """

    def __init__(self) -> None:
        super().__init__()
        self._broken = faults.inject(TorchBackend(), "swapped-sf")

    def prepare_weights(self, weights):
        gate = os.environ.get("MEGAMOE_TEST_GATE")
        deadline = time.monotonic() + 120
        while gate and not os.path.exists(gate) and time.monotonic() < deadline:
            time.sleep(0.05)
        return super().prepare_weights(weights)

    def swizzle_scales(self, scale, out=None):
        broken = os.environ.get("MEGAMOE_TEST_BREAK")
        if broken and os.path.exists(broken):
            return self._broken.swizzle_scales(scale, out)
        return super().swizzle_scales(scale, out)


class StickyDeviceErrorBackend(TorchBackend):
    """A device that dies on the first forward and stays dead, as CUDA does after an illegal access."""

    def __init__(self) -> None:
        super().__init__()
        self.dead = False

    def moe_forward(self, prepared, cfg, x, topk_ids, topk_weights, batch_invariant=True):
        self.dead = True
        raise RuntimeError("CUDA error: an illegal memory access was encountered (injected by the test)")

    def synchronize(self) -> None:
        if self.dead:
            raise RuntimeError("CUDA error: an illegal memory access was encountered (injected by the test)")


class SlowDeviceCallsBackend(TorchBackend):
    """The torch backend whose GEMM and SF round trip each take 0.3 s more: a kernel-health run
    that holds the device for seconds, while the MoE forward (inference) stays as fast as ever."""

    DELAY_S = 0.3

    def gemm(self, a, b, alpha=None, out_dtype=None):
        time.sleep(self.DELAY_S)
        return super().gemm(a, b, alpha=alpha) if out_dtype is None else super().gemm(a, b, alpha=alpha, out_dtype=out_dtype)

    def verify_sf_roundtrip(self, scale):
        time.sleep(self.DELAY_S)
        return super().verify_sf_roundtrip(scale)


class FirstLoadsBackend(TorchBackend):
    """The torch backend of which only the first process to load goes ahead: every later one waits
    (at most 120 s) until ``$MEGAMOE_TEST_GATE`` exists. Several instances of one server: one is
    ready while the others are still loading."""

    def prepare_weights(self, weights):
        gate = os.environ["MEGAMOE_TEST_GATE"]
        claim = gate + ".first"  # holds the process id of the first one (the self-test loads again)
        try:
            fd = os.open(claim, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
            os.write(fd, str(os.getpid()).encode())
            os.close(fd)
        except FileExistsError:
            deadline = time.monotonic() + 120
            while (not os.path.exists(gate) and time.monotonic() < deadline
                   and open(claim).read().strip() != str(os.getpid())):
                time.sleep(0.05)
        return super().prepare_weights(weights)


class DeviceDiesOnFileBackend(TorchBackend):
    """A device that dies for good at a forward while ``$MEGAMOE_TEST_BREAK`` exists (the forward and
    every later device call fail, as CUDA does after an illegal access). A process started after the
    file is gone (an instance restarted) has a healthy device."""

    def __init__(self) -> None:
        super().__init__()
        self.dead = False

    def moe_forward(self, prepared, cfg, x, topk_ids, topk_weights, batch_invariant=True):
        broken = os.environ.get("MEGAMOE_TEST_BREAK")
        if self.dead or (broken and os.path.exists(broken)):
            self.dead = True
            raise RuntimeError("CUDA error: an illegal memory access was encountered (injected by the test)")
        return super().moe_forward(prepared, cfg, x, topk_ids, topk_weights, batch_invariant)

    def synchronize(self) -> None:
        if self.dead:
            raise RuntimeError("CUDA error: an illegal memory access was encountered (injected by the test)")


class UnpicklablePreparedBackend(TorchBackend):
    """The torch backend whose prepared weights hold a function made at run time, which no pickler can
    send to another process: the layer cannot be shared between instances."""

    def prepare_weights(self, weights):
        prepared = super().prepare_weights(weights)
        prepared.local_hook = lambda: None
        return prepared

"""The pieces of the shared layer in one process (service/shared_weights.py, MoELayer.from_prepared): a
layer rebuilt from a package that went through torch.multiprocessing's pickler computes what the original
computes, bit for bit, with its host tensors in shared memory and nothing prepared again; a GPU layer's
host copy of the routed experts travels as meta placeholders of the same shapes; the float32 copies of
the router and the shared expert travel too and are not made again; from_prepared refuses dense weights
on another device than its backend's; shared host tensors mapped read-only fault on a write."""

from __future__ import annotations

import dataclasses
import types
from multiprocessing.reduction import ForkingPickler

import pytest
import torch

from megamoe.backends.torch_ref import TorchBackend
from megamoe.moe import MoELayer
from megamoe.service.shared_weights import iter_tensors, package_layer, storage_bytes

from service_testkit import random_inputs


class CountingTorchBackend(TorchBackend):
    prepared = 0

    def prepare_weights(self, weights):
        CountingTorchBackend.prepared += 1
        return super().prepare_weights(weights)


class RelayingTorchBackend(TorchBackend):
    """The torch backend, declaring that it keeps its own copy of the routed experts (as cuda-sm90 does)."""

    copies_routed_weights = True


def roundtrip(obj):
    import torch.multiprocessing  # noqa: F401 - torch's reductions in multiprocessing's pickler

    return ForkingPickler.loads(ForkingPickler.dumps(obj))


def test_a_layer_from_the_package_answers_bit_for_bit_and_prepares_nothing():
    layer = MoELayer.from_preset("tiny", seed=3, backend="torch", n_shared_experts=1, shared_intermediate_size=64)
    package = package_layer(layer)
    assert sorted(package.float32) == ["router_weight", "shared_down", "shared_gate_up"]
    tensors = list(iter_tensors((package.weights, package.prepared, package.float32)))
    assert tensors and all(t.is_shared() for t in tensors)  # moved to shared memory, once
    assert package.host_bytes == storage_bytes(tensors)["cpu"] and package.device_bytes == 0
    received = roundtrip(package)
    CountingTorchBackend.prepared = 0
    rebuilt = MoELayer.from_prepared(received.weights, received.config, received.prepared,
                                     backend=CountingTorchBackend(), float32=received.float32)
    assert CountingTorchBackend.prepared == 0
    for k, tokens in enumerate((1, 5, 17)):
        hidden, ids, weights = random_inputs(layer, tokens, seed=50 + k)
        torch.testing.assert_close(rebuilt.forward(hidden, ids, weights), layer.forward(hidden, ids, weights),
                                   rtol=0, atol=0)
        torch.testing.assert_close(rebuilt.forward(hidden), layer.forward(hidden), rtol=0, atol=0)  # its router
    # the float32 copies of the router and the shared expert are the received ones, not made again
    for name, copy in received.float32.items():
        assert rebuilt.dense_float32()[name] is copy and copy.is_shared(), name


def test_from_prepared_refuses_a_float32_copy_of_another_tensor():
    layer = MoELayer.from_preset("tiny", seed=6, backend="torch")
    with pytest.raises(ValueError, match="float32\\['router_weight'\\] is not a float32 copy"):
        MoELayer.from_prepared(layer.weights, layer.config, layer._prepared, backend="torch",
                               float32={"router_weight": layer.weights.router_weight})  # bfloat16


def test_a_device_layers_host_copy_of_the_experts_travels_as_placeholders():
    layer = MoELayer.from_preset("tiny", seed=4, backend="torch")
    # a layer on a device whose backend keeps its own copy of the experts (the cuda-sm90 case, without a GPU)
    device_layer = types.SimpleNamespace(weights=layer.weights, config=layer.config, _prepared=layer._prepared,
                                         device=torch.device("cuda", 0), backend=RelayingTorchBackend(),
                                         dense_float32=layer.dense_float32)
    package = package_layer(device_layer)
    for name in ("w13", "w2"):
        sent, kept = getattr(package.weights, name), getattr(layer.weights, name)
        assert sent.data.device.type == "meta" and sent.scale.device.type == "meta"
        assert sent.shape == kept.shape and sent.nbytes() == kept.nbytes()
    received = roundtrip(package)
    rebuilt = MoELayer.from_prepared(received.weights, received.config, received.prepared,
                                     backend=RelayingTorchBackend())
    hidden, ids, weights = random_inputs(layer, 7, seed=60)
    torch.testing.assert_close(rebuilt.forward(hidden, ids, weights), layer.forward(hidden, ids, weights),
                               rtol=0, atol=0)
    assert rebuilt.expert_weight_bytes(ids) == layer.expert_weight_bytes(ids)


def test_from_prepared_refuses_dense_weights_on_another_device():
    layer = MoELayer.from_preset("tiny", seed=5, backend="torch")
    elsewhere = dataclasses.replace(layer.weights, router_weight=layer.weights.router_weight.to("meta"))
    with pytest.raises(ValueError, match="weights.router_weight is on meta, the backend torch runs on cpu"):
        MoELayer.from_prepared(elsewhere, layer.config, layer._prepared, backend="torch")
    # the routed experts may live elsewhere only for a backend that keeps its own copy of them
    routed_elsewhere = dataclasses.replace(layer.weights, w13=layer.weights.w13.to("meta"))
    with pytest.raises(ValueError, match="weights.w13 is on meta"):
        MoELayer.from_prepared(routed_elsewhere, layer.config, layer._prepared, backend="torch")
    MoELayer.from_prepared(routed_elsewhere, layer.config, layer._prepared, backend=RelayingTorchBackend())


def test_shared_host_tensors_mapped_read_only_fault_on_a_write(tmp_path):
    """protect_read_only: the tensor still reads the same; a write into it faults (SIGSEGV) rather than
    change what every instance reads (run in a child process, which the fault ends)."""
    import signal
    import subprocess
    import sys

    code = (
        "import torch\n"
        "from megamoe.service.shared_weights import protect_read_only\n"
        "t = torch.arange(100000, dtype=torch.float32).share_memory_()\n"
        "v = t[10:20]\n"
        "assert protect_read_only([t, v]) == t.untyped_storage().nbytes()\n"
        "assert float(v.sum()) == float(sum(range(10, 20)))\n"
        "print('read', flush=True)\n"
        "t[5] = 1.0\n"
        "print('written', flush=True)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.split() == ["read"], (out.stdout, out.stderr[-2000:])
    assert out.returncode == -signal.SIGSEGV, (out.returncode, out.stderr[-2000:])

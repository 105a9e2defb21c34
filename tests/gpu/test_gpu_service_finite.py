"""The service's NaN/Inf check of large requests on the device (megamoe.service.model: a flag per
row computed in the stream after the host-to-device copy, read back with the outputs): a request
with a non-finite hidden state gets its 400 naming the element, the other requests of its batch
get exactly the rows they get when that request is finite (graph-bucket, stacked and eager
batches, cuda-sm90), and those rows match the layer's forward of each request alone."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from _helpers import SEED, backend_or_skip, cosine, random_inputs

pytest.importorskip("fastapi", reason="the service's packages are not installed")
try:
    import megamoe.service  # noqa: F401 - the installed layout (wheel or editable install)
except ModuleNotFoundError:
    # a source tree on sys.path (scripts/gpu_check.sh): the repository's service/ folder is megamoe.service
    import megamoe

    megamoe.__path__.append(str(Path(__file__).resolve().parents[2]))

TYPES = {"hidden_states": "FP32", "topk_ids": "INT32", "topk_weights": "FP32"}


# (rows per request, index of the bad one): stacked into a graph bucket (35 rows), copied per request
# into a graph bucket (91), copied per request, eager (305)
@pytest.mark.parametrize("sizes, bad", [((32, 3), 0), ((40, 48, 3), 1), ((100, 200, 5), 1)])
def test_nonfinite_request_is_refused_the_others_unaffected(sizes, bad):
    backend_or_skip("cuda-sm90")
    from megamoe.moe import MoELayer
    from megamoe.service.model import ServedModel
    from megamoe.service.runner import BatchRunner

    gpu = MoELayer.from_preset("small", seed=SEED % 997, backend="cuda-sm90")
    model = ServedModel("m", gpu, 4096)
    runner = BatchRunner(model)
    names = ("hidden_states", "topk_ids", "topk_weights")
    clean = [dict(zip(names, random_inputs(gpu, n, seed=SEED + k))) for k, n in enumerate(sizes)]
    dirty = [dict(x) for x in clean]
    poisoned = clean[bad]["hidden_states"].clone()
    row, col = sizes[bad] // 2, (SEED % gpu.config.hidden_size)
    poisoned[row, col] = float("nan") if SEED % 2 else float("-inf")
    dirty[bad]["hidden_states"] = poisoned

    def run(batch):
        requests = [model.validate(x, TYPES) for x in batch]
        outputs, _ = runner.finish_batch(runner.launch_batch(requests))
        return requests, outputs

    requests, outputs = run(dirty)
    assert requests[bad].finite_on_device  # left to the device by validate
    error = outputs[bad]
    assert isinstance(error, Exception) and error.status == 400, error
    assert f"hidden_states contains NaN or Inf (first at [{row}, {col}])" in error.message, error.message
    _, reference = run(clean)
    assert isinstance(reference[bad], torch.Tensor)
    for k, x in enumerate(clean):
        if k == bad:
            continue
        assert torch.isfinite(outputs[k]).all()
        assert torch.equal(outputs[k], reference[k]), f"request {k}: rows changed by another request's NaN"
        alone = gpu.forward(x["hidden_states"].cuda(), topk_ids=x["topk_ids"].cuda(),
                            topk_weights=x["topk_weights"].cuda()).float().cpu()
        assert cosine(outputs[k].float(), alone) > 0.9999, k

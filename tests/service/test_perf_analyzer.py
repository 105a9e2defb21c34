"""NVIDIA Triton's load generator perf_analyzer against ``megamoe serve`` (CPU backend, loopback):
it reads the metadata and the model configuration (``/v2/models/{m}/config``), sends binary and
JSON tensors, sweeps concurrency 1..16, with ``--input-data zero`` and with a data file of random
inputs; ``--input-data random`` gets a 400 that names the problem. Each case measures only a few small windows (a few seconds).

perf_analyzer comes from scripts/install_perf_analyzer.sh (scripts/setup.sh runs it); found
under ``sys.prefix``, so a PATH without the venv's bin folder is fine.
"""

from __future__ import annotations

import csv
import inspect
import json
import subprocess
import sys
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from service_testkit import PRESET, REPO, TOKEN, random_inputs

# small windows: a case is a few seconds, stability is not what these tests measure
WINDOWS = ["--measurement-mode", "count_windows", "--measurement-request-count", "12",
           "--stability-percentage", "1000", "--max-trials", "3"]


@pytest.fixture(scope="module")
def perf_analyzer() -> Path:
    wrapper = Path(sys.prefix) / "bin" / "perf_analyzer"
    if not wrapper.exists():
        out = subprocess.run(["bash", str(REPO / "scripts" / "install_perf_analyzer.sh"), sys.prefix],
                             capture_output=True, text=True, timeout=600)
        assert out.returncode == 0, f"installing perf_analyzer failed:\n{out.stderr[-3000:]}"
    assert wrapper.exists(), wrapper
    return wrapper


def run_pa(perf_analyzer: Path, server, tmp_path: Path, *args: str, timeout: float = 120.0):
    """perf_analyzer against the test server; returns (exit code, output, CSV rows by concurrency)."""
    report = tmp_path / "pa.csv"
    cmd = [str(perf_analyzer), "-m", PRESET, "-u", server.url.removeprefix("http://"), "-i", "http",
           "-H", f"Authorization: Bearer {TOKEN}", "-f", str(report), *WINDOWS, *args]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=tmp_path)
    rows = {}
    if report.exists():
        rows = {int(r["Concurrency"]): r for r in csv.DictReader(report.open())}
    return out.returncode, out.stdout + out.stderr, rows


def tokens_processed(server) -> float:
    _, text = server.get("/metrics")
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "megamoe_tokens_processed_total":
                return sample.value
    return 0.0


def zero_shapes(layer, tokens: int) -> list[str]:
    cfg = layer.config
    widths = {"hidden_states": cfg.hidden_size, "topk_ids": cfg.top_k, "topk_weights": cfg.top_k,
              "router_logits": cfg.num_experts}
    shapes = [a for name, width in widths.items() for a in ("--shape", f"{name}:{tokens},{width}")]
    if "input_ids" in inspect.signature(layer.forward).parameters:  # advertised, [T]: token 0 is a valid id
        shapes += ["--shape", f"input_ids:{tokens}"]
    return shapes


def test_config_route_is_triton_model_configuration(server, layer):
    status, meta = server.get("/v2")
    assert status == 200 and "model_configuration" in meta["extensions"], meta
    status, config = server.get(f"/v2/models/{PRESET}/config")
    assert status == 200, config
    assert server.get(f"/v2/models/{PRESET}/versions/1/config")[0] == 200
    assert server.get("/v2/models/nope/config")[0] == 404
    cfg = layer.config
    assert config["name"] == PRESET and config["max_batch_size"] == 0
    inputs = {i["name"]: i for i in config["input"]}
    assert inputs["hidden_states"] == {"name": "hidden_states", "data_type": "TYPE_FP32", "format": "FORMAT_NONE",
                                       "dims": [-1, cfg.hidden_size], "is_shape_tensor": False,
                                       "allow_ragged_batch": False, "optional": False}
    for name, width in (("topk_ids", cfg.top_k), ("topk_weights", cfg.top_k), ("router_logits", cfg.num_experts)):
        assert inputs[name]["optional"] is True and inputs[name]["dims"] == [-1, width], inputs[name]
    assert inputs["topk_ids"]["data_type"] == "TYPE_INT32"
    assert [o["name"] for o in config["output"]] == ["output"] and config["output"][0]["data_type"] == "TYPE_FP32"
    # every value of Triton's parameters map is a string_value
    assert all(set(v) == {"string_value"} for v in config["parameters"].values()), config["parameters"]
    # the metadata advertises datatypes that every client sends in JSON as in binary
    _, metadata = server.get(f"/v2/models/{PRESET}")
    assert {i["name"]: i["datatype"] for i in metadata["inputs"]} == {n: i["data_type"][5:] for n, i in inputs.items()}


@pytest.mark.parametrize("tensor_format", ["binary", "json"])
def test_zero_data_concurrency_1_to_16(perf_analyzer, server, layer, tmp_path, tensor_format):
    # perf_analyzer 2.48 writes only the last dimension of each input in its JSON tensor
    # format (its batch-of-one assumption), so JSON requests carry T = 1
    tokens = 3 if tensor_format == "binary" else 1
    before = tokens_processed(server)
    rc, output, rows = run_pa(perf_analyzer, server, tmp_path, "--concurrency-range", "1:16:5",
                              "--input-data", "zero", *zero_shapes(layer, tokens),
                              "--input-tensor-format", tensor_format, "--output-tensor-format", tensor_format)
    assert rc == 0, output[-3000:]
    assert sorted(rows) == [1, 6, 11, 16], output[-3000:]
    for concurrency, row in rows.items():
        assert float(row["Inferences/Second"]) > 0, (concurrency, row)
        assert int(row["p50 latency"]) > 0, (concurrency, row)
    # the server ran what perf_analyzer counted: at least 3 windows x 12 requests per level
    assert tokens_processed(server) - before >= 4 * 3 * 12 * tokens


def write_data_file(path: Path, layer, tokens: int, streams: int, seed: int, bad_id: int | None = None) -> Path:
    """perf_analyzer's input-data JSON: random inputs with their routing (router_logits left out:
    an optional input the file does not name is not sent). ``bad_id``: the first top-k id is set
    to it. (perf_analyzer 2.48 checks validation_data only for outputs of a fixed shape; the
    output here is [-1, H], so the results are checked by the other service tests.)"""
    entries = []
    for i in range(streams):
        hidden, ids, weights = random_inputs(layer, tokens, seed=seed + i)
        if bad_id is not None:
            ids[0, 0] = bad_id
        entries.append({
            "hidden_states": {"content": hidden.flatten().tolist(), "shape": list(hidden.shape)},
            "topk_ids": {"content": ids.flatten().tolist(), "shape": list(ids.shape)},
            "topk_weights": {"content": weights.flatten().tolist(), "shape": list(weights.shape)},
        })
    path.write_text(json.dumps({"data": entries}))
    return path


@pytest.mark.parametrize("tensor_format", ["binary", "json"])
def test_data_file_concurrency_1_and_16(perf_analyzer, server, layer, tmp_path, tensor_format):
    tokens = 4 if tensor_format == "binary" else 1
    data = write_data_file(tmp_path / "data.json", layer, tokens, streams=3, seed=101)
    before = tokens_processed(server)
    rc, output, rows = run_pa(perf_analyzer, server, tmp_path, "--concurrency-range", "1:16:15",
                              "--input-data", str(data),
                              "--input-tensor-format", tensor_format, "--output-tensor-format", tensor_format)
    assert rc == 0, output[-3000:]
    assert sorted(rows) == [1, 16], output[-3000:]
    assert tokens_processed(server) - before >= 2 * 3 * 12 * tokens


def test_data_file_content_reaches_the_server(perf_analyzer, server, layer, tmp_path):
    """The file's values are what is sent: an expert id out of range in it is refused by name."""
    bad = layer.config.num_experts + 3
    data = write_data_file(tmp_path / "data.json", layer, 2, streams=1, seed=7, bad_id=bad)
    rc, output, _ = run_pa(perf_analyzer, server, tmp_path, "--concurrency-range", "1:1", "--input-data", str(data))
    assert rc != 0 and f"topk_ids out of range: {bad}" in output, output[-3000:]


def test_random_data_gets_a_clear_400(perf_analyzer, server, layer, tmp_path):
    rc, output, _ = run_pa(perf_analyzer, server, tmp_path, "--concurrency-range", "1:1",
                           "--input-data", "random", *zero_shapes(layer, 2))
    assert rc != 0, output[-3000:]
    # random FP32 bit patterns hold NaN/Inf (or random ids out of range): perf_analyzer shows the server's reason
    assert "NaN or Inf" in output or "topk_ids out of range" in output, output[-3000:]


@pytest.fixture(scope="module")
def bf16_server(tmp_path_factory):
    """A server that advertises BF16 for hidden_states and output (``--hidden-datatype BF16``)."""
    from service_testkit import ServerProcess

    srv = ServerProcess(tmp_path_factory.mktemp("bf16") / "server.log", env={"MEGAMOE_TOKEN": TOKEN},
                        args=["--backend", "torch", "--hidden-datatype", "BF16", "--max-tokens-per-request", "64"])
    try:
        srv.wait_for("/v2/health/ready")
        yield srv
    finally:
        srv.stop()


def test_bf16_hidden_datatype_is_advertised_and_sent_by_perf_analyzer(perf_analyzer, bf16_server, layer, tmp_path):
    """--hidden-datatype BF16: metadata and config advertise BF16 for hidden_states and output (the
    routing inputs keep theirs), and perf_analyzer's binary format sends BF16 tensors that the server
    runs: half the bytes of FP32 each way."""
    _, metadata = bf16_server.get(f"/v2/models/{PRESET}")
    types = {i["name"]: i["datatype"] for i in metadata["inputs"]}
    types.pop("input_ids", None)  # INT32 where the layer takes token ids (test_service_input_ids.py)
    assert types == {"hidden_states": "BF16", "topk_ids": "INT32", "topk_weights": "FP32", "router_logits": "FP32"}
    assert metadata["outputs"][0]["datatype"] == "BF16"
    _, config = bf16_server.get(f"/v2/models/{PRESET}/config")
    assert {i["name"]: i["data_type"] for i in config["input"]}["hidden_states"] == "TYPE_BF16"
    assert config["output"][0]["data_type"] == "TYPE_BF16"
    tokens = 5
    before = tokens_processed(bf16_server)
    rc, output, rows = run_pa(perf_analyzer, bf16_server, tmp_path, "--concurrency-range", "2",
                              "--input-data", "zero", *zero_shapes(layer, tokens))
    assert rc == 0, output[-3000:]
    assert sorted(rows) == [2] and float(rows[2]["Inferences/Second"]) > 0, output[-3000:]
    assert tokens_processed(bf16_server) - before >= 3 * 12 * tokens

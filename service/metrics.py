"""Prometheus metrics of one service instance (its own registry, so several apps can live in one process).

Several serving processes (``--instances N``, service/instances.py) share prometheus_client's
multiprocess mode: each process writes its samples to files in ``PROMETHEUS_MULTIPROC_DIR`` (set
by the parent before they start) and ``/metrics`` reports all of them, whichever process answers:
counters and histograms summed, each gauge by its ``multiprocess_mode`` (queued requests summed
over the live processes; ``megamoe_ready`` 1 when every live instance reports ready, which each
does only while every instance is (what the readiness endpoint answers; a hung instance that still
reports 1 is outvoted by the others); self-test results the worst and the latest over the instances;
``megamoe_instance_ready`` one sample per instance, with its process id).
"""

from __future__ import annotations


from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

_LATENCY_BUCKETS_S = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0)
_STAGE_BUCKETS_S = (0.00002, 0.00005, 0.0001, 0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.5, 2.0)
_BATCH_REQUEST_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
_BATCH_TOKEN_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)

CHECK_STATUS_VALUE = {"pass": 1.0, "fail": 0.0, "skip": -1.0}


class ServiceMetrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self, *, multiprocess: bool = False, instance: int = 0) -> None:
        """``multiprocess``: one of several serving processes (prometheus_client's multiprocess mode,
        its directory in the environment); ``instance``: this process's index."""
        self.registry = CollectorRegistry()
        self.instance = str(instance)
        self._render_registry = self.registry
        if multiprocess:
            from prometheus_client import multiprocess as mp

            self._render_registry = CollectorRegistry()
            mp.MultiProcessCollector(self._render_registry)
        r = self.registry
        self.requests = Counter(
            "megamoe_requests", "HTTP requests answered, by route and status code",
            ["route", "code"], registry=r)
        self.failures = Counter(
            "megamoe_request_failures", "requests answered with an error, by route and reason",
            ["route", "reason"], registry=r)
        self.request_latency = Histogram(
            "megamoe_request_latency_seconds", "infer latency, from the route being reached to the response built (queue and compute included)",
            ["model"], buckets=_LATENCY_BUCKETS_S, registry=r)
        self.queue_latency = Histogram(
            "megamoe_queue_latency_seconds", "time an infer request waited in the batcher",
            ["model"], buckets=_LATENCY_BUCKETS_S, registry=r)
        self.compute_latency = Histogram(
            "megamoe_compute_latency_seconds", "time of one batched forward on the device",
            ["model"], buckets=_LATENCY_BUCKETS_S, registry=r)
        self.stage_latency = Histogram(
            "megamoe_stage_seconds",
            "where an infer's time goes, by stage: per request decode (body to tensors, validation included) "
            "and encode (output to body); per batch stage (rows stacked into pinned host buffers), "
            "h2d, compute and d2h (CUDA event times on a GPU; on the CPU compute is the whole forward)",
            ["model", "stage"], buckets=_STAGE_BUCKETS_S, registry=r)
        self.batch_requests = Histogram(
            "megamoe_batch_size_requests", "requests per batched forward",
            ["model"], buckets=_BATCH_REQUEST_BUCKETS, registry=r)
        self.batch_tokens = Histogram(
            "megamoe_batch_size_tokens", "tokens (rows) per batched forward",
            ["model"], buckets=_BATCH_TOKEN_BUCKETS, registry=r)
        self.tokens = Counter(
            "megamoe_tokens_processed", "tokens (rows) run through the MoE layer",
            ["model"], registry=r)
        self.queued = Gauge(
            "megamoe_batcher_queued_requests", "infer requests waiting for a batch (summed over the instances)",
            registry=r, multiprocess_mode="livesum")
        self.ready = Gauge("megamoe_ready", "1 when the server reports ready (every instance ready)", registry=r,
                           multiprocess_mode="livemin")
        self.instance_ready = Gauge(
            "megamoe_instance_ready", "1 when this serving process (model instance) is ready",
            ["instance"], registry=r, multiprocess_mode="liveall")
        self.selftest_runs = Counter(
            "megamoe_selftest_runs", "kernel self-test runs, by level and outcome",
            ["level", "status"], registry=r)
        self.selftest_check = Gauge(
            "megamoe_selftest_check_status", "last result of each self-test check (1 pass, 0 fail, -1 skip; "
            "the worst over the instances)", ["level", "check"], registry=r, multiprocess_mode="livemin")
        self.selftest_metric = Gauge(
            "megamoe_selftest_check_metric", "last metric of each self-test check (see its threshold in the report; "
            "the largest over the instances)", ["level", "check"], registry=r, multiprocess_mode="livemax")
        self.selftest_timestamp = Gauge(
            "megamoe_selftest_last_run_timestamp_seconds", "when each self-test level last ran (the latest "
            "over the instances)", ["level"], registry=r, multiprocess_mode="livemax")

    def set_ready(self, ready: bool, own: bool | None = None) -> None:
        """``ready``: what readiness answers; ``own``: whether this process can serve (default: ``ready``)."""
        self.ready.set(1.0 if ready else 0.0)
        self.instance_ready.labels(self.instance).set(1.0 if (ready if own is None else own) else 0.0)

    def record_batch(self, model: str, requests: int, tokens: int, compute_s: float) -> None:
        self.batch_requests.labels(model).observe(requests)
        self.batch_tokens.labels(model).observe(tokens)
        self.compute_latency.labels(model).observe(compute_s)
        self.tokens.labels(model).inc(tokens)

    def record_stage(self, model: str, stage: str, seconds: float) -> None:
        self.stage_latency.labels(model, stage).observe(seconds)

    def record_stages(self, model: str, stages: dict[str, float]) -> None:
        for stage, seconds in stages.items():
            self.stage_latency.labels(model, stage).observe(seconds)

    def record_selftest(self, level: str, report: dict, when_s: float) -> None:
        self.selftest_runs.labels(level, report.get("status", "fail")).inc()
        self.selftest_timestamp.labels(level).set(when_s)
        for check in report.get("checks", []):
            name = str(check.get("name"))
            self.selftest_check.labels(level, name).set(CHECK_STATUS_VALUE.get(check.get("status"), 0.0))
            metric = check.get("metric")
            if isinstance(metric, (int, float)) and not isinstance(metric, bool):
                self.selftest_metric.labels(level, name).set(float(metric))

    def render(self) -> bytes:
        return generate_latest(self._render_registry)

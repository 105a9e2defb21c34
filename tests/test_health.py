"""docs/SPEC.md §5 health checks: they pass on a healthy backend and fail on the original bug."""
import json

from megamoe import faults, health
from megamoe.backends import available_backends, get_backend


def by_name(report):
    return {c["name"]: c for c in report["checks"]}


def test_report_shape_and_pass_on_torch():
    r = health.run_checks("quick", backend="torch", seed=11)
    json.dumps(r)  # serialisable as is
    assert r["status"] == "pass" and r["backend"] == "torch" and r["seed"] == 11
    checks = by_name(r)
    assert set(checks) == set(health.CHECKS)
    for c in checks.values():
        assert set(c) == {"name", "status", "metric", "threshold", "detail", "duration_ms"}
    assert checks["sf_roundtrip"]["metric"] == 0
    assert checks["gemm_cosine_random"]["metric"] >= 0.9999
    assert checks["moe_vs_reference"]["status"] == "skip"  # the torch backend is the reference


def test_swapped_scale_layout_is_caught_only_by_random_scales():
    r = health.run_checks("quick", backend=faults.inject(get_backend("torch"), "swapped-sf"), seed=12)
    checks = by_name(r)
    assert r["status"] == "fail"
    assert checks["sf_roundtrip"]["status"] == "fail" and checks["sf_roundtrip"]["metric"] > 0
    assert checks["gemm_cosine_uniform"]["status"] == "pass"  # the case that hid the bug
    assert checks["gemm_cosine_random"]["status"] == "fail"
    assert checks["gemm_cosine_random"]["metric"] < 0.9


def test_a_crashing_check_is_a_failure_not_a_crash():
    class Exploding(type(get_backend("torch"))):
        def gemm(self, *a, **k):
            raise RuntimeError("illegal memory access")

    r = health.run_checks("quick", backend=Exploding(), seed=1, only=["gemm_cosine_random"])
    assert r["status"] == "fail"
    assert "illegal memory access" in r["checks"][0]["detail"]


def test_backends_report_reasons():
    av = available_backends()
    assert av["torch"] == (True, "")
    for name in ("cuda-sm90", "cuda-sm100"):
        ok, why = av[name]
        assert ok or why  # unavailable always says why

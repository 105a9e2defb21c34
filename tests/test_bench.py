"""bench/moe_bench.py's profile accounting (host only): the exposed non-GEMM time of a forward."""
from __future__ import annotations

import importlib.util
import os

import pytest

_PATH = os.path.join(os.path.dirname(__file__), "..", "bench", "moe_bench.py")


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("moe_bench", _PATH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_union_length_merges_overlaps_and_keeps_gaps(bench):
    assert bench.union_length([]) == 0.0
    assert bench.union_length([(0.0, 2.0), (1.0, 3.0), (5.0, 6.0)]) == pytest.approx(4.0)
    assert bench.union_length([(5.0, 6.0), (0.0, 10.0), (2.0, 3.0)]) == pytest.approx(10.0)  # nested, unsorted
    assert bench.union_length([(0.0, 1.0), (1.0, 2.0)]) == pytest.approx(2.0)  # touching


def test_exposed_other_excludes_the_wait_inside_a_gemm(bench):
    # one forward: align 0-2, L1 2-10, L2 launched early (PDL) 9-20, combine launched early 19-23 (waits for L2 until 20)
    spans = [("moe_align_kernel", 0.0, 2.0), ("wg_gemm_kernel<64>", 2.0, 10.0), ("wg_gemm_kernel<64>", 9.0, 20.0),
             ("combine_kernel", 19.0, 23.0)]
    # the kernels' own durations add up to 6 us of non-GEMM time; exposed: 0-2 and 20-23
    assert bench.exposed_other_us(spans, reps=1) == pytest.approx(5.0)
    # two forwards with a host gap between them: per call
    later = [(n, a + 100.0, b + 100.0) for n, a, b in spans]
    assert bench.exposed_other_us(spans + later, reps=2) == pytest.approx(5.0)


def test_gemm_kernel_names(bench):
    assert bench.is_gemm_kernel("void megamoe::sm90::wg_gemm_kernel<64, 256, true, false>(...)")
    assert bench.is_gemm_kernel("void megamoe::sm90::stream_gemm_nt1_fused_kernel<true>(...)")
    assert not bench.is_gemm_kernel("void megamoe::sm90::(anonymous namespace)::combine_kernel<float, float>(...)")
    assert bench.kernel_table({"void megamoe::sm90::(anonymous namespace)::combine_kernel<float>(x)": 1.0,
                               "void megamoe::sm90::(anonymous namespace)::combine_kernel<float>(y)": 2.0}) == \
        {"combine_kernel<float>": 3.0}

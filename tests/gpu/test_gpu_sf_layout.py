"""docs/SPEC.md §2 on the GPU: swizzle / unswizzle identical to the reference, and the device
verifier catches the two historical bugs (M/K swap, unwritten padding)."""
from __future__ import annotations

import pytest
import torch

from megamoe import nvfp4

from _helpers import backend_or_skip

pytestmark = pytest.mark.gpu

SHAPES = [(1, 1), (7, 3), (31, 4), (33, 5), (127, 29), (129, 128), (300, 448), (256, 116)]


def _scales(rows, cols, gen):
    return (torch.rand((rows, cols), generator=gen) * 400 + 2 ** -9).to(torch.float8_e4m3fn)


@pytest.mark.parametrize("rows,cols", SHAPES)
def test_swizzle_matches_reference_and_closed_form(rows, cols, gen):
    be = backend_or_skip("cuda-sm90")
    s = _scales(rows, cols, gen)
    prow, pcol = nvfp4.sf_padded_shape(rows, cols)
    buf = torch.full((prow, pcol), 0x7F, dtype=torch.uint8, device="cuda")  # poisoned: padding must be rewritten
    got = be.swizzle_scales(s.cuda(), out=buf).cpu()
    assert torch.equal(got, nvfp4.swizzle_scales(s)), "swizzled buffer differs from the reference"
    # closed form, independently: every logical byte where sf_offset says
    m = torch.arange(rows).unsqueeze(1)
    k = torch.arange(cols).unsqueeze(0)
    off = nvfp4.sf_offset(m, k, cols)
    assert torch.equal(got.reshape(-1)[off.reshape(-1)], s.view(torch.uint8).reshape(-1))
    assert torch.equal(be.unswizzle_scales(got.cuda(), rows, cols).cpu().view(torch.uint8), s.view(torch.uint8))
    rep = be.verify_sf_roundtrip(s.cuda())
    assert rep["mismatches"] == 0, rep


def test_swizzle_batched(gen):
    be = backend_or_skip("cuda-sm90")
    s = _scales(3 * 33, 5, gen).reshape(3, 33, 5)
    got = be.swizzle_scales(s.cuda()).cpu()
    assert torch.equal(got, nvfp4.swizzle_scales(s))
    assert torch.equal(be.unswizzle_scales(got.cuda(), 33, 5).cpu().view(torch.uint8), s.view(torch.uint8))


@pytest.mark.parametrize("sizes", [[5, 0, 130, 1, 33], [128, 128], [1], [0, 0, 7]])
def test_grouped_swizzle(sizes, gen):
    be = backend_or_skip("cuda-sm90")
    cols = 29
    s = _scales(sum(sizes), cols, gen)
    ref = nvfp4.swizzle_scales_grouped(s, sizes)
    got = be.swizzle_scales_grouped(s.cuda(), sizes).cpu()
    assert torch.equal(got, ref)
    back = be.unswizzle_scales_grouped(got.cuda(), sizes, cols).cpu()
    assert torch.equal(back.view(torch.uint8), s.view(torch.uint8))
    assert be.verify_swizzled(s, got, group_sizes=sizes)["mismatches"] == 0


def test_verifier_catches_mk_swap(gen):
    """docs/FIELD_BUGS.md row 2: a remap with M and K swapped (square so the buffer size is the same)."""
    be = backend_or_skip("cuda-sm90")
    s = _scales(128, 128, gen)
    bad = nvfp4.swizzle_scales(s.T.contiguous())
    rep = be.verify_swizzled(s, bad)
    assert rep["mismatches"] > 1000, rep
    good = nvfp4.swizzle_scales(s)
    assert be.verify_swizzled(s, good)["mismatches"] == 0


@pytest.mark.parametrize("rows,cols", [(33, 5), (129, 29), (7, 3)])
def test_verifier_catches_unwritten_padding(rows, cols, gen):
    """docs/FIELD_BUGS.md rows 1/4/7: padding left as 0x7F (NaN in e4m3) is counted byte by byte and reported as padding."""
    be = backend_or_skip("cuda-sm90")
    s = _scales(rows, cols, gen)
    buf = nvfp4.swizzle_scales(s).clone()
    logical = torch.zeros(buf.numel(), dtype=torch.bool)
    m = torch.arange(rows).unsqueeze(1)
    k = torch.arange(cols).unsqueeze(0)
    logical[nvfp4.sf_offset(m, k, cols).reshape(-1)] = True
    flat = buf.reshape(-1)
    flat[~logical] = 0x7F
    rep = be.verify_swizzled(s, buf)
    assert rep["mismatches"] == int((~logical).sum()), rep
    for b, mm, kk in rep["first"]:
        assert mm >= rows or kk >= cols, f"padding mismatch reported at a logical coordinate {(mm, kk)}"
    # and a single wrong logical byte is found with its coordinates
    buf2 = nvfp4.swizzle_scales(s).clone()
    off = nvfp4.sf_offset(rows - 1, cols - 1, cols)
    buf2.reshape(-1)[off] ^= 0x01
    rep2 = be.verify_swizzled(s, buf2)
    assert rep2["mismatches"] == 1 and rep2["first"] == [(0, rows - 1, cols - 1)], rep2


def test_grouped_verifier_catches_poisoned_padding(gen):
    be = backend_or_skip("cuda-sm90")
    sizes = [3, 0, 140]
    s = _scales(sum(sizes), 7, gen)
    buf = nvfp4.swizzle_scales_grouped(s, sizes).clone()
    buf.reshape(-1)[-1] = 0x7F  # last byte: padding of the last group
    rep = be.verify_swizzled(s, buf, group_sizes=sizes)
    assert rep["mismatches"] == 1, rep

"""docs/SPEC.md §2: the scale-factor layout, its padding, the grouped layout and the verifier."""
import os

import pytest
import torch

from megamoe import _ext
from megamoe import nvfp4 as F
from megamoe.faults import SwappedScaleLayout
from megamoe.backends import get_backend

from _helpers import random_scales

# docs/FIELD_BUGS.md rows 5 (M in 1, 7, 31, 33, 127, 129) and 8 (I = 464, 5472, 1856: K/16 = 29, 342, 116)
SHAPES = [(1, 1), (1, 4), (7, 3), (31, 5), (32, 4), (33, 4), (127, 29), (128, 8), (129, 13), (300, 7), (464, 448),
          (33, 342), (129, 116)]


def tile_permute(scale):
    """The layout by a second route: pad, view as (MT, 4, 32, KT, 4) tiles, permute."""
    rows, cols = scale.shape
    pr, pc = F.sf_padded_shape(rows, cols)
    pad = torch.zeros(pr, pc, dtype=torch.uint8)
    pad[:rows, :cols] = scale.view(torch.uint8)
    return pad.view(pr // 128, 4, 32, pc // 4, 4).permute(0, 3, 2, 1, 4).reshape(-1)


@pytest.mark.parametrize("rows,cols", SHAPES)
def test_swizzle_matches_tile_permutation_and_pads_zero(rows, cols, gen):
    s = random_scales(rows, cols, gen, signed=True)
    out = torch.full(F.sf_padded_shape(rows, cols), 0x7F, dtype=torch.uint8)  # poisoned (NaN in e4m3)
    got = F.swizzle_scales(s, out=out)
    assert got.data_ptr() == out.data_ptr()
    assert torch.equal(got.reshape(-1), tile_permute(s))
    assert not bool((got == 0x7F).any() and not (s.view(torch.uint8) == 0x7F).any())


@pytest.mark.parametrize("rows,cols", SHAPES)
def test_round_trip_is_identity(rows, cols, gen):
    s = random_scales(rows, cols, gen, signed=True)
    back = F.unswizzle_scales(F.swizzle_scales(s), rows, cols)
    assert torch.equal(back.view(torch.uint8), s.view(torch.uint8))


def test_padded_size_and_tile_bytes():
    assert F.sf_padded_shape(1, 1) == (128, 4)
    assert F.sf_padded_shape(129, 5) == (256, 8)
    # each 128x4 tile is 512 contiguous bytes: scale (m, k) for m < 128, k < 4 stays in [0, 512)
    m = torch.arange(128).unsqueeze(1)
    k = torch.arange(4).unsqueeze(0)
    offs = F.sf_offset(m, k, cols=4)
    assert sorted(offs.flatten().tolist()) == list(range(512))


def test_batched_swizzle_offsets(gen):
    s = random_scales(3 * 33, 5, gen, signed=True).view(3, 33, 5)
    buf = F.swizzle_scales(s)
    flat = buf.reshape(-1)
    for b in range(3):
        for m, k in [(0, 0), (32, 4), (17, 2)]:
            assert flat[F.sf_offset(m, k, cols=5, rows=33, b=b)] == s[b, m, k].view(torch.uint8)
    assert torch.equal(F.unswizzle_scales(buf, 33, 5).view(torch.uint8), s.view(torch.uint8))


def test_grouped_layout_starts_each_expert_at_128_rows(gen):
    sizes = [5, 0, 130, 1, 128, 33]
    offs = F.grouped_row_offsets(sizes)
    assert offs.tolist() == [0, 128, 128, 384, 512, 640, 768]
    s = random_scales(sum(sizes), 7, gen, signed=True)
    buf = F.swizzle_scales_grouped(s, sizes)
    assert buf.shape == (768, 8)
    flat = buf.reshape(-1)
    row = 0
    for e, n in enumerate(sizes):
        for r in range(n):
            for k in range(7):
                assert flat[F.sf_offset(int(offs[e]) + r, k, cols=7)] == s[row + r, k].view(torch.uint8)
        row += n
    back = F.unswizzle_scales_grouped(buf, sizes, 7)
    assert torch.equal(back.view(torch.uint8), s.view(torch.uint8))
    # every byte that is not a real scale is zero
    mask = torch.zeros(768 * 8, dtype=torch.bool)
    row = 0
    for e, n in enumerate(sizes):
        m = torch.arange(n).unsqueeze(1) + int(offs[e])
        mask[F.sf_offset(m, torch.arange(7).unsqueeze(0), cols=7).flatten()] = True
    assert bool((flat[~mask] == 0).all())


def test_verifier_passes_reference(gen):
    r = F.verify_sf_roundtrip(random_scales(129, 13, gen, signed=True))
    assert r["mismatches"] == 0 and r["first"] == []


def test_verifier_catches_swapped_m_and_k(gen):
    be = SwappedScaleLayout(get_backend("torch"))
    s = random_scales(33, 13, gen, signed=True)
    r = be.verify_sf_roundtrip(s)
    assert r["mismatches"] > 0
    assert any(kind == "layout" for kind, _, _ in r["first"])


def test_verifier_catches_unwritten_padding(gen):
    def lazy_swizzle(scale, out=None):  # writes the real scales, leaves padding as it was
        rows, cols = scale.shape
        m = torch.arange(rows).unsqueeze(1)
        k = torch.arange(cols).unsqueeze(0)
        out.view(-1)[F.sf_offset(m, k, cols).flatten()] = scale.view(torch.uint8).flatten()
        return out

    r = F.verify_sf_roundtrip(random_scales(33, 5, gen, signed=True), swizzle=lazy_swizzle)
    assert r["mismatches"] == 128 * 8 - 33 * 5
    assert r["first"][0][0] == "padding"


def test_verifier_catches_first_element_only_writer(gen):
    # docs/FIELD_BUGS.md row 3: every thread wrote element 0
    def broken(scale, out=None):
        out.zero_()
        out.view(-1)[0] = scale.view(torch.uint8)[-1, -1]
        return out

    r = F.verify_sf_roundtrip(random_scales(40, 6, gen, signed=True), swizzle=broken)
    assert r["mismatches"] > 0


def test_compiled_closed_form_matches_python():
    if _ext.ext is None:
        if os.environ.get("CI"):
            pytest.fail(f"CI builds the extension, but it does not import: {_ext.EXT_ERROR}")
        pytest.skip(f"extension not built: {_ext.EXT_ERROR}")
    for rows, cols in SHAPES:
        for b in (0, 2):
            for m, k in [(0, 0), (rows - 1, cols - 1), (rows // 2, cols // 2)]:
                assert _ext.ext.sf_offset(b, m, k, rows, cols) == F.sf_offset(m, k, cols=cols, rows=rows, b=b)
        assert _ext.ext.sf_padded_bytes(rows, cols) == F.sf_padded_shape(rows, cols)[0] * F.sf_padded_shape(rows, cols)[1]

"""The sm90 word layout of the packed weights (megamoe/backends/cuda_sm90.py, cpp/sm90/gemm_common.cuh
"Weight bit layout"): host only, no GPU.

The host re-layout is a bit permutation of every 32-bit word (its inverse round-trips), and the
kernels' decode arithmetic (dequant_word), written out here
on numpy uint32 words instruction by instruction, turns re-laid-out words into exactly the reference
e2m1 values of megamoe/nvfp4.py, for every code in every position."""
import numpy as np
import pytest
import torch

from _helpers import SEED
from megamoe import _ext, checkpoint, nvfp4
from megamoe.backends import cuda_sm90
from megamoe.presets import get_preset

# prepare_weights asks the C++ rule which weights take the tiled order (megamoe._C.sm90_weights_tileable)
needs_sm90 = pytest.mark.skipif(not _ext.has_part("sm90"),
                                reason=f"megamoe._C built without sm90 kernels (parts: {_ext.built_parts()})")

M32 = 0xFFFFFFFF
SLOTS = 0x81C081C0  # kPairSlots
P3_MASK, P3_MUL = 0x001B001B, (1 << 3) | (1 << 8) | (1 << 14)  # kP3Mask, kP3Mul


# ---- the device arithmetic of gemm_common.cuh, on uint32 numpy arrays
def rotr(w: np.ndarray, n: int) -> np.ndarray:
    w = w.astype(np.uint64)
    return (((w >> np.uint64(n)) | (w << np.uint64(32 - n))) & M32).astype(np.uint32) if n else w.astype(np.uint32)


def mul_lo(a: np.ndarray, b: int) -> np.ndarray:
    return ((a.astype(np.uint64) * np.uint64(b)) & M32).astype(np.uint32)


def dequant_word_bits(w: np.ndarray) -> list[np.ndarray]:
    """dequant_word's four pairs before the scale multiply."""
    return [w & np.uint32(SLOTS), rotr(w, 3) & np.uint32(SLOTS), rotr(w, 6) & np.uint32(SLOTS),
            mul_lo(w & np.uint32(P3_MASK), P3_MUL) & np.uint32(SLOTS)]


def bf16_halves(p: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """(low, high) bf16 halves of bf16x2 words as float32."""
    lo = ((p & np.uint32(0xFFFF)).astype(np.uint32) << np.uint32(16)).view(np.float32)
    hi = (p & np.uint32(0xFFFF0000)).view(np.float32)
    return torch.from_numpy(lo.copy()), torch.from_numpy(hi.copy())


def words_of(data: torch.Tensor) -> np.ndarray:
    return data.contiguous().view(torch.int32).reshape(-1).numpy().view(np.uint32)


def same_values(got: torch.Tensor, want: torch.Tensor) -> bool:
    return torch.equal(got, want) and torch.equal(torch.signbit(got), torch.signbit(want))


def test_layout_is_a_bit_permutation_of_every_word():
    stored = cuda_sm90.SM90_STORED_BITS
    assert sorted(stored) == list(range(32)) and list(stored) != list(range(32))
    one_hot = torch.tensor([1 << b for b in range(32)], dtype=torch.int64)
    one_hot = ((one_hot ^ 0x80000000) - 0x80000000).to(torch.int32).view(torch.uint8).reshape(32, 4)
    moved = words_of(cuda_sm90.sm90_word_layout(one_hot))
    assert [int(m) for m in moved] == [1 << stored[b] for b in range(32)], "bit b must land on SM90_STORED_BITS[b]"


@pytest.mark.parametrize("shape", [(1, 4), (3, 7, 8), (2, 64, 2048)])
def test_inverse_round_trips_and_input_is_untouched(shape):
    gen = torch.Generator().manual_seed(SEED)
    data = torch.randint(0, 256, shape, generator=gen, dtype=torch.uint8)
    before = data.clone()
    laid = cuda_sm90.sm90_word_layout(data)
    assert laid.dtype == torch.uint8 and laid.shape == data.shape and torch.equal(data, before)
    assert torch.equal(cuda_sm90.sm90_word_layout_inverse(laid), data)
    assert torch.equal(cuda_sm90.sm90_word_layout(cuda_sm90.sm90_word_layout_inverse(data)), data)
    if data.numel() >= 64:
        assert not torch.equal(laid, data)
    # popcount per word is kept (a permutation of bits, never a bit lost or duplicated)
    pc = lambda t: np.unpackbits(t.numpy().reshape(-1, 4), axis=1).sum(axis=1)  # noqa: E731
    assert np.array_equal(pc(laid), pc(data))


def test_chunked_layout_equals_one_chunk(monkeypatch):
    gen = torch.Generator().manual_seed(SEED + 1)
    data = torch.randint(0, 256, (5, 3, 40), generator=gen, dtype=torch.uint8)
    whole = cuda_sm90.sm90_word_layout(data)
    monkeypatch.setattr(cuda_sm90, "_LAYOUT_CHUNK_WORDS", 7)  # chunks that split rows
    assert torch.equal(cuda_sm90.sm90_word_layout(data), whole)


def test_layout_rejects_what_it_cannot_permute():
    with pytest.raises(ValueError, match="uint8"):
        cuda_sm90.sm90_word_layout(torch.zeros(2, 8, dtype=torch.int8))
    with pytest.raises(ValueError, match="multiple of 4"):
        cuda_sm90.sm90_word_layout(torch.zeros(2, 6, dtype=torch.uint8))


def _check_decode(nvfp4_words: np.ndarray):
    """The device decode of the re-laid-out words gives the reference value of every code."""
    data = torch.from_numpy(nvfp4_words.astype(np.uint32).view(np.uint8).copy()).reshape(-1, 4)
    laid = words_of(cuda_sm90.sm90_word_layout(data))
    ref = nvfp4.e2m1_decode(nvfp4.unpack_codes(data))  # [n, 8]: n0..n7 of each word
    pairs = dequant_word_bits(laid)
    for j in range(4):
        lo, hi = bf16_halves(pairs[j])
        assert same_values(lo * 2.0**126, ref[:, j]), f"P{j} low half (n{j}) wrong"
        assert same_values(hi * 2.0**126, ref[:, j + 4]), f"P{j} high half (n{j + 4}) wrong"
        # nothing but the slots of the two codes is set
        assert not np.any(pairs[j] & np.uint32(~SLOTS & M32))


def test_every_code_in_every_position_decodes_exactly():
    words = []
    for c in range(16):
        words.append(sum(c << (4 * i) for i in range(8)))  # code c everywhere
        for pos in range(8):  # code c at one position, another code elsewhere
            other = (c + 5 + pos) % 16
            words.append(sum((c if i == pos else other) << (4 * i) for i in range(8)))
    _check_decode(np.array(words, dtype=np.uint32))


def test_random_words_decode_exactly():
    rng = np.random.default_rng(SEED)
    _check_decode(rng.integers(0, 2**32, size=4096, dtype=np.uint64).astype(np.uint32))


def test_scale_multiply_of_the_pairs_is_exact():
    """P * bf16(scale * 2^119) == e2m1 * scale * 2^-7 in bf16 for every code and finite e4m3 scale."""
    codes = np.arange(16, dtype=np.uint32)
    words = codes * np.uint32(0x11111111)  # one code in all 8 positions
    data = torch.from_numpy(words.view(np.uint8).copy()).reshape(-1, 4)
    lo, hi = bf16_halves(dequant_word_bits(words_of(cuda_sm90.sm90_word_layout(data)))[1])
    scales = torch.arange(0, 127, dtype=torch.uint8).view(torch.float8_e4m3fn).float()  # 127 = NaN
    s2 = (scales * 2.0**119).to(torch.bfloat16)
    want = nvfp4.e2m1_decode(torch.from_numpy(codes.astype(np.uint8)))[:, None] * scales[None, :] * 2.0**-7
    for half in (lo, hi):
        got = (half.to(torch.bfloat16)[:, None] * s2[None, :]).float()
        assert same_values(got, want.to(torch.bfloat16).float())
        assert torch.equal(want.to(torch.bfloat16).float(), want)  # exact in bf16


@needs_sm90
def test_prepare_weights_lays_out_a_copy_and_keeps_the_layers_weights():
    cfg = get_preset("tiny")
    w = checkpoint.synthetic_weights(cfg, seed=SEED % 1000, device="cpu")
    w13, w2 = w.w13.data.clone(), w.w2.data.clone()
    be = cuda_sm90.CudaSm90Backend.__new__(cuda_sm90.CudaSm90Backend)
    be._device = torch.device("cpu")
    p = be.prepare_weights(w)
    assert torch.equal(w.w13.data, w13) and torch.equal(w.w2.data, w2), "the caller's weights changed"
    # tiny (H 256, I 128): w13 (K = H) in the tiled order, w2 (K = I = 128, not a multiple of 256) row-major
    assert (p.w13_tiled, p.w2_tiled) == (True, False)
    want13 = cuda_sm90.sm90_tiled(*cuda_sm90.sm90_weights(w13, w.w13.scale))
    want2 = cuda_sm90.sm90_weights(w2, w.w2.scale)
    for (gd, gs), (wd, ws) in zip(((p.w13_data, p.w13_scale), (p.w2_data, p.w2_scale)), (want13, want2)):
        assert torch.equal(gd, wd) and torch.equal(gs, ws)
    assert p.w13_data.data_ptr() != w.w13.data.data_ptr()
    again = be.prepare_weights(w)  # preparing twice starts from the NVFP4 data both times
    assert torch.equal(again.w13_data, p.w13_data)


# ---- the scale code (gemm_common.cuh "Scale code"): scale_pair = byte_perm(word, 0, sel) * 16 + 0x76807680
def scale_pair_bits(codes: np.ndarray) -> np.ndarray:
    """The device's bf16x2 scale of each code byte (both halves), from its arithmetic."""
    c = codes.astype(np.uint32)
    return ((c | (c << np.uint32(16))) * np.uint32(16) + np.uint32(0x76807680)) & np.uint32(M32)


def test_scale_code_decodes_to_every_e4m3_scale_times_2_119():
    every = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    codes = cuda_sm90.sm90_scale_code(every).numpy()
    assert cuda_sm90.sm90_scale_code(every.view(torch.float8_e4m3fn)).numpy().tolist() == codes.tolist()
    bits = scale_pair_bits(codes)
    assert np.array_equal(bits & np.uint32(0xFFFF), bits >> np.uint32(16)), "both halves hold the same scale"
    lo, _ = bf16_halves(bits)
    mag = every.view(torch.float8_e4m3fn).float().abs()
    finite = ~torch.isnan(mag) & (mag > 0)
    assert int(finite.sum()) == 2 * 126
    assert torch.equal(lo[finite], mag[finite] * 2.0**119), "code * 16 + 0x7680 must be bf16(|scale| * 2^119)"
    assert torch.isnan(lo[torch.isnan(mag)]).all() and int(torch.isnan(mag).sum()) == 2
    assert len(set(codes[1:127].tolist())) == 126, "distinct magnitudes get distinct codes"


def _decode_blocks(data: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """What the kernels compute from sm90_weights(data, scale): every element's code x scale product (x 2^7), in
    NVFP4 element order, [blocks, 16] float32."""
    laid, codes = cuda_sm90.sm90_weights(data, scale)
    words = words_of(laid).reshape(-1, 2)  # two words per block
    s2 = scale_pair_bits(codes[..., :scale.shape[-1]].reshape(-1).numpy())
    slo, shi = (h.to(torch.bfloat16) for h in bf16_halves(s2))
    out = torch.empty(words.shape[0], 16)
    for q in range(2):
        pairs = dequant_word_bits(words[:, q].copy())
        for j in range(4):
            lo, hi = bf16_halves(pairs[j])
            out[:, 8 * q + j] = (lo.to(torch.bfloat16) * slo).float() * 2.0**7
            out[:, 8 * q + j + 4] = (hi.to(torch.bfloat16) * shi).float() * 2.0**7
    return out


def test_sm90_weights_keep_every_product_for_every_scale_byte():
    """Each of the 256 scale bytes (zero, negative, subnormal, NaN) on a block holding all 16 codes: the kernels'
    product of the folded codes and the scale code equals code x scale of the reference for every element."""
    block = torch.tensor([(2 * i) | ((2 * i + 1) << 4) for i in range(8)], dtype=torch.uint8)  # codes 0..15
    data = block.repeat(256, 1)  # [256, 8]: 16 codes per row, one block
    scale = torch.arange(256, dtype=torch.int32).to(torch.uint8).reshape(256, 1)
    before = data.clone(), scale.clone()
    got = _decode_blocks(data, scale)
    assert torch.equal(data, before[0]) and torch.equal(scale, before[1]), "the inputs changed"
    want = nvfp4.e2m1_decode(nvfp4.unpack_codes(data)) * scale.view(torch.float8_e4m3fn).float()
    nan = torch.isnan(want)
    assert torch.equal(torch.isnan(got), nan) and int(nan.sum()) == 2 * 16
    assert torch.equal(got[~nan], want[~nan]), "a folded code x scale code product differs from the reference"
    assert set(nvfp4.unpack_codes(data[0:1]).reshape(-1).tolist()) == set(range(16))


def test_sm90_weights_fold_only_the_blocks_that_need_it(monkeypatch):
    gen = torch.Generator().manual_seed(SEED + 2)
    data = torch.randint(0, 256, (3, 5, 64), generator=gen, dtype=torch.uint8)  # K = 128: 8 blocks per row
    pos = (torch.rand((3, 5, 8), generator=gen) * 300 + 0.01).to(torch.float8_e4m3fn)  # none rounds to 0
    laid, codes = cuda_sm90.sm90_weights(data, pos)  # positive scales: the codes only re-laid out
    assert torch.equal(laid, cuda_sm90.sm90_word_layout(data))
    assert codes.shape == (3, 5, 16) and torch.equal(codes[..., 8:], torch.zeros_like(codes[..., 8:]))
    mixed = pos.view(torch.uint8).clone()
    mixed[0, 0, 1] |= 0x80   # negative
    mixed[1, 2, 3] = 0        # zero
    mixed[2, 4, 7] = 0x80     # negative zero
    data[1, 2, 24] |= 1        # the zeroed blocks hold a nonzero code
    data[2, 4, 56] |= 1
    laid, _ = cuda_sm90.sm90_weights(data, mixed)
    back = cuda_sm90.sm90_word_layout_inverse(laid).reshape(3, 5, 8, 8)
    ref = data.reshape(3, 5, 8, 8)
    changed = (back != ref).any(-1)
    assert changed.nonzero().tolist() == [[0, 0, 1], [1, 2, 3], [2, 4, 7]]
    assert torch.equal(back[0, 0, 1], ref[0, 0, 1] ^ 0x88)
    assert not back[1, 2, 3].any() and not back[2, 4, 7].any()
    monkeypatch.setattr(cuda_sm90, "_FOLD_CHUNK_BLOCKS", 3)  # chunks that split rows
    assert torch.equal(cuda_sm90.sm90_weights(data, mixed)[0], laid)
    with pytest.raises(ValueError, match="do not match"):
        cuda_sm90.sm90_weights(data, mixed[..., :4])


# ---- the tiled order (cuda_sm90.sm90_tiled; cpp/include/megamoe/sm90_kernels.h sm90_weight_tile_offset)
def tile_offset(n: int, b: int, row_bytes: int, chunk: int) -> int:
    """sm90_weight_tile_offset, written again: byte b of row n within one expert's tiled bytes."""
    return (n // 32) * 32 * row_bytes + (b // chunk) * 32 * chunk + (n % 32) * chunk + b % chunk


def test_tiled_order_puts_every_byte_where_the_kernels_read_it():
    g = torch.Generator().manual_seed(SEED)
    e, n, k = 3, 96, 768
    data = torch.randint(0, 256, (e, n, k // 2), dtype=torch.uint8, generator=g)
    scale = torch.randint(0, 256, (e, n, k // 16), dtype=torch.uint8, generator=g)
    td, ts = cuda_sm90.sm90_tiled(data, scale)
    assert td.shape == data.shape and ts.shape == scale.shape
    assert not torch.equal(td, data), "random rows of 3 chunks: the order must move bytes"
    for t, src, row_bytes, chunk in ((td, data, k // 2, 128), (ts, scale, k // 16, 16)):
        _, nn, nbb = torch.meshgrid(torch.arange(e), torch.arange(n), torch.arange(row_bytes), indexing="ij")
        off = (nn // 32) * 32 * row_bytes + (nbb // chunk) * 32 * chunk + (nn % 32) * chunk + nbb % chunk
        flat = t.reshape(e, -1)
        assert torch.equal(flat.gather(1, off.reshape(e, -1)).reshape(src.shape), src)
        assert tile_offset(33, 130 % row_bytes, row_bytes, chunk) == int(off[0, 33, 130 % row_bytes])
    back = cuda_sm90.sm90_untiled(td, ts)
    assert torch.equal(back[0], data) and torch.equal(back[1], scale)


@needs_sm90
@pytest.mark.parametrize("rows,k,gate_up,ok", [(4096, 4096, True, True), (7168, 2048, False, True),
                                               (544, 1024, True, False), (1024, 192, False, False),
                                               (1024, 1088, False, False), (96, 256, True, False),
                                               (64, 256, True, True), (96, 256, False, True)])
def test_tileable_shapes(rows, k, gate_up, ok):
    assert cuda_sm90.sm90_tileable(rows, k, gate_up) == ok


def test_tiled_refuses_shapes_it_cannot_tile():
    with pytest.raises(ValueError, match="multiples of 32"):
        cuda_sm90.sm90_tiled(torch.zeros(40, 128, dtype=torch.uint8), torch.zeros(40, 16, dtype=torch.uint8))
    with pytest.raises(ValueError, match="K % 256 == 0"):
        cuda_sm90.sm90_tiled(torch.zeros(32, 96, dtype=torch.uint8), torch.zeros(32, 12, dtype=torch.uint8))

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
from megamoe import checkpoint, nvfp4
from megamoe.backends import cuda_sm90
from megamoe.presets import get_preset

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


def test_prepare_weights_lays_out_a_copy_and_keeps_the_layers_weights():
    cfg = get_preset("tiny")
    w = checkpoint.synthetic_weights(cfg, seed=SEED % 1000, device="cpu")
    w13, w2 = w.w13.data.clone(), w.w2.data.clone()
    be = cuda_sm90.CudaSm90Backend.__new__(cuda_sm90.CudaSm90Backend)
    be._device = torch.device("cpu")
    p = be.prepare_weights(w)
    assert torch.equal(w.w13.data, w13) and torch.equal(w.w2.data, w2), "the caller's weights changed"
    assert torch.equal(p.w13_data, cuda_sm90.sm90_word_layout(w13))
    assert torch.equal(p.w2_data, cuda_sm90.sm90_word_layout(w2))
    assert p.w13_data.data_ptr() != w.w13.data.data_ptr()
    again = be.prepare_weights(w)  # preparing twice starts from the NVFP4 data both times
    assert torch.equal(again.w13_data, p.w13_data)

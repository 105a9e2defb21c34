// docs/SPEC.md §2: where the block scale of (batch b, row m, scale column k) lives in the
// tensor-core scale-factor layout of CUTLASS's Sm1xxBlockScaledConfig<16>
// (SfKMajorAtom tiled over (M, K, L) with Step<_2,_1,_3>).
//
// One closed form, shared by every kernel and host path, and checked against CuTe
// by cpp/tests/test_sf_layout.cpp. Each 128x4 tile of scales is 512 contiguous
// bytes; rows are padded to 128 and scale columns to 4, and the padding is zero.
#pragma once
#include <cstdint>

#if defined(__CUDACC__)
#define MEGAMOE_HD __host__ __device__ __forceinline__
#else
#define MEGAMOE_HD inline
#endif

namespace megamoe {

constexpr int64_t kSfVec = 16;        // elements per block scale
constexpr int64_t kSfTileRows = 128;  // rows per SF tile
constexpr int64_t kSfTileCols = 4;    // scale columns per SF tile
constexpr int64_t kSfTileBytes = kSfTileRows * kSfTileCols;

MEGAMOE_HD int64_t sf_padded_rows(int64_t rows) { return (rows + kSfTileRows - 1) / kSfTileRows * kSfTileRows; }
MEGAMOE_HD int64_t sf_padded_cols(int64_t cols) { return (cols + kSfTileCols - 1) / kSfTileCols * kSfTileCols; }
// Bytes of one batch's swizzled scale buffer (padding included): what CuTe calls
// size(filter_zeros(layout)) / cosize.
MEGAMOE_HD int64_t sf_padded_bytes(int64_t rows, int64_t cols) { return sf_padded_rows(rows) * sf_padded_cols(cols); }

// Offset of scale (m, k) of batch b; kt = number of 4-column tiles = ceil(cols / 4),
// mt = number of 128-row tiles = ceil(rows / 128).
MEGAMOE_HD int64_t sf_offset(int64_t b, int64_t m, int64_t k, int64_t mt, int64_t kt) {
  return b * mt * kt * kSfTileBytes + (m / 128) * kt * kSfTileBytes + (k / 4) * kSfTileBytes +
         (m % 32) * 16 + ((m % 128) / 32) * 4 + (k % 4);
}
MEGAMOE_HD int64_t sf_offset(int64_t m, int64_t k, int64_t kt) { return sf_offset(0, m, k, 0, kt); }

}  // namespace megamoe

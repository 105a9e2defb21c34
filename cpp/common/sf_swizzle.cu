// docs/SPEC.md §2 scale-factor layout: swizzle, unswizzle and the round-trip verifier, for
// batched and grouped (per-expert, 128-row aligned) buffers.
//
// The swizzle kernels walk the *padded buffer* (one thread per byte, so padding is
// written as zero and no byte is left unwritten) and map each byte back to its
// logical (m, k) by decomposing the offset; the verifier walks the *logical
// coordinates* and maps them forward through the closed form sf_offset(). Two
// independent directions, so a bug in one shows up against the other.
#include "megamoe/common_kernels.h"
#include "megamoe/sf_layout.hpp"
#include "offset_search.cuh"

namespace megamoe {
namespace {

struct TileCoord {
  int64_t m;  // row within the (batch / group) matrix
  int64_t k;  // scale column
};

// Inverse of the closed form within one batch: byte offset -> (m, k).
__device__ __forceinline__ TileCoord decompose(int64_t off, int64_t kt) {
  const int64_t tile = off / kSfTileBytes;
  const int64_t in = off - tile * kSfTileBytes;
  const int64_t mt = tile / kt, ktile = tile - mt * kt;
  TileCoord c;
  c.m = mt * 128 + ((in % 16) / 4) * 32 + in / 16;
  c.k = ktile * 4 + (in % 4);
  return c;
}

__global__ void swizzle_kernel(const uint8_t* lin, int64_t batches, int64_t rows, int64_t cols, uint8_t* swz) {
  const int64_t per_batch = sf_padded_bytes(rows, cols);
  const int64_t idx = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (idx >= batches * per_batch) return;
  const int64_t b = idx / per_batch;
  const TileCoord c = decompose(idx - b * per_batch, (cols + 3) / 4);
  swz[idx] = (c.m < rows && c.k < cols) ? lin[(b * rows + c.m) * cols + c.k] : uint8_t(0);
}

__global__ void unswizzle_kernel(const uint8_t* swz, int64_t batches, int64_t rows, int64_t cols, uint8_t* lin) {
  const int64_t idx = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (idx >= batches * rows * cols) return;
  const int64_t b = idx / (rows * cols);
  const int64_t rem = idx - b * rows * cols;
  const int64_t m = rem / cols, k = rem - m * cols;
  lin[idx] = swz[sf_offset(b, m, k, (rows + 127) / 128, (cols + 3) / 4)];
}

__global__ void swizzle_grouped_kernel(const uint8_t* lin, int num_groups, const int32_t* src_offsets,
                                       const int32_t* dst_row_offsets, int64_t total_rows, int64_t cols,
                                       uint8_t* swz) {
  const int64_t idx = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (idx >= sf_padded_bytes(total_rows, cols)) return;
  const TileCoord c = decompose(idx, (cols + 3) / 4);
  uint8_t v = 0;
  if (c.k < cols && c.m >= dst_row_offsets[0]) {
    const int g = last_offset_at_or_below(dst_row_offsets, num_groups, c.m);  // the group owning row c.m
    const int64_t local = c.m - dst_row_offsets[g];
    if (local < int64_t(src_offsets[g + 1]) - src_offsets[g]) v = lin[(src_offsets[g] + local) * cols + c.k];
  }
  swz[idx] = v;
}

__global__ void unswizzle_grouped_kernel(const uint8_t* swz, int num_groups, const int32_t* src_offsets,
                                         const int32_t* dst_row_offsets, int64_t cols, uint8_t* lin) {
  const int64_t n = int64_t(src_offsets[num_groups]) * cols;
  const int64_t kt = (cols + 3) / 4;
  for (int64_t idx = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; idx < n;
       idx += int64_t(gridDim.x) * blockDim.x) {
    const int64_t r = idx / cols, k = idx - r * cols;
    int lo = 0, hi = num_groups - 1;  // group of linear row r
    while (lo < hi) {
      const int mid = (lo + hi + 1) >> 1;
      if (src_offsets[mid] <= r) lo = mid;
      else hi = mid - 1;
    }
    lin[idx] = swz[sf_offset(dst_row_offsets[lo] + (r - src_offsets[lo]), k, kt)];
  }
}

__device__ __forceinline__ void record(int64_t* result, int max_records, int64_t b, int64_t m, int64_t k) {
  const unsigned long long slot = atomicAdd(reinterpret_cast<unsigned long long*>(&result[0]), 1ull);
  if (slot < unsigned(max_records)) {
    result[1 + 3 * slot] = b;
    result[2 + 3 * slot] = m;
    result[3 + 3 * slot] = k;
  }
}

// Pass 1 (logical coordinates, forward closed form): every linear scale is where
// sf_offset() says. Pass 2 (every byte, inverse map): bytes that no logical
// coordinate owns are zero.
__global__ void verify_kernel(const uint8_t* lin, const uint8_t* swz, int64_t batches, int64_t rows, int64_t cols,
                              int64_t* result, int max_records) {
  const int64_t mt = (rows + 127) / 128, kt = (cols + 3) / 4;
  const int64_t logical = batches * rows * cols;
  const int64_t per_batch = sf_padded_bytes(rows, cols);
  const int64_t total = logical + batches * per_batch;
  for (int64_t idx = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; idx < total;
       idx += int64_t(gridDim.x) * blockDim.x) {
    if (idx < logical) {
      const int64_t b = idx / (rows * cols);
      const int64_t rem = idx - b * rows * cols;
      const int64_t m = rem / cols, k = rem - m * cols;
      if (swz[sf_offset(b, m, k, mt, kt)] != lin[idx]) record(result, max_records, b, m, k);
    } else {
      const int64_t off = idx - logical;
      const int64_t b = off / per_batch;
      const TileCoord c = decompose(off - b * per_batch, kt);
      if ((c.m >= rows || c.k >= cols) && swz[off] != 0) record(result, max_records, b, c.m, c.k);
    }
  }
}

__global__ void verify_grouped_kernel(const uint8_t* lin, const uint8_t* swz, int num_groups,
                                      const int32_t* src_offsets, const int32_t* dst_row_offsets,
                                      int64_t total_rows, int64_t cols, int64_t* result, int max_records) {
  const int64_t kt = (cols + 3) / 4;
  const int64_t logical = int64_t(src_offsets[num_groups]) * cols;
  const int64_t total = logical + sf_padded_bytes(total_rows, cols);
  for (int64_t idx = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; idx < total;
       idx += int64_t(gridDim.x) * blockDim.x) {
    if (idx < logical) {
      const int64_t r = idx / cols, k = idx - r * cols;
      int lo = 0, hi = num_groups - 1;
      while (lo < hi) {
        const int mid = (lo + hi + 1) >> 1;
        if (src_offsets[mid] <= r) lo = mid;
        else hi = mid - 1;
      }
      const int64_t local = r - src_offsets[lo];
      if (swz[sf_offset(dst_row_offsets[lo] + local, k, kt)] != lin[idx]) record(result, max_records, lo, local, k);
    } else {
      const int64_t off = idx - logical;
      const TileCoord c = decompose(off, kt);
      bool padding = c.k >= cols || c.m < dst_row_offsets[0];
      int g = 0;
      int64_t local = c.m;
      if (!padding) {
        g = last_offset_at_or_below(dst_row_offsets, num_groups, c.m);  // the group owning row c.m
        local = c.m - dst_row_offsets[g];
        padding = local >= int64_t(src_offsets[g + 1]) - src_offsets[g];
      }
      if (padding && swz[off] != 0) record(result, max_records, g, local, c.k);
    }
  }
}

unsigned grid_for(int64_t n, int threads) { return unsigned((n + threads - 1) / threads); }

}  // namespace

cudaError_t launch_swizzle_scales(const uint8_t* linear, int64_t batches, int64_t rows, int64_t cols,
                                  uint8_t* swizzled, cudaStream_t stream) {
  const int64_t n = batches * sf_padded_bytes(rows, cols);
  if (n == 0) return cudaSuccess;
  swizzle_kernel<<<grid_for(n, 256), 256, 0, stream>>>(linear, batches, rows, cols, swizzled);
  return cudaGetLastError();
}

cudaError_t launch_unswizzle_scales(const uint8_t* swizzled, int64_t batches, int64_t rows, int64_t cols,
                                    uint8_t* linear, cudaStream_t stream) {
  const int64_t n = batches * rows * cols;
  if (n == 0) return cudaSuccess;
  unswizzle_kernel<<<grid_for(n, 256), 256, 0, stream>>>(swizzled, batches, rows, cols, linear);
  return cudaGetLastError();
}

cudaError_t launch_swizzle_scales_grouped(const uint8_t* linear, int num_groups, const int32_t* src_offsets,
                                          const int32_t* dst_row_offsets, int64_t total_rows, int64_t cols,
                                          uint8_t* swizzled, cudaStream_t stream) {
  const int64_t n = sf_padded_bytes(total_rows, cols);
  if (n == 0 || num_groups <= 0) return cudaSuccess;
  swizzle_grouped_kernel<<<grid_for(n, 256), 256, 0, stream>>>(linear, num_groups, src_offsets, dst_row_offsets,
                                                               total_rows, cols, swizzled);
  return cudaGetLastError();
}

cudaError_t launch_unswizzle_scales_grouped(const uint8_t* swizzled, int num_groups, const int32_t* src_offsets,
                                            const int32_t* dst_row_offsets, int64_t total_rows, int64_t cols,
                                            uint8_t* linear, cudaStream_t stream) {
  (void)total_rows;
  if (num_groups <= 0) return cudaSuccess;
  unswizzle_grouped_kernel<<<1024, 256, 0, stream>>>(swizzled, num_groups, src_offsets, dst_row_offsets, cols, linear);
  return cudaGetLastError();
}

cudaError_t launch_verify_swizzled(const uint8_t* linear, const uint8_t* swizzled, int64_t batches, int64_t rows,
                                   int64_t cols, int64_t* result, int max_records, cudaStream_t stream) {
  cudaError_t err = cudaMemsetAsync(result, 0, sizeof(int64_t) * (1 + 3 * int64_t(max_records)), stream);
  if (err != cudaSuccess) return err;
  const int64_t n = batches * (rows * cols + sf_padded_bytes(rows, cols));
  if (n == 0) return cudaSuccess;
  unsigned grid = grid_for(n, 256);
  if (grid > 4096) grid = 4096;
  verify_kernel<<<grid, 256, 0, stream>>>(linear, swizzled, batches, rows, cols, result, max_records);
  return cudaGetLastError();
}

cudaError_t launch_verify_swizzled_grouped(const uint8_t* linear, const uint8_t* swizzled, int num_groups,
                                           const int32_t* src_offsets, const int32_t* dst_row_offsets,
                                           int64_t total_rows, int64_t cols, int64_t* result, int max_records,
                                           cudaStream_t stream) {
  cudaError_t err = cudaMemsetAsync(result, 0, sizeof(int64_t) * (1 + 3 * int64_t(max_records)), stream);
  if (err != cudaSuccess) return err;
  if (num_groups <= 0) return cudaSuccess;
  verify_grouped_kernel<<<4096, 256, 0, stream>>>(linear, swizzled, num_groups, src_offsets, dst_row_offsets,
                                                  total_rows, cols, result, max_records);
  return cudaGetLastError();
}

}  // namespace megamoe

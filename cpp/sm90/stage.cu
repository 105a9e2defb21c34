// Activation staging: bf16 rows in operand or lane order (megamoe/sm90_operand_order.hpp), gathered per grouped row
// (stage_bf16) or scattered from each token's row (scatter_bf16), and their launchers (megamoe/sm90_kernels.h).
// Launched with PDL (cpp/sm90/pdl.cuh): the kernels wait for their predecessor before their first global access and
// release their dependents right after.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <type_traits>

#include "launch_util.cuh"
#include "megamoe/sm90_kernels.h"
#include "megamoe/sm90_operand_order.hpp"
#include "pdl.cuh"

namespace megamoe::sm90 {
namespace {

// The converted 16-byte chunk c of a source row: pair t of it holds elements (first + step t, + 4), in operand or lane
// order (megamoe/sm90_operand_order.hpp, operand_chunk_first).
template <typename T>
__device__ __forceinline__ uint4 bf16_chunk(const T* row, int64_t c, bool lane_order) {
  const int64_t first = operand_chunk_first(c, lane_order);
  const int step = operand_chunk_step(lane_order);  // elements between the pairs' first elements
  const T* p = row + first;
  uint32_t w[4];
#pragma unroll
  for (int t = 0; t < 4; ++t) {
    __nv_bfloat162 b = __floats2bfloat162_rn(static_cast<float>(p[step * t]), static_cast<float>(p[step * t + 4]));
    w[t] = *reinterpret_cast<uint32_t*>(&b);  // to float exact; one rounding to bf16 (none for bf16 sources)
  }
  return make_uint4(w[0], w[1], w[2], w[3]);
}

// One thread per 16-byte output chunk c of a row (4 bf16 pairs): gather, convert, store (bf16_chunk).
template <typename T>
__global__ void stage_bf16_kernel(const T* src, int64_t stride, const int32_t* src_rows, const int32_t* num_rows,
                                  int64_t max_rows, int64_t cols, uint16_t* dst, bool lane_order) {
  griddep_sync_and_release();  // no-op unless launched with PDL
  const int64_t chunks = cols / 8;
  const int64_t rows = num_rows ? *num_rows : max_rows;
  for (int64_t idx = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; idx < rows * chunks;
       idx += int64_t(gridDim.x) * blockDim.x) {
    const int64_t r = idx / chunks, c = idx - r * chunks;
    const int64_t sr = src_rows ? src_rows[r] : r;
    *reinterpret_cast<uint4*>(dst + r * cols + c * 8) = bf16_chunk(src + sr * stride, c, lane_order);
  }
}

// 16-byte global store (p 16-byte aligned). Written as one vector store: the scatter loop below, written with a uint4
// assignment, was compiled into four 4-byte stores per row.
__device__ __forceinline__ void store16(void* p, const uint4& v) {
  asm volatile("st.global.v4.b32 [%0], {%1, %2, %3, %4};" ::"l"(p), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w)
               : "memory");
}

// Token order: one thread per 16-byte chunk c of token t's row, read once and stored into each of the token's
// rows dst_rows[t * top_k + j] >= 0. Each source byte is read once, where stage_bf16_kernel with src_rows reads a
// token's row once per slot, in expert order.
template <typename T>
__global__ void scatter_bf16_kernel(const T* src, int64_t stride, int64_t tokens, const int32_t* dst_rows, int top_k,
                                    int64_t cols, uint16_t* dst, bool lane_order) {
  griddep_sync_and_release();  // no-op unless launched with PDL
  const int64_t chunks = cols / 8;
  for (int64_t idx = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; idx < tokens * chunks;
       idx += int64_t(gridDim.x) * blockDim.x) {
    const int64_t t = idx / chunks, c = idx - t * chunks;
    for (int j0 = 0; j0 < top_k; j0 += kSlotBatch) {
      int32_t r[kSlotBatch];
#pragma unroll
      for (int u = 0; u < kSlotBatch; ++u) r[u] = j0 + u < top_k ? __ldg(dst_rows + t * top_k + j0 + u) : -1;
      const uint4 v = bf16_chunk(src + t * stride, c, lane_order);  // (again for a second batch: top_k > 8 only)
#pragma unroll
      for (int u = 0; u < kSlotBatch; ++u)
        if (r[u] >= 0) store16(dst + int64_t(r[u]) * cols + c * 8, v);
    }
  }
}

}  // namespace

cudaError_t launch_stage_bf16(const void* src, ElemType src_type, int64_t src_row_stride, const int32_t* src_rows,
                              const int32_t* num_rows, int64_t max_rows, int64_t cols, uint16_t* dst,
                              bool lane_order, cudaStream_t stream) {
  if (cols % (lane_order ? 64 : 16) != 0) return cudaErrorInvalidValue;
  if (max_rows == 0) return cudaSuccess;
  const unsigned grid = grid_of(max_rows * (cols / 8), 256);
  return with_elem_type(src_type, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    return pdl_launch(stage_bf16_kernel<T>, grid, 256, 0, stream, static_cast<const T*>(src), src_row_stride,
                      src_rows, num_rows, max_rows, cols, dst, lane_order);
  });
}

cudaError_t launch_scatter_bf16(const void* src, ElemType src_type, int64_t src_row_stride, int64_t tokens,
                                const int32_t* dst_rows, int top_k, int64_t cols, uint16_t* dst, bool lane_order,
                                cudaStream_t stream) {
  if (cols % (lane_order ? 64 : 16) != 0 || top_k <= 0 || !dst_rows) return cudaErrorInvalidValue;
  if (tokens == 0) return cudaSuccess;
  const unsigned grid = grid_of(tokens * (cols / 8), 256);
  return with_elem_type(src_type, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    return pdl_launch(scatter_bf16_kernel<T>, grid, 256, 0, stream, static_cast<const T*>(src), src_row_stride,
                      tokens, dst_rows, top_k, cols, dst, lane_order);
  });
}

}  // namespace megamoe::sm90

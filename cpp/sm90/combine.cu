// The weighted combine of the expert rows into each token's output (docs/SPEC.md §3) and its launcher,
// launch_moe_combine (megamoe/sm90_kernels.h). Launched with PDL (cpp/sm90/pdl.cuh): the kernel waits for its
// predecessor before its first global access and releases its dependents right after.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <type_traits>

#include "launch_util.cuh"
#include "megamoe/sm90_kernels.h"
#include "pdl.cuh"

namespace megamoe::sm90 {
namespace {

// Eight partial values of y (fp32 or bf16) at element idx (a multiple of 8): loaded as raw 16-byte words (two for fp32
// rows, one for bf16 rows), then value i as fp32 (bf16 -> fp32 is exact: the bf16 bits in the high half of a word).
template <typename Y>
constexpr int kPartialWords = int(sizeof(Y)) / 2;
__device__ __forceinline__ void load_partial8(const float* y, int64_t idx, uint4 (&u)[2]) {
  u[0] = __ldcs(reinterpret_cast<const uint4*>(y + idx));
  u[1] = __ldcs(reinterpret_cast<const uint4*>(y + idx + 4));
}
__device__ __forceinline__ void load_partial8(const __nv_bfloat16* y, int64_t idx, uint4 (&u)[1]) {
  u[0] = __ldcs(reinterpret_cast<const uint4*>(y + idx));
}
__device__ __forceinline__ uint32_t word_of(const uint4& u, int k) { return k == 0 ? u.x : k == 1 ? u.y : k == 2 ? u.z : u.w; }
__device__ __forceinline__ float partial_value(const uint4 (&u)[2], int i) { return __uint_as_float(word_of(u[i / 4], i % 4)); }
__device__ __forceinline__ float partial_value(const uint4 (&u)[1], int i) {
  const uint32_t w = word_of(u[0], i / 2);
  return __uint_as_float(i % 2 ? w & 0xFFFF0000u : w << 16);
}
// Eight output values at o (16-byte aligned), each rounded once to T (round to nearest even for __half and bf16).
__device__ __forceinline__ void store8(float* o, const float (&v)[8]) {
  reinterpret_cast<float4*>(o)[0] = make_float4(v[0], v[1], v[2], v[3]);
  reinterpret_cast<float4*>(o)[1] = make_float4(v[4], v[5], v[6], v[7]);
}
template <typename T>
__device__ __forceinline__ void store8(T* o, const float (&v)[8]) {
  T t[8];
#pragma unroll
  for (int i = 0; i < 8; ++i) t[i] = T(v[i]);
  *reinterpret_cast<uint4*>(o) = *reinterpret_cast<const uint4*>(t);
}

// One thread per 8 consecutive columns of one token (hidden % 8 == 0: 16-byte loads and stores; the bytes of the k
// partial rows read exactly once); fp32 sum in j order, dropped entries skipped. kBatch slots at a time: their rows
// and weights, then their partial rows, then the products. kBatch = kSlotBatch where the grid is small (a thread then
// waits twice per token instead of twice per slot); 1 for large grids, where the waits are hidden by the other
// threads and the batch's registers (84 instead of about 40 with bf16 rows) cost more than they save
// (launch_moe_combine picks kBatch by the grid's size; above the batched size, bf16 rows go to combine_cols_kernel
// where the hidden size allows). The sums and their order are the same for every kBatch.
template <typename T, typename Y, int kBatch>
__global__ void combine_kernel(const Y* y, const int32_t* entry_row, const float* w, int64_t tokens, int top_k,
                               int64_t hidden, T* out) {
  griddep_sync_and_release();  // no-op unless launched with PDL
  const int64_t octs = hidden / 8, n = tokens * octs;
  for (int64_t idx = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; idx < n; idx += int64_t(gridDim.x) * blockDim.x) {
    const int64_t t = idx / octs, c = (idx - t * octs) * 8;
    float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
    for (int j0 = 0; j0 < top_k; j0 += kBatch) {
      int32_t r[kBatch];
      float wj[kBatch];
#pragma unroll
      for (int u = 0; u < kBatch; ++u) {
        const bool in = j0 + u < top_k;
        r[u] = in ? entry_row[t * top_k + j0 + u] : -1;
        wj[u] = in && r[u] >= 0 ? w[t * top_k + j0 + u] : 0.f;
      }
      uint4 v[kBatch][kPartialWords<Y>];
#pragma unroll
      for (int u = 0; u < kBatch; ++u)
        if (r[u] >= 0) load_partial8(y, int64_t(r[u]) * hidden + c, v[u]);
#pragma unroll
      for (int u = 0; u < kBatch; ++u)
        if (r[u] >= 0) {
#pragma unroll
          for (int i = 0; i < 8; ++i) acc[i] += wj[u] * partial_value(v[u], i);
        }
    }
    store8(out + t * hidden + c, acc);
  }
}

// bf16 rows of a hidden size that is a multiple of 8 * 32 * kCombineCols: each warp sums kCombineCols * 32
// consecutive 16-byte chunks of one token (lane l: chunks l, l + 32, ...), one slot at a time, so that a slot's read
// is kCombineCols coalesced 512-byte runs of its row in flight per warp. The sum of each element is combine_kernel's
// (the same fp32 products, added in j order, dropped entries skipped), so the two give the same bits. 256 threads, at
// most 64 registers (four blocks per SM).
constexpr int kCombineCols = 4;
template <typename T>
__global__ void __launch_bounds__(256, 4)
    combine_cols_kernel(const __nv_bfloat16* y, const int32_t* entry_row, const float* w, int64_t tokens, int top_k,
                        int64_t hidden, T* out) {
  griddep_sync_and_release();  // no-op unless launched with PDL
  constexpr int kSeg = 32 * kCombineCols;  // chunks per warp
  const int64_t segs = hidden / 8 / kSeg, n = tokens * segs;
  const int lane = int(threadIdx.x & 31);
  const int64_t warps = (int64_t(gridDim.x) * blockDim.x) >> 5;
  for (int64_t gw = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) >> 5; gw < n; gw += warps) {
    const int64_t t = gw / segs, c0 = ((gw - t * segs) * kSeg + lane) * 8;
    float acc[kCombineCols][8] = {};
    for (int j = 0; j < top_k; ++j) {
      const int32_t r = entry_row[t * top_k + j];
      if (r < 0) continue;
      const float wj = w[t * top_k + j];
      uint4 v[kCombineCols][1];
#pragma unroll
      for (int c = 0; c < kCombineCols; ++c) load_partial8(y, int64_t(r) * hidden + c0 + c * 256, v[c]);
#pragma unroll
      for (int c = 0; c < kCombineCols; ++c)
#pragma unroll
        for (int i = 0; i < 8; ++i) acc[c][i] += wj * partial_value(v[c], i);
    }
#pragma unroll
    for (int c = 0; c < kCombineCols; ++c) store8(out + t * hidden + c0 + c * 256, acc[c]);
  }
}

}  // namespace

cudaError_t launch_moe_combine(const void* y, bool y_bf16, const int32_t* entry_row, const float* topk_weights,
                               int64_t tokens, int top_k, int64_t hidden, void* out, ElemType out_type,
                               cudaStream_t stream) {
  if (hidden % 8 != 0 || reinterpret_cast<uintptr_t>(y) % 16 != 0 || reinterpret_cast<uintptr_t>(out) % 16 != 0)
    return cudaErrorInvalidValue;
  const int64_t n = tokens * (hidden / 8);
  if (n == 0) return cudaSuccess;
  const unsigned grid = grid_of(n, 256);
  // Batched slots up to kCombineBatchedMax threads (decode and small prefill: latency-bound, each thread's waits
  // are the cost), one slot at a time above (bandwidth-bound: the other threads hide the waits, and the batch's
  // registers would lower occupancy; docs/PERFORMANCE.md, rejected variants), bf16 rows there kCombineCols chunks per
  // thread where the hidden size allows (combine_cols_kernel; bench/combine_rate.cu measures all three).
  constexpr int64_t kCombineBatchedMax = int64_t(1) << 16;
  return with_elem_type(out_type, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    auto launch = [&](auto* ytag, auto batch) {
      using Y = std::remove_pointer_t<decltype(ytag)>;
      return pdl_launch(combine_kernel<T, Y, decltype(batch)::value>, grid, 256, 0, stream, static_cast<const Y*>(y),
                        entry_row, topk_weights, tokens, top_k, hidden, static_cast<T*>(out));
    };
    auto by_batch = [&](auto* ytag) {
      if (n <= kCombineBatchedMax) return launch(ytag, std::integral_constant<int, kSlotBatch>{});
      using Y = std::remove_pointer_t<decltype(ytag)>;
      if (std::is_same_v<Y, __nv_bfloat16> && hidden % (8 * 32 * kCombineCols) == 0)
        return pdl_launch(combine_cols_kernel<T>, grid_of(n / kCombineCols, 256), 256, 0, stream,
                          static_cast<const __nv_bfloat16*>(y), entry_row, topk_weights, tokens, top_k, hidden,
                          static_cast<T*>(out));
      return launch(ytag, std::integral_constant<int, 1>{});
    };
    return y_bf16 ? by_batch(static_cast<__nv_bfloat16*>(nullptr)) : by_batch(static_cast<float*>(nullptr));
  });
}

}  // namespace megamoe::sm90

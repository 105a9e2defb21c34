// The MoE pipeline around the grouped GEMMs (docs/SPEC.md §3): routing results -> grouped
// rows, activation staging, dynamic global scale over the valid rows, weighted combine.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "megamoe/nvfp4_device.cuh"
#include "megamoe/sm90_kernels.h"
#include "decode_route.cuh"
#include "pdl.cuh"

namespace megamoe::sm90 {
namespace {

constexpr int kAlignThreads = 1024;

// The kernels here are launched with PDL (align, stage_bf16, combine; cpp/sm90/pdl.cuh): they wait for their
// predecessor before their first global access and release their dependents right after.
// One block: count per expert, exclusive scan, then place every (token, expert) entry.
// The two passes over the entries load kAlignUnroll ids per thread before their shared-memory
// atomics (the block is alone on its SM: without that ILP each pass is one global-load latency
// per kAlignThreads entries).
constexpr int kAlignUnroll = 8;
// Up to kAlignSmallEntries entries (decode) the rows are placed without atomics, in entry order.
constexpr int kAlignSmallEntries = 256;

template <typename Id>
__device__ __forceinline__ int32_t valid_expert(const Id* ids, int64_t i, int64_t entries, int E) {
  if (i >= entries) return -1;
  const int64_t e = static_cast<int64_t>(ids[i]);
  return e >= 0 && e < E ? int32_t(e) : -1;
}

// Small T: the ids in shared memory; entry i's row = (valid entries of lower experts) + (earlier
// entries of its expert), so the rows of an expert are in entry order (no atomics, three barriers).
template <typename Id>
__device__ __forceinline__ void moe_align_small(const Id* ids, int entries, int top_k, int E, int32_t* expert_offsets,
                                                int32_t* active_experts, int32_t* num_active, int32_t* row_token,
                                                int32_t* entry_row, int32_t* sh) {
  __shared__ int32_t s_id[kAlignSmallEntries];
  __shared__ int32_t s_rank[kAlignSmallEntries];   // earlier entries with the same expert
  __shared__ int32_t s_first[kAlignSmallEntries];  // first entry of its expert (1) or not (0)
  int32_t* offset = sh;  // [E]
  const int tid = threadIdx.x;
  for (int i = tid; i < entries; i += kAlignThreads) s_id[i] = valid_expert(ids, i, entries, E);
  __syncthreads();
  for (int i = tid; i < entries; i += kAlignThreads) {
    const int32_t e = s_id[i];
    int32_t rank = 0;
    for (int j = 0; j < i; ++j) rank += s_id[j] == e ? 1 : 0;
    s_rank[i] = rank;
    s_first[i] = e >= 0 && rank == 0 ? 1 : 0;
  }
  __syncthreads();
  for (int e = tid; e <= E; e += kAlignThreads) {
    int32_t below = 0, act_below = 0, here = 0;
    for (int j = 0; j < entries; ++j) {
      const int32_t id = s_id[j];
      const bool lt = id >= 0 && id < e;
      below += lt ? 1 : 0;
      act_below += lt ? s_first[j] : 0;
      here += id == e ? 1 : 0;
    }
    expert_offsets[e] = below;
    if (e < E) {
      offset[e] = below;
      if (here > 0) active_experts[act_below] = e;
    } else {
      *num_active = act_below;
    }
  }
  __syncthreads();
  for (int i = tid; i < entries; i += kAlignThreads) {
    const int32_t e = s_id[i];
    int32_t row = -1;
    if (e >= 0) {
      row = offset[e] + s_rank[i];
      row_token[row] = int32_t(i / top_k);
    }
    entry_row[i] = row;
  }
}

template <typename Id>
__global__ void __launch_bounds__(kAlignThreads) moe_align_kernel(const Id* ids, int64_t entries, int top_k, int E,
                                                                  int32_t* expert_offsets, int32_t* active_experts,
                                                                  int32_t* num_active, int32_t* row_token,
                                                                  int32_t* entry_row) {
  extern __shared__ int32_t sh[];
  if (entries <= kAlignSmallEntries) {
    griddep_sync_and_release();  // no-op unless launched with PDL
    moe_align_small(ids, int(entries), top_k, E, expert_offsets, active_experts, num_active, row_token, entry_row, sh);
    return;
  }
  int32_t* count = sh;       // [E]
  int32_t* fill = sh + E;    // [E]
  __shared__ int32_t warp_tot[kAlignThreads / 32];
  __shared__ int32_t warp_act[kAlignThreads / 32];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  for (int e = tid; e < E; e += kAlignThreads) count[e] = 0;
  griddep_sync_and_release();  // no-op unless launched with PDL
  __syncthreads();
  for (int64_t base = 0; base < entries; base += int64_t(kAlignThreads) * kAlignUnroll) {
    int32_t e[kAlignUnroll];
#pragma unroll
    for (int u = 0; u < kAlignUnroll; ++u) e[u] = valid_expert(ids, base + u * kAlignThreads + tid, entries, E);
#pragma unroll
    for (int u = 0; u < kAlignUnroll; ++u)
      if (e[u] >= 0) atomicAdd(&count[e[u]], 1);
  }
  __syncthreads();
  // Exclusive scan of counts (and of "has tokens") in chunks of kAlignThreads experts.
  int32_t carry = 0, carry_act = 0;
  for (int base = 0; base < E; base += kAlignThreads) {
    const int e = base + tid;
    const int32_t c = e < E ? count[e] : 0;
    int32_t v = c, act = c > 0 ? 1 : 0;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const int32_t t = __shfl_up_sync(0xffffffffu, v, o);
      const int32_t ta = __shfl_up_sync(0xffffffffu, act, o);
      if (lane >= o) { v += t; act += ta; }
    }
    if (lane == 31) { warp_tot[warp] = v; warp_act[warp] = act; }
    __syncthreads();
    int32_t pre = carry, pre_a = carry_act, tot = carry, tot_a = carry_act;
    for (int w = 0; w < kAlignThreads / 32; ++w) {
      if (w < warp) { pre += warp_tot[w]; pre_a += warp_act[w]; }
      tot += warp_tot[w];
      tot_a += warp_act[w];
    }
    if (e < E) {
      const int32_t excl = pre + v - c;
      expert_offsets[e] = excl;
      fill[e] = excl;
      if (c > 0) active_experts[pre_a + act - 1] = e;
    }
    carry = tot;
    carry_act = tot_a;
    __syncthreads();
  }
  if (tid == 0) {
    expert_offsets[E] = carry;
    *num_active = carry_act;
  }
  __syncthreads();
  for (int64_t base = 0; base < entries; base += int64_t(kAlignThreads) * kAlignUnroll) {
    int32_t e[kAlignUnroll];
#pragma unroll
    for (int u = 0; u < kAlignUnroll; ++u) e[u] = valid_expert(ids, base + u * kAlignThreads + tid, entries, E);
#pragma unroll
    for (int u = 0; u < kAlignUnroll; ++u) {
      const int64_t i = base + u * kAlignThreads + tid;
      if (i >= entries) break;
      int32_t row = -1;
      if (e[u] >= 0) {
        row = atomicAdd(&fill[e[u]], 1);
        row_token[row] = int32_t(i / top_k);
      }
      entry_row[i] = row;
    }
  }
}

// One thread per 8-element group: gather, convert, store in operand order.
template <typename T>
__global__ void stage_bf16_kernel(const T* src, int64_t stride, const int32_t* src_rows, const int32_t* num_rows,
                                  int64_t max_rows, int64_t cols, uint16_t* dst) {
  griddep_sync_and_release();  // no-op unless launched with PDL
  const int64_t groups = cols / 8;
  const int64_t rows = num_rows ? *num_rows : max_rows;
  for (int64_t idx = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; idx < rows * groups;
       idx += int64_t(gridDim.x) * blockDim.x) {
    const int64_t r = idx / groups, gi = idx - r * groups;
    const int64_t sr = src_rows ? src_rows[r] : r;
    const T* p = src + sr * stride + gi * 8;
    float x[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) x[i] = static_cast<float>(p[i]);  // exact for float, __half, bf16
    uint32_t w[4];
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      __nv_bfloat162 b = __floats2bfloat162_rn(x[operand_order(2 * q)], x[operand_order(2 * q + 1)]);
      w[q] = *reinterpret_cast<uint32_t*>(&b);
    }
    *reinterpret_cast<uint4*>(dst + r * cols + gi * 8) = make_uint4(w[0], w[1], w[2], w[3]);
  }
}

// Weighted combine, out[t, c] = sum_j w[t, j] * y[row(t, j), c]: one thread per kCols consecutive
// columns of one token (16-byte loads of y: 4 fp32 or 8 bf16 columns, so the bytes of the k partial
// rows are read exactly once), fp32 sum in j order, dropped entries skipped. kRouted: row(t, j) from
// topk_ids (decode_route.cuh numbering, computed once per block into shared memory), else entry_row.
struct CombineArgs {
  const void* y;
  const int32_t* entry_row;
  const void* ids;
  bool ids64;
  int num_experts;
  const float* w;
  int64_t tokens;
  int top_k;
  int64_t hidden;
};

template <typename T, bool kYbf16, bool kRouted>
__global__ void combine_kernel(CombineArgs c, T* out) {
  constexpr int kCols = kYbf16 ? 8 : 4;
  __shared__ int32_t s_row[kRouted ? kRouteMaxEntries : 1];
  griddep_sync_and_release();  // no-op unless launched with PDL
  const int64_t entries = c.tokens * c.top_k;
  if constexpr (kRouted) {
    if (threadIdx.x < 32) {
      const int lane = threadIdx.x;
      const LaneRoute r = lane_route(route_id(c.ids, c.ids64, lane, int(entries), c.num_experts), lane);
      if (lane < entries) s_row[lane] = r.e >= 0 ? lane_row(r, lane) : -1;
    }
    __syncthreads();
  }
  const int64_t groups = c.hidden / kCols, n = c.tokens * groups;
  for (int64_t idx = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; idx < n; idx += int64_t(gridDim.x) * blockDim.x) {
    const int64_t t = idx / groups, col = (idx - t * groups) * kCols;
    float acc[kCols];
#pragma unroll
    for (int q = 0; q < kCols; ++q) acc[q] = 0.f;
    for (int j = 0; j < c.top_k; ++j) {
      const int32_t r = kRouted ? s_row[t * c.top_k + j] : c.entry_row[t * c.top_k + j];
      if (r < 0) continue;
      const float wj = c.w[t * c.top_k + j];
      if constexpr (kYbf16) {
        const uint4 v = __ldcs(reinterpret_cast<const uint4*>(static_cast<const uint16_t*>(c.y) + int64_t(r) * c.hidden + col));
        const uint32_t u[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
        for (int q = 0; q < 4; ++q) {
          acc[2 * q] += wj * __uint_as_float(u[q] << 16);  // bf16 -> fp32 is exact
          acc[2 * q + 1] += wj * __uint_as_float(u[q] & 0xFFFF0000u);
        }
      } else {
        const float4 v = __ldcs(reinterpret_cast<const float4*>(static_cast<const float*>(c.y) + int64_t(r) * c.hidden + col));
        acc[0] += wj * v.x;
        acc[1] += wj * v.y;
        acc[2] += wj * v.z;
        acc[3] += wj * v.w;
      }
    }
    T* o = out + t * c.hidden + col;  // T(float): round to nearest even for __half and bf16
#pragma unroll
    for (int q = 0; q < kCols; ++q) o[q] = T(acc[q]);
  }
}

unsigned grid_of(int64_t n, int threads, unsigned cap = 65535u * 4) {
  int64_t b = (n + threads - 1) / threads;
  if (b < 1) b = 1;
  return unsigned(b > cap ? cap : b);
}

}  // namespace

cudaError_t launch_moe_align(const void* topk_ids, bool ids_int64, int64_t tokens, int top_k, int num_experts,
                             int32_t* expert_offsets, int32_t* active_experts, int32_t* num_active,
                             int32_t* row_token, int32_t* entry_row, cudaStream_t stream) {
  if (num_experts <= 0 || top_k <= 0) return cudaErrorInvalidValue;
  const size_t smem = sizeof(int32_t) * 2 * size_t(num_experts);
  const int64_t entries = tokens * top_k;
  if (ids_int64)
    return pdl_launch(moe_align_kernel<int64_t>, 1, kAlignThreads, smem, stream,
                      static_cast<const int64_t*>(topk_ids), entries, top_k, num_experts, expert_offsets,
                      active_experts, num_active, row_token, entry_row);
  return pdl_launch(moe_align_kernel<int32_t>, 1, kAlignThreads, smem, stream,
                    static_cast<const int32_t*>(topk_ids), entries, top_k, num_experts, expert_offsets,
                    active_experts, num_active, row_token, entry_row);
}

cudaError_t launch_stage_bf16(const void* src, ElemType src_type, int64_t src_row_stride, const int32_t* src_rows,
                              const int32_t* num_rows, int64_t max_rows, int64_t cols, uint16_t* dst,
                              cudaStream_t stream) {
  if (cols % 16 != 0) return cudaErrorInvalidValue;
  if (max_rows == 0) return cudaSuccess;
  const unsigned grid = grid_of(max_rows * (cols / 8), 256);
  switch (src_type) {
    case ElemType::kFloat32:
      return pdl_launch(stage_bf16_kernel<float>, grid, 256, 0, stream, static_cast<const float*>(src),
                        src_row_stride, src_rows, num_rows, max_rows, cols, dst);
    case ElemType::kFloat16:
      return pdl_launch(stage_bf16_kernel<__half>, grid, 256, 0, stream, static_cast<const __half*>(src),
                        src_row_stride, src_rows, num_rows, max_rows, cols, dst);
    case ElemType::kBFloat16:
      return pdl_launch(stage_bf16_kernel<__nv_bfloat16>, grid, 256, 0, stream,
                        static_cast<const __nv_bfloat16*>(src), src_row_stride, src_rows, num_rows, max_rows, cols,
                        dst);
  }
  return cudaErrorInvalidValue;
}

template <bool kYbf16, bool kRouted>
cudaError_t launch_combine(const CombineArgs& c, void* out, ElemType out_type, cudaStream_t stream) {
  const int64_t n = c.tokens * (c.hidden / (kYbf16 ? 8 : 4));
  if (n == 0) return cudaSuccess;
  const unsigned grid = grid_of(n, 256);
  switch (out_type) {
    case ElemType::kFloat32:
      return pdl_launch(combine_kernel<float, kYbf16, kRouted>, grid, 256, 0, stream, c, static_cast<float*>(out));
    case ElemType::kFloat16:
      return pdl_launch(combine_kernel<__half, kYbf16, kRouted>, grid, 256, 0, stream, c, static_cast<__half*>(out));
    case ElemType::kBFloat16:
      return pdl_launch(combine_kernel<__nv_bfloat16, kYbf16, kRouted>, grid, 256, 0, stream, c,
                        static_cast<__nv_bfloat16*>(out));
  }
  return cudaErrorInvalidValue;
}

cudaError_t launch_moe_combine(const void* y, bool y_bf16, const int32_t* entry_row, const float* topk_weights,
                               int64_t tokens, int top_k, int64_t hidden, void* out, ElemType out_type,
                               cudaStream_t stream) {
  if (hidden % (y_bf16 ? 8 : 4) != 0 || !entry_row) return cudaErrorInvalidValue;
  const CombineArgs c{y, entry_row, nullptr, false, 0, topk_weights, tokens, top_k, hidden};
  return y_bf16 ? launch_combine<true, false>(c, out, out_type, stream)
                : launch_combine<false, false>(c, out, out_type, stream);
}

cudaError_t launch_moe_combine_routed(const void* y, bool y_bf16, const void* topk_ids, bool ids_int64, int num_experts,
                                      const float* topk_weights, int64_t tokens, int top_k, int64_t hidden, void* out,
                                      ElemType out_type, cudaStream_t stream) {
  if (hidden % (y_bf16 ? 8 : 4) != 0 || !topk_ids || tokens * top_k > kRouteMaxEntries) return cudaErrorInvalidValue;
  const CombineArgs c{y, nullptr, topk_ids, ids_int64, num_experts, topk_weights, tokens, top_k, hidden};
  return y_bf16 ? launch_combine<true, true>(c, out, out_type, stream)
                : launch_combine<false, true>(c, out, out_type, stream);
}

}  // namespace megamoe::sm90

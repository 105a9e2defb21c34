// The MoE pipeline around the grouped GEMMs (docs/SPEC.md §3): routing results -> grouped
// rows, activation staging, dynamic global scale over the valid rows, weighted combine.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <type_traits>

#include "megamoe/nvfp4_device.cuh"
#include "megamoe/sm90_kernels.h"
#include "pdl.cuh"

namespace megamoe::sm90 {
namespace {

constexpr int kAlignThreads = 1024;

// The kernels here are launched with PDL (align, stage_bf16, combine; cpp/sm90/pdl.cuh): they wait for their
// predecessor before their first global access and release their dependents right after.
// Align: count per expert, exclusive scan, then place every (token, expert) entry. Up to
// kAlignSmallEntries entries (decode) one block places them without atomics, in entry order; up to
// kAlignMultiFrom one block counts and places with shared-memory atomics; above, kAlignChunk
// entries per block in two kernels (count; then scan of all blocks' counts and place), because one
// block's loop is latency-bound at ~2 ns per entry. The loops load kAlignUnroll ids per thread
// before their atomics. The order of rows inside an expert is not fixed (results do not depend on it).
constexpr int kAlignUnroll = 4;
constexpr int kAlignSmallEntries = 256;
static_assert(kAlignChunk == kAlignThreads * kAlignUnroll, "one chunk = one pass of the block's loads");
constexpr int64_t kAlignMultiFrom = 2 * kAlignChunk;

template <typename Id>
__device__ __forceinline__ int32_t valid_expert(const Id* ids, int64_t i, int64_t entries, int E) {
  if (i >= entries) return -1;
  const int64_t e = static_cast<int64_t>(ids[i]);
  return e >= 0 && e < E ? int32_t(e) : -1;
}

// count[e] += entries of expert e in [begin, end) (shared-memory atomics).
template <typename Id>
__device__ __forceinline__ void align_count(const Id* ids, int64_t begin, int64_t end, int E, int32_t* count) {
  for (int64_t base = begin; base < end; base += kAlignChunk) {
    int32_t e[kAlignUnroll];
#pragma unroll
    for (int u = 0; u < kAlignUnroll; ++u) e[u] = valid_expert(ids, base + u * kAlignThreads + threadIdx.x, end, E);
#pragma unroll
    for (int u = 0; u < kAlignUnroll; ++u)
      if (e[u] >= 0) atomicAdd(&count[e[u]], 1);
  }
}

// Rows of the entries in [begin, end): row = atomicAdd(fill[e]); row_token[row] = token, entry_row[i] = row.
template <typename Id>
__device__ __forceinline__ void align_place(const Id* ids, int64_t begin, int64_t end, int top_k, int E, int32_t* fill,
                                            int32_t* row_token, int32_t* entry_row) {
  for (int64_t base = begin; base < end; base += kAlignChunk) {
    int32_t e[kAlignUnroll];
#pragma unroll
    for (int u = 0; u < kAlignUnroll; ++u) e[u] = valid_expert(ids, base + u * kAlignThreads + threadIdx.x, end, E);
#pragma unroll
    for (int u = 0; u < kAlignUnroll; ++u) {
      const int64_t i = base + u * kAlignThreads + threadIdx.x;
      if (i >= end) break;
      int32_t row = -1;
      if (e[u] >= 0) {
        row = atomicAdd(&fill[e[u]], 1);
        row_token[row] = int32_t(i) / top_k;  // rows are int32: 32-bit division
      }
      entry_row[i] = row;
    }
  }
}

// Block-wide exclusive scan of count[0..E) (and of "has tokens"): fill[e] += prefix(e); with write_meta
// also expert_offsets[0..E], active_experts and num_active. Call with all kAlignThreads threads. Per 1024 experts:
// a scan by shuffles inside each warp, then warp 0 scans the 32 warp totals the same way (kAlignThreads = 32 * 32).
__device__ __forceinline__ void align_scan(const int32_t* count, int32_t* fill, int E, bool write_meta,
                                           int32_t* expert_offsets, int32_t* active_experts, int32_t* num_active) {
  static_assert(kAlignThreads == 32 * 32, "one warp scans the warp totals");
  __shared__ int32_t warp_pre[kAlignThreads / 32];  // exclusive prefix of the warp totals
  __shared__ int32_t warp_pre_act[kAlignThreads / 32];
  __shared__ int32_t block_tot[2];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
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
    if (lane == 31) { warp_pre[warp] = v; warp_pre_act[warp] = act; }
    __syncthreads();
    if (warp == 0) {
      const int32_t wt = warp_pre[lane], wa = warp_pre_act[lane];
      int32_t s = wt, sa = wa;
#pragma unroll
      for (int o = 1; o < 32; o <<= 1) {
        const int32_t t = __shfl_up_sync(0xffffffffu, s, o);
        const int32_t ta = __shfl_up_sync(0xffffffffu, sa, o);
        if (lane >= o) { s += t; sa += ta; }
      }
      warp_pre[lane] = s - wt;
      warp_pre_act[lane] = sa - wa;
      if (lane == 31) { block_tot[0] = s; block_tot[1] = sa; }
    }
    __syncthreads();
    const int32_t pre = carry + warp_pre[warp], pre_a = carry_act + warp_pre_act[warp];
    if (e < E) {
      const int32_t excl = pre + v - c;
      fill[e] += excl;
      if (write_meta) {
        expert_offsets[e] = excl;
        if (c > 0) active_experts[pre_a + act - 1] = e;
      }
    }
    carry += block_tot[0];
    carry_act += block_tot[1];
    __syncthreads();
  }
  if (write_meta && tid == 0) {
    expert_offsets[E] = carry;
    *num_active = carry_act;
  }
}

// Small T (up to kAlignSmallEntries entries, thread i holding entry i): entry i's row = (valid entries of lower
// experts) + (earlier entries of its expert), so the rows of an expert are in entry order. The warps holding entries
// take their turn in order: each finds its lanes of equal expert (match.any), and the first lane of each group adds the
// group's size to its expert's count, whose value before is the rank of the group's first entry (the block barrier
// after each warp makes the counts a prefix in entry order: no atomics). Then the counts are scanned (align_scan).
template <typename Id>
__device__ __forceinline__ void moe_align_small(const Id* ids, int entries, int top_k, int E, int32_t* expert_offsets,
                                                int32_t* active_experts, int32_t* num_active, int32_t* row_token,
                                                int32_t* entry_row, int32_t* sh) {
  static_assert(kAlignSmallEntries <= kAlignThreads, "one entry per thread");
  int32_t* count = sh;     // [E]
  int32_t* fill = sh + E;  // [E]
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  for (int e = tid; e < E; e += kAlignThreads) count[e] = fill[e] = 0;
  const int32_t e = valid_expert(ids, tid, entries, E);  // -1 past the entries
  __syncthreads();
  int32_t rank = 0;
  for (int w = 0; w * 32 < entries; ++w) {
    if (warp == w) {
      const unsigned same = __match_any_sync(0xffffffffu, e);
      const int first = __ffs(same) - 1;
      int32_t before = 0;
      if (lane == first && e >= 0) {
        before = count[e];
        count[e] = before + __popc(same);
      }
      rank = __shfl_sync(0xffffffffu, before, first) + __popc(same & ((1u << lane) - 1u));
    }
    __syncthreads();
  }
  align_scan(count, fill, E, true, expert_offsets, active_experts, num_active);
  __syncthreads();
  if (tid < entries) {
    int32_t row = -1;
    if (e >= 0) {
      row = fill[e] + rank;
      row_token[row] = int32_t(tid / top_k);
    }
    entry_row[tid] = row;
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
  for (int e = threadIdx.x; e < E; e += kAlignThreads) count[e] = fill[e] = 0;
  griddep_sync_and_release();  // no-op unless launched with PDL
  __syncthreads();
  align_count(ids, 0, entries, E, count);
  __syncthreads();
  align_scan(count, fill, E, true, expert_offsets, active_experts, num_active);
  __syncthreads();
  align_place(ids, 0, entries, top_k, E, fill, row_token, entry_row);
}

// Multi-block align, step 1: block b counts the experts of entries [b*kAlignChunk, +kAlignChunk) into
// block_counts[b*E .. b*E + E).
template <typename Id>
__global__ void __launch_bounds__(kAlignThreads) moe_align_count_kernel(const Id* ids, int64_t entries, int E,
                                                                        int32_t* block_counts) {
  extern __shared__ int32_t count[];  // [E]
  for (int e = threadIdx.x; e < E; e += kAlignThreads) count[e] = 0;
  griddep_sync_and_release();
  __syncthreads();
  const int64_t begin = int64_t(blockIdx.x) * kAlignChunk;
  align_count(ids, begin, begin + kAlignChunk < entries ? begin + kAlignChunk : entries, E, count);
  __syncthreads();
  for (int e = threadIdx.x; e < E; e += kAlignThreads) block_counts[int64_t(blockIdx.x) * E + e] = count[e];
}

// Step 2 (same grid): every block adds up all blocks' counts (totals, and the counts of the blocks before
// it: its first row in each expert), scans the totals (block 0 writes expert_offsets, active_experts,
// num_active) and places its own entries.
template <typename Id>
__global__ void __launch_bounds__(kAlignThreads) moe_align_place_kernel(const Id* ids, int64_t entries, int top_k,
                                                                        int E, const int32_t* block_counts,
                                                                        int32_t* expert_offsets,
                                                                        int32_t* active_experts, int32_t* num_active,
                                                                        int32_t* row_token, int32_t* entry_row) {
  extern __shared__ int32_t sh[];
  int32_t* total = sh;     // [E]
  int32_t* fill = sh + E;  // [E]
  griddep_sync_and_release();
  const int b = int(blockIdx.x), nb = int(gridDim.x);
  for (int e = threadIdx.x; e < E; e += kAlignThreads) {
    int32_t tot = 0, before = 0;
    for (int q = 0; q < nb; ++q) {
      const int32_t c = block_counts[int64_t(q) * E + e];
      tot += c;
      before += q < b ? c : 0;
    }
    total[e] = tot;
    fill[e] = before;
  }
  __syncthreads();
  align_scan(total, fill, E, b == 0, expert_offsets, active_experts, num_active);
  __syncthreads();
  const int64_t begin = int64_t(b) * kAlignChunk;
  align_place(ids, begin, begin + kAlignChunk < entries ? begin + kAlignChunk : entries, top_k, E, fill, row_token,
              entry_row);
}

// The converted 16-byte chunk c of a source row (the order: see stage_bf16_kernel below).
template <typename T>
__device__ __forceinline__ uint4 bf16_chunk(const T* row, int64_t c, bool lane_order) {
  const int v = int(c & 7);
  const int64_t first = lane_order ? (c >> 3) * 64 + 8 * (v >> 2) + (v & 3) : c * 8;
  const int step = lane_order ? 16 : 1;  // elements between the pairs' first elements
  const T* p = row + first;
  uint32_t w[4];
#pragma unroll
  for (int t = 0; t < 4; ++t) {
    __nv_bfloat162 b = __floats2bfloat162_rn(static_cast<float>(p[step * t]), static_cast<float>(p[step * t + 4]));
    w[t] = *reinterpret_cast<uint32_t*>(&b);  // to float exact; one rounding to bf16 (none for bf16 sources)
  }
  return make_uint4(w[0], w[1], w[2], w[3]);
}

// One thread per 16-byte output chunk c of a row (4 bf16 pairs): gather, convert, store. Operand order:
// chunk c is 8-element group c, pair q = elements (q, q + 4) of it. Lane order: chunk v = c % 8 of
// 64-element block c / 8 holds the operand pairs v, 8 + v, 16 + v, 24 + v, i.e. elements
// (16t + 8(v / 4) + v % 4, + 4) of the block for pair t.
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

// A token's slot entries (rows of entry_row / dst_rows, routing weights) are read up to kSlotBatch at a time, all
// before the first store or product that uses them, so that a thread waits for them once per batch, not once per
// slot (the loop over j, with a store or a dependent load in each step, had the compiler issue one slot at a time).
constexpr int kSlotBatch = 8;

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
// (launch_moe_combine picks kBatch by the grid's size).
// The sums and their order are the same for every kBatch.
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

// f(static_cast<C*>(nullptr)) for the C type of t (float, __half, __nv_bfloat16).
template <typename F>
cudaError_t with_elem_type(ElemType t, F&& f) {
  switch (t) {
    case ElemType::kFloat32: return f(static_cast<float*>(nullptr));
    case ElemType::kFloat16: return f(static_cast<__half*>(nullptr));
    case ElemType::kBFloat16: return f(static_cast<__nv_bfloat16*>(nullptr));
  }
  return cudaErrorInvalidValue;
}

unsigned grid_of(int64_t n, int threads, unsigned cap = 65535u * 4) {
  int64_t b = (n + threads - 1) / threads;
  if (b < 1) b = 1;
  return unsigned(b > cap ? cap : b);
}

}  // namespace

namespace {

// One or, above kAlignMultiFrom entries with enough scratch, two multi-block kernels (count; place).
template <typename Id>
cudaError_t launch_align_ids(const Id* ids, int64_t entries, int top_k, int num_experts, int32_t* expert_offsets,
                             int32_t* active_experts, int32_t* num_active, int32_t* row_token, int32_t* entry_row,
                             int32_t* scratch, int64_t scratch_size, cudaStream_t stream) {
  const size_t smem = sizeof(int32_t) * 2 * size_t(num_experts);
  if (scratch && entries > kAlignMultiFrom && scratch_size >= align_scratch_size(entries, num_experts)) {
    const unsigned nb = unsigned((entries + kAlignChunk - 1) / kAlignChunk);
    const size_t csmem = sizeof(int32_t) * size_t(num_experts);
    const cudaError_t err =
        pdl_launch(moe_align_count_kernel<Id>, nb, kAlignThreads, csmem, stream, ids, entries, num_experts, scratch);
    if (err != cudaSuccess) return err;
    return pdl_launch(moe_align_place_kernel<Id>, nb, kAlignThreads, smem, stream, ids, entries, top_k, num_experts,
                      static_cast<const int32_t*>(scratch), expert_offsets, active_experts, num_active, row_token,
                      entry_row);
  }
  return pdl_launch(moe_align_kernel<Id>, 1, kAlignThreads, smem, stream, ids, entries, top_k, num_experts,
                    expert_offsets, active_experts, num_active, row_token, entry_row);
}

}  // namespace

cudaError_t launch_moe_align(const void* topk_ids, bool ids_int64, int64_t tokens, int top_k, int num_experts,
                             int32_t* expert_offsets, int32_t* active_experts, int32_t* num_active,
                             int32_t* row_token, int32_t* entry_row, int32_t* scratch, int64_t scratch_size,
                             cudaStream_t stream) {
  if (num_experts <= 0 || top_k <= 0) return cudaErrorInvalidValue;
  const int64_t entries = tokens * top_k;
  if (ids_int64)
    return launch_align_ids(static_cast<const int64_t*>(topk_ids), entries, top_k, num_experts, expert_offsets,
                            active_experts, num_active, row_token, entry_row, scratch, scratch_size, stream);
  return launch_align_ids(static_cast<const int32_t*>(topk_ids), entries, top_k, num_experts, expert_offsets,
                          active_experts, num_active, row_token, entry_row, scratch, scratch_size, stream);
}

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
  // registers would lower occupancy; docs/PERFORMANCE.md, rejected variants).
  constexpr int64_t kCombineBatchedMax = int64_t(1) << 16;
  return with_elem_type(out_type, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    auto launch = [&](auto* ytag, auto batch) {
      using Y = std::remove_pointer_t<decltype(ytag)>;
      return pdl_launch(combine_kernel<T, Y, decltype(batch)::value>, grid, 256, 0, stream, static_cast<const Y*>(y),
                        entry_row, topk_weights, tokens, top_k, hidden, static_cast<T*>(out));
    };
    auto by_batch = [&](auto* ytag) {
      return n <= kCombineBatchedMax ? launch(ytag, std::integral_constant<int, kSlotBatch>{})
                                     : launch(ytag, std::integral_constant<int, 1>{});
    };
    return y_bf16 ? by_batch(static_cast<__nv_bfloat16*>(nullptr)) : by_batch(static_cast<float*>(nullptr));
  });
}

}  // namespace megamoe::sm90

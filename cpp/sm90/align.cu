// Routing results -> grouped rows (docs/SPEC.md §3): the align kernels (one block, or two multi-block kernels)
// and their launcher, launch_moe_align (megamoe/sm90_kernels.h).
#include <cstdint>

#include "megamoe/sm90_kernels.h"
#include "pdl.cuh"

namespace megamoe::sm90 {
namespace {

constexpr int kAlignThreads = 1024;

// The align kernels are launched with PDL (cpp/sm90/pdl.cuh): they wait for their
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

}  // namespace megamoe::sm90

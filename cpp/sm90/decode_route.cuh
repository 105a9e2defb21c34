// Routing of a decode batch computed inside the kernels that need it, from topk_ids, instead of a
// moe_align launch (one kernel and one dependent step fewer at T = 1..4): up to kRouteMaxEntries
// (T*k) entries, one warp, one entry per lane. The grouped rows are numbered as moe_align's small
// path numbers them: entry i of expert e is row (valid entries of lower experts) + (earlier
// entries of e), and the experts with tokens take the slots in ascending order, so every kernel of
// the forward (L1, L2, combine) derives the same rows.
#pragma once
#include <cstdint>

#include "megamoe/sm90_kernels.h"

namespace megamoe::sm90 {

// Entry i of topk_ids as an expert in [0, E), or -1 (dropped id, or i >= entries). Loads through L2
// (ld.global.cg): the L2 GEMM reads the ids before its PDL wait (pdl.cuh rule 3).
__device__ __forceinline__ int32_t route_id(const void* ids, bool ids64, int i, int entries, int E) {
  if (i >= entries) return -1;
  const long long v = ids64 ? __ldcg(static_cast<const long long*>(ids) + i)
                            : static_cast<long long>(__ldcg(static_cast<const int*>(ids) + i));
  return v >= 0 && v < E ? int32_t(v) : -1;
}

// One lane's view of the routing (call with the whole warp; lane i holds entry i).
struct LaneRoute {
  int32_t e;       // this entry's expert, -1 if none
  uint32_t same;   // lanes whose entry has the same expert (including this one)
  int32_t below;   // valid entries with a lower expert: the expert's first grouped row
  int32_t slot;    // number of experts with tokens below e: the expert's slot (valid for its first entry)
  bool first;      // lowest lane of its expert
};

__device__ __forceinline__ LaneRoute lane_route(int32_t e, int lane) {
  LaneRoute r;
  r.e = e;
  r.same = __match_any_sync(0xffffffffu, e);
  r.first = e >= 0 && (__ffs(r.same) - 1) == lane;
  const uint32_t firsts = __ballot_sync(0xffffffffu, r.first);
  int32_t below = 0, slot = 0;
#pragma unroll 4
  for (int j = 0; j < 32; ++j) {
    const int32_t ej = __shfl_sync(0xffffffffu, e, j);
    const bool lower = ej >= 0 && ej < e;
    below += lower ? 1 : 0;
    slot += lower && ((firsts >> j) & 1u) ? 1 : 0;
  }
  r.below = below;
  r.slot = slot;
  return r;
}

// Grouped row of this lane's (valid) entry.
__device__ __forceinline__ int32_t lane_row(const LaneRoute& r, int lane) {
  return r.below + __popc(r.same & ((1u << lane) - 1u));
}

// Expert slot `slot` of the batch, by warp 0 of a block: out[0] = expert, out[1] = its first grouped
// row, out[2] = its rows (0: no expert in this slot), out[3 + q] = token of its row q (q < rows).
__device__ __forceinline__ void route_slot(const void* ids, bool ids64, int entries, int top_k, int E, int slot,
                                           int32_t* out) {
  const int lane = threadIdx.x & 31;
  const LaneRoute r = lane_route(route_id(ids, ids64, lane, entries, E), lane);
  const uint32_t m = __ballot_sync(0xffffffffu, r.first && r.slot == slot);
  if (m == 0) {
    if (lane == 0) out[2] = 0;
    return;
  }
  const int src = __ffs(m) - 1;
  const uint32_t same = __shfl_sync(0xffffffffu, r.same, src);
  const int32_t expert = __shfl_sync(0xffffffffu, r.e, src), first_row = __shfl_sync(0xffffffffu, r.below, src);
  const int rows = __popc(same);
  if (lane == 0) {
    out[0] = expert;
    out[1] = first_row;
    out[2] = rows;
  }
  if (lane < rows) out[3 + lane] = int32_t(__fns(same, 0, lane + 1)) / top_k;  // entries of the expert, ascending
}

}  // namespace megamoe::sm90

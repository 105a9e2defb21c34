// Row offsets -> owner, shared by the quantize and scale-factor kernels.
#pragma once
#include <cstdint>

namespace megamoe {

// The last i in [0, n) with offsets[i] <= v, for nondecreasing offsets (the expert owning input row
// v of expert_offsets, or the group owning a row of dst_row_offsets); 0 when none is.
__device__ __forceinline__ int last_offset_at_or_below(const int32_t* offsets, int n, int64_t v) {
  int lo = 0, hi = n - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) >> 1;
    if (offsets[mid] <= v) lo = mid;
    else hi = mid - 1;
  }
  return lo;
}

}  // namespace megamoe

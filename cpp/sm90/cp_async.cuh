// cp.async (sm_80+) global -> shared copies with zero fill (their completion is tracked with mbarriers:
// gemm_wgmma.cuh).
#pragma once
#include <cstdint>

namespace megamoe::sm90 {

// cp.async of kBytes (16, 8 or 4) to a shared-memory address (__cvta_generic_to_shared); only the
// first bytes_valid are read, the rest zero-filled.
template <int kBytes>
__device__ __forceinline__ void cp_async_s(uint32_t smem, const void* gmem, int bytes_valid) {
  if constexpr (kBytes == 16)
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(smem), "l"(gmem), "r"(bytes_valid));
  else if constexpr (kBytes == 8)
    asm volatile("cp.async.ca.shared.global [%0], [%1], 8, %2;" ::"r"(smem), "l"(gmem), "r"(bytes_valid));
  else
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;" ::"r"(smem), "l"(gmem), "r"(bytes_valid));
}

}  // namespace megamoe::sm90

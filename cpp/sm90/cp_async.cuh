// cp.async (sm_80+) global -> shared copies with zero fill, and their group commit / wait.
#pragma once
#include <cstdint>

namespace megamoe::sm90 {

// Copies `size` (16, 8 or 4) bytes; only the first bytes_valid are read, the rest are zero-filled.
__device__ __forceinline__ void cp_async(void* smem, const void* gmem, int bytes_valid, int size) {
  const uint32_t s = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  if (size == 16)
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(s), "l"(gmem), "r"(bytes_valid));
  else if (size == 8)
    asm volatile("cp.async.ca.shared.global [%0], [%1], 8, %2;" ::"r"(s), "l"(gmem), "r"(bytes_valid));
  else
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;" ::"r"(s), "l"(gmem), "r"(bytes_valid));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;" ::"n"(N)); }

}  // namespace megamoe::sm90

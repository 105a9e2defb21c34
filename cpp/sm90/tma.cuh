// Tensor memory accelerator (TMA, sm_90) copies global -> shared for the wgmma GEMMs: tensor maps
// encoded on the host (cuTensorMapEncodeTiled through the runtime's driver entry point, so nothing
// links libcuda), passed to the kernel as __grid_constant__ parameters; one thread issues a copy of a
// whole box, whose bytes complete a transaction count on an mbarrier (gemm_wgmma.cuh).
//
// Swizzled boxes: the 32/64/128-byte swizzles permute the 16-byte chunks of every shared-memory row
// by address bits (128 B: chunk bits 4..6 ^= bits 7..9; 64 B: bits 4..5 ^= bits 7..8; 32 B: bit 4 ^=
// bit 7), so a box written at a 1024-byte aligned address has a fixed, known layout (the wgmma SW128
// descriptor reads the same function of the address).
#pragma once
#include <cuda.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace megamoe::sm90 {

// ---- device side ----

__device__ __forceinline__ void mbar_fence_init() { asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory"); }

// One arrival on bar that also expects `bytes` more transaction bytes in the current phase.
__device__ __forceinline__ void mbar_arrive_expect_tx(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes) : "memory");
}

// Box of `map` at coordinates (c0 innermost, c1, c2) into shared address dst; completes its bytes on bar.
__device__ __forceinline__ void tma_load_3d(uint32_t dst, const CUtensorMap* map, int c0, int c1, int c2,
                                            uint32_t bar) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4}], "
      "[%5];" ::"r"(dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(c2), "r"(bar)
      : "memory");
}
// The same for a 5-D map (the tiled weights: {bytes of a chunk, rows of a group, chunk, group, expert}).
__device__ __forceinline__ void tma_load_5d(uint32_t dst, const CUtensorMap* map, int c0, int c1, int c2, int c3,
                                            int c4, uint32_t bar) {
  asm volatile(
      "cp.async.bulk.tensor.5d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4, %5, "
      "%6}], [%7];" ::"r"(dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(c4), "r"(bar)
      : "memory");
}
__device__ __forceinline__ void tma_prefetch_map(const CUtensorMap* map) {
  asm volatile("prefetch.tensormap [%0];" ::"l"(reinterpret_cast<uint64_t>(map)) : "memory");
}

// ---- host side ----

// cuTensorMapEncodeTiled of a tensor of `rank` dims (dims[0] innermost, contiguous; strides in bytes of
// dims 1..rank-1) with boxes `box` (elements), zero fill outside the tensor. Host only, no GPU work.
// cudaErrorInvalidValue when the driver refuses the shape (alignment, strides, box limits).
cudaError_t encode_tensor_map(CUtensorMap* map, CUtensorMapDataType type, int rank, const void* base,
                              const uint64_t* dims, const uint64_t* strides, const uint32_t* box,
                              CUtensorMapSwizzle swizzle);

}  // namespace megamoe::sm90

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
// The same box multicast to the CTAs of the cluster in `mask` (bit r: CTA rank r): it lands at shared offset dst of
// each of them and completes its bytes on the mbarrier at offset bar of each.
__device__ __forceinline__ void tma_load_3d_multicast(uint32_t dst, const CUtensorMap* map, int c0, int c1, int c2,
                                                      uint32_t bar, uint16_t mask) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes.multicast::cluster [%0], [%1, "
      "{%2, %3, %4}], [%5], %6;" ::"r"(dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(c2), "r"(bar), "h"(mask)
      : "memory");
}

// Thread block clusters: this CTA's rank in its cluster; a barrier of all threads of all CTAs of the cluster (release
// and acquire: what each CTA wrote to shared memory before it, mbarrier initializations included, is visible to the
// others after it); the address in CTA `rank`'s shared memory of this CTA's shared address `addr`; an atomic add on
// such an address, acquire-release at cluster scope (returns the old value).
__device__ __forceinline__ uint32_t cluster_ctarank() {
  uint32_t r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
  return r;
}
__device__ __forceinline__ void cluster_sync() {
  asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;" ::: "memory");
}
__device__ __forceinline__ uint32_t cluster_map_shared(uint32_t addr, uint32_t rank) {
  uint32_t r;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(r) : "r"(addr), "r"(rank));
  return r;
}
__device__ __forceinline__ uint32_t atom_add_acq_rel_cluster(uint32_t cluster_addr, uint32_t v) {
  uint32_t old;
  asm volatile("atom.acq_rel.cluster.shared::cluster.add.u32 %0, [%1], %2;" : "=r"(old) : "r"(cluster_addr), "r"(v)
               : "memory");
  return old;
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

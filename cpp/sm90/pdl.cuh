// Programmatic dependent launch (PDL, sm_90) for the decode chain of the MoE forward
// (align -> [stage] -> gemm1 -> [stage] -> gemm2 -> combine): each kernel is launched with
// cudaLaunchAttributeProgrammaticStreamSerialization, so its blocks may start (and run the
// part of the kernel that reads only constant data: weight prefetch) while
// its predecessor is still finishing; inside CUDA graphs the capture turns this into a
// programmatic edge.
//
// Protocol (every kernel launched through pdl_launch follows it):
//   1. before griddep_wait(): read nothing that an earlier kernel of the stream writes,
//      except what rule 3 allows; write nothing to global memory;
//   2. every thread executes griddep_wait() (then griddep_launch_dependents()) before its
//      first dependent access and before any early return, in every block;
//   3. since each kernel triggers its dependents only after its own wait returned, a kernel
//      N+1 starts only when kernel N-1 (and all before it) has completed: N+1 may read
//      outputs of N-1 and earlier before its wait, through L2 (ld.global.cg, never the
//      non-coherent path), e.g. gemm2 reads the align kernel's expert list to prefetch
//      its weights while gemm1 drains.
// The wgmma GEMMs follow it and are launched with PDL where their grid is one wave (plan_pdl_launch), normally
// otherwise. Kernels not written for the protocol (common quantize) are launched normally: a
// normal launch waits for everything before it, and a PDL kernel after such a kernel starts
// at that kernel's completion (implicit trigger), so mixing is safe.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>
#include <utility>

namespace megamoe::sm90 {

// Multiprocessors of the current device (queried once per device).
inline int sm_count() {
  static int cached[64] = {};
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess || dev < 0 || dev >= 64) return 132;
  if (cached[dev] == 0) {
    int n = 0;
    if (cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess || n <= 0) n = 132;
    cached[dev] = n;
  }
  return cached[dev];
}

__device__ __forceinline__ void griddep_wait() { asm volatile("griddepcontrol.wait;" ::: "memory"); }
__device__ __forceinline__ void griddep_launch_dependents() {
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
}
// Protocol steps 2 (wait) and the trigger, in this order.
__device__ __forceinline__ void griddep_sync_and_release() {
  griddep_wait();
  griddep_launch_dependents();
}

// Asynchronous prefetch of [p, p + bytes) into L2 (a hint; skipped unless 16-byte aligned).
__device__ __forceinline__ void prefetch_l2_bulk(const void* p, uint32_t bytes) {
  if (bytes == 0 || ((reinterpret_cast<uintptr_t>(p) | bytes) & 15u) != 0) return;
  asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(p), "r"(bytes) : "memory");
}

// kernel<<<grid, block, smem, stream>>>(args...) with the PDL attribute.
template <typename... KArgs, typename... Args>
cudaError_t pdl_launch(void (*kernel)(KArgs...), dim3 grid, dim3 block, size_t smem, cudaStream_t stream,
                       Args&&... args) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  const cudaError_t err = cudaLaunchKernelEx(&cfg, kernel, std::forward<Args>(args)...);
  return err != cudaSuccess ? err : cudaGetLastError();
}

}  // namespace megamoe::sm90

// Programmatic dependent launch (PDL, sm_90) for the decode chain of the MoE forward
// (align -> [stage] -> L1 -> [stage] -> L2 -> combine): each kernel is launched with
// cudaLaunchAttributeProgrammaticStreamSerialization, so its blocks may start (and run the
// part of the kernel that reads only constant data: scale tables, weight prefetch) while
// its predecessor is still finishing; inside CUDA graphs the capture turns this into a
// programmatic edge.
//
// Protocol (every kernel launched through pdl_launch with PDL on follows it):
//   1. before griddep_wait(): read nothing that an earlier kernel of the stream writes,
//      except what rule 3 allows; write nothing to global memory;
//   2. every thread executes griddep_wait() (then griddep_launch_dependents()) before its
//      first dependent access and before any early return, in every block;
//   3. since each kernel triggers its dependents only after its own wait returned, a kernel
//      N+1 starts only when kernel N-1 (and all before it) has completed: N+1 may read
//      outputs of N-1 and earlier before its wait, through L2 (ld.global.cg, never the
//      non-coherent path), e.g. the L2 GEMM reads the align kernel's expert list to prefetch
//      its weights while the L1 GEMM drains.
// Kernels not written for the protocol (wgmma, tiled, common quantize) are launched
// normally: a normal launch waits for everything before it, and a PDL kernel after such a
// kernel starts at that kernel's completion (implicit trigger), so mixing is safe.
//
// Switch: environment variable MEGAMOE_SM90_PDL=0 launches everything normally (the run-6
// path; griddepcontrol.* are no-ops in a grid launched without the attribute).
#pragma once
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdlib>
#include <utility>

namespace megamoe::sm90 {

// Read at every launch (cheap; lets tests and the benchmark flip it inside one process).
inline bool pdl_enabled() {
  const char* v = std::getenv("MEGAMOE_SM90_PDL");
  return !(v && v[0] == '0');
}

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

// Experimental, off unless MEGAMOE_SM90_PREFETCH_L1=1 (and PDL on): see stream_pdl_prologue.
inline bool pdl_prefetch_l1_enabled() {
  const char* v = std::getenv("MEGAMOE_SM90_PREFETCH_L1");
  return v && v[0] == '1';
}

// Persistent one-tile decode GEMM (grouped_gemm_stream.cuh): MEGAMOE_SM90_DECODE_PERSISTENT=1 turns it on (default
// off until measured); MEGAMOE_SM90_DECODE_PREFETCH_NEXT=0 keeps the persistent grid without the next-item L2 prefetch.
inline bool decode_persistent_enabled() {
  const char* v = std::getenv("MEGAMOE_SM90_DECODE_PERSISTENT");
  return v && v[0] == '1';
}
inline bool decode_prefetch_next_enabled() {
  const char* v = std::getenv("MEGAMOE_SM90_DECODE_PREFETCH_NEXT");
  return !(v && v[0] == '0');
}

// L2 size of the current device in bytes (queried once per device; 50 MB if the query fails).
inline int64_t l2_bytes() {
  static int64_t cached[64] = {};
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess || dev < 0 || dev >= 64) return 50ll << 20;
  if (cached[dev] == 0) {
    int n = 0;
    if (cudaDeviceGetAttribute(&n, cudaDevAttrL2CacheSize, dev) != cudaSuccess || n <= 0) n = 50 << 20;
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

// kernel<<<grid, block, smem, stream>>>(args...), with the PDL attribute when pdl is true.
template <typename... KArgs, typename... Args>
cudaError_t pdl_launch(void (*kernel)(KArgs...), dim3 grid, dim3 block, size_t smem, cudaStream_t stream, bool pdl,
                       Args&&... args) {
  if (!pdl) {  // exactly the launch of run 6
    kernel<<<grid, block, smem, stream>>>(std::forward<Args>(args)...);
    return cudaGetLastError();
  }
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

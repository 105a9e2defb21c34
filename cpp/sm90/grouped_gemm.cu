// NVFP4 grouped GEMM for Hopper: dispatch between the streaming (decode) kernel and the
// tiled (prefill) kernel.
#include "grouped_gemm_stream.cuh"
#include "grouped_gemm_tiled.cuh"
#include "megamoe/sm90_kernels.h"

namespace megamoe::sm90 {

cudaError_t launch_grouped_gemm(const GroupedGemmArgs& a, cudaStream_t stream) {
  if (a.K % 16 != 0 || a.K <= 0 || a.N <= 0 || !a.act || !a.w_data || !a.w_scale || !a.w_global_scale ||
      !a.expert_offsets || !a.out || a.grid_experts <= 0)
    return cudaErrorInvalidValue;
  const bool silu_mul = a.epilogue == Epilogue::kSiluMul;
  if (silu_mul && ((a.N % 32) != 0 || a.w_gs_per_expert != 2)) return cudaErrorInvalidValue;
  if (a.grid_experts > 65535) return cudaErrorInvalidValue;

  int kernel = a.force_kernel;
  if (kernel < 0) kernel = a.max_tokens_per_expert > kStreamMaxTokens ? 1 : 0;
  if (kernel == 1 && tiled_gemm_supported(a)) return launch_tiled_gemm(a, stream);

  const unsigned gx = silu_mul ? unsigned(a.N / 2 / 16) : unsigned((a.N + kStreamRows - 1) / kStreamRows);
  dim3 grid(gx, unsigned(a.grid_experts));
  if (a.K % 64 == 0) stream_gemm_kernel<true><<<grid, kStreamThreads, 0, stream>>>(a);
  else stream_gemm_kernel<false><<<grid, kStreamThreads, 0, stream>>>(a);
  return cudaGetLastError();
}

}  // namespace megamoe::sm90

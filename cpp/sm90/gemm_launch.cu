// launch_grouped_gemm (megamoe/sm90_kernels.h): the arguments' rules (grouped_gemm_args_error, gemm_args.cpp), then
// the plan's kernel family (gemm_launch.h).
#include "gemm_launch.h"
#include "megamoe/sm90_kernels.h"

namespace megamoe::sm90 {

cudaError_t launch_grouped_gemm(const GroupedGemmArgs& a, cudaStream_t stream) {
  if (grouped_gemm_args_error(a)) return cudaErrorInvalidValue;
  return a.kernel == GemmKernel::kStream ? launch_stream_gemm(a, stream) : launch_wgmma_gemm(a, stream);
}

}  // namespace megamoe::sm90

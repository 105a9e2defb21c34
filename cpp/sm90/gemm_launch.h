// The launchers of the two grouped-GEMM families, called by launch_grouped_gemm (gemm_launch.cu) once the arguments
// common to both are checked: the streaming kernels (gemm_stream_launch.cu) and the wgmma kernels
// (gemm_wgmma_launch.cu). Both expect arguments that passed grouped_gemm_args_error.
#pragma once
#include <cuda_runtime.h>

#include "megamoe/sm90_kernels.h"

namespace megamoe::sm90 {

cudaError_t launch_stream_gemm(const GroupedGemmArgs& a, cudaStream_t stream);  // a.kernel == kStream
cudaError_t launch_wgmma_gemm(const GroupedGemmArgs& a, cudaStream_t stream);   // a.kernel == kWgmma32 / 64 / 128

}  // namespace megamoe::sm90

// launch_grouped_gemm (megamoe/sm90_kernels.h): the checks common to every grouped-GEMM kernel, then the plan's
// kernel family (gemm_launch.h). The binding (cpp/sm90/bind_sm90.cpp) checks the same rules with messages first.
#include "gemm_launch.h"
#include "megamoe/sm90_kernels.h"

namespace megamoe::sm90 {

cudaError_t launch_grouped_gemm(const GroupedGemmArgs& a, cudaStream_t stream) {
  if (a.K % 16 != 0 || a.K <= 0 || a.N <= 0 || !a.act || !a.w_data || !a.w_scale || !a.w_global_scale ||
      (!a.expert_offsets && !a.slot_experts) || a.grid_experts <= 0)
    return cudaErrorInvalidValue;
  const bool silu_mul = a.epilogue == Epilogue::kSiluMul;
  if (silu_mul && ((a.N % 32) != 0 || a.w_gs_per_expert != 2 || a.out_bf16)) return cudaErrorInvalidValue;
  // exactly one output: fp32 out or bf16 out_bf16 (kStore), or out / out_operand (kSiluMul)
  if (a.out && a.out_bf16) return cudaErrorInvalidValue;
  if (!a.out && !a.out_bf16 && !(silu_mul && a.out_operand)) return cudaErrorInvalidValue;
  if (a.h_quant_gs && !(silu_mul && a.out_operand)) return cudaErrorInvalidValue;
  if (a.grid_experts > 65535) return cudaErrorInvalidValue;
  if (a.slot_experts && a.kernel != GemmKernel::kStream) return cudaErrorInvalidValue;  // (its one-tile kernel only)
  if (a.entry_row_out && !(a.slot_experts && silu_mul)) return cudaErrorInvalidValue;
  switch (a.kernel) {
    case GemmKernel::kStream: return launch_stream_gemm(a, stream);
    case GemmKernel::kWgmma32:
    case GemmKernel::kWgmma64:
    case GemmKernel::kWgmma128: return launch_wgmma_gemm(a, stream);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace megamoe::sm90

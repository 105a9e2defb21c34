// launch_stream_gemm (megamoe/sm90_kernels.h): the streaming grouped-GEMM kernel (gemm_stream.cuh) of the arguments'
// tokens per pass (the plan's), K (16-byte weight loads when K % 64 == 0), gather, epilogue and one-token slots, with
// programmatic dependent launch (pdl.cuh).
#include "gemm_stream.cuh"
#include "pdl.cuh"

namespace megamoe::sm90 {

cudaError_t launch_stream_gemm(const StreamGemmArgs& a, cudaStream_t stream) {
  // the binding checked the rules with their messages; under them every branch below has its instantiation
  if (stream_gemm_args_error(a)) return cudaErrorInvalidValue;
  const bool silu_mul = a.epilogue == Epilogue::kSiluMul;
  const int nt = a.tokens_per_pass / 8;

  const unsigned gx = silu_mul ? unsigned(a.N / 2 / 16) : unsigned((a.N + kStreamRows - 1) / kStreamRows);
  const dim3 grid(gx, unsigned(a.grid_experts));
  const bool vec = a.K % 64 == 0;
  // Launched with programmatic dependent launch (pdl.cuh); the first wave of kStore blocks
  // (4 resident blocks/SM at 124 registers) prefetches its weights before waiting.
  StreamGemmArgs sa = a;
  sa.prefetch_blocks = 4 * sm_count();
  if (a.slot_experts) {  // one token without the align kernel, K % 64 == 0: its gemm2 (staged rows) and its gemm1, either
                         // gathering bf16 x (W4A16) or reading staged rows and quantizing h (W4A4, static h scale)
    if (!silu_mul) return pdl_launch(stream_gemm_nt1_direct_kernel<false>, grid, kStreamThreads, 0, stream, sa);
    if (a.h_quant_gs) return pdl_launch(stream_gemm_nt1_direct_kernel<false, true>, grid, kStreamThreads, 0, stream, sa);
    return pdl_launch(stream_gemm_nt1_direct_kernel<true>, grid, kStreamThreads, 0, stream, sa);
  }
  if (nt == 1) {
    const bool fused = a.act_rows || a.out_operand;
    const bool quant = a.h_quant_gs != nullptr;
    if (quant) {  // W4A4 (staged rows: a gather with the quantizing epilogue is not instantiated)
      if (vec) return pdl_launch(stream_gemm_nt1_quant_kernel<true>, grid, kStreamThreads, 0, stream, sa);
      return pdl_launch(stream_gemm_nt1_quant_kernel<false>, grid, kStreamThreads, 0, stream, sa);
    }
    if (vec && fused) return pdl_launch(stream_gemm_nt1_fused_kernel<true>, grid, kStreamThreads, 0, stream, sa);
    if (vec) return pdl_launch(stream_gemm_nt1_kernel<true>, grid, kStreamThreads, 0, stream, sa);
    if (fused) return pdl_launch(stream_gemm_nt1_fused_kernel<false>, grid, kStreamThreads, 0, stream, sa);
    return pdl_launch(stream_gemm_nt1_kernel<false>, grid, kStreamThreads, 0, stream, sa);
  }
  if (vec) {
    if (nt == 2) return pdl_launch(stream_gemm_kernel<true, 2>, grid, kStreamThreads, 0, stream, sa);
    if (nt == 4) return pdl_launch(stream_gemm_kernel<true, 4>, grid, kStreamThreads, 0, stream, sa);
    return pdl_launch(stream_gemm_kernel<true, 8>, grid, kStreamThreads, 0, stream, sa);
  }
  if (nt == 2) return pdl_launch(stream_gemm_kernel<false, 2>, grid, kStreamThreads, 0, stream, sa);
  if (nt == 4) return pdl_launch(stream_gemm_kernel<false, 4>, grid, kStreamThreads, 0, stream, sa);
  return pdl_launch(stream_gemm_kernel<false, 8>, grid, kStreamThreads, 0, stream, sa);
}

}  // namespace megamoe::sm90

// NVFP4 grouped GEMM for Hopper: the dispatch plan (plan_moe_gemms) and the launcher that runs
// the plan's kernel -- the streaming kernel (decode; grouped_gemm_stream.cuh) or the wgmma kernel
// (grouped_gemm_wgmma.cuh).
#include "grouped_gemm_stream.cuh"
#include "grouped_gemm_wgmma.cuh"
#include "megamoe/sm90_kernels.h"

namespace megamoe::sm90 {

cudaError_t encode_tensor_map(CUtensorMap* map, CUtensorMapDataType type, int rank, const void* base,
                              const uint64_t* dims, const uint64_t* strides, const uint32_t* box,
                              CUtensorMapSwizzle swizzle) {
  using Encode = CUresult (*)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*, const cuuint64_t*,
                              const cuuint64_t*, const cuuint32_t*, const cuuint32_t*, CUtensorMapInterleave,
                              CUtensorMapSwizzle, CUtensorMapL2promotion, CUtensorMapFloatOOBfill);
  static Encode encode = [] {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult found{};
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault, &found) !=
            cudaSuccess ||
        found != cudaDriverEntryPointSuccess)
      fn = nullptr;
    return reinterpret_cast<Encode>(fn);
  }();
  if (!encode) return cudaErrorNotSupported;
  cuuint64_t d[5], st[4];
  cuuint32_t b[5], one[5];
  for (int i = 0; i < rank; ++i) {
    d[i] = dims[i];
    b[i] = box[i];
    one[i] = 1;
    if (i + 1 < rank) st[i] = strides[i];
  }
  const CUresult r = encode(map, type, cuuint32_t(rank), const_cast<void*>(base), d, st, b, one,
                            CU_TENSOR_MAP_INTERLEAVE_NONE, swizzle, CU_TENSOR_MAP_L2_PROMOTION_L2_128B,
                            CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  return r == CUDA_SUCCESS ? cudaSuccess : cudaErrorInvalidValue;
}

GemmPlan plan_moe_gemms(const GemmProblem& p) {
  GemmPlan plan;
  const bool wgmma_shape = p.k_l1 % kWgK == 0 && p.k_l2 % kWgK == 0 && p.num_experts <= kWgMaxExperts;
  GemmKernel kernel = p.kernel;
  // Both K multiples of the smallest K per stage of tile 32 (256) and of tile 64 (128: its K-256 stages need 256).
  const bool k_tiny = p.k_l1 % wg_min_stage_k(kWgTiny) == 0 && p.k_l2 % wg_min_stage_k(kWgTiny) == 0;
  const bool k_small = p.k_l1 % wg_min_stage_k(kWgSmall) == 0 && p.k_l2 % wg_min_stage_k(kWgSmall) == 0;
  if (kernel == GemmKernel::kAuto) {
    kernel = p.tokens_per_expert <= kWgmmaAboveTokensPerExpert    ? GemmKernel::kStream
             : p.tokens_per_expert <= kWgmma32UpTo && k_tiny      ? GemmKernel::kWgmma32
             : p.tokens_per_expert <= kWgmma64UpTo && k_small     ? GemmKernel::kWgmma64
                                                                  : GemmKernel::kWgmma128;
  }
  if (!wgmma_shape) kernel = GemmKernel::kStream;
  // an explicit tile-32/64 request on a K they cannot step through: the next tile that can
  if (kernel == GemmKernel::kWgmma32 && !k_tiny) kernel = GemmKernel::kWgmma64;
  if (kernel == GemmKernel::kWgmma64 && !k_small) kernel = GemmKernel::kWgmma128;
  plan.kernel = kernel;
  plan.h_operand = p.w4a16 || p.h_static_scale;
  // Tiles 64 and 128 read x staged per slot: their L1 takes whole TMA boxes of contiguous rows, which gains more
  // than the staging costs (docs/PERFORMANCE.md); tile 32 and the streaming kernels gather.
  plan.gather_x = p.w4a16 && p.gather_input && (kernel == GemmKernel::kStream || kernel == GemmKernel::kWgmma32);
  if (kernel != GemmKernel::kStream) {
    plan.lane_order = true;
    plan.token_tile = plan.tokens_per_pass = kernel == GemmKernel::kWgmma32   ? kWgTiny
                                             : kernel == GemmKernel::kWgmma64 ? kWgSmall
                                                                              : kWgMid;
    return plan;
  }
  plan.token_tile = 8;
  int tpp = p.tokens_per_pass;
  if (tpp != 8 && tpp != 16 && tpp != 32 && tpp != 64) {
    // Enough 8-token tiles per pass for an expert somewhat above the expected count.
    const int64_t want = (p.tokens_per_expert * 3 + 1) / 2;
    tpp = p.tokens_per_expert <= kStreamOneTileUpTo ? 8 : want <= 32 ? 32 : 64;
  }
  plan.tokens_per_pass = tpp;
  return plan;
}

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
  if (a.kernel == GemmKernel::kWgmma32 || a.kernel == GemmKernel::kWgmma64 || a.kernel == GemmKernel::kWgmma128) {
    // The plan chooses wgmma only for shapes it takes (act_rows: a gather of lane-order rows).
    if (a.kernel == GemmKernel::kWgmma32)
      return wg_gemm_supported<kWgTiny>(a) ? launch_wg_gemm<kWgTiny>(a, stream) : cudaErrorInvalidValue;
    if (a.kernel == GemmKernel::kWgmma64)
      return wg_gemm_supported<kWgSmall>(a) ? launch_wg_gemm<kWgSmall>(a, stream) : cudaErrorInvalidValue;
    return wg_gemm_supported<kWgMid>(a) ? launch_wg_gemm<kWgMid>(a, stream) : cudaErrorInvalidValue;
  }
  if (a.kernel != GemmKernel::kStream) return cudaErrorInvalidValue;
  const int nt = a.tokens_per_pass / 8;
  if (nt != 1 && nt != 2 && nt != 4 && nt != 8) return cudaErrorInvalidValue;

  const unsigned gx = silu_mul ? unsigned(a.N / 2 / 16) : unsigned((a.N + kStreamRows - 1) / kStreamRows);
  const dim3 grid(gx, unsigned(a.grid_experts));
  const bool vec = a.K % 64 == 0;
  // Launched with programmatic dependent launch (pdl.cuh); the first wave of kStore blocks
  // (4 resident blocks/SM at 124 registers) prefetches its weights before waiting.
  GroupedGemmArgs sa = a;
  sa.prefetch_blocks = 4 * sm_count();
  if (a.slot_experts) {  // one token without the align kernel, K % 64 == 0: its L2 (staged rows) and its L1, either
                         // gathering bf16 x (W4A16) or reading staged rows and quantizing h (W4A4, static h scale)
    if (nt != 1 || !vec) return cudaErrorInvalidValue;
    if (!silu_mul) {
      if (a.act_rows) return cudaErrorInvalidValue;
      return pdl_launch(stream_gemm_nt1_direct_kernel<false>, grid, kStreamThreads, 0, stream, sa);
    }
    if (!a.out_operand || bool(a.act_rows) == bool(a.h_quant_gs)) return cudaErrorInvalidValue;
    if (a.h_quant_gs) return pdl_launch(stream_gemm_nt1_direct_kernel<false, true>, grid, kStreamThreads, 0, stream, sa);
    return pdl_launch(stream_gemm_nt1_direct_kernel<true>, grid, kStreamThreads, 0, stream, sa);
  }
  if (nt == 1) {
    const bool fused = a.act_rows || a.out_operand;
    const bool quant = a.h_quant_gs != nullptr;
    if (quant && !a.act_rows) {  // W4A4 (no gather): the staged-rows kernel with the quantizing epilogue
      if (vec) return pdl_launch(stream_gemm_nt1_quant_kernel<true>, grid, kStreamThreads, 0, stream, sa);
      return pdl_launch(stream_gemm_nt1_quant_kernel<false>, grid, kStreamThreads, 0, stream, sa);
    }
    if (quant) return cudaErrorInvalidValue;  // a gather with the quantizing epilogue is not instantiated
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

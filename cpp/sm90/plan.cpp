// The dispatch plan of the sm90 MoE GEMMs (megamoe/sm90_plan.h): host only, no CUDA call, so that it is tested on
// the CPU (tests/test_sm90_plan.py) and every launch reads its choices instead of deciding again.
#include "megamoe/sm90_plan.h"

namespace megamoe::sm90 {

GemmPlan plan_moe_gemms(const GemmProblem& p) {
  GemmPlan plan;
  const bool wgmma_shape = p.k_gemm1 % kWgK == 0 && p.k_gemm2 % kWgK == 0 && p.num_experts <= kWgMaxExperts;
  GemmKernel kernel = p.kernel;
  // Both K multiples of the smallest K per stage of tile 32 (256) and of tile 64 (128: its K-256 stages need 256).
  const bool k_tiny = p.k_gemm1 % wg_min_stage_k(kTile32) == 0 && p.k_gemm2 % wg_min_stage_k(kTile32) == 0;
  const bool k_small = p.k_gemm1 % wg_min_stage_k(kTile64) == 0 && p.k_gemm2 % wg_min_stage_k(kTile64) == 0;
  if (kernel == GemmKernel::kAuto) {
    // batch-invariant: no streaming kernel for few tokens where the wgmma kernels can run (the shape check below
    // falls back to streaming at every token count where they cannot)
    const bool stream_decode = !p.batch_invariant && p.tokens_per_expert <= kWgmmaAboveTokensPerExpert;
    kernel = stream_decode                                        ? GemmKernel::kStream
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
  // Tiles 64 and 128 read x staged per slot: their gemm1 takes whole TMA boxes of contiguous rows, which gains more
  // than the staging costs (docs/PERFORMANCE.md); tile 32 and the streaming kernels gather.
  plan.gather_x = p.w4a16 && p.gather_input && (kernel == GemmKernel::kStream || kernel == GemmKernel::kWgmma32);
  if (kernel != GemmKernel::kStream) {
    plan.lane_order = true;
    const int tile = kernel == GemmKernel::kWgmma32 ? kTile32 : kernel == GemmKernel::kWgmma64 ? kTile64 : kTile128;
    plan.token_tile = plan.tokens_per_pass = tile;
    // gemm1 gathers lane-order rows of x through row_token with cp.async copies (gather_x), else both GEMMs read
    // contiguous staged rows by TMA
    plan.copied_rows_gemm1 = plan.gather_x;
    plan.stage_k_gemm1 = plan_stage_k(tile, p.k_gemm1, !plan.copied_rows_gemm1);
    plan.stage_k_gemm2 = plan_stage_k(tile, p.k_gemm2, true);
  } else {
    plan.token_tile = 8;
    int tpp = p.tokens_per_pass;
    if (tpp != 8 && tpp != 16 && tpp != 32 && tpp != 64) {
      // Enough 8-token tiles per pass for an expert somewhat above the expected count.
      const int64_t want = (p.tokens_per_expert * 3 + 1) / 2;
      tpp = p.tokens_per_expert <= kStreamOneTileUpTo ? 8 : want <= 32 ? 32 : 64;
    }
    plan.tokens_per_pass = tpp;
  }
  // One token without the align kernel: the kernels that take slot_experts (the one-tile streaming ones with
  // K % 64 == 0, and wgmma tile 32: its tile-8 and tile-32 kPdl instances), for W4A16 gathering bf16 x, or W4A4
  // quantizing h in gemm1 (a dynamic scale for h needs its quantizer's grouped rows).
  const bool slot_kernel = kernel == GemmKernel::kWgmma32 ||
                           (kernel == GemmKernel::kStream && plan.tokens_per_pass == 8 && p.k_gemm1 % 64 == 0 &&
                            p.k_gemm2 % 64 == 0);
  plan.without_align = p.tokens == 1 && slot_kernel && (p.w4a16 ? plan.gather_x : plan.h_operand);
  plan.token_order = p.tokens > 0 && p.tokens >= p.token_order_from && (p.w4a16 || p.slots_quantize_alike);
  return plan;
}

}  // namespace megamoe::sm90

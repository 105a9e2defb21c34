// NVFP4 grouped GEMM for Hopper: dispatch between the streaming (decode) kernel, the
// tiled mma.sync kernel and the wgmma kernel (force_kernel 3..6; grouped_gemm_wgmma.cuh).
#include "grouped_gemm_stream.cuh"
#include "grouped_gemm_tiled.cuh"
#include "grouped_gemm_wgmma.cuh"
#include "grouped_gemm_wgmma_ws.cuh"
#include "megamoe/sm90_kernels.h"

namespace megamoe::sm90 {

// Resident blocks per SM of one persistent decode kernel (occupancy query, once per instantiation).
template <bool kVec, bool kFused>
int nt1_persistent_blocks_per_sm() {
  static int cached = 0;
  if (cached == 0) {
    void (*kernel)(GroupedGemmArgs) =
        kFused ? stream_gemm_nt1_fused_persistent_kernel<kVec> : stream_gemm_nt1_persistent_kernel<kVec>;
    int n = 0;
    if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kernel, kStreamThreads, 0) != cudaSuccess || n <= 0) {
      (void)cudaGetLastError();
      n = 4;
    }
    cached = n;
  }
  return cached;
}

// Persistent one-tile decode GEMM (MEGAMOE_SM90_DECODE_PERSISTENT=1, grouped_gemm_stream.cuh): a grid of exactly
// blocks/SM x SMs blocks (fewer when there are fewer work items) looping over (slot, row block) items.
template <bool kVec, bool kFused>
cudaError_t launch_nt1_persistent(GroupedGemmArgs sa, unsigned row_blocks, cudaStream_t stream) {
  const int64_t items = int64_t(row_blocks) * sa.grid_experts;  // host bound; the kernel reads num_active
  const int64_t resident = int64_t(nt1_persistent_blocks_per_sm<kVec, kFused>()) * sm_count();
  const int64_t grid = items < resident ? items : resident;
  sa.row_blocks = int(row_blocks);
  if (sa.pdl && sa.prefetch_blocks < grid) sa.prefetch_blocks = int(grid);
  // Next-item L2 prefetch: blocks with a second item share half of L2, 32 rows each.
  const int64_t prefetchers = items - grid < grid ? items - grid : grid;
  sa.prefetch_row_bytes = 0;
  if (prefetchers > 0 && decode_prefetch_next_enabled()) {
    const int64_t per_row = (l2_bytes() / 2) / (prefetchers * kStreamRows);
    sa.prefetch_row_bytes = per_row & ~int64_t(15);
  }
  void (*kernel)(GroupedGemmArgs) =
      kFused ? stream_gemm_nt1_fused_persistent_kernel<kVec> : stream_gemm_nt1_persistent_kernel<kVec>;
  return pdl_launch(kernel, dim3(unsigned(grid)), kStreamThreads, 0, stream, sa.pdl, sa);
}

cudaError_t launch_grouped_gemm(const GroupedGemmArgs& a, cudaStream_t stream) {
  if (a.K % 16 != 0 || a.K <= 0 || a.N <= 0 || !a.act || !a.w_data || !a.w_scale || !a.w_global_scale ||
      !a.expert_offsets || a.grid_experts <= 0)
    return cudaErrorInvalidValue;
  const bool silu_mul = a.epilogue == Epilogue::kSiluMul;
  if (silu_mul && ((a.N % 32) != 0 || a.w_gs_per_expert != 2)) return cudaErrorInvalidValue;
  if (a.grid_experts > 65535) return cudaErrorInvalidValue;

  int kernel = a.force_kernel;
  // auto: the wgmma kernel above kWgAutoAbove tokens per expert (run 6), else streaming; a K the wgmma
  // (and tiled) kernels do not take (K % 64 != 0) falls through to streaming below.
  if (kernel < 0) kernel = a.max_tokens_per_expert > kWgAutoAbove ? 3 : 0;
  if (a.act_rows || a.out_operand) kernel = 0;  // fused gather / operand output exist in the streaming kernel only
  if (kernel >= 3 && kernel <= 6 && wg_gemm_supported(a)) return launch_wg_gemm(a, stream, kernel);
  // warp-specialized wgmma (grouped_gemm_wgmma_ws.cuh): only when forced, never chosen by auto (yet)
  if (kernel >= kKernelWgmmaWsLarge && kernel <= kKernelWgmmaWs2Mid && wg_gemm_supported(a))
    return launch_wgws_gemm(a, stream, kernel);
  if (kernel >= 1 && tiled_gemm_supported(a)) return launch_tiled_gemm(a, stream, kernel);
  if (!a.out && !(silu_mul && a.out_operand)) return cudaErrorInvalidValue;

  int nt = a.tokens_per_pass / 8;
  if (nt <= 0) {
    // Enough token tiles per pass for an expert somewhat above the expected count.
    const int64_t want = (a.max_tokens_per_expert * 3 + 1) / 2;
    nt = want <= 8 ? 1 : want <= 16 ? 2 : want <= 32 ? 4 : 8;
  }
  const unsigned gx = silu_mul ? unsigned(a.N / 2 / 16) : unsigned((a.N + kStreamRows - 1) / kStreamRows);
  dim3 grid(gx, unsigned(a.grid_experts));
  const bool vec = a.K % 64 == 0;
  // Programmatic dependent launch of the streaming kernels (cpp/sm90/pdl.cuh; MEGAMOE_SM90_PDL=0: off).
  GroupedGemmArgs sa = a;
  sa.pdl = pdl_enabled();
  sa.prefetch_silu = sa.pdl && pdl_prefetch_l1_enabled();
  sa.prefetch_blocks = sa.pdl ? 4 * sm_count() : 0;  // 4 resident blocks/SM (124 registers)
  if (nt == 1) {
    // One token tile per pass: the nt1 kernel, with the fused gather / bf16 h output (run 7) when given.
    const bool fused = a.act_rows || a.out_operand;
    if (decode_persistent_enabled()) {
      if (vec && fused) return launch_nt1_persistent<true, true>(sa, gx, stream);
      if (vec) return launch_nt1_persistent<true, false>(sa, gx, stream);
      if (fused) return launch_nt1_persistent<false, true>(sa, gx, stream);
      return launch_nt1_persistent<false, false>(sa, gx, stream);
    }
    if (vec && fused) return pdl_launch(stream_gemm_nt1_fused_kernel<true>, grid, kStreamThreads, 0, stream, sa.pdl, sa);
    if (vec) return pdl_launch(stream_gemm_nt1_kernel<true>, grid, kStreamThreads, 0, stream, sa.pdl, sa);
    if (fused) return pdl_launch(stream_gemm_nt1_fused_kernel<false>, grid, kStreamThreads, 0, stream, sa.pdl, sa);
    return pdl_launch(stream_gemm_nt1_kernel<false>, grid, kStreamThreads, 0, stream, sa.pdl, sa);
  }
#define MEGAMOE_STREAM(V, NT, PF) \
  return pdl_launch(stream_gemm_kernel<V, NT, PF>, grid, kStreamThreads, 0, stream, sa.pdl, sa)
  if (vec) {
    // Register prefetch of the next slice measured slower at decode (run 3: T=32 674 -> 995 us), so off.
    if (nt == 1) MEGAMOE_STREAM(true, 1, false);
    else if (nt == 2) MEGAMOE_STREAM(true, 2, false);
    else if (nt == 4) MEGAMOE_STREAM(true, 4, false);
    else MEGAMOE_STREAM(true, 8, false);
  } else {
    if (nt == 1) MEGAMOE_STREAM(false, 1, false);
    else if (nt == 2) MEGAMOE_STREAM(false, 2, false);
    else if (nt == 4) MEGAMOE_STREAM(false, 4, false);
    else MEGAMOE_STREAM(false, 8, false);
  }
#undef MEGAMOE_STREAM
  return cudaGetLastError();
}

}  // namespace megamoe::sm90

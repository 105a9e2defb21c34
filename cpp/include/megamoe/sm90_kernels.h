// Launchers of the Hopper (sm_90a) MoE kernels in cpp/sm90/. Plain C++ (no device
// code); every launcher is asynchronous on `stream`, never synchronizes with the host
// (so a forward of fixed T can be captured in a CUDA graph) and returns the launch error.
//
// Row layout used between the kernels ("compact grouped"): the T*k (token, expert)
// pairs are sorted by expert; expert e owns rows [expert_offsets[e], expert_offsets[e+1]).
// Activations handed to the GEMMs are bf16 [rows, K] with each 8-element group stored
// in the order 0,4,1,5,2,6,3,7 ("operand order", see cpp/sm90/gemm_common.cuh); for
// W4A4 they hold e2m1 * e4m3 of the NVFP4 activation (exact), the global scale going
// into the GEMM alpha.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

#include "megamoe/common_kernels.h"

namespace megamoe::sm90 {

// Routing results -> grouped rows. topk_ids [T, k] (int32 or int64, ids outside
// [0, E) are dropped). Outputs (device):
//   expert_offsets [E+1], active_experts [E] (experts with tokens, ascending; entries
//   past num_active[0] undefined), num_active [1], row_token [T*k] (token of each
//   grouped row), entry_row [T*k] (grouped row of entry t*k+j, -1 when dropped).
// One block; the order of rows inside an expert is not fixed (results do not depend on it).
cudaError_t launch_moe_align(const void* topk_ids, bool ids_int64, int64_t tokens, int top_k, int num_experts,
                             int32_t* expert_offsets, int32_t* active_experts, int32_t* num_active,
                             int32_t* row_token, int32_t* entry_row, cudaStream_t stream);

// dst[r] = bf16(src[src_rows ? src_rows[r] : r]) in operand order, for r < *num_rows
// (device count; rows past it are not touched). cols % 16 == 0.
cudaError_t launch_stage_bf16(const void* src, ElemType src_type, int64_t src_row_stride, const int32_t* src_rows,
                              const int32_t* num_rows, int64_t max_rows, int64_t cols, uint16_t* dst,
                              cudaStream_t stream);

enum class Epilogue : int {
  kStore = 0,    // out[row, n] = alpha * acc  (fp32, ldo = N)
  kSiluMul = 1,  // N = 2I (gate rows then up rows): out[row, i] = silu(alpha_g*gate) * alpha_u*up (fp32, ldo = I)
};

struct GroupedGemmArgs {
  const uint16_t* act = nullptr;  // bf16 [rows, K], operand order (or [*, K] natural order with act_rows)
  const int32_t* act_rows = nullptr;  // streaming kernel only: grouped row r reads act row act_rows[r], natural order
  const int32_t* expert_offsets = nullptr;  // [E+1]
  const int32_t* active_experts = nullptr;  // [E] (null: grid.y indexes experts directly)
  const int32_t* num_active = nullptr;      // [1] (null: all grid.y slots are active)
  int num_experts = 0;
  int grid_experts = 0;  // grid.y: upper bound of active experts (min(E, T*k))
  const uint8_t* w_data = nullptr;   // [E, N, K/2]
  const uint8_t* w_scale = nullptr;  // [E, N, K/16] e4m3
  const float* w_global_scale = nullptr;  // [E * w_gs_per_expert] (kSiluMul: 2 per expert, gate then up)
  int w_gs_per_expert = 1;
  const float* a_global_scale = nullptr;  // null: 1.0
  bool a_gs_per_expert = false;           // a_global_scale[e] instead of a_global_scale[0]
  const float* a_row_scale = nullptr;     // per grouped row activation global scale (dynamic W4A4), multiplies too
  bool swiglu_clamp = false;              // kSiluMul: gate = min(gate, limit), up = clamp(up, -limit, limit)
  float swiglu_limit = 0.f;
  int64_t N = 0, K = 0;
  Epilogue epilogue = Epilogue::kStore;
  float* out = nullptr;
  uint16_t* out_operand = nullptr;  // streaming kSiluMul only: write h as bf16 [rows, I] in operand order instead
  int64_t max_tokens_per_expert = 0;  // host estimate of tokens per expert (picks tokens per pass)
  int64_t max_total_rows = 0;         // host bound on expert_offsets[E] (sizes the tiled grid)
  int force_kernel = -1;              // -1 auto, 0 streaming (decode), 1 tiled (prefill), 2 tiled, 2 blocks/SM,
                                      // 3 wgmma (tile from max_tokens_per_expert), 4/5/6 wgmma token tile 64/256/128
                                      // 7/8 warp-specialized wgmma, token tile 256/128 (kKernelWgmmaWs*),
                                      // 9 token tile 128 with two producer warpgroups
  int tokens_per_pass = 0;            // streaming: 8, 16, 32 or 64 (0: from max_tokens_per_expert)
  bool pdl = false;  // set by launch_grouped_gemm (streaming kernels): launched with programmatic dependent
                     // launch (cpp/sm90/pdl.cuh; MEGAMOE_SM90_PDL=0 turns it off)
  int prefetch_blocks = 0;     // with pdl: kStore blocks with linear index below this prefetch their weights into
                               // L2 before the wait (set to 4 x SMs: the blocks that can overlap the previous GEMM)
  bool prefetch_silu = false;  // with pdl: the kSiluMul streaming GEMM prefetches its weight rows into L2
                               // (experimental, MEGAMOE_SM90_PREFETCH_L1=1)
  // Set by launch_grouped_gemm for the persistent one-tile decode kernel (MEGAMOE_SM90_DECODE_PERSISTENT=1):
  int row_blocks = 0;              // work items per expert slot (row blocks of 32 rows / 16 gate+up columns)
  int64_t prefetch_row_bytes = 0;  // bytes of each weight row of a block's next item prefetched into L2 (0: none)
};
// force_kernel values of the warp-specialized wgmma kernel (cpp/sm90/grouped_gemm_wgmma_ws.cuh).
constexpr int kKernelWgmmaWsLarge = 7, kKernelWgmmaWsMid = 8, kKernelWgmmaWs2Mid = 9;
cudaError_t launch_grouped_gemm(const GroupedGemmArgs& args, cudaStream_t stream);

// out[t, c] = sum_j topk_weights[t, j] * y[entry_row[t*k + j], c] (fp32 sum in j order,
// dropped entries skipped), cast to out_type. y fp32 [rows, H].
cudaError_t launch_moe_combine(const float* y, const int32_t* entry_row, const float* topk_weights, int64_t tokens,
                               int top_k, int64_t hidden, void* out, ElemType out_type, cudaStream_t stream);

}  // namespace megamoe::sm90

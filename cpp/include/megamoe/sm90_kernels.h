// Launchers of the Hopper (sm_90a) MoE kernels in cpp/sm90/. Plain C++ (no device
// code); every launcher is asynchronous on `stream`, never synchronizes with the host
// (so a forward of fixed T can be captured in a CUDA graph) and returns the launch error.
//
// Row layout used between the kernels ("compact grouped"): the T*k (token, expert)
// pairs are sorted by expert; expert e owns rows [expert_offsets[e], expert_offsets[e+1]).
// Activations handed to the GEMMs are bf16 [rows, K] with each 8-element group stored
// in the order 0,4,1,5,2,6,3,7 ("operand order", megamoe/sm90_operand_order.hpp), and for the
// wgmma kernels with the 4-byte pairs of every 64-element block further permuted ("lane order",
// megamoe/sm90_operand_order.hpp lane_order_position; GemmPlan::lane_order); for W4A4 they hold
// e2m1 * e4m3 of the NVFP4 activation (exact), the global scale going into the GEMM alpha.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

#include "megamoe/common_kernels.h"
#include "megamoe/sm90_plan.h"

namespace megamoe::sm90 {

// Routing results -> grouped rows. topk_ids [T, k] (int32 or int64, ids outside
// [0, E) are dropped). Outputs (device):
//   expert_offsets [E+1], active_experts [E] (experts with tokens, ascending; entries
//   past num_active[0] undefined), num_active [1], row_token [T*k] (token of each
//   grouped row), entry_row [T*k] (grouped row of entry t*k+j, -1 when dropped).
// The order of rows inside an expert is not fixed (results do not depend on it). One block, or with
// scratch (int32, at least align_scratch_size(T*k, E) entries) and more than 2 * kAlignChunk entries,
// kAlignChunk entries per block in two kernels (count, then scan and place).
constexpr int kAlignChunk = 4096;
constexpr int64_t align_scratch_size(int64_t entries, int num_experts) {
  return (entries + kAlignChunk - 1) / kAlignChunk * num_experts;
}
cudaError_t launch_moe_align(const void* topk_ids, bool ids_int64, int64_t tokens, int top_k, int num_experts,
                             int32_t* expert_offsets, int32_t* active_experts, int32_t* num_active,
                             int32_t* row_token, int32_t* entry_row, int32_t* scratch, int64_t scratch_size,
                             cudaStream_t stream);

// dst[r] = bf16(src[src_rows ? src_rows[r] : r]) in operand order (lane_order: lane order), for
// r < *num_rows (device count; rows past it are not touched). cols % 16 == 0 (lane order: % 64).
cudaError_t launch_stage_bf16(const void* src, ElemType src_type, int64_t src_row_stride, const int32_t* src_rows,
                              const int32_t* num_rows, int64_t max_rows, int64_t cols, uint16_t* dst,
                              bool lane_order, cudaStream_t stream);

// dst[dst_rows[t*top_k + j]] = bf16(src[t]) in operand order (lane_order: lane order) for every t < tokens and
// j < top_k with dst_rows[t*top_k + j] >= 0 (moe_align's entry_row: each grouped row once); other rows are not
// touched. Reads each source row once. cols % 16 == 0 (lane order: % 64).
cudaError_t launch_scatter_bf16(const void* src, ElemType src_type, int64_t src_row_stride, int64_t tokens,
                                const int32_t* dst_rows, int top_k, int64_t cols, uint16_t* dst, bool lane_order,
                                cudaStream_t stream);

enum class Epilogue : int {
  kStore = 0,    // out[row, n] = alpha * acc  (fp32, or bf16 with GroupedGemmCommon::out_bf16; ldo = N)
  kSiluMul = 1,  // N = 2I (gate rows then up rows): out[row, i] = silu(alpha_g*gate) * alpha_u*up (fp32, ldo = I)
};

// The arguments of one grouped GEMM, one struct per kernel family: GroupedGemmCommon holds what both families read
// (the activations and their gather, the expert grouping, the weights and their scales, the epilogue and its outputs),
// StreamGemmArgs adds what only the streaming kernels read (gemm_stream.cuh: tokens per pass, the active experts, the
// weight prefetch), WgmmaGemmArgs what only the wgmma kernels read
// (gemm_wgmma.cuh and its launch: the token tile, stage K, TMA or copied activation rows, the bounds of the TMA view
// and of the grid). The binding (bind_sm90.cpp sm90_grouped_gemm) builds the struct of the plan's kernel family,
// checks it once against the rules of cpp/sm90/gemm_args.cpp (stream_gemm_args_error, wgmma_gemm_args_error: the
// message it throws) and calls that family's launcher.
struct GroupedGemmCommon {
  const uint16_t* act = nullptr;  // bf16 [rows, K], operand order (wgmma: lane order; or [*, K] natural order with
                                  // act_rows, streaming)
  const int32_t* act_rows = nullptr;  // grouped row r reads act row act_rows[r]: the streaming kernel natural-order
                                      // bf16 x, the wgmma kernel lane-order rows (x staged once as [T, K])
  const int32_t* expert_offsets = nullptr;  // [E+1] (streaming: null with StreamGemmArgs::slot_experts)
  int num_experts = 0;
  int grid_experts = 0;  // upper bound of active experts (min(E, T*k)): streaming grid.y; wgmma: its grid's tile bound
  const uint8_t* w_data = nullptr;   // [E, N, K/2]
  const uint8_t* w_scale = nullptr;  // [E, N, w_scale_row_bytes] scale codes (the first K/16 bytes of each row;
                                     // megamoe/backends/cuda_sm90.py sm90_weights, gemm_common.cuh "Scale code")
  int64_t w_scale_row_bytes = 0;     // scale row stride, >= K/16 (0: K/16); the wgmma kernels need a multiple of 16
                                     // (their TMA map; prepare_weights pads the rows: sm90_scale_rows)
  // w_data and w_scale in the tiled order (sm90_weight_tile_offset; cuda_sm90.py sm90_tiled): the bytes of each
  // 32 rows x 256 elements of K (4 KB of codes, 512 bytes of scale codes) contiguous, so that a block's weight box
  // of one stage is whole 4 KB runs of memory instead of 128 bytes of each of its rows. Needs K % 256 == 0 and
  // N % 32 == 0 (silu_mul: I % 32 == 0) and scale rows of exactly K / 16 bytes.
  bool w_tiled = false;
  const float* w_global_scale = nullptr;  // [E * w_gs_per_expert] (kSiluMul: 2 per expert, gate then up)
  int w_gs_per_expert = 1;
  const float* a_global_scale = nullptr;  // null: 1.0
  bool a_gs_per_expert = false;           // a_global_scale[e] instead of a_global_scale[0]
  const float* a_row_scale = nullptr;     // per grouped row activation global scale (dynamic W4A4), multiplies too
  bool swiglu_clamp = false;              // kSiluMul: gate = min(gate, limit), up = clamp(up, -limit, limit)
  float swiglu_limit = 0.f;
  // kSiluMul: h = (up + swiglu_up_shift) * gate * sigmoid(swiglu_alpha * gate) (after the clamp); 1 and 0: SwiGLU,
  // silu(gate) * up, bit for bit; gpt-oss 1.702 and 1
  float swiglu_alpha = 1.f;
  float swiglu_up_shift = 0.f;
  // [E, N] fp32 expert bias added to the scaled product of weight row n (gpt-oss): kSiluMul the gate rows' then the
  // up rows' (before the clamp and the activation), kStore each output column (before the combine's routing
  // weight); null: none
  const float* bias = nullptr;
  int64_t N = 0, K = 0;
  Epilogue epilogue = Epilogue::kStore;
  float* out = nullptr;
  uint16_t* out_bf16 = nullptr;     // kStore only: out as bf16 [rows, N] (round to nearest even) instead of fp32
  uint16_t* out_operand = nullptr;  // kSiluMul only: write h as bf16 [rows, I] in the kernel's own order instead
  const float* h_quant_gs = nullptr;  // with out_operand: h quantized to NVFP4 with this global scale ([E] with
                                      // h_gs_per_expert, else [1]) and written as its exact bf16 decode (e2m1 *
                                      // e4m3 scale: W4A4's gemm2 input, bit for bit what quantize_nvfp4 writes of h)
  bool h_gs_per_expert = false;
  // expert_offsets (and act_rows) were complete before the kernel ahead of this one in the stream started (the MoE
  // forward's GEMMs: the align kernel is at least two kernels back): the wgmma kernels launched with programmatic
  // dependent launch (one-wave grids of tiles 8 and 32: plan_pdl_launch) then find their tile and issue their first
  // stages' weight loads before they wait for that kernel (pdl.cuh rule 3), else they wait first. The streaming kernels
  // do not read it.
  bool offsets_settled = false;
  // One token without the align kernel (GemmPlan::without_align: the one-tile streaming kernel with K % 64 == 0, or
  // wgmma tile 32, which runs it as tile 8 or 32 on its kPdl instances): slot j of the grid is grouped row j, of
  // expert slot_experts[j] (the token's topk_ids: int32, or int64 with slot_experts_int64; an id outside [0, E) is
  // dropped: slot j has no row); expert_offsets (and the streaming kernels' active_experts and num_active) are not
  // read. With entry_row_out (kSiluMul), slot j also writes entry_row_out[j] = j, or -1 when dropped: the align
  // kernel's entry_row of the token, which the combine kernel reads.
  bool slot_experts_int64 = false;
  const void* slot_experts = nullptr;
  int32_t* entry_row_out = nullptr;
};

// The streaming kernels (GemmKernel::kStream; cpp/sm90/gemm_stream.cuh): grid.y runs over expert slots.
struct StreamGemmArgs : GroupedGemmCommon {
  const int32_t* active_experts = nullptr;  // [E] (null: grid.y indexes experts directly)
  const int32_t* num_active = nullptr;      // [1] (null: all grid.y slots are active)
  int tokens_per_pass = 8;                  // 8, 16, 32 or 64 (the plan's)
  int prefetch_blocks = 0;  // set by launch_stream_gemm: kStore blocks with linear index below this prefetch their
                            // weights into L2 before the PDL wait (4 x SMs: about one wave)
};

// The wgmma kernels (GemmKernel::kWgmma32 / 64 / 128; cpp/sm90/gemm_wgmma.cuh): grid.y runs over the token tiles of
// all experts, or over one token's slots (slot_experts). tile, act_tma and stage_k name the kernel instance (its
// template arguments); plan_wgmma_stage sets the last two by the plan's rule.
struct WgmmaGemmArgs : GroupedGemmCommon {
  int64_t act_num_rows = 0;    // rows of act (the TMA view's bound; 0: max_total_rows)
  int64_t max_total_rows = 0;  // host bound on expert_offsets[E] (sizes the grid)
  int tile = kTile32;          // token tile: kTile32, kTile64 or kTile128 (GemmPlan::token_tile)
  bool act_tma = true;         // the activation rows come by TMA (contiguous rows of a 16-byte aligned act), else the
                               // threads copy them (cp.async: act_rows, or an unaligned act)
  int stage_k = 0;             // K per pipeline stage: plan_stage_k(tile, K, act_tma)
};

// Every rule the arguments of a family's launcher must follow, written once: nullptr when they do, else what is wrong
// (the binding throws it with the call's name; the launcher returns cudaErrorInvalidValue). cpp/sm90/gemm_args.cpp.
const char* stream_gemm_args_error(const StreamGemmArgs& args);
const char* wgmma_gemm_args_error(const WgmmaGemmArgs& args);
// The plan's kernel names a family: nullptr for stream, wgmma32, wgmma64 and wgmma128, else the message.
const char* gemm_kernel_error(GemmKernel kernel);
// Sets args.act_tma (contiguous rows, no act_rows, of a 16-byte aligned act: read by TMA) and args.stage_k (the plan's
// K per stage for them, plan_stage_k) from args.tile, act, act_rows and K: the plan's choice for this call's rows.
void plan_wgmma_stage(WgmmaGemmArgs& args);

// The launchers: a switch on the arguments (streaming: tokens per pass, K % 64, gathered or staged rows, the
// quantizing epilogue, direct slots; wgmma: tile, stage K, TMA or copied rows, the quantizing epilogue, direct
// slots), after a guard that returns cudaErrorInvalidValue where the family's rules do not hold.
cudaError_t launch_stream_gemm(const StreamGemmArgs& args, cudaStream_t stream);
cudaError_t launch_wgmma_gemm(const WgmmaGemmArgs& args, cudaStream_t stream);

// Byte stride between the scale rows of the weights (GroupedGemmCommon::w_scale_row_bytes, or K/16 when unset).
#if defined(__CUDACC__)
__host__ __device__ __forceinline__
#else
inline
#endif
int64_t scale_row_bytes(const GroupedGemmCommon& a) {
  return a.w_scale_row_bytes > 0 ? a.w_scale_row_bytes : a.K / 16;
}

// The tiled order of the weights (GroupedGemmCommon::w_tiled): rows in groups of kWTileRows, K in chunks of
// kWTileK elements; chunk c of group g of an expert is kWTileRows rows of its bytes (codes: 128 per row, scale codes:
// 16), the chunks of a group one after the other, the groups of an expert one after the other.
constexpr int kWTileRows = 32, kWTileK = 256;
// Byte offset, from an expert's first byte, of byte b of weight row n (row_bytes: K / 2 for the codes, K / 16 for the
// scale codes) in the tiled order.
constexpr int64_t sm90_weight_tile_offset(int64_t n, int64_t b, int64_t row_bytes, int chunk_bytes) {
  return (n / kWTileRows) * kWTileRows * row_bytes + (b / chunk_bytes) * (kWTileRows * chunk_bytes) +
         (n % kWTileRows) * chunk_bytes + b % chunk_bytes;
}
// Whether weights of N rows (silu_mul: gate and up halves) and reduction length K can be in the tiled order: K a
// multiple of kWTileK, each half's rows a multiple of kWTileRows (prepare_weights asks: megamoe._C.sm90_weights_tileable).
constexpr bool sm90_weights_tileable(int64_t N, int64_t K, bool silu_mul) {
  return N > 0 && K > 0 && K % kWTileK == 0 && N % (silu_mul ? 2 * kWTileRows : kWTileRows) == 0;
}

// out[t, c] = sum_j topk_weights[t, j] * y[entry_row[t*k + j], c] (fp32 sum in j order,
// dropped entries skipped), cast to out_type. y [rows, H], fp32 or (y_bf16) bf16; H % 8 == 0, y and out
// 16-byte aligned.
cudaError_t launch_moe_combine(const void* y, bool y_bf16, const int32_t* entry_row, const float* topk_weights,
                               int64_t tokens, int top_k, int64_t hidden, void* out, ElemType out_type,
                               cudaStream_t stream);

}  // namespace megamoe::sm90

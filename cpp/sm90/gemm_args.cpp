// Every rule the arguments of the grouped-GEMM launchers must follow, written once with its message
// (megamoe/sm90_kernels.h stream_gemm_args_error, wgmma_gemm_args_error): the binding throws it, the launchers return
// cudaErrorInvalidValue. The rules both families share come first (common_error), then each family's own. Host only,
// so that cpp/tests/test_sm90_gemm_args.cpp checks it on the CPU.
#include <cstdint>

#include "megamoe/sm90_kernels.h"

namespace megamoe::sm90 {

namespace {

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

// The rules of the common part, the one-token rows (slot_experts) included: both families run them (the one-tile
// streaming kernel and wgmma tile 32) with the same inputs.
const char* common_error(const GroupedGemmCommon& a) {
  if (a.K <= 0 || a.K % 16 != 0) return "K must be a positive multiple of 16";
  if (a.N <= 0) return "N (weight rows) must be positive";
  if (!a.act || !a.w_data || !a.w_scale || !a.w_global_scale) return "act, w_data, w_scale and w_global_scale are needed";
  const bool slots = a.slot_experts != nullptr;
  if (bool(a.expert_offsets) == slots)
    return "give expert_offsets (grouped rows of moe_align) or slot_experts (one token's expert ids, row j = slot j), "
           "not both";
  if (a.grid_experts <= 0 || a.grid_experts > 65535) return "grid_experts must be in [1, 65535]";
  const bool silu_mul = a.epilogue == Epilogue::kSiluMul;
  if (silu_mul && a.N % 32 != 0) return "the silu_mul epilogue needs N = 2 I with I a multiple of 16";
  if (silu_mul && a.w_gs_per_expert != 2)
    return "the silu_mul epilogue needs w_global_scale with 2 entries per expert (gate, up)";
  if (silu_mul && a.out_bf16) return "a bfloat16 out needs the store epilogue (silu_mul writes fp32 out or out_operand)";
  if (a.out && a.out_bf16) return "give one of out and out_bf16";
  if (!a.out && !a.out_bf16 && !(silu_mul && a.out_operand)) return "give out (or out_operand with silu_mul)";
  if (a.out_operand && !silu_mul) return "out_operand (h as the gemm2 operand) needs the silu_mul epilogue";
  if (!silu_mul && (a.swiglu_clamp || a.swiglu_alpha != 1.f || a.swiglu_up_shift != 0.f))
    return "swiglu_limit, swiglu_alpha and swiglu_up_shift shape the silu_mul epilogue only";
  if (a.h_quant_gs && !(silu_mul && a.out_operand)) return "h_quant_scale (h quantized to NVFP4) needs out_operand";
  if (a.w_tiled && (!sm90_weights_tileable(a.N, a.K, silu_mul) || scale_row_bytes(a) != a.K / 16))
    return "w_tiled weights need K % 256 == 0, N % 32 == 0 (silu_mul: I % 32 == 0) and scale rows of K / 16 bytes";
  if (a.entry_row_out && !(slots && silu_mul))
    return "entry_row_out is written by the silu_mul GEMM with slot_experts only";
  if (slots) {
    if (!silu_mul && a.act_rows) return "slot_experts: the store GEMM reads staged rows (no act_rows)";
    if (silu_mul && !a.out_operand) return "slot_experts: the silu_mul GEMM writes h into out_operand";
    if (silu_mul && bool(a.act_rows) == bool(a.h_quant_gs))
      return "slot_experts: the silu_mul GEMM either gathers act through act_rows or reads staged rows with "
             "h_quant_scale";
  }
  return nullptr;
}

}  // namespace

const char* gemm_kernel_error(GemmKernel kernel) {
  switch (kernel) {
    case GemmKernel::kStream:
    case GemmKernel::kWgmma32:
    case GemmKernel::kWgmma64:
    case GemmKernel::kWgmma128: return nullptr;
    default: return "the plan's kernel is not one of stream, wgmma32, wgmma64, wgmma128";
  }
}

const char* stream_gemm_args_error(const StreamGemmArgs& a) {
  if (const char* err = common_error(a)) return err;
  const int nt = a.tokens_per_pass / 8;
  if (a.tokens_per_pass % 8 != 0 || (nt != 1 && nt != 2 && nt != 4 && nt != 8))
    return "the streaming kernel takes 8, 16, 32 or 64 tokens per pass";
  if (a.slot_experts) {
    if (nt != 1 || a.K % 64 != 0)
      return "slot_experts runs on the one-tile streaming kernel (8 tokens per pass) with K % 64 == 0";
    if (a.active_experts || a.num_active) return "slot_experts: every grid slot is a slot (no active_experts or num_active)";
  } else if (nt == 1 && a.h_quant_gs && a.act_rows) {
    return "h_quant_scale needs activation rows without act_rows on the one-tile streaming kernel";
  }
  return nullptr;
}

const char* wgmma_gemm_args_error(const WgmmaGemmArgs& a) {
  if (const char* err = common_error(a)) return err;
  const int tile = a.tile;
  if (tile != kTile32 && tile != kTile64 && tile != kTile128)
    return "the wgmma kernels take token tiles of 32, 64 or 128 (the plan's token_tile)";
  if (a.slot_experts && tile != kTile32) return "slot_experts runs on wgmma tile 32 (or the one-tile streaming kernel)";
  if (a.K % wg_min_stage_k(tile) != 0) return "K is not a multiple of this wgmma tile's K per stage (the plan's)";
  if (a.num_experts > kWgMaxExperts) return "the wgmma kernels take at most 1024 experts";
  if (scale_row_bytes(a) % 16 != 0 || scale_row_bytes(a) < a.K / 16)
    return "the wgmma kernels need scale rows of a multiple of 16 bytes, at least K / 16 (sm90_scale_rows)";
  if (!aligned16(a.w_data) || !aligned16(a.w_scale)) return "the wgmma kernels need 16-byte aligned w_data and w_scale";
  if (a.h_quant_gs && (a.act_rows || !aligned16(a.act) || !a.act_tma))
    return "h_quant_scale needs activation rows without act_rows here (16-byte aligned, read by TMA)";
  if (a.act_tma && (a.act_rows || !aligned16(a.act)))
    return "act_tma: TMA reads contiguous activation rows (no act_rows) of a 16-byte aligned act";
  if (a.stage_k != plan_stage_k(tile, a.K, a.act_tma))
    return "stage_k is not the plan's K per stage for this tile, K and activation rows (plan_stage_k)";
  if ((a.max_total_rows + tile - 1) / tile + a.grid_experts > 65535)
    return "too many token tiles for one wgmma grid (max_total_rows / tile + grid_experts > 65535)";
  return nullptr;
}

void plan_wgmma_stage(WgmmaGemmArgs& a) {
  a.act_tma = !a.act_rows && aligned16(a.act);
  a.stage_k = plan_stage_k(a.tile, a.K, a.act_tma);
}

}  // namespace megamoe::sm90

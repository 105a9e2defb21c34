// Launchers of the CUDA kernels shared by every GPU backend (cpp/common/*.cu).
//
// Plain C++ (no device code): included by the .cu files that implement them and by
// cpp/common/bind_common.cpp. Pointers are device pointers; every launcher is
// asynchronous on `stream` and returns the launch error (cudaSuccess when queued).
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

namespace megamoe {

enum class ElemType : int { kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2 };

// How the quantizer finds the decode global scale (docs/SPEC.md §1) of a row.
enum class GlobalScaleMode : int {
  kSingle = 0,     // global_scale[0] for every row
  kPerExpert = 1,  // global_scale[expert of the row] (static per-expert input_scale)
  kPerRow = 2,     // global_scale[r] (r = input row index)
  kPerRowDynamic = 3,  // computed from the row: amax(|row|) / (6*448), 1.0 for a zero row, NaN ignored
                       // (megamoe.backends.torch_ref.row_global_scales); written to row_scale_out[dst row]
};

// NVFP4 quantization of rows of a [*, cols] tensor (docs/SPEC.md §1), bit-identical to
// megamoe.nvfp4.quantize.
//
// Row r (0 <= r < rows) reads source row src_rows[r] (or r when src_rows is null)
// and writes destination row dst_row(r):
//   - plain: dst_row = r;
//   - grouped: rows are taken expert by expert; expert e owns input rows
//     [expert_offsets[e], expert_offsets[e+1]) and writes them to
//     dst_row = dst_offsets[e] + (r - expert_offsets[e]).
//     For the docs/SPEC.md §2 grouped layout dst_offsets[e] = sum_{j<e} round_up(tokens_j, 128).
// Outputs (each optional, null to skip):
//   data        uint8 [*, cols/2], low nibble first
//   scale       uint8 (e4m3) [*, cols/16], linear
//   scale_swz   docs/SPEC.md §2 buffer of a [sf_rows, cols/16] matrix; the caller zeroes it first
//               (its padding must be zero) and sizes it with sf_padded_bytes(sf_rows, cols/16)
//   dequant     bf16 [*, cols]: e2m1(code) * float(scale) (exact, global scale left out),
//               stored with each 8-element group in the order 0,4,1,5,2,6,3,7 (the operand
//               order of the sm90 GEMMs), or with dequant_lane_order in the lane order of the
//               sm90 wgmma GEMMs (megamoe/sm90_operand_order.hpp; cols % 64 == 0)
struct QuantizeArgs {
  const void* src = nullptr;
  ElemType src_type = ElemType::kBFloat16;
  int64_t src_row_stride = 0;  // elements
  const int32_t* src_rows = nullptr;
  int64_t rows = 0;
  int64_t cols = 0;  // multiple of 16
  const float* global_scale = nullptr;
  GlobalScaleMode gs_mode = GlobalScaleMode::kSingle;
  int num_experts = 0;                    // grouped when > 0
  const int32_t* expert_offsets = nullptr;  // [E+1] input rows per expert (device)
  const int32_t* dst_offsets = nullptr;     // [E] first destination row per expert (device)
  uint8_t* data = nullptr;
  uint8_t* scale = nullptr;
  uint8_t* scale_swz = nullptr;
  int64_t sf_rows = 0;  // rows of the swizzled matrix (for its tile count)
  uint16_t* dequant = nullptr;
  bool dequant_lane_order = false;
  float* row_scale_out = nullptr;  // kPerRowDynamic: the global scale of each destination row
  // Token order (plain rows only, dequant and row_scale_out only): the outputs of row r go to every row
  // scatter_rows[r * scatter_k + j] >= 0 (j < scatter_k) instead of row r; the row is quantized once for all of
  // them (e.g. a token's row of x into its k expert slots, when they share one global scale).
  const int32_t* scatter_rows = nullptr;
  int scatter_k = 0;
  // Plain rows, kPerExpert, no scatter_rows: row r uses global_scale[row_experts[r]] (int32, or int64 with
  // row_experts_int64); a row whose id is outside [0, row_experts_bound) is skipped (nothing written).
  const void* row_experts = nullptr;
  bool row_experts_int64 = false;
  int row_experts_bound = 0;
};
cudaError_t launch_quantize_nvfp4(const QuantizeArgs& args, cudaStream_t stream);

// Exact decode of NVFP4 rows (data [rows, cols/2], e4m3 scale [rows, cols/16]) to bf16
// e2m1 * scale in the operand order (lane_order: lane order) described for QuantizeArgs::dequant.
cudaError_t launch_nvfp4_to_operand(const uint8_t* data, const uint8_t* scale, int64_t rows, int64_t cols,
                                    uint16_t* dst, bool lane_order, cudaStream_t stream);

// amax(|x|) over a [rows, cols] tensor (NaN ignored) -> out[0] = amax / (6 * 448), or 1.0
// when amax is 0 (docs/SPEC.md §1 default global scale). `scratch` is one uint32 of device memory.
cudaError_t launch_dynamic_global_scale(const void* src, ElemType src_type, int64_t rows, int64_t cols,
                                        int64_t row_stride, uint32_t* scratch, float* out,
                                        cudaStream_t stream);

// docs/SPEC.md §2 swizzle of `batches` linear [rows, cols] e4m3 matrices into a buffer of
// batches * sf_padded_bytes(rows, cols) bytes. Every byte of the buffer is written
// (padding = 0).
cudaError_t launch_swizzle_scales(const uint8_t* linear, int64_t batches, int64_t rows, int64_t cols,
                                  uint8_t* swizzled, cudaStream_t stream);
cudaError_t launch_unswizzle_scales(const uint8_t* swizzled, int64_t batches, int64_t rows, int64_t cols,
                                    uint8_t* linear, cudaStream_t stream);

// Grouped: group g owns linear rows [src_offsets[g], src_offsets[g+1]) of a [*, cols]
// matrix; its swizzled block starts at row dst_row_offsets[g] (a multiple of 128) of one
// [total_rows, cols] docs/SPEC.md §2 buffer of sf_padded_bytes(total_rows, cols) bytes (every byte
// written; rows past a group's count are padding = 0). Offsets are device int32 arrays.
cudaError_t launch_swizzle_scales_grouped(const uint8_t* linear, int num_groups, const int32_t* src_offsets,
                                          const int32_t* dst_row_offsets, int64_t total_rows, int64_t cols,
                                          uint8_t* swizzled, cudaStream_t stream);
cudaError_t launch_unswizzle_scales_grouped(const uint8_t* swizzled, int num_groups, const int32_t* src_offsets,
                                            const int32_t* dst_row_offsets, int64_t total_rows, int64_t cols,
                                            uint8_t* linear, cudaStream_t stream);

// SF verifier (docs/SPEC.md §2): compares a swizzled buffer with the linear scales through the
// closed form (every logical (b, m, k)) and checks that every padding byte is zero.
// result: int64 [1 + 3 * max_records], zeroed by the launcher: result[0] = mismatching
// bytes, then (b, m, k) triples of the first min(result[0], max_records) mismatches found
// (in no particular order; m >= rows or k >= cols marks a padding byte).
cudaError_t launch_verify_swizzled(const uint8_t* linear, const uint8_t* swizzled, int64_t batches, int64_t rows,
                                   int64_t cols, int64_t* result, int max_records, cudaStream_t stream);
// Grouped variant (group index reported as b, m relative to the group).
cudaError_t launch_verify_swizzled_grouped(const uint8_t* linear, const uint8_t* swizzled, int num_groups,
                                           const int32_t* src_offsets, const int32_t* dst_row_offsets,
                                           int64_t total_rows, int64_t cols, int64_t* result, int max_records,
                                           cudaStream_t stream);

}  // namespace megamoe

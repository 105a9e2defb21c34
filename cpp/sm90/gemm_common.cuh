// Pieces shared by the sm90 NVFP4 GEMMs: exact NVFP4 -> bf16 dequantization in
// registers, the bf16 tensor-core MMA, the epilogue.
//
// Operand order. A 32-bit word of packed weights holds 8 consecutive elements
// n0..n7 (NVFP4: n0 in the low nibble). dequant_word() turns it into four bf16x2 registers
// P0..P3 with Pj = (n_j, n_{j+4}). A dot product does not care about the order of its
// terms as long as both operands use the same one, so activations are stored with each
// 8-element group in the order 0,4,1,5,2,6,3,7: their 32-bit words are then exactly the
// partners of P0..P3.
//
// Exactness. Pj holds each code's magnitude bits at bf16 bits 6..8 and its sign at bit 15 of
// its half (all other bits 0), so its value is e2m1 * 2^-126 (the 0.5 code is a bf16
// subnormal). Multiplying by the bf16 value scale * 2^119 (exact: 4 significant bits, within
// range for every e4m3 scale) gives e2m1 * scale * 2^-7, exact in bf16 (at most 6 significant
// bits, >= 2^-17). The 2^7 goes into the epilogue alpha (kDequantAlpha).
//
// Scale code. prepare_weights stores every e4m3 block scale once as a code byte (megamoe/backends/cuda_sm90.py
// sm90_scale_code; same bytes): |scale| = 2^k (1 + f / 8) with k in -9..8 (e4m3's subnormals normalized) is stored as
// c = ((k + 9) << 3) | f, so that c * 16 + 0x7680 are the bits of the bf16 value |scale| * 2^119 (exponent field
// k + 246, mantissa f << 4) and the scale pair of a lane is one byte permute and one multiply-add (scale_pair) instead
// of a table lookup in shared memory; c = 145 (bits 0x7F90) is a NaN scale. The sign of a negative scale moves into
// the 16 codes of its block (each code's sign bit flipped) and the codes of a block with a zero scale are zeroed, so
// that every code x scale product keeps its value.
//
// Weight bit layout (sm90 word layout). prepare_weights permutes the bits inside every 32-bit
// word once (megamoe/backends/cuda_sm90.py sm90_word_layout; same bytes, still 4.5 bits per
// weight) so that the pairs fall out of few instructions. Slots: the bf16x2 bits a pair needs,
// kPairSlots = bits 6,7,8,15 (n_j: magnitude bits 0..2, sign) and 22,23,24,31 (n_{j+4}).
// Slot s of pair j is stored at word bit
//   P0: s            -> P0 = w & kPairSlots
//   P1: (s + 3) % 32 -> P1 = rotr(w, 3) & kPairSlots
//   P2: (s + 6) % 32 -> P2 = rotr(w, 6) & kPairSlots
//   P3: 6<-3, 7<-4, 8<-0, 15<-1, 22<-19, 23<-20, 24<-16, 31<-17
//                    -> P3 = ((w & 0x001B001B) * (2^3 + 2^8 + 2^14)) & kPairSlots
// (P3: the three shifted copies of the 8 masked bits do not overlap, so the product is their
// OR and has no carries.) Per word 8 integer instructions (2 rotates, 5 LOP3, 1 IMAD) and 4
// bf16x2 multiplies; the natural nibble order took 13 (a shift, then mask, multiply-place,
// mask per pair). No layout gives every pair one rotate and one mask (no four rotated copies of
// kPairSlots tile the 32 bits), and none decodes in 7 with rotates and byte permutes (exhaustive
// searches).
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <cstdint>

#include "megamoe/nvfp4_device.cuh"
#include "megamoe/sm90_operand_order.cuh"
#include "megamoe/sm90_kernels.h"

namespace megamoe::sm90 {

constexpr float kDequantAlpha = 128.0f;  // 2^7, see above

// The bits of bf16(v), rounded to nearest even.
__device__ __forceinline__ uint16_t bf16_bits(float v) {
  const __nv_bfloat16 b = __float2bfloat16_rn(v);
  return *reinterpret_cast<const uint16_t*>(&b);
}

// Byte permute selector: byte i of a word into the low byte of both 16-bit halves, zeros above.
__host__ __device__ constexpr uint32_t scale_byte_sel(uint32_t i) { return i | (4u << 4) | (i << 8) | (4u << 12); }

// bf16x2 (both halves) of |scale| * 2^119 from the scale-code byte of `word` that `sel` (scale_byte_sel) picks.
__device__ __forceinline__ uint32_t scale_pair(uint32_t word, uint32_t sel) {
  return __byte_perm(word, 0u, sel) * 16u + 0x76807680u;
}

__device__ __forceinline__ uint32_t bf16x2_mul(uint32_t a, uint32_t b) {
  uint32_t d;
  asm("mul.rn.bf16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
  return d;
}

// The bf16x2 bits of a pair (see "Weight bit layout" above).
constexpr uint32_t kPairSlots = 0x81C081C0u;
constexpr uint32_t kP3Mask = 0x001B001Bu;
constexpr uint32_t kP3Mul = (1u << 3) | (1u << 8) | (1u << 14);

__device__ __forceinline__ uint32_t rotr(uint32_t w, uint32_t n) { return __funnelshift_r(w, w, n); }

// w: 8 e2m1 codes in the sm90 word layout; s2: scale_pair(); p[j] = (n_j, n_{j+4}) * scale * 2^-7.
__device__ __forceinline__ void dequant_word(uint32_t w, uint32_t s2, uint32_t (&p)[4]) {
  p[0] = bf16x2_mul(w & kPairSlots, s2);
  p[1] = bf16x2_mul(rotr(w, 3) & kPairSlots, s2);
  p[2] = bf16x2_mul(rotr(w, 6) & kPairSlots, s2);
  p[3] = bf16x2_mul(((w & kP3Mask) * kP3Mul) & kPairSlots, s2);
}

// D += A * B, m16n8k16, bf16 inputs, fp32 accumulators.
__device__ __forceinline__ void mma_bf16_16816(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                               uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// x * sigmoid(x) with the fast division (MUFU.RCP and a multiply, 2 ulp; x / inf = -0 for x below about -88), not the
// IEEE division's range checks and slow-path call per value; every kernel of this backend uses this one definition,
// so their h agree bit for bit.
__device__ __forceinline__ float silu(float x) { return __fdividef(x, 1.0f + expf(-x)); }

// Epilogue value of one accumulator: undo the dequant's 2^-7, then the global scales.
__device__ __forceinline__ float scaled(float acc, float alpha, float row_scale) {
  return ((acc * kDequantAlpha) * alpha) * row_scale;
}

// The expert's row of GroupedGemmCommon::bias ([N] floats), or null without a bias.
__device__ __forceinline__ const float* expert_bias(const GroupedGemmCommon& a, int expert) {
  return a.bias ? a.bias + int64_t(expert) * a.N : nullptr;
}
// v plus bias b[n] (b: expert_bias); v itself without a bias (not v + 0, which would turn -0 into +0).
__device__ __forceinline__ float add_bias(float v, const float* b, int64_t n) { return b ? v + __ldg(b + n) : v; }

// h of output column col (of I) from its gate and up products, megamoe.reference.swiglu: the expert's gate and up bias
// (b: expert_bias, gate row col and up row I + col), the optional clamp, then (up + shift) * gate * sigmoid(alpha *
// gate), which for alpha 1 and shift 0 is silu(gate) * up, bit for bit.
__device__ __forceinline__ float swiglu(const GroupedGemmCommon& a, const float* b, int64_t I, int64_t col, float gate,
                                        float up) {
  gate = add_bias(gate, b, col);
  up = add_bias(up, b, I + col);
  if (a.swiglu_clamp) {
    gate = fminf(gate, a.swiglu_limit);
    up = fminf(fmaxf(up, -a.swiglu_limit), a.swiglu_limit);
  }
  if (a.swiglu_up_shift != 0.f) up += a.swiglu_up_shift;
  return __fdividef(gate, 1.0f + expf(-(a.swiglu_alpha * gate))) * up;
}

// Output scales of one expert: alpha0 for the only (or the gate) accumulator, alpha1 for the up
// accumulator of kSiluMul: activation global scale times the weight global scale(s).
__device__ __forceinline__ void epilogue_alphas(const GroupedGemmCommon& a, int expert, bool silu_mul, float& alpha0,
                                                float& alpha1) {
  const float a_gs = a.a_global_scale ? a.a_global_scale[a.a_gs_per_expert ? expert : 0] : 1.0f;
  const float* wgs = a.w_global_scale + int64_t(expert) * a.w_gs_per_expert;
  alpha0 = a_gs * wgs[0];
  alpha1 = silu_mul ? a_gs * wgs[1] : alpha0;
}

// The global scale h is quantized with (GroupedGemmCommon::h_quant_gs; 1 when unset).
__device__ __forceinline__ float h_quant_scale(const GroupedGemmCommon& a, int expert) {
  return a.h_quant_gs ? a.h_quant_gs[a.h_gs_per_expert ? expert : 0] : 1.0f;
}

// operand_position, operand_column: megamoe/sm90_operand_order.hpp
// h[out_row, col] of the kSiluMul epilogue written as the bf16 gemm2 operand ([rows, I], operand order, or
// lane order for the wgmma GEMMs: megamoe/sm90_operand_order.hpp), rounded once, as staging would.
__device__ __forceinline__ void store_operand_bf16(uint16_t* out_operand, int64_t out_row, int64_t I, int64_t col,
                                                   float hv, bool lane_order) {
  out_operand[out_row * I + operand_column(col, lane_order)] = bf16_bits(hv);
}

// Element idx of the kStore output: fp32 out, or bf16 out_bf16 rounded once (GroupedGemmCommon::out_bf16).
__device__ __forceinline__ void store_out(const GroupedGemmCommon& a, int64_t idx, float v) {
  if (a.out_bf16) {
    a.out_bf16[idx] = bf16_bits(v);
  } else {
    a.out[idx] = v;
  }
}

// Expert slot -> expert and its row range; false when the slot is unused.
__device__ __forceinline__ bool expert_of_slot(const int32_t* active_experts, const int32_t* num_active,
                                               const int32_t* expert_offsets, int slot, int& expert,
                                               int& row_begin, int& rows) {
  if (num_active && slot >= *num_active) return false;
  expert = active_experts ? active_experts[slot] : slot;
  row_begin = expert_offsets[expert];
  rows = expert_offsets[expert + 1] - row_begin;
  return rows > 0;
}

// GroupedGemmCommon::slot_experts (one token, no align kernel): the expert id of slot `slot`, or -1 when dropped
// (outside [0, E)). The load goes through L2 (ld.global.cg): the GEMMs read it before their PDL wait.
__device__ __forceinline__ int slot_expert_id(const GroupedGemmCommon& a, int slot) {
  const int64_t id = a.slot_experts_int64 ? int64_t(__ldcg(static_cast<const long long*>(a.slot_experts) + slot))
                                          : int64_t(__ldcg(static_cast<const int*>(a.slot_experts) + slot));
  return id >= 0 && id < a.num_experts ? int(id) : -1;
}

struct ExpertTile {
  int expert, row_begin, rows, m0;
};

// Which expert and which kTile-token tile of it block `tile` owns, for the kernels whose grid.y runs over the
// token tiles of all experts (no host sync), in one pass: a block-wide inclusive scan of ceil(tokens_e / kTile)
// over the E = a.num_experts experts (warp_sums[kThreads / 32] is scratch); the thread of the expert whose tiles
// hold `tile` writes that expert, its row range and m0 (the tile's first token within the expert) to *found
// (shared memory). Returns the total tile count; *found is set when tile is below it. Call with all kThreads
// threads: its __syncthreads also publish what the block wrote to shared memory before the call. warp = tid >> 5
// and lane = tid & 31 come from the caller.
// kL2: the offsets are read through L2 (ld.global.cg), as a PDL kernel reads them before its wait (pdl.cuh rule 3).
template <int kThreads, int kTile, bool kL2 = false>
__device__ __forceinline__ int expert_tile_of_block(const GroupedGemmCommon& a, int E, int tile, int32_t* warp_sums,
                                                    ExpertTile* found, int tid, int warp, int lane) {
  int carry = 0;
  for (int base = 0; base < E; base += kThreads) {
    const int e = base + tid;
    int row_begin = 0, rows = 0;
    if (e < E) {
      row_begin = kL2 ? __ldcg(a.expert_offsets + e) : a.expert_offsets[e];
      rows = (kL2 ? __ldcg(a.expert_offsets + e + 1) : a.expert_offsets[e + 1]) - row_begin;
    }
    const int own = (rows + kTile - 1) / kTile;  // tiles of expert e
    int v = own;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const int t = __shfl_up_sync(0xffffffffu, v, o);
      if (lane >= o) v += t;
    }
    if (lane == 31) warp_sums[warp] = v;
    __syncthreads();
    int prefix = carry;
    for (int w = 0; w < warp; ++w) prefix += warp_sums[w];
    const int first = prefix + v - own;  // tiles of the experts before e
    if (tile >= first && tile < first + own) *found = {e, row_begin, rows, (tile - first) * kTile};
    int total = carry;
    for (int w = 0; w < kThreads / 32; ++w) total += warp_sums[w];
    carry = total;
    __syncthreads();
  }
  return carry;
}

}  // namespace megamoe::sm90

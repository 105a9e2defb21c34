// Device helpers for the NVFP4 number format (docs/SPEC.md §1), shared by the quantizer and the
// GEMM epilogues (the sm90 operand and lane orders they write: megamoe/sm90_operand_order.cuh). Every function here reproduces megamoe/nvfp4.py bit for bit: plain
// IEEE fp32 operations in the reference's order, no fast-math.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <cstdint>

namespace megamoe {

// e4m3 (fn) of a non-negative fp32, round to nearest even, saturating at 448.
__device__ __forceinline__ uint8_t e4m3_rne_satfinite(float v) {
  return static_cast<uint8_t>(__nv_cvt_float_to_fp8(v, __NV_SATFINITE, __NV_E4M3));
}

__device__ __forceinline__ float e4m3_to_float(uint8_t b) {
  __half_raw h = __nv_cvt_fp8_to_halfraw(static_cast<__nv_fp8_storage_t>(b), __NV_E4M3);
  return __half2float(__half(h));
}

// The E2M1 value nearest to v (ties to even), saturating at +-6, as an fp32: one of 0, +-0.5, +-1,
// +-1.5, +-2, +-3, +-4, +-6. NaN and every value that rounds to zero give +0 (no negative zero).
// Branch-free: adding and subtracting 1.5 * 2^k, whose ulp is the E2M1 spacing of |v|'s binade
// (0.5 below 2, 1 below 4, 2 above), rounds to that spacing in the fp32 adder's own ties-to-even; the
// exact sum of opposite values is +0.
__device__ __forceinline__ float e2m1_round(float v) {
  const float c = fminf(fmaxf(v, -6.0f), 6.0f);
  const float a = fabsf(c);
  const float m = a < 2.0f ? 0x1.8p22f : (a < 4.0f ? 0x1.8p23f : 0x1.8p24f);
  const float s = copysignf(m, c);
  const float r = __fsub_rn(__fadd_rn(c, s), s);
  return v == v ? r : 0.0f;
}

// The 4-bit code of an E2M1 value given by e2m1_round (magnitude code 0..7, sign bit 8):
// e2m1_code(e2m1_round(v)) is docs/SPEC.md §1's e2m1_rne_satfinite(v).
__device__ __forceinline__ uint32_t e2m1_code(float r) {
  const uint32_t b = __float_as_uint(r);
  const uint32_t mag = b & 0x7fffffffu;  // 0, 0.5 = 0x3F000000, then (bits >> 22) - 252 from 1.0 on
  const uint32_t m = mag >= 0x3F800000u ? (mag >> 22) - 252u : (mag != 0u ? 1u : 0u);
  return m | ((b >> 28) & 8u);
}

__device__ __forceinline__ float e2m1_to_float(uint32_t code) {
  const uint32_t m = code & 7u;
  const float a = m < 4u ? 0.5f * float(m) : (m < 6u ? float(m - 2u) : (m == 6u ? 4.f : 6.f));
  return (code & 8u) ? -a : a;
}

// One 16-element block of NVFP4 quantization (docs/SPEC.md §1, the reference's fp32 operations in its order) once
// its amax (the largest |x|, NaN dropped) is known: the e4m3 scale byte and value, and the divisor of the block's
// values, scale * gs.
struct Nvfp4Block {
  uint8_t scale_byte;
  float scale, denom;
  float rcp;  // the divisor's reciprocal for the fast path of nvfp4_quotient
  bool fast;  // whether that path is exact here (see nvfp4_quotient)
};

__device__ __forceinline__ Nvfp4Block nvfp4_block(float amax, float gs) {
  Nvfp4Block b;
  b.scale_byte = e4m3_rne_satfinite(__fdiv_rn(amax, __fmul_rn(6.0f, gs)));
  b.scale = e4m3_to_float(b.scale_byte);
  b.denom = __fmul_rn(b.scale, gs);
  b.fast = b.denom >= 0x1p-60f && b.denom <= 0x1p60f && amax <= 0x1p60f;
  float r0;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r0) : "f"(b.denom));
  b.rcp = __fmaf_rn(r0, __fmaf_rn(-b.denom, r0, 1.0f), r0);
  return b;
}

// x / b.denom as E2M1 rounding needs it: correctly rounded (IEEE division) wherever the quotient can round to a
// non-zero E2M1 value. With the divisor and amax within 2^+-60 (b.fast) it is the instruction sequence of the
// compiler's own IEEE division fast path (approximate reciprocal, one Newton step, quotient, exact residual,
// correction) with the reciprocal computed once for the block; that path is exact unless the operands lie near
// the ends of the exponent range, which in this range means a quotient far below 0.25 (E2M1 0 either way;
// tests/gpu/test_gpu_quantize.py checks quotients within 3 ulps of every rounding boundary over global scales
// 2^-75..2^75). Outside the range: the full division.
__device__ __forceinline__ float nvfp4_quotient_fast(const Nvfp4Block& b, float x) {
  const float q0 = __fmaf_rn(b.rcp, x, 0.0f);
  return __fmaf_rn(b.rcp, __fmaf_rn(-b.denom, q0, x), q0);
}
__device__ __forceinline__ float nvfp4_quotient(const Nvfp4Block& b, float x) {
  return b.fast ? nvfp4_quotient_fast(b, x) : __fdiv_rn(x, b.denom);
}

// x of block b quantized and decoded again: e2m1 * scale, exact in fp32 and in bf16 (+0 in a block whose divisor
// is 0). The bf16 GEMM operand of an NVFP4 activation holds these values.
__device__ __forceinline__ float nvfp4_dequantized(const Nvfp4Block& b, float x) {
  const float r = b.denom == 0.f ? 0.f : e2m1_round(nvfp4_quotient(b, x));
  return __fmul_rn(r, b.scale);
}

__device__ __forceinline__ float block_amax(const float (&x)[16]) {
  float m = 0.f;
#pragma unroll
  for (int i = 0; i < 16; ++i) m = fmaxf(m, fabsf(x[i]));  // fmaxf drops NaN
  return m;
}

// Quantizes one block of 16 values with global scale gs (docs/SPEC.md §1): its e4m3 scale byte and value, and in r
// its 16 E2M1 values (the division's two paths as whole loops: nvfp4_quotient).
__device__ __forceinline__ void nvfp4_quantize_block(const float (&x)[16], float gs, uint8_t& scale_byte, float& scale,
                                                     float (&r)[16]) {
  const Nvfp4Block b = nvfp4_block(block_amax(x), gs);
  scale_byte = b.scale_byte;
  scale = b.scale;
  if (b.denom == 0.f) {
#pragma unroll
    for (int i = 0; i < 16; ++i) r[i] = 0.f;
  } else if (b.fast) {
#pragma unroll
    for (int i = 0; i < 16; ++i) r[i] = e2m1_round(nvfp4_quotient_fast(b, x[i]));
  } else {
#pragma unroll
    for (int i = 0; i < 16; ++i) r[i] = e2m1_round(__fdiv_rn(x[i], b.denom));
  }
}

}  // namespace megamoe

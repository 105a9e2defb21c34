// The device writers of the sm90 GEMMs' activation orders (megamoe/sm90_operand_order.hpp): a block of 16 decoded
// NVFP4 values stored into a bf16 operand row in operand or lane order. Used by the quantizer's decode
// (cpp/common/quantize.cu: quantize_nvfp4's dequant, nvfp4_to_operand) and by the wgmma gemm1 epilogue that writes h
// as the gemm2 operand (cpp/sm90/gemm_wgmma.cuh).
#pragma once
#include <cuda_bf16.h>

#include <cstdint>

#include "megamoe/sm90_operand_order.hpp"

namespace megamoe {

// The 8 operand-order bf16 pairs of a block of 16 values (E2M1 values already multiplied by their e4m3 scale: exact).
__device__ __forceinline__ void operand_pairs(const float (&v)[16], uint32_t (&w)[8]) {
#pragma unroll
  for (int g = 0; g < 2; ++g) {
#pragma unroll
    for (int p = 0; p < 8; p += 2) {
      __nv_bfloat162 b = __floats2bfloat162_rn(v[g * 8 + operand_order(p)], v[g * 8 + operand_order(p + 1)]);
      w[g * 4 + p / 2] = *reinterpret_cast<uint32_t*>(&b);
    }
  }
}

// Block kb (16 E2M1 values v, already multiplied by their e4m3 scale: exact) of a bf16 operand row in
// operand order, 2 x 16 bytes, or in lane order (its 8 pairs at their lane-order places).
__device__ __forceinline__ void store_operand_block(const float (&v)[16], uint16_t* row, int64_t kb, bool lane_order) {
  uint32_t w[8];
  operand_pairs(v, w);
  if (lane_order) {
    uint16_t* blk = row + (kb >> 2) * 64;
    const int p0 = int(kb & 3) * 16;  // operand position of the first pair within the 64-block
#pragma unroll
    for (int i = 0; i < 8; ++i) *reinterpret_cast<uint32_t*>(blk + lane_order_position(p0 + 2 * i)) = w[i];
  } else {
    uint4* dst = reinterpret_cast<uint4*>(row + kb * 16);
    dst[0] = make_uint4(w[0], w[1], w[2], w[3]);
    dst[1] = make_uint4(w[4], w[5], w[6], w[7]);
  }
}

// Lane order in whole 16-byte chunks: the 4 lanes of a quad (lanes 4m..4m+3, `quad_mask` their bits) hold the
// blocks kb = 4b..4b+3 of one 64-element block, lane & 3 == kb & 3 (v: each lane's 16 values, as for
// store_operand_block). In lane order the 16-byte chunk c of the 64-block holds pair c of each of the 4 blocks, so
// the quad transposes its operand_pairs through `stage` (32 words of shared memory of its own, 16-byte aligned; word
// p stored at (p + rot) % 32, rot a multiple of 4 that spreads the quads of a warp over the banks) and each lane
// returns chunks tig and tig + 4 (store_lane_order_chunks): two 16-byte stores per lane instead of eight 4-byte
// ones. All 4 lanes call it; the first __syncwarp also orders any earlier reads of `stage` by the quad before it is
// overwritten.
__device__ __forceinline__ void lane_order_chunks(const float (&v)[16], uint32_t* stage, int rot, int tig,
                                                  unsigned quad_mask, uint4 (&chunk)[2]) {
  uint32_t w[8];
  operand_pairs(v, w);
  __syncwarp(quad_mask);
#pragma unroll
  for (int i = 0; i < 8; ++i) stage[(4 * i + tig + rot) & 31] = w[i];  // lane_order_unit(8 tig + i) = 4 i + tig
  __syncwarp(quad_mask);
#pragma unroll
  for (int h = 0; h < 2; ++h) chunk[h] = *reinterpret_cast<const uint4*>(stage + ((4 * (tig + 4 * h) + rot) & 31));
}

// Stores lane tig's chunks of lane_order_chunks() into the bf16 operand row `row` (block kb's 64-block).
__device__ __forceinline__ void store_lane_order_chunks(uint16_t* row, int64_t kb, int tig, const uint4 (&chunk)[2]) {
#pragma unroll
  for (int h = 0; h < 2; ++h) *reinterpret_cast<uint4*>(row + (kb >> 2) * 64 + (tig + 4 * h) * 8) = chunk[h];
}

// Shared memory of a CTA of up to kThreads threads for lane_order_chunks(): 32 words per quad of threads.
template <int kThreads>
struct LaneOrderStage {
  uint32_t words[kThreads / 4][32];
};

// The quad's stage and its bank rotation: quad m of a warp at 4 * pi(m), pi = 0 4 1 5 2 6 3 7, so that the 8
// quads' stores of one pair fall on distinct banks and the two quads of each 16-byte read phase on distinct chunks.
template <int kThreads>
__device__ __forceinline__ uint32_t* lane_order_stage(LaneOrderStage<kThreads>& st, int& rot) {
  const int m = (threadIdx.x & 31) >> 2;
  rot = 4 * ((m >> 1) + 4 * (m & 1));
  return st.words[threadIdx.x >> 2];
}

// Block kb of 16 values v (E2M1 values already multiplied by their e4m3 scale: exact) of row `row` stored into the
// bf16 operand rows of `out` (`cols` wide): row `row`, or with scatter_rows every row scatter_rows[row * scatter_k
// + j] >= 0 (j < scatter_k). In operand order, or with lane_order in lane order, in whole 16-byte chunks through
// `st` (lane_order_chunks): that needs kb & 3 == threadIdx.x & 3 and the 4 threads of the quad calling together.
// The row arguments are references (the caller's kernel arguments), read where they are used.
template <int kThreads>
__device__ __forceinline__ void store_operand_rows(const float (&v)[16], uint16_t* const& out, const int64_t& cols,
                                                   int64_t row, int64_t kb, const bool& lane_order,
                                                   const int32_t* const& scatter_rows, const int& scatter_k,
                                                   LaneOrderStage<kThreads>& st) {
  if (lane_order) {
    const int tig = int(threadIdx.x & 3);
    int rot;
    uint32_t* stage = lane_order_stage(st, rot);
    uint4 chunk[2];
    lane_order_chunks(v, stage, rot, tig, 0xFu << (threadIdx.x & 28), chunk);
    if (scatter_rows) {
      for (int j = 0; j < scatter_k; ++j) {
        const int32_t d = __ldg(scatter_rows + row * scatter_k + j);
        if (d >= 0) store_lane_order_chunks(out + int64_t(d) * cols, kb, tig, chunk);
      }
    } else {
      store_lane_order_chunks(out + row * cols, kb, tig, chunk);
    }
  } else if (scatter_rows) {
    for (int j = 0; j < scatter_k; ++j) {
      const int32_t d = __ldg(scatter_rows + row * scatter_k + j);
      if (d >= 0) store_operand_block(v, out + int64_t(d) * cols, kb, false);
    }
  } else {
    store_operand_block(v, out + row * cols, kb, false);
  }
}

}  // namespace megamoe

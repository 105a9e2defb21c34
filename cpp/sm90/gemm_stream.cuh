// Streaming NVFP4 grouped GEMM for few tokens per expert (decode): memory-bound, so
// the job is to pull the 4.5-bit weights through at HBM speed.
//
// Swap-AB: the weights are the MMA "A" operand (m16 = 16 weight rows), the tokens the
// "B" operand (n8 = up to 8 tokens of one expert). A block = 4 warps owns 32 weight rows
// (two m16 tiles) of one expert and splits K four ways between its warps; the partial
// sums are added in shared memory in a fixed order. Each lane streams 32 contiguous
// bytes (64 elements) of 4 weight rows per step with 16-byte non-allocating loads and
// dequantizes them in registers (gemm_common.cuh); no dequantized weight ever reaches
// memory. Tokens beyond 8 are handled in further passes over the (then L2-resident)
// weight rows.
//
// K split: the K dimension is cut in slices of 64 elements (4 scale blocks); lane
// (warp w, tig) takes slices w*4 + tig, +16, +32, ... so a warp reads 128 contiguous
// bytes per weight row per step. Which K elements an MMA k-position stands for depends
// only on tig, the same for the A lane (row g) and the B lane (token g), which is what
// makes the per-lane K assignment valid.
#pragma once
#include "gemm_common.cuh"
#include "megamoe/sm90_kernels.h"
#include "pdl.cuh"

namespace megamoe::sm90 {

constexpr int kStreamThreads = 128;
constexpr int kStreamRows = 32;

__device__ __forceinline__ uint4 ldg_stream(const void* p) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
}

// Activation operand of one token row, 8 elements (one 16-byte word) at element `col`.
// Either the staged operand-order buffer, or (fused gather) a bf16 row of x in natural
// order, interleaved here with byte permutes into operand order (megamoe/sm90_operand_order.hpp: stored position
// operand_position(j) of element j).
__device__ __forceinline__ uint4 interleave_act(uint4 u) {
  uint4 v;
  v.x = __byte_perm(u.x, u.z, 0x5410);  // (x0, x4)
  v.y = __byte_perm(u.x, u.z, 0x7632);  // (x1, x5)
  v.z = __byte_perm(u.y, u.w, 0x5410);  // (x2, x6)
  v.w = __byte_perm(u.y, u.w, 0x7632);  // (x3, x7)
  return v;
}
__device__ __forceinline__ uint4 load_act(const uint16_t* row, int64_t col, bool natural) {
  const uint4 u = __ldg(reinterpret_cast<const uint4*>(row + col));
  return natural ? interleave_act(u) : u;
}


// PDL prologue of the streaming kernels (launched with the PDL attribute, see pdl.cuh).
// The down-projection GEMM (kStore) first asks L2 to fetch this block's weight rows (data and
// scales, contiguous ranges of one expert), which depend on nothing computed in this forward
// except the expert list of the align kernel -- complete by pdl.cuh rule 3, read through L2 --
// so the weight stream starts while the gate/up GEMM before it drains. Only the first
// a.prefetch_blocks blocks (about one wave: the ones that can start during the previous GEMM's
// tail) do it; later blocks stream exactly as without PDL. Then every thread waits for the
// predecessor grid and releases the next one. kDirect: the expert of a slot is a.slot_experts' (the token's
// topk_ids, written before the forward: complete by rule 3 as well).
template <bool kDirect = false>
__device__ __forceinline__ void stream_pdl_prologue(const StreamGemmArgs& a) {
  const int slot = int(blockIdx.y), rb = int(blockIdx.x);
  const int64_t linear_block = int64_t(blockIdx.y) * gridDim.x + blockIdx.x;
  if (a.epilogue == Epilogue::kStore && threadIdx.x == 0 && linear_block < a.prefetch_blocks) {
    const bool active = kDirect || !a.num_active || slot < __ldcg(a.num_active);
    const int expert = kDirect            ? slot_expert_id(a, slot)
                       : a.active_experts ? (active ? __ldcg(a.active_experts + slot) : -1)
                                          : slot;
    const int64_t n0 = int64_t(rb) * kStreamRows;
    const int64_t nrows = a.N - n0 < kStreamRows ? a.N - n0 : kStreamRows;
    if (active && expert >= 0 && expert < a.num_experts && nrows > 0) {
      const int64_t first = int64_t(expert) * a.N + n0, row_bytes = a.K / 2;
      const int64_t srs = scale_row_bytes(a);
      prefetch_l2_bulk(a.w_data + first * row_bytes, uint32_t(nrows * row_bytes));
      prefetch_l2_bulk(a.w_scale + first * srs, uint32_t(nrows * srs));
    }
  }
  griddep_sync_and_release();
}

// The 4 weight rows of this lane in weight-row block rb of `expert`: (m-tile mt, half hh) -> row
// g + 8*hh of the tile (kSiluMul: tile 0 the gate column rb*16 + g + 8*hh, tile 1 its up column).
// A row past the end is marked invalid and points at row 0. wstep, sstep: load_weight_slice's steps in this order.
__device__ __forceinline__ void stream_weight_rows(const StreamGemmArgs& a, int expert, unsigned rb, int g,
                                                   bool silu_mul, int64_t N, int64_t row_bytes,
                                                   const uint8_t* (&wrow)[2][2], const uint8_t* (&srow)[2][2],
                                                   bool (&rvalid)[2][2], int64_t& wstep, int64_t& sstep) {
  wstep = a.w_tiled ? kWTileRows * 128 : 128;
  sstep = a.w_tiled ? kWTileRows * 16 : 16;
  const int64_t I = N / 2;
  const int64_t srs = scale_row_bytes(a);
  const uint8_t* wd = a.w_data + int64_t(expert) * N * row_bytes;
  const uint8_t* ws = a.w_scale + int64_t(expert) * N * srs;
#pragma unroll
  for (int mt = 0; mt < 2; ++mt) {
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      const int r = g + 8 * hh;
      int64_t n;
      if (silu_mul) {
        const int64_t col = int64_t(rb) * 16 + r;
        rvalid[mt][hh] = col < I;
        n = mt * I + col;
      } else {
        n = int64_t(rb) * kStreamRows + mt * 16 + r;
        rvalid[mt][hh] = n < N;
      }
      if (!rvalid[mt][hh]) n = 0;
      // tiled weights (a.w_tiled): the row's first 128 code bytes and 16 scale bytes (its chunk 0)
      wrow[mt][hh] = wd + (a.w_tiled ? sm90_weight_tile_offset(n, 0, row_bytes, 128) : n * row_bytes);
      srow[mt][hh] = ws + (a.w_tiled ? sm90_weight_tile_offset(n, 0, srs, 16) : n * srs);
    }
  }
}

// Weight words (wv[mt][hh][i]: elements 8i..8i+7 of the slice) and the 4 packed scale codes of K slice
// s (64 elements) of the lane's 4 rows; zeros for invalid rows and past the end of K.
// kVec: K % 64 == 0 (16-byte aligned rows, whole slices); else 8-byte loads, one scale block at a time.
// wstep, sstep (kVec): bytes from a row's chunk of 4 slices (256 elements) to its next, of the codes (128 row-major,
// 32 * 128 tiled) and of the scale codes (16, 32 * 16); the slice's 32 and 4 bytes are at (s % 4) * 32 and * 4 of
// its chunk in both orders.
// (slices and Kb by reference: the multi-tile kernels then compile as with this body written in place.)
template <bool kVec>
__device__ __forceinline__ void load_weight_slice(int64_t s, const int64_t& slices, const int64_t& Kb,
                                                  const uint8_t* const (&wrow)[2][2],
                                                  const uint8_t* const (&srow)[2][2], const bool (&rvalid)[2][2],
                                                  int64_t wstep, int64_t sstep, uint32_t (&wv)[2][2][8],
                                                  uint32_t (&sc)[2][2]) {
  const bool svalid = s < slices;
  const int64_t wo = (s >> 2) * wstep + (s & 3) * 32, so = (s >> 2) * sstep + (s & 3) * 4;
#pragma unroll
  for (int mt = 0; mt < 2; ++mt) {
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      if (kVec) {
        uint4 x0 = make_uint4(0, 0, 0, 0), x1 = x0;
        uint32_t sv = 0;
        if (rvalid[mt][hh] && svalid) {
          x0 = ldg_stream(wrow[mt][hh] + wo);
          x1 = ldg_stream(wrow[mt][hh] + wo + 16);
          sv = __ldg(reinterpret_cast<const uint32_t*>(srow[mt][hh] + so));
        }
        wv[mt][hh][0] = x0.x; wv[mt][hh][1] = x0.y; wv[mt][hh][2] = x0.z; wv[mt][hh][3] = x0.w;
        wv[mt][hh][4] = x1.x; wv[mt][hh][5] = x1.y; wv[mt][hh][6] = x1.z; wv[mt][hh][7] = x1.w;
        sc[mt][hh] = sv;
      } else {
        uint32_t sv = 0;
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const int64_t b = s * 4 + j;
          uint2 x = make_uint2(0, 0);
          if (rvalid[mt][hh] && b < Kb) {
            x = __ldg(reinterpret_cast<const uint2*>(wrow[mt][hh] + b * 8));
            sv |= uint32_t(__ldg(srow[mt][hh] + b)) << (8 * j);
          }
          wv[mt][hh][2 * j] = x.x;
          wv[mt][hh][2 * j + 1] = x.y;
        }
        sc[mt][hh] = sv;
      }
    }
  }
}

// bf16x2 scales of scale block blk (0..3) of the slice, made at each block start (short live range: fewer
// registers) from the scale codes (gemm_common.cuh, "Scale code").
__device__ __forceinline__ void slice_block_scales(const uint32_t (&sc)[2][2], int blk, uint32_t (&s2)[2][2]) {
  const uint32_t sel = scale_byte_sel(uint32_t(blk));
#pragma unroll
  for (int mt = 0; mt < 2; ++mt)
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) s2[mt][hh] = scale_pair(sc[mt][hh], sel);
}

// Weight word i (k16 of the slice) of both m-tiles, dequantized, times the activation words b[nt] of
// NT token tiles: acc[mt][nt] += A(mt) * B(nt).
template <int NT>
__device__ __forceinline__ void mma_weight_word(float (&acc)[2][NT][4], const uint32_t (&wv)[2][2][8],
                                                const uint32_t (&s2)[2][2], int i, const uint4 (&b)[NT]) {
#pragma unroll
  for (int mt = 0; mt < 2; ++mt) {
    uint32_t p0[4], p1[4];
    dequant_word(wv[mt][0][i], s2[mt][0], p0);
    dequant_word(wv[mt][1][i], s2[mt][1], p1);
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
      mma_bf16_16816(acc[mt][nt], p0[0], p1[0], p0[1], p1[1], b[nt].x, b[nt].y);
      mma_bf16_16816(acc[mt][nt], p0[2], p1[2], p0[3], p1[3], b[nt].z, b[nt].w);
    }
  }
}

// kSiluMul with a.h_quant_gs (W4A4 with a static scale for h; gs its value for this expert) for the 8 tokens from
// tok of one token tile: h quantized to NVFP4 and written as its exact bf16 decode in operand order, the W4A4 gemm2
// input, bit for bit what quantize_nvfp4 makes of the fp32 h written otherwise. The block's 16 columns
// rb * 16 + g + 8 hh are one NVFP4 block, all in this warp: a token's amax is the max over hh and the shuffles
// over g. Called by the whole warp; tokens past `rows` are computed as 0 and not stored, the columns are valid or
// not as a whole (I % 16 == 0).
__device__ __forceinline__ void stream_h_nvfp4(const StreamGemmArgs& a, const float (&sum)[2][4], int tok, int rows,
                                               int row_begin, unsigned rb, int g, int tig, const bool (&rvalid)[2][2],
                                               int64_t I, float alpha0, float alpha1, float gs, const float* bias) {
  float hv[2][2], m[2] = {0.f, 0.f};
#pragma unroll
  for (int hh = 0; hh < 2; ++hh) {
#pragma unroll
    for (int t = 0; t < 2; ++t) {
      const int tk = tok + 2 * tig + t;
      float v = 0.f;
      if (tk < rows && rvalid[0][hh]) {
        const float rs = a.a_row_scale ? a.a_row_scale[int64_t(row_begin) + tk] : 1.0f;
        v = swiglu(a, bias, I, int64_t(rb) * 16 + g + 8 * hh, scaled(sum[0][2 * hh + t], alpha0, rs),
                   scaled(sum[1][2 * hh + t], alpha1, rs));
      }
      hv[hh][t] = v;
      m[t] = fmaxf(m[t], fabsf(v));  // fmaxf drops NaN, as the quantizer's block amax does
    }
  }
#pragma unroll
  for (int t = 0; t < 2; ++t) {
#pragma unroll
    for (int o = 4; o < 32; o <<= 1) m[t] = fmaxf(m[t], __shfl_xor_sync(0xffffffffu, m[t], o));
    const int tk = tok + 2 * tig + t;
    if (tk >= rows) continue;
    const Nvfp4Block b = nvfp4_block(m[t], gs);
#pragma unroll
    for (int hh = 0; hh < 2; ++hh)
      if (rvalid[0][hh])
        store_operand_bf16(a.out_operand, int64_t(row_begin) + tk, I, int64_t(rb) * 16 + g + 8 * hh,
                           nvfp4_dequantized(b, hv[hh][t]), false);
  }
}

// End of one pass over the tokens tok0 .. tok0 + 8*NT - 1: the 4 warps' partial sums are added in shared
// memory in a fixed order (warp w finishes the token tiles nt % 4 == w), scaled and written. kOperandOut:
// the kSiluMul epilogue writes h as the bf16 gemm2 operand when a.out_operand is set (its NVFP4 decode with
// a.h_quant_gs: stream_h_nvfp4).
template <int NT, bool kOperandOut, bool kQuantH>
__device__ __forceinline__ void stream_pass_epilogue(const StreamGemmArgs& a, const float (&acc)[2][NT][4],
                                                     float (&partial)[4][2][NT][4][32], int tok0, int rows,
                                                     int row_begin, unsigned rb, int warp, int lane, int g, int tig,
                                                     bool silu_mul, const bool (&rvalid)[2][2], int64_t N,
                                                     float alpha0, float alpha1, float h_gs, const float* bias) {
  const int64_t I = N / 2;
#pragma unroll
  for (int mt = 0; mt < 2; ++mt)
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int i = 0; i < 4; ++i) partial[warp][mt][nt][i][lane] = acc[mt][nt][i];
  __syncthreads();
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) {
    if ((nt & 3) != warp) continue;
    float sum[2][4];
#pragma unroll
    for (int mt = 0; mt < 2; ++mt)
#pragma unroll
      for (int i = 0; i < 4; ++i)
        sum[mt][i] = ((partial[0][mt][nt][i][lane] + partial[1][mt][nt][i][lane]) + partial[2][mt][nt][i][lane]) +
                     partial[3][mt][nt][i][lane];
    // c0/c1: row g, tokens 2tig/2tig+1; c2/c3: row g+8.
    if (kQuantH && silu_mul && a.out_operand && a.h_quant_gs) {
      stream_h_nvfp4(a, sum, tok0 + nt * 8, rows, row_begin, rb, g, tig, rvalid, I, alpha0, alpha1, h_gs, bias);
      continue;
    }
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
#pragma unroll
      for (int t = 0; t < 2; ++t) {
        const int tok = tok0 + nt * 8 + 2 * tig + t;
        if (tok >= rows) continue;
        const int64_t out_row = row_begin + tok;
        const float rs = a.a_row_scale ? a.a_row_scale[out_row] : 1.0f;
        if (silu_mul) {
          if (!rvalid[0][hh]) continue;
          const float gate = scaled(sum[0][2 * hh + t], alpha0, rs);
          const float up = scaled(sum[1][2 * hh + t], alpha1, rs);
          const int64_t col = int64_t(rb) * 16 + g + 8 * hh;
          const float hv = swiglu(a, bias, I, col, gate, up);
          if (kOperandOut && a.out_operand) {
            store_operand_bf16(a.out_operand, out_row, I, col, hv, false);
          } else {
            a.out[out_row * I + col] = hv;
          }
        } else {
#pragma unroll
          for (int mt = 0; mt < 2; ++mt) {
            if (!rvalid[mt][hh]) continue;
            const int64_t n = int64_t(rb) * kStreamRows + mt * 16 + g + 8 * hh;
            store_out(a, out_row * N + n, add_bias(scaled(sum[mt][2 * hh + t], alpha0, rs), bias, n));
          }
        }
      }
    }
  }
  __syncthreads();
}

// NT: n8 token tiles per pass (8*NT tokens share one dequantization of the weights).
template <bool kVec, int NT>
__global__ void __launch_bounds__(kStreamThreads) stream_gemm_kernel(StreamGemmArgs a) {
  constexpr int kChunkWords = NT >= 8 ? 1 : 8 / NT;  // activation words loaded at once (32 registers)
  __shared__ float partial[4][2][NT][4][32];
  stream_pdl_prologue(a);

  int expert, row_begin, rows;
  if (!expert_of_slot(a.active_experts, a.num_active, a.expert_offsets, blockIdx.y, expert, row_begin, rows)) return;

  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, tig = lane & 3;
  const int64_t K = a.K, N = a.N, Kb = K / 16, slices = (Kb + 3) / 4, row_bytes = K / 2;
  const bool silu_mul = a.epilogue == Epilogue::kSiluMul;
  const bool natural = a.act_rows != nullptr;

  const uint8_t* wrow[2][2];
  const uint8_t* srow[2][2];
  bool rvalid[2][2];
  int64_t wstep, sstep;
  stream_weight_rows(a, expert, blockIdx.x, g, silu_mul, N, row_bytes, wrow, srow, rvalid, wstep, sstep);
  float alpha0, alpha1;
  epilogue_alphas(a, expert, silu_mul, alpha0, alpha1);

  for (int tok0 = 0; tok0 < rows; tok0 += 8 * NT) {
    float acc[2][NT][4];
    const uint16_t* arow[NT];
    bool tvalid[NT];
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
      const int tok = tok0 + nt * 8 + g;
      tvalid[nt] = tok < rows;
      const int64_t r = int64_t(row_begin) + (tvalid[nt] ? tok : 0);
      arow[nt] = a.act + (natural ? int64_t(a.act_rows[r]) : r) * K;
#pragma unroll
      for (int mt = 0; mt < 2; ++mt)
#pragma unroll
        for (int i = 0; i < 4; ++i) acc[mt][nt][i] = 0.f;
    }

    uint32_t wv[2][2][8], sc[2][2];
    // The trip count must be the same for the whole warp (mma.sync is warp-collective):
    // lanes past the last slice load zeros.
    for (int64_t s0 = warp * 4; s0 < slices; s0 += 16) {
      const int64_t s = s0 + tig;
      load_weight_slice<kVec>(s, slices, Kb, wrow, srow, rvalid, wstep, sstep, wv, sc);
#pragma unroll
      for (int c0 = 0; c0 < 8; c0 += kChunkWords) {
        uint4 av[NT][kChunkWords];
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
          for (int w = 0; w < kChunkWords; ++w) {
            const int i = c0 + w;
            av[nt][w] = make_uint4(0, 0, 0, 0);
            if (tvalid[nt] && (kVec ? s < slices : s * 4 + i / 2 < Kb)) av[nt][w] = load_act(arow[nt], s * 64 + i * 8, natural);
          }
#pragma unroll
        for (int w = 0; w < kChunkWords; ++w) {
          const int i = c0 + w;
          uint32_t s2[2][2];
          slice_block_scales(sc, i / 2, s2);
          uint4 b[NT];
#pragma unroll
          for (int nt = 0; nt < NT; ++nt) b[nt] = av[nt][w];
          mma_weight_word<NT>(acc, wv, s2, i, b);
        }
      }
    }
    stream_pass_epilogue<NT, true, true>(a, acc, partial, tok0, rows, row_begin, blockIdx.x, warp, lane, g, tig, silu_mul,
                                   rvalid, N, alpha0, alpha1, h_quant_scale(a, expert), expert_bias(a, expert));
  }
}

// One token tile per pass, staged operand-order activations: the decode kernel (the plan runs it up to
// kStreamOneTileUpTo tokens per expert), kept apart from the multi-tile loop.
// kFused (W4A16 only): the activation rows are gathered from x (a.act_rows, natural
// order, interleaved in registers as in the multi-tile kernel) and the kSiluMul epilogue may
// write h straight as the bf16 gemm2 operand (a.out_operand), so no staging kernel runs between
// align, gemm1 and gemm2. Same sums, same roundings as the staged path (bf16 x is staged unchanged;
// h is rounded to bf16 once either way), so results are bit-identical to it.
// kQuantH (W4A4 with a static scale for h, staged rows): the kSiluMul epilogue quantizes h and writes its NVFP4
// decode as the gemm2 operand (stream_h_nvfp4); an instantiation of its own, so that the others keep their registers.
// One block: weight-row block rb (32 rows, or 16 gate + 16 up columns) of expert slot `slot`, all its tokens.
// kDirect (GroupedGemmCommon::slot_experts): slot j is row j of expert slot_experts[j], no row when that id is dropped;
// the first weight-row block of each slot writes a.entry_row_out[j] when set.
template <bool kVec, bool kFused, bool kQuantH, bool kDirect = false>  // kVec: K % 64 == 0 (16-byte aligned weight
                                                                       // rows, whole slices)
__device__ __forceinline__ void stream_nt1_item(const StreamGemmArgs& a, unsigned slot, unsigned rb,
                                                float (&partial)[4][2][1][4][32]) {
  int expert, row_begin, rows;
  if constexpr (kDirect) {
    expert = slot_expert_id(a, int(slot));
    row_begin = int(slot);
    rows = expert >= 0 ? 1 : 0;
    if (a.entry_row_out && rb == 0 && threadIdx.x == 0) a.entry_row_out[slot] = expert >= 0 ? int(slot) : -1;
    if (expert < 0) return;
  } else if (!expert_of_slot(a.active_experts, a.num_active, a.expert_offsets, slot, expert, row_begin, rows)) {
    return;
  }

  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, tig = lane & 3;
  const int64_t K = a.K, N = a.N, Kb = K / 16, slices = (Kb + 3) / 4, row_bytes = K / 2;
  const bool silu_mul = a.epilogue == Epilogue::kSiluMul;

  const uint8_t* wrow[2][2];
  const uint8_t* srow[2][2];
  bool rvalid[2][2];
  int64_t wstep, sstep;
  stream_weight_rows(a, expert, rb, g, silu_mul, N, row_bytes, wrow, srow, rvalid, wstep, sstep);
  float alpha0, alpha1;
  epilogue_alphas(a, expert, silu_mul, alpha0, alpha1);

  for (int tok0 = 0; tok0 < rows; tok0 += 8) {
    float acc[2][1][4];
#pragma unroll
    for (int mt = 0; mt < 2; ++mt)
#pragma unroll
      for (int i = 0; i < 4; ++i) acc[mt][0][i] = 0.f;
    const bool tvalid = tok0 + g < rows;
    const int64_t grow = int64_t(row_begin + tok0 + (tvalid ? g : 0));
    const uint16_t* arow = a.act + (kFused && a.act_rows ? int64_t(a.act_rows[grow]) : grow) * K;

    // The trip count must be the same for the whole warp (mma.sync is warp-collective):
    // lanes past the last slice load zeros.
    for (int64_t s0 = warp * 4; s0 < slices; s0 += 16) {
      const int64_t s = s0 + tig;
      const bool svalid = s < slices;
      uint32_t wv[2][2][8];
      uint32_t sc[2][2];
      load_weight_slice<kVec>(s, slices, Kb, wrow, srow, rvalid, wstep, sstep, wv, sc);
      uint4 av[8];
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        av[i] = make_uint4(0, 0, 0, 0);
        // (kFused with act_rows: natural order here, interleaved at the MMA below: fewer live registers)
        if (tvalid && (kVec ? svalid : s * 4 + i / 2 < Kb)) av[i] = __ldg(reinterpret_cast<const uint4*>(arow + s * 64 + i * 8));
      }
#pragma unroll
      for (int blk = 0; blk < 4; ++blk) {
        uint32_t s2[2][2];
        slice_block_scales(sc, blk, s2);
#pragma unroll
        for (int wi = 0; wi < 2; ++wi) {
          const int i = blk * 2 + wi;
          const uint4 b[1] = {kFused && a.act_rows ? interleave_act(av[i]) : av[i]};
          mma_weight_word<1>(acc, wv, s2, i, b);
        }
      }
    }
    stream_pass_epilogue<1, kFused || kQuantH, kQuantH>(a, acc, partial, tok0, rows, row_begin, rb, warp, lane, g,
                                                        tig, silu_mul, rvalid, N, alpha0, alpha1,
                                                        h_quant_scale(a, expert), expert_bias(a, expert));
  }
}

template <bool kVec, bool kFused, bool kQuantH = false>
__device__ __forceinline__ void stream_gemm_nt1_body(const StreamGemmArgs& a) {
  __shared__ float partial[4][2][1][4][32];
  stream_pdl_prologue(a);
  stream_nt1_item<kVec, kFused, kQuantH>(a, blockIdx.y, blockIdx.x, partial);
}

template <bool kVec>
__global__ void __launch_bounds__(kStreamThreads) stream_gemm_nt1_kernel(StreamGemmArgs a) {
  stream_gemm_nt1_body<kVec, false>(a);
}

// The fused variant is held to 128 registers (4 blocks per SM, like the staged one; 138 without).
template <bool kVec>
__global__ void __launch_bounds__(kStreamThreads, 4) stream_gemm_nt1_fused_kernel(StreamGemmArgs a) {
  stream_gemm_nt1_body<kVec, true>(a);
}

// W4A4 with a static scale for h: the staged-rows kernel whose epilogue quantizes h and writes it as the gemm2 input
// (a.out_operand, a.h_quant_gs).
template <bool kVec>
__global__ void __launch_bounds__(kStreamThreads) stream_gemm_nt1_quant_kernel(StreamGemmArgs a) {
  stream_gemm_nt1_body<kVec, false, true>(a);
}

// One token without the align kernel (a.slot_experts; K % 64 == 0): kFused, gemm1 of a W4A16 forward of bf16
// x, gathering x's one row through act_rows (zeros) and writing h as the gemm2 operand (row j: slot j) and the token's
// entry_row (a.entry_row_out); kQuantH, gemm1 of a W4A4 forward with a static scale for h, reading staged rows
// (row j: slot j, x's row quantized into each) and writing h's NVFP4 decode and the entry_row; else gemm2,
// staged rows (row j: slot j). Held to 128 registers as the fused kernel is (the staged one has 126 without the bound).
template <bool kFused, bool kQuantH = false>
__global__ void __launch_bounds__(kStreamThreads, 4) stream_gemm_nt1_direct_kernel(StreamGemmArgs a) {
  static_assert(!(kFused && kQuantH), "a gather with the quantizing epilogue is not instantiated");
  __shared__ float partial[4][2][1][4][32];
  stream_pdl_prologue<true>(a);
  stream_nt1_item<true, kFused, kQuantH, true>(a, blockIdx.y, blockIdx.x, partial);
}

}  // namespace megamoe::sm90

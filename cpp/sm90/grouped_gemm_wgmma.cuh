// NVFP4 grouped GEMM on Hopper warpgroup MMA (wgmma, sm_90a), swap-AB: the weights are the
// M operand (from registers), the tokens of one expert the N operand (from shared memory).
//
// Block = 2 warpgroups (256 threads) = 128 weight rows (64 per warpgroup, 16 per warp) of
// one expert x one token tile of up to kMaxN tokens of that expert; K in steps of 64.
// All 256 threads load (cp.async, kStages-deep ring of shared-memory stages) and compute:
//  - activations (bf16, operand order, K-major) land in a 128-byte-swizzled tile, rows of
//    128 bytes, 16-byte chunk c of row r at chunk c ^ (r & 7) (the SW128 K-major layout a
//    wgmma descriptor reads);
//  - packed NVFP4 weights (32 bytes per row per stage) and their e4m3 scales land as raw bytes;
//    each warp dequantizes exactly its own 16 rows into the A register fragment (every
//    weight element is decoded once per block), then wgmma m64nNk16 with A in registers.
// N (tokens per wgmma) is picked per block from the tile's token count, in steps of the
// instantiated widths, so a tile of 12 tokens runs n16 and one of 48 runs n64.
//
// Operand order: A's k-pair (2tig, 2tig+1) of an 8-element group is weight pair P_tig =
// (n_tig, n_tig+4) (gemm_common.cuh), and activations are stored in the order 0,4,1,5,..
// so that stored position 2j, 2j+1 holds elements j, j+4: both operands agree.
// K 128 or 256 per stage (token tiles 64 and 32) permutes K within each K-128 half of the stage
// instead: lane tig owns K [32 tig, 32 tig + 32) of the half for its two rows (one 16-byte shared
// load per row, every nibble of it used, whole words dequantized), and the activation tile is
// stored in the matching order by 4-byte copies (load_stage).
// Activation rows: grouped row r of the tile, or row act_rows[r] of act (a gather of operand-order rows,
// e.g. x staged once per token); each thread's source rows are fixed for the tile, their pointers are
// set up once and advanced by K per stage.
//
// Pipeline per k-tile kt (prefetch distance kStages-1):
//   wait for tile kt's cp.async group; fence.proxy.async; __syncthreads
//   issue loads of tile kt+kStages-1 into the slot of tile kt-1 (its wgmmas finished: every
//     warpgroup drained them at the end of iteration kt-1, before the barrier)
//   dequantize tile kt into the A registers; wgmma.fence; 4 wgmma (k16 steps); commit; drain.
#pragma once
#include "cp_async.cuh"
#include "gemm_common.cuh"
#include "megamoe/sm90_kernels.h"
#include "wgmma_ops.cuh"

namespace megamoe::sm90 {

constexpr int kWgK = 64;         // K of one SW128 activation sub-tile (a stage holds 1, 2 or 4)
constexpr int kWgTiny = 32, kWgSmall = 64, kWgMid = 128;  // token tiles of GemmKernel::kWgmma32 / 64 / 128
constexpr int kWgMaxExperts = 1024;        // the block-wide expert/tile scan holds E entries in shared memory

// Two blocks per SM everywhere (two independent blocks overlap one's barrier, loads and
// dequantization with the other's MMAs). kMaxN 32: K 256 per stage (two lane-owned K-128 halves),
// 3 stages (the memory-bound middle: a quarter of the K-64 per-stage fixed cost -- barrier, wait,
// drain, copies' addressing -- per weight byte); 64: K 128, 4 stages; 128: K 64, 4 stages.
template <int kMaxN>
struct WgCfg {
  static constexpr int kKS = kMaxN == kWgTiny ? 256 : kMaxN == kWgSmall ? 128 : 64;  // K per stage
  static constexpr int kSub = kKS / kWgK;                   // SW128 activation sub-tiles per stage
  static constexpr int kStages = kMaxN == kWgTiny ? 3 : 4;
  static constexpr int kThreads = 256;  // 2 warpgroups
  static constexpr int kRows = 128;     // weight rows per block (64 per warpgroup)
  static constexpr int kMinBlocks = 2;
  // packed weights per row and stage (kKS / 2 bytes); K 64: padded by 16 (16-aligned, conflict-free
  // reads of one row's words by the 4 lanes of a quad); K 128: unpadded (each lane reads its own
  // 16 bytes, a warp 16 consecutive rows: 512 consecutive bytes)
  static constexpr int kWRowBytes = kKS >= 128 ? kKS / 2 : kKS / 2 + 16;
  static constexpr int kABytes = kMaxN * 128 * kSub;
  static constexpr int kWBytes = kRows * kWRowBytes;
  static constexpr int kRaw = kABytes + kWBytes + kRows * (kKS / 16);
  static constexpr int kStageBytes = (kRaw + 1023) / 1024 * 1024;  // every A tile 1024-aligned (SW128 atom)
  static constexpr int kSmem = 1024 /*alignment slack*/ + kStageBytes * kStages + 256 * 4 + (1024 + 32) * 4;
};

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int kPending>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(kPending) : "memory");
}
__device__ __forceinline__ void fence_proxy_async_smem() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }
template <int M>
__device__ __forceinline__ void acc_fence(float (&d)[M]) {
#pragma unroll
  for (int i = 0; i < M; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

// Descriptor of a K-major, 128-byte-swizzled bf16 tile at shared address addr: rows of 128 bytes,
// 8-row groups 1024 bytes apart. The low word holds addr / 16 (14 bits: shared addresses are below
// 256 KB, so an offset added to it never carries out) and the leading byte offset (unused for
// swizzled K-major); the high word the stride byte offset (next 8-row group) and the 128 B swizzle mode.
__device__ __forceinline__ uint32_t sw128_desc_lo(uint32_t addr) { return ((addr & 0x3FFFFu) >> 4) | (1u << 16); }
__device__ __forceinline__ uint64_t sw128_desc(uint32_t lo) {
  return (uint64_t((1024 >> 4) | (1u << 30)) << 32) | lo;
}

template <int kMaxN>
inline bool wg_gemm_supported(const GroupedGemmArgs& a) {
  return a.K % WgCfg<kMaxN>::kKS == 0 && a.num_experts <= kWgMaxExperts;
}

// The tokens of an m64nN D fragment below `rows`: for token m0 + 8j + 2tig + t, calls
// f(4j + t, out_row, rs) with its output row row_begin + token and its row scale; acc[4j + t] is its
// value in row g, acc[4j + 2 + t] in row g + 8.
template <int N, typename F>
__device__ __forceinline__ void wg_fragment_tokens(const GroupedGemmArgs& a, int row_begin, int rows, int m0, int tig,
                                                   F&& f) {
#pragma unroll
  for (int j = 0; j < N / 8; ++j) {
#pragma unroll
    for (int t = 0; t < 2; ++t) {
      const int tok = m0 + 8 * j + 2 * tig + t;
      if (tok < rows) {
        const int64_t out_row = int64_t(row_begin) + tok;
        const float rs = a.a_row_scale ? a.a_row_scale[out_row] : 1.0f;
        f(4 * j + t, out_row, rs);
      }
    }
  }
}

// Epilogue of wg_tile(): acc is warp wq of
// warpgroup wg's m64nN fragment (block-local weight rows wg*64 + wq*16 + g and + 8, tokens m0 + 8j +
// 2tig + {0, 1}); scales it and writes output rows row_begin + token (tokens < rows).
// silu_mul, Nw = a.N and I = Nw / 2 come from the caller.
template <int N, int kMaxN>
__device__ __forceinline__ void wg_epilogue(const GroupedGemmArgs& a, const float (&acc)[N / 2], bool silu_mul,
                                            int64_t Nw, int64_t I, int expert, int row_begin, int rows, int m0,
                                            int wg, int wq, int g, int tig) {
  float alpha0, alpha1;
  epilogue_alphas(a, expert, silu_mul, alpha0, alpha1);
  // D fragment: acc[4j + c]: c = 0, 1 row g, tokens 8j + 2tig + {0, 1}; c = 2, 3 row g + 8.
  if (silu_mul) {
    const int64_t col = int64_t(blockIdx.x) * (WgCfg<kMaxN>::kRows / 2) + wg * 32 + wq * 8 + g;
    if (col < I) {
      wg_fragment_tokens<N>(a, row_begin, rows, m0, tig, [&](int c, int64_t out_row, float rs) {
        const float hv = swiglu(scaled(acc[c], alpha0, rs), scaled(acc[c + 2], alpha1, rs), a.swiglu_clamp,
                                a.swiglu_limit);
        if (a.out_operand) {
          store_operand_bf16(a.out_operand, out_row, I, col, hv);
        } else {
          a.out[out_row * I + col] = hv;
        }
      });
    }
  } else {
    const int64_t n0 = int64_t(blockIdx.x) * WgCfg<kMaxN>::kRows + wg * 64 + wq * 16 + g;
    wg_fragment_tokens<N>(a, row_begin, rows, m0, tig, [&](int c, int64_t out_row, float rs) {
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) {
        const int64_t n = n0 + 8 * hh;
        if (n < Nw) a.out[out_row * Nw + n] = scaled(acc[c + 2 * hh], alpha0, rs);
      }
    });
  }
}

// Main loop and epilogue of one block for token tiles of width N (<= kMaxN).
template <int N, int kMaxN>
__device__ __forceinline__ void wg_tile(const GroupedGemmArgs& a, uint8_t* stages, const uint32_t* lut, int expert,
                                        int row_begin, int rows, int m0) {
  using Cfg = WgCfg<kMaxN>;
  constexpr int S = Cfg::kStages;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, tig = lane & 3;
  const int wg = warp >> 2, wq = warp & 3;  // warpgroup, warp within it
  const int64_t K = a.K, Nw = a.N, Kb = K / 16, row_bytes = K / 2;
  const bool silu_mul = a.epilogue == Epilogue::kSiluMul;
  const int64_t I = Nw / 2;
  const uint8_t* wd = a.w_data + int64_t(expert) * Nw * row_bytes;
  const uint8_t* ws = a.w_scale + int64_t(expert) * Nw * Kb;

  // Block-local weight row lr -> global weight row. kSiluMul: the block covers 64 output
  // columns; in warp (wg, wq) rows g are the gate and rows g + 8 the up row of column
  // blockIdx.x*64 + wg*32 + wq*8 + g, so one thread holds both for its tokens.
  auto weight_row = [&](int lr, bool& valid) -> int64_t {
    if (silu_mul) {
      const int64_t col = int64_t(blockIdx.x) * (Cfg::kRows / 2) + (lr >> 4) * 8 + (lr & 7);
      valid = col < I;
      return valid ? (((lr >> 3) & 1) ? I + col : col) : 0;
    }
    const int64_t n = int64_t(blockIdx.x) * Cfg::kRows + lr;
    valid = n < Nw;
    return valid ? n : 0;
  };
  constexpr int kKS = Cfg::kKS, kWRow = Cfg::kWRowBytes;
  const int w_lr = tid >> 1, w_half = tid & 1;  // 2 threads per weight row, kKS / 4 bytes each
  bool w_valid;
  const uint8_t* w_src = wd + weight_row(w_lr, w_valid) * row_bytes + w_half * (kKS / 4);
  bool s_valid = false;
  const uint8_t* s_src = ws;
  if (tid < Cfg::kRows) s_src = ws + weight_row(tid, s_valid) * Kb;

  const int num_k_tiles = int(K / kKS);
  // Activation copies of this thread, fixed for the whole tile: kAR source rows (token r of the tile ->
  // grouped row row_begin + m0 + r, or act row act_rows[that] with a gather), each a pointer advanced by
  // kKS elements per stage, and its shared-memory destination relative to the stage.
  //  K 128: lane-owned K ranges (see the main loop). Stored column c = 8u + 2t + e (u = 16-byte chunk
  //   of the stage row, t = slot in it, e = 0, 1) holds operand position 32t + 2u + e of the stage's
  //   128: 4-byte copies; one warp instruction = one token row's 128-byte sub-tile (lane: slot
  //   t = lane >> 3, chunk ch = lane & 7); thread rows 8j + warp, j < N / 8, both sub-tiles.
  //  K 64: 16-byte copies, thread rows tid / 8 + 32 j (j < N / 32), chunk tid & 7.
  constexpr int kT = Cfg::kThreads;
  constexpr bool kLane = kKS >= 128;  // lane-owned K (K-128 halves)
  constexpr int kAR = kLane ? N / 8 : (N * 8 + kT - 1) / kT;
  const bool a_thread = kLane || N * 8 >= kT || tid < N * 8;
  const uint16_t* a_src[kAR];
  bool a_valid[kAR];
  uint32_t a_dst;  // byte offset of this thread's first copy in a stage (row of j = 0)
  {
    const int ct = lane >> 3, ch = lane & 7;
    const int r0 = kLane ? warp : tid >> 3;
    const int col = kLane ? 32 * ct + 2 * ch : 8 * (tid & 7);
    a_dst = kLane ? uint32_t(r0 * 128 + ((ch ^ warp) * 16) + ct * 4)
                       : uint32_t(r0 * 128 + (((tid & 7) ^ (r0 & 7)) * 16));
    const int64_t first = int64_t(row_begin) + m0;  // invalid tokens read the tile's first row (0 bytes)
    const int64_t first_src = a.act_rows ? int64_t(a.act_rows[first]) : first;
#pragma unroll
    for (int j = 0; j < kAR; ++j) {
      const int r = r0 + (kLane ? 8 : kT / 8) * j;
      a_valid[j] = a_thread && m0 + r < rows;
      const int64_t src = a_valid[j] ? (a.act_rows ? int64_t(a.act_rows[first + r]) : first + r) : first_src;
      a_src[j] = a.act + src * K + col;
    }
  }
  const uint32_t stages_s = static_cast<uint32_t>(__cvta_generic_to_shared(stages));
  auto load_stage = [&](int slot, int kt) {
    const uint32_t sa = stages_s + uint32_t(slot) * Cfg::kStageBytes;
    const uint32_t sw = sa + Cfg::kABytes;
    const uint32_t ss = sw + Cfg::kWBytes;
    const int64_t ko = int64_t(kt) * kKS;
#pragma unroll
    for (int j = 0; j < kAR; ++j) {
      if constexpr (kLane) {
#pragma unroll
        for (int sub = 0; sub < Cfg::kSub; ++sub)  // K-128 half sub / 2, its sub-tile sub % 2
          cp_async_s<4>(sa + a_dst + sub * (kMaxN * 128) + 8 * j * 128, a_src[j] + ko + 128 * (sub >> 1) + 16 * (sub & 1),
                        a_valid[j] ? 4 : 0);
      } else {
        if (a_thread) cp_async_s<16>(sa + a_dst + (kT / 8) * j * 128, a_src[j] + ko, a_valid[j] ? 16 : 0);
      }
    }
#pragma unroll
    for (int q = 0; q < kKS / 64; ++q)
      cp_async_s<16>(sw + w_lr * kWRow + w_half * (kKS / 4) + q * 16, w_src + int64_t(kt) * (kKS / 2) + q * 16,
                     w_valid ? 16 : 0);
    if (tid < Cfg::kRows) cp_async_s<kKS / 16>(ss + tid * (kKS / 16), s_src + int64_t(kt) * (kKS / 16), s_valid ? kKS / 16 : 0);
  };

  float acc[N / 2];
#pragma unroll
  for (int i = 0; i < N / 2; ++i) acc[i] = 0.f;

  // Per-lane dequant constants: this lane extracts pair P_tig of each word.
  const PairPick pick = pair_pick(tig);
  const int lr0 = wg * 64 + wq * 16 + g;  // A rows g and g + 8 of this warp

#pragma unroll
  for (int s = 0; s < S - 1; ++s) {
    if (s < num_k_tiles) load_stage(s, s);
    cp_async_commit();
  }

  uint32_t af[4 * Cfg::kSub][4];
  const uint32_t desc_lo0 = sw128_desc_lo(stages_s);
  int slot = 0, pf_slot = S - 1;  // kt % S and (kt + S - 1) % S
  for (int kt = 0; kt < num_k_tiles; ++kt) {
    cp_async_wait<S - 2>();  // tile kt landed (this thread's copies)
    fence_proxy_async_smem();  // ... and is visible to the async proxy (wgmma)
    __syncthreads();           // everyone's copies; every warpgroup is done with tile kt-1
    const int pf = kt + S - 1;
    if (pf < num_k_tiles) load_stage(pf_slot, pf);  // the slot of tile kt-1
    cp_async_commit();

    const uint8_t* sa = stages + slot * Cfg::kStageBytes;
    const uint8_t* sw = sa + Cfg::kABytes;
    const uint8_t* ss = sw + Cfg::kWBytes;
    if constexpr (kKS == 64) {
      const uint4 w0a = *reinterpret_cast<const uint4*>(sw + lr0 * kWRow);
      const uint4 w0b = *reinterpret_cast<const uint4*>(sw + lr0 * kWRow + 16);
      const uint4 w1a = *reinterpret_cast<const uint4*>(sw + (lr0 + 8) * kWRow);
      const uint4 w1b = *reinterpret_cast<const uint4*>(sw + (lr0 + 8) * kWRow + 16);
      const uint32_t sc0 = *reinterpret_cast<const uint32_t*>(ss + lr0 * 4);
      const uint32_t sc1 = *reinterpret_cast<const uint32_t*>(ss + (lr0 + 8) * 4);
      const uint32_t r0[8] = {w0a.x, w0a.y, w0a.z, w0a.w, w0b.x, w0b.y, w0b.z, w0b.w};
      const uint32_t r1[8] = {w1a.x, w1a.y, w1a.z, w1a.w, w1b.x, w1b.y, w1b.z, w1b.w};
#pragma unroll
      for (int ks = 0; ks < 4; ++ks) {
        const uint32_t s0 = lut[(sc0 >> (8 * ks)) & 0xFFu];
        const uint32_t s1 = lut[(sc1 >> (8 * ks)) & 0xFFu];
        af[ks][0] = dequant_pair(r0[2 * ks], pick, s0);
        af[ks][1] = dequant_pair(r1[2 * ks], pick, s1);
        af[ks][2] = dequant_pair(r0[2 * ks + 1], pick, s0);
        af[ks][3] = dequant_pair(r1[2 * ks + 1], pick, s1);
      }
    } else {
      // K 128 / 256 per stage, lane-owned K: per K-128 half, lane tig takes K [32 tig, 32 tig + 32) for its rows
      // g and g + 8 (one 16-byte load each, whole words dequantized, two scale blocks per row). Word q
      // gives pairs p0..p3 = elements (j, j + 4) of K 32 tig + 8q + j: k16 steps 2q (registers 0/2 of
      // the row: p0, p1) and 2q + 1 (p2, p3); the activations were stored to match (load_stage).
#pragma unroll
      for (int hf = 0; hf < kKS / 128; ++hf) {  // K-128 half: k16 steps 8 hf ..
        const uint4 w0 = *reinterpret_cast<const uint4*>(sw + lr0 * kWRow + 64 * hf + 16 * tig);
        const uint4 w1 = *reinterpret_cast<const uint4*>(sw + (lr0 + 8) * kWRow + 64 * hf + 16 * tig);
        const uint32_t sc0 = *reinterpret_cast<const uint16_t*>(ss + lr0 * (kKS / 16) + 8 * hf + 2 * tig);
        const uint32_t sc1 = *reinterpret_cast<const uint16_t*>(ss + (lr0 + 8) * (kKS / 16) + 8 * hf + 2 * tig);
        const uint32_t s0[2] = {lut[sc0 & 0xFFu], lut[sc0 >> 8]};
        const uint32_t s1[2] = {lut[sc1 & 0xFFu], lut[sc1 >> 8]};
        const uint32_t r0[4] = {w0.x, w0.y, w0.z, w0.w};
        const uint32_t r1[4] = {w1.x, w1.y, w1.z, w1.w};
#pragma unroll
        for (int q = 0; q < 4; ++q) {
          uint32_t p[4];
          uint32_t(&fa)[4] = af[8 * hf + 2 * q];
          uint32_t(&fb)[4] = af[8 * hf + 2 * q + 1];
          dequant_word(r0[q], s0[q >> 1], p);
          fa[0] = p[0];
          fa[2] = p[1];
          fb[0] = p[2];
          fb[2] = p[3];
          dequant_word(r1[q], s1[q >> 1], p);
          fa[1] = p[0];
          fa[3] = p[1];
          fb[1] = p[2];
          fb[3] = p[3];
        }
      }
    }
    acc_fence(acc);
    wgmma_fence();
#pragma unroll
    for (int ks = 0; ks < 4 * Cfg::kSub; ++ks)
      Wgmma<N>::mma(acc, af[ks],
                    sw128_desc(desc_lo0 + ((slot * Cfg::kStageBytes + (ks >> 2) * (kMaxN * 128) + (ks & 3) * 32) >> 4)));
    wgmma_commit();
    acc_fence(acc);
    // Drain before the A registers are redefined (registers feeding an in-flight wgmma must not be
    // written). The other warpgroup (and block) keep the tensor cores busy meanwhile: overlapping
    // the decode with this warpgroup's own wgmmas (the fragment in two halves, wait_group 1; ptxas
    // keeps them asynchronous) was measured no faster (docs/PERFORMANCE.md, rejected variants).
    wgmma_wait<0>();
    slot = slot + 1 == S ? 0 : slot + 1;
    pf_slot = pf_slot + 1 == S ? 0 : pf_slot + 1;
  }
  acc_fence(acc);
  cp_async_wait<0>();

  wg_epilogue<N, kMaxN>(a, acc, silu_mul, Nw, I, expert, row_begin, rows, m0, wg, wq, g, tig);
}

template <int kMaxN>
__global__ void __launch_bounds__(WgCfg<kMaxN>::kThreads, WgCfg<kMaxN>::kMinBlocks) wg_gemm_kernel(GroupedGemmArgs a) {
  static_assert(kMaxN == kWgTiny || kMaxN == kWgSmall || kMaxN == kWgMid, "token tiles of 32, 64 or 128");
  using Cfg = WgCfg<kMaxN>;
  extern __shared__ uint8_t wg_smem_raw[];
  // 1024-align the stage ring (the SW128 swizzle is a function of address bits 4..9).
  const uint32_t raw_addr = static_cast<uint32_t>(__cvta_generic_to_shared(wg_smem_raw));
  uint8_t* stages = wg_smem_raw + ((1024u - (raw_addr & 1023u)) & 1023u);
  uint32_t* scale_lut = reinterpret_cast<uint32_t*>(stages + Cfg::kStageBytes * Cfg::kStages);
  int32_t* tile_scan = reinterpret_cast<int32_t*>(scale_lut + 256);  // [1024] inclusive tile counts
  int32_t* warp_sums = tile_scan + 1024;

  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  for (int i = tid; i < 256; i += Cfg::kThreads) scale_lut[i] = scale_bf16x2(uint8_t(i));

  // Which expert and which token tile of it.
  const int E = a.num_experts;
  const int num_tiles = expert_tile_scan<Cfg::kThreads, kMaxN>(a, E, tile_scan, warp_sums, tid, warp, lane);
  const int tile = blockIdx.y;
  if (tile >= num_tiles) return;
  const ExpertTile et = find_expert_tile<kMaxN>(a, E, tile_scan, tile);
  const int expert = et.expert, row_begin = et.row_begin, rows = et.rows, m0 = et.m0;
  const int count = min(rows - m0, kMaxN);  // tokens in this tile (block-uniform)
  __syncthreads();  // scale_lut visible

  if constexpr (kMaxN == kWgTiny) {
    if (count <= 8) wg_tile<8, kMaxN>(a, stages, scale_lut, expert, row_begin, rows, m0);
    else if (count <= 16) wg_tile<16, kMaxN>(a, stages, scale_lut, expert, row_begin, rows, m0);
    else wg_tile<32, kMaxN>(a, stages, scale_lut, expert, row_begin, rows, m0);
  } else if constexpr (kMaxN == kWgSmall) {
    if (count <= 8) wg_tile<8, kMaxN>(a, stages, scale_lut, expert, row_begin, rows, m0);
    else if (count <= 16) wg_tile<16, kMaxN>(a, stages, scale_lut, expert, row_begin, rows, m0);
    else if (count <= 32) wg_tile<32, kMaxN>(a, stages, scale_lut, expert, row_begin, rows, m0);
    else wg_tile<64, kMaxN>(a, stages, scale_lut, expert, row_begin, rows, m0);
  } else {
    if (count <= 32) wg_tile<32, kMaxN>(a, stages, scale_lut, expert, row_begin, rows, m0);
    else if (count <= 64) wg_tile<64, kMaxN>(a, stages, scale_lut, expert, row_begin, rows, m0);
    else wg_tile<128, kMaxN>(a, stages, scale_lut, expert, row_begin, rows, m0);
  }
}

template <int kMaxN>
inline cudaError_t launch_wg_gemm(const GroupedGemmArgs& a, cudaStream_t stream) {
  using Cfg = WgCfg<kMaxN>;
  static bool attr_set = false;
  if (!attr_set) {
    cudaError_t err = cudaFuncSetAttribute(wg_gemm_kernel<kMaxN>, cudaFuncAttributeMaxDynamicSharedMemorySize, Cfg::kSmem);
    if (err == cudaSuccess)  // all of the unified L1/shared storage as shared memory (kMinBlocks blocks must fit)
      err = cudaFuncSetAttribute(wg_gemm_kernel<kMaxN>, cudaFuncAttributePreferredSharedMemoryCarveout,
                                 int(cudaSharedmemCarveoutMaxShared));
    if (err != cudaSuccess) return err;
    attr_set = true;
  }
  const bool silu_mul = a.epilogue == Epilogue::kSiluMul;
  constexpr int kCols = Cfg::kRows / 2;  // kSiluMul: output columns per block (gate and up rows)
  const unsigned gx = silu_mul ? unsigned((a.N / 2 + kCols - 1) / kCols) : unsigned((a.N + Cfg::kRows - 1) / Cfg::kRows);
  // Upper bound of token tiles over all experts: sum ceil(t_e / kMaxN) <= rows / kMaxN + active experts.
  const int64_t tiles = (a.max_total_rows + kMaxN - 1) / kMaxN + a.grid_experts;
  if (tiles > 65535) return cudaErrorInvalidValue;
  wg_gemm_kernel<kMaxN><<<dim3(gx, unsigned(tiles)), Cfg::kThreads, Cfg::kSmem, stream>>>(a);
  return cudaGetLastError();
}

}  // namespace megamoe::sm90

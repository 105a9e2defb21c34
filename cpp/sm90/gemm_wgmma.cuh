// NVFP4 grouped GEMM on Hopper warpgroup MMA (wgmma, sm_90a), swap-AB: the weights are the
// M operand (from registers), the tokens of one expert the N operand (from shared memory).
//
// Block = R / 64 warpgroups = R weight rows (R = WgCfg::kRows: 128 or 256; 64 per warpgroup, 16 per warp) of
// one expert x one token tile of up to kMaxN tokens of that expert (tiles 32 and 64 with TMA rows: two such row
// blocks in turn, wg_tile); K in stages of kKS (64, 128 or 256), a kStages-deep ring of shared-memory stages filled
// by the tensor memory accelerator (TMA, tma.cuh: one thread issues a box copy, its bytes complete the stage's
// mbarrier):
//  - activations (bf16, lane order: see below) land in 128-byte-swizzled K-major sub-tiles of 64
//    elements (16-byte chunk c of row r at c ^ (r & 7): the SW128 layout a wgmma descriptor
//    reads): all of a stage's sub-tiles as one TMA box of a 3-D view {64 elements, rows, K / 64} (sub-tile j
//    of N rows at j * N * 128 bytes), or, when the rows are gathered (act_rows), 16-byte cp.async copies by
//    all threads (TMA has no row gather on sm_90; sub-tile j at j * kMaxN * 128 bytes);
//  - packed NVFP4 weights: one TMA box of R rows x kKS / 2 bytes (kSiluMul: two of R / 2, the gate and the up
//    rows; swizzled by kKS: WgCfg::wswz);
//    their scale codes (gemm_common.cuh, "Scale code"): one box of R rows x 16 bytes (kSiluMul: two) every
//    256 / kKS stages, into a ring of kScSlots scale slots beside the stages (the scale rows must be 16-byte
//    multiples: padded when K % 256 != 0, the bytes past K / 16 read as zeros);
//    every thread reads the words and scales of exactly its own two A-fragment rows (g and g + 8 of
//    its warp's 16; every weight element is decoded once per block), dequantizes whole words into
//    the A registers and issues wgmma m64nNk16 with A in registers.
// N (tokens per wgmma) is picked per block from the tile's token count, in steps of the
// instantiated widths, so a tile of 12 tokens runs n16 and one of 44 n48.
//
// Lane-owned K. The weight words are in their natural order (the sm90 word layout of
// gemm_common.cuh: word w of a row holds elements 8w..8w+7, dequant_word gives pairs
// (n_j, n_{j+4})). In every 64-element block, MMA lane tig owns elements [16 tig, 16 tig + 16) of
// its rows: the two words at byte 8 tig of the block's 32 and one scale (byte tig of the block's
// 4). For that to be a dot product, the activations must put the partners of those elements at
// the k-positions lane tig holds in the A fragment (a0: k 2tig, 2tig+1; a2: k 2tig+8, 2tig+9 of
// every k16 step): the lane order (megamoe/sm90_operand_order.hpp, lane_order_position) stores operand
// unit u = 8 tig + v of a block (a unit: the bf16 pair at operand positions 2u, 2u + 1) at unit
// 4v + tig, so word q of the lane (units v = 4q..4q+3) feeds k16 steps 2q and 2q + 1 of the
// block: pair j of it is register 0 (j even; row g + 8: 1) or 2 (j odd; 3) of step 2q + j / 2.
// The producers of the activations write lane order when the plan runs these kernels
// (GemmPlan::lane_order: stage_bf16, the W4A4 quantizer's decode, nvfp4_to_operand, this kernel's
// own kSiluMul epilogue writing h as the gemm2 operand); the streaming kernels read operand order.
// Activation rows: grouped row r of the tile, or row act_rows[r] of act (a gather of lane-order rows,
// e.g. x staged once per token); each thread's source rows are fixed for the tile, their pointers are
// set up once and advanced by K per stage.
//
// Pipeline per k-tile kt (prefetch distance kStages-1), with two mbarriers per ring slot and no
// block-wide barrier, so the two warpgroups need not meet at every stage:
//   wait on full[slot of kt] (the TMA bytes of tile kt landed, and with copied rows every thread's
//     cp.async copies: each thread arrives with cp.async.mbarrier.arrive after issuing them; then
//     fence.proxy.async, since the wgmmas read what the generic proxy wrote)
//   with copied rows every thread waits on empty[slot of kt-1] (every warp's wgmmas of tile kt-1
//     finished), then thread 0 issues the TMA boxes of tile kt+kStages-1 into that slot and every thread
//     its cp.async copies, with their arrivals
//   dequantize tile kt into the A registers; wgmma.fence; kKS/16 wgmma (k16 steps); commit; drain;
//     with copied rows each warp arrives on empty[slot of kt]; with TMA rows it counts itself in
//     freed[slot of kt] instead (an atomic whose result it reads one stage later), and the last of the
//     warps issues the TMA boxes of tile kt+kStages into the slot during its next stage, while that stage's
//     wgmmas run (the prologue issued tiles 0..kStages-1): no thread waits for a slot to free, or for the
//     atomic.
// Why two schemes: with TMA rows no thread needs to wait for a slot, so the warp that frees it last refills it
// and nobody stalls on the empty barrier (with thread 0 issuing every box a slot is refilled only when warp 0
// gets to it, and its warpgroup pays every issue); with copied rows every thread waits on that barrier before
// its own copies anyway, so thread 0 issues the boxes there (docs/PERFORMANCE.md, rejected variants).
#pragma once
#include "cp_async.cuh"
#include "gemm_common.cuh"
#include "megamoe/sm90_kernels.h"
#include "pdl.cuh"
#include "tma.cuh"
#include "wgmma_ops.cuh"

namespace megamoe::sm90 {

// kWgK, the token tiles kTile8 / 32 / 64 / 128, kWgMaxExperts, wg_stage_k, wg_min_stage_k: megamoe/sm90_plan.h

// Four warpgroups per SM everywhere (independent warpgroups overlap one's barrier waits, loads and
// dequantization with the others' MMAs). kMaxN 32: K 256 per stage, 3 stages (the memory-bound
// middle: a quarter of the K-64 per-stage fixed cost -- barrier waits, drain -- per weight byte);
// 64: K 256, 3 stages, or K 128 and 6 stages for a K that is a multiple of 128 only or copied activation rows;
// 128: K 128, 4 stages, or K 64 and 8 stages for a K that is a multiple of 64 only or copied rows
// (launch_wg_gemm picks): about 192 KB of ring in tiles 64 and 128.
// Weight rows per block: tile 32 128 rows (2 warpgroups, two blocks per SM); tiles 64 and 128 256 rows (4 warpgroups,
// one block per SM), so that the 4 warpgroups of an SM share one activation tile: half the activation bytes per FLOP
// that two 128-row blocks read from L2. Tile 8 (a small tile-32 grid, plan_tile8): 64 rows (one warpgroup), K 256,
// 5 stages, three blocks per SM (a fourth would hold the SM's only spare slot, and at one token the deeper ring
// keeps more bytes in flight: v4-flash 42.1 -> 40.9 us on an H100, docs/PERFORMANCE.md).
__host__ __device__ constexpr int wg_rows(int max_n) { return max_n == kTile8 ? 64 : max_n == kTile32 ? 128 : 256; }
template <int kMaxN, int kStageK = wg_stage_k(kMaxN)>
struct WgCfg {
  static constexpr int kKS = kStageK;      // K per stage
  static_assert(kKS == 64 || kKS == 128 || kKS == 256, "K 64, 128 or 256 per stage");
  static constexpr int kSub = kKS / kWgK;  // 64-element blocks (SW128 activation sub-tiles) per stage
  static constexpr int kRows = wg_rows(kMaxN);  // weight rows per block (64 per warpgroup)
  static constexpr int kThreads = 2 * kRows;    // kRows / 64 warpgroups
  static constexpr int kMinBlocks = wg_blocks_per_sm(kMaxN);
  static constexpr int kStages = kMaxN == kTile8 ? 5 : kMaxN == kTile32 ? 3 : kMaxN == kTile64 ? (kKS == 256 ? 3 : 6) : kKS == 64 ? 8 : 4;
  static constexpr int kABytes = kMaxN * 128 * kSub;
  static constexpr int kWBytes = kRows * kKS / 2;  // rows of kKS / 2 bytes (TMA boxes, swizzled: wswz)
  static constexpr int kStageBytes = (kABytes + kWBytes + 1023) / 1024 * 1024;  // A tiles 1024-aligned
  // Scales: a ring of kScSlots chunks of K 256 (16 bytes per row), chunk c loaded with stage c * kChunkStages.
  // Its slot is reloaded kScSlots chunks later, by the copies of stage (c + kScSlots) * kChunkStages, which
  // are issued once every warp finished stage (c + kScSlots) * kChunkStages - kStages: at least the chunk's
  // last stage c * kChunkStages + kChunkStages - 1.
  static constexpr int kChunkStages = 256 / kKS;
  static constexpr int kScSlots = (kStages - 1 + kChunkStages - 1) / kChunkStages + 1;
  static_assert((kScSlots - 1) * kChunkStages >= kStages - 1, "a scale slot is reloaded while a stage still reads it");
  static constexpr int kScBytes = kRows * 16;
  static constexpr int kSmem = 1024 /*alignment slack*/ + kStageBytes * kStages + kScBytes * kScSlots +
                               32 * 4 /*scan scratch*/ + 16 /*the block's expert tile*/ +
                               16 * kStages /*full and empty mbarriers*/ + 4 * kStages /*freed counters*/ +
                               4 * 32 /*atomic scratch*/;
  static_assert(kMinBlocks * (kSmem + 1024) <= 228 * 1024, "kMinBlocks blocks per SM must fit in shared memory");
  static_assert(kStageBytes * kStages >= kMaxN * (kRows / 2 + 4) * 4, "the ring holds a tile of h (wg_epilogue_h_nvfp4)");
  // TMA swizzle of the weight rows (kKS / 2 bytes): 16-byte chunk q of row r is stored at chunk q ^ wswz(r), so
  // that the 8 rows a warp reads (8 bytes per lane, 32 bytes per row) fall on distinct bank groups.
  static constexpr CUtensorMapSwizzle kWSwizzle = kKS == 256   ? CU_TENSOR_MAP_SWIZZLE_128B
                                                  : kKS == 128 ? CU_TENSOR_MAP_SWIZZLE_64B
                                                               : CU_TENSOR_MAP_SWIZZLE_NONE;
  __host__ __device__ static constexpr int wswz(int r) { return kKS == 256 ? (r & 7) : kKS == 128 ? ((r >> 1) & 3) : 0; }
  // Token widths the kernel instantiates (wgmma n), narrowest first; a block runs the narrowest that holds its tile
  // (tile 128: 32, 48, ..., 128 in steps of 16; tile 64: 8, 16, 32, 40, 48, 56, 64; tile 32: 8, 16, 32; tile 8: 8),
  // so a tile's wgmmas run fewer than 16 (tile 128, from 32 tokens) or 8 (tile 64, from 32 tokens) token columns past
  // its tokens.
  static constexpr int kNumWidths = kMaxN == kTile128 ? 7 : kMaxN == kTile64 ? 7 : kMaxN == kTile32 ? 3 : 1;
  __host__ __device__ static constexpr int width(int i) {
    return kMaxN == kTile128 ? 16 * (i + 2) : kMaxN == kTile64 ? (i < 3 ? 8 << i : 8 * (i + 2)) : 8 << i;
  }
  __host__ __device__ static constexpr int width_index(int n) {
    int i = 0;
    while (i + 1 < kNumWidths && width(i) < n) ++i;
    return i;
  }
};

// TMA tensor maps of one launch (kernel parameter): packed weights [E][N][K/2] bytes in boxes of
// {kKS / 2, R rows} (kSiluMul: R / 2 rows), scales [E][N][K/16] in boxes of {16, R rows} (kSiluMul: R / 2), and with
// contiguous activation rows the activations [rows][K] bf16 as a 3-D view {64, rows, K / 64} in boxes of
// {64, width(i), kSub} (SW128): one box per stage.
struct WgMaps {
  CUtensorMap w;
  CUtensorMap s;
  CUtensorMap act[7];  // one per token width (WgCfg::kNumWidths)
};

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int kPending>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(kPending) : "memory");
}
__device__ __forceinline__ void fence_proxy_async_smem() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }
__device__ __forceinline__ void mbar_init(uint32_t bar, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(count) : "memory");
}
// Arrives on bar once every cp.async this thread issued so far has landed (the expected count includes it).
__device__ __forceinline__ void mbar_cp_async_arrive(uint32_t bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];" ::"r"(bar) : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint32_t bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(bar) : "memory");
}
// Waits until the phase of bar with this parity has completed.
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
  asm volatile(
      "{\n .reg .pred done;\n"
      "again:\n mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n @!done bra again;\n}\n" ::"r"(bar),
      "r"(parity)
      : "memory");
}
// Returns the old value.
__device__ __forceinline__ uint32_t atom_add_acq_rel_shared(uint32_t addr, uint32_t v) {
  uint32_t old;
  asm volatile("atom.acq_rel.cta.shared::cta.add.u32 %0, [%1], %2;" : "=r"(old) : "r"(addr), "r"(v) : "memory");
  return old;
}
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

// Row blocks of a GEMM: blocks of kRows weight rows (kSiluMul: of kRows / 2 output columns, gate and up rows).
template <int kMaxN>
__host__ __device__ inline int wg_row_blocks(const GroupedGemmCommon& a) {
  constexpr int R = wg_rows(kMaxN);
  return a.epilogue == Epilogue::kSiluMul ? int((a.N / 2 + R / 2 - 1) / (R / 2)) : int((a.N + R - 1) / R);
}
// Row blocks per block (wg_tile): up to 2 in tiles 32 and 64 with TMA rows and h not quantized (that epilogue takes
// the ring), 2 where a row block's K-tiles fill whole scale chunks; 1 elsewhere (tile 128 and copied rows keep the
// one-item loop: in pairs neither gained, tile 128's blocks being long enough that a pair mostly lengthens the
// grid's last wave, and the copied-rows loop spilling; docs/PERFORMANCE.md, rejected variants).
// act_tma and quant_h: the kernel's kActTma and kQuantH (the host passes the ones of the kernel it launches).
__host__ __device__ constexpr int wg_max_items(int max_n, bool act_tma, bool quant_h) {
  return (max_n == kTile64 || max_n == kTile32) && act_tma && !quant_h ? 2 : 1;
}
// The host launches a paired grid (row_blocks / 2 rounded up) only where wg_items is 2 and the plan pairs
// (plan_pair_row_blocks); the kernel reads the pairing off its grid (wg_block_items).
template <int kMaxN, int kStageK>
__host__ __device__ constexpr int wg_items(int64_t K, bool act_tma, bool quant_h) {
  return wg_max_items(kMaxN, act_tma, quant_h) > 1 && (K / kStageK) % WgCfg<kMaxN, kStageK>::kChunkStages == 0 ? 2 : 1;
}
__host__ __device__ constexpr int wg_block_items(int max_items, int row_blocks, unsigned grid_x) {
  return max_items > 1 && int(grid_x) < row_blocks ? 2 : 1;
}

// kSiluMul epilogue with a.h_quant_gs (W4A4 with a static scale for h): h quantized to NVFP4 and written as its exact
// bf16 decode in lane order, the W4A4 gemm2 input, bit for bit what quantize_nvfp4 makes of the fp32 h that wg_epilogue
// writes otherwise. The block's tile of h (the kCols = kRows / 2 columns of row block rb x the tile's tokens) goes
// through shared memory, the stage ring, free once every warp has passed the block barrier (its wgmmas drained, every
// copy landed): token rows of kHRow floats (kCols and 4 of padding, so that the 8 columns x 4 tokens a warp writes at
// once fall on distinct banks); then each thread quantizes whole 16-element blocks of a token row, as the quantize
// kernel does, and the 4 threads holding a 64-element block of a token row store its bf16 values in lane order as
// 16-byte chunks (lane_order_chunks). Every thread of the block comes here (the barriers). Tokens past `rows` and
// blocks past I are not stored (I % 64 == 0 under the wgmma plan: the 4 threads of a 64-block store or skip it
// together).
template <int N, int kMaxN>
__device__ __forceinline__ void wg_epilogue_h_nvfp4(const GroupedGemmCommon& a, const float (&acc)[N / 2], float* tile,
                                                    int64_t I, int expert, int row_begin, int rows, int m0, int rb,
                                                    int wg, int wq, int g, int tig) {
  constexpr int kCols = WgCfg<kMaxN>::kRows / 2, kHRow = kCols + 4;
  static_assert(kCols % 64 == 0 && WgCfg<kMaxN>::kThreads % 32 == 0, "quads of threads per token row (lane_order_chunks)");
  float alpha0, alpha1;
  epilogue_alphas(a, expert, true, alpha0, alpha1);
  const int c = wg * 32 + wq * 8 + g;  // the thread's column within the block's kCols
  const int64_t col0 = int64_t(rb) * kCols;
  const float* bias = col0 + c < I ? expert_bias(a, expert) : nullptr;  // (a column past I reads no bias)
  __syncthreads();
#pragma unroll
  for (int j = 0; j < N / 8; ++j) {
#pragma unroll
    for (int t = 0; t < 2; ++t) {
      const int i = 8 * j + 2 * tig + t;
      float v = 0.f;
      if (m0 + i < rows) {
        const float rs = a.a_row_scale ? a.a_row_scale[int64_t(row_begin) + m0 + i] : 1.0f;
        v = swiglu(a, bias, I, col0 + c, scaled(acc[4 * j + t], alpha0, rs), scaled(acc[4 * j + t + 2], alpha1, rs));
      }
      tile[i * kHRow + c] = v;
    }
  }
  __syncthreads();
  const float gs = h_quant_scale(a, expert);
  for (int q = threadIdx.x; q < N * (kCols / 16); q += WgCfg<kMaxN>::kThreads) {
    const int i = q / (kCols / 16), kb = q % (kCols / 16);
    if (m0 + i >= rows || col0 + 16 * kb >= I) continue;
    float x[16];
#pragma unroll
    for (int v = 0; v < 4; ++v) {
      const float4 f = *reinterpret_cast<const float4*>(tile + i * kHRow + 16 * kb + 4 * v);
      x[4 * v] = f.x; x[4 * v + 1] = f.y; x[4 * v + 2] = f.z; x[4 * v + 3] = f.w;
    }
    uint8_t scale_byte;
    float scale, r[16];
    nvfp4_quantize_block(x, gs, scale_byte, scale, r);
#pragma unroll
    for (int e = 0; e < 16; ++e) r[e] = __fmul_rn(r[e], scale);  // exact, +0 stays +0
    // The quad of threads holding the 4 blocks of one 64-element block of row i (kb & 3 == threadIdx.x & 3) stores them
    // in 16-byte chunks, staged in the tile words of that 64-block, which its 4 threads have read by now.
    uint4 chunk[2];
    lane_order_chunks(r, reinterpret_cast<uint32_t*>(tile + i * kHRow + 16 * (kb & ~3)), 0, kb & 3,
                      0xFu << (threadIdx.x & 28), chunk);
    store_lane_order_chunks(a.out_operand + (int64_t(row_begin) + m0 + i) * I + col0, kb, kb & 3, chunk);
  }
}

// Epilogue of wg_tile(): acc is warp wq of warpgroup wg's m64nN fragment (block-local weight rows wg*64 + wq*16 + g
// and + 8 of row block rb, tokens m0 + 8j + 2tig + {0, 1}: acc[4j + t] row g, acc[4j + 2 + t] row g + 8); scales it
// and writes output rows row_begin + token (tokens < rows). silu_mul, Nw = a.N and I = Nw / 2 come from the caller.
// Straight-line code: the row scales of the thread's N / 4 tokens are loaded together, every value is computed, and
// each store is predicated on its token, so that no token's stores wait behind a branch and a dependent load of
// its own. Token i = 2j + t of the thread is tile token
// m0 + 2tig + wg_tok(i); its values are acc[wg_acc(i)] (row g) and acc[wg_acc(i) + 2] (row g + 8).
__host__ __device__ constexpr int wg_tok(int i) { return 8 * (i >> 1) + (i & 1); }
__host__ __device__ constexpr int wg_acc(int i) { return 4 * (i >> 1) + (i & 1); }
template <int N, int kMaxN>
__device__ __forceinline__ void wg_epilogue(const GroupedGemmCommon& a, const float (&acc)[N / 2], bool silu_mul,
                                            int64_t Nw, int64_t I, int expert, int row_begin, int rows, int m0,
                                            int rb, int wg, int wq, int g, int tig) {
  constexpr int kTok = N / 4;
  float alpha0, alpha1;
  epilogue_alphas(a, expert, silu_mul, alpha0, alpha1);
  const float* bias = expert_bias(a, expert);
  const int t0 = m0 + 2 * tig;  // the thread's first token in the expert's rows
  float rs[kTok];
#pragma unroll
  for (int i = 0; i < kTok; ++i) rs[i] = 1.0f;
  if (a.a_row_scale) {
    const float* r = a.a_row_scale + row_begin + t0;
#pragma unroll
    for (int i = 0; i < kTok; ++i)
      if (t0 + wg_tok(i) < rows) rs[i] = r[wg_tok(i)];
  }
  // f(q, i) for every token i of the thread below `rows`, q = p + wg_tok(i) * stride (p: the thread's first token's
  // row; a pointer advanced by 8 rows per j)
  auto store_tokens = [&](auto* p, int64_t stride, auto&& f) {
#pragma unroll
    for (int j = 0; j < N / 8; ++j, p += 8 * stride) {
#pragma unroll
      for (int t = 0; t < 2; ++t)
        if (t0 + 8 * j + t < rows) f(p + t * stride, 2 * j + t);
    }
  };
  if (silu_mul) {
    const int64_t col = int64_t(rb) * (WgCfg<kMaxN>::kRows / 2) + wg * 32 + wq * 8 + g;
    if (col >= I) return;
    float hv[kTok];
#pragma unroll
    for (int i = 0; i < kTok; ++i)
      hv[i] = swiglu(a, bias, I, col, scaled(acc[wg_acc(i)], alpha0, rs[i]), scaled(acc[wg_acc(i) + 2], alpha1, rs[i]));
    const int64_t row0 = (int64_t(row_begin) + t0) * I;
    if (a.out_operand) {  // h as the bf16 gemm2 operand, lane order (store_operand_bf16)
      store_tokens(a.out_operand + row0 + operand_column(col, true), I,
                   [&](uint16_t* q, int i) { *q = bf16_bits(hv[i]); });
    } else {
      store_tokens(a.out + row0 + col, I, [&](float* q, int i) { *q = hv[i]; });
    }
  } else {
    const int64_t n0 = int64_t(rb) * WgCfg<kMaxN>::kRows + wg * 64 + wq * 16 + g;
    const bool v0 = n0 < Nw, v1 = n0 + 8 < Nw;
    const int64_t base = (int64_t(row_begin) + t0) * Nw + n0;
    // rows n0 and n0 + 8 of each token, through cvt (fp32 out, or bf16 out_bf16: store_out)
    auto store_rows = [&](auto* out, auto&& cvt) {
      store_tokens(out + base, Nw, [&](auto* q, int i) {
        if (v0) q[0] = cvt(add_bias(scaled(acc[wg_acc(i)], alpha0, rs[i]), bias, n0));
        if (v1) q[8] = cvt(add_bias(scaled(acc[wg_acc(i) + 2], alpha0, rs[i]), bias, n0 + 8));
      });
    };
    if (a.out_bf16) {
      store_rows(a.out_bf16, [](float v) { return bf16_bits(v); });
    } else {
      store_rows(a.out, [](float v) { return v; });
    }
  }
}

// Main loop and epilogue of one block for token tiles of width N (<= kMaxN); kQuantH: the kSiluMul epilogue quantizes
// h (wg_epilogue_h_nvfp4; its own instantiation, so that the other kernels keep their registers); kActTma: the activation rows
// are contiguous (grouped row r of the tile = act row row_begin + m0 + r) and come by TMA.
// Row blocks rb0 .. rb0 + items - 1 (items: 1, or 2 in tiles 32 and 64: wg_items) of the token tile, one after the other,
// with one ring of stages through all of them: stage gk of the block is k-tile gk % num_k_tiles of row block
// rb0 + gk / num_k_tiles, so the copies of the second row block's first stages are issued during the first's last
// stages and land while its epilogue runs; one block launch, scan and first wait per pair saved (docs/PERFORMANCE.md).
// The epilogue of each row block writes global memory only.
template <int N, int kMaxN, int kStageK, bool kActTma, bool kQuantH, bool kPdl>
__device__ __forceinline__ void wg_tile(const GroupedGemmCommon& a, const WgMaps& maps, uint8_t* stages,
                                        uint8_t* scales, uint32_t bars, uint32_t freed,
                                        int expert, int row_begin, int rows, int m0, int rb0, int items,
                                        bool pre_wait) {
  using Cfg = WgCfg<kMaxN, kStageK>;
  constexpr int S = Cfg::kStages, kKS = Cfg::kKS, kB = Cfg::kSub;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, tig = lane & 3;
  const int wg = warp >> 2, wq = warp & 3;  // warpgroup, warp within it
  const int64_t K = a.K, Nw = a.N;
  const bool silu_mul = a.epilogue == Epilogue::kSiluMul;
  const int64_t I = Nw / 2;

  // The weight rows of row block rb of expert `expert` (R = Cfg::kRows), at shared rows 0..R/2-1 and R/2..R-1 (one
  // TMA box of R rows for kStore, two of R / 2 for kSiluMul). kSiluMul: box 0 the gate rows of output columns
  // rb*R/2 + 0..R/2-1, box 1 their up rows; a warp's rows g are gate and rows g + 8 up rows of column
  // rb*R/2 + wg*32 + wq*8 + g, so one thread holds both for its tokens. kStore: rows rb*R + 0..R-1.
  // Rows past the expert's N read as zeros, rows of the up half in a gate box (I % (R / 2) != 0) are never stored.
  constexpr int kMaxItems = wg_max_items(kMaxN, kActTma, kQuantH);
  const int n_items = kMaxItems == 1 ? 1 : items;
  const int num_k_tiles = int(K / kKS);
  const int total = n_items * num_k_tiles;  // stages of the block
  const uint32_t stages_s = static_cast<uint32_t>(__cvta_generic_to_shared(stages));
  const uint32_t scales_s = static_cast<uint32_t>(__cvta_generic_to_shared(scales));

  // One thread: the TMA boxes of stage gk into ring slot `slot` (and its scale chunk when the stage starts one), all
  // completing on the slot's full barrier.
  constexpr int kWidth = Cfg::width_index(N);
  // Bytes between the activation sub-tiles of a stage: the box's N rows of 128 bytes (TMA), or kMaxN rows (copies)
  constexpr int kActSub = kActTma ? N * 128 : kMaxN * 128;
  static_assert(Cfg::width(kWidth) == N, "N is one of the instantiated widths");
  constexpr uint32_t kTx = uint32_t(Cfg::kWBytes) + (kActTma ? uint32_t(kB * N * 128) : 0u);
  // Stage gk: k-tile kt of row block rb0 + it; its scale chunk kt / kChunkStages goes to scale slot
  // (gk / kChunkStages) % kScSlots, the chunks of all items counted in one sequence (num_k_tiles % kChunkStages == 0
  // when items > 1: wg_items), as the loop below steps through the slots.
  // issue_weights: the stage's expected bytes (activations included) and its weight and scale boxes; issue_act: its
  // activation box (kActTma). The prologue of a block that has not waited for the grid before it (kPdl and pre_wait)
  // issues the first before the wait and the second after it.
  auto issue_weights = [&](int slot, int gk) {
    const int it = kMaxItems > 1 && gk >= num_k_tiles ? 1 : 0, kt = gk - it * num_k_tiles;
    const int rb = rb0 + it;
    const int wrow0 = silu_mul ? rb * (Cfg::kRows / 2) : rb * Cfg::kRows;
    const int wrow1 = silu_mul ? int(I) + wrow0 : wrow0 + Cfg::kRows / 2;
    const uint32_t bar = bars + 8 * slot;
    const bool chunk = kt % Cfg::kChunkStages == 0;
    mbar_arrive_expect_tx(bar, kTx + (chunk ? uint32_t(Cfg::kScBytes) : 0u));
    const uint32_t sa = stages_s + uint32_t(slot) * Cfg::kStageBytes, sw = sa + Cfg::kABytes;
    // kStore: the R rows are contiguous, one box each for the weights and the scales (the maps' boxes are of R rows);
    // kSiluMul: gate and up rows, two boxes of R / 2 rows each
    // tiled weights (a.w_tiled): 5-D boxes {bytes of the stage in its chunk, 32 rows, chunk, row groups, expert}
    const int wb = kt * (kKS / 2);
    const uint32_t sw1 = sw + (Cfg::kRows / 2) * (kKS / 2);
    if (a.w_tiled) {
      tma_load_5d(sw, &maps.w, wb % 128, 0, wb / 128, wrow0 / kWTileRows, expert, bar);
      if (silu_mul) tma_load_5d(sw1, &maps.w, wb % 128, 0, wb / 128, wrow1 / kWTileRows, expert, bar);
    } else {
      tma_load_3d(sw, &maps.w, wb, wrow0, expert, bar);
      if (silu_mul) tma_load_3d(sw1, &maps.w, wb, wrow1, expert, bar);
    }
    if (chunk) {
      const int c = kt / Cfg::kChunkStages;
      const uint32_t ss = scales_s + uint32_t((gk / Cfg::kChunkStages) % Cfg::kScSlots) * Cfg::kScBytes;
      const uint32_t ss1 = ss + (Cfg::kRows / 2) * 16;
      if (a.w_tiled) {
        tma_load_5d(ss, &maps.s, 0, 0, c, wrow0 / kWTileRows, expert, bar);
        if (silu_mul) tma_load_5d(ss1, &maps.s, 0, 0, c, wrow1 / kWTileRows, expert, bar);
      } else {
        tma_load_3d(ss, &maps.s, c * 16, wrow0, expert, bar);
        if (silu_mul) tma_load_3d(ss1, &maps.s, c * 16, wrow1, expert, bar);
      }
    }
  };
  // the stage's kB activation sub-tiles as one box of a 3-D view {64 elements, rows, K / 64}: sub-tile j lands at
  // sa + j * N * 128 (kActSub)
  auto issue_act = [&](int slot, int gk) {
    if constexpr (kActTma) {
      const int it = kMaxItems > 1 && gk >= num_k_tiles ? 1 : 0, kt = gk - it * num_k_tiles;
      tma_load_3d(stages_s + uint32_t(slot) * Cfg::kStageBytes, &maps.act[kWidth], 0, row_begin + m0, kt * kB,
                  bars + 8 * slot);
    }
  };
  auto issue_tma = [&](int slot, int gk) {
    issue_weights(slot, gk);
    issue_act(slot, gk);
  };

  // Copied rows (!kActTma: gathered, or an activation view TMA cannot read): this thread's activation copies,
  // fixed for the whole tile: 16-byte chunk c = kT j + tid of the stage's kB * N * 8 (sub-tile c / (N * 8),
  // token row (c / 8) % N, chunk c % 8 of its 128 bytes); source row: token r of the tile -> grouped row
  // row_begin + m0 + r, or act row act_rows[that] with a gather; a pointer advanced by kKS elements per stage.
  constexpr int kT = Cfg::kThreads;
  constexpr int kChunks = kB * N * 8;
  constexpr int kAR = kActTma ? 1 : (kChunks + kT - 1) / kT;
  const uint16_t* a_src[kAR];
  bool a_valid[kAR];
  uint32_t a_dst[kAR];  // byte offset of the copy in a stage
  if constexpr (!kActTma) {
    const int64_t first = int64_t(row_begin) + m0;  // invalid tokens read the tile's first row (0 bytes)
    const int64_t first_src = a.act_rows ? int64_t(a.act_rows[first]) : first;
#pragma unroll
    for (int j = 0; j < kAR; ++j) {
      const int c = tid + kT * j;
      const int sub = c / (N * 8), r = (c >> 3) % N, ch = c & 7;
      a_valid[j] = c < kChunks && m0 + r < rows;
      const int64_t src = a_valid[j] ? (a.act_rows ? int64_t(a.act_rows[first + r]) : first + r) : first_src;
      a_src[j] = a.act + src * K + 64 * sub + 8 * ch;
      a_dst[j] = uint32_t(sub * (kMaxN * 128) + r * 128 + ((ch ^ (r & 7)) * 16));
    }
  }
  // Copied rows: this thread's copies of tile kt into ring slot `slot`, then its arrival on the slot's full
  // barrier (counted once they have landed).
  // (copied rows run one item, wg_max_items: stage gk is k-tile gk)
  auto load_act = [&](int slot, int kt) {
    if constexpr (!kActTma) {
      static_assert(kMaxItems == 1, "copied activation rows: one row block per block");
      const uint32_t sa = stages_s + uint32_t(slot) * Cfg::kStageBytes;
      const int64_t ko = int64_t(kt) * kKS;
#pragma unroll
      for (int j = 0; j < kAR; ++j)
        if (kChunks % kT == 0 || tid + kT * j < kChunks)
          cp_async_s<16>(sa + a_dst[j], a_src[j] + ko, a_valid[j] ? 16 : 0);
      mbar_cp_async_arrive(bars + 8 * slot);
    }
  };

  float acc[N / 2];
#pragma unroll
  for (int i = 0; i < N / 2; ++i) acc[i] = 0.f;

  // full[s] (bars + 8 s): tile of slot s landed (the issuing thread's expect_tx arrival and the TMA bytes; with
  // copied rows also kThreads cp.async arrivals); empty[s] (bars + 8 (S + s)): every warp's wgmmas of that
  // stage finished (kThreads / 32 arrivals).
  // kActTma: the TMA boxes of tiles 0 .. S-1 fill the whole ring; then the last warp to finish tile kt (freed[slot]
  // counts the warps) issues those of tile kt + S into its slot, so no thread waits for a slot to free. Copied
  // activation rows: every thread waits on the empty barrier of tile kt - 1 anyway before its cp.async copies of
  // tile kt + A (A = S - 1 ahead), so thread 0 issues that tile's boxes right there.
  constexpr int A = S - 1;
  if constexpr (kPdl) {
    if (tid == 0)
      for (int s = 0; s < (kActTma ? S : A) && s < total; ++s) issue_weights(s, s);
    if (pre_wait) griddep_sync_and_release();
    if (tid == 0)
      for (int s = 0; s < (kActTma ? S : A) && s < total; ++s) issue_act(s, s);
  } else if (tid == 0) {
    for (int s = 0; s < (kActTma ? S : A) && s < total; ++s) issue_tma(s, s);
  }
#pragma unroll
  for (int s = 0; s < A; ++s)
    if (s < total) load_act(s, s);

  // Shared rows of this thread's A-fragment rows g (h = 0) and g + 8 (h = 1), see the weight rows above.
  const int srow0 = silu_mul ? wg * 32 + wq * 8 + g : wg * 64 + wq * 16 + g;
  const int srow1 = silu_mul ? srow0 + Cfg::kRows / 2 : srow0 + 8;
  uint32_t af[4 * kB][4];
  const uint32_t desc_lo0 = sw128_desc_lo(stages_s);
  const uint32_t sc_sel = scale_byte_sel(uint32_t(tig));  // this lane's scale code byte of a block's word
  int slot = 0, pf_slot = A;  // gk % S and (gk + A) % S
  uint32_t phase = 0;         // (gk / S) & 1
  int sc_slot = 0, sc_pos = 0;  // scale slot of stage gk's chunk, and gk's stage within the chunk
  // kActTma, lane 0: the warp's count in freed[] for the stage before (the counter's old value) and the tile the
  // last warp issues into that stage's slot, pend_kt % S (-1: none); checked one stage later, while this stage's
  // wgmmas run, so the warp never waits for the atomic's result.
  uint32_t pend_old = 0u;
  int pend_kt = -1;
#pragma unroll 1
  for (int it = 0; it < n_items; ++it) {
    const int gk_end = (it + 1) * num_k_tiles;
    for (int gk = it * num_k_tiles; gk < gk_end; ++gk) {
      mbar_wait(bars + 8 * slot, phase);                   // stage gk landed
      if constexpr (!kActTma) fence_proxy_async_smem();    // ... and the copies are visible to the async proxy
      const int pf = gk + A;
      if (!kActTma && pf < total) {
        // the slot's previous tile pf - S: every warp's wgmmas on it finished
        if (pf >= S) mbar_wait(bars + 8 * (S + pf_slot), uint32_t((pf / S - 1) & 1));
        if (tid == 0) issue_tma(pf_slot, pf);
        load_act(pf_slot, pf);
      }

      // Dequantize: word q of block b of row h (8 bytes at 8 tig of the block's 32) -> k16 steps 4b + 2q
      // (pairs 0, 1) and 4b + 2q + 1 (pairs 2, 3); registers 0 / 2 for row g, 1 / 3 for row g + 8.
      const uint8_t* sw = stages + slot * Cfg::kStageBytes + Cfg::kABytes;
      const uint8_t* ss = scales + sc_slot * Cfg::kScBytes + sc_pos * (kKS / 16);
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int sr = h ? srow1 : srow0;
        uint32_t sc[kB];  // the row's kKS / 16 scale bytes of the stage, one shared load
        if constexpr (kB == 4) {
          const uint4 v = *reinterpret_cast<const uint4*>(ss + sr * 16);
          sc[0] = v.x; sc[1] = v.y; sc[2] = v.z; sc[3] = v.w;
        } else if constexpr (kB == 2) {
          const uint2 v = *reinterpret_cast<const uint2*>(ss + sr * 16);
          sc[0] = v.x; sc[1] = v.y;
        } else {
          sc[0] = *reinterpret_cast<const uint32_t*>(ss + sr * 16);
        }
        const uint8_t* wrow = sw + sr * (kKS / 2) + (tig & 1) * 8;
        const int x = Cfg::wswz(sr);
#pragma unroll
        for (int b = 0; b < kB; ++b) {
          const uint2 w = *reinterpret_cast<const uint2*>(wrow + (((2 * b + (tig >> 1)) ^ x) * 16));
          const uint32_t s2 = scale_pair(sc[b], sc_sel);
#pragma unroll
          for (int q = 0; q < 2; ++q) {
            uint32_t p[4];
            dequant_word(q ? w.y : w.x, s2, p);
            af[4 * b + 2 * q][h] = p[0];
            af[4 * b + 2 * q][2 + h] = p[1];
            af[4 * b + 2 * q + 1][h] = p[2];
            af[4 * b + 2 * q + 1][2 + h] = p[3];
          }
        }
      }

      acc_fence(acc);
      wgmma_fence();
      // descriptor address field of k16 step ks: the slot's base plus a compile-time offset (one uniform add per wgmma)
      const uint32_t lo_slot = desc_lo0 + uint32_t(slot) * uint32_t(Cfg::kStageBytes >> 4);
#pragma unroll
      for (int ks = 0; ks < 4 * kB; ++ks)
        Wgmma<N>::mma(acc, af[ks], sw128_desc(lo_slot + uint32_t(((ks >> 2) * kActSub + (ks & 3) * 32) >> 4)));
      wgmma_commit();
      acc_fence(acc);
      if constexpr (kActTma) {
        // the last of the block's warps to finish the stage before issues the TMA boxes of tile pend_kt into its slot
        constexpr uint32_t kWarps = Cfg::kThreads / 32;
        if (lane == 0 && pend_kt >= 0 && (pend_old + 1u) % kWarps == 0u) {
          fence_proxy_async_smem();
          issue_tma(pend_kt % S, pend_kt);
        }
      }
      // Drain before the A registers are redefined (registers feeding an in-flight wgmma must not be
      // written). The other warpgroups on the SM keep the tensor cores busy meanwhile, so one drain per
      // stage costs little (overlapping the decode with this warpgroup's own wgmmas gained nothing:
      // docs/PERFORMANCE.md, rejected variants).
      wgmma_wait<0>();
      __syncwarp();
      if constexpr (!kActTma) {
        if (lane == 0) mbar_arrive(bars + 8 * (S + slot));
      } else {
        // acq_rel: every other warp's reads of the slot (its shared loads, and its wgmmas, drained) happen before
        // the last one's TMA writes into it (issued during the next stage, above). Every lane executes the atomic,
        // lane 0 on the slot's counter and the others on a scratch word of their own (a warp-uniform condition
        // would make the compiler aggregate it: a shuffle of the result right behind the atomic, waiting for it).
        pend_old = atom_add_acq_rel_shared(lane == 0 ? freed + 4 * slot : freed + 4 * (S + lane), lane == 0 ? 1u : 0u);
        pend_kt = gk + S < total ? gk + S : -1;
      }
      slot = slot + 1 == S ? 0 : slot + 1;
      phase ^= slot == 0 ? 1u : 0u;
      pf_slot = pf_slot + 1 == S ? 0 : pf_slot + 1;
      if (++sc_pos == Cfg::kChunkStages) {
        sc_pos = 0;
        sc_slot = sc_slot + 1 == Cfg::kScSlots ? 0 : sc_slot + 1;
      }
    }
    // item it done: with one item every copy of the tile has landed (each loaded stage's full barrier was waited on);
    // with two, the copies in flight are the next item's, into slots no warp reads now
    acc_fence(acc);
    if constexpr (kQuantH) {
      wg_epilogue_h_nvfp4<N, kMaxN>(a, acc, reinterpret_cast<float*>(stages), I, expert, row_begin, rows, m0, rb0, wg,
                                    wq, g, tig);
    } else {
      wg_epilogue<N, kMaxN>(a, acc, silu_mul, Nw, I, expert, row_begin, rows, m0, rb0 + it, wg, wq, g, tig);
      if (kMaxItems > 1) {
#pragma unroll
        for (int i = 0; i < N / 2; ++i) acc[i] = 0.f;
      }
    }
  }
}

// wg_tile of the narrowest instantiated width (WgCfg::width(i), i >= I) that holds `count` tokens.
template <int I, int kMaxN, int kStageK, bool kActTma, bool kQuantH, bool kPdl>
__device__ __forceinline__ void wg_tile_of_width(int count, const GroupedGemmCommon& a, const WgMaps& maps,
                                                 uint8_t* stages, uint8_t* scales, uint32_t bars, uint32_t freed,
                                                 int expert, int row_begin, int rows, int m0, int rb0, int items,
                                                 bool pre_wait) {
  using Cfg = WgCfg<kMaxN, kStageK>;
  if constexpr (I + 1 < Cfg::kNumWidths) {
    if (count > Cfg::width(I)) {
      wg_tile_of_width<I + 1, kMaxN, kStageK, kActTma, kQuantH, kPdl>(count, a, maps, stages, scales, bars, freed,
                                                                      expert, row_begin, rows, m0, rb0, items,
                                                                      pre_wait);
      return;
    }
  }
  wg_tile<Cfg::width(I), kMaxN, kStageK, kActTma, kQuantH, kPdl>(a, maps, stages, scales, bars, freed, expert,
                                                                row_begin, rows, m0, rb0, items, pre_wait);
}

// One token's slots (GroupedGemmCommon::slot_experts): the tile of block row y is slot y's row (grouped row y, one
// token) of expert slot_experts[y], into *found (thread 0; a block barrier publishes it and the mbarriers). Returns the
// grid's tiles as expert_tile_of_block does: all of grid.y, or none when the slot's id is dropped.
__device__ __forceinline__ int wg_slot_tile(const GroupedGemmCommon& a, ExpertTile* found, int tid) {
  const int slot = int(blockIdx.y), expert = slot_expert_id(a, slot);
  if (tid == 0) *found = ExpertTile{expert, slot, 1, 0};
  __syncthreads();
  return expert >= 0 ? int(gridDim.y) : 0;
}

// The kernel reads the common part of the arguments only: WgmmaGemmArgs' own fields (tile, stage K, TMA rows, the
// bounds of the TMA view and the grid) chose this instance, its tensor maps and its grid on the host.
// kPdl: launched with programmatic dependent launch (plan_pdl_launch), following pdl.cuh's protocol.
template <int kMaxN, int kStageK, bool kActTma, bool kQuantH, bool kPdl>
__global__ void __launch_bounds__(WgCfg<kMaxN, kStageK>::kThreads, WgCfg<kMaxN, kStageK>::kMinBlocks)
    wg_gemm_kernel(GroupedGemmCommon a, const __grid_constant__ WgMaps maps) {
  static_assert(kMaxN == kTile8 || kMaxN == kTile32 || kMaxN == kTile64 || kMaxN == kTile128,
                "token tiles of 8, 32, 64 or 128");
  static_assert(!(kQuantH && kMaxN == kTile8), "h is quantized by blocks of 128 rows or more (wg_epilogue_h_nvfp4)");
  static_assert(WgCfg<kMaxN, kStageK>::kNumWidths <= 7, "WgMaps holds one activation map per width");
  using Cfg = WgCfg<kMaxN, kStageK>;
  extern __shared__ uint8_t wg_smem_raw[];
  // 1024-align the stage ring (the SW128 and TMA swizzles are functions of address bits 4..9).
  const uint32_t raw_addr = static_cast<uint32_t>(__cvta_generic_to_shared(wg_smem_raw));
  uint8_t* stages = wg_smem_raw + ((1024u - (raw_addr & 1023u)) & 1023u);
  uint8_t* scales = stages + Cfg::kStageBytes * Cfg::kStages;                  // kScSlots scale chunks
  int32_t* warp_sums = reinterpret_cast<int32_t*>(scales + Cfg::kScBytes * Cfg::kScSlots);  // [32] scan scratch
  ExpertTile* found = reinterpret_cast<ExpertTile*>(warp_sums + 32);              // the block's expert tile
  // 2 kStages mbarriers, then kStages freed counters (warps done with the slot's tiles so far) and 32 scratch words
  const uint32_t bars = static_cast<uint32_t>(__cvta_generic_to_shared(found + 1));
  uint32_t* freed = reinterpret_cast<uint32_t*>(found + 1) + 4 * Cfg::kStages;

  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  if (tid == 0) {
    for (int s = 0; s < Cfg::kStages; ++s) {
      mbar_init(bars + 8 * s, kActTma ? 1 : Cfg::kThreads + 1);
      mbar_init(bars + 8 * (Cfg::kStages + s), Cfg::kThreads / 32);
      freed[s] = 0u;
    }
    mbar_fence_init();  // the initialized barriers are visible to the TMA unit
    tma_prefetch_map(&maps.w);
    tma_prefetch_map(&maps.s);
  }
  // Programmatic dependent launch (kPdl, pdl.cuh): with settled offsets (GroupedGemmCommon::offsets_settled, the
  // forward's GEMMs) the block finds its tile in expert_offsets and issues its first stages' weight boxes before it
  // waits for the grid before it (whose tail it overlaps: pdl.cuh rule 3), else it waits first. Either way it releases
  // its dependents once it has waited.
  const bool pre_wait = kPdl && a.offsets_settled;
  if (kPdl && !pre_wait) griddep_sync_and_release();

  // Which expert and which token tile of it (the scan's barriers also publish the mbarriers). One token's slots
  // (a.slot_experts; the kPdl instances only, as launch_wg_gemm_k launches them): block row y is slot y, grouped row y
  // of expert slot_experts[y] (wg_slot_tile), none when that id is dropped; slot y's first block writes
  // entry_row_out[y] (y, or -1) once it has waited (pdl.cuh rule 1).
  bool slots = false;
  if constexpr (kPdl) slots = a.slot_experts != nullptr;
  const int num_tiles = slots ? wg_slot_tile(a, found, tid)
                              : expert_tile_of_block<Cfg::kThreads, kMaxN, kPdl>(a, a.num_experts, blockIdx.y,
                                                                                 warp_sums, found, tid, warp, lane);
  if (int(blockIdx.y) >= num_tiles) {
    if (pre_wait) griddep_sync_and_release();
    if (slots && a.entry_row_out && blockIdx.x == 0 && tid == 0) a.entry_row_out[blockIdx.y] = -1;
    return;
  }
  const ExpertTile et = *found;
  const int expert = et.expert, row_begin = et.row_begin, rows = et.rows, m0 = et.m0;
  const int count = min(rows - m0, kMaxN);  // tokens in this tile (block-uniform)
  // row blocks rb0 .. rb0 + items - 1 of the tile (wg_items)
  const int row_blocks = wg_row_blocks<kMaxN>(a);
  const int per_block = wg_block_items(wg_max_items(kMaxN, kActTma, kQuantH), row_blocks, gridDim.x);
  const int rb0 = int(blockIdx.x) * per_block;
  const int items = min(per_block, row_blocks - rb0);

  wg_tile_of_width<0, kMaxN, kStageK, kActTma, kQuantH, kPdl>(count, a, maps, stages, scales, bars,
                                                         static_cast<uint32_t>(__cvta_generic_to_shared(freed)), expert,
                                                         row_begin, rows, m0, rb0, items, pre_wait);
  if (slots && a.entry_row_out && blockIdx.x == 0 && tid == 0) a.entry_row_out[row_begin] = row_begin;
}

}  // namespace megamoe::sm90

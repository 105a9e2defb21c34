// NVFP4 grouped GEMM on Hopper wgmma, warp-specialized and pipelined (force_kernel 7 and 8).
// Same problem, block tiling and epilogue as grouped_gemm_wgmma.cuh (swap-AB: 128 weight rows of
// one expert = M, a tile of up to kMaxN tokens of that expert = N, K in steps of 64), but:
//
//  - warpgroup 0 is the PRODUCER (setmaxnreg.dec): it cp.asyncs the activation tile (bf16,
//    operand order, 128-byte swizzled: 16-byte chunk c of row r at chunk c ^ (r & 7)), the packed
//    NVFP4 weights (32 bytes per row per stage) and their e4m3 scales into a kStages-deep ring,
//    then decodes the weights ONCE into a bf16 tile of the SAME layout (128 rows x 128 bytes,
//    SW128 K-major, operand order: packed word c of a row = elements 8c..8c+7 -> chunk c), fences
//    it for the async proxy and arrives on the stage's FULL mbarrier. Thread t decodes weight row t;
//    the row's packed bytes are copied by lanes of the same warp (coalesced 32-byte sectors), so
//    decode needs only a __syncwarp, no barrier among the producer warps.
//  - warpgroups 1 and 2 are CONSUMERS (setmaxnreg.inc): 64 weight rows each (rows 64*cw..+63 of the
//    tile), wgmma m64nNk16 with A AND B from shared memory (descriptors), one commit group per
//    64-K stage, wait_group<1> (the group of stage kt stays in flight while stage kt+1 is issued),
//    then release stage kt-1 on its EMPTY mbarrier.
//
// Producer loop (prefetch distance kStages-1), per k-tile kt:
//   cp.async.wait_group (tile kt landed, own copies) -> decode into slot kt%S -> fence.proxy.async
//   -> arrive FULL[kt%S];  then wait EMPTY of the slot of tile kt-1 (consumers finished its wgmmas)
//   and issue the loads of tile kt+S-1 into it.
// Consumer loop: wait FULL[kt%S] -> 4 x wgmma (k16 steps) -> commit -> wait_group<1> -> arrive
//   EMPTY[(kt-1)%S].  No block-wide barrier after the setup; nothing else is shared.
//
// The accumulator fragment of wgmma is the same for A in registers or in shared memory, and a
// block-local weight row lr sits at tile row lr in both kernels, so the consumers run wg_tile()'s
// epilogue (wg_epilogue(), grouped_gemm_wgmma.cuh) with the consumer warpgroup in place of the
// warpgroup (same alphas, row scales, SiLU*up with clamp, output layout).
#pragma once
#include "gemm_common.cuh"
#include "grouped_gemm_tiled.cuh"  // cp_async
#include "grouped_gemm_wgmma.cuh"  // kWgRows, kWgK, kWgWRowBytes, sw128_desc, wgmma_fence/commit/wait, acc_fence
#include "megamoe/sm90_kernels.h"
#include "wgmma_ss_ops.cuh"

namespace megamoe::sm90 {

// kPWG producer warpgroups (1: force_kernel 7/8, 2: 9) + 2 consumer warpgroups.
// setmaxnreg: the consumers' increase is served from what the producers release, within the block's
// allocation at launch (threads x the __launch_bounds__(threads, 1) cap: 168 for 384 threads, 128 for
// 512); asking for more would make setmaxnreg.inc wait forever. The consumers use ~152 (ptxas, N = 256).
template <int kPWG>
struct WsRoles {
  static constexpr int kProducers = 128 * kPWG, kThreads = kProducers + 256;
  static constexpr int kEntryRegs = kPWG == 1 ? 168 : 128;
  static constexpr int kProducerRegs = 56, kConsumerRegs = kPWG == 1 ? 224 : 200;
  static_assert(kProducers * kProducerRegs + 256 * kConsumerRegs <= kThreads * kEntryRegs, "setmaxnreg beyond the launch allocation");
  static_assert(kThreads * kEntryRegs <= 65536, "register file");
};
constexpr int kWsLarge = 256, kWsMid = 128;                // token-tile configurations (force_kernel 7, 8)

// One block per SM (the ring is most of shared memory). Stage layout (every part 1024-aligned
// where wgmma reads it): [activations kMaxN x 128 B][bf16 weights 128 x 128 B][packed weights
// 128 x 48 B][scales 128 x 4 B].
template <int kMaxN>
struct WsCfg {
  static constexpr int kStages = kMaxN >= 256 ? 4 : 5;
  static constexpr int kABytes = kMaxN * 128;
  static constexpr int kWTileBytes = kWgRows * 128;
  static constexpr int kRawBytes = kWgRows * kWgWRowBytes;
  static constexpr int kRaw = kABytes + kWTileBytes + kRawBytes + kWgRows * 4;
  static constexpr int kStageBytes = (kRaw + 1023) / 1024 * 1024;
  static constexpr int kSmem = 1024 /*alignment slack*/ + kStageBytes * kStages + 256 * 4 /*LUT*/ + 2 * kStages * 8;
  static_assert(kABytes % 1024 == 0 && kStageBytes % 1024 == 0, "SW128 tiles must be 1024-aligned");
  static_assert(kSmem <= 232448, "over the sm_90 shared-memory limit per block");
  static_assert(kStageBytes >= 1024 * 4 + 64, "stage 0 holds the tile scan during setup");
};

// Byte offset of 16-byte chunk c (0..7) of row r in a 128-byte-swizzled K-major tile (1024-aligned):
// the PTX 128B swizzle XORs address bits [4,7) with bits [7,10).
__host__ __device__ constexpr uint32_t ws_sw128_offset(uint32_t r, uint32_t c) { return r * 128u + ((c ^ (r & 7u)) * 16u); }

__device__ __forceinline__ uint32_t ws_smem_u32(const void* p) { return static_cast<uint32_t>(__cvta_generic_to_shared(p)); }
__device__ __forceinline__ void ws_mbar_init(uint64_t* bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(ws_smem_u32(bar)), "r"(count) : "memory");
}
__device__ __forceinline__ void ws_mbar_arrive(uint64_t* bar) {
  asm volatile("{\n.reg .b64 st;\nmbarrier.arrive.shared::cta.b64 st, [%0];\n}\n" ::"r"(ws_smem_u32(bar)) : "memory");
}
// Blocks until the phase of parity `parity` of the barrier has completed. Watchdog: a wait of more
// than ~2^34 cycles (~9 s; a legitimate wait here is microseconds) traps, so that a pipeline bug
// shows up as a launch failure instead of a hung device (this kernel was written without a GPU).
__device__ __forceinline__ void ws_mbar_wait(uint64_t* bar, uint32_t parity) {
  const uint32_t addr = ws_smem_u32(bar);
  uint32_t done = 0;
  long long start = 0;
  for (;;) {
    asm volatile(
        "{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(done)
        : "r"(addr), "r"(parity)
        : "memory");
    if (done) break;
    const long long now = clock64();
    if (start == 0) start = now;
    else if (now - start > (1ll << 34)) __trap();
  }
}
// L2 prefetch hint of `bytes` (multiple of 16) contiguous global bytes at a 16-byte-aligned address.
__device__ __forceinline__ void ws_prefetch_l2(const void* p, uint32_t bytes) {
  asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;\n" ::"l"(p), "r"(bytes) : "memory");
}
template <int N>
__device__ __forceinline__ void ws_cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory"); }

// Block-local weight row lr -> global weight row (as wg_tile(): kSiluMul puts gate rows at lr & 8 == 0
// and the matching up rows at lr & 8 == 8 so that one thread holds both in its D fragment).
__device__ __forceinline__ int64_t ws_weight_row(const GroupedGemmArgs& a, int lr, bool& valid) {
  if (a.epilogue == Epilogue::kSiluMul) {
    const int64_t I = a.N / 2;
    const int64_t col = int64_t(blockIdx.x) * 64 + (lr >> 4) * 8 + (lr & 7);
    valid = col < I;
    return valid ? (((lr >> 3) & 1) ? I + col : col) : 0;
  }
  const int64_t n = int64_t(blockIdx.x) * kWgRows + lr;
  valid = n < a.N;
  return valid ? n : 0;
}

template <int N, int kMaxN, int kPWG>
__device__ __forceinline__ void ws_producer(const GroupedGemmArgs& a, uint8_t* stages, const uint32_t* lut, uint64_t* full,
                                            uint64_t* empty, int expert, int row_begin, int rows, int m0) {
  using Cfg = WsCfg<kMaxN>;
  constexpr int S = Cfg::kStages;
  constexpr int P = WsRoles<kPWG>::kProducers;
  constexpr int kWords = 8 / kPWG;     // packed 32-bit words (8 elements each) decoded per thread and stage
  constexpr int kRowStep = P / 8;      // activation rows between a thread's chunks
  constexpr int kChunks = N * 8 / P;   // activation chunks per thread and stage
  static_assert(N <= kMaxN && (N * 8) % P == 0, "activation chunks per producer thread");
  const int pt = threadIdx.x;          // 0..P-1: decodes words w0..w0+kWords-1 of weight row d_row
  const int d_row = pt / kPWG, w0 = (pt % kPWG) * kWords;
  const bool scale_owner = (pt % kPWG) == 0;  // copies the row's 4 scale bytes (kPWG 2: for both halves)
  const int64_t K = a.K, Kb = K / 16, row_bytes = K / 2;
  // Packed weights: the 32 bytes of a row per stage come as one coalesced 32-byte sector from two
  // neighbouring lanes. kPWG 1: lane l loads half l & 1 of rows 32w + (l >> 1) and 32w + 16 + (l >> 1)
  // (w = warp); kPWG 2: thread pt loads half pt & 1 of row pt >> 1 (its own words). Decode may read bytes
  // another lane of the same warp copied (scales too): __syncwarp after the wait.
  const int lane = pt & 31, w_half = lane & 1;
  const int w_lr0 = kPWG == 1 ? (pt & ~31) + (lane >> 1) : (pt >> 1), w_lr1 = w_lr0 + 16;
  bool w_valid0, w_valid1 = false, s_valid;
  const uint8_t* w_src0 = a.w_data + (int64_t(expert) * a.N + ws_weight_row(a, w_lr0, w_valid0)) * row_bytes + w_half * 16;
  const uint8_t* w_src1 = w_src0;
  if (kPWG == 1) w_src1 = a.w_data + (int64_t(expert) * a.N + ws_weight_row(a, w_lr1, w_valid1)) * row_bytes + w_half * 16;
  const int64_t wrow_pt = int64_t(expert) * a.N + ws_weight_row(a, d_row, s_valid);  // the row this thread decodes
  const uint8_t* s_src = a.w_scale + wrow_pt * Kb;
  // Activation chunks of this thread: chunk pt & 7 of tile rows r0 + kRowStep i (i < kChunks); rows past
  // the expert's last token are zero-filled (source size 0, address clamped to its first row).
  const int r0 = pt >> 3, ch = pt & 7;
  const int valid_chunks = min(kChunks, max(0, (rows - m0 - r0 + kRowStep - 1) / kRowStep));
  const uint16_t* act_first = a.act + int64_t(row_begin) * K + ch * 8;
  const uint16_t* act_src = act_first + int64_t(m0 + r0) * K;
  const uint32_t act_dst = ws_sw128_offset(r0, ch);  // + i * 128 * kRowStep (same row & 7)
  const int num_k_tiles = int(K / kWgK);

  // The packed weights and scales of a block are read exactly once (from HBM) and only 2-3 stages
  // ahead of their decode, so every 8 k-tiles each producer thread asks L2 for the next 8 k-tiles of
  // its row (256 bytes of packed weights, 32 of scales; a hint, no completion tracked).
  const uint8_t* pf_w = a.w_data + wrow_pt * row_bytes;
  const bool pf_s_ok = scale_owner && s_valid && (Kb % 16) == 0 && (reinterpret_cast<uintptr_t>(s_src) & 15) == 0;
  const bool pf_w_ok = scale_owner && s_valid && (reinterpret_cast<uintptr_t>(pf_w) & 15) == 0;
  auto prefetch_tiles = [&](int kt0) {  // k-tiles [kt0, kt0 + 8) that exist; kt0 % 8 == 0
    if (kt0 >= num_k_tiles) return;
    const int cnt = min(8, num_k_tiles - kt0);
    if (pf_w_ok) ws_prefetch_l2(pf_w + int64_t(kt0) * 32, uint32_t(cnt) * 32u);
    if (pf_s_ok && cnt == 8) ws_prefetch_l2(s_src + int64_t(kt0) * 4, 32u);
  };

  auto load_stage = [&](int slot, int kt) {
    if ((kt & 7) == 0) prefetch_tiles(kt + 8);
    uint8_t* sa = stages + slot * Cfg::kStageBytes;
    uint8_t* sraw = sa + Cfg::kABytes + Cfg::kWTileBytes;
    uint8_t* ss = sraw + Cfg::kRawBytes;
    const uint16_t* src = act_src + int64_t(kt) * kWgK;
#pragma unroll
    for (int i = 0; i < kChunks; ++i) {
      const bool valid = i < valid_chunks;
      cp_async(sa + act_dst + i * (128 * kRowStep), valid ? src : act_first, valid ? 16 : 0, 16);
      src += kRowStep * K;
    }
    cp_async(sraw + w_lr0 * kWgWRowBytes + w_half * 16, w_src0 + int64_t(kt) * 32, w_valid0 ? 16 : 0, 16);
    if (kPWG == 1) cp_async(sraw + w_lr1 * kWgWRowBytes + w_half * 16, w_src1 + int64_t(kt) * 32, w_valid1 ? 16 : 0, 16);
    if (scale_owner) cp_async(ss + d_row * 4, s_src + int64_t(kt) * 4, s_valid ? 4 : 0, 4);
  };

  prefetch_tiles(0);
#pragma unroll
  for (int s = 0; s < S - 1; ++s) {
    if (s < num_k_tiles) load_stage(s, s);
    cp_async_commit();
  }
  for (int kt = 0; kt < num_k_tiles; ++kt) {
    const int slot = kt % S;
    ws_cp_async_wait<S - 2>();  // this thread's copies of tile kt landed (committed groups: S-1+kt)
    __syncwarp();               // ... and those of the other lanes of this warp (packed weight halves)
    uint8_t* sa = stages + slot * Cfg::kStageBytes;
    uint8_t* wt = sa + Cfg::kABytes;
    const uint8_t* sraw = wt + Cfg::kWTileBytes;
    const uint8_t* ss = sraw + Cfg::kRawBytes;
    uint32_t w[kWords];
#pragma unroll
    for (int h = 0; h < kWords / 4; ++h) {
      const uint4 v = *reinterpret_cast<const uint4*>(sraw + d_row * kWgWRowBytes + w0 * 4 + h * 16);
      w[4 * h] = v.x, w[4 * h + 1] = v.y, w[4 * h + 2] = v.z, w[4 * h + 3] = v.w;
    }
    const uint32_t sc = *reinterpret_cast<const uint32_t*>(ss + d_row * 4);
#pragma unroll
    for (int j = 0; j < kWords; ++j) {  // word c = elements 8c..8c+7 = chunk c, scale block c/2
      const int c = w0 + j;
      uint32_t p[4];
      dequant_word(w[j], lut[(sc >> (8 * (c >> 1))) & 0xFFu], p);
      *reinterpret_cast<uint4*>(wt + ws_sw128_offset(d_row, c)) = make_uint4(p[0], p[1], p[2], p[3]);
    }
    fence_proxy_async_smem();  // the bf16 tile and this thread's activation chunks -> async proxy (wgmma)
    ws_mbar_arrive(&full[slot]);
    const int pf = kt + S - 1;  // into the slot of tile kt-1
    if (pf < num_k_tiles) {
      if (pf >= S) ws_mbar_wait(&empty[pf % S], uint32_t((pf / S - 1) & 1));
      load_stage(pf % S, pf);
    }
    cp_async_commit();
  }
  ws_cp_async_wait<0>();
}

template <int N, int kMaxN, int kPWG>
__device__ __forceinline__ void ws_consumer(const GroupedGemmArgs& a, uint8_t* stages, uint64_t* full, uint64_t* empty,
                                            int expert, int row_begin, int rows, int m0) {
  using Cfg = WsCfg<kMaxN>;
  constexpr int S = Cfg::kStages;
  const int ct = threadIdx.x - WsRoles<kPWG>::kProducers;  // 0..255
  const int cw = ct >> 7;            // consumer warpgroup: tile rows 64*cw..+63
  const int lane = threadIdx.x & 31, g = lane >> 2, tig = lane & 3, wq = (threadIdx.x >> 5) & 3;
  const int num_k_tiles = int(a.K / kWgK);

  float acc[N / 2];
#pragma unroll
  for (int i = 0; i < N / 2; ++i) acc[i] = 0.f;

  for (int kt = 0; kt < num_k_tiles; ++kt) {
    const int slot = kt % S;
    ws_mbar_wait(&full[slot], uint32_t((kt / S) & 1));
    const uint8_t* sa = stages + slot * Cfg::kStageBytes;
    const uint8_t* wt = sa + Cfg::kABytes + cw * (64 * 128);
    acc_fence(acc);
    wgmma_fence();
#pragma unroll
    for (int ks = 0; ks < 4; ++ks) WgmmaSS<N>::mma(acc, sw128_desc(wt + ks * 32), sw128_desc(sa + ks * 32));
    wgmma_commit();
    acc_fence(acc);
    wgmma_wait<1>();  // the group of tile kt-1 is done: its stage may be refilled
    if (kt > 0) ws_mbar_arrive(&empty[(kt - 1) % S]);
  }
  wgmma_wait<0>();
  acc_fence(acc);

  // Epilogue: as wg_tile() with wg -> cw.
  const bool silu_mul = a.epilogue == Epilogue::kSiluMul;
  const int64_t Nw = a.N, I = Nw / 2;
  wg_epilogue<N>(a, acc, silu_mul, Nw, I, expert, row_begin, rows, m0, cw, wq, g, tig);
}

template <int kMaxN, int kPWG>
__global__ void __launch_bounds__(WsRoles<kPWG>::kThreads, 1) wgws_gemm_kernel(GroupedGemmArgs a) {
  using Cfg = WsCfg<kMaxN>;
  using Roles = WsRoles<kPWG>;
  constexpr int kWsThreads = Roles::kThreads;
  constexpr int S = Cfg::kStages;
  extern __shared__ uint8_t ws_smem_raw[];
  const uint32_t raw_addr = ws_smem_u32(ws_smem_raw);
  uint8_t* stages = ws_smem_raw + ((1024u - (raw_addr & 1023u)) & 1023u);
  uint32_t* scale_lut = reinterpret_cast<uint32_t*>(stages + Cfg::kStageBytes * S);
  uint64_t* full = reinterpret_cast<uint64_t*>(scale_lut + 256);
  uint64_t* empty = full + S;
  // The tile scan lives in stage 0 during setup (before any copy is issued).
  int32_t* tile_scan = reinterpret_cast<int32_t*>(stages);  // [1024] inclusive tile counts
  int32_t* warp_sums = tile_scan + 1024;

  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  for (int i = tid; i < 256; i += kWsThreads) scale_lut[i] = scale_bf16x2(uint8_t(i));
  if (tid == 0) {
    for (int s = 0; s < S; ++s) {
      ws_mbar_init(&full[s], Roles::kProducers);  // every producer thread arrives once per fill
      ws_mbar_init(&empty[s], 256);  // every consumer thread arrives once per release
    }
  }

  // Which expert and which token tile of it (block-uniform return past the last tile).
  const int E = a.num_experts;
  const int num_tiles = expert_tile_scan<kWsThreads, kMaxN>(a, E, tile_scan, warp_sums, tid, warp, lane);
  const int tile = blockIdx.y;
  if (tile >= num_tiles) return;
  const ExpertTile et = find_expert_tile<kMaxN>(a, E, tile_scan, tile);
  const int expert = et.expert, row_begin = et.row_begin, rows = et.rows, m0 = et.m0;
  const int count = min(rows - m0, kMaxN);  // tokens in this tile (block-uniform)
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  __syncthreads();  // LUT and barriers ready; every thread done with the tile scan (stage 0 is free)

  if (warp < 4 * kPWG) {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(Roles::kProducerRegs));
    if constexpr (kMaxN == 256) {
      if (count <= 64) ws_producer<64, kMaxN, kPWG>(a, stages, scale_lut, full, empty, expert, row_begin, rows, m0);
      else if (count <= 128) ws_producer<128, kMaxN, kPWG>(a, stages, scale_lut, full, empty, expert, row_begin, rows, m0);
      else if (count <= 160) ws_producer<160, kMaxN, kPWG>(a, stages, scale_lut, full, empty, expert, row_begin, rows, m0);
      else if (count <= 192) ws_producer<192, kMaxN, kPWG>(a, stages, scale_lut, full, empty, expert, row_begin, rows, m0);
      else if (count <= 224) ws_producer<224, kMaxN, kPWG>(a, stages, scale_lut, full, empty, expert, row_begin, rows, m0);
      else ws_producer<256, kMaxN, kPWG>(a, stages, scale_lut, full, empty, expert, row_begin, rows, m0);
    } else {
      if (count <= 32) ws_producer<32, kMaxN, kPWG>(a, stages, scale_lut, full, empty, expert, row_begin, rows, m0);
      else if (count <= 64) ws_producer<64, kMaxN, kPWG>(a, stages, scale_lut, full, empty, expert, row_begin, rows, m0);
      else if (count <= 96) ws_producer<96, kMaxN, kPWG>(a, stages, scale_lut, full, empty, expert, row_begin, rows, m0);
      else ws_producer<128, kMaxN, kPWG>(a, stages, scale_lut, full, empty, expert, row_begin, rows, m0);
    }
  } else {
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(Roles::kConsumerRegs));
    if constexpr (kMaxN == 256) {
      if (count <= 64) ws_consumer<64, kMaxN, kPWG>(a, stages, full, empty, expert, row_begin, rows, m0);
      else if (count <= 128) ws_consumer<128, kMaxN, kPWG>(a, stages, full, empty, expert, row_begin, rows, m0);
      else if (count <= 160) ws_consumer<160, kMaxN, kPWG>(a, stages, full, empty, expert, row_begin, rows, m0);
      else if (count <= 192) ws_consumer<192, kMaxN, kPWG>(a, stages, full, empty, expert, row_begin, rows, m0);
      else if (count <= 224) ws_consumer<224, kMaxN, kPWG>(a, stages, full, empty, expert, row_begin, rows, m0);
      else ws_consumer<256, kMaxN, kPWG>(a, stages, full, empty, expert, row_begin, rows, m0);
    } else {
      if (count <= 32) ws_consumer<32, kMaxN, kPWG>(a, stages, full, empty, expert, row_begin, rows, m0);
      else if (count <= 64) ws_consumer<64, kMaxN, kPWG>(a, stages, full, empty, expert, row_begin, rows, m0);
      else if (count <= 96) ws_consumer<96, kMaxN, kPWG>(a, stages, full, empty, expert, row_begin, rows, m0);
      else ws_consumer<128, kMaxN, kPWG>(a, stages, full, empty, expert, row_begin, rows, m0);
    }
  }
}

template <int kMaxN, int kPWG>
inline cudaError_t launch_wgws_gemm_cfg(const GroupedGemmArgs& a, cudaStream_t stream) {
  using Cfg = WsCfg<kMaxN>;
  static bool attr_set = false;
  if (!attr_set) {
    cudaError_t err = cudaFuncSetAttribute(wgws_gemm_kernel<kMaxN, kPWG>, cudaFuncAttributeMaxDynamicSharedMemorySize, Cfg::kSmem);
    if (err != cudaSuccess) return err;
    attr_set = true;
  }
  const bool silu_mul = a.epilogue == Epilogue::kSiluMul;
  const unsigned gx = silu_mul ? unsigned((a.N / 2 + 63) / 64) : unsigned((a.N + kWgRows - 1) / kWgRows);
  const int64_t tiles = (a.max_total_rows + kMaxN - 1) / kMaxN + a.grid_experts;
  if (tiles > 65535) return cudaErrorInvalidValue;
  wgws_gemm_kernel<kMaxN, kPWG><<<dim3(gx, unsigned(tiles)), WsRoles<kPWG>::kThreads, Cfg::kSmem, stream>>>(a);
  return cudaGetLastError();
}

// variant: 7 token tile 256 (N 64/128/160/192/224/256), 8 token tile 128 (N 32/64/96/128), one producer
// warpgroup; 9: token tile 128 with two producer warpgroups (512 threads, each producer thread decodes half
// a row). ptxas allocates the whole kernel within the entry cap (128 registers at 512 threads: setmaxnreg
// does not raise it), so the m64n256 accumulators (~154 registers) cannot have two producer warpgroups.
inline cudaError_t launch_wgws_gemm(const GroupedGemmArgs& a, cudaStream_t stream, int variant) {
  if (variant == 8) return launch_wgws_gemm_cfg<kWsMid, 1>(a, stream);
  if (variant == 9) return launch_wgws_gemm_cfg<kWsMid, 2>(a, stream);
  return launch_wgws_gemm_cfg<kWsLarge, 1>(a, stream);
}

}  // namespace megamoe::sm90

// NVFP4 grouped GEMM on Hopper wgmma for wide token tiles (prefill), warp-specialized and persistent.
//
// Same operands and decode as grouped_gemm_wgmma.cuh (swap-AB: the weights are the register A operand,
// dequantized lane-owned from shared memory; the tokens the shared-memory B operand, lane order, SW128),
// but each block is
//  - one copy warpgroup (warpgroup 2) that only issues the cp.async copies of a kStages-deep ring of K-64
//    stages, with 40 registers (setmaxnreg), and
//  - two MMA warpgroups (warpgroups 0 and 1: 64 weight rows each, 128 per block) with 232 registers, which
//    hold the accumulators of up to 256 tokens and two A fragments: the decode of stage kt + 1 runs while
//    the wgmmas of stage kt are in flight (wgmma.wait_group 1), so each warpgroup keeps the tensor cores
//    fed by itself;
// one block per SM, persistent: block b runs the work items b, b + gridDim.x, ... (item = token tile *
// column blocks + column block), and the ring runs on through the items, so the copies of the next item
// start while the current one's last stages and epilogue run.
// Token tiles of up to kWsMaxN = 256 tokens of one expert; per item the wgmma width N is the tile's token
// count rounded up to a multiple of 32.
//
// Barriers per ring slot s: full[s] (bars + 8 s): the copy warpgroup's 128 threads each arrive with
// cp.async.mbarrier.arrive once their copies of the stage landed; empty[s] (bars + 8 (S + s)): each of the
// 8 MMA warps arrives once its wgmmas reading the slot have finished. Stage q of the block (counted through
// all its items) is in slot q % S with phase (q / S) & 1.
#pragma once
#include <algorithm>
#include <type_traits>

#include "grouped_gemm_wgmma.cuh"
#include "pdl.cuh"

namespace megamoe::sm90 {

constexpr int kWsMaxN = 256;  // token tile of GemmKernel::kWgmma256

struct WsCfg {
  static constexpr int kKS = 64;  // K per stage: one SW128 activation sub-tile
  static constexpr int kStages = 5;
  static constexpr int kMmaThreads = 256, kCopyThreads = 128, kThreads = kMmaThreads + kCopyThreads;
  static constexpr int kCopyRegs = 40, kMmaRegs = 232;  // setmaxnreg: 128 x 40 + 256 x 232 <= 64 K registers
  static constexpr int kABytes = kWsMaxN * 128;
  static constexpr int kWBytes = kWgRows * kKS / 2;
  static constexpr int kSBytes = kWgRows * kKS / 16;
  static constexpr int kStageBytes = (kABytes + kWBytes + kSBytes + 1023) / 1024 * 1024;  // A tiles 1024-aligned
  // ring, scale LUT, expert/tile scan (+ warp sums), the copy warpgroup's source-row table, 2 S mbarriers
  static constexpr int kSmem = 1024 + kStageBytes * kStages + 256 * 4 + (1024 + 32) * 4 + kWsMaxN * 4 + 16 * kStages;
  static_assert(kSmem <= 227 * 1024, "one block per SM must fit in shared memory");
  static_assert(kCopyThreads * kCopyRegs + kMmaThreads * kMmaRegs <= 65536, "setmaxnreg budget");
};

inline bool wg_ws_supported(const GroupedGemmArgs& a) { return a.K % WsCfg::kKS == 0 && a.num_experts <= kWgMaxExperts; }

struct WsItem {
  int bx;  // column block
  ExpertTile et;
  int count;  // tokens of the tile (<= kWsMaxN)
};

__device__ __forceinline__ WsItem ws_item(const GroupedGemmArgs& a, const int32_t* tile_scan, int item, int gx) {
  WsItem it;
  const int tile = item / gx;
  it.bx = item - tile * gx;
  it.et = find_expert_tile<kWsMaxN>(a, a.num_experts, tile_scan, tile);
  it.count = min(it.et.rows - it.et.m0, kWsMaxN);
  return it;
}

// Copy warpgroup, one item with an n-token-wide tile (n: a multiple of 32): thread t copies, per stage,
// 16-byte chunk t % 8 of token rows t / 8 + 16 i (i < n / 16; row_tab: the source row of each token, -1 past
// the tile, zero-filled), 16 bytes of weight rows t / 2 and t / 2 + 64 and the 4 scale bytes of row t.
__device__ __forceinline__ void ws_copy_item(int n, const GroupedGemmArgs& a, uint32_t stages_s, uint32_t bars,
                                             const int32_t* row_tab, int64_t first_src, const uint8_t* w0,
                                             const uint8_t* w1, const uint8_t* s0, int num_k_tiles, int& slot,
                                             uint32_t& phase, uint32_t& q) {
  constexpr int S = WsCfg::kStages, kKS = WsCfg::kKS;
  const int t = threadIdx.x - WsCfg::kMmaThreads, ch = t & 7;
  const int64_t K = a.K;
  for (int p = 0; p < num_k_tiles; ++p) {
    if (q >= uint32_t(S)) mbar_wait(bars + 8 * (S + slot), phase ^ 1u);  // the slot's previous stage consumed
    const uint32_t sa = stages_s + uint32_t(slot) * WsCfg::kStageBytes;
    const uint32_t sw = sa + WsCfg::kABytes, ss = sw + WsCfg::kWBytes;
    const int64_t ko = int64_t(p) * kKS + 8 * ch;
#pragma unroll
    for (int i = 0; i < kWsMaxN / 16; ++i) {
      if (16 * i >= n) break;
      const int r = (t >> 3) + 16 * i;
      const int32_t src = row_tab[r];
      cp_async_s<16>(sa + r * 128 + ((ch ^ (r & 7)) * 16), a.act + (src >= 0 ? int64_t(src) : first_src) * K + ko,
                     src >= 0 ? 16 : 0);
    }
    const int wo = p * (kKS / 2) + (t & 1) * 16;
    cp_async_s<16>(sw + (t >> 1) * (kKS / 2) + (t & 1) * 16, w0 + wo, 16);
    cp_async_s<16>(sw + ((t >> 1) + 64) * (kKS / 2) + (t & 1) * 16, w1 + wo, 16);
    cp_async_s<kKS / 16>(ss + t * (kKS / 16), s0 + p * (kKS / 16), kKS / 16);
    mbar_cp_async_arrive(bars + 8 * slot);
    ++q;
    slot = slot + 1 == S ? 0 : slot + 1;
    phase ^= slot == 0 ? 1u : 0u;
  }
}

// MMA warpgroups, one item with an N-token-wide tile: main loop with the decode of stage kt + 1 overlapping
// the wgmmas of stage kt, then the epilogue.
template <int N>
__device__ __forceinline__ void ws_mma_item(const GroupedGemmArgs& a, const uint8_t* stages, uint32_t stages_s,
                                            const uint32_t* lut, uint32_t bars, const WsItem& it, int num_k_tiles,
                                            int& slot, uint32_t& phase) {
  constexpr int S = WsCfg::kStages;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, tig = lane & 3;
  const int wg = warp >> 2, wq = warp & 3;
  const int lr0 = wg * 64 + wq * 16 + g;  // A rows g and g + 8 of this warp
  const uint32_t byte_shift = 8u * uint32_t(tig);
  const uint32_t desc_lo0 = sw128_desc_lo(stages_s);

  float acc[N / 2];
#pragma unroll
  for (int i = 0; i < N / 2; ++i) acc[i] = 0.f;
  uint32_t af0[4][4], af1[4][4];

  auto wait_decode = [&](uint32_t (&af)[4][4]) {
    mbar_wait(bars + 8 * slot, phase);  // the copy warpgroup's copies of this stage landed
    fence_proxy_async_smem();           // ... and are visible to the async proxy (wgmma)
    wg_decode<1, WsCfg::kKS>(stages + slot * WsCfg::kStageBytes + WsCfg::kABytes, lr0, tig, byte_shift, lut, af);
  };
  // Issues the wgmmas of the current slot's stage with A = af, then (wait_group 1) lets the previous
  // stage's slot go and moves on to the next stage; its decode into the other fragment, nf, overlaps.
  int prev_slot = -1;
  auto step = [&](const uint32_t (&af)[4][4], uint32_t (&nf)[4][4], bool more) {
    acc_fence(acc);
    wgmma_fence();
    const uint32_t lo_slot = desc_lo0 + uint32_t(slot) * uint32_t(WsCfg::kStageBytes >> 4);
#pragma unroll
    for (int ks = 0; ks < 4; ++ks) Wgmma<N>::mma(acc, af[ks], sw128_desc(lo_slot + uint32_t((ks * 32) >> 4)));
    wgmma_commit();
    acc_fence(acc);
    wgmma_wait<1>();  // the previous stage's wgmmas (and their A fragment, nf) are done
    __syncwarp();
    if (prev_slot >= 0 && lane == 0) mbar_arrive(bars + 8 * (S + prev_slot));
    prev_slot = slot;
    slot = slot + 1 == S ? 0 : slot + 1;
    phase ^= slot == 0 ? 1u : 0u;
    if (more) wait_decode(nf);
  };

  wait_decode(af0);
  for (int kt = 0; kt < num_k_tiles; kt += 2) {
    step(af0, af1, kt + 1 < num_k_tiles);
    if (kt + 1 < num_k_tiles) step(af1, af0, kt + 2 < num_k_tiles);
  }
  wgmma_wait<0>();
  acc_fence(acc);
  __syncwarp();
  if (lane == 0) mbar_arrive(bars + 8 * (S + prev_slot));

  const bool silu_mul = a.epilogue == Epilogue::kSiluMul;
  wg_epilogue<N, kWgMid>(a, acc, silu_mul, a.N, a.N / 2, it.et.expert, it.et.row_begin, it.et.rows, it.et.m0, it.bx,
                         wg, wq, g, tig);
}

// The item's wgmma width N: kN1 for tiles of up to kN1 tokens, kWsMaxN above. (More widths in one kernel
// make ptxas serialize its wgmmas for want of registers: C7512.)
template <int kN1, typename F>
__device__ __forceinline__ void ws_dispatch(int count, F&& f) {
  if (count <= kN1) f(std::integral_constant<int, kN1>());
  else f(std::integral_constant<int, kWsMaxN>());
}

__host__ __device__ inline int ws_column_blocks(const GroupedGemmArgs& a) {
  return a.epilogue == Epilogue::kSiluMul ? int((a.N / 2 + kWgRows / 2 - 1) / (kWgRows / 2))
                                          : int((a.N + kWgRows - 1) / kWgRows);
}

template <int kN1>
__global__ void __launch_bounds__(WsCfg::kThreads, 1) wg_gemm_ws_kernel(GroupedGemmArgs a) {
  static_assert(kN1 % 32 == 0 && kN1 < kWsMaxN, "the narrow width: a multiple of 32 below the tile");
  using Cfg = WsCfg;
  extern __shared__ uint8_t ws_smem_raw[];
  const uint32_t raw_addr = static_cast<uint32_t>(__cvta_generic_to_shared(ws_smem_raw));
  uint8_t* stages = ws_smem_raw + ((1024u - (raw_addr & 1023u)) & 1023u);  // SW128: 1024-aligned ring
  uint32_t* scale_lut = reinterpret_cast<uint32_t*>(stages + Cfg::kStageBytes * Cfg::kStages);
  int32_t* tile_scan = reinterpret_cast<int32_t*>(scale_lut + 256);  // [1024] inclusive tile counts
  int32_t* warp_sums = tile_scan + 1024;
  int32_t* row_tab = warp_sums + 32;  // [kWsMaxN] source rows of the copy warpgroup's current item
  const uint32_t bars = static_cast<uint32_t>(__cvta_generic_to_shared(row_tab + kWsMaxN));
  const uint32_t stages_s = static_cast<uint32_t>(__cvta_generic_to_shared(stages));

  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  for (int i = tid; i < 256; i += Cfg::kThreads) scale_lut[i] = scale_bf16x2(uint8_t(i));
  const int num_tiles = expert_tile_scan<Cfg::kThreads, kWsMaxN>(a, a.num_experts, tile_scan, warp_sums, tid, warp, lane);
  if (tid == 0)
    for (int s = 0; s < Cfg::kStages; ++s) {
      mbar_init(bars + 8 * s, Cfg::kCopyThreads);
      mbar_init(bars + 8 * (Cfg::kStages + s), Cfg::kMmaThreads / 32);
    }
  __syncthreads();  // scale_lut, tile_scan and the mbarriers visible

  const int gx = ws_column_blocks(a);
  const int items = num_tiles * gx;
  const int num_k_tiles = int(a.K / Cfg::kKS);
  const bool silu_mul = a.epilogue == Epilogue::kSiluMul;
  const int64_t Nw = a.N, I = Nw / 2, row_bytes = a.K / 2, Kb = a.K / 16;
  int slot = 0;
  uint32_t phase = 0;
  if (tid < Cfg::kMmaThreads) {
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(Cfg::kMmaRegs));
    for (int item = blockIdx.x; item < items; item += gridDim.x) {
      const WsItem it = ws_item(a, tile_scan, item, gx);
      ws_dispatch<kN1>(it.count, [&](auto n) {
        ws_mma_item<decltype(n)::value>(a, stages, stages_s, scale_lut, bars, it, num_k_tiles, slot, phase);
      });
    }
    return;
  }
  {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(Cfg::kCopyRegs));
    const int t = tid - Cfg::kMmaThreads;
    uint32_t q = 0;  // stages issued so far
    for (int item = blockIdx.x; item < items; item += gridDim.x) {
      const WsItem it = ws_item(a, tile_scan, item, gx);
      const int64_t first = int64_t(it.et.row_begin) + it.et.m0;
      asm volatile("bar.sync 1, 128;\n" ::: "memory");  // the previous item's table is no longer read
#pragma unroll
      for (int j = 0; j < kWsMaxN / Cfg::kCopyThreads; ++j) {
        const int r = t + Cfg::kCopyThreads * j;
        row_tab[r] = r < it.count ? int32_t(a.act_rows ? int64_t(a.act_rows[first + r]) : first + r) : -1;
      }
      asm volatile("bar.sync 1, 128;\n" ::: "memory");
      const int64_t first_src = row_tab[0];
      const uint8_t* wd = a.w_data + int64_t(it.et.expert) * Nw * row_bytes;
      const uint8_t* w0 = wd + wg_weight_row<kWgRows>(silu_mul, Nw, I, it.bx, t >> 1) * row_bytes;
      const uint8_t* w1 = wd + wg_weight_row<kWgRows>(silu_mul, Nw, I, it.bx, (t >> 1) + 64) * row_bytes;
      const uint8_t* s0 = a.w_scale + (int64_t(it.et.expert) * Nw + wg_weight_row<kWgRows>(silu_mul, Nw, I, it.bx, t)) * Kb;
      ws_copy_item(it.count <= kN1 ? kN1 : kWsMaxN, a, stages_s, bars, row_tab, first_src, w0, w1, s0, num_k_tiles, slot, phase, q);
    }
    asm volatile("cp.async.wait_all;\n" ::: "memory");
    return;
  }

}

template <int kN1>
inline cudaError_t launch_wg_ws_gemm_n1(const GroupedGemmArgs& a, cudaStream_t stream) {
  static bool attr_set = false;
  if (!attr_set) {
    cudaError_t err =
        cudaFuncSetAttribute(wg_gemm_ws_kernel<kN1>, cudaFuncAttributeMaxDynamicSharedMemorySize, WsCfg::kSmem);
    if (err != cudaSuccess) return err;
    attr_set = true;
  }
  // Work items: at most (rows / kWsMaxN + active experts) token tiles times the column blocks; one block per SM.
  const int64_t items = ((a.max_total_rows + kWsMaxN - 1) / kWsMaxN + a.grid_experts) * ws_column_blocks(a);
  const int grid = int(std::min<int64_t>(items, sm_count()));
  wg_gemm_ws_kernel<kN1><<<grid, WsCfg::kThreads, WsCfg::kSmem, stream>>>(a);
  return cudaGetLastError();
}

// a.tokens_per_pass: the narrow width kN1 (64, 128 or 192; the plan's, from the expected tokens per expert).
inline cudaError_t launch_wg_ws_gemm(const GroupedGemmArgs& a, cudaStream_t stream) {
  if (a.tokens_per_pass == 64) return launch_wg_ws_gemm_n1<64>(a, stream);
  if (a.tokens_per_pass == 128) return launch_wg_ws_gemm_n1<128>(a, stream);
  if (a.tokens_per_pass == 192) return launch_wg_ws_gemm_n1<192>(a, stream);
  return cudaErrorInvalidValue;
}

}  // namespace megamoe::sm90

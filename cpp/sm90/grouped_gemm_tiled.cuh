// Tiled NVFP4 grouped GEMM for many tokens per expert (prefill): compute-bound.
//
// Block tile 128 tokens x 128 weight rows x 64 K, 8 warps as 2 (tokens) x 4 (weight
// rows), warp tile 64 x 32, mma.sync m16n8k16 bf16 with fp32 accumulators. A 3-stage
// cp.async pipeline brings bf16 activations (operand order, XOR-swizzled 16-byte
// chunks for conflict-free ldmatrix) and the packed NVFP4 weights + their e4m3 scales
// into shared memory; each warp dequantizes its weight fragments in registers
// (gemm_common.cuh), so dequantized weights never touch memory at all.
//
// Work: grid.x = weight-row tiles, grid.y = 128-token tiles over all experts; a block
// finds its expert from the per-expert token counts (block-wide scan, no host sync).
// For the gate/up GEMM each warp's 32 weight rows are 16 gate rows and the matching 16
// up rows, so SiLU(gate) * up is formed in registers.
#pragma once
#include "gemm_common.cuh"
#include "megamoe/sm90_kernels.h"

namespace megamoe::sm90 {

constexpr int kStreamMaxTokens = 24;  // run 3 switch streaming -> tiled; unused since run 6 (auto picks wgmma)
constexpr int kTileM = 128, kTileN = 128, kTileK = 64, kStages = 3, kTiledThreads = 256;
constexpr int kWRowBytes = 40;  // 32 bytes of packed weights per row and stage, padded (bank conflicts)
constexpr int kSmemA = kTileM * kTileK * 2;
constexpr int kSmemW = kTileN * kWRowBytes;
constexpr int kSmemS = kTileN * 4;
constexpr int kSmemStage = kSmemA + kSmemW + kSmemS;
constexpr int kSmemTiled = kSmemStage * kStages + 256 * 4 + 2 * 1024 * 4;

__device__ __forceinline__ void cp_async(void* smem, const void* gmem, int bytes_valid, int size) {
  const uint32_t s = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  if (size == 16)
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(s), "l"(gmem), "r"(bytes_valid));
  else if (size == 8)
    asm volatile("cp.async.ca.shared.global [%0], [%1], 8, %2;" ::"r"(s), "l"(gmem), "r"(bytes_valid));
  else
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;" ::"r"(s), "l"(gmem), "r"(bytes_valid));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;" ::"n"(N)); }

__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const void* smem) {
  const uint32_t s = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(s));
}

inline bool tiled_gemm_supported(const GroupedGemmArgs& a) { return a.K % kTileK == 0 && a.num_experts <= 1024; }

template <int kMinBlocks>  // 1: registers unconstrained; 2: two blocks (16 warps) per SM
__global__ void __launch_bounds__(kTiledThreads, kMinBlocks) tiled_gemm_kernel(GroupedGemmArgs a) {
  extern __shared__ __align__(128) uint8_t smem[];
  uint32_t* scale_lut = reinterpret_cast<uint32_t*>(smem + kSmemStage * kStages);
  int32_t* tile_scan = reinterpret_cast<int32_t*>(scale_lut + 256);  // [1024] inclusive tile counts
  int32_t* warp_sums = tile_scan + 1024;

  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, tig = lane & 3;
  for (int i = tid; i < 256; i += kTiledThreads) scale_lut[i] = scale_bf16x2(uint8_t(i));

  // Which expert and which 128-token tile of it (m0: its first token within the expert).
  const int E = a.num_experts;
  const int num_tiles = expert_tile_scan<kTiledThreads, kTileM>(a, E, tile_scan, warp_sums, tid, warp, lane);
  const int tile = blockIdx.y;
  if (tile >= num_tiles) return;
  const ExpertTile et = find_expert_tile<kTileM>(a, E, tile_scan, tile);
  const int expert = et.expert, row_begin = et.row_begin, rows = et.rows, m0 = et.m0;

  const int64_t K = a.K, N = a.N, Kb = K / 16, row_bytes = K / 2;
  const bool silu_mul = a.epilogue == Epilogue::kSiluMul;
  const int64_t I = N / 2;
  const uint8_t* wd = a.w_data + int64_t(expert) * N * row_bytes;
  const uint8_t* ws = a.w_scale + int64_t(expert) * N * Kb;

  // Loader roles. A: 4 chunks of 16 B per thread; W: 2 blocks of 8 B; scales: 4 B (threads < 128).
  auto weight_row = [&](int j, bool& valid) -> int64_t {
    if (silu_mul) {
      const int wn = j / 32, jj = j % 32;
      const int64_t col = int64_t(blockIdx.x) * 64 + wn * 16 + (jj % 16);
      valid = col < I;
      return valid ? (jj < 16 ? col : I + col) : 0;
    }
    const int64_t n = int64_t(blockIdx.x) * kTileN + j;
    valid = n < N;
    return valid ? n : 0;
  };
  const int w_row_ld = tid >> 1;          // weight row this thread loads (2 threads per row)
  bool w_valid;
  const int64_t w_n = weight_row(w_row_ld, w_valid);
  const uint8_t* w_src = wd + w_n * row_bytes;

  const int num_k_tiles = int(K / kTileK);
  auto load_stage = [&](int slot, int kt) {
    uint8_t* sa = smem + slot * kSmemStage;
    uint8_t* sw = sa + kSmemA;
    uint8_t* ss = sw + kSmemW;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int c = tid + i * kTiledThreads;  // 0..1023
      const int r = c >> 3, ch = c & 7;
      const bool valid = m0 + r < rows;
      const uint16_t* src = a.act + (int64_t(row_begin) + (valid ? m0 + r : 0)) * K + int64_t(kt) * kTileK + ch * 8;
      cp_async(sa + r * 128 + ((ch ^ (r & 7)) * 16), src, valid ? 16 : 0, 16);
    }
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const int blk = (tid & 1) * 2 + i;
      cp_async(sw + w_row_ld * kWRowBytes + blk * 8, w_src + (int64_t(kt) * 4 + blk) * 8, w_valid ? 8 : 0, 8);
    }
    if (tid < kTileN) {
      bool v;
      const int64_t n = weight_row(tid, v);
      cp_async(ss + tid * 4, ws + n * Kb + int64_t(kt) * 4, v ? 4 : 0, 4);
    }
  };

  float acc[4][4][4];
#pragma unroll
  for (int i = 0; i < 4; ++i)
#pragma unroll
    for (int j = 0; j < 4; ++j)
#pragma unroll
      for (int c = 0; c < 4; ++c) acc[i][j][c] = 0.f;

  const int wm = warp >> 2, wn = warp & 3;
  // Per-lane dequant constants: this lane extracts pair P_tig of each word.
  const uint32_t pick_shift = tig >= 2 ? 8u : 0u;
  const uint32_t pick_mask = (tig & 1) ? 0x00F000F0u : 0x000F000Fu;
  const uint32_t pick_mul = (tig & 1) ? 0x0104u : 0x1040u;

#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < num_k_tiles) load_stage(s, s);
    cp_async_commit();
  }

  for (int kt = 0; kt < num_k_tiles; ++kt) {
    cp_async_wait<kStages - 2>();
    __syncthreads();
    const int pf = kt + kStages - 1;
    if (pf < num_k_tiles) load_stage(pf % kStages, pf);
    cp_async_commit();

    const uint8_t* sa = smem + (kt % kStages) * kSmemStage;
    const uint8_t* sw = sa + kSmemA;
    const uint8_t* ss = sw + kSmemW;
#pragma unroll
    for (int ks = 0; ks < 4; ++ks) {
      uint32_t af[4][4];
#pragma unroll
      for (int mt = 0; mt < 4; ++mt) {
        const int r = wm * 64 + mt * 16 + (lane & 15);
        const int ch = ks * 2 + (lane >> 4);
        ldmatrix_x4(af[mt], sa + r * 128 + ((ch ^ (r & 7)) * 16));
      }
      uint32_t bf[4][2];
#pragma unroll
      for (int nt = 0; nt < 4; ++nt) {
        const int r = wn * 32 + nt * 8 + g;
        const uint2 w = *reinterpret_cast<const uint2*>(sw + r * kWRowBytes + ks * 8);
        const uint32_t s2 = scale_lut[ss[r * 4 + ks]];
        bf[nt][0] = bf16x2_mul(nibble_pair_bits((w.x >> pick_shift) & pick_mask, pick_mul), s2);
        bf[nt][1] = bf16x2_mul(nibble_pair_bits((w.y >> pick_shift) & pick_mask, pick_mul), s2);
      }
#pragma unroll
      for (int mt = 0; mt < 4; ++mt)
#pragma unroll
        for (int nt = 0; nt < 4; ++nt)
          mma_bf16_16816(acc[mt][nt], af[mt][0], af[mt][1], af[mt][2], af[mt][3], bf[nt][0], bf[nt][1]);
    }
  }
  cp_async_wait<0>();

  const float a_gs = a.a_global_scale ? a.a_global_scale[a.a_gs_per_expert ? expert : 0] : 1.0f;
  const float* wg = a.w_global_scale + int64_t(expert) * a.w_gs_per_expert;
  const float alpha0 = a_gs * wg[0];
  const float alpha1 = silu_mul ? a_gs * wg[1] : alpha0;
#pragma unroll
  for (int mt = 0; mt < 4; ++mt) {
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      const int tok = m0 + wm * 64 + mt * 16 + g + 8 * hh;
      if (tok >= rows) continue;
      const int64_t out_row = int64_t(row_begin) + tok;
      const float rs = a.a_row_scale ? a.a_row_scale[out_row] : 1.0f;
      if (silu_mul) {
#pragma unroll
        for (int nt = 0; nt < 2; ++nt) {
          const int64_t col = int64_t(blockIdx.x) * 64 + wn * 16 + nt * 8 + 2 * tig;
          if (col >= I) continue;
          float2 h;
          h.x = swiglu(scaled(acc[mt][nt][2 * hh], alpha0, rs), scaled(acc[mt][nt + 2][2 * hh], alpha1, rs),
                       a.swiglu_clamp, a.swiglu_limit);
          h.y = swiglu(scaled(acc[mt][nt][2 * hh + 1], alpha0, rs), scaled(acc[mt][nt + 2][2 * hh + 1], alpha1, rs),
                       a.swiglu_clamp, a.swiglu_limit);
          *reinterpret_cast<float2*>(a.out + out_row * I + col) = h;
        }
      } else {
#pragma unroll
        for (int nt = 0; nt < 4; ++nt) {
          const int64_t n = int64_t(blockIdx.x) * kTileN + wn * 32 + nt * 8 + 2 * tig;
          if (n >= N) continue;
          float2 v;
          v.x = scaled(acc[mt][nt][2 * hh], alpha0, rs);
          v.y = scaled(acc[mt][nt][2 * hh + 1], alpha0, rs);
          *reinterpret_cast<float2*>(a.out + out_row * N + n) = v;
        }
      }
    }
  }
}

inline cudaError_t launch_tiled_gemm(const GroupedGemmArgs& a, cudaStream_t stream, int variant) {
  static bool attr_set[2] = {false, false};
  const int v = variant == 2 ? 1 : 0;
  if (!attr_set[v]) {
    cudaError_t err = v ? cudaFuncSetAttribute(tiled_gemm_kernel<2>, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemTiled)
                        : cudaFuncSetAttribute(tiled_gemm_kernel<1>, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemTiled);
    if (err != cudaSuccess) return err;
    attr_set[v] = true;
  }
  const bool silu_mul = a.epilogue == Epilogue::kSiluMul;
  const unsigned gx = silu_mul ? unsigned((a.N / 2 + 63) / 64) : unsigned((a.N + kTileN - 1) / kTileN);
  // Upper bound of 128-token tiles over all experts: sum ceil(t_e/128) <= rows/128 + active experts.
  const int64_t tiles = (a.max_total_rows + kTileM - 1) / kTileM + a.grid_experts;
  if (tiles > 65535) return cudaErrorInvalidValue;
  dim3 grid(gx, unsigned(tiles));
  if (v) tiled_gemm_kernel<2><<<grid, kTiledThreads, kSmemTiled, stream>>>(a);
  else tiled_gemm_kernel<1><<<grid, kTiledThreads, kSmemTiled, stream>>>(a);
  return cudaGetLastError();
}

}  // namespace megamoe::sm90

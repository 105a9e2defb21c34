// Rate of the wgmma main loop's arithmetic alone, on one Hopper GPU: warpgroup MMAs with the weights in registers
// (wgmma m64nNk16, A from registers, as gemm_wgmma.cuh issues them), with and without the NVFP4 decode that
// fills those registers before each stage's group, and no memory traffic (every operand is already in shared
// memory). Four warpgroups per SM, one block per SM, one group of K / 16 wgmmas per stage and a drain, as in the
// kernels (then N = 8 and 16 again with one to three warpgroups per SM, as one token's blocks run). It bounds what the
// GEMM kernels can reach at a given token width N, whatever their pipeline does.
//
//   nvcc -O3 -std=c++17 --generate-code=arch=compute_90a,code=sm_90a --expt-relaxed-constexpr -I cpp/include \
//        -o /tmp/wgmma_decode_rate bench/wgmma_decode_rate.cu && /tmp/wgmma_decode_rate bench/results/wgmma_decode_h200.json
//
// Modes: "mma" (the A registers are not rewritten), "decode" (the kernels' decode: per 64-element block and row one
// 8-byte shared load of two weight words and the scale pair from the row's scale codes, dequant_word per word),
// "decode_half_mul" and "decode_no_mul" (the same bit operations with 2 or none of the 4 bf16x2 multiplies per word:
// not exact, they show what those instructions cost), "decode_int_scale" (every multiply replaced by an XOR with the
// scale pair: the scale path kept, the multiplies not; not exact either).
#include <cuda_runtime.h>

#include <cstdio>

#include "../cpp/sm90/gemm_wgmma.cuh"  // the kernels' decode, wgmma and descriptor helpers
#include "bench_record.h"

using namespace megamoe::sm90;

namespace {

enum Mode { kMma = 0, kDecode = 1, kDecodeHalfMul = 2, kDecodeNoMul = 3, kDecodeIntScale = 4 };
const char* const kModeName[] = {"mma", "decode", "decode_half_mul", "decode_no_mul", "decode_int_scale"};
constexpr int kWarpgroups = 4;  // per SM (one block) in the main table; the sweep at one token's widths runs 1 to 3
constexpr int kStagesTimed = 4000;

__device__ __forceinline__ uint2 lds64(uint32_t addr) {
  uint2 v;
  asm volatile("ld.shared.v2.u32 {%0, %1}, [%2];" : "=r"(v.x), "=r"(v.y) : "r"(addr));
  return v;
}
__device__ __forceinline__ uint4 lds128(uint32_t addr) {
  uint4 v;
  asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(addr));
  return v;
}

template <int kMode>
__device__ __forceinline__ void decode_word(uint32_t w, uint32_t s2, uint32_t (&p)[4]) {
  if constexpr (kMode == kDecode) {
    dequant_word(w, s2, p);
  } else {
    p[0] = w & kPairSlots;
    p[1] = rotr(w, 3) & kPairSlots;
    p[2] = rotr(w, 6) & kPairSlots;
    p[3] = ((w & kP3Mask) * kP3Mul) & kPairSlots;
    if constexpr (kMode == kDecodeHalfMul) {
      p[0] = bf16x2_mul(p[0], s2);
      p[2] = bf16x2_mul(p[2], s2);
    }
    if constexpr (kMode == kDecodeIntScale) {  // the scale pair still made and consumed, by an XOR per pair
#pragma unroll
      for (int k = 0; k < 4; ++k) p[k] ^= s2;
    }
  }
}

// Shared memory: the activation tile (K / 64 SW128 sub-tiles of N rows), the block's 64 weight rows per warpgroup of
// K / 2 bytes, 16 bytes of scale codes per row.
template <int N, int kKS, int kWG>
constexpr int smem_bytes() {
  return 1024 + (kKS / 64) * N * 128 + 64 * kWG * (kKS / 2 + 16);
}

template <int N, int kKS, int kMode, int kWG>
__global__ void __launch_bounds__(128 * kWG, 1) rate_kernel(int stages, float* out) {
  extern __shared__ uint8_t smem_raw[];
  constexpr int kSub = kKS / 64, kSteps = kKS / 16;
  constexpr int kABytes = kSub * N * 128, kWBytes = 64 * kWG * kKS / 2;
  const uint32_t raw = uint32_t(__cvta_generic_to_shared(smem_raw));
  const uint32_t base = (raw + 1023u) & ~1023u;
  uint32_t* words = reinterpret_cast<uint32_t*>(smem_raw + (base - raw));
  for (int i = threadIdx.x; i < (smem_bytes<N, kKS, kWG>() - 1024) / 4; i += blockDim.x) {
    const uint32_t h = uint32_t(i) * 2654435761u + blockIdx.x;
    words[i] = i < kABytes / 4 ? (h & 0x3F7F3F7Fu) : h;  // finite bf16 activations; random weight and scale codes
  }
  __syncthreads();

  const int row = (threadIdx.x >> 7) * 64 + ((threadIdx.x >> 5) & 3) * 16 + ((threadIdx.x & 31) >> 2);
  const int tig = threadIdx.x & 3;
  const uint32_t wrow = base + kABytes + row * (kKS / 2) + (tig & 1) * 8;
  const uint32_t srow = base + kABytes + kWBytes + row * 16;
  const uint32_t sel = scale_byte_sel(uint32_t(tig));
  float acc[N / 2];
#pragma unroll
  for (int i = 0; i < N / 2; ++i) acc[i] = 0.f;
  uint32_t af[kSteps][4];
#pragma unroll
  for (int s = 0; s < kSteps; ++s)
#pragma unroll
    for (int j = 0; j < 4; ++j) af[s][j] = 0x3F803F80u ^ uint32_t(s * 4 + j);

  for (int st = 0; st < stages; ++st) {
    if constexpr (kMode == kMma) {
#pragma unroll
      for (int s = 0; s < kSteps; ++s) asm volatile("" : "+r"(af[s][0]), "+r"(af[s][1]), "+r"(af[s][2]), "+r"(af[s][3]));
    } else {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const uint4 v = lds128(srow + h * 8 * 16);  // the row's scale codes of the stage: a word per 64-element block
        const uint32_t sc[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
        for (int b = 0; b < kSub; ++b) {
          const uint2 w = lds64(wrow + h * 8 * (kKS / 2) + (((2 * b + (tig >> 1)) ^ (row & 7)) * 16));
          const uint32_t s2 = scale_pair(sc[b], sel);
#pragma unroll
          for (int q = 0; q < 2; ++q) {
            uint32_t p[4];
            decode_word<kMode>(q ? w.y : w.x, s2, p);
            af[4 * b + 2 * q][h] = p[0];
            af[4 * b + 2 * q][2 + h] = p[1];
            af[4 * b + 2 * q + 1][h] = p[2];
            af[4 * b + 2 * q + 1][2 + h] = p[3];
          }
        }
      }
    }
    wgmma_fence();
#pragma unroll
    for (int s = 0; s < kSteps; ++s)
      Wgmma<N>::mma(acc, af[s], sw128_desc(sw128_desc_lo(base + (s / 4) * N * 128 + (s % 4) * 32)));
    wgmma_commit();
    wgmma_wait<0>();
    acc_fence(acc);
  }
  float t = 0.f;
#pragma unroll
  for (int i = 0; i < N / 2; ++i) t += acc[i];
  out[blockIdx.x * blockDim.x + threadIdx.x] = t;
}

FILE* g_json = nullptr;
bool g_first = true;

template <int N, int kKS, int kMode, int kWG = kWarpgroups>
void run(int sms, float* out) {
  constexpr int kSmem = smem_bytes<N, kKS, kWG>();
  auto* kernel = rate_kernel<N, kKS, kMode, kWG>;
  cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem);
  cudaFuncAttributes attr;
  cudaFuncGetAttributes(&attr, kernel);
  kernel<<<sms, 128 * kWG, kSmem>>>(16, out);  // warm-up
  cudaEvent_t e0, e1;
  cudaEventCreate(&e0);
  cudaEventCreate(&e1);
  float ms[7];
  for (float& m : ms) {
    cudaEventRecord(e0);
    kernel<<<sms, 128 * kWG, kSmem>>>(kStagesTimed, out);
    cudaEventRecord(e1);
    cudaEventSynchronize(e1);
    cudaEventElapsedTime(&m, e0, e1);
  }
  for (int i = 1; i < 7; ++i)  // median of 7
    for (int j = i; j > 0 && ms[j] < ms[j - 1]; --j) { const float t = ms[j]; ms[j] = ms[j - 1]; ms[j - 1] = t; }
  const float med = ms[3];
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) {
    std::fprintf(stderr, "N=%d K=%d %s: %s\n", N, kKS, kModeName[kMode], cudaGetErrorString(err));
    return;
  }
  const double flops = double(sms) * kWG * kStagesTimed * (kKS / 16) * 64.0 * N * 16 * 2;
  const double tflops = flops / (med * 1e-3) / 1e12;
  const double stage_ns = med * 1e6 / kStagesTimed;
  // weight bytes a stage of the SM's 256 rows decodes (NVFP4: 0.5 byte per element and 1 / 16 byte of scale)
  const double weight_tbps = double(sms) * 64 * kWG * kKS * (0.5 + 1.0 / 16) / (stage_ns * 1e-9) / 1e12;
  std::printf("N %3d  K/stage %3d  %-16s %d WG/SM  %3d registers  %6.1f TFLOP/s  %6.0f ns per stage  %5.2f TB/s of "
              "NVFP4 weights\n",
              N, kKS, kModeName[kMode], kWG, attr.numRegs, tflops, stage_ns, weight_tbps);
  if (g_json)
    std::fprintf(g_json,
                 "%s\n    {\"n\": %d, \"k_per_stage\": %d, \"mode\": \"%s\", \"warpgroups\": %d, \"registers\": %d, "
                 "\"tflops\": %.1f, \"stage_ns\": %.0f, \"weight_tbps\": %.2f}",
                 g_first ? "" : ",", N, kKS, kModeName[kMode], kWG, attr.numRegs, tflops, stage_ns, weight_tbps);
  g_first = false;
}

// The wgmmas alone and with the kernels' decode, K 256 per stage, kWG warpgroups per SM.
template <int N, int kWG>
void run_mma_decode(int sms, float* out) {
  run<N, 256, kMma, kWG>(sms, out);
  run<N, 256, kDecode, kWG>(sms, out);
}

template <int N, int kKS>
void run_modes(int sms, float* out) {
  run<N, kKS, kMma>(sms, out);
  run<N, kKS, kDecode>(sms, out);
  run<N, kKS, kDecodeHalfMul>(sms, out);
  run<N, kKS, kDecodeNoMul>(sms, out);
  run<N, kKS, kDecodeIntScale>(sms, out);
}

}  // namespace

int main(int argc, char** argv) {
  HopperDevice dev;
  if (!query_hopper(dev)) return 1;
  const int sms = dev.sms;
  float* out = nullptr;
  cudaMalloc(&out, size_t(sms) * 128 * kWarpgroups * sizeof(float));
  if (argc > 1) {
    g_json = open_record(argv[1],
                         "nvcc -O3 -std=c++17 --generate-code=arch=compute_90a,code=sm_90a --expt-relaxed-constexpr -I "
                         "cpp/include -o /tmp/wgmma_decode_rate bench/wgmma_decode_rate.cu && /tmp/wgmma_decode_rate",
                         dev);
    if (!g_json) return 1;
    std::fprintf(g_json,
                 "  \"method\": \"%d warpgroups per SM unless a result says otherwise, one block per SM, %d stages per "
                 "launch, median of 7 launches "
                 "(CUDA events); per stage one group of K/16 wgmma m64nNk16 (A from registers) and a drain\",\n"
                 "  \"results\": [",
                 kWarpgroups, kStagesTimed);
  }
  run_modes<8, 256>(sms, out);
  run_modes<16, 256>(sms, out);
  run_modes<32, 256>(sms, out);
  run_modes<40, 256>(sms, out);
  run_modes<48, 256>(sms, out);
  run_modes<56, 256>(sms, out);
  run_modes<64, 256>(sms, out);
  run_modes<64, 128>(sms, out);
  run_modes<128, 128>(sms, out);
  // One token's widths with fewer warpgroups per SM (the GEMM kernels run one to three one-warpgroup blocks per SM
  // there): whether a stage's time is the warpgroup's own chain or the SM's shared issue.
  run_mma_decode<8, 1>(sms, out);
  run_mma_decode<8, 2>(sms, out);
  run_mma_decode<8, 3>(sms, out);
  run_mma_decode<16, 1>(sms, out);
  run_mma_decode<16, 3>(sms, out);
  close_record(g_json);
  cudaFree(out);
  return 0;
}

// NVFP4 activation quantization (docs/SPEC.md §1), plain and grouped per expert (docs/SPEC.md §2 row
// offsets), and the dynamic global scale. A CTA quantizes (a chunk of) one row, each thread a few
// 16-element blocks of it.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>

#include "megamoe/common_kernels.h"
#include "megamoe/nvfp4_device.cuh"
#include "megamoe/sf_layout.hpp"
#include "megamoe/sm90_operand_order.cuh"
#include "offset_search.cuh"

namespace megamoe {
namespace {

template <ElemType T>
struct Elem;
template <>
struct Elem<ElemType::kFloat32> {
  using type = float;
  static __device__ __forceinline__ float to_float(float v) { return v; }
};
template <>
struct Elem<ElemType::kFloat16> {
  using type = __half;
  static __device__ __forceinline__ float to_float(__half v) { return __half2float(v); }
};
template <>
struct Elem<ElemType::kBFloat16> {
  using type = __nv_bfloat16;
  static __device__ __forceinline__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }
};

// Loads 16 consecutive elements as fp32 (16-byte loads when `vec`).
template <ElemType T>
__device__ __forceinline__ void load_block(const typename Elem<T>::type* p, bool vec, float (&x)[16]) {
  using E = typename Elem<T>::type;
  constexpr int kPerVec = 16 / sizeof(E);
  if (vec) {
#pragma unroll
    for (int v = 0; v < 16 / kPerVec; ++v) {
      uint4 u = __ldg(reinterpret_cast<const uint4*>(p) + v);
      const E* e = reinterpret_cast<const E*>(&u);
#pragma unroll
      for (int i = 0; i < kPerVec; ++i) x[v * kPerVec + i] = Elem<T>::to_float(e[i]);
    }
  } else {
#pragma unroll
    for (int i = 0; i < 16; ++i) x[i] = Elem<T>::to_float(p[i]);
  }
}

constexpr int kMaxThreads = 128;

struct RowPlace {
  int64_t dst_row;
  int expert;
};

__device__ __forceinline__ bool row_valid(const QuantizeArgs& a, int64_t r) {
  return a.num_experts <= 0 || r < a.expert_offsets[a.num_experts];
}

// Where row r goes (the caller has checked row_valid).
__device__ __forceinline__ RowPlace place_row(const QuantizeArgs& a, int64_t r) {
  RowPlace p{r, 0};
  if (a.num_experts > 0) {
    p.expert = last_offset_at_or_below(a.expert_offsets, a.num_experts, r);  // the expert owning row r
    p.dst_row = int64_t(a.dst_offsets[p.expert]) + (r - a.expert_offsets[p.expert]);
  }
  return p;
}

// row_experts: the expert of row r, or -1 when its id is outside [0, row_experts_bound) (row skipped).
__device__ __forceinline__ int row_expert(const QuantizeArgs& a, int64_t r) {
  const int64_t e = a.row_experts_int64 ? int64_t(__ldg(static_cast<const long long*>(a.row_experts) + r))
                                        : int64_t(__ldg(static_cast<const int*>(a.row_experts) + r));
  return e >= 0 && e < a.row_experts_bound ? int(e) : -1;
}

using LaneStage = LaneOrderStage<kMaxThreads>;

// Quantizes block kb of a placed row; docs/SPEC.md §1 in the reference's fp32 operation order. The lane-order
// decode (a.dequant_lane_order) is stored in whole 16-byte chunks through `st` (store_operand_rows): it needs
// kb & 3 == threadIdx.x & 3 and the 4 threads of the quad calling together (both kernels below: blockDim.x is a
// multiple of 32, blocks_per_row of 4, so a quad's blocks are valid or not together).
__device__ __forceinline__ void quantize_block(const QuantizeArgs& a, const float (&x)[16], float gs, int64_t dst_row,
                                               int64_t kb, LaneStage& st) {
  const int64_t blocks_per_row = a.cols / 16;
  uint8_t scale_byte;
  float scale, r[16];  // E2M1 values
  nvfp4_quantize_block(x, gs, scale_byte, scale, r);

  if (a.data) {
    uint32_t lo = 0, hi = 0;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      lo |= e2m1_code(r[i]) << (4 * i);
      hi |= e2m1_code(r[8 + i]) << (4 * i);
    }
    *reinterpret_cast<uint2*>(a.data + dst_row * (a.cols / 2) + kb * 8) = make_uint2(lo, hi);
  }
  if (a.scale) a.scale[dst_row * blocks_per_row + kb] = scale_byte;
  if (a.scale_swz) a.scale_swz[sf_offset(dst_row, kb, (blocks_per_row + 3) / 4)] = scale_byte;
  if (a.dequant) {
#pragma unroll
    for (int i = 0; i < 16; ++i) r[i] = __fmul_rn(r[i], scale);  // exact, +0 stays +0
    store_operand_rows(r, a.dequant, a.cols, dst_row, kb, a.dequant_lane_order, a.scatter_rows, a.scatter_k, st);
  }
}

// Each thread loads kPer blocks of one row before it quantizes any (the loads overlap): 2, or 1 where the
// grid is small (decode), so that more threads share the latency of the row.
constexpr int kPerThread = 2;
constexpr int64_t kOnePerThreadBelow = 1 << 17;  // blocks in all

// Threads of a CTA for rows of `blocks_per_row` blocks: one pass of `per` blocks each over the row
// when that fits in kMaxThreads, whole warps.
int row_threads(int64_t blocks_per_row, int per) {
  const int64_t need = (blocks_per_row + per - 1) / per;
  return int(std::min<int64_t>(kMaxThreads, (need + 31) / 32 * 32));
}

// Static global scale: blockIdx.x = row, blockIdx.y = a chunk of kPer * blockDim.x blocks of it.
template <ElemType T, int kPer>
__global__ void __launch_bounds__(kMaxThreads) quantize_nvfp4_kernel(QuantizeArgs a, bool vec) {
  using E = typename Elem<T>::type;
  __shared__ LaneStage st;
  const int64_t r = blockIdx.x;
  if (!row_valid(a, r)) return;
  const int row_ex = a.row_experts ? row_expert(a, r) : 0;
  if (row_ex < 0) return;
  const int64_t blocks_per_row = a.cols / 16;
  const int64_t kb0 = int64_t(blockIdx.y) * kPer * blockDim.x + threadIdx.x;
  const int64_t src_row = a.src_rows ? a.src_rows[r] : r;
  const E* row = static_cast<const E*>(a.src) + src_row * a.src_row_stride;
  float x[kPer][16];
#pragma unroll
  for (int j = 0; j < kPer; ++j) {
    const int64_t kb = kb0 + int64_t(j) * blockDim.x;
    if (kb < blocks_per_row) load_block<T>(row + kb * 16, vec, x[j]);
  }
  const RowPlace p = place_row(a, r);
  const int64_t gi = a.gs_mode == GlobalScaleMode::kPerExpert ? int64_t(a.row_experts ? row_ex : p.expert)
                     : a.gs_mode == GlobalScaleMode::kPerRow  ? r
                                                              : int64_t(0);
  const float gs = a.global_scale[gi];
#pragma unroll
  for (int j = 0; j < kPer; ++j) {
    const int64_t kb = kb0 + int64_t(j) * blockDim.x;
    if (kb < blocks_per_row) quantize_block(a, x[j], gs, p.dst_row, kb, st);
  }
}

// Dynamic per-row global scale: one CTA per row; the row's amax first, then its blocks. The first
// kPerThread * blockDim.x blocks stay in registers between the two; longer rows read the rest twice.
template <ElemType T>
__global__ void __launch_bounds__(kMaxThreads) quantize_nvfp4_rowwise_kernel(QuantizeArgs a, bool vec) {
  using E = typename Elem<T>::type;
  __shared__ float warp_max[kMaxThreads / 32];
  __shared__ LaneStage st;
  const int64_t r = blockIdx.x;
  if (!row_valid(a, r)) return;
  const int64_t blocks_per_row = a.cols / 16;
  const int64_t src_row = a.src_rows ? a.src_rows[r] : r;
  const E* row = static_cast<const E*>(a.src) + src_row * a.src_row_stride;
  const int64_t held = int64_t(kPerThread) * blockDim.x;
  float x[kPerThread][16];
  float m = 0.f;
#pragma unroll
  for (int j = 0; j < kPerThread; ++j) {
    const int64_t kb = threadIdx.x + int64_t(j) * blockDim.x;
    if (kb < blocks_per_row) {
      load_block<T>(row + kb * 16, vec, x[j]);
      m = fmaxf(m, block_amax(x[j]));
    }
  }
  for (int64_t kb = held + threadIdx.x; kb < blocks_per_row; kb += blockDim.x) {
    float y[16];
    load_block<T>(row + kb * 16, vec, y);
    m = fmaxf(m, block_amax(y));
  }
  const RowPlace p = place_row(a, r);
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
  if ((threadIdx.x & 31) == 0) warp_max[threadIdx.x >> 5] = m;
  __syncthreads();
  float amax = 0.f;
  for (int w = 0; w < int(blockDim.x >> 5); ++w) amax = fmaxf(amax, warp_max[w]);
  const float gs = amax > 0.f ? __fdiv_rn(amax, 6.0f * 448.0f) : 1.0f;
  if (threadIdx.x == 0 && a.row_scale_out) {
    if (a.scatter_rows) {
      for (int j = 0; j < a.scatter_k; ++j) {
        const int32_t d = a.scatter_rows[p.dst_row * a.scatter_k + j];
        if (d >= 0) a.row_scale_out[d] = gs;
      }
    } else {
      a.row_scale_out[p.dst_row] = gs;
    }
  }
#pragma unroll
  for (int j = 0; j < kPerThread; ++j) {
    const int64_t kb = threadIdx.x + int64_t(j) * blockDim.x;
    if (kb < blocks_per_row) quantize_block(a, x[j], gs, p.dst_row, kb, st);
  }
  for (int64_t kb = held + threadIdx.x; kb < blocks_per_row; kb += blockDim.x) {
    float y[16];
    load_block<T>(row + kb * 16, vec, y);
    quantize_block(a, y, gs, p.dst_row, kb, st);
  }
}

// Exact decode of existing NVFP4 rows to bf16 e2m1 * scale in operand (or lane) order.
__global__ void nvfp4_to_operand_kernel(const uint8_t* data, const uint8_t* scale, int64_t rows, int64_t cols,
                                        uint16_t* dst, bool lane_order) {
  const int64_t blocks_per_row = cols / 16;
  const int64_t idx = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (idx >= rows * blocks_per_row) return;
  const int64_t r = idx / blocks_per_row, kb = idx - r * blocks_per_row;
  const uint2 packed = *reinterpret_cast<const uint2*>(data + r * (cols / 2) + kb * 8);
  const float s = e4m3_to_float(scale[r * blocks_per_row + kb]);
  float v[16];
#pragma unroll
  for (int i = 0; i < 16; ++i) v[i] = e2m1_to_float(((i < 8 ? packed.x : packed.y) >> (4 * (i & 7))) & 0xFu) * s;
  store_operand_block(v, dst + r * cols, kb, lane_order);
}

template <ElemType T>
__global__ void amax_kernel(const void* src_v, int64_t rows, int64_t cols, int64_t stride, uint32_t* out) {
  using E = typename Elem<T>::type;
  const E* src = static_cast<const E*>(src_v);
  float m = 0.f;
  const int64_t n = rows * cols;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    int64_t at = i;
    if (stride != cols) {
      const int64_t r = i / cols;
      at = r * stride + (i - r * cols);
    }
    m = fmaxf(m, fabsf(Elem<T>::to_float(src[at])));  // fmaxf drops NaN
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
  // Non-negative floats order like their bit patterns.
  if ((threadIdx.x & 31) == 0) atomicMax(out, __float_as_uint(m));
}

__global__ void finish_global_scale_kernel(const uint32_t* amax_bits, float* out) {
  const float amax = __uint_as_float(*amax_bits);
  *out = amax == 0.f ? 1.0f : __fdiv_rn(amax, 6.0f * 448.0f);
}

template <typename F>
cudaError_t dispatch_type(ElemType t, F&& f) {
  switch (t) {
    case ElemType::kFloat32: return f(std::integral_constant<ElemType, ElemType::kFloat32>{});
    case ElemType::kFloat16: return f(std::integral_constant<ElemType, ElemType::kFloat16>{});
    case ElemType::kBFloat16: return f(std::integral_constant<ElemType, ElemType::kBFloat16>{});
  }
  return cudaErrorInvalidValue;
}

int elem_bytes(ElemType t) { return t == ElemType::kFloat32 ? 4 : 2; }

}  // namespace

cudaError_t launch_quantize_nvfp4(const QuantizeArgs& args, cudaStream_t stream) {
  const bool rowwise = args.gs_mode == GlobalScaleMode::kPerRowDynamic;
  if (args.cols % 16 != 0 || args.rows < 0 || !args.src || (!rowwise && !args.global_scale))
    return cudaErrorInvalidValue;
  if (args.num_experts > 0 && (!args.expert_offsets || !args.dst_offsets)) return cudaErrorInvalidValue;
  if (args.dequant && args.dequant_lane_order && args.cols % 64 != 0) return cudaErrorInvalidValue;
  if (args.gs_mode == GlobalScaleMode::kPerExpert && args.num_experts <= 0 && !args.row_experts)
    return cudaErrorInvalidValue;
  if (args.row_experts && (args.gs_mode != GlobalScaleMode::kPerExpert || args.scatter_rows || args.num_experts > 0 ||
                           args.row_experts_bound < 1))
    return cudaErrorInvalidValue;
  if (args.scatter_rows && (args.scatter_k < 1 || args.num_experts > 0 || args.src_rows || args.data || args.scale ||
                            args.scale_swz))
    return cudaErrorInvalidValue;
  const int64_t total = args.rows * (args.cols / 16);
  if (total == 0) return cudaSuccess;
  const int eb = elem_bytes(args.src_type);
  const bool vec = (reinterpret_cast<uintptr_t>(args.src) % 16 == 0) && ((args.src_row_stride * eb) % 16 == 0);
  if (args.rows > 0x7fffffff) return cudaErrorInvalidValue;
  const int64_t blocks_per_row = args.cols / 16;
  const int per = rowwise || total >= kOnePerThreadBelow ? kPerThread : 1;
  const int threads = row_threads(blocks_per_row, per);
  const int64_t chunks = (blocks_per_row + int64_t(per) * threads - 1) / (int64_t(per) * threads);
  if (chunks > 65535) return cudaErrorInvalidValue;
  return dispatch_type(args.src_type, [&](auto t) {
    constexpr ElemType kT = decltype(t)::value;
    const dim3 grid(unsigned(args.rows), unsigned(chunks));
    if (rowwise) quantize_nvfp4_rowwise_kernel<kT><<<unsigned(args.rows), threads, 0, stream>>>(args, vec);
    else if (per == 1) quantize_nvfp4_kernel<kT, 1><<<grid, threads, 0, stream>>>(args, vec);
    else quantize_nvfp4_kernel<kT, kPerThread><<<grid, threads, 0, stream>>>(args, vec);
    return cudaGetLastError();
  });
}

cudaError_t launch_nvfp4_to_operand(const uint8_t* data, const uint8_t* scale, int64_t rows, int64_t cols,
                                    uint16_t* dst, bool lane_order, cudaStream_t stream) {
  if (cols % (lane_order ? 64 : 16) != 0) return cudaErrorInvalidValue;
  const int64_t n = rows * (cols / 16);
  if (n == 0) return cudaSuccess;
  nvfp4_to_operand_kernel<<<unsigned((n + 255) / 256), 256, 0, stream>>>(data, scale, rows, cols, dst, lane_order);
  return cudaGetLastError();
}

cudaError_t launch_dynamic_global_scale(const void* src, ElemType src_type, int64_t rows, int64_t cols,
                                        int64_t row_stride, uint32_t* scratch, float* out, cudaStream_t stream) {
  cudaError_t err = cudaMemsetAsync(scratch, 0, sizeof(uint32_t), stream);
  if (err != cudaSuccess) return err;
  const int64_t n = rows * cols;
  if (n > 0) {
    const int threads = 256;
    int64_t blocks = (n + threads * 8 - 1) / (threads * 8);
    if (blocks > 1024) blocks = 1024;
    err = dispatch_type(src_type, [&](auto t) {
      amax_kernel<decltype(t)::value><<<unsigned(blocks), threads, 0, stream>>>(src, rows, cols, row_stride, scratch);
      return cudaGetLastError();
    });
    if (err != cudaSuccess) return err;
  }
  finish_global_scale_kernel<<<1, 1, 0, stream>>>(scratch, out);
  return cudaGetLastError();
}

}  // namespace megamoe

// Host helpers shared by the launchers of the elementwise kernels (stage.cu, combine.cu), and the slot batch
// both kernels use.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "megamoe/common_kernels.h"

namespace megamoe::sm90 {
namespace {

// A token's slot entries (rows of entry_row / dst_rows, routing weights) are read up to kSlotBatch at a time, all
// before the first store or product that uses them, so that a thread waits for them once per batch, not once per
// slot (the loop over j, with a store or a dependent load in each step, had the compiler issue one slot at a time).
constexpr int kSlotBatch = 8;

// f(static_cast<C*>(nullptr)) for the C type of t (float, __half, __nv_bfloat16).
template <typename F>
cudaError_t with_elem_type(ElemType t, F&& f) {
  switch (t) {
    case ElemType::kFloat32: return f(static_cast<float*>(nullptr));
    case ElemType::kFloat16: return f(static_cast<__half*>(nullptr));
    case ElemType::kBFloat16: return f(static_cast<__nv_bfloat16*>(nullptr));
  }
  return cudaErrorInvalidValue;
}

unsigned grid_of(int64_t n, int threads, unsigned cap = 65535u * 4) {
  int64_t b = (n + threads - 1) / threads;
  if (b < 1) b = 1;
  return unsigned(b > cap ? cap : b);
}

}  // namespace
}  // namespace megamoe::sm90

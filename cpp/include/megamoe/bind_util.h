// Helpers shared by the nanobind registration files (cpp/*/bind_*.cpp): turning DLPack
// arrays into raw device pointers with the checks that catch wrong inputs where they
// enter (dtype, device, contiguity), and CUDA errors into Python exceptions.
#pragma once
#include <cuda_runtime.h>
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>

#include <cstdint>
#include <optional>
#include <stdexcept>
#include <string>

#include "megamoe/common_kernels.h"

namespace megamoe::bind {

namespace nb = nanobind;
using Array = nb::ndarray<nb::device::cuda>;
using OptArray = std::optional<Array>;

inline std::string dtype_name(nb::dlpack::dtype d) {
  return "(code " + std::to_string(int(d.code)) + ", bits " + std::to_string(int(d.bits)) + ")";
}

inline bool is_contiguous(const Array& a) {
  int64_t expect = 1;
  for (int i = int(a.ndim()) - 1; i >= 0; --i) {
    if (a.shape(i) != 1 && a.stride(i) != expect) return false;
    expect *= int64_t(a.shape(i));
  }
  return true;
}

// Pointer of a contiguous array whose element size is `bytes` (any dtype code).
template <typename T>
T* ptr(const Array& a, const char* name, int bytes) {
  if (int(a.dtype().bits) != 8 * bytes)
    throw std::invalid_argument(std::string(name) + ": expected " + std::to_string(8 * bytes) + "-bit elements, got " +
                                dtype_name(a.dtype()));
  if (!is_contiguous(a)) throw std::invalid_argument(std::string(name) + ": must be contiguous");
  return static_cast<T*>(a.data());
}

template <typename T>
T* opt_ptr(const OptArray& a, const char* name, int bytes) {
  return a ? ptr<T>(*a, name, bytes) : nullptr;
}

inline ElemType elem_type(const Array& a, const char* name) {
  const auto d = a.dtype();
  if (d == nb::dtype<float>()) return ElemType::kFloat32;
  if (d.code == uint8_t(nb::dlpack::dtype_code::Float) && d.bits == 16) return ElemType::kFloat16;
  if (d.code == uint8_t(nb::dlpack::dtype_code::Bfloat) && d.bits == 16) return ElemType::kBFloat16;
  throw std::invalid_argument(std::string(name) + ": expected float32, float16 or bfloat16, got " + dtype_name(d));
}

inline int64_t numel(const Array& a) {
  int64_t n = 1;
  for (size_t i = 0; i < a.ndim(); ++i) n *= int64_t(a.shape(i));
  return n;
}

inline void check(cudaError_t err, const char* what) {
  if (err != cudaSuccess) throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(err));
}

inline cudaStream_t stream_of(uintptr_t s) { return reinterpret_cast<cudaStream_t>(s); }

}  // namespace megamoe::bind

// Helpers shared by the CUDA launchers (csrc/cuda/*.cpp): dtype mapping, error checks and
// device attributes. Host-only; compiled by the C++ compiler against ATen.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>
#include <cuda_runtime_api.h>

#include <cstdint>

#include "orca/cuda/params.h"

namespace orca::cuda {

inline DType to_dtype(at::ScalarType t) {
  switch (t) {
    case at::kBFloat16: return DType::kBFloat16;
    case at::kHalf: return DType::kFloat16;
    default: return DType::kFloat32;
  }
}

inline bool aligned16(const void* ptr) { return reinterpret_cast<uintptr_t>(ptr) % 16 == 0; }

inline void check_cuda(const at::Tensor& t, const char* op, const char* name) {
  TORCH_CHECK(t.is_cuda(), op, ": ", name, " must be a CUDA tensor, got device ", t.device());
}

#define ORCA_CUDA_LAUNCH_CHECK(expr, op)                                              \
  do {                                                                                \
    const cudaError_t orca_err_ = (expr);                                             \
    TORCH_CHECK(orca_err_ == cudaSuccess, op, ": CUDA launch failed: ",               \
                cudaGetErrorString(orca_err_));                                       \
  } while (0)

// A device attribute (cheap driver query, no synchronization).
inline int device_attribute(cudaDeviceAttr attr, int device) {
  int value = 0;
  const cudaError_t err = cudaDeviceGetAttribute(&value, attr, device);
  TORCH_CHECK(err == cudaSuccess, "cudaDeviceGetAttribute failed: ", cudaGetErrorString(err));
  return value;
}

}  // namespace orca::cuda

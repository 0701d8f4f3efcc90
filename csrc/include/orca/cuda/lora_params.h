// Torch-free launch parameters of lora_linear's CUDA kernel (csrc/cuda/lora.cu).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "orca/cuda/params.h"

namespace orca::cuda {

struct LoraParams {
  void* y;                  // [T, N] in the dtype, contiguous
  const void* x;            // [T, K] in the dtype, rows x_row_stride elements apart
  const float* lora_a;      // [L, R, K]
  const float* lora_b;      // [L, R, N] (B transposed)
  const float* scales;      // [L]
  const int32_t* cu_seg_lens;  // [S + 1]
  const int32_t* seg_slots;    // [S]; -1: no adapter; outside [0, L) skipped
  int64_t T, K, N, R, L, S, x_row_stride;
};

cudaError_t launch_lora_linear(const LoraParams& p, DType dtype, cudaStream_t stream);

}  // namespace orca::cuda

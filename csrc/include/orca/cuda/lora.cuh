// Torch-free CUDA kernel of lora_linear: one CTA per row. The row finds its segment by binary
// search over cu_seg_lens, its warps compute the shrink x @ A^T (one rank row each, reduced by
// shuffles) into shared memory, then its threads add scale * shrink @ B^T over the columns.
#pragma once

#include "orca/cuda/common.cuh"
#include "orca/cuda/lora_params.h"

namespace orca::cuda::lora {

constexpr int kThreads = 128;

template <typename T>
__global__ void lora_linear_kernel(const LoraParams p) {
  ORCA_DYNAMIC_SMEM(smem);
  float* shrink = reinterpret_cast<float*>(smem);
  const int64_t row = blockIdx.x;
  // The last segment starting at or before the row (empty segments skipped by >).
  int64_t lo = 0, hi = p.S;
  while (hi - lo > 1) {
    const int64_t mid = (lo + hi) / 2;
    if (p.cu_seg_lens[mid] <= row) lo = mid;
    else hi = mid;
  }
  while (lo + 1 < p.S && p.cu_seg_lens[lo + 1] <= row) ++lo;
  const int32_t slot = p.seg_slots[lo];
  if (slot < 0 || slot >= p.L) return;
  const T* x = static_cast<const T*>(p.x) + row * p.x_row_stride;
  const float* a = p.lora_a + static_cast<int64_t>(slot) * p.R * p.K;
  const float* b = p.lora_b + static_cast<int64_t>(slot) * p.R * p.N;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, warps = blockDim.x / 32;
  for (int64_t j = warp; j < p.R; j += warps) {
    float sum = 0.f;
    for (int64_t k = lane; k < p.K; k += 32) sum += to_float(x[k]) * a[j * p.K + k];
    for (int offset = 16; offset > 0; offset /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, offset);
    if (lane == 0) shrink[j] = p.scales[slot] * sum;
  }
  __syncthreads();
  T* y = static_cast<T*>(p.y) + row * p.N;
  for (int64_t n = threadIdx.x; n < p.N; n += blockDim.x) {
    float delta = 0.f;
    for (int64_t j = 0; j < p.R; ++j) delta += shrink[j] * b[j * p.N + n];
    y[n] = from_float<T>(to_float(y[n]) + delta);
  }
}

}  // namespace orca::cuda::lora

// Torch-free row norms for packed_linear's fused input norm at decode sizes (a few rows, run
// on the calling thread: the rows are a few KB, less work than a fork-join). Each output is
// rounded to the model's dtype as the unfused norm's output tensor would be:
// - layer_norm: (x - mean) / sqrt(var + eps) * w + b, statistics in float (torch's layer_norm);
// - rms_norm: w * dtype(x / sqrt(mean(x^2) + eps)), the normalization in float and the scale
//   in the dtype (Hugging Face's LlamaRMSNorm).
#pragma once

#include <cmath>
#include <cstdint>

namespace orca::cpu {

template <typename scalar_t>
void layer_norm_rows(const scalar_t* x, int64_t rows, int64_t K, const scalar_t* w,
                     const scalar_t* b, float eps, scalar_t* y) {
  for (int64_t i = 0; i < rows; ++i) {
    const scalar_t* xr = x + i * K;
    float mean = 0.f, var = 0.f;
    for (int64_t k = 0; k < K; ++k) mean += static_cast<float>(xr[k]);
    mean /= static_cast<float>(K);
    for (int64_t k = 0; k < K; ++k) {
      const float d = static_cast<float>(xr[k]) - mean;
      var += d * d;
    }
    const float rstd = 1.f / std::sqrt(var / static_cast<float>(K) + eps);
    for (int64_t k = 0; k < K; ++k) {
      const float bias = b ? static_cast<float>(b[k]) : 0.f;
      y[i * K + k] = static_cast<scalar_t>((static_cast<float>(xr[k]) - mean) * rstd *
                                               static_cast<float>(w[k]) + bias);
    }
  }
}

template <typename scalar_t>
void rms_norm_rows(const scalar_t* x, int64_t rows, int64_t K, const scalar_t* w, float eps,
                   scalar_t* y) {
  for (int64_t i = 0; i < rows; ++i) {
    const scalar_t* xr = x + i * K;
    float sum_sq = 0.f;
    for (int64_t k = 0; k < K; ++k) {
      const float v = static_cast<float>(xr[k]);
      sum_sq += v * v;
    }
    const float rstd = 1.f / std::sqrt(sum_sq / static_cast<float>(K) + eps);
    for (int64_t k = 0; k < K; ++k) {
      // Rounded to the dtype before the scale, as h.to(x.dtype) in LlamaRMSNorm.
      const float normalized = static_cast<scalar_t>(static_cast<float>(xr[k]) * rstd);
      y[i * K + k] = static_cast<scalar_t>(static_cast<float>(w[k]) * normalized);
    }
  }
}

}  // namespace orca::cpu

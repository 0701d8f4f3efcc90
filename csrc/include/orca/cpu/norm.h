// Torch-free row norms for packed_linear's fused input norm at decode sizes (a few rows, run
// on the calling thread: the rows are a few KB, less work than a fork-join). Each output is
// rounded to the model's dtype as the unfused norm's output tensor would be:
// - layer_norm: (x - mean) / sqrt(var + eps) * w + b, statistics in float (torch's layer_norm);
// - rms_norm: w * dtype(x / sqrt(mean(x^2) + eps)), the normalization in float and the scale
//   in the dtype (Hugging Face's LlamaRMSNorm).
#pragma once

#include <cmath>
#include <cstdint>

#include "orca/cpu/vec.h"

namespace orca::cpu {

// sum over k < K of f(x[k]) (f on floats, lane-wise on vectors), in 32 float lanes and then
// across them: a scalar sum is one dependent add per element, each waiting out the add's
// latency, which made the fused input norm a visible share of a decode step.
template <typename scalar_t, typename F>
float row_sum(const scalar_t* x, int64_t K, const F& f) {
  vec16 lanes[2] = {};
  int64_t k = 0;
  for (; k + 32 <= K; k += 32) {
    lanes[0] += f(load16_as_float(x + k));
    lanes[1] += f(load16_as_float(x + k + 16));
  }
  for (; k + 16 <= K; k += 16) lanes[0] += f(load16_as_float(x + k));
  float sum = hsum(lanes[0] + lanes[1]);
  for (; k < K; ++k) sum += f(static_cast<float>(x[k]));
  return sum;
}

template <typename scalar_t>
void layer_norm_rows(const scalar_t* x, int64_t rows, int64_t K, const scalar_t* w,
                     const scalar_t* b, float eps, scalar_t* y) {
  for (int64_t i = 0; i < rows; ++i) {
    const scalar_t* xr = x + i * K;
    const float mean = row_sum(xr, K, [](auto v) { return v; }) / static_cast<float>(K);
    const float var = row_sum(xr, K, [mean](auto v) { return (v - mean) * (v - mean); });
    const float rstd = 1.f / std::sqrt(var / static_cast<float>(K) + eps);
    for (int64_t k = 0; k < K; ++k) {
      const float bias = b ? static_cast<float>(b[k]) : 0.f;
      y[i * K + k] = static_cast<scalar_t>((static_cast<float>(xr[k]) - mean) * rstd *
                                               static_cast<float>(w[k]) + bias);
    }
  }
}

// With a residual [rows, K], y = residual + rms_norm(x), the sum rounded once more (a post-norm
// block's add). y may be x or the residual (each element is read before it is written).
template <typename scalar_t>
void rms_norm_rows(const scalar_t* x, int64_t rows, int64_t K, const scalar_t* w, float eps,
                   scalar_t* y, const scalar_t* residual = nullptr) {
  for (int64_t i = 0; i < rows; ++i) {
    const scalar_t* xr = x + i * K;
    const float sum_sq = row_sum(xr, K, [](auto v) { return v * v; });
    const float rstd = 1.f / std::sqrt(sum_sq / static_cast<float>(K) + eps);
    for (int64_t k = 0; k < K; ++k) {
      // Rounded to the dtype before the scale, as h.to(x.dtype) in LlamaRMSNorm.
      const float normalized = static_cast<scalar_t>(static_cast<float>(xr[k]) * rstd);
      const scalar_t scaled = static_cast<scalar_t>(static_cast<float>(w[k]) * normalized);
      y[i * K + k] = residual ? static_cast<scalar_t>(static_cast<float>(residual[i * K + k]) +
                                                      static_cast<float>(scaled))
                              : scaled;
    }
  }
}

}  // namespace orca::cpu

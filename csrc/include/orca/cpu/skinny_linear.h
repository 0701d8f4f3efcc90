// Torch-free dot-product kernel for linear layers with very few tokens (decode at small
// batch): y[t, n] = x[t, :] . w[n, :]. Each weight row is read once for all kT tokens, four
// rows at a time, so the op streams the weights at close to memory bandwidth; BLAS GEMM
// kernels are tuned for many rows and lose a good part of that on such shapes.
#pragma once

#include <algorithm>
#include <cstdint>

#include "orca/cpu/vec.h"

namespace orca::cpu {

// x: [kT, K] float32; w: [N, K]; writes y[t * y_stride + (n - n_begin)] for n in
// [n_begin, n_end).
template <int kT, typename scalar_t>
void skinny_dot(const float* x, const scalar_t* w, int64_t K, int64_t n_begin, int64_t n_end,
                float* y, int64_t y_stride) {
  constexpr int kRows = 4;
  const int64_t k_vec = K / 16 * 16;
  for (int64_t n0 = n_begin; n0 < n_end; n0 += kRows) {
    const int rows = static_cast<int>(std::min<int64_t>(kRows, n_end - n0));
    const scalar_t* wr[kRows];
    for (int i = 0; i < kRows; ++i) wr[i] = w + (n0 + (i < rows ? i : 0)) * K;
    vec16 acc[kT][kRows] = {};
    for (int64_t k = 0; k < k_vec; k += 16) {
      vec16 wv[kRows];
      for (int i = 0; i < kRows; ++i) wv[i] = load16_as_float(wr[i] + k);
      for (int t = 0; t < kT; ++t) {
        const vec16 xv = load16(x + t * K + k);
        for (int i = 0; i < kRows; ++i) acc[t][i] += xv * wv[i];
      }
    }
    for (int t = 0; t < kT; ++t) {
      for (int i = 0; i < rows; ++i) {
        float sum = hsum(acc[t][i]);
        for (int64_t k = k_vec; k < K; ++k) sum += x[t * K + k] * static_cast<float>(wr[i][k]);
        y[t * y_stride + (n0 - n_begin) + i] = sum;
      }
    }
  }
}

}  // namespace orca::cpu

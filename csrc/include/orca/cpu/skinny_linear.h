// Torch-free dot-product kernel for linear layers with very few tokens (decode at small
// batch): y[t, n] = x[t, :] . w[n, :]. Each weight row is read once, front to back, for all kT
// tokens, so a thread reads its share of the weights as one sequential stream, prefetched a
// row ahead; BLAS GEMM kernels are tuned for many rows and lose a good part of the memory
// bandwidth on such shapes, and so does reading several rows interleaved (several short
// streams the hardware prefetcher follows badly: about half the bandwidth, measured).
#pragma once

#include <algorithm>
#include <cstdint>

#include "orca/cpu/vec.h"

namespace orca::cpu {

// Independent FMA chains per token, enough to cover the FMA latency with kT chains in flight.
template <int kT>
constexpr int kSkinnyChains = kT == 1 ? 4 : kT <= 4 ? 2 : 1;
constexpr int64_t kSkinnyPrefetchBytes = 2048;

// x: [kT, K] float32; w: [N, K]; writes y[t * y_stride + (n - n_begin)] for n in
// [n_begin, n_end).
template <int kT, typename scalar_t>
void skinny_dot(const float* x, const scalar_t* w, int64_t K, int64_t n_begin, int64_t n_end,
                float* y, int64_t y_stride) {
  constexpr int kChains = kSkinnyChains<kT>;
  constexpr int64_t kStep = 16 * kChains;
  const int64_t k_main = K / kStep * kStep, k_vec = K / 16 * 16;
  for (int64_t n = n_begin; n < n_end; ++n) {
    const scalar_t* row = w + n * K;
    vec16 acc[kT][kChains] = {};
    for (int64_t k = 0; k < k_main; k += kStep) {
      for (int c = 0; c < kChains; ++c) {
        const scalar_t* chunk = row + k + 16 * c;
        __builtin_prefetch(reinterpret_cast<const char*>(chunk) + kSkinnyPrefetchBytes, 0, 0);
        const vec16 wv = load16_as_float(chunk);
        for (int t = 0; t < kT; ++t) acc[t][c] += wv * load16(x + t * K + k + 16 * c);
      }
    }
    for (int64_t k = k_main; k < k_vec; k += 16) {
      const vec16 wv = load16_as_float(row + k);
      for (int t = 0; t < kT; ++t) acc[t][0] += wv * load16(x + t * K + k);
    }
    for (int t = 0; t < kT; ++t) {
      vec16 total = acc[t][0];
      for (int c = 1; c < kChains; ++c) total += acc[t][c];
      float sum = hsum(total);
      for (int64_t k = k_vec; k < K; ++k) sum += x[t * K + k] * static_cast<float>(row[k]);
      y[t * y_stride + (n - n_begin)] = sum;
    }
  }
}

}  // namespace orca::cpu

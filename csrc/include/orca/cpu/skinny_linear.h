// Torch-free dot-product kernel for linear layers with very few tokens (decode at small
// batch): y[t, n] = x[t, :] . w[n, :]. Each weight row is read once, front to back, for all kT
// tokens, and a thread walks kStreams distant row ranges side by side: long sequential
// streams, prefetched ahead, with each x load shared by all of them. Measured on a 2-core
// Zen 4: about 1.2x (1 token) to 1.3x (4 tokens) the bandwidth of one stream, and 2x that of
// reading a few adjacent rows interleaved (short streams the hardware prefetcher follows
// badly). The software prefetch targets L2 (prefetcht1): into L1 (t0 / nta) it held 3-4 tokens
// to ~27 GB/s against ~35 GB/s, as the FMAs left fewer loads in flight (1 token: about equal).
// BLAS GEMM kernels are tuned for many rows and lose much of the bandwidth here.
#pragma once

#include <algorithm>
#include <cstdint>

#include "orca/cpu/vec.h"

namespace orca::cpu {

constexpr int64_t kSkinnyPrefetchBytes = 2048;

// Rows first[s] + i of w: [N, K] (s < kStreams, i < rows) against x: [kT, K] float32; writes
// y[s][t * y_stride + i].
template <int kT, int kStreams, typename scalar_t>
void skinny_rows(const float* x, const scalar_t* w, int64_t K, const int64_t (&first)[kStreams],
                 int64_t rows, float* const (&y)[kStreams], int64_t y_stride) {
  // Independent FMA chains: enough accumulators in flight to cover the FMA latency.
  constexpr int kChains = kT * kStreams >= 4 ? 1 : 4 / (kT * kStreams);
  constexpr int64_t kStep = 16 * kChains;
  const int64_t k_main = K / kStep * kStep, k_vec = K / 16 * 16;
  for (int64_t i = 0; i < rows; ++i) {
    const scalar_t* row[kStreams];
    for (int s = 0; s < kStreams; ++s) row[s] = w + (first[s] + i) * K;
    vec16 acc[kStreams][kT][kChains] = {};
    for (int64_t k = 0; k < k_main; k += kStep) {
      for (int c = 0; c < kChains; ++c) {
        vec16 wv[kStreams];
        for (int s = 0; s < kStreams; ++s) {
          const scalar_t* chunk = row[s] + k + 16 * c;
          __builtin_prefetch(reinterpret_cast<const char*>(chunk) + kSkinnyPrefetchBytes, 0, 2);
          wv[s] = load16_as_float(chunk);
        }
        for (int t = 0; t < kT; ++t) {
          const vec16 xv = load16(x + t * K + k + 16 * c);
          for (int s = 0; s < kStreams; ++s) acc[s][t][c] += wv[s] * xv;
        }
      }
    }
    for (int64_t k = k_main; k < k_vec; k += 16) {
      for (int s = 0; s < kStreams; ++s) {
        const vec16 wv = load16_as_float(row[s] + k);
        for (int t = 0; t < kT; ++t) acc[s][t][0] += wv * load16(x + t * K + k);
      }
    }
    for (int s = 0; s < kStreams; ++s) {
      for (int t = 0; t < kT; ++t) {
        vec16 total = acc[s][t][0];
        for (int c = 1; c < kChains; ++c) total += acc[s][t][c];
        float sum = hsum(total);
        for (int64_t k = k_vec; k < K; ++k) sum += x[t * K + k] * static_cast<float>(row[s][k]);
        y[s][t * y_stride + i] = sum;
      }
    }
  }
}

}  // namespace orca::cpu

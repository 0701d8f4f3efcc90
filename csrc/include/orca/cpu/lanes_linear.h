// Torch-free kernel for linear layers with a few tens of tokens (decode at moderate batch):
// the tokens are the vector lanes. x is transposed once to [K][W] (W = 16 * kTV, the tokens
// rounded up to whole vectors, zero-padded), and kRows weight rows at a time are read front
// to back, each weight broadcast against the W tokens' x values:
// y[n * W + t] = sum_k w[n, k] x[t, k]. No horizontal sums; kRows x kTV accumulators stay in
// registers, and every weight is loaded once for all tokens.
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

#include "orca/cpu/vec.h"

namespace orca::cpu {

// Weight rows per pass: enough accumulators to hide the FMA latency, few enough to stay in
// registers with the x vectors.
template <int kTV>
constexpr int lanes_rows_per_pass() {
  return kTV <= 2 ? 8 : 4;
}

// Rows [0, rows) of w ([., K], row-major) against xt ([K][16 * kTV] float32) into y
// ([rows][16 * kTV]).
template <int kTV, typename scalar_t>
void lanes_rows(const float* xt, const scalar_t* w, int64_t K, int64_t rows, float* y) {
  constexpr int W = 16 * kTV;
  const auto pass = [&]<int kRows>(int64_t n0) {
    vec16 acc[kRows][kTV] = {};
    const scalar_t* row[kRows];
    for (int r = 0; r < kRows; ++r) row[r] = w + (n0 + r) * K;
    for (int64_t k = 0; k < K; ++k) {
      vec16 xv[kTV];
      for (int tv = 0; tv < kTV; ++tv) xv[tv] = load16(xt + k * W + 16 * tv);
      for (int r = 0; r < kRows; ++r) {
        const float wk = static_cast<float>(row[r][k]);
        for (int tv = 0; tv < kTV; ++tv) acc[r][tv] += wk * xv[tv];
      }
    }
    for (int r = 0; r < kRows; ++r) {
      for (int tv = 0; tv < kTV; ++tv) store16(y + (n0 + r) * W + 16 * tv, acc[r][tv]);
    }
  };
  constexpr int kRows = lanes_rows_per_pass<kTV>();
  int64_t n = 0;
  for (; n + kRows <= rows; n += kRows) pass.template operator()<kRows>(n);
  for (; n < rows; ++n) pass.template operator()<1>(n);
}

#if defined(__AVX512BF16__)
// lanes_rows for bfloat16 on AVX512-BF16: xt holds the tokens' dims (2i, 2i+1) as one 32-bit
// pair ([K/2][16 * kTV]), and each weight pair is broadcast into vdpbf16ps (exact products,
// float sums): half the instructions per weight of the float kernel. K is even.
template <int kTV>
void lanes_rows_bf16(const uint32_t* xt, const uint16_t* w, int64_t K, int64_t rows, float* y) {
  constexpr int W = 16 * kTV;
  const auto pass = [&]<int kRows>(int64_t n0) {
    __m512 acc[kRows][kTV];
    for (auto& per_row : acc) {
      for (auto& a : per_row) a = _mm512_setzero_ps();
    }
    const uint16_t* row[kRows];
    for (int r = 0; r < kRows; ++r) row[r] = w + (n0 + r) * K;
    for (int64_t i = 0; i < K / 2; ++i) {
      __m512bh xv[kTV];
      for (int tv = 0; tv < kTV; ++tv) {
        xv[tv] = (__m512bh)_mm512_loadu_si512(xt + i * W + 16 * tv);
      }
      for (int r = 0; r < kRows; ++r) {
        uint32_t pair;
        std::memcpy(&pair, row[r] + 2 * i, sizeof(pair));
        const __m512bh wv = (__m512bh)_mm512_set1_epi32(static_cast<int>(pair));
        for (int tv = 0; tv < kTV; ++tv) acc[r][tv] = _mm512_dpbf16_ps(acc[r][tv], xv[tv], wv);
      }
    }
    for (int r = 0; r < kRows; ++r) {
      for (int tv = 0; tv < kTV; ++tv) _mm512_storeu_ps(y + (n0 + r) * W + 16 * tv, acc[r][tv]);
    }
  };
  constexpr int kRows = lanes_rows_per_pass<kTV>();
  int64_t n = 0;
  for (; n + kRows <= rows; n += kRows) pass.template operator()<kRows>(n);
  for (; n < rows; ++n) pass.template operator()<1>(n);
}
#endif

}  // namespace orca::cpu

// Torch-free "lanes" dot kernels: one operand's rows (tokens, or query rows) are the vector
// lanes, stored transposed as [K][W] (W a multiple of 16, zero-padded), and each element of a
// few other rows (weights, or keys) is broadcast against them: acc[r][v] += row_r . lanes.
// No horizontal sums; the accumulators stay in registers, and every row element is loaded
// once for all lanes. Used by linear layers with a few tens of tokens (decode at moderate
// batch) and by the prefill attention's scores (orca/cpu/attention.h).
#pragma once

#include <cstdint>
#include <cstring>
#include <type_traits>

#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

#include "orca/cpu/vec.h"

namespace orca::cpu {

// acc[r][v] += sum_{k < K} rows[r][k] * lanes[k * W + 16 v + lane], lanes float32.
template <int kR, int kV, typename row_t>
inline void lane_dots(const float* lanes, int64_t W, const row_t* const* rows, int64_t K,
                      vec16 (&acc)[kR][kV]) {
  for (int64_t k = 0; k < K; ++k) {
    vec16 x[kV];
    for (int v = 0; v < kV; ++v) x[v] = load16(lanes + k * W + 16 * v);
    for (int r = 0; r < kR; ++r) {
      const float e = static_cast<float>(rows[r][k]);
      for (int v = 0; v < kV; ++v) acc[r][v] += e * x[v];
    }
  }
}

#if defined(__AVX512BF16__)
// lane_dots on bfloat16 pairs (AVX512-BF16): lanes holds elements (2i, 2i+1) as one 32-bit
// pair ([pairs][W]) and each row's pair is broadcast into vdpbf16ps (exact products, float
// sums): half the instructions per element of the float version.
template <int kR, int kV>
inline void lane_pair_dots(const uint32_t* lanes, int64_t W, const uint16_t* const* rows,
                           int64_t pairs, vec16 (&acc)[kR][kV]) {
  for (int64_t i = 0; i < pairs; ++i) {
    __m512bh x[kV];
    for (int v = 0; v < kV; ++v) x[v] = (__m512bh)_mm512_loadu_si512(lanes + i * W + 16 * v);
    for (int r = 0; r < kR; ++r) {
      uint32_t pair;
      std::memcpy(&pair, rows[r] + 2 * i, sizeof(pair));
      const __m512bh e = (__m512bh)_mm512_set1_epi32(static_cast<int>(pair));
      for (int v = 0; v < kV; ++v) acc[r][v] = (vec16)_mm512_dpbf16_ps((__m512)acc[r][v], x[v], e);
    }
  }
}
#endif

// Weight rows per pass: enough accumulators to hide the FMA latency, few enough to stay in
// registers with the x vectors.
template <int kTV>
constexpr int lanes_rows_per_pass() {
  return kTV <= 2 ? 8 : 4;
}

// A linear layer's rows [0, rows) of w ([., K], row-major) against the tokens xt into y
// ([rows][16 * kTV]): xt is [K][16 * kTV] float32, or for bfloat16 weights (uint16_t bits, K
// even, AVX512-BF16) [K/2][16 * kTV] pairs.
template <int kTV, typename lane_t, typename row_t>
void lanes_rows(const lane_t* xt, const row_t* w, int64_t K, int64_t rows, float* y) {
  constexpr int W = 16 * kTV;
  const auto pass = [&]<int kRows>(int64_t n0) {
    vec16 acc[kRows][kTV] = {};
    const row_t* row[kRows];
    for (int r = 0; r < kRows; ++r) row[r] = w + (n0 + r) * K;
#if defined(__AVX512BF16__)
    if constexpr (std::is_same_v<lane_t, uint32_t>) {
      lane_pair_dots<kRows, kTV>(xt, W, row, K / 2, acc);
    } else
#endif
    {
      lane_dots<kRows, kTV>(xt, W, row, K, acc);
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

}  // namespace orca::cpu

// The quantized linear's int8-activation path for a few tokens on AVX-512 VNNI CPUs: each
// 32-value block of a token is split into two int8 parts, hi = nearest-even(x / dx) with
// dx = max |x| / 127 (llama.cpp's q8_0 rounding of the activations), then the remainder's
// lo = nearest-even((x - hi dx) / (dx / 256)), so x = (256 hi + lo) dx / 256 + e with
// |e| <= dx / 512: about 16 bits of each block, finer than bfloat16 (one int8 part alone flips
// greedy tokens of a one-request decode). vpdpbusd multiplies 64 weight bytes (two blocks) by 64
// bytes of each part into 16 int32 lanes exactly, and 256 dot(hi) + dot(lo) stays exact in
// int32; only then are the lanes scaled to float.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "orca/cpu/quant_formats.h"

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")

namespace orca::cpu::quant::vnni {

// A token's two blocks 2p and 2p + 1 (the second zero past the row's end), laid out as the
// weight bytes are: q8_0 [block 0: 32 | block 1: 32]; q4_0 / q4_1 [block 0 values 0-15 | block
// 1 values 0-15 | block 0 values 16-31 | block 1 values 16-31] (the low, then the high nibbles).
// Lane l of the dot product covers bytes 4l..4l+3.
// q holds hi and q_lo lo; a lane's value is 256 hi + lo in units of dx / 256.
struct BlockPair {
  int8_t q[64];
  int8_t q_lo[64];
  float unit[16];   // dx / 256 of lane l's block
  int32_t off[16];  // the weights' offset times lane l's sum of 256 q + q_lo (q8_0: 128,
                    // q4_0: 8, q4_1: 0)
  float sum[16];    // q4_1: unit times lane l's sum of 256 q + q_lo, for the blocks' m term
};

// The block of lane l: q8_0 lanes 0-7 are block 0, q4 lanes 0-3 and 8-11.
constexpr int lane_block(Format f, int l) { return f == Format::kQ8_0 ? l / 8 : (l / 4) % 2; }

// x [T, K] (K a multiple of 32) as T * ceil(K / 64) block pairs, token by token.
inline void quantize_activations(Format f, const float* x, int64_t T, int64_t K,
                                 BlockPair* out) {
  const int64_t blocks = K / kBlockSize, pairs = (blocks + 1) / 2;
  const int32_t offset = f == Format::kQ8_0 ? 128 : f == Format::kQ4_0 ? 8 : 0;
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t p = 0; p < pairs; ++p) {
      float d[2] = {0.f, 0.f};
      int8_t q[2][2][kBlockSize] = {};  // [hi or lo][block][value]
      for (int s = 0; s < 2 && 2 * p + s < blocks; ++s) {
        const float* xb = x + t * K + (2 * p + s) * kBlockSize;
        float amax = 0.f;
        for (int j = 0; j < kBlockSize; ++j) amax = std::max(amax, std::fabs(xb[j]));
        d[s] = amax / 127.f;
        const float inverse = d[s] > 0.f ? 1.f / d[s] : 0.f;
        const float inverse_lo = 256.f * inverse;
        for (int j = 0; j < kBlockSize; ++j) {
          const float hi = std::nearbyint(xb[j] * inverse);
          // |x - hi dx| <= dx / 2 but for float rounding: lo clamped to int8.
          const float lo = std::nearbyint(std::fma(-hi, d[s], xb[j]) * inverse_lo);
          q[0][s][j] = static_cast<int8_t>(hi);
          q[1][s][j] = static_cast<int8_t>(std::clamp(lo, -127.f, 127.f));
        }
      }
      // Where each 16 bytes of BlockPair::q come from: (block, first value).
      constexpr int kGroups[2][4][2] = {{{0, 0}, {0, 16}, {1, 0}, {1, 16}},
                                        {{0, 0}, {1, 0}, {0, 16}, {1, 16}}};
      const auto& groups = kGroups[f == Format::kQ8_0 ? 0 : 1];
      BlockPair& o = out[t * pairs + p];
      for (int g = 0; g < 4; ++g) {
        for (int j = 0; j < 16; ++j) {
          o.q[16 * g + j] = q[0][groups[g][0]][groups[g][1] + j];
          o.q_lo[16 * g + j] = q[1][groups[g][0]][groups[g][1] + j];
        }
      }
      for (int l = 0; l < 16; ++l) {
        int32_t sum = 0;
        for (int i = 4 * l; i < 4 * l + 4; ++i) sum += 256 * o.q[i] + o.q_lo[i];
        o.unit[l] = d[lane_block(f, l)] / 256.f;
        o.off[l] = offset * sum;
        o.sum[l] = o.unit[l] * static_cast<float>(sum);
      }
    }
  }
}

// The weights of blocks b0 and b0 + 1 (`both`: else b0 alone, the row's last) as 64 unsigned
// bytes in BlockPair's order, and per lane their block's d (and q4_1's m).
template <Format F>
inline void weight_pair(const uint8_t* b0, bool both, __m512i& bytes, __m512& d, __m512& m) {
  const uint8_t* b1 = b0 + block_bytes(F);
  const int64_t qs = quants_offset(F);
  if constexpr (F == Format::kQ8_0) {
    const __m256i lo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b0 + qs));
    const __m256i hi = both ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b1 + qs))
                            : _mm256_setzero_si256();
    // int8 + 128 as uint8 (vpdpbusd's unsigned operand); BlockPair::off takes the 128 back.
    bytes = _mm512_xor_si512(_mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1),
                             _mm512_set1_epi8(static_cast<char>(0x80)));
  } else {
    // [b0's 16 bytes | b1's | b0's | b1's] by broadcast loads (load ports, not the shuffle
    // port the dot's scales already keep busy), then the upper half's high nibbles.
    const auto* q0 = reinterpret_cast<const __m128i*>(b0 + qs);
    const auto* q1 = reinterpret_cast<const __m128i*>(b1 + qs);
    __m512i v = _mm512_broadcast_i32x4(_mm_loadu_si128(q0));
    v = both ? _mm512_mask_broadcast_i32x4(v, 0xF0F0, _mm_loadu_si128(q1))
             : _mm512_maskz_mov_epi32(0x0F0F, v);
    bytes = _mm512_and_si512(_mm512_mask_srli_epi16(v, 0xFFFF0000u, v, 4),
                             _mm512_set1_epi8(15));
  }
  // d0, m0, d1, m1 (q4_1) or d0, d1 as floats, then spread over the lanes of their blocks.
  uint32_t h0 = 0, h1 = 0;
  std::memcpy(&h0, b0, F == Format::kQ4_1 ? 4 : 2);
  if (both) std::memcpy(&h1, b1, F == Format::kQ4_1 ? 4 : 2);
  const __m512 halves = _mm512_castps128_ps512(_mm_cvtph_ps(_mm_cvtsi64_si128(
      static_cast<int64_t>(F == Format::kQ4_1 ? h0 | uint64_t{h1} << 32 : h0 | h1 << 16))));
  if constexpr (F == Format::kQ8_0) {
    d = _mm512_permutexvar_ps(_mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1),
                              halves);
  } else if constexpr (F == Format::kQ4_0) {
    d = _mm512_permutexvar_ps(_mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 0, 0, 0, 0, 1, 1, 1, 1),
                              halves);
  } else {
    d = _mm512_permutexvar_ps(_mm512_setr_epi32(0, 0, 0, 0, 2, 2, 2, 2, 0, 0, 0, 0, 2, 2, 2, 2),
                              halves);
    m = _mm512_permutexvar_ps(_mm512_setr_epi32(1, 1, 1, 1, 3, 3, 3, 3, 1, 1, 1, 1, 3, 3, 3, 3),
                              halves);
  }
}

// Rows [0, kRows) of w against kT tokens' block pairs x: y[t * y_stride + r].
template <Format F, int kT, int kRows>
inline void dot_row_group(const BlockPair* x, int64_t K, const uint8_t* w, int64_t row_bytes,
                          float* y, int64_t y_stride) {
  const int64_t blocks = K / kBlockSize, pairs = (blocks + 1) / 2;
  __m512 acc[kRows][kT];
  for (auto& per_row : acc) {
    for (auto& a : per_row) a = _mm512_setzero_ps();
  }
  for (int64_t p = 0; p < pairs; ++p) {
    const bool both = 2 * p + 1 < blocks;
#pragma GCC unroll 4
    for (int r = 0; r < kRows; ++r) {
      const uint8_t* b0 = w + r * row_bytes + 2 * p * block_bytes(F);
      __builtin_prefetch(b0 + kRows * row_bytes, 0, 3);
      __m512i bytes;
      __m512 d, m;
      weight_pair<F>(b0, both, bytes, d, m);
#pragma GCC unroll 8
      for (int t = 0; t < kT; ++t) {
        const BlockPair& xp = x[t * pairs + p];
        const __m512i hi = _mm512_dpbusd_epi32(_mm512_setzero_si512(), bytes,
                                               _mm512_loadu_si512(xp.q));
        __m512i dot = _mm512_dpbusd_epi32(_mm512_slli_epi32(hi, 8), bytes,
                                          _mm512_loadu_si512(xp.q_lo));
        dot = _mm512_sub_epi32(dot, _mm512_loadu_si512(xp.off));
        acc[r][t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot),
                                    _mm512_mul_ps(d, _mm512_loadu_ps(xp.unit)), acc[r][t]);
        if constexpr (F == Format::kQ4_1) {
          acc[r][t] = _mm512_fmadd_ps(m, _mm512_loadu_ps(xp.sum), acc[r][t]);
        }
      }
    }
  }
  for (int r = 0; r < kRows; ++r) {
    for (int t = 0; t < kT; ++t) y[t * y_stride + r] = _mm512_reduce_add_ps(acc[r][t]);
  }
}

// `rows` rows of w against kT tokens: groups of rows side by side (four up to two tokens, two
// up to eight, within the 32 registers), then single rows.
template <Format F, int kT>
void dot_rows(const BlockPair* x, int64_t K, const uint8_t* w, int64_t rows, float* y,
              int64_t y_stride) {
  constexpr int kRows = kT <= 2 ? 4 : 2;
  const int64_t row_bytes = K / kBlockSize * block_bytes(F);
  int64_t i = 0;
  for (; i + kRows <= rows; i += kRows) {
    dot_row_group<F, kT, kRows>(x, K, w + i * row_bytes, row_bytes, y + i, y_stride);
  }
  for (; i < rows; ++i) {
    dot_row_group<F, kT, 1>(x, K, w + i * row_bytes, row_bytes, y + i, y_stride);
  }
}

}  // namespace orca::cpu::quant::vnni

#pragma GCC pop_options

// The quantized linear's int8-activation path for a few tokens on AVX-512 VNNI CPUs, for every
// format: each 32-value block of a token is split into two int8 parts, hi = nearest-even(x / dx)
// with dx = max |x| / 127 (llama.cpp's q8_0 rounding of the activations), then the remainder's
// lo = nearest-even((x - hi dx) / (dx / 256)), so x = (256 hi + lo) dx / 256 + e with
// |e| <= dx / 512: about 16 bits of each block, finer than bfloat16 (one int8 part alone flips
// greedy tokens of a one-request decode). vpdpbusd multiplies 64 unsigned weight quants (two
// blocks, or two sub-blocks of a K-quant) by 64 bytes of each part into 16 int32 lanes exactly,
// and 256 dot(hi) + dot(lo) stays exact in int32; only then are the lanes scaled to float by
// their block's (or sub-block's) scale, its zero and min applied as the activations' sums.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "orca/cpu/quant_formats.h"
#include "orca/cpu/quant_prefetch.h"

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")

namespace orca::cpu::quant::vnni {

// A token's two blocks 2p and 2p + 1 (the second zero past the row's end), laid out as the
// weight bytes are: contiguous [block 0: 32 | block 1: 32] (q8_0, and a K-quant's sub-blocks
// 2j and 2j + 1); interleaved [block 0 values 0-15 | block 1 values 0-15 | block 0 values 16-31
// | block 1 values 16-31] (q4_0, q4_1, q5_0, q5_1: the low, then the high nibbles).
// Lane l of the dot product covers bytes 4l..4l+3.
// q holds hi and q_lo lo; a lane's value is 256 hi + lo in units of dx / 256.
struct BlockPair {
  int8_t q[64];
  int8_t q_lo[64];
  float unit[16];   // dx / 256 of lane l's block
  int32_t off[16];  // the weights' zero (quant_zero) times lane l's sum of 256 q + q_lo
  float sum[16];    // unit times lane l's sum of 256 q + q_lo, for the formats' min term
  int32_t total[4];  // sums of 256 q + q_lo of values 0-15, 16-31 of each block (x16 kernels)
};

constexpr bool interleaved_pairs(Format f) {
  return f == Format::kQ4_0 || f == Format::kQ4_1 || f == Format::kQ5_0 || f == Format::kQ5_1;
}

// The unsigned quant that stands for weight zero (q8_0's int8 read as uint8 + 128); the formats
// with a min (has_min) take 0 and add min times the activations' sum instead.
constexpr int32_t quant_zero(Format f) {
  switch (f) {
    case Format::kQ8_0: return 128;
    case Format::kQ4_0: return 8;
    case Format::kQ5_0: return 16;
    case Format::kQ6_K: return 32;
    default: return 0;
  }
}

constexpr bool has_min(Format f) {
  return f == Format::kQ4_1 || f == Format::kQ5_1 || f == Format::kQ8_M || f == Format::kQ4_K ||
         f == Format::kQ5_K;
}

// The block of lane l: contiguous lanes 0-7 are block 0, interleaved lanes 0-3 and 8-11.
constexpr int lane_block(Format f, int l) { return interleaved_pairs(f) ? (l / 4) % 2 : l / 8; }

// A block of 32 values xb as its two int8 parts: hi and lo, and dx (x = (256 hi + lo) dx / 256
// + e, |e| <= dx / 512).
inline float split_block(const float* xb, int8_t* hi, int8_t* lo) {
  float amax = 0.f;
  for (int j = 0; j < kBlockSize; ++j) amax = std::max(amax, std::fabs(xb[j]));
  const float d = amax / 127.f;
  const float inverse = d > 0.f ? 1.f / d : 0.f;
  const float inverse_lo = 256.f * inverse;
  for (int j = 0; j < kBlockSize; ++j) {
    const float h = std::nearbyint(xb[j] * inverse);
    // |x - hi dx| <= dx / 2 but for float rounding: lo clamped to int8.
    const float l = std::nearbyint(std::fma(-h, d, xb[j]) * inverse_lo);
    hi[j] = static_cast<int8_t>(h);
    lo[j] = static_cast<int8_t>(std::clamp(l, -127.f, 127.f));
  }
  return d;
}

// x [T, K] (K a multiple of 32) as T * ceil(K / 64) block pairs, token by token; where given,
// remainder [T, K] gets what the split leaves of x, x - (256 hi + lo) dx / 256.
inline void quantize_activations(Format f, const float* x, int64_t T, int64_t K,
                                 BlockPair* out, float* remainder = nullptr) {
  const int64_t blocks = K / kBlockSize, pairs = (blocks + 1) / 2;
  const int32_t zero = quant_zero(f);
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t p = 0; p < pairs; ++p) {
      float d[2] = {0.f, 0.f};
      int8_t q[2][2][kBlockSize] = {};  // [hi or lo][block][value]
      for (int s = 0; s < 2 && 2 * p + s < blocks; ++s) {
        const int64_t at = t * K + (2 * p + s) * kBlockSize;
        d[s] = split_block(x + at, q[0][s], q[1][s]);
        if (remainder == nullptr) continue;
        for (int j = 0; j < kBlockSize; ++j) {
          remainder[at + j] = std::fma(-static_cast<float>(256 * q[0][s][j] + q[1][s][j]),
                                       d[s] / 256.f, x[at + j]);
        }
      }
      // Where each 16 bytes of BlockPair::q come from: (block, first value).
      constexpr int kGroups[2][4][2] = {{{0, 0}, {0, 16}, {1, 0}, {1, 16}},
                                        {{0, 0}, {1, 0}, {0, 16}, {1, 16}}};
      const auto& groups = kGroups[interleaved_pairs(f) ? 1 : 0];
      BlockPair& o = out[t * pairs + p];
      for (int quarter = 0; quarter < 4; ++quarter) {
        o.total[quarter] = 0;
        for (int j = 16 * (quarter % 2); j < 16 * (quarter % 2) + 16; ++j) {
          o.total[quarter] += 256 * q[0][quarter / 2][j] + q[1][quarter / 2][j];
        }
      }
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
        o.off[l] = zero * sum;
        o.sum[l] = o.unit[l] * static_cast<float>(sum);
      }
    }
  }
}

// x [T, K] (K a multiple of 32) as 2T tokens of block pairs for a call that refuses int8
// rounding: token 2t is x[t] split as quantize_activations splits it, token 2t + 1 the remainder
// of that split, split again, so that the two together stand for x[t] within
// max |x| / (65024 * 65024) of each block, finer than float32's rounding of it.
inline void quantize_activations_fine(Format f, const float* x, int64_t T, int64_t K,
                                      BlockPair* out) {
  const int64_t pairs = (K / kBlockSize + 1) / 2;
  std::vector<float> remainder(K);
  for (int64_t t = 0; t < T; ++t) {
    quantize_activations(f, x + t * K, 1, K, out + 2 * t * pairs, remainder.data());
    quantize_activations(f, remainder.data(), 1, K, out + (2 * t + 1) * pairs);
  }
}

// Per lane, the scale (and min) of its block: the fp16 d (and m) of a pair of 32-weight blocks,
// h0 | h1 << 16 (q8_0, q4_0, q5_0) or d0 | m0 << 16 | d1 << 32 | m1 << 48 (q4_1, q5_1, q8_m),
// spread over the lanes of each block.
template <Format F>
inline void spread_scales(uint64_t halves_bits, __m512& d, __m512& m) {
  const __m512 halves =
      _mm512_castps128_ps512(_mm_cvtph_ps(_mm_cvtsi64_si128(static_cast<int64_t>(halves_bits))));
  if constexpr (!interleaved_pairs(F) && has_min(F)) {
    d = _mm512_permutexvar_ps(_mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 2, 2, 2, 2, 2, 2, 2, 2),
                              halves);
    m = _mm512_permutexvar_ps(_mm512_setr_epi32(1, 1, 1, 1, 1, 1, 1, 1, 3, 3, 3, 3, 3, 3, 3, 3),
                              halves);
  } else if constexpr (!interleaved_pairs(F)) {
    d = _mm512_permutexvar_ps(_mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1),
                              halves);
  } else if constexpr (!has_min(F)) {
    d = _mm512_permutexvar_ps(_mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 0, 0, 0, 0, 1, 1, 1, 1),
                              halves);
  } else {
    d = _mm512_permutexvar_ps(_mm512_setr_epi32(0, 0, 0, 0, 2, 2, 2, 2, 0, 0, 0, 0, 2, 2, 2, 2),
                              halves);
    m = _mm512_permutexvar_ps(_mm512_setr_epi32(1, 1, 1, 1, 3, 3, 3, 3, 1, 1, 1, 1, 3, 3, 3, 3),
                              halves);
  }
}

// Bytes [0, 32) of v's low nibbles, then [32, 64) of its high nibbles.
inline __m512i split_nibbles(__m256i v) {
  const __m256i low = _mm256_set1_epi8(15);
  return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_and_si256(v, low)),
                            _mm256_and_si256(_mm256_srli_epi16(v, 4), low), 1);
}

constexpr bool has_packed_scales(Format f) { return f == Format::kQ4_K || f == Format::kQ5_K; }

// A q4_K / q5_K super-block's eight sub-block scales times d (lanes 0-7) and mins times -dmin
// (lanes 8-15), each product exact as ggml-quants.c computes it: unpacked once per super-block
// (get_scale_min_k4's fields, in ggml's AVX2 kernel's word arithmetic) for its four pairs.
inline __m512 packed_scales(const uint8_t* block) {
  constexpr uint32_t kLow6 = 0x3f3f3f3f, kLow4 = 0x0f0f0f0f, kLow2 = 0x03030303;
  uint32_t w[3];
  std::memcpy(w, block + 4, sizeof(w));
  const uint32_t scales_hi = (w[2] & kLow4) | (((w[0] >> 6) & kLow2) << 4);
  const uint32_t mins_hi = ((w[2] >> 4) & kLow4) | (((w[1] >> 6) & kLow2) << 4);
  const __m128i fields = _mm_setr_epi32(static_cast<int>(w[0] & kLow6),
                                        static_cast<int>(scales_hi),
                                        static_cast<int>(w[1] & kLow6), static_cast<int>(mins_hi));
  const __m512 factor = _mm512_mask_blend_ps(
      0xFF00, _mm512_set1_ps(_cvtsh_ss(load_u16(block))),
      _mm512_set1_ps(-_cvtsh_ss(load_u16(block + 2))));
  return _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(fields)), factor);
}

// Pair p of a row of w (blocks 2p and 2p + 1 of 32 weights; blocks: the row's count) as 64
// unsigned quants in BlockPair's order, and per lane their block's scale d and min m (has_min).
// Each lane's scale is computed as ggml-quants.c computes it (a K-quant's d times its sub-block
// scale, exact in float32); q4_K and q5_K take theirs from packed (packed_scales of the pair's
// super-block).
template <Format F>
inline void weight_pair(const uint8_t* row, int64_t p, int64_t blocks, const __m512& packed,
                        __m512i& bytes, __m512& d, __m512& m) {
  if constexpr (is_k_quant(F)) {
    // Sub-blocks 2j and 2j + 1 of super-block p / 4.
    const uint8_t* block = row + p / 4 * block_bytes(F);
    const int j = static_cast<int>(p % 4);
    if constexpr (F == Format::kQ6_K) {
      const float block_d = _cvtsh_ss(load_u16(block + 208));
      // Sub-block 2j reads the first and 2j + 1 the second 32 bytes of ql[64 (j / 2) ...], the
      // low nibbles for j even, then qh[32 (j / 2) ...]'s bits 4 (j % 2) (2j) and 4 (j % 2) + 2.
      const uint8_t* ql = block + 64 * (j / 2);
      const __m256i qh =
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 128 + 32 * (j / 2)));
      const int shift = 4 * (j % 2);
      const __m512i nibbles = _mm512_and_si512(
          _mm512_srl_epi16(_mm512_loadu_si512(ql), _mm_cvtsi32_si128(shift)),
          _mm512_set1_epi8(15));
      const __m512i high_bits = _mm512_srlv_epi16(
          _mm512_inserti64x4(_mm512_castsi256_si512(qh), qh, 1),
          _mm512_mask_blend_epi32(0xFF00, _mm512_set1_epi16(static_cast<int16_t>(shift)),
                                  _mm512_set1_epi16(static_cast<int16_t>(shift + 2))));
      bytes = _mm512_or_si512(
          nibbles, _mm512_slli_epi16(_mm512_and_si512(high_bits, _mm512_set1_epi8(3)), 4));
      // Lanes 4i to 4i + 3 are weights 16i to 16i + 15 of the pair: scales[4j + i].
      int32_t scales;
      std::memcpy(&scales, block + 192 + 4 * j, sizeof(scales));
      const __m512 four = _mm512_castps128_ps512(_mm_mul_ps(
          _mm_cvtepi32_ps(_mm_cvtepi8_epi32(_mm_cvtsi32_si128(scales))), _mm_set1_ps(block_d)));
      d = _mm512_permutexvar_ps(
          _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3), four);
    } else {
      const int64_t qs_at = F == Format::kQ5_K ? 48 : 16;
      bytes = split_nibbles(
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + qs_at + 32 * j)));
      if constexpr (F == Format::kQ5_K) {
        // Bit s of qh[l] is bit 4 of sub-block s's weight l.
        const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 16));
        const __m256i one = _mm256_set1_epi8(1);
        const __m256i b0 = _mm256_and_si256(_mm256_srl_epi16(qh, _mm_cvtsi32_si128(2 * j)), one);
        const __m256i b1 =
            _mm256_and_si256(_mm256_srl_epi16(qh, _mm_cvtsi32_si128(2 * j + 1)), one);
        bytes = _mm512_or_si512(
            bytes, _mm512_slli_epi16(
                       _mm512_inserti64x4(_mm512_castsi256_si512(b0), b1, 1), 4));
      }
      // Lanes 0-7 take sub-block 2j's scale and min, lanes 8-15 sub-block 2j + 1's.
      const __m512i sub_block = _mm512_mask_blend_epi32(0xFF00, _mm512_set1_epi32(2 * j),
                                                        _mm512_set1_epi32(2 * j + 1));
      d = _mm512_permutexvar_ps(sub_block, packed);
      m = _mm512_permutexvar_ps(_mm512_add_epi32(sub_block, _mm512_set1_epi32(8)), packed);
    }
  } else {
    const bool both = 2 * p + 1 < blocks;
    const uint8_t* b0 = row + 2 * p * block_bytes(F);
    const uint8_t* b1 = b0 + block_bytes(F);
    // d0, m0, d1, m1 (with a min) or d0, d1: the first bytes of each block.
    constexpr int kHalves = has_min(F) ? 4 : 2;
    uint32_t h0 = 0, h1 = 0;
    std::memcpy(&h0, b0, kHalves);
    if (both) std::memcpy(&h1, b1, kHalves);
    spread_scales<F>(has_min(F) ? h0 | uint64_t{h1} << 32 : h0 | uint64_t{h1} << 16, d, m);
    if constexpr (F == Format::kQ8_0 || F == Format::kQ8_M) {
      constexpr int64_t kQs = F == Format::kQ8_0 ? 2 : 4;
      const __m256i lo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b0 + kQs));
      const __m256i hi = both ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b1 + kQs))
                              : _mm256_setzero_si256();
      bytes = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
      // q8_0: int8 + 128 as uint8 (vpdpbusd's unsigned operand); BlockPair::off takes the 128
      // back.
      if constexpr (F == Format::kQ8_0) {
        bytes = _mm512_xor_si512(bytes, _mm512_set1_epi8(static_cast<char>(0x80)));
      }
    } else {
      // q5: the 32 high bits after the scales, then the nibbles.
      constexpr int64_t kQh = has_min(F) ? 4 : 2;
      constexpr bool kQ5 = F == Format::kQ5_0 || F == Format::kQ5_1;
      constexpr int64_t kQs = kQ5 ? kQh + 4 : kQh;
      // [b0's 16 bytes | b1's | b0's | b1's] by broadcast loads (load ports, not the shuffle
      // port the dot's scales already keep busy), then the upper half's high nibbles.
      const auto* q0 = reinterpret_cast<const __m128i*>(b0 + kQs);
      const auto* q1 = reinterpret_cast<const __m128i*>(b1 + kQs);
      __m512i v = _mm512_broadcast_i32x4(_mm_loadu_si128(q0));
      v = both ? _mm512_mask_broadcast_i32x4(v, 0xF0F0, _mm_loadu_si128(q1))
               : _mm512_maskz_mov_epi32(0x0F0F, v);
      bytes = _mm512_and_si512(_mm512_mask_srli_epi16(v, 0xFFFF0000u, v, 4),
                               _mm512_set1_epi8(15));
      if constexpr (kQ5) {
        // Bit i of qh is bit 4 of weight i, in the bytes' order: b0's and b1's weights 0-15,
        // then their weights 16-31.
        uint32_t qh0 = 0, qh1 = 0;
        std::memcpy(&qh0, b0 + kQh, sizeof(qh0));
        if (both) std::memcpy(&qh1, b1 + kQh, sizeof(qh1));
        const uint64_t mask = (qh0 & 0xFFFFu) | uint64_t{qh1 & 0xFFFFu} << 16 |
                              uint64_t{qh0 >> 16} << 32 | uint64_t{qh1 >> 16} << 48;
        bytes = _mm512_or_si512(bytes, _mm512_maskz_mov_epi8(mask, _mm512_set1_epi8(16)));
      }
    }
  }
}

// Rows [0, kRows) of w against kT tokens' block pairs x: y[t * y_stride + r].
template <Format F, int kT, int kRows>
inline void dot_row_group(const BlockPair* x, int64_t K, const uint8_t* w, int64_t row_bytes,
                          float* y, int64_t y_stride) {
  const int64_t blocks = K / kBlockSize, pairs = (blocks + 1) / 2;
  const int64_t pair_bytes = row_bytes / pairs;  // about: for the prefetch only
  __m512 acc[kRows][kT];
  for (auto& per_row : acc) {
    for (auto& a : per_row) a = _mm512_setzero_ps();
  }
  __m512 packed[kRows] = {};  // q4_K / q5_K: each row's packed_scales of the super-block
  for (int64_t p = 0; p < pairs; ++p) {
#pragma GCC unroll 4
    for (int r = 0; r < kRows; ++r) {
      const uint8_t* row = w + r * row_bytes;
      prefetch_weights_ahead(row + p * pair_bytes);
      if constexpr (has_packed_scales(F)) {
        if (p % 4 == 0) packed[r] = packed_scales(row + p / 4 * block_bytes(F));
      }
      __m512i bytes;
      __m512 d, m;
      weight_pair<F>(row, p, blocks, packed[r], bytes, d, m);
#pragma GCC unroll 8
      for (int t = 0; t < kT; ++t) {
        const BlockPair& xp = x[t * pairs + p];
        const __m512i hi = _mm512_dpbusd_epi32(_mm512_setzero_si512(), bytes,
                                               _mm512_loadu_si512(xp.q));
        __m512i dot = _mm512_dpbusd_epi32(_mm512_slli_epi32(hi, 8), bytes,
                                          _mm512_loadu_si512(xp.q_lo));
        if constexpr (quant_zero(F) != 0) dot = _mm512_sub_epi32(dot, _mm512_loadu_si512(xp.off));
        acc[r][t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot),
                                    _mm512_mul_ps(d, _mm512_loadu_ps(xp.unit)), acc[r][t]);
        if constexpr (has_min(F)) {
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
  const int64_t row_bytes = quant::row_bytes(F, K);
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

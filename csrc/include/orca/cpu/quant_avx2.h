// The quantized linear's AVX2 path (8-float vectors, FMA, F16C), compiled through a target
// pragma so that a baseline build carries it and picks it at run time.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "orca/cpu/quant_formats.h"
#include "orca/cpu/quant_prefetch.h"

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")

namespace orca::cpu::quant::avx2 {

// Byte j of the result: `value` where bit j of `bits` is set, else 0.
inline __m256i bits_to_bytes(uint32_t bits, char value) {
  // Byte j takes byte j / 8 of bits, then tests its bit j % 8.
  const __m256i spread = _mm256_shuffle_epi8(
      _mm256_set1_epi32(static_cast<int>(bits)),
      _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 3,
                       3, 3, 3, 3, 3, 3, 3));
  const __m256i bit = _mm256_set1_epi64x(static_cast<int64_t>(0x8040201008040201));
  const __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit);
  return _mm256_and_si256(set, _mm256_set1_epi8(value));
}

// The bytes at p shifted right by `shift` bits, masked to `mask` (per byte).
inline __m256i shifted_bytes(const uint8_t* p, int shift, char mask) {
  const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm256_and_si256(_mm256_srl_epi16(bytes, _mm_cvtsi32_si128(shift)),
                          _mm256_set1_epi8(mask));
}

// chunk_quants' 32 quants of chunk c of a row as bytes (also used by the AVX-512 path).
template <Format F>
inline __m256i chunk_quant_bytes(const uint8_t* row, int64_t c) {
  static_assert(!has_own_dequant(F));
  if constexpr (F == Format::kQ8_M) {
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + c * block_bytes(F) + 4));
  } else if constexpr (F == Format::kQ5_0 || F == Format::kQ5_1) {
    const Q5Quants fields = q5_quants<F>(row + c * block_bytes(F));
    const __m128i qs = _mm_loadu_si128(reinterpret_cast<const __m128i*>(fields.nibbles));
    const __m256i nibbles = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(qs, 4), qs),
                                             _mm256_set1_epi8(15));
    return _mm256_or_si256(nibbles, bits_to_bytes(fields.high_bits, 16));
  } else {
    const uint8_t* block = row + c / 8 * block_bytes(F);
    const int s = static_cast<int>(c % 8);
    if constexpr (F == Format::kQ6_K) {
      const __m256i low = shifted_bytes(block + 64 * (s / 4) + 32 * (s % 2), 4 * (s % 4 / 2), 15);
      const __m256i high = shifted_bytes(block + 128 + 32 * (s / 4), 2 * (s % 4), 3);
      return _mm256_or_si256(low, _mm256_slli_epi16(high, 4));
    } else {
      __m256i q =
          shifted_bytes(block + (F == Format::kQ5_K ? 48 : 16) + 32 * (s / 2), 4 * (s % 2), 15);
      if constexpr (F == Format::kQ5_K) {
        q = _mm256_or_si256(q, _mm256_slli_epi16(shifted_bytes(block + 16, s, 1), 4));
      }
      return q;
    }
  }
}

struct Vec {
  using V = __m256;
  static constexpr int kWidth = 8;
  static constexpr int kChainTarget = 4;
  // 16 registers: two rows side by side for one token (8 weight vectors, 4 accumulators).
  static constexpr int rows_for(int kT) { return kT == 1 ? 2 : 1; }
  static V zero() { return _mm256_setzero_ps(); }
  static V load(const float* p) { return _mm256_loadu_ps(p); }
  static void store(float* p, V v) { _mm256_storeu_ps(p, v); }
  static void store_bf16(uint16_t* p, V v) {
    float values[kWidth];
    _mm256_storeu_ps(values, v);
    for (int j = 0; j < kWidth; ++j) p[j] = float_to_bf16(values[j]);
  }
  static V add(V a, V b) { return _mm256_add_ps(a, b); }
  static V fmadd(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
  static float hsum(V v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
  }
  // The fp16 at p in all lanes: broadcast as fp16, then widened.
  static V broadcast_half(const uint8_t* p) {
    return _mm256_cvtph_ps(_mm_set1_epi16(static_cast<short>(load_u16(p))));
  }
  static V to_float(__m128i bytes8, bool is_signed) {
    return _mm256_cvtepi32_ps(is_signed ? _mm256_cvtepi8_epi32(bytes8)
                                        : _mm256_cvtepu8_epi32(bytes8));
  }

  // Chunk c (32 weights) of a row of F's blocks.
  template <Format F>
  static void dequant(const uint8_t* row, int64_t c, V (&w)[4]) {
    if constexpr (has_own_dequant(F)) {
      const uint8_t* block = row + c * block_bytes(F);
      const V d = broadcast_half(block);
      const uint8_t* qs = block + quants_offset(F);
      if constexpr (F == Format::kQ8_0) {
        for (int i = 0; i < 4; ++i) {
          const __m128i q = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(qs + 8 * i));
          w[i] = _mm256_mul_ps(to_float(q, true), d);
        }
      } else {
        const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs));
        const __m128i mask = _mm_set1_epi8(15);
        const __m128i lo = _mm_and_si128(q, mask), hi = _mm_and_si128(_mm_srli_epi16(q, 4), mask);
        // q4_0 subtracts 8 from each nibble; q4_1 adds its fp16 offset m.
        const V m = F == Format::kQ4_1 ? broadcast_half(block + 2)
                                       : _mm256_mul_ps(d, _mm256_set1_ps(-8.f));
        const __m128i parts[4] = {lo, _mm_srli_si128(lo, 8), hi, _mm_srli_si128(hi, 8)};
        for (int i = 0; i < 4; ++i) w[i] = _mm256_fmadd_ps(to_float(parts[i], false), d, m);
      }
    } else {
      const ChunkScale s = chunk_scale<F>(row, c, [](uint16_t h) { return _cvtsh_ss(h); });
      const __m256i q = chunk_quant_bytes<F>(row, c);
      const __m128i halves[2] = {_mm256_castsi256_si128(q), _mm256_extracti128_si256(q, 1)};
      for (int i = 0; i < 4; ++i) {
        const __m128i part = i % 2 ? _mm_srli_si128(halves[i / 2], 8) : halves[i / 2];
        w[i] = _mm256_fmadd_ps(to_float(part, false), _mm256_set1_ps(s.scale[i / 2]),
                               _mm256_set1_ps(s.offset[i / 2]));
      }
    }
  }
};

#include "orca/cpu/quant_kernel.h"

}  // namespace orca::cpu::quant::avx2

#pragma GCC pop_options

// The quantized linear's AVX2 path (8-float vectors, FMA, F16C), compiled through a target
// pragma so that a baseline build carries it and picks it at run time.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "orca/cpu/quant_formats.h"

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")

namespace orca::cpu::quant::avx2 {

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

  template <Format F>
  static void dequant(const uint8_t* block, V (&w)[4]) {
    const V d = broadcast_half(block);
    const uint8_t* qs = block + quants_offset(F);
    if constexpr (F == Format::kQ8_0) {
      for (int c = 0; c < 4; ++c) {
        const __m128i q = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(qs + 8 * c));
        w[c] = _mm256_mul_ps(to_float(q, true), d);
      }
    } else {
      const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs));
      const __m128i mask = _mm_set1_epi8(15);
      const __m128i lo = _mm_and_si128(q, mask), hi = _mm_and_si128(_mm_srli_epi16(q, 4), mask);
      // q4_0 subtracts 8 from each nibble; q4_1 adds its fp16 offset m.
      const V m = F == Format::kQ4_1 ? broadcast_half(block + 2)
                                     : _mm256_mul_ps(d, _mm256_set1_ps(-8.f));
      const __m128i parts[4] = {lo, _mm_srli_si128(lo, 8), hi, _mm_srli_si128(hi, 8)};
      for (int c = 0; c < 4; ++c) w[c] = _mm256_fmadd_ps(to_float(parts[c], false), d, m);
    }
  }
};

#include "orca/cpu/quant_kernel.h"

}  // namespace orca::cpu::quant::avx2

#pragma GCC pop_options

// The int8 KV cache's rows (kv_cache_dtype "int8"): each (token, KV head) row of K or V is D
// int8 values q then the row's float32 scale s (4 bytes, unaligned), x = q * s, with
// s = max |x| / 127 and q = x / s rounded to nearest even (llama.cpp's q8_0 rule, over the
// head's D values instead of blocks of 32).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

#include "orca/cpu/vec.h"

namespace orca::cpu {

// Bytes of an int8 row after its D values: the row's float32 scale.
constexpr int64_t kInt8ScaleBytes = 4;

inline float int8_row_scale(const int8_t* row, int64_t D) {
  float scale;
  std::memcpy(&scale, row + D, sizeof(scale));
  return scale;
}

// x [D] (any float type) quantized into the int8 row out [D + 4].
template <typename scalar_t>
inline void quantize_kv_row(const scalar_t* x, int64_t D, int8_t* out) {
  float amax = 0.f;
  for (int64_t d = 0; d < D; ++d) amax = std::max(amax, std::fabs(static_cast<float>(x[d])));
  const float scale = amax / 127.f;
  for (int64_t d = 0; d < D; ++d) {
    const float q = scale > 0.f ? std::nearbyint(static_cast<float>(x[d]) / scale) : 0.f;
    out[d] = static_cast<int8_t>(std::clamp(q, -127.f, 127.f));
  }
  std::memcpy(out + D, &scale, sizeof(scale));
}

// 16 int8 values widened to float32 (sign-extend and convert: GCC scalarizes the generic
// vector conversion).
inline vec16 load16_int8(const int8_t* p) {
#if defined(__AVX512F__)
  const __m512 v = _mm512_cvtepi32_ps(
      _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  return reinterpret_cast<const vec16&>(v);
#elif defined(__AVX2__)
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  alignas(64) float out[16];
  _mm256_store_ps(out, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes)));
  _mm256_store_ps(out + 8, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(bytes, 8))));
  return load16(out);
#else
  float out[16];
  for (int i = 0; i < 16; ++i) out[i] = static_cast<float>(p[i]);
  return load16(out);
#endif
}

}  // namespace orca::cpu

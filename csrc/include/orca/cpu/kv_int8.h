// The int8 KV cache's rows (kv_cache_dtype "int8"): each (token, KV head) row of K or V is D
// int8 values q then the row's float32 scale s (4 bytes, unaligned), y = q * s, with
// s = max |y| / 127 and q = y / s rounded to nearest even (llama.cpp's q8_0 rule, over the
// head's D values instead of blocks of 32). V rows hold y = v; K rows hold y = H k, H the
// Walsh-Hadamard transform (orthonormal, its own inverse) over blocks of the largest power of
// two dividing D: it spreads a key's outlier channels over its block, so the other channels
// get finer steps, and attention takes q . k = (H q) . (H k) with the query rotated instead.
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
// The most values an int8 row holds (ragged_attention's head_dim limit).
constexpr int64_t kInt8MaxHeadDim = 256;

// x [D] replaced by H' x per block of b values (b = D & -D), H' the Walsh-Hadamard matrix of
// entries +-1 (butterflies of sums and differences); returns 1 / sqrt(b), which makes it H.
inline float hadamard_unnormalized(float* x, int64_t D) {
  const int64_t b = D & -D;
  for (int64_t block = 0; block < D; block += b) {
    for (int64_t h = 1; h < b; h *= 2) {
      for (int64_t i = block; i < block + b; i += 2 * h) {
        for (int64_t j = i; j < i + h; ++j) {
          const float u = x[j], v = x[j + h];
          x[j] = u + v;
          x[j + h] = u - v;
        }
      }
    }
  }
  return 1.f / std::sqrt(static_cast<float>(b));
}

// A query row q [D] (float32) rotated in place to H q, as the int8 cache's keys are.
inline void rotate_query(float* q, int64_t D) {
  const float norm = hadamard_unnormalized(q, D);
  for (int64_t d = 0; d < D; ++d) q[d] *= norm;
}

inline float int8_row_scale(const int8_t* row, int64_t D) {
  float scale;
  std::memcpy(&scale, row + D, sizeof(scale));
  return scale;
}

// x [D] (any float type, D <= kInt8MaxHeadDim) quantized into the int8 row out [D + 4]; a key
// (rotate) as H x: H' x quantized, its scale times 1 / sqrt(b).
template <typename scalar_t>
inline void quantize_kv_row(const scalar_t* x, int64_t D, int8_t* out, bool rotate) {
  float y[kInt8MaxHeadDim];
  for (int64_t d = 0; d < D; ++d) y[d] = static_cast<float>(x[d]);
  const float norm = rotate ? hadamard_unnormalized(y, D) : 1.f;
  float amax = 0.f;
  for (int64_t d = 0; d < D; ++d) amax = std::max(amax, std::fabs(y[d]));
  const float scale = amax / 127.f;
  for (int64_t d = 0; d < D; ++d) {
    const float q = scale > 0.f ? std::nearbyint(y[d] / scale) : 0.f;
    out[d] = static_cast<int8_t>(std::clamp(q, -127.f, 127.f));
  }
  const float stored = scale * norm;
  std::memcpy(out + D, &stored, sizeof(stored));
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

// The int8 KV cache's rows (kv_cache_dtype "int8"): each (token, KV head) row of K or V is D
// int8 values q then the row's float32 scale s (4 bytes, unaligned), x = q * s, with
// s = max |x| / 127 and q = x / s rounded to nearest even (llama.cpp's q8_0 rule, over the
// head's D values instead of blocks of 32).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

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

// 16 int8 values widened to float32.
inline vec16 load16_int8(const int8_t* p) {
  typedef int8_t int8x16 __attribute__((vector_size(16)));
  int8x16 v;
  std::memcpy(&v, p, sizeof(v));
  return __builtin_convertvector(v, vec16);
}

}  // namespace orca::cpu

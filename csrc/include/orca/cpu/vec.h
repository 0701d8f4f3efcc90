// 16-float vectors through the GCC/Clang vector extension: one AVX-512 register, or two
// AVX2 ones; the compiler picks the instructions for the -march it builds for.
#pragma once

#include <cstring>
#include <type_traits>

namespace orca::cpu {

typedef float vec16 __attribute__((vector_size(64)));

inline vec16 load16(const float* p) {
  vec16 v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

inline void store16(float* p, vec16 v) { std::memcpy(p, &v, sizeof(v)); }

// 16 elements of any float type, widened to float32.
template <typename scalar_t>
inline vec16 load16_as_float(const scalar_t* p) {
  if constexpr (std::is_same_v<scalar_t, float>) {
    return load16(p);
  } else {
    float tmp[16];
    for (int i = 0; i < 16; ++i) tmp[i] = static_cast<float>(p[i]);
    return load16(tmp);
  }
}

inline float hsum(vec16 v) {
  float t[16];
  store16(t, v);
  float s = 0.f;
  for (int i = 0; i < 16; ++i) s += t[i];
  return s;
}

}  // namespace orca::cpu

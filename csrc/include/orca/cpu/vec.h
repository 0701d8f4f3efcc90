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

typedef int int16v __attribute__((vector_size(64)));

// Pins a loaded vector to a register. Where registers look scarce GCC re-loads a vector from
// memory at each use instead: the skinny kernel loaded every weight vector once per token
// (GCC 12 at -march=native on Zen 4, 4 tokens: 16 loads of the 4 weight vectors a step needs).
template <typename V>
inline void keep_in_register(V& v) {
#if defined(__AVX512F__)
  asm("" : "+v"(v));
#else
  (void)v;  // 64-byte vectors are register pairs without AVX-512: nothing to pin
#endif
}

// Sum of the 16 lanes by halving folds (4 shuffles + 4 adds, no round trip through memory).
inline float hsum(vec16 v) {
#if defined(__clang__)
  v += __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7);
  v += __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11);
  v += __builtin_shufflevector(v, v, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13);
  v += __builtin_shufflevector(v, v, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14);
#else
  v += __builtin_shuffle(v, int16v{8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7});
  v += __builtin_shuffle(v, int16v{4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11});
  v += __builtin_shuffle(v, int16v{2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13});
  v += __builtin_shuffle(v, int16v{1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14});
#endif
  return v[0];
}

}  // namespace orca::cpu

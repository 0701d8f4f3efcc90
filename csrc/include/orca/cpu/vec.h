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

// Lanes of the concatenation a:b (indices 0-31) picked by the 16 indices.
#if defined(__clang__)
#define ORCA_SHUFFLE2(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
#else
#define ORCA_SHUFFLE2(a, b, ...) __builtin_shuffle(a, b, int16v{__VA_ARGS__})
#endif
#define ORCA_SHUFFLE(v, ...) ORCA_SHUFFLE2(v, v, __VA_ARGS__)

// The 16 lanes folded with `op` by halving (4 shuffles + 4 ops, no round trip through memory).
template <typename Op>
inline float fold16(vec16 v, Op op) {
  v = op(v, ORCA_SHUFFLE(v, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7));
  v = op(v, ORCA_SHUFFLE(v, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11));
  v = op(v, ORCA_SHUFFLE(v, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13));
  v = op(v, ORCA_SHUFFLE(v, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14));
  return v[0];
}

inline float hsum(vec16 v) { return fold16(v, [](vec16 a, vec16 b) { return a + b; }); }
inline float hmax(vec16 v) { return fold16(v, [](vec16 a, vec16 b) { return a > b ? a : b; }); }

// The lane sums of a and b together: one fold of both into one vector, then three.
inline void hsum2(vec16 a, vec16 b, float& sum_a, float& sum_b) {
  vec16 v = ORCA_SHUFFLE2(a, b, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
            ORCA_SHUFFLE2(a, b, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  v += ORCA_SHUFFLE(v, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11);
  v += ORCA_SHUFFLE(v, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13);
  v += ORCA_SHUFFLE(v, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14);
  sum_a = v[0];
  sum_b = v[8];
}

// Lane j of the result: the sum of v[j]'s 16 lanes. Four rounds of pairwise shuffles and adds
// (45 instructions) instead of 16 separate folds (128).
inline vec16 hsum16(const vec16 (&v)[16]) {
  vec16 w[8], x[4], y[2];
  for (int i = 0; i < 8; ++i) {  // lanes 0-7: v[2i]'s halves summed, 8-15: v[2i + 1]'s
    w[i] = ORCA_SHUFFLE2(v[2 * i], v[2 * i + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20,
                         21, 22, 23) +
           ORCA_SHUFFLE2(v[2 * i], v[2 * i + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27,
                         28, 29, 30, 31);
  }
  for (int i = 0; i < 4; ++i) {  // quarters: v[4i], v[4i + 2], v[4i + 1], v[4i + 3]
    x[i] = ORCA_SHUFFLE2(w[2 * i], w[2 * i + 1], 0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24,
                         25, 26, 27) +
           ORCA_SHUFFLE2(w[2 * i], w[2 * i + 1], 4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28,
                         29, 30, 31);
  }
  for (int i = 0; i < 2; ++i) {  // lane pairs: v[8i + 0, 4, 2, 6, 1, 5, 3, 7]
    y[i] = ORCA_SHUFFLE2(x[2 * i], x[2 * i + 1], 0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12,
                         13, 28, 29) +
           ORCA_SHUFFLE2(x[2 * i], x[2 * i + 1], 2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14,
                         15, 30, 31);
  }
  // Lane j now holds the sum of v[bit-reversed j]; the last shuffle puts them in order.
  const vec16 z = ORCA_SHUFFLE2(y[0], y[1], 0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28,
                                14, 30) +
                  ORCA_SHUFFLE2(y[0], y[1], 1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29,
                                15, 31);
  return ORCA_SHUFFLE(z, 0, 8, 4, 12, 2, 10, 6, 14, 1, 9, 5, 13, 3, 11, 7, 15);
}

}  // namespace orca::cpu

// Torch-free math for the CPU kernels, written so that GCC/Clang vectorize loops that call
// it (no libm calls, no branches): exp (also on vec16), and the fused activations built on it.
#pragma once

#include <bit>
#include <cstdint>

#include "orca/cpu/vec.h"

namespace orca::cpu {

// 2^n for a float n holding an integer in [-126, 127], by building the exponent bits.
inline float exp2_int(float n) {
  return std::bit_cast<float>((static_cast<int32_t>(n) + 127) << 23);
}
inline vec16 exp2_int(vec16 n) {
  return reinterpret_cast<vec16>((__builtin_convertvector(n, int16v) + 127) << 23);
}

// exp(x) with ~2 ulp error on [-87, 88], for a float or element-wise for a vec16 (same
// instructions either way); -inf maps to ~1e-38, so callers that need an exact 0 select it.
// Range reduction to 2^n * exp(r), |r| <= ln2/2, then a degree-6 polynomial.
template <typename F>
inline F fast_exp(F x) {
  const F lo = F{} - 87.0f, hi = F{} + 88.0f;
  x = x < lo ? lo : (x > hi ? hi : x);
  // Round to nearest by the 1.5 * 2^23 trick: plain float adds vectorize, roundf does not.
  const F n = (x * 1.44269504089f + 12582912.0f) - 12582912.0f;
  F r = x - n * 0.693145751953125f;
  r -= n * 1.428606765330187e-06f;
  F p = F{} + 1.3888949e-3f;
  p = p * r + 8.3333337e-3f;
  p = p * r + 4.1666645e-2f;
  p = p * r + 1.6666666e-1f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  return p * exp2_int(n);
}

// x * sigmoid(x)
inline float silu(float x) { return x / (1.0f + fast_exp(-x)); }

// 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))) == x * sigmoid(2u)
inline float gelu_tanh(float x) {
  const float u = 0.7978845608028654f * (x + 0.044715f * x * x * x);
  return x / (1.0f + fast_exp(-2.0f * u));
}

inline float relu(float x) { return x > 0.0f ? x : 0.0f; }

}  // namespace orca::cpu

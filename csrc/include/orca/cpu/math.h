// Torch-free scalar math for the CPU kernels, written so that GCC/Clang vectorize loops that
// call it (no libm calls, no branches): exp, and the fused activations built on it.
#pragma once

#include <bit>
#include <cstdint>

namespace orca::cpu {

// exp(x) with ~2 ulp error on [-87, 88]; -inf maps to 0. Range reduction to
// 2^n * exp(r), |r| <= ln2/2, then a degree-6 polynomial.
inline float fast_exp(float x) {
  x = x < -87.0f ? -87.0f : (x > 88.0f ? 88.0f : x);
  // Round to nearest by the 1.5 * 2^23 trick: plain float adds vectorize, roundf does not.
  const float n = (x * 1.44269504089f + 12582912.0f) - 12582912.0f;
  float r = x - n * 0.693145751953125f;
  r -= n * 1.428606765330187e-06f;
  float p = 1.3888949e-3f;
  p = p * r + 8.3333337e-3f;
  p = p * r + 4.1666645e-2f;
  p = p * r + 1.6666666e-1f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  return p * std::bit_cast<float>(bits);
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

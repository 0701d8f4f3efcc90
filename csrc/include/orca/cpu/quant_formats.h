// Torch-free definitions of the GGUF (ggml) weight blocks quantized_linear reads, exactly as
// llama.cpp's ggml-common.h lays them out: 32 weights per block, little-endian fields.
// - q8_0: fp16 d, int8 qs[32]; w[j] = qs[j] * d (34 bytes).
// - q4_0: fp16 d, uint8 qs[16]; w[j] = ((qs[j] & 15) - 8) * d, w[j + 16] = ((qs[j] >> 4) - 8) * d
//   (18 bytes).
// - q4_1: fp16 d, fp16 m, uint8 qs[16]; w[j] = (qs[j] & 15) * d + m, w[j + 16] = (qs[j] >> 4) *
//   d + m (20 bytes).
// The products q * d are exact in float32 (at most 8 + 11 significant bits), so a float32
// dequantization equals gguf.quants.dequantize bit for bit.
#pragma once

#include <bit>
#include <cstdint>
#include <cstring>

namespace orca::cpu::quant {

enum class Format { kQ8_0, kQ4_0, kQ4_1 };

constexpr int64_t kBlockSize = 32;  // weights per block, in every format

constexpr int64_t block_bytes(Format f) {
  return f == Format::kQ8_0 ? 34 : f == Format::kQ4_0 ? 18 : 20;
}

// The first byte of a block's quants (after d, and m for q4_1).
constexpr int64_t quants_offset(Format f) { return f == Format::kQ4_1 ? 4 : 2; }

inline uint16_t load_u16(const uint8_t* p) {
  uint16_t v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

// IEEE half to float, for the portable path (the vector paths use F16C's vcvtph2ps).
inline float half_to_float(uint16_t h) {
  const uint32_t sign = uint32_t{h & 0x8000u} << 16;
  const uint32_t exponent = (h >> 10) & 0x1f, mantissa = h & 0x3ffu;
  if (exponent == 0) {  // zero or subnormal: mantissa * 2^-24
    const float magnitude = static_cast<float>(mantissa) * 0x1p-24f;
    return sign ? -magnitude : magnitude;
  }
  const uint32_t bits = exponent == 0x1f ? sign | 0x7f800000u | (mantissa << 13)
                                         : sign | ((exponent + 112) << 23) | (mantissa << 13);
  return std::bit_cast<float>(bits);
}

// float to bfloat16 bits, rounded to nearest even as c10::BFloat16 rounds (NaN stays NaN).
inline uint16_t float_to_bf16(float f) {
  const uint32_t u = std::bit_cast<uint32_t>(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
  return static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

}  // namespace orca::cpu::quant

// Torch-free definitions of the GGUF (ggml) weight blocks quantized_linear reads, exactly as
// llama.cpp's ggml-common.h lays them out and ggml-quants.c's dequantize_row_* reads them
// (little-endian fields, fp16 scales).
// Blocks of 32 weights:
// - q8_0: fp16 d, int8 qs[32]; w[j] = qs[j] * d (34 bytes).
// - q4_0: fp16 d, uint8 qs[16]; w[j] = ((qs[j] & 15) - 8) * d, w[j + 16] = ((qs[j] >> 4) - 8) * d
//   (18 bytes).
// - q4_1: fp16 d, fp16 m, uint8 qs[16]; w[j] = (qs[j] & 15) * d + m, w[j + 16] = (qs[j] >> 4) *
//   d + m (20 bytes).
// - q5_0: fp16 d, uint32 qh, uint8 qs[16]; q4_0's nibbles with bit j of qh as bit 4 of weight
//   j, w[j] = (q[j] - 16) * d (22 bytes).
// - q5_1: fp16 d, fp16 m, uint32 qh, uint8 qs[16]; w[j] = q[j] * d + m, q[j] as q5_0's (24 bytes).
// - q8_m (orca's own, not a ggml type): fp16 d, fp16 m, uint8 qs[32]; w[j] = qs[j] * d + m (36
//   bytes). It holds every other 32-weight format's blocks exactly (q8_0 as int8 + 128 with
//   m = -128 d, q4_0 / q5_0 with m = -8 d / -16 d, q4_1 / q5_1 as they are): the loader's format
//   for a fused weight whose parts a GGUF file stores in different ones.
// Super-blocks of 256 weights, eight sub-blocks of 32 (six-bit scales sc and mins mn of the
// sub-blocks packed in 12 bytes as ggml's get_scale_min_k4 reads them):
// - q4_K: fp16 d, fp16 dmin, scales[12], qs[128]; sub-block s takes the low (s even) or high
//   nibbles of qs[32 (s / 2) ...], w = (d sc_s) q - dmin mn_s (144 bytes).
// - q5_K: fp16 d, fp16 dmin, scales[12], qh[32], qs[128]; q4_K with bit s of qh[l] as bit 4 of
//   sub-block s's weight l (176 bytes).
// - q6_K: ql[128], qh[64], int8 scales[16], fp16 d; 16 scales of 16 weights each, w = (d
//   scale) (q - 32), q 6 bits: four nibbles of ql and two bits of qh (210 bytes).
// Every product of a scale and a quant is exact in float32 (at most 24 significant bits: d's 11
// times q6_K's |scale q| <= 4096, or q4_K / q5_K's 6-bit sc times a 4- or 5-bit q), so a float32
// dequantization that rounds once after the product (the offset's add) equals
// gguf.quants.dequantize bit for bit, whichever order the products take.
#pragma once

#include <bit>
#include <cstdint>
#include <cstdlib>
#include <cstring>

namespace orca::cpu::quant {

enum class Format { kQ8_0, kQ4_0, kQ4_1, kQ5_0, kQ5_1, kQ8_M, kQ4_K, kQ5_K, kQ6_K };

// The kernels' unit of weights: a block of the 32-weight formats, a sub-block of the K-quants.
constexpr int64_t kBlockSize = 32;

constexpr bool is_k_quant(Format f) {
  return f == Format::kQ4_K || f == Format::kQ5_K || f == Format::kQ6_K;
}

// Weights per block (a K-quant's super-block): K must be a multiple of it.
constexpr int64_t weights_per_block(Format f) { return is_k_quant(f) ? 256 : kBlockSize; }

constexpr int64_t block_bytes(Format f) {
  switch (f) {
    case Format::kQ8_0: return 34;
    case Format::kQ4_0: return 18;
    case Format::kQ4_1: return 20;
    case Format::kQ5_0: return 22;
    case Format::kQ5_1: return 24;
    case Format::kQ8_M: return 36;
    case Format::kQ4_K: return 144;
    case Format::kQ5_K: return 176;
    case Format::kQ6_K: return 210;
  }
  return 0;
}

// The bytes of a row of K weights (K a multiple of weights_per_block(f)).
constexpr int64_t row_bytes(Format f, int64_t K) {
  return K / weights_per_block(f) * block_bytes(f);
}

// Whether the format's blocks are dequantized by their own code (q8_0, q4_0, q4_1); the others
// are read as unsigned quants times a scale plus an offset (chunk_scale, chunk_quants).
constexpr bool has_own_dequant(Format f) {
  return f == Format::kQ8_0 || f == Format::kQ4_0 || f == Format::kQ4_1;
}

// f.template operator()<F>() for the format.
template <typename Fn>
void dispatch_format(Format format, const Fn& f) {
  switch (format) {
    case Format::kQ8_0: return f.template operator()<Format::kQ8_0>();
    case Format::kQ4_0: return f.template operator()<Format::kQ4_0>();
    case Format::kQ4_1: return f.template operator()<Format::kQ4_1>();
    case Format::kQ5_0: return f.template operator()<Format::kQ5_0>();
    case Format::kQ5_1: return f.template operator()<Format::kQ5_1>();
    case Format::kQ8_M: return f.template operator()<Format::kQ8_M>();
    case Format::kQ4_K: return f.template operator()<Format::kQ4_K>();
    case Format::kQ5_K: return f.template operator()<Format::kQ5_K>();
    case Format::kQ6_K: return f.template operator()<Format::kQ6_K>();
  }
  std::abort();
}

// The first byte of a q8_0 / q4_0 / q4_1 block's quants (after d, and m for q4_1).
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

// The six-bit scale and min of sub-block s (0-7) of a q4_K / q5_K super-block, as ggml's
// get_scale_min_k4 unpacks them from the 12 bytes at `scales`.
inline void scale_min_k4(int s, const uint8_t* scales, int& scale, int& min) {
  if (s < 4) {
    scale = scales[s] & 63;
    min = scales[s + 4] & 63;
  } else {
    scale = (scales[s + 4] & 0xf) | ((scales[s - 4] >> 6) << 4);
    min = (scales[s + 4] >> 4) | ((scales[s] >> 6) << 4);
  }
}

// How chunk c (weights 32c to 32c + 31) of a row in a format without tile kernels is scaled:
// weight j is q[j] * scale[j / 16] + offset[j / 16], q its unsigned quant (chunk_quants).
struct ChunkScale {
  float scale[2];
  float offset[2];
};

// Chunk c's scales, fp16 values read by half (the ISA's fp16 to float conversion). Each scale
// is computed as ggml-quants.c computes it (d * sc, dmin * mn: exact), so that one rounding
// after q * scale (exact) gives gguf's values.
template <Format F, typename HalfToFloat>
inline ChunkScale chunk_scale(const uint8_t* row, int64_t c, const HalfToFloat& half) {
  static_assert(!has_own_dequant(F));
  if constexpr (F == Format::kQ5_0 || F == Format::kQ5_1 || F == Format::kQ8_M) {
    const uint8_t* block = row + c * block_bytes(F);
    const float d = half(load_u16(block));
    const float offset = F == Format::kQ5_0 ? -16.f * d : half(load_u16(block + 2));
    return {{d, d}, {offset, offset}};
  } else {
    const uint8_t* block = row + c / 8 * block_bytes(F);
    const int s = static_cast<int>(c % 8);
    if constexpr (F == Format::kQ6_K) {
      const float d = half(load_u16(block + 208));
      const auto* scales = reinterpret_cast<const int8_t*>(block + 192);
      const float scale0 = d * static_cast<float>(scales[2 * s]);
      const float scale1 = d * static_cast<float>(scales[2 * s + 1]);
      return {{scale0, scale1}, {-32.f * scale0, -32.f * scale1}};
    } else {
      int sc = 0, mn = 0;
      scale_min_k4(s, block + 4, sc, mn);
      const float scale = half(load_u16(block)) * static_cast<float>(sc);
      const float offset = -(half(load_u16(block + 2)) * static_cast<float>(mn));
      return {{scale, scale}, {offset, offset}};
    }
  }
}

// A q5_0 / q5_1 block's quant fields: bit j of high_bits is bit 4 of weight j; nibbles[j] holds
// the low 4 bits of weights j (low nibble) and j + 16 (high nibble).
struct Q5Quants {
  uint32_t high_bits;
  const uint8_t* nibbles;
};

template <Format F>
inline Q5Quants q5_quants(const uint8_t* block) {
  static_assert(F == Format::kQ5_0 || F == Format::kQ5_1);
  const int64_t qh_at = F == Format::kQ5_1 ? 4 : 2;
  uint32_t high_bits;
  std::memcpy(&high_bits, block + qh_at, sizeof(high_bits));
  return {high_bits, block + qh_at + 4};
}

// Chunk c's 32 unsigned quants (q5: 0-31, q8_m: 0-255, q4_K: 0-15, q5_K: 0-31, q6_K: 0-63), one
// at a time (the vector paths build them 32 at once from the same bytes).
template <Format F>
inline void chunk_quants(const uint8_t* row, int64_t c, uint8_t (&q)[kBlockSize]) {
  static_assert(!has_own_dequant(F));
  if constexpr (F == Format::kQ8_M) {
    for (int j = 0; j < kBlockSize; ++j) q[j] = row[c * block_bytes(F) + 4 + j];
  } else if constexpr (F == Format::kQ5_0 || F == Format::kQ5_1) {
    const auto [qh, qs] = q5_quants<F>(row + c * block_bytes(F));
    for (int j = 0; j < kBlockSize / 2; ++j) {
      q[j] = static_cast<uint8_t>((qs[j] & 15) | ((qh >> j) & 1) << 4);
      q[j + 16] = static_cast<uint8_t>((qs[j] >> 4) | ((qh >> (j + 16)) & 1) << 4);
    }
  } else {
    const uint8_t* block = row + c / 8 * block_bytes(F);
    const int s = static_cast<int>(c % 8);
    if constexpr (F == Format::kQ6_K) {
      // Sub-blocks 4h to 4h + 3 read ql[64h ...] and qh[32h ...]: the low nibbles of the first
      // and second 32 bytes, then their high nibbles; qh's bits 2(s % 4) and up.
      const uint8_t* ql = block + 64 * (s / 4) + 32 * (s % 2);
      const uint8_t* qh = block + 128 + 32 * (s / 4);
      const int nibble_shift = 4 * (s % 4 / 2), high_shift = 2 * (s % 4);
      for (int l = 0; l < kBlockSize; ++l) {
        q[l] = static_cast<uint8_t>(((ql[l] >> nibble_shift) & 15) |
                                    ((qh[l] >> high_shift) & 3) << 4);
      }
    } else {
      const uint8_t* qs = block + (F == Format::kQ5_K ? 48 : 16) + 32 * (s / 2);
      for (int l = 0; l < kBlockSize; ++l) {
        const int high = F == Format::kQ5_K ? ((block[16 + l] >> s) & 1) << 4 : 0;
        q[l] = static_cast<uint8_t>(((qs[l] >> (4 * (s % 2))) & 15) | high);
      }
    }
  }
}

}  // namespace orca::cpu::quant

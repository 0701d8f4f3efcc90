// The quantized linear's portable path: one float per "vector", compiled for the build's
// baseline target (the compiler may vectorize it, nothing here assumes an ISA).
#pragma once

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "orca/cpu/quant_formats.h"
#include "orca/cpu/quant_prefetch.h"

namespace orca::cpu::quant::portable {

struct Vec {
  using V = float;
  static constexpr int kWidth = 1;
  static constexpr int kChainTarget = 8;
  static constexpr int rows_for(int) { return 1; }
  static V zero() { return 0.f; }
  static V load(const float* p) { return *p; }
  static void store(float* p, V v) { *p = v; }
  static void store_bf16(uint16_t* p, V v) { *p = float_to_bf16(v); }
  static V add(V a, V b) { return a + b; }
  static V fmadd(V a, V b, V c) { return a * b + c; }
  static float hsum(V v) { return v; }

  // Chunk c (32 weights) of a row of F's blocks.
  template <Format F>
  static void dequant(const uint8_t* row, int64_t c, V (&w)[kBlockSize]) {
    if constexpr (has_own_dequant(F)) {
      const uint8_t* block = row + c * block_bytes(F);
      const float d = half_to_float(load_u16(block));
      const uint8_t* qs = block + quants_offset(F);
      if constexpr (F == Format::kQ8_0) {
        for (int j = 0; j < kBlockSize; ++j) {
          w[j] = static_cast<float>(static_cast<int8_t>(qs[j])) * d;
        }
      } else {
        // q4_0 subtracts 8 from each nibble; q4_1 adds its fp16 offset m.
        const float m = F == Format::kQ4_1 ? half_to_float(load_u16(block + 2)) : -8.f * d;
        for (int j = 0; j < kBlockSize / 2; ++j) {
          w[j] = static_cast<float>(qs[j] & 15) * d + m;
          w[j + kBlockSize / 2] = static_cast<float>(qs[j] >> 4) * d + m;
        }
      }
    } else {
      const ChunkScale s = chunk_scale<F>(row, c, half_to_float);
      uint8_t q[kBlockSize];
      chunk_quants<F>(row, c, q);
      for (int j = 0; j < kBlockSize; ++j) {
        w[j] = static_cast<float>(q[j]) * s.scale[j / 16] + s.offset[j / 16];
      }
    }
  }
};

#include "orca/cpu/quant_kernel.h"

}  // namespace orca::cpu::quant::portable

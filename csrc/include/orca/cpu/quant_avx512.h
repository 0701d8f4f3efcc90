// The quantized linear's AVX-512 path (16-float vectors, AVX-512 F/BW/VL, FMA, F16C), compiled
// through a target pragma so that a baseline build carries it and picks it at run time. The
// formats without tile kernels take their quant bytes from the AVX2 path's chunk_quant_bytes.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "orca/cpu/quant_avx2.h"
#include "orca/cpu/quant_formats.h"
#include "orca/cpu/quant_prefetch.h"

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")

namespace orca::cpu::quant::avx512 {

struct Vec {
  using V = __m512;
  static constexpr int kWidth = 16;
  static constexpr int kChainTarget = 8;
  // 32 registers: four rows side by side up to two tokens, two rows up to eight.
  static constexpr int rows_for(int kT) { return kT <= 2 ? 4 : 2; }
  static V zero() { return _mm512_setzero_ps(); }
  static V load(const float* p) { return _mm512_loadu_ps(p); }
  static void store(float* p, V v) { _mm512_storeu_ps(p, v); }
  // float_to_bf16 on 16 lanes: the bits plus 0x7fff plus the kept lowest bit, shifted down;
  // NaN lanes become the quiet NaN 0x7fc0.
  static void store_bf16(uint16_t* p, V v) {
    const __m512i u = _mm512_castps_si512(v);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i bf = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(odd,
                                                    _mm512_set1_epi32(0x7fff))), 16);
    bf = _mm512_mask_mov_epi32(bf, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q),
                               _mm512_set1_epi32(0x7fc0));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(bf));
  }
  static V add(V a, V b) { return _mm512_add_ps(a, b); }
  static V fmadd(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
  static float hsum(V v) { return _mm512_reduce_add_ps(v); }
  // The fp16 at p in all lanes: broadcast as fp16, then widened (fewer uops than widening one
  // lane and broadcasting the float).
  static V broadcast_half(const uint8_t* p) {
    return _mm512_cvtph_ps(_mm256_set1_epi16(static_cast<short>(load_u16(p))));
  }

  // Chunk c (32 weights) of a row of F's blocks.
  template <Format F>
  static void dequant(const uint8_t* row, int64_t c, V (&w)[2]) {
    if constexpr (has_own_dequant(F)) {
      const uint8_t* block = row + c * block_bytes(F);
      const V d = broadcast_half(block);
      const uint8_t* qs = block + quants_offset(F);
      if constexpr (F == Format::kQ8_0) {
        for (int i = 0; i < 2; ++i) {
          const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs + 16 * i));
          w[i] = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q)), d);
        }
      } else {
        // The block's 16 possible weights in a table (q4_0: (j - 8) d, q4_1: j d + m, both
        // exact as gguf computes them), looked up by vpermps, which reads only an index's low 4
        // bits: the 16 bytes widened to int32 lanes index their low nibbles (weights 0-15) as
        // they are and their high nibbles (16-31) shifted down.
        const V iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
        const V table = F == Format::kQ4_1
                            ? _mm512_fmadd_ps(iota, d, broadcast_half(block + 2))
                            : _mm512_mul_ps(_mm512_sub_ps(iota, _mm512_set1_ps(8.f)), d);
        const __m512i q =
            _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qs)));
        w[0] = _mm512_permutexvar_ps(q, table);
        w[1] = _mm512_permutexvar_ps(_mm512_srli_epi32(q, 4), table);
      }
    } else {
      const ChunkScale s = chunk_scale<F>(row, c, [](uint16_t h) { return _cvtsh_ss(h); });
      const __m256i q = avx2::chunk_quant_bytes<F>(row, c);
      const __m128i halves[2] = {_mm256_castsi256_si128(q), _mm256_extracti128_si256(q, 1)};
      for (int i = 0; i < 2; ++i) {
        w[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(halves[i])),
                               _mm512_set1_ps(s.scale[i]), _mm512_set1_ps(s.offset[i]));
      }
    }
  }
};

#include "orca/cpu/quant_kernel.h"

}  // namespace orca::cpu::quant::avx512

#pragma GCC pop_options

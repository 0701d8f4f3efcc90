// avx512_vnni's dot kernels on the x16 layout (quant_rows16.h): one output row per int32 lane,
// 16 rows a vector. A quant vector holds 4 bytes of each row's quants; vpdpbusd multiplies them
// by the same 4 activation bytes broadcast to every lane, for both int8 parts of the
// activations (quant_vnni.h's BlockPair, the row kernels' rounding); then the 16 rows' int32
// sums are scaled by their 16 scales at once. Against the row layout's kernels, no per-row
// scale shuffles and no horizontal sums: about a third of the instructions per weight.
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <cstring>
#include <utility>

#include "orca/cpu/quant_formats.h"
#include "orca/cpu/quant_prefetch.h"
#include "orca/cpu/quant_rows16.h"
#include "orca/cpu/quant_vnni.h"

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")

namespace orca::cpu::quant::vnni {

// Where value j (a multiple of 4 within a half of 16) of block s of a pair lies in BlockPair::q,
// and the lane whose unit is that block's.
template <Format F>
constexpr int pair_byte(int s, int j) {
  if constexpr (interleaved_pairs(F)) return j < 16 ? 16 * s + j : 32 + 16 * s + (j - 16);
  return 32 * s + j;
}
template <Format F>
constexpr int pair_lane(int s) {
  return interleaved_pairs(F) ? 4 * s : 8 * s;
}

inline __m512i broadcast_bytes(const int8_t* at) {
  int32_t four;
  std::memcpy(&four, at, sizeof(four));
  return _mm512_set1_epi32(four);
}

inline __m512 load_halves(const uint8_t* at) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(at)));
}

// f.template operator()<i>() for i = 0 .. kCount - 1, unrolled (shifts take i as an immediate).
template <int kCount, typename Fn>
inline void unrolled(const Fn& f) {
  [&]<int... i>(std::integer_sequence<int, i...>) {
    (f.template operator()<i>(), ...);
  }(std::make_integer_sequence<int, kCount>());
}

// Quant vector v of a 32-weight format's block of 16 rows as unsigned quants (q8_0's int8 + 128):
// `first` holds weights 4v to 4v + 3 of each row; the four-bit formats' `second` weights
// 16 + 4v to 16 + 4v + 3 (q5_0 / q5_1's fifth bits from the rearranged qh, `high_bits`).
template <Format F, int v>
inline void block_quants(const uint8_t* block, __m512i high_bits, __m512i& first,
                         __m512i& second) {
  const __m512i raw =
      _mm512_loadu_si512(block + rows16::group_at(F, rows16::quant_field(F)) + 64 * v);
  if constexpr (rows16::quant_vectors(F) == 4) {
    const __m512i low = _mm512_set1_epi8(15), fifth = _mm512_set1_epi8(16);
    first = _mm512_and_si512(raw, low);
    second = _mm512_and_si512(_mm512_srli_epi16(raw, 4), low);
    if constexpr (rows16::has_high_bits(F)) {
      first = _mm512_or_si512(first, _mm512_and_si512(_mm512_slli_epi32(high_bits, 4 - v), fifth));
      second = _mm512_or_si512(second, _mm512_and_si512(_mm512_srli_epi32(high_bits, v), fifth));
    }
  } else if constexpr (F == Format::kQ8_0) {
    first = _mm512_xor_si512(raw, _mm512_set1_epi8(static_cast<char>(0x80)));
  } else {
    first = raw;
  }
}

// A 32-weight format's block of 16 rows: q5_0 / q5_1's rearranged qh (zero for the others).
template <Format F>
inline __m512i block_high_bits(const uint8_t* block) {
  if constexpr (rows16::has_high_bits(F)) {
    return _mm512_loadu_si512(block + rows16::group_at(F, rows16::high_bits_field(F)));
  }
  return _mm512_setzero_si512();
}

// The 32-weight formats: the kRowGroup rows of group `w` against kT tokens' block pairs x:
// y[t * y_stride + r].
template <Format F, int kT>
inline void dot_group(const BlockPair* x, int64_t K, const uint8_t* w, float* y,
                      int64_t y_stride) {
  constexpr int64_t kGroupBlock = kRowGroup * block_bytes(F);
  constexpr int kQuantVectors = rows16::quant_vectors(F);
  constexpr bool kFourBit = kQuantVectors == 4;
  constexpr bool kMin = has_min(F);
  const int64_t blocks = K / kBlockSize, pairs = (blocks + 1) / 2;
  __m512 acc[kT];
  for (auto& a : acc) a = _mm512_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* block = w + b * kGroupBlock;
    for (int64_t line = 0; line < kGroupBlock; line += 64) prefetch_weights_ahead(block + line);
    const int s = static_cast<int>(b % 2);
    // Per token: the dot of the hi parts and of the lo parts, each in two chains.
    __m512i hi[kT][2], lo[kT][2];
    for (int t = 0; t < kT; ++t) {
      hi[t][0] = hi[t][1] = lo[t][0] = lo[t][1] = _mm512_setzero_si512();
    }
    const __m512i high_bits = block_high_bits<F>(block);
    unrolled<kQuantVectors>([&]<int v>() {
      __m512i first, second;  // kFourBit: the low and high nibbles' quants
      block_quants<F, v>(block, high_bits, first, second);
#pragma GCC unroll 8
      for (int t = 0; t < kT; ++t) {
        const BlockPair& xp = x[t * pairs + b / 2];
        const int at = pair_byte<F>(s, 4 * v);
        hi[t][0] = _mm512_dpbusd_epi32(hi[t][0], first, broadcast_bytes(xp.q + at));
        lo[t][0] = _mm512_dpbusd_epi32(lo[t][0], first, broadcast_bytes(xp.q_lo + at));
        if constexpr (kFourBit) {
          const int high_at = pair_byte<F>(s, 16 + 4 * v);
          hi[t][1] = _mm512_dpbusd_epi32(hi[t][1], second, broadcast_bytes(xp.q + high_at));
          lo[t][1] = _mm512_dpbusd_epi32(lo[t][1], second, broadcast_bytes(xp.q_lo + high_at));
        }
      }
    });
    const __m512 d = load_halves(block);
    __m512 m;
    if constexpr (kMin) m = load_halves(block + rows16::group_at(F, 1));
#pragma GCC unroll 8
    for (int t = 0; t < kT; ++t) {
      const BlockPair& xp = x[t * pairs + b / 2];
      __m512i dot = _mm512_add_epi32(
          _mm512_slli_epi32(_mm512_add_epi32(hi[t][0], hi[t][1]), 8),
          _mm512_add_epi32(lo[t][0], lo[t][1]));
      const int32_t total = xp.total[2 * s] + xp.total[2 * s + 1];
      if constexpr (quant_zero(F) != 0) {
        dot = _mm512_sub_epi32(dot, _mm512_set1_epi32(quant_zero(F) * total));
      }
      const float unit = xp.unit[pair_lane<F>(s)];
      acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(d, _mm512_set1_ps(unit)),
                               acc[t]);
      if constexpr (kMin) {
        acc[t] = _mm512_fmadd_ps(m, _mm512_set1_ps(unit * static_cast<float>(total)), acc[t]);
      }
    }
  }
  for (int t = 0; t < kT; ++t) _mm512_storeu_ps(y + t * y_stride, acc[t]);
}

// Chunk c (weights 32c to 32c + 31) of a K-quant super-block of 16 rows `sb` as 8 vectors of
// unsigned quants, vector v holding weights 4v to 4v + 3 of each row.
template <Format F, int c>
inline void k_chunk_quants(const uint8_t* sb, __m512i (&q)[8]) {
  using rows16::group_at;
  const auto load = [](const uint8_t* at) { return _mm512_loadu_si512(at); };
  const __m512i low = _mm512_set1_epi8(15);
  if constexpr (F == Format::kQ6_K) {
    // ql[64h + 32(k % 2) + l]'s nibble k / 2 and qh[32h + l]'s bits 2k, 2k + 1 (c = 4h + k).
    constexpr int h = c / 4, k = c % 4;
    const uint8_t* ql = sb + group_at(F, 3) + 64 * (16 * h + 8 * (k % 2));
    const uint8_t* qh = sb + group_at(F, 2) + 64 * (8 * h);
    for (int v = 0; v < 8; ++v) {
      const __m512i nibbles = _mm512_and_si512(_mm512_srli_epi16(load(ql + 64 * v), 4 * (k / 2)),
                                               low);
      const __m512i high = _mm512_and_si512(_mm512_srli_epi16(load(qh + 64 * v), 2 * k),
                                            _mm512_set1_epi8(3));
      q[v] = _mm512_or_si512(nibbles, _mm512_slli_epi16(high, 4));
    }
  } else {
    // qs[32 (c / 2) + l]'s nibble c % 2; q5_K: qh[l]'s bit c as bit 4.
    constexpr int kQsField = F == Format::kQ5_K ? 4 : 3;
    const uint8_t* qs = sb + group_at(F, kQsField) + 64 * (8 * (c / 2));
    for (int v = 0; v < 8; ++v) {
      q[v] = _mm512_and_si512(_mm512_srli_epi16(load(qs + 64 * v), 4 * (c % 2)), low);
      if constexpr (F == Format::kQ5_K) {
        const __m512i qh = load(sb + group_at(F, 3) + 64 * v);
        const __m512i bit = c <= 4 ? _mm512_slli_epi16(qh, 4 - c) : _mm512_srli_epi16(qh, c - 4);
        q[v] = _mm512_or_si512(q[v], _mm512_and_si512(bit, _mm512_set1_epi8(16)));
      }
    }
  }
}

// Bits [at, at + bits) of each lane's dword, as ints.
template <int at, int bits>
inline __m512i lane_bits(__m512i v) {
  return _mm512_and_si512(_mm512_srli_epi32(v, at), _mm512_set1_epi32((1 << bits) - 1));
}

// Chunk c's scales of a K-quant super-block of 16 rows `sb`, per half of 16 weights: q6_K's d
// scale, q4_K / q5_K's d sc (both halves) with their dmin mn in `min` (get_scale_min_k4's
// fields; every product exact in float32).
template <Format F, int c>
inline void k_chunk_scales(const uint8_t* sb, __m512 (&scale)[2], __m512& min) {
  using rows16::group_at;
  const __m512 d = load_halves(sb + group_at(F, 0));
  if constexpr (F == Format::kQ6_K) {
    const __m512i scales = _mm512_loadu_si512(sb + group_at(F, 1) + 64 * (c / 2));
    unrolled<2>([&]<int half>() {
      constexpr int kByte = 2 * (c % 2) + half;
      const __m512i sc = _mm512_srai_epi32(_mm512_slli_epi32(scales, 24 - 8 * kByte), 24);
      scale[half] = _mm512_mul_ps(d, _mm512_cvtepi32_ps(sc));
    });
    min = _mm512_setzero_ps();
  } else {
    // The 12 bytes of six-bit scales and mins, as 3 dwords.
    const auto packed = [&](int i) { return _mm512_loadu_si512(sb + group_at(F, 2) + 64 * i); };
    __m512i sc, mn;
    if constexpr (c < 4) {
      sc = lane_bits<8 * c, 6>(packed(0));
      mn = lane_bits<8 * c, 6>(packed(1));
    } else {
      constexpr int kAt = 8 * (c - 4);
      sc = _mm512_or_si512(lane_bits<kAt, 4>(packed(2)),
                           _mm512_slli_epi32(lane_bits<kAt + 6, 2>(packed(0)), 4));
      mn = _mm512_or_si512(lane_bits<kAt + 4, 4>(packed(2)),
                           _mm512_slli_epi32(lane_bits<kAt + 6, 2>(packed(1)), 4));
    }
    scale[0] = scale[1] = _mm512_mul_ps(d, _mm512_cvtepi32_ps(sc));
    min = _mm512_mul_ps(load_halves(sb + group_at(F, 1)), _mm512_cvtepi32_ps(mn));
  }
}

// The K-quants: the kRowGroup rows of group `w` against kT tokens' block pairs x, a chunk of
// 32 weights (a pair's block) at a time.
template <Format F, int kT>
inline void dot_group_k(const BlockPair* x, int64_t K, const uint8_t* w, float* y,
                        int64_t y_stride) {
  using rows16::group_at;
  constexpr int64_t kGroupBlock = kRowGroup * block_bytes(F);
  const int64_t super_blocks = K / weights_per_block(F), pairs = K / (2 * kBlockSize);
  __m512 acc[kT];
  for (auto& a : acc) a = _mm512_setzero_ps();
  for (int64_t b = 0; b < super_blocks; ++b) {
    const uint8_t* sb = w + b * kGroupBlock;
    for (int64_t line = 0; line < kGroupBlock; line += 64) prefetch_weights_ahead(sb + line);
    unrolled<8>([&]<int c>() {
      __m512i q[8];
      k_chunk_quants<F, c>(sb, q);
      __m512 scale[2], min;
      k_chunk_scales<F, c>(sb, scale, min);
      constexpr int s = c % 2;
#pragma GCC unroll 8
      for (int t = 0; t < kT; ++t) {
        const BlockPair& xp = x[t * pairs + 4 * b + c / 2];
        // Per half: 256 dot(hi) + dot(lo) in one accumulator.
        __m512i dot[2] = {_mm512_setzero_si512(), _mm512_setzero_si512()};
        for (int v = 0; v < 8; ++v) {
          dot[v / 4] =
              _mm512_dpbusd_epi32(dot[v / 4], q[v], broadcast_bytes(xp.q + 32 * s + 4 * v));
        }
        dot[0] = _mm512_slli_epi32(dot[0], 8);
        dot[1] = _mm512_slli_epi32(dot[1], 8);
        for (int v = 0; v < 8; ++v) {
          dot[v / 4] =
              _mm512_dpbusd_epi32(dot[v / 4], q[v], broadcast_bytes(xp.q_lo + 32 * s + 4 * v));
        }
        const __m512 unit = _mm512_set1_ps(xp.unit[8 * s]);
        if constexpr (F == Format::kQ6_K) {
          for (int half = 0; half < 2; ++half) {
            const __m512i centered = _mm512_sub_epi32(
                dot[half], _mm512_set1_epi32(quant_zero(F) * xp.total[2 * s + half]));
            acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(centered),
                                     _mm512_mul_ps(scale[half], unit), acc[t]);
          }
        } else {
          acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(dot[0], dot[1])),
                                   _mm512_mul_ps(scale[0], unit), acc[t]);
          const float total =
              static_cast<float>(xp.total[2 * s] + xp.total[2 * s + 1]) * xp.unit[8 * s];
          acc[t] = _mm512_fnmadd_ps(min, _mm512_set1_ps(total), acc[t]);
        }
      }
    });
  }
  for (int t = 0; t < kT; ++t) _mm512_storeu_ps(y + t * y_stride, acc[t]);
}

// The 8 quant vectors (4 values of each of the 16 rows, as AMX's B tile rows) of chunk c (values
// 32c to 32c + 31) of a group block `block` (a K-quant's super-block, c < 8; else c = 0), signed
// where the format has no min, and the 16 rows' d and m of the chunk's units (q6_K: two of 16
// values) into d[16 u ...], m[16 u ...] (m: the offset, q4_1's m, q4_K's -dmin mn).
template <Format F, int c>
inline void unpack_chunk(const uint8_t* block, __m512i (&b)[8], float* d, float* m) {
  if constexpr (is_k_quant(F)) {
    k_chunk_quants<F, c>(block, b);
    __m512 scale[2], min;
    k_chunk_scales<F, c>(block, scale, min);
    _mm512_storeu_ps(d, scale[0]);
    if constexpr (F == Format::kQ6_K) _mm512_storeu_ps(d + kRowGroup, scale[1]);
    if constexpr (has_min(F)) _mm512_storeu_ps(m, _mm512_sub_ps(_mm512_setzero_ps(), min));
  } else {
    const __m512i high_bits = block_high_bits<F>(block);
    constexpr bool kFourBit = rows16::quant_vectors(F) == 4;
    unrolled<rows16::quant_vectors(F)>([&]<int v>() {
      __m512i second;
      block_quants<F, v>(block, high_bits, b[v], second);
      if constexpr (kFourBit) b[4 + v] = second;
    });
    _mm512_storeu_ps(d, load_halves(block));
    if constexpr (has_min(F)) {
      _mm512_storeu_ps(m, load_halves(block + rows16::group_at(F, 1)));
    }
  }
  if constexpr (!has_min(F)) {
    const __m512i zero = _mm512_set1_epi8(static_cast<char>(quant_zero(F)));
    for (auto& row : b) row = _mm512_sub_epi8(row, zero);
  }
}

// `rows` rows (a multiple of kRowGroup) of the x16 layout's w against kT tokens.
template <Format F, int kT>
void dot_rows16(const BlockPair* x, int64_t K, const uint8_t* w, int64_t rows, float* y,
                int64_t y_stride) {
  const int64_t group_bytes = kRowGroup * row_bytes(F, K);
  for (int64_t g = 0; g < rows / kRowGroup; ++g) {
    if constexpr (is_k_quant(F)) {
      dot_group_k<F, kT>(x, K, w + g * group_bytes, y + g * kRowGroup, y_stride);
    } else {
      dot_group<F, kT>(x, K, w + g * group_bytes, y + g * kRowGroup, y_stride);
    }
  }
}

}  // namespace orca::cpu::quant::vnni

#pragma GCC pop_options

// Torch-free AMX pieces of the CPU attention's prefill-like bfloat16 path (attention.h's
// attend_lanes_amx): whether AMX may be used, the tile configuration, a block of tile matrix
// products, the V tile transposed for the P.V product, and a vector exp2 for the softmax.
// Compiled in where the build targets AMX-BF16 (-march=native on such a CPU, ORCA_ATTENTION_AMX);
// used only where the CPU has it and the OS grants the process tile data (amx::usable()).
#pragma once

#include <cstdint>

#include "orca/cpu/amx_tiles.h"

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#define ORCA_ATTENTION_AMX 1
#include <immintrin.h>
#endif

namespace orca::cpu::amx {

// Whether this build has the AMX attention, the CPU AMX-BF16, and the OS grants tile data.
inline bool usable() {
#if defined(ORCA_ATTENTION_AMX)
  __builtin_cpu_init();
  return __builtin_cpu_supports("amx-tile") && __builtin_cpu_supports("amx-bf16") &&
         tile_data_granted();
#else
  return false;
#endif
}

#if defined(ORCA_ATTENTION_AMX)

// All 8 tiles as 16 rows of 64 bytes (palette 1). Loaded at each item: other code on the
// thread (oneDNN's AMX GEMMs) may have configured the tiles otherwise.
inline void configure_tiles() {
  TileConfig config;
  for (int t = 0; t < 8; ++t) {
    config.colsb[t] = 64;
    config.rows[t] = 16;
  }
  load_tile_config(config);
}

// One block of C += A . B over `steps` K-steps of 32 bf16: kNA row tiles of A (a0, a1: each
// 16 rows of 32 bf16 per step, rows a_stride bytes apart, the next step a_step bytes on) by
// kNB column tiles of B (b and b + 64 bytes: 16 rows of 16 bf16 pairs, b_stride bytes apart,
// the next step b_step bytes on), into C tiles of 16 x 16 floats at c + i * c_next_a + j * 64
// (rows c_stride bytes apart), loaded first (kLoadC) or zero. Tiles: C 0-3, A 4-5, B 6-7.
template <int kNA, int kNB, bool kLoadC>
inline void tile_block(char* c, int64_t c_stride, int64_t c_next_a, const char* a0,
                       const char* a1, int64_t a_stride, int64_t a_step, const char* b,
                       int64_t b_stride, int64_t b_step, int steps) {
  static_assert((kNA == 1 || kNA == 2) && (kNB == 1 || kNB == 2));
  if constexpr (kLoadC) {
    _tile_loadd(0, c, c_stride);
    if constexpr (kNB == 2) _tile_loadd(1, c + 64, c_stride);
    if constexpr (kNA == 2) _tile_loadd(2, c + c_next_a, c_stride);
    if constexpr (kNA == 2 && kNB == 2) _tile_loadd(3, c + c_next_a + 64, c_stride);
  } else {
    _tile_zero(0);
    if constexpr (kNB == 2) _tile_zero(1);
    if constexpr (kNA == 2) _tile_zero(2);
    if constexpr (kNA == 2 && kNB == 2) _tile_zero(3);
  }
  for (int s = 0; s < steps; ++s) {
    _tile_loadd(6, b + s * b_step, b_stride);
    if constexpr (kNB == 2) _tile_loadd(7, b + s * b_step + 64, b_stride);
    _tile_loadd(4, a0 + s * a_step, a_stride);
    _tile_dpbf16ps(0, 4, 6);
    if constexpr (kNB == 2) _tile_dpbf16ps(1, 4, 7);
    if constexpr (kNA == 2) {
      _tile_loadd(5, a1 + s * a_step, a_stride);
      _tile_dpbf16ps(2, 5, 6);
      if constexpr (kNB == 2) _tile_dpbf16ps(3, 5, 7);
    }
  }
  _tile_stored(0, c, c_stride);
  if constexpr (kNB == 2) _tile_stored(1, c + 64, c_stride);
  if constexpr (kNA == 2) _tile_stored(2, c + c_next_a, c_stride);
  if constexpr (kNA == 2 && kNB == 2) _tile_stored(3, c + c_next_a + 64, c_stride);
}

// The B operand kept in tiles 4-7 for row_step: kSteps x kNB tiles, the (s, j) one 16 rows of
// 16 bf16 pairs at b + s * b_step + j * 64 (rows b_stride bytes apart).
template <int kSteps, int kNB>
inline void load_b(const char* b, int64_t b_stride, int64_t b_step) {
  static_assert((kSteps == 1 || kSteps == 2) && (kNB == 1 || kNB == 2));
  _tile_loadd(4, b, b_stride);
  if constexpr (kNB == 2) _tile_loadd(5, b + 64, b_stride);
  if constexpr (kSteps == 2) {
    _tile_loadd(6, b + b_step, b_stride);
    if constexpr (kNB == 2) _tile_loadd(7, b + b_step + 64, b_stride);
  }
}

// One row tile of C += A . B against load_b's B: A's K-step s is 16 rows of 32 bf16 at
// a + s * 64 (rows a_stride bytes apart); C's tile j is 16 x 16 floats at c + j * 64 (rows
// c_stride apart), loaded first (kLoadC) or zero. Tiles: C 0-1, A 2-3.
template <int kSteps, int kNB, bool kLoadC>
inline void row_step(char* c, int64_t c_stride, const char* a, int64_t a_stride) {
  if constexpr (kLoadC) {
    _tile_loadd(0, c, c_stride);
    if constexpr (kNB == 2) _tile_loadd(1, c + 64, c_stride);
  } else {
    _tile_zero(0);
    if constexpr (kNB == 2) _tile_zero(1);
  }
  _tile_loadd(2, a, a_stride);
  if constexpr (kSteps == 2) _tile_loadd(3, a + 64, a_stride);
  _tile_dpbf16ps(0, 2, 4);
  if constexpr (kNB == 2) _tile_dpbf16ps(1, 2, 5);
  if constexpr (kSteps == 2) {
    _tile_dpbf16ps(0, 3, 6);
    if constexpr (kNB == 2) _tile_dpbf16ps(1, 3, 7);
  }
  _tile_stored(0, c, c_stride);
  if constexpr (kNB == 2) _tile_stored(1, c + 64, c_stride);
}

// r[i][j] = r[j][i] for a 16 x 16 matrix of 32-bit words.
inline void transpose16(__m512i (&r)[16]) {
  __m512i t[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  // u[4i + c], 128-bit lane L: column 4L + c of rows 4i..4i+3.
  __m512i u[16];
  for (int i = 0; i < 4; ++i) {
    u[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
    u[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
    u[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
    u[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
  }
  for (int c = 0; c < 4; ++c) {
    const __m512i a = _mm512_shuffle_i32x4(u[c], u[4 + c], 0x44);
    const __m512i b = _mm512_shuffle_i32x4(u[c], u[4 + c], 0xEE);
    const __m512i x = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0x44);
    const __m512i y = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0xEE);
    r[c] = _mm512_shuffle_i32x4(a, x, 0x88);
    r[4 + c] = _mm512_shuffle_i32x4(a, x, 0xDD);
    r[8 + c] = _mm512_shuffle_i32x4(b, y, 0x88);
    r[12 + c] = _mm512_shuffle_i32x4(b, y, 0xDD);
  }
}

// 16 bf16 of a and 16 of b interleaved into 16 pairs (a_i, b_i).
inline __m512i interleave_pairs(__m256i a, __m256i b) {
  const __m512i index = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9,
                                         40, 8, 39, 7, 38, 6, 37, 5, 36, 4, 35, 3, 34, 2, 33, 1,
                                         32, 0);
  return _mm512_permutex2var_epi16(_mm512_castsi256_si512(a), index, _mm512_castsi256_si512(b));
}

// Dims [16c, 16c + 16) of 32 V rows (bf16; v_rows[j] for key j) as V^T:
// vt[d * vt_stride + j] (bf16) for those d and j < 32, part of the A operand of
// O^T += V^T . P^T. Key pairs are interleaved into words, then the 16 x 16 words transposed.
inline void transpose_v(const uint16_t* const* v_rows, int c, uint16_t* vt, int64_t vt_stride) {
  __m512i r[16];
  for (int i = 0; i < 16; ++i) {
    r[i] = interleave_pairs(
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(v_rows[2 * i] + 16 * c)),
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(v_rows[2 * i + 1] + 16 * c)));
  }
  transpose16(r);
  for (int d = 0; d < 16; ++d) _mm512_storeu_si512(vt + (16 * c + d) * vt_stride, r[d]);
}

// 2^y for y <= 8, or -inf (-> 0) where kMaybeInf: 2^n by scalef on a degree-3 polynomial of
// 2^f, f = y - n in [-1/2, 1/2] (relative error 1.2e-4: the probabilities are rounded to
// bfloat16 anyway, and the output's numerator and denominator share it; 2^0 = 1 exactly).
template <bool kMaybeInf>
inline __m512 exp2_small(__m512 y) {
  if constexpr (kMaybeInf) y = _mm512_max_ps(y, _mm512_set1_ps(-200.f));  // 2^-200 -> 0
  const __m512 n = _mm512_roundscale_ps(y, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(y, n);
  __m512 p = _mm512_set1_ps(5.45928281e-2f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.42218381e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.93368689e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, n);
}

// Non-negative finite a and b rounded to bf16 (to nearest, ties away: adding half an ulp of
// bf16 to the bits) and interleaved into 16 pairs (a_i, b_i): 4 integer ops, where the
// conversions and a 2-source word permute take 7.
inline __m512i round_pairs(__m512 a, __m512 b) {
  const __m512i half = _mm512_set1_epi32(0x8000);
  const __m512i ra = _mm512_add_epi32(_mm512_castps_si512(a), half);
  const __m512i rb = _mm512_add_epi32(_mm512_castps_si512(b), half);
  return _mm512_mask_blend_epi16(0xAAAAAAAA, _mm512_srli_epi32(ra, 16), rb);
}

#endif  // ORCA_ATTENTION_AMX

}  // namespace orca::cpu::amx

// The quantized linear's AMX-INT8 path (Isa::kAmxInt8) for more than a couple of tokens, on
// activations split into two int8 parts per 32-value block: hi = nearest-even(x / dx) with
// dx = max |x| / 127 (the VNNI path's rounding, quant_vnni.h), then the remainder's
// lo = nearest-even((x - hi dx) / dx_lo) with dx_lo = dx / 254, so x = hi dx + lo dx_lo + e
// with |e| <= dx / 508 = max |x| / 64516: about 15 bits of each block, finer than bfloat16.
// Each block of up to 16 tokens by 16 weight rows by 32 values takes two tile products (hi and
// lo), exact in int32, scaled to float by the block's activation and weight scales and summed
// over the blocks in registers. A weight's block scale changes every 32 values, so a tile
// product may not run over more than one block.
// Tiles: A = a group of G tokens' hi or lo bytes of a block (G rows of 32 signed bytes, read in
// place), B = 16 weight rows' block in the VNNI layout (row r: weight row n's values 4r..4r+3
// at bytes 4n..4n+3; q8_0 signed bytes, q4_0 / q4_1 nibbles 0..15), prepared per group of 16
// weight rows in a scratch panel; C = G x 16 int32. The tile products' cost grows with G (their
// rows), so a few tokens cost little.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "orca/cpu/amx_tiles.h"
#include "orca/cpu/quant_formats.h"

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c,amx-tile,amx-int8")

namespace orca::cpu::quant::amx {

constexpr int kTile = 16;  // the most tokens, and the weight rows, of a tile product

// The tokens of each group for a call of T tokens: the groups (ceil(T / 16) of them) evenly
// filled, rounded up to a multiple of 4; the last group is padded with zero tokens.
constexpr int64_t group_tokens(int64_t T) {
  const int64_t groups = std::max<int64_t>(1, (T + kTile - 1) / kTile);
  return std::max<int64_t>(4, ((T + groups - 1) / groups + 3) / 4 * 4);
}
constexpr int64_t token_groups(int64_t T) { return (T + group_tokens(T) - 1) / group_tokens(T); }

// A group of G tokens as the tiles read it, group_bytes(G, K) bytes a group: hi [G, K] and
// lo [G, K] the two int8 parts, then per token and block [G, K / 32] the scales dx and dx_lo,
// and corr, the weights' offset term per unit of the weight's d (q4_0: -8 (dx sum hi + dx_lo
// sum lo)) or m (q4_1: dx sum hi + dx_lo sum lo; q8_0: none). Tokens past T are zero.
constexpr int64_t group_bytes(int64_t G, int64_t K) {
  return 2 * G * K + 3 * G * (K / kBlockSize) * static_cast<int64_t>(sizeof(float));
}

struct TokenGroup {
  const int8_t* hi;
  const int8_t* lo;
  const float* dx;
  const float* dx_lo;
  const float* corr;
};

inline TokenGroup token_group(const uint8_t* x, int64_t G, int64_t K, int64_t g) {
  const uint8_t* base = x + g * group_bytes(G, K);
  const auto* dx = reinterpret_cast<const float*>(base + 2 * G * K);
  const int64_t n = G * (K / kBlockSize);
  return {reinterpret_cast<const int8_t*>(base), reinterpret_cast<const int8_t*>(base + G * K),
          dx, dx + n, dx + 2 * n};
}

// Tokens [0, T) of x [T, K] (K a multiple of 32) split into groups of G tokens from `out` on
// (T need not fill the last group).
inline void quantize_activations(Format f, const float* x, int64_t T, int64_t K, int64_t G,
                                 uint8_t* out) {
  const int64_t blocks = K / kBlockSize;
  const int64_t groups = (T + G - 1) / G;
  std::memset(out, 0, groups * group_bytes(G, K));
  constexpr int kRound = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  for (int64_t t = 0; t < T; ++t) {
    const int64_t g = t / G, j = t % G;
    uint8_t* base = out + g * group_bytes(G, K);
    auto* hi = reinterpret_cast<int8_t*>(base) + j * K;
    int8_t* lo = hi + G * K;
    auto* dx = reinterpret_cast<float*>(base + 2 * G * K) + j * blocks;
    float* dx_lo = dx + G * blocks;
    float* corr = dx_lo + G * blocks;
    for (int64_t b = 0; b < blocks; ++b) {
      const float* xb = x + t * K + b * kBlockSize;
      const __m512 v[2] = {_mm512_loadu_ps(xb), _mm512_loadu_ps(xb + 16)};
      const float amax = _mm512_reduce_max_ps(
          _mm512_max_ps(_mm512_abs_ps(v[0]), _mm512_abs_ps(v[1])));
      const float d = amax / 127.f, d_lo = d / 254.f;
      const __m512 inverse = _mm512_set1_ps(d > 0.f ? 1.f / d : 0.f);
      const __m512 inverse_lo = _mm512_set1_ps(d > 0.f ? 1.f / d_lo : 0.f);
      __m512i sums = _mm512_setzero_si512(), sums_lo = _mm512_setzero_si512();
      for (int h = 0; h < 2; ++h) {
        // Rounded to nearest even, as the VNNI path's std::nearbyint in the default mode.
        const __m512i q = _mm512_cvt_roundps_epi32(_mm512_mul_ps(v[h], inverse), kRound);
        const __m512 rest = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(q), _mm512_set1_ps(d), v[h]);
        // |rest| <= dx / 2, so |lo| <= 127 but for the float rounding of rest: clamped.
        const __m512i q_lo = _mm512_max_epi32(
            _mm512_min_epi32(_mm512_cvt_roundps_epi32(_mm512_mul_ps(rest, inverse_lo), kRound),
                             _mm512_set1_epi32(127)),
            _mm512_set1_epi32(-127));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(hi + b * kBlockSize + 16 * h),
                         _mm512_cvtsepi32_epi8(q));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(lo + b * kBlockSize + 16 * h),
                         _mm512_cvtsepi32_epi8(q_lo));
        sums = _mm512_add_epi32(sums, q);
        sums_lo = _mm512_add_epi32(sums_lo, q_lo);
      }
      const float sum = d * static_cast<float>(_mm512_reduce_add_epi32(sums)) +
                        d_lo * static_cast<float>(_mm512_reduce_add_epi32(sums_lo));
      dx[b] = d;
      dx_lo[b] = d_lo;
      corr[b] = f == Format::kQ4_0 ? -8.f * sum : f == Format::kQ4_1 ? sum : 0.f;
    }
  }
}

// The tiles of group_product's pipeline, which keeps two blocks in flight so that a block's
// products are ready when they are scaled: stage s's C tiles 2s (hi) and 2s + 1 (lo), G rows of
// 16 int32, and its B tile 6 + s (8 rows of 64 bytes); the A tiles 4 (hi) and 5 (lo), G rows of
// 32 bytes. Loaded at each call: other code on the thread (oneDNN's AMX GEMMs, the attention's
// tiles) may have configured the tiles otherwise.
inline void configure_tiles(int64_t G) {
  cpu::amx::TileConfig config;
  for (int t = 0; t < 4; ++t) {
    config.colsb[t] = 4 * kTile;
    config.rows[t] = static_cast<uint8_t>(G);
  }
  for (int t = 0; t < 2; ++t) {
    config.colsb[4 + t] = kBlockSize;
    config.rows[4 + t] = static_cast<uint8_t>(G);
    config.colsb[6 + t] = 4 * kTile;
    config.rows[6 + t] = kBlockSize / 4;
  }
  cpu::amx::load_tile_config(config);
}

// The tile instructions with the tile as a template argument (GCC's intrinsics take literals).
// A tile load names no memory: callers order the stores it reads (asm memory barriers).
template <int kTmm>
inline void tile_load(const void* base, int64_t stride) {
  asm volatile("tileloadd (%0,%1,1), %%tmm%c2" ::"r"(base), "r"(stride), "i"(kTmm));
}
template <int kTmm>
inline void tile_zero() {
  asm volatile("tilezero %%tmm%c0" ::"i"(kTmm));
}
// C += A . B on bytes, A signed (the activations), B signed (q8_0) or unsigned (q4's nibbles).
template <bool kSignedB, int kC, int kA, int kB>
inline void tile_dot() {
  if constexpr (kSignedB) {
    asm volatile("tdpbssd %%tmm%c2, %%tmm%c1, %%tmm%c0" ::"i"(kC), "i"(kA), "i"(kB));
  } else {
    asm volatile("tdpbsud %%tmm%c2, %%tmm%c1, %%tmm%c0" ::"i"(kC), "i"(kA), "i"(kB));
  }
}
// C tile kC's G rows stored to c, 64 bytes a row, with c named as the asm's output (GCC's
// _tile_stored clobbers all memory, which would keep the accumulators out of registers).
template <int kC>
inline void tile_store(int32_t (&c)[kTile * kTile]) {
  asm volatile("tilestored %%tmm%c2, (%1,%3,1)" : "=m"(c) : "r"(c), "i"(kC), "r"(int64_t{64}));
}

// A group of 16 weight rows as tile B reads them: per block, 8 rows of 64 bytes (b), then each
// block's d and m as floats (q4_1's m; [block][row]). Rows past the matrix's end are zero.
struct RowGroup {
  const uint8_t* b;
  const float* d;
  const float* m;
};

// The 4 x 4 transposes, within each 128-bit lane, of z[0..3]: lane j of z[k] holding weight
// row k + 4j's 4 dwords, out[r] holds dword r of rows 0..15 in order.
inline void transpose_dwords(const __m512i (&z)[4], __m512i (&out)[4]) {
  const __m512i t0 = _mm512_unpacklo_epi32(z[0], z[1]), t1 = _mm512_unpackhi_epi32(z[0], z[1]);
  const __m512i t2 = _mm512_unpacklo_epi32(z[2], z[3]), t3 = _mm512_unpackhi_epi32(z[2], z[3]);
  out[0] = _mm512_unpacklo_epi64(t0, t2);
  out[1] = _mm512_unpackhi_epi64(t0, t2);
  out[2] = _mm512_unpacklo_epi64(t1, t3);
  out[3] = _mm512_unpackhi_epi64(t1, t3);
}

// 16 bytes at byte `offset` of each of the 16 rows' block (rows[n], or zeros where null), as
// z[k] lane j = row k + 4j.
inline void load_rows(const uint8_t* const (&rows)[kTile], int64_t offset, __m512i (&z)[4]) {
  for (int k = 0; k < 4; ++k) {
    __m512i v = _mm512_setzero_si512();
    for (int j = 0; j < 4; ++j) {
      const uint8_t* row = rows[k + 4 * j];
      if (row == nullptr) continue;
      v = _mm512_mask_broadcast_i32x4(v, static_cast<__mmask16>(0xF << (4 * j)),
                                      _mm_loadu_si128(reinterpret_cast<const __m128i*>(row +
                                                                                       offset)));
    }
    z[k] = v;
  }
}

// The group of 16 weight rows from w (`rows` of them real, the others zero) laid out in scratch.
template <Format F>
inline RowGroup prepare_rows(const uint8_t* w, int64_t K, int64_t rows,
                             std::vector<uint8_t>& scratch) {
  const int64_t blocks = K / kBlockSize, row_bytes = blocks * block_bytes(F);
  const int64_t panel_bytes = blocks * kBlockSize * kTile;
  const int64_t scale_bytes = 2 * blocks * kTile * static_cast<int64_t>(sizeof(float));
  if (static_cast<int64_t>(scratch.size()) < panel_bytes + scale_bytes) {
    scratch.resize(panel_bytes + scale_bytes);
  }
  uint8_t* panel = scratch.data();
  auto* d = reinterpret_cast<float*>(scratch.data() + panel_bytes);
  float* m = d + blocks * kTile;
  // Each row's d (and q4_1's m) gathered for the 16 rows: the first 4 bytes of each block.
  const auto live = static_cast<__mmask16>((1u << rows) - 1);
  const __m512i offsets = _mm512_mullo_epi32(
      _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
      _mm512_set1_epi32(static_cast<int32_t>(row_bytes)));
  const __m512i nibble = _mm512_set1_epi8(15);
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* block = w + b * block_bytes(F);
    const __m512i heads =
        _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), live, offsets, block, 1);
    _mm512_storeu_ps(d + b * kTile, _mm512_cvtph_ps(_mm512_cvtepi32_epi16(heads)));
    _mm512_storeu_ps(m + b * kTile,
                     _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(heads, 16))));
    const uint8_t* quants[kTile];
    for (int n = 0; n < kTile; ++n) {
      quants[n] = n < rows ? block + n * row_bytes + quants_offset(F) : nullptr;
    }
    auto* out = reinterpret_cast<__m512i*>(panel + b * kBlockSize * kTile);
    __m512i z[4], dwords[4];
    load_rows(quants, 0, z);
    transpose_dwords(z, dwords);
    if constexpr (F == Format::kQ8_0) {
      // Bytes 0-15 give B rows 0-3, bytes 16-31 rows 4-7.
      for (int r = 0; r < 4; ++r) _mm512_storeu_si512(out + r, dwords[r]);
      load_rows(quants, 16, z);
      transpose_dwords(z, dwords);
      for (int r = 0; r < 4; ++r) _mm512_storeu_si512(out + 4 + r, dwords[r]);
    } else {
      // Values 0-15 are the low nibbles of qs[0..15] (B rows 0-3), 16-31 the high ones (4-7).
      for (int r = 0; r < 4; ++r) {
        _mm512_storeu_si512(out + r, _mm512_and_si512(dwords[r], nibble));
        _mm512_storeu_si512(out + 4 + r,
                            _mm512_and_si512(_mm512_srli_epi16(dwords[r], 4), nibble));
      }
    }
  }
  // The tiles' loads name no memory: the panel is stored before any tile reads it.
  asm volatile("" ::: "memory");
  return {panel, d, m};
}

// Block b's hi and lo products into stage kStage's C tiles.
template <Format F, int kStage>
inline void block_product(const RowGroup& w, const TokenGroup& x, int64_t K, int64_t b) {
  constexpr int kHi = 2 * kStage, kLo = 2 * kStage + 1, kB = 6 + kStage;
  constexpr bool kSigned = F == Format::kQ8_0;
  tile_load<kB>(w.b + b * kBlockSize * kTile, 4 * kTile);
  tile_load<4>(x.hi + b * kBlockSize, K);
  tile_zero<kHi>();
  tile_dot<kSigned, kHi, 4, kB>();
  tile_load<5>(x.lo + b * kBlockSize, K);
  tile_zero<kLo>();
  tile_dot<kSigned, kLo, 5, kB>();
}

// acc[t] (16 weight rows' lanes) += block b's scaled products, read from c (hi and lo, kG x
// 16 int32 each).
template <Format F, int kG>
inline void scale_block(const RowGroup& w, const TokenGroup& x, int64_t blocks, int64_t b,
                        const int32_t (&c)[2][kTile * kTile], __m512 (&acc)[kTile]) {
  const __m512 d = _mm512_loadu_ps(w.d + b * kTile);
  const __m512 m = _mm512_loadu_ps(w.m + b * kTile);
#pragma GCC unroll 16
  for (int t = 0; t < kG; ++t) {
    const int64_t i = t * blocks + b;
    const __m512 hi = _mm512_cvtepi32_ps(_mm512_loadu_si512(c[0] + t * kTile));
    const __m512 lo = _mm512_cvtepi32_ps(_mm512_loadu_si512(c[1] + t * kTile));
    const __m512 products = _mm512_fmadd_ps(lo, _mm512_set1_ps(x.dx_lo[i]),
                                            _mm512_mul_ps(hi, _mm512_set1_ps(x.dx[i])));
    const __m512 corr = _mm512_set1_ps(x.corr[i]);
    if constexpr (F == Format::kQ4_0) {
      // d (x . nibbles - 8 sum x): the nibbles' offset of 8 taken back per token.
      acc[t] = _mm512_fmadd_ps(_mm512_add_ps(products, corr), d, acc[t]);
    } else {
      acc[t] = _mm512_fmadd_ps(products, d, acc[t]);
      if constexpr (F == Format::kQ4_1) acc[t] = _mm512_fmadd_ps(m, corr, acc[t]);
    }
  }
}

// Stage kStage of group_product's pipeline at block b: block b + 1's products issued (into the
// C tiles block b - 1 freed), block b's stored, and block b - 1's, stored a step ago, scaled
// into acc (scaling the products just stored would wait for the stores to land).
template <Format F, int kG, int kStage>
inline void pipeline_step(const RowGroup& w, const TokenGroup& x, int64_t K, int64_t b,
                          int32_t (&c)[2][2][kTile * kTile], __m512 (&acc)[kTile]) {
  const int64_t blocks = K / kBlockSize;
  if (b + 1 < blocks) block_product<F, 1 - kStage>(w, x, K, b + 1);
  tile_store<2 * kStage>(c[kStage][0]);
  tile_store<2 * kStage + 1>(c[kStage][1]);
  if (b > 0) scale_block<F, kG>(w, x, blocks, b - 1, c[1 - kStage], acc);
}

// y[t * y_stride + n] = x[t] . W[n] for the group's tokens (< tokens) and rows (< rows), over
// all blocks (at least one).
template <Format F, int kG>
inline void group_product(const RowGroup& w, const TokenGroup& x, int64_t K, int64_t rows,
                          int64_t tokens, float* y, int64_t y_stride) {
  const int64_t blocks = K / kBlockSize;
  alignas(64) int32_t c[2][2][kTile * kTile];
  __m512 acc[kTile];
  // Unrolled before the loop passes could turn it into a memset, which keeps acc in memory.
#pragma GCC unroll 16
  for (auto& a : acc) a = _mm512_setzero_ps();
  block_product<F, 0>(w, x, K, 0);
  for (int64_t b = 0; b < blocks; b += 2) {
    pipeline_step<F, kG, 0>(w, x, K, b, c, acc);
    if (b + 1 >= blocks) break;
    pipeline_step<F, kG, 1>(w, x, K, b + 1, c, acc);
  }
  scale_block<F, kG>(w, x, blocks, blocks - 1, c[(blocks - 1) % 2], acc);
  const auto live = static_cast<__mmask16>((1u << rows) - 1);
#pragma GCC unroll 16
  for (int t = 0; t < kG; ++t) {
    if (t < tokens) _mm512_mask_storeu_ps(y + t * y_stride, live, acc[t]);
  }
}

// `rows` rows of w against the T tokens of x (quantize_activations' groups of
// group_tokens(T)): y[t * y_stride + n] = x[t] . W[n].
template <Format F>
void dot_rows(const uint8_t* x, int64_t T, int64_t K, const uint8_t* w, int64_t rows,
              float* y, int64_t y_stride) {
  thread_local std::vector<uint8_t> scratch;
  const int64_t blocks = K / kBlockSize, row_bytes = blocks * block_bytes(F);
  if (blocks == 0) {
    for (int64_t t = 0; t < T; ++t) std::fill_n(y + t * y_stride, rows, 0.f);
    return;
  }
  const int64_t G = group_tokens(T);
  const auto run = [&]<int kG>() {
    configure_tiles(kG);
    for (int64_t n0 = 0; n0 < rows; n0 += kTile) {
      const int64_t group_rows = std::min<int64_t>(kTile, rows - n0);
      const RowGroup wg = prepare_rows<F>(w + n0 * row_bytes, K, group_rows, scratch);
      for (int64_t t0 = 0, g = 0; t0 < T; t0 += kG, ++g) {
        group_product<F, kG>(wg, token_group(x, kG, K, g), K, group_rows,
                             std::min<int64_t>(kG, T - t0), y + t0 * y_stride + n0, y_stride);
      }
    }
  };
  switch (G) {
    case 4: return run.template operator()<4>();
    case 8: return run.template operator()<8>();
    case 12: return run.template operator()<12>();
    default: return run.template operator()<16>();
  }
}

}  // namespace orca::cpu::quant::amx

#pragma GCC pop_options

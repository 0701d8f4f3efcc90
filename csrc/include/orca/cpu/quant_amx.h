// The quantized linear's AMX-INT8 path (Isa::kAmxInt8) for more than a couple of tokens, every
// format, on activations split into two int8 parts per 32-value block: hi = nearest-even(x / dx)
// with dx = max |x| / 127 (the VNNI path's rounding, quant_vnni.h), then the remainder's
// lo = nearest-even((x - hi dx) / dx_lo) with dx_lo = dx / 254, so x = hi dx + lo dx_lo + e
// with |e| <= dx / 508 = max |x| / 64516: about 15 bits of each block, finer than bfloat16.
// The weights are read per unit of 32 values (q6_K: 16, its scales' unit) as w = d q + m:
// signed quants without m where the format has no min (q8_0's int8, q4_0 / q5_0 / q6_K's
// unsigned quants less their zero), else unsigned quants and the unit's offset m (q4_1 /
// q5_1's m, q8_m's, q4_K / q5_K's -dmin mn), whose term m sum(x) the activations' sums give.
// Each unit of up to 16 tokens by 16 weight rows takes two tile products (hi and lo), exact in
// int32, scaled to float by the unit's activation and weight scales and summed over the units
// in registers.
// Tiles: A = a group of G tokens' hi or lo bytes of a unit (G rows, read in place), B = 16
// weight rows' unit in the VNNI layout (row r: weight row n's values 4r..4r+3 at bytes
// 4n..4n+3), unpacked per group of 16 weight rows into a scratch panel from the x16 layout
// (quant_rows16.h; rows in the file's layout are interleaved first); C = G x 16 int32. The tile
// products' cost grows with G (their rows), so a few tokens cost little.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "orca/cpu/amx_tiles.h"
#include "orca/cpu/quant_formats.h"
#include "orca/cpu/quant_rows16.h"
#include "orca/cpu/quant_vnni.h"
#include "orca/cpu/quant_vnni_rows16.h"

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c,amx-tile,amx-int8")

namespace orca::cpu::quant::amx {

constexpr int kTile = 16;  // the most tokens, and the weight rows, of a tile product
static_assert(kTile == kRowGroup);

// The values of a unit, which one weight scale d (and offset m) covers.
constexpr int64_t unit_values(Format f) { return f == Format::kQ6_K ? 16 : kBlockSize; }

// The tokens of each group for a call of T tokens: the groups (ceil(T / 16) of them) evenly
// filled, rounded up to a multiple of 4; the last group is padded with zero tokens.
constexpr int64_t group_tokens(int64_t T) {
  const int64_t groups = std::max<int64_t>(1, (T + kTile - 1) / kTile);
  return std::max<int64_t>(4, ((T + groups - 1) / groups + 3) / 4 * 4);
}
constexpr int64_t token_groups(int64_t T) { return (T + group_tokens(T) - 1) / group_tokens(T); }

// A group of G tokens as the tiles read it, group_bytes(G, K) bytes a group: hi [G, K] and
// lo [G, K] the two int8 parts, then per token and block [G, K / 32] the scales dx and dx_lo,
// and corr, the block's sum as rounded (dx sum hi + dx_lo sum lo), which the weights' offsets m
// multiply (formats with a min; unused otherwise). Tokens past T are zero.
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
inline void quantize_activations(const float* x, int64_t T, int64_t K, int64_t G,
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
      corr[b] = sum;
    }
  }
}

// The tiles of group_product's pipeline, which keeps two units in flight so that a unit's
// products are ready when they are scaled: stage s's C tiles 2s (hi) and 2s + 1 (lo), G rows of
// 16 int32, and its B tile 6 + s (unit / 4 rows of 64 bytes); the A tiles 4 (hi) and 5 (lo), G
// rows of `unit` bytes. Loaded at each call: other code on the thread (oneDNN's AMX GEMMs, the
// attention's tiles) may have configured the tiles otherwise.
inline void configure_tiles(int64_t G, int64_t unit) {
  cpu::amx::TileConfig config;
  for (int t = 0; t < 4; ++t) {
    config.colsb[t] = 4 * kTile;
    config.rows[t] = static_cast<uint8_t>(G);
  }
  for (int t = 0; t < 2; ++t) {
    config.colsb[4 + t] = static_cast<uint16_t>(unit);
    config.rows[4 + t] = static_cast<uint8_t>(G);
    config.colsb[6 + t] = 4 * kTile;
    config.rows[6 + t] = static_cast<uint8_t>(unit / 4);
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
// C += A . B on bytes, A signed (the activations), B signed or unsigned (has_min's quants).
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

// A group of 16 weight rows as tile B reads them: per 32 values, 8 rows of 64 bytes (b), then
// each unit's d and m as floats ([unit][row]; m for has_min's formats only).
struct RowGroup {
  const uint8_t* b;
  const float* d;
  const float* m;
};

// The group of 16 weight rows `group` (the x16 layout's, K values each) laid out in scratch.
template <Format F>
inline RowGroup prepare_rows(const uint8_t* group, int64_t K, std::vector<uint8_t>& scratch) {
  constexpr int kChunks = static_cast<int>(weights_per_block(F) / kBlockSize);  // per block
  constexpr int64_t kUnitsPerChunk = kBlockSize / unit_values(F);
  const int64_t chunks = K / kBlockSize, units = K / unit_values(F);
  const int64_t panel_bytes = chunks * kBlockSize * kTile;
  const int64_t scale_bytes = 2 * units * kTile * static_cast<int64_t>(sizeof(float));
  if (static_cast<int64_t>(scratch.size()) < panel_bytes + scale_bytes) {
    scratch.resize(panel_bytes + scale_bytes);
  }
  uint8_t* panel = scratch.data();
  auto* d = reinterpret_cast<float*>(scratch.data() + panel_bytes);
  float* m = d + units * kTile;
  for (int64_t blk = 0; blk < K / weights_per_block(F); ++blk) {
    const uint8_t* block = group + blk * kRowGroup * block_bytes(F);
    vnni::unrolled<kChunks>([&]<int c>() {
      const int64_t chunk = blk * kChunks + c, unit = chunk * kUnitsPerChunk;
      __m512i b[8];
      vnni::unpack_chunk<F, c>(block, b, d + unit * kTile, m + unit * kTile);
      auto* out = reinterpret_cast<__m512i*>(panel + chunk * kBlockSize * kTile);
      for (int r = 0; r < 8; ++r) _mm512_storeu_si512(out + r, b[r]);
    });
  }
  // The tiles' loads name no memory: the panel is stored before any tile reads it.
  asm volatile("" ::: "memory");
  return {panel, d, m};
}

// Unit u's hi and lo products into stage kStage's C tiles.
template <Format F, int kStage>
inline void unit_product(const RowGroup& w, const TokenGroup& x, int64_t K, int64_t u) {
  constexpr int kHi = 2 * kStage, kLo = 2 * kStage + 1, kB = 6 + kStage;
  constexpr bool kSigned = !vnni::has_min(F);
  constexpr int64_t kUnit = unit_values(F);
  tile_load<kB>(w.b + u * kUnit * kTile, 4 * kTile);
  tile_load<4>(x.hi + u * kUnit, K);
  tile_zero<kHi>();
  tile_dot<kSigned, kHi, 4, kB>();
  tile_load<5>(x.lo + u * kUnit, K);
  tile_zero<kLo>();
  tile_dot<kSigned, kLo, 5, kB>();
}

// acc[t] (16 weight rows' lanes) += unit u's scaled products, read from c (hi and lo, kG x
// 16 int32 each).
template <Format F, int kG>
inline void scale_unit(const RowGroup& w, const TokenGroup& x, int64_t K, int64_t u,
                       const int32_t (&c)[2][kTile * kTile], __m512 (&acc)[kTile]) {
  const int64_t blocks = K / kBlockSize, b = u * unit_values(F) / kBlockSize;
  const __m512 d = _mm512_loadu_ps(w.d + u * kTile);
  __m512 m;
  if constexpr (vnni::has_min(F)) m = _mm512_loadu_ps(w.m + u * kTile);
#pragma GCC unroll 16
  for (int t = 0; t < kG; ++t) {
    const int64_t i = t * blocks + b;
    const __m512 hi = _mm512_cvtepi32_ps(_mm512_loadu_si512(c[0] + t * kTile));
    const __m512 lo = _mm512_cvtepi32_ps(_mm512_loadu_si512(c[1] + t * kTile));
    const __m512 products = _mm512_fmadd_ps(lo, _mm512_set1_ps(x.dx_lo[i]),
                                            _mm512_mul_ps(hi, _mm512_set1_ps(x.dx[i])));
    acc[t] = _mm512_fmadd_ps(products, d, acc[t]);
    if constexpr (vnni::has_min(F)) acc[t] = _mm512_fmadd_ps(m, _mm512_set1_ps(x.corr[i]), acc[t]);
  }
}

// Stage kStage of group_product's pipeline at unit u: unit u + 1's products issued (into the
// C tiles unit u - 1 freed), unit u's stored, and unit u - 1's, stored a step ago, scaled
// into acc (scaling the products just stored would wait for the stores to land).
template <Format F, int kG, int kStage>
inline void pipeline_step(const RowGroup& w, const TokenGroup& x, int64_t K, int64_t u,
                          int32_t (&c)[2][2][kTile * kTile], __m512 (&acc)[kTile]) {
  const int64_t units = K / unit_values(F);
  if (u + 1 < units) unit_product<F, 1 - kStage>(w, x, K, u + 1);
  tile_store<2 * kStage>(c[kStage][0]);
  tile_store<2 * kStage + 1>(c[kStage][1]);
  if (u > 0) scale_unit<F, kG>(w, x, K, u - 1, c[1 - kStage], acc);
}

// y[t * y_stride + n] = x[t] . W[n] for the group's tokens (< tokens) and rows (< rows), over
// all units (at least one).
template <Format F, int kG>
inline void group_product(const RowGroup& w, const TokenGroup& x, int64_t K, int64_t rows,
                          int64_t tokens, float* y, int64_t y_stride) {
  const int64_t units = K / unit_values(F);
  alignas(64) int32_t c[2][2][kTile * kTile];
  __m512 acc[kTile];
  // Unrolled before the loop passes could turn it into a memset, which keeps acc in memory.
#pragma GCC unroll 16
  for (auto& a : acc) a = _mm512_setzero_ps();
  unit_product<F, 0>(w, x, K, 0);
  for (int64_t u = 0; u < units; u += 2) {
    pipeline_step<F, kG, 0>(w, x, K, u, c, acc);
    if (u + 1 >= units) break;
    pipeline_step<F, kG, 1>(w, x, K, u + 1, c, acc);
  }
  scale_unit<F, kG>(w, x, K, units - 1, c[(units - 1) % 2], acc);
  const auto live = static_cast<__mmask16>((1u << rows) - 1);
#pragma GCC unroll 16
  for (int t = 0; t < kG; ++t) {
    if (t < tokens) _mm512_mask_storeu_ps(y + t * y_stride, live, acc[t]);
  }
}

// The group of 16 rows from n0 of w in the x16 layout: w's own (rows16), or w's rows n0 to
// n0 + 15 (those past `rows` zero) interleaved into scratch.
template <Format F>
inline const uint8_t* row_group(const uint8_t* w, bool rows16, int64_t K, int64_t n0,
                                int64_t rows, std::vector<uint8_t>& scratch) {
  const int64_t row = row_bytes(F, K);
  if (rows16) return w + n0 * row;
  const int64_t live = std::min<int64_t>(kRowGroup, rows - n0);
  scratch.resize(2 * kRowGroup * row);
  const uint8_t* rows_in = w + n0 * row;
  if (live < kRowGroup) {
    // A last group short of 16 rows, padded with zero blocks (zero scales).
    std::memcpy(scratch.data(), rows_in, live * row);
    std::memset(scratch.data() + live * row, 0, (kRowGroup - live) * row);
    rows_in = scratch.data();
  }
  uint8_t* group = scratch.data() + kRowGroup * row;
  for (int64_t blk = 0; blk < K / weights_per_block(F); ++blk) {
    rows16::convert_block<F, true>(rows_in + blk * block_bytes(F),
                                   group + blk * kRowGroup * block_bytes(F), row);
  }
  return group;
}

// `rows` rows of w (the x16 layout's if rows16: rows a multiple of 16) against the T tokens of
// x (quantize_activations' groups of group_tokens(T)): y[t * y_stride + n] = x[t] . W[n].
template <Format F>
void dot_rows(const uint8_t* x, int64_t T, int64_t K, const uint8_t* w, bool rows16,
              int64_t rows, float* y, int64_t y_stride) {
  thread_local std::vector<uint8_t> scratch, interleaved;
  if (K == 0) {
    for (int64_t t = 0; t < T; ++t) std::fill_n(y + t * y_stride, rows, 0.f);
    return;
  }
  const int64_t G = group_tokens(T);
  const auto run = [&]<int kG>() {
    configure_tiles(kG, unit_values(F));
    for (int64_t n0 = 0; n0 < rows; n0 += kTile) {
      const int64_t group_rows = std::min<int64_t>(kTile, rows - n0);
      const RowGroup wg =
          prepare_rows<F>(row_group<F>(w, rows16, K, n0, rows, interleaved), K, scratch);
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

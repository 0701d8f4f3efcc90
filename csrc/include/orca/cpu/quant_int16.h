// The quantized linear's GEMM for prompt-sized batches on AVX-512 VNNI CPUs without AMX, for
// every format: the activations rounded to int16 per 32-value block (dx = max |x| / 32767,
// nearest even: within max |x| / 65534 of each block, as fine as the int8 paths' two parts),
// a panel of weight rows unpacked once into signed int16 quants with one float scale per group
// (32 weights; q6_K's 16) and, for the formats with a min, one float offset per 32, and
// vpdpwssd multiplying 16 tokens' int16 pairs by a broadcast pair of a row's quants into int32
// lanes exactly; each group's int32 sums are scaled to float by the weights' scale times the
// tokens' dx, the offsets taken as the tokens' block sums.
// Tokens lie in the vector lanes (tiles of 16), so the rows are read as the file stores them
// (no transposed panel) and one activation layout serves every row.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "orca/cpu/quant_formats.h"
#include "orca/cpu/quant_rows16.h"
#include "orca/cpu/quant_vnni.h"
#include "orca/cpu/quant_vnni_rows16.h"

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")

namespace orca::cpu::quant::int16 {

constexpr int64_t kTileTokens = 16;

// Weights per scale: a block (a K-quant's sub-block) of 32, q6_K's 16.
constexpr int64_t group_weights(Format f) { return f == Format::kQ6_K ? 16 : kBlockSize; }

// A tile of 16 tokens of K values: int16 pairs [K / 2][16] (lane l: token l's values 2i and
// 2i + 1), then per 32-value block dx [K / 32][16] and dx times the block's sum of quants
// [K / 32][16] (the offsets' term). Tokens past T are zero.
constexpr int64_t tile_bytes(int64_t K) {
  return K * kTileTokens * 2 + 2 * (K / kBlockSize) * kTileTokens * 4;
}

inline int64_t tiles(int64_t T) { return (T + kTileTokens - 1) / kTileTokens; }

// Tile `tile` of x [T, K] (K a multiple of 32) into out (tile_bytes(K)).
inline void quantize_tile(const float* x, int64_t T, int64_t K, int64_t tile, uint8_t* out) {
  const int64_t blocks = K / kBlockSize;
  auto* pairs = reinterpret_cast<int32_t*>(out);
  auto* dx = reinterpret_cast<float*>(out + K * kTileTokens * 2);
  float* sums = dx + blocks * kTileTokens;
  const int64_t t0 = tile * kTileTokens, count = std::min(kTileTokens, T - t0);
  if (count < kTileTokens) std::memset(out, 0, tile_bytes(K));  // the lanes past T
  const __m512 sign_off = _mm512_castsi512_ps(_mm512_set1_epi32(0x7fffffff));
  for (int64_t l = 0; l < count; ++l) {
    const float* row = x + (t0 + l) * K;
    for (int64_t b = 0; b < blocks; ++b) {
      const __m512 v0 = _mm512_loadu_ps(row + b * kBlockSize);
      const __m512 v1 = _mm512_loadu_ps(row + b * kBlockSize + 16);
      const float amax = _mm512_reduce_max_ps(
          _mm512_max_ps(_mm512_and_ps(v0, sign_off), _mm512_and_ps(v1, sign_off)));
      const float d = amax / 32767.f;
      const __m512 inverse = _mm512_set1_ps(d > 0.f ? 1.f / d : 0.f);
      // Nearest even (the default rounding), within int16 by construction; saturated anyway.
      const __m512i q0 = _mm512_cvtps_epi32(_mm512_mul_ps(v0, inverse));
      const __m512i q1 = _mm512_cvtps_epi32(_mm512_mul_ps(v1, inverse));
      dx[b * kTileTokens + l] = d;
      sums[b * kTileTokens + l] =
          d * static_cast<float>(_mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1)));
      // 32 int16 values as 16 int32 pairs, pair i to lane l of row b * 16 + i.
      alignas(64) int32_t packed[16];
      _mm512_store_si512(
          packed, _mm512_inserti64x4(_mm512_castsi256_si512(_mm512_cvtsepi32_epi16(q0)),
                                     _mm512_cvtsepi32_epi16(q1), 1));
      int32_t* column = pairs + b * 16 * kTileTokens + l;
      for (int i = 0; i < 16; ++i) column[i * kTileTokens] = packed[i];
    }
  }
}

// Rows [0, rows) of w (row_bytes(F, K) each) unpacked for gemm_tiles into `padded` rows (the
// rest zero): quants [padded][K] int16 (the format's zero subtracted: q8_0's int8, q4_0's q - 8,
// q5_0's q - 16, q6_K's q - 32; the formats with a min keep q), scales [padded][K /
// group_weights(F)] (d, d sc; exact products as ggml computes them) and offsets [padded][K / 32]
// (q4_1 / q5_1's m, q4_K / q5_K's -dmin mn; written only for the formats with a min).
template <Format F>
void unpack_rows(const uint8_t* w, int64_t K, int64_t rows, int64_t padded, int16_t* quants,
                 float* scales, float* offsets) {
  const int64_t blocks = K / kBlockSize, pairs = (blocks + 1) / 2;
  const int64_t groups = K / group_weights(F), bytes_per_row = row_bytes(F, K);
  const __m256i zero = _mm256_set1_epi16(static_cast<int16_t>(vnni::quant_zero(F)));
  for (int64_t r = 0; r < rows; ++r) {
    const uint8_t* row = w + r * bytes_per_row;
    int16_t* q = quants + r * K;
    float* scale = scales + r * groups;
    float* offset = offsets + r * blocks;
    __m512 packed = _mm512_setzero_ps();
    for (int64_t p = 0; p < pairs; ++p) {
      if constexpr (vnni::has_packed_scales(F)) {
        if (p % 4 == 0) packed = vnni::packed_scales(row + p / 4 * block_bytes(F));
      }
      __m512i bytes;
      __m512 d, m = _mm512_setzero_ps();
      vnni::weight_pair<F>(row, p, blocks, packed, bytes, d, m);
      // The interleaved formats' [b0 0-15 | b1 0-15 | b0 16-31 | b1 16-31] in weight order.
      if constexpr (vnni::interleaved_pairs(F)) {
        bytes = _mm512_shuffle_i64x2(bytes, bytes, _MM_SHUFFLE(3, 1, 2, 0));
      }
      const bool both = 2 * p + 1 < blocks;
      for (int half = 0; half < (both ? 2 : 1); ++half) {
        const __m256i b = half ? _mm512_extracti64x4_epi64(bytes, 1)
                               : _mm512_castsi512_si256(bytes);
        const __m256i lo = _mm256_sub_epi16(_mm256_cvtepu8_epi16(_mm256_castsi256_si128(b)), zero);
        const __m256i hi =
            _mm256_sub_epi16(_mm256_cvtepu8_epi16(_mm256_extracti128_si256(b, 1)), zero);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + 64 * p + 32 * half), lo);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + 64 * p + 32 * half + 16), hi);
      }
      // Lane l of d and m covers bytes 4l..4l + 3 of weight_pair's order.
      alignas(64) float lane_d[16], lane_m[16];
      _mm512_store_ps(lane_d, d);
      _mm512_store_ps(lane_m, m);
      if constexpr (F == Format::kQ6_K) {
        for (int g = 0; g < 4; ++g) scale[4 * p + g] = lane_d[4 * g];
      } else {
        const int second = vnni::interleaved_pairs(F) ? 4 : 8;  // the first lane of block 1
        scale[2 * p] = lane_d[0];
        if (vnni::has_min(F)) offset[2 * p] = lane_m[0];
        if (both) {
          scale[2 * p + 1] = lane_d[second];
          if (vnni::has_min(F)) offset[2 * p + 1] = lane_m[second];
        }
      }
    }
  }
  std::memset(quants + rows * K, 0, (padded - rows) * K * sizeof(int16_t));
  std::memset(scales + rows * groups, 0, (padded - rows) * groups * sizeof(float));
  std::memset(offsets + rows * blocks, 0, (padded - rows) * blocks * sizeof(float));
}

// The quant vectors b of a chunk of 16 rows (vector v: values 4v to 4v + 3 of row r in dword r)
// as each row's 32 values widened to int16 (row r at quants + r * K; bytes signed or unsigned):
// an 8 x 16 dword transpose in registers. After the unpacks, u[k] (values 0-15) and u[4 + k]
// (16-31) hold rows k, 4 + k, 8 + k and 12 + k in their 128-bit lanes 0 to 3.
template <bool kSigned>
inline void store_rows_int16(const __m512i (&b)[8], int64_t K, int16_t* quants) {
  __m512i t[8], u[8];
  for (int i = 0; i < 4; ++i) {
    t[2 * i] = _mm512_unpacklo_epi32(b[2 * i], b[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(b[2 * i], b[2 * i + 1]);
  }
  for (int half = 0; half < 2; ++half) {
    const __m512i* h = t + 4 * half;
    u[4 * half] = _mm512_unpacklo_epi64(h[0], h[2]);
    u[4 * half + 1] = _mm512_unpackhi_epi64(h[0], h[2]);
    u[4 * half + 2] = _mm512_unpacklo_epi64(h[1], h[3]);
    u[4 * half + 3] = _mm512_unpackhi_epi64(h[1], h[3]);
  }
  const auto widen = [](__m256i bytes) {
    return kSigned ? _mm512_cvtepi8_epi16(bytes) : _mm512_cvtepu8_epi16(bytes);
  };
  const auto store = [&](int64_t r, __m512i two_rows) {
    _mm512_storeu_si512(quants + r * K, widen(_mm512_castsi512_si256(two_rows)));
    _mm512_storeu_si512(quants + (r + 4) * K, widen(_mm512_extracti64x4_epi64(two_rows, 1)));
  };
  constexpr int kOrder = _MM_SHUFFLE(3, 1, 2, 0);  // [a.0, b.0, a.1, b.1] from [a.0, a.1, b.0, b.1]
  for (int k = 0; k < 4; ++k) {
    const __m512i first = _mm512_shuffle_i32x4(u[k], u[4 + k], _MM_SHUFFLE(1, 0, 1, 0));
    const __m512i second = _mm512_shuffle_i32x4(u[k], u[4 + k], _MM_SHUFFLE(3, 2, 3, 2));
    store(k, _mm512_shuffle_i32x4(first, first, kOrder));
    store(8 + k, _mm512_shuffle_i32x4(second, second, kOrder));
  }
}

// unpack_rows on rows in the x16 layout (rows a multiple of kRowGroup): each chunk's quant
// vectors and scales as the AMX tiles unpack them, transposed to rows in registers.
template <Format F>
void unpack_rows16(const uint8_t* w, int64_t K, int64_t rows, int64_t padded, int16_t* quants,
                   float* scales, float* offsets) {
  constexpr int kChunks = static_cast<int>(weights_per_block(F) / kBlockSize);
  constexpr int64_t kGroupsPerChunk = kBlockSize / group_weights(F);
  const int64_t groups = K / group_weights(F), blocks = K / kBlockSize;
  const int64_t group_bytes = kRowGroup * row_bytes(F, K);
  for (int64_t g = 0; g < rows / kRowGroup; ++g) {
    for (int64_t blk = 0; blk < K / weights_per_block(F); ++blk) {
      const uint8_t* block = w + g * group_bytes + blk * kRowGroup * block_bytes(F);
      vnni::unrolled<kChunks>([&]<int c>() {
        const int64_t chunk = blk * kChunks + c;
        __m512i b[8];
        alignas(64) float d[2 * kRowGroup], m[kRowGroup];
        vnni::unpack_chunk<F, c>(block, b, d, m);
        store_rows_int16<!vnni::has_min(F)>(b, K, quants + g * kRowGroup * K + chunk * kBlockSize);
        for (int64_t r = 0; r < kRowGroup; ++r) {
          const int64_t row = g * kRowGroup + r;
          for (int64_t i = 0; i < kGroupsPerChunk; ++i) {
            scales[row * groups + chunk * kGroupsPerChunk + i] = d[i * kRowGroup + r];
          }
          if constexpr (vnni::has_min(F)) offsets[row * blocks + chunk] = m[r];
        }
      });
    }
  }
  std::memset(quants + rows * K, 0, (padded - rows) * K * sizeof(int16_t));
  std::memset(scales + rows * groups, 0, (padded - rows) * groups * sizeof(float));
  std::memset(offsets + rows * blocks, 0, (padded - rows) * blocks * sizeof(float));
}

// kRows rows of unpacked weights against kTiles tiles of tokens (tile_bytes(K) apart):
// out[r][16 i + l] = token l of tile i . row r.
template <Format F, int kRows, int kTiles>
inline void gemm_block(const uint8_t* x, int64_t K, const int16_t* quants, const float* scales,
                       const float* offsets, float* out) {
  constexpr int64_t G = group_weights(F);
  const int64_t groups = K / G, blocks = K / kBlockSize, stride = tile_bytes(K);
  const int32_t* pairs[kTiles];
  const float* dx[kTiles];
  const float* sums[kTiles];
  for (int i = 0; i < kTiles; ++i) {
    pairs[i] = reinterpret_cast<const int32_t*>(x + i * stride);
    dx[i] = reinterpret_cast<const float*>(x + i * stride + K * kTileTokens * 2);
    sums[i] = dx[i] + blocks * kTileTokens;
  }
  __m512 acc[kRows][kTiles];
  for (auto& row : acc) {
    for (auto& a : row) a = _mm512_setzero_ps();
  }
  for (int64_t g = 0; g < groups; ++g) {
    __m512i dot[kRows][kTiles];
    for (auto& row : dot) {
      for (auto& a : row) a = _mm512_setzero_si512();
    }
#pragma GCC unroll 16
    for (int64_t j = 0; j < G / 2; ++j) {
      const int64_t i = g * (G / 2) + j;
      __m512i xv[kTiles];
      for (int t = 0; t < kTiles; ++t) xv[t] = _mm512_loadu_si512(pairs[t] + i * kTileTokens);
      for (int r = 0; r < kRows; ++r) {
        int32_t w;
        std::memcpy(&w, quants + r * K + 2 * i, sizeof(w));
        const __m512i wv = _mm512_set1_epi32(w);
        for (int t = 0; t < kTiles; ++t) dot[r][t] = _mm512_dpwssd_epi32(dot[r][t], xv[t], wv);
      }
    }
    const int64_t b = g * G / kBlockSize;
    __m512 dxv[kTiles];
    for (int t = 0; t < kTiles; ++t) dxv[t] = _mm512_loadu_ps(dx[t] + b * kTileTokens);
    for (int r = 0; r < kRows; ++r) {
      const __m512 s = _mm512_set1_ps(scales[r * groups + g]);
      for (int t = 0; t < kTiles; ++t) {
        acc[r][t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[r][t]), _mm512_mul_ps(s, dxv[t]),
                                    acc[r][t]);
      }
    }
    if constexpr (vnni::has_min(F)) {
      for (int r = 0; r < kRows; ++r) {
        const __m512 m = _mm512_set1_ps(offsets[r * blocks + b]);
        for (int t = 0; t < kTiles; ++t) {
          acc[r][t] = _mm512_fmadd_ps(m, _mm512_loadu_ps(sums[t] + b * kTileTokens), acc[r][t]);
        }
      }
    }
  }
  for (int r = 0; r < kRows; ++r) {
    for (int t = 0; t < kTiles; ++t) _mm512_storeu_ps(out + r * kTiles * 16 + t * 16, acc[r][t]);
  }
}

constexpr int kGemmRows = 6, kGemmTiles = 2;

// The rows unpack_rows pads a panel of `rows` to.
constexpr int64_t padded_rows(int64_t rows) {
  return (rows + kGemmRows - 1) / kGemmRows * kGemmRows;
}

// y[t * y_stride + r] = x[t] . W[r] for t < T, r < rows: x as quantize_tile's tiles, W as
// unpack_rows laid it out.
template <Format F>
void gemm_rows(const uint8_t* x, int64_t T, int64_t K, const int16_t* quants,
               const float* scales, const float* offsets, int64_t rows, float* y,
               int64_t y_stride) {
  const int64_t groups = K / group_weights(F), blocks = K / kBlockSize;
  const int64_t n_tiles = tiles(T);
  alignas(64) float out[kGemmRows * kGemmTiles * kTileTokens];
  for (int64_t i0 = 0; i0 < n_tiles; i0 += kGemmTiles) {
    const int64_t count = std::min<int64_t>(kGemmTiles, n_tiles - i0);
    const uint8_t* xi = x + i0 * tile_bytes(K);
    for (int64_t r0 = 0; r0 < rows; r0 += kGemmRows) {
      const int16_t* q = quants + r0 * K;
      const float* s = scales + r0 * groups;
      const float* o = offsets + r0 * blocks;
      if (count == 1) {
        gemm_block<F, kGemmRows, 1>(xi, K, q, s, o, out);
      } else {
        gemm_block<F, kGemmRows, kGemmTiles>(xi, K, q, s, o, out);
      }
      const int64_t t0 = i0 * kTileTokens;
      const int64_t tokens = std::min(count * kTileTokens, T - t0);
      const int64_t n = std::min<int64_t>(kGemmRows, rows - r0);
      for (int64_t t = 0; t < tokens; ++t) {
        for (int64_t r = 0; r < n; ++r) {
          y[(t0 + t) * y_stride + r0 + r] = out[r * count * kTileTokens + t];
        }
      }
    }
  }
}

}  // namespace orca::cpu::quant::int16

#pragma GCC pop_options

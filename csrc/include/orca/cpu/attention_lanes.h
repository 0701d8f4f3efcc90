// Prefill-like items (orca/cpu/attention.h) with the query rows as vector lanes: the float
// tile kernels, the bfloat16 pair kernels (AVX512-BF16) and attend_lanes over an item's rows.
#pragma once

#include "orca/cpu/attention_common.h"

namespace orca::cpu {

// ---- Prefill-like items (many query rows per KV head): the query rows are the vector lanes.
// Q is transposed once per item to [D][W] (W = rows rounded up to 16), so a KV tile's scores
// come out as [tile][W] vectors from K rows read in cache layout (no per-tile transpose), and
// the online softmax (max, exp, sum over the tile) is element-wise across rows.

constexpr int64_t kMaxLaneRows = 64;  // rows per pass: 4 vectors of scores per key
constexpr int kKeysPerStep = 4;       // keys scored together (4 x 4 accumulators in registers)

// Stores one step's scores x[jj][rv] (keys j0 + jj) into s[j][W], as -inf where the key is
// not visible to the row, outside [row_start, row_pos] (checked only when `masked`: the tile
// crosses the causal diagonal or a window's start, or is short), and folds them into each
// row's tile maximum.
template <int kRV>
inline void store_scores(const vec16 (&x)[kKeysPerStep][kRV], int64_t j0, int64_t nt,
                         bool masked, const int16v* row_pos, const int16v* row_start, int64_t t0,
                         float* s, vec16* tile_max) {
  constexpr int W = kRV * 16;
  const vec16 neg_inf = vec16{} + kNegInf;
  for (int jj = 0; jj < kKeysPerStep; ++jj) {
    // Keys past the tile's end are visible to no row.
    const int key_pos = j0 + jj < nt ? static_cast<int>(t0 + j0 + jj) : INT32_MAX;
    for (int rv = 0; rv < kRV; ++rv) {
      const vec16 v =
          masked ? ((row_pos[rv] >= key_pos) & (row_start[rv] <= key_pos) ? x[jj][rv] : neg_inf)
                 : x[jj][rv];
      store16(s + (j0 + jj) * W + 16 * rv, v);
      tile_max[rv] = tile_max[rv] > v ? tile_max[rv] : v;
    }
  }
}

// Scores of one KV tile, s[j][W] = q_r . k_j (masked as store_scores says), and each row's
// maximum in tile_max. qt is Q^T: pre-scaled floats ([kD][W]) against float K rows, or
// bfloat16 pairs ([kD/2][W], scaled here) against bf16 K rows (AVX512-BF16). k_rows has nt
// rows, padded to a whole step with zero rows.
template <int kD, int kRV, typename lane_t, typename row_t>
inline void tile_scores(const lane_t* qt, const row_t* const* k_rows, int64_t nt, bool masked,
                        const int16v* row_pos, const int16v* row_start, int64_t t0, float scale,
                        float* s, vec16* tile_max) {
  constexpr int W = kRV * 16;
  for (int rv = 0; rv < kRV; ++rv) tile_max[rv] = vec16{} + kNegInf;
  for (int64_t j0 = 0; j0 < nt; j0 += kKeysPerStep) {
    vec16 acc[kKeysPerStep][kRV] = {};
#if defined(__AVX512BF16__)
    if constexpr (std::is_same_v<lane_t, uint32_t>) {
      lane_pair_dots<kKeysPerStep, kRV>(qt, W, k_rows + j0, kD / 2, acc);
      for (auto& per_key : acc) {
        for (auto& v : per_key) v *= scale;
      }
    } else
#endif
    {
      lane_dots<kKeysPerStep, kRV>(qt, W, k_rows + j0, kD, acc);
    }
    store_scores<kRV>(acc, j0, nt, masked, row_pos, row_start, t0, s, tile_max);
  }
}

// Online-softmax step for one tile: scores in s become probabilities exp(s - m_new), and each
// row's (m, l) is updated; alpha = exp(m_old - m_new) is the factor its acc must be scaled by.
template <int kRV>
inline void tile_softmax(float* s, int64_t nt, const vec16* tile_max, float* m, float* l,
                         float* alpha) {
  constexpr int W = kRV * 16;
  const vec16 neg_inf = vec16{} + kNegInf, zero = vec16{};
  for (int rv = 0; rv < kRV; ++rv) {
    const vec16 m_old = load16(m + 16 * rv);
    const vec16 m_new = m_old > tile_max[rv] ? m_old : tile_max[rv];
    // A row that has seen no key yet (m = -inf) has acc = l = 0: scale by 0, never by NaN.
    const vec16 a = m_old == neg_inf ? zero : fast_exp(m_old - m_new);
    const vec16 base = m_new == neg_inf ? zero : m_new;
    vec16 sum = zero;
    for (int64_t j = 0; j < nt; ++j) {
      const vec16 x = load16(s + j * W + 16 * rv);
      const vec16 p = x == neg_inf ? zero : fast_exp(x - base);
      store16(s + j * W + 16 * rv, p);
      sum += p;
    }
    store16(l + 16 * rv, load16(l + 16 * rv) * a + sum);
    store16(m + 16 * rv, m_new);
    store16(alpha + 16 * rv, a);
  }
}

// Rows whose output accumulators stay in registers while a tile's V rows stream past.
template <int kD>
constexpr int pv_rows() {
  constexpr int kNV = kD / 16;
  return kNV <= 2 ? 8 : (kNV <= 5 ? 4 : 2);
}

// acc[r] = acc[r] * alpha[r] + sum_j p[j][r] v_j for the W rows (acc is [W][kD]).
template <int kD>
inline void tile_pv(const float* p, int64_t W, const float* const* v_rows, int64_t nt,
                    const float* alpha, float* acc) {
  constexpr int kNV = kD / 16, kRB = pv_rows<kD>();
  for (int64_t r0 = 0; r0 < W; r0 += kRB) {
    vec16 o[kRB][kNV];
    for (int rb = 0; rb < kRB; ++rb) {
      for (int c = 0; c < kNV; ++c) {
        o[rb][c] = load16(acc + (r0 + rb) * kD + 16 * c) * alpha[r0 + rb];
      }
    }
    for (int64_t j = 0; j < nt; ++j) {
      vec16 v[kNV];
      for (int c = 0; c < kNV; ++c) v[c] = load16(v_rows[j] + 16 * c);
      for (int rb = 0; rb < kRB; ++rb) {
        const float pj = p[j * W + r0 + rb];
        for (int c = 0; c < kNV; ++c) o[rb][c] += pj * v[c];
      }
    }
    for (int rb = 0; rb < kRB; ++rb) {
      for (int c = 0; c < kNV; ++c) store16(acc + (r0 + rb) * kD + 16 * c, o[rb][c]);
    }
  }
}

#if defined(__AVX512BF16__)
// Prefill-like items over bfloat16 caches on CPUs with AVX512-BF16: Q.K and P.V as dot
// products of bf16 pairs
// (vdpbf16ps: exact products, float sums), half the instructions of widening to float. q and
// K stay exact (the scale is applied to the scores); P is rounded to bfloat16 for P.V, as GPU
// flash attention does. "Pairs" are 32-bit words of two bf16, the lower one first.

// 16 bf16 of a and 16 of b interleaved into 16 pairs (a_i, b_i).
inline __m512i interleave_bf16(__m256i a, __m256i b) {
  static constexpr auto kIndex = [] {
    std::array<uint16_t, 32> index{};
    for (int i = 0; i < 16; ++i) {
      index[2 * i] = static_cast<uint16_t>(i);
      index[2 * i + 1] = static_cast<uint16_t>(32 + i);  // bit 5: from b
    }
    return index;
  }();
  return _mm512_permutex2var_epi16(_mm512_castsi256_si512(a), _mm512_loadu_si512(kIndex.data()),
                                   _mm512_castsi256_si512(b));
}

// Probabilities p [2 * num_pairs][W] (float) to pairs [num_pairs][W] of keys (2i, 2i+1).
template <int kRV>
inline void pack_p_pairs(const float* p, int64_t num_pairs, uint32_t* p_pairs) {
  constexpr int W = kRV * 16;
  for (int64_t i = 0; i < num_pairs; ++i) {
    for (int rv = 0; rv < kRV; ++rv) {
      const __m256i even = (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(p + 2 * i * W + 16 * rv));
      const __m256i odd =
          (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(p + (2 * i + 1) * W + 16 * rv));
      _mm512_storeu_si512(p_pairs + i * W + 16 * rv, interleave_bf16(even, odd));
    }
  }
}

// V rows (bf16, 2 * num_pairs of them) to pairs [num_pairs][kD] of rows (2i, 2i+1).
template <int kD>
inline void pack_v_pairs(const uint16_t* const* v_rows, int64_t num_pairs, uint32_t* v_pairs) {
  for (int64_t i = 0; i < num_pairs; ++i) {
    for (int c = 0; c < kD / 16; ++c) {
      const __m256i even =
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(v_rows[2 * i] + 16 * c));
      const __m256i odd =
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(v_rows[2 * i + 1] + 16 * c));
      _mm512_storeu_si512(v_pairs + i * kD + 16 * c, interleave_bf16(even, odd));
    }
  }
}

// tile_pv on pairs of keys.
template <int kD>
inline void tile_pv_bf16(const uint32_t* p_pairs, int64_t W, const uint32_t* v_pairs,
                         int64_t num_pairs, const float* alpha, float* acc) {
  constexpr int kNV = kD / 16, kRB = pv_rows<kD>();
  for (int64_t r0 = 0; r0 < W; r0 += kRB) {
    __m512 o[kRB][kNV];
    for (int rb = 0; rb < kRB; ++rb) {
      const __m512 scale = _mm512_set1_ps(alpha[r0 + rb]);
      for (int c = 0; c < kNV; ++c) {
        o[rb][c] = _mm512_mul_ps(_mm512_loadu_ps(acc + (r0 + rb) * kD + 16 * c), scale);
      }
    }
    for (int64_t i = 0; i < num_pairs; ++i) {
      __m512bh v[kNV];
      for (int c = 0; c < kNV; ++c) v[c] = (__m512bh)_mm512_loadu_si512(v_pairs + i * kD + 16 * c);
      for (int rb = 0; rb < kRB; ++rb) {
        const __m512bh p = (__m512bh)_mm512_set1_epi32(static_cast<int>(p_pairs[i * W + r0 + rb]));
        for (int c = 0; c < kNV; ++c) o[rb][c] = _mm512_dpbf16_ps(o[rb][c], v[c], p);
      }
    }
    for (int rb = 0; rb < kRB; ++rb) {
      for (int c = 0; c < kNV; ++c) _mm512_storeu_ps(acc + (r0 + rb) * kD + 16 * c, o[rb][c]);
    }
  }
}
#endif

// Rows [row_begin, row_begin + count) of KV head h's rows of a prefill-like item (count <=
// 16 * kRV) against the item's KV range, as vector lanes; leaves their (acc, m, l) in sc.acc,
// sc.m and sc.l at the item's row numbers, row_base being the head's first. kBf16Dot: the
// bfloat16 pair kernels (scalar_t is bfloat16); kInt8: an int8 cache, rows dequantized.
template <int kD, int kRV, bool kBf16Dot, bool kInt8, typename scalar_t>
void attend_lanes(const AttentionArgs<scalar_t>& a, const AttentionWork& w, int64_t h,
                  int64_t row_base, int64_t row_begin, int64_t count, int64_t first_pos,
                  AttentionScratch& sc) {
  constexpr int W = kRV * 16;
  const int64_t G = a.num_q_heads / a.num_kv_heads, Hkv = a.num_kv_heads;
  const int32_t* blocks = a.block_table + w.request * a.max_blocks;

  // Q^T: floats pre-scaled, or pairs as they are. Padding lanes are zero, at position -1:
  // they see no key in masked tiles, and their results are never read.
  if constexpr (kBf16Dot) {
    sc.q_pairs.assign(kD / 2 * W, 0);
  } else {
    sc.qt.assign(kD * W, 0.f);
  }
  // Each row sees the keys [start, pos].
  alignas(64) int32_t pos[W], start[W];
  for (int r = 0; r < W; ++r) {
    pos[r] = r < count ? first_pos + (row_begin + r) / G : -1;
    start[r] = static_cast<int32_t>(window_start(std::max(pos[r], 0), a.window));
  }
  for (int64_t r = 0; r < count; ++r) {
    const RowPlace at = row_place(a, w, row_base + row_begin + r);
    const scalar_t* src = a.q + at.token * a.q_stride_token + at.q_head * a.q_stride_head;
    if constexpr (kBf16Dot) {
      for (int i = 0; i < kD / 2; ++i) std::memcpy(&sc.q_pairs[i * W + r], src + 2 * i, 4);
    } else if constexpr (kInt8) {
      float q[kD];  // rotated as the keys are stored
      for (int d = 0; d < kD; ++d) q[d] = static_cast<float>(src[d]) * a.scale;
      rotate_query(q, kD);
      for (int d = 0; d < kD; ++d) sc.qt[d * W + r] = q[d];
    } else {
      for (int d = 0; d < kD; ++d) sc.qt[d * W + r] = static_cast<float>(src[d]) * a.scale;
    }
  }
  int16v row_pos[kRV], row_start[kRV];
  std::memcpy(row_pos, pos, sizeof(pos));
  std::memcpy(row_start, start, sizeof(start));
  const auto* q_lanes = [&] {
    if constexpr (kBf16Dot) {
      return sc.q_pairs.data();
    } else {
      return sc.qt.data();
    }
  }();
  // Positions grow with the row: the first row's is the least, the last row's start the most.
  const int64_t min_pos = pos[0], max_start = start[count - 1];

  sc.lane_acc.assign(W * kD, 0.f);
  sc.lane_m.assign(W, kNegInf);
  sc.lane_l.assign(W, 0.f);
  sc.alpha.resize(W);
  sc.p.resize((kKvTile + kKeysPerStep) * W);
  sc.zero_row.assign(kD, 0.f);
  if constexpr (kBf16Dot) {
    sc.p_pairs.resize(kKvTile / 2 * W);
    sc.v_pairs.resize(kKvTile / 2 * kD);
  } else if constexpr (kInt8 || !std::is_same_v<scalar_t, float>) {
    sc.k_float.resize(kKvTile * kD);
    sc.v_float.resize(kKvTile * kD);
  }
  // Cache rows for kBf16Dot, else float rows; the last step is padded with zero rows.
  using row_t = std::conditional_t<kBf16Dot, uint16_t, float>;
  const row_t* k_rows[kKvTile + kKeysPerStep];
  const row_t* v_rows[kKvTile + kKeysPerStep];
  const row_t* zero_row = reinterpret_cast<const row_t*>(sc.zero_row.data());
  for (int64_t t0 = w.kv_begin; t0 < w.kv_end; t0 += kKvTile) {
    const int64_t nt = std::min<int64_t>(kKvTile, w.kv_end - t0);
    const int64_t nt_padded = (nt + kKeysPerStep - 1) / kKeysPerStep * kKeysPerStep;
    for (int64_t j = 0; j < nt; ++j) {
      const int64_t t = t0 + j;
      const int64_t row = (static_cast<int64_t>(blocks[t / a.block_size]) * a.block_size +
                           t % a.block_size) * Hkv + h;
      const int64_t offset = row * kD;
      if constexpr (kInt8) {
        widen_row(a.k_int8 + row * (kD + kInt8ScaleBytes), kD, sc.k_float.data() + j * kD);
        widen_row(a.v_int8 + row * (kD + kInt8ScaleBytes), kD, sc.v_float.data() + j * kD);
        k_rows[j] = sc.k_float.data() + j * kD;
        v_rows[j] = sc.v_float.data() + j * kD;
      } else if constexpr (kBf16Dot) {
        k_rows[j] = reinterpret_cast<const uint16_t*>(a.k_cache + offset);
        v_rows[j] = reinterpret_cast<const uint16_t*>(a.v_cache + offset);
      } else {
        k_rows[j] = float_row<kD>(a.k_cache + offset, sc.k_float.data() + j * kD);
        v_rows[j] = float_row<kD>(a.v_cache + offset, sc.v_float.data() + j * kD);
      }
    }
    for (int64_t j = nt; j < nt_padded; ++j) k_rows[j] = v_rows[j] = zero_row;
    const bool masked = nt < kKvTile || t0 + nt - 1 > min_pos || t0 < max_start;
    vec16 tile_max[kRV];
    tile_scores<kD, kRV>(q_lanes, k_rows, nt, masked, row_pos, row_start, t0, a.scale,
                         sc.p.data(), tile_max);
    tile_softmax<kRV>(sc.p.data(), nt_padded, tile_max, sc.lane_m.data(), sc.lane_l.data(),
                      sc.alpha.data());
#if defined(__AVX512BF16__)
    if constexpr (kBf16Dot) {
      // Keys padded to an even count: the padding has p = 0 and a zero V row.
      const int64_t num_pairs = (nt + 1) / 2;
      pack_p_pairs<kRV>(sc.p.data(), num_pairs, sc.p_pairs.data());
      pack_v_pairs<kD>(v_rows, num_pairs, sc.v_pairs.data());
      tile_pv_bf16<kD>(sc.p_pairs.data(), W, sc.v_pairs.data(), num_pairs, sc.alpha.data(),
                       sc.lane_acc.data());
    }
#endif
    if constexpr (!kBf16Dot) {
      tile_pv<kD>(sc.p.data(), W, v_rows, nt, sc.alpha.data(), sc.lane_acc.data());
    }
  }
  const int64_t row0 = row_base + row_begin;
  std::copy_n(sc.lane_acc.data(), count * kD, sc.acc.data() + row0 * kD);
  std::copy_n(sc.lane_m.data(), count, sc.m.data() + row0);
  std::copy_n(sc.lane_l.data(), count, sc.l.data() + row0);
}

}  // namespace orca::cpu

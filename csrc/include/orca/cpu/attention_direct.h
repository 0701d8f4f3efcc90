// Decode-like items (orca/cpu/attention.h): the tile kernels that read K/V rows in place, for
// float and int8 caches.
#pragma once

#include "orca/cpu/attention_common.h"

namespace orca::cpu {

// ---- Decode-like items (few query rows per KV head): all of the item's heads at once, K/V
// rows read in place (token by token, each token's heads adjacent), no gather.
// Rows are (head, row within the head); p is [rows][kKvTile], q rows pre-scaled [rows][kD].

// f(h, v) for each head h of one key's K or V row (row: its first head), with the head's kD
// values as float vectors.
template <int kD, typename scalar_t, typename F>
inline void for_each_head(const scalar_t* row, int64_t num_heads, const F& f) {
  alignas(64) float tmp[kD];
  for (int64_t h = 0; h < num_heads; ++h) {
    const float* x = float_row<kD>(row + h * kD, tmp);
    vec16 v[kD / 16];
    for (int c = 0; c < kD / 16; ++c) v[c] = load16(x + 16 * c);
    f(h, v);
  }
}

// Scores of keys ja and jb (ka_row, kb_row: their first heads) for every row; jb < 0: ja
// alone (kb_row is then ka_row, its scores dropped).
template <int kD, typename scalar_t>
inline void direct_scores(const scalar_t* ka_row, int64_t ja, const scalar_t* kb_row, int64_t jb,
                          int64_t num_heads, int64_t head_rows, const float* q, float* p) {
  alignas(64) float tmp[kD];
  for_each_head<kD>(ka_row, num_heads, [&](int64_t h, const vec16* ka) {
    const float* kb = float_row<kD>(kb_row + h * kD, tmp);
    for (int64_t r = 0; r < head_rows; ++r) {
      const int64_t row = h * head_rows + r;
      const float* qr = q + row * kD;
      vec16 ta = load16(qr) * ka[0], tb = load16(qr) * load16(kb);
      for (int c = 1; c < kD / 16; ++c) {
        const vec16 qv = load16(qr + 16 * c);
        ta += qv * ka[c];
        tb += qv * load16(kb + 16 * c);
      }
      float sa, sb;
      hsum2(ta, tb, sa, sb);
      p[row * kKvTile + ja] = sa;
      if (jb >= 0) p[row * kKvTile + jb] = sb;
    }
  });
}

// acc[row] += p[row][ja] v_ja + p[row][jb] v_jb (va_row, vb_row: keys ja and jb's first
// heads) for every row; jb < 0: ja alone (vb_row is then va_row, weighted 0). Two keys per pass
// halve the accumulators' loads and stores.
template <int kD, typename scalar_t>
inline void direct_pv(const scalar_t* va_row, int64_t ja, const scalar_t* vb_row, int64_t jb,
                      int64_t num_heads, int64_t head_rows, const float* p, float* acc) {
  alignas(64) float tmp[kD];
  for_each_head<kD>(va_row, num_heads, [&](int64_t h, const vec16* va) {
    const float* b = float_row<kD>(vb_row + h * kD, tmp);
    for (int64_t r = 0; r < head_rows; ++r) {
      const int64_t row = h * head_rows + r;
      const float pa = p[row * kKvTile + ja], pb = jb < 0 ? 0.f : p[row * kKvTile + jb];
      float* o = acc + row * kD;
      for (int c = 0; c < kD / 16; ++c) {
        store16(o + 16 * c, load16(o + 16 * c) + pa * va[c] + pb * load16(b + 16 * c));
      }
    }
  });
}

// direct_scores over int8 rows (heads kD + 4 bytes apart): the dot products with the int8
// values widened in registers, times the row's scale.
template <int kD>
inline void direct_scores_int8(const int8_t* ka_row, int64_t ja, const int8_t* kb_row,
                               int64_t jb, int64_t num_heads, int64_t head_rows, const float* q,
                               float* p) {
  constexpr int kNV = kD / 16;
  constexpr int64_t kRow = kD + kInt8ScaleBytes;
  for (int64_t h = 0; h < num_heads; ++h) {
    const int8_t* a_h = ka_row + h * kRow;
    const int8_t* b_h = kb_row + h * kRow;
    vec16 ka[kNV], kb[kNV];
    for (int c = 0; c < kNV; ++c) {
      ka[c] = load16_int8(a_h + 16 * c);
      kb[c] = load16_int8(b_h + 16 * c);
    }
    const float scale_a = int8_row_scale(a_h, kD), scale_b = int8_row_scale(b_h, kD);
    for (int64_t r = 0; r < head_rows; ++r) {
      const int64_t row = h * head_rows + r;
      const float* qr = q + row * kD;
      vec16 ta = load16(qr) * ka[0], tb = load16(qr) * kb[0];
      for (int c = 1; c < kNV; ++c) {
        const vec16 qv = load16(qr + 16 * c);
        ta += qv * ka[c];
        tb += qv * kb[c];
      }
      float sa, sb;
      hsum2(ta, tb, sa, sb);
      p[row * kKvTile + ja] = sa * scale_a;
      if (jb >= 0) p[row * kKvTile + jb] = sb * scale_b;
    }
  }
}

// direct_pv over int8 rows, kN keys a pass (rows[k]: key j[k]'s first head; j[k] < 0: none,
// weighted 0): each key's probability times its V row's scale weighs the int8 values widened in
// registers; more keys a pass, fewer loads and stores of the accumulators.
template <int kD, int kN>
inline void direct_pv_int8(const int8_t* const (&rows)[kN], const int64_t (&j)[kN],
                           int64_t num_heads, int64_t head_rows, const float* p, float* acc) {
  constexpr int kNV = kD / 16;
  constexpr int64_t kRow = kD + kInt8ScaleBytes;
  for (int64_t h = 0; h < num_heads; ++h) {
    vec16 v[kN][kNV];
    float scale[kN];
    for (int k = 0; k < kN; ++k) {
      const int8_t* row = rows[k] + h * kRow;
      for (int c = 0; c < kNV; ++c) v[k][c] = load16_int8(row + 16 * c);
      scale[k] = j[k] < 0 ? 0.f : int8_row_scale(row, kD);
    }
    for (int64_t r = 0; r < head_rows; ++r) {
      const int64_t row = h * head_rows + r;
      float weight[kN];
      for (int k = 0; k < kN; ++k) weight[k] = j[k] < 0 ? 0.f : p[row * kKvTile + j[k]] * scale[k];
      float* o = acc + row * kD;
      for (int c = 0; c < kNV; ++c) {
        vec16 sum = load16(o + 16 * c);
        for (int k = 0; k < kN; ++k) sum += weight[k] * v[k][c];
        store16(o + 16 * c, sum);
      }
    }
  }
}

// Online-softmax step of one tile's scores p (row r of each head sees the tile's keys
// [first[r], end[r])): p becomes probabilities, (m, l) advance and each row's acc is rescaled.
// Returns the most keys any row's range reaches. A row's kKvTile scores are two vectors.
template <int kD>
inline int64_t direct_softmax(const int64_t* first, const int64_t* end, int64_t rows,
                              int64_t head_rows, float* p, AttentionScratch& sc) {
  static_assert(kKvTile == 32);
  constexpr int kNV = kD / 16;
  const int16v lane_lo = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
  const int16v lane_hi = lane_lo + 16;
  const vec16 neg_inf = vec16{} + kNegInf, zero = vec16{};
  int64_t max_visible = 0;
  for (int64_t row = 0; row < rows; ++row) {
    const int64_t lo = first[row % head_rows], hi = end[row % head_rows];
    max_visible = std::max(max_visible, hi);
    float* pr = p + row * kKvTile;
    const int16v begin_v = int16v{} + static_cast<int>(std::clamp<int64_t>(lo, 0, kKvTile));
    const int16v end_v = int16v{} + static_cast<int>(std::clamp<int64_t>(hi, 0, kKvTile));
    const int16v in_lo = (lane_lo >= begin_v) & (lane_lo < end_v);
    const int16v in_hi = (lane_hi >= begin_v) & (lane_hi < end_v);
    const vec16 s_lo = in_lo ? load16(pr) : neg_inf;
    const vec16 s_hi = in_hi ? load16(pr + 16) : neg_inf;
    const float tile_max = hmax(s_lo > s_hi ? s_lo : s_hi);
    const float m_old = sc.m[row], m_new = std::max(m_old, tile_max);
    const vec16 e_lo = in_lo ? fast_exp(s_lo - m_new) : zero;
    const vec16 e_hi = in_hi ? fast_exp(s_hi - m_new) : zero;
    store16(pr, e_lo);
    store16(pr + 16, e_hi);
    if (hi <= lo) continue;  // nothing visible: the row's state stays as it is
    const float alpha = m_old == kNegInf ? 0.f : fast_exp(m_old - m_new);
    sc.l[row] = sc.l[row] * alpha + hsum(e_lo + e_hi);
    sc.m[row] = m_new;
    float* acc = sc.acc.data() + row * kD;
    for (int c = 0; c < kNV; ++c) store16(acc + 16 * c, load16(acc + 16 * c) * alpha);
  }
  return max_visible;
}

}  // namespace orca::cpu

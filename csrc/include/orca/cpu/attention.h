// Torch-free CPU kernel of ragged (split-and-merge) paged attention.
//
// The launcher cuts the batch into AttentionWork items: one request, a range of KV heads
// (each head's whole query-head group shares its K/V loads), a block of the request's queries
// and a range of KV positions. An item covering a request's whole causal range writes normalized output; a
// long range split into chunks writes (unnormalized o, running max m, sum l) partials that
// merge_partials combines by log-sum-exp. Softmax is online over KV tiles: no [T, context]
// score matrix is ever formed.
#pragma once

#include <algorithm>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <vector>

#include "orca/cpu/math.h"
#include "orca/cpu/vec.h"

namespace orca::cpu {

template <typename scalar_t>
struct AttentionArgs {
  const scalar_t* q;  // [T, Hq, D], last dim contiguous
  int64_t q_stride_token, q_stride_head;
  const scalar_t* k_cache;  // [num_blocks, block_size, Hkv, D] contiguous
  const scalar_t* v_cache;
  scalar_t* out;  // [T, Hq, D] contiguous
  const int32_t* cu_q_lens;
  const int32_t* context_lens;
  const int32_t* block_table;  // [B, max_blocks]
  int64_t max_blocks, block_size, num_q_heads, num_kv_heads, head_dim;
  float scale;
};

struct AttentionWork {
  int32_t request, kv_head_begin, kv_head_end, q_begin, q_end, kv_begin, kv_end;
  int64_t partial_row;  // -1: write normalized output; else first row in the partial buffers

  // Rows are (KV head, query, head within the group), in that order.
  int64_t num_rows(int64_t group) const {
    return static_cast<int64_t>(kv_head_end - kv_head_begin) * (q_end - q_begin) * group;
  }
};

// Where row `row` of a work item lives in q and out: (token, query head).
struct RowPlace {
  int64_t token, q_head;
};

template <typename scalar_t>
inline RowPlace row_place(const AttentionArgs<scalar_t>& a, const AttentionWork& w,
                          int64_t row) {
  const int64_t G = a.num_q_heads / a.num_kv_heads, nq = w.q_end - w.q_begin;
  const int64_t head = w.kv_head_begin + row / (nq * G), rem = row % (nq * G);
  return {a.cu_q_lens[w.request] + w.q_begin + rem / G, head * G + rem % G};
}

struct Partials {
  float* o;  // [rows, D]
  float* m;  // [rows]
  float* l;  // [rows]
};

constexpr int kKvTile = 32;
// Query rows per KV head up to which an item is decode-like (read in place, all heads at once).
constexpr int64_t kMaxDirectRows = 8;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

struct AttentionScratch {
  std::vector<float> q, acc, k_t, v, m, l, p;
};

// Rows of queries processed together against one KV tile: enough to reuse each K/V load
// several times, few enough that the accumulators stay in registers.
template <int kD>
constexpr int rows_per_block() {
  return kD <= 96 ? 4 : (kD <= 128 ? 2 : 1);
}

// One KV tile against kR query rows: scores, online-softmax update of (m, l), and
// acc = acc * alpha + P V. q rows are pre-scaled; visible[r] is how many of the tile's KV
// positions row r may see (causal); rows with visible <= 0 are skipped.
template <int kD, int kR>
inline void tile_update(const float* const* q, const float* k_t, const float* v,
                        const int64_t* visible, float* const* acc, float* m, float* l) {
  constexpr int kNV = kD / 16;
  vec16 s[kR][2] = {};
  for (int d = 0; d < kD; ++d) {
    const vec16 k0 = load16(k_t + d * kKvTile), k1 = load16(k_t + d * kKvTile + 16);
    for (int r = 0; r < kR; ++r) {
      s[r][0] += q[r][d] * k0;
      s[r][1] += q[r][d] * k1;
    }
  }
  float p[kR][kKvTile];
  float alpha[kR];
  for (int r = 0; r < kR; ++r) {
    float sr[kKvTile];
    store16(sr, s[r][0]);
    store16(sr + 16, s[r][1]);
    float tile_max = kNegInf;
    for (int64_t j = 0; j < visible[r]; ++j) tile_max = std::max(tile_max, sr[j]);
    const float m_new = std::max(m[r], tile_max);
    alpha[r] = m[r] == kNegInf ? 0.f : fast_exp(m[r] - m_new);
    for (int j = 0; j < kKvTile; ++j) p[r][j] = j < visible[r] ? fast_exp(sr[j] - m_new) : 0.f;
    float sum = 0.f;
    for (int j = 0; j < kKvTile; ++j) sum += p[r][j];
    l[r] = l[r] * alpha[r] + sum;
    m[r] = visible[r] > 0 ? m_new : m[r];
  }
  vec16 a[kR][kNV];
  for (int r = 0; r < kR; ++r) {
    for (int c = 0; c < kNV; ++c) a[r][c] = load16(acc[r] + 16 * c) * alpha[r];
  }
  int64_t tile_visible = 0;
  for (int r = 0; r < kR; ++r) tile_visible = std::max(tile_visible, visible[r]);
  for (int64_t j = 0; j < tile_visible; ++j) {
    vec16 vv[kNV];
    for (int c = 0; c < kNV; ++c) vv[c] = load16(v + j * kD + 16 * c);
    for (int r = 0; r < kR; ++r) {
      for (int c = 0; c < kNV; ++c) a[r][c] += p[r][j] * vv[c];
    }
  }
  for (int r = 0; r < kR; ++r) {
    if (visible[r] <= 0) continue;  // untouched (alpha may be 0 for a row with m = -inf)
    for (int c = 0; c < kNV; ++c) store16(acc[r] + 16 * c, a[r][c]);
  }
}

// A K or V row as float32: the cache row itself for float caches, else converted into tmp.
template <int kD, typename scalar_t>
inline const float* float_row(const scalar_t* src, float* tmp) {
  if constexpr (std::is_same_v<scalar_t, float>) {
    return src;
  } else {
    for (int d = 0; d < kD; ++d) tmp[d] = static_cast<float>(src[d]);
    return tmp;
  }
}

// One KV tile for decode-like items (few query rows per head), all of the item's heads at
// once: K/V rows are read in place in cache order (token by token, each token's heads
// adjacent), with no gather. q_rows holds each head's rows in order ([heads][head_rows][kD]).
template <int kD, typename scalar_t>
inline void direct_tile(const scalar_t* k_tile, const scalar_t* v_tile,
                        const int64_t* slot_offset, int64_t nt, int64_t num_heads,
                        int64_t head_rows, const int64_t* visible, AttentionScratch& sc) {
  constexpr int kNV = kD / 16;
  const int64_t rows = num_heads * head_rows;
  float* p = sc.p.data();  // [rows][kKvTile]
  alignas(64) float tmp[kD];
  for (int64_t j = 0; j < nt; ++j) {
    for (int64_t h = 0; h < num_heads; ++h) {
      const float* k = float_row<kD>(k_tile + slot_offset[j] + h * kD, tmp);
      vec16 kv[kNV];
      for (int c = 0; c < kNV; ++c) kv[c] = load16(k + 16 * c);
      for (int64_t r = 0; r < head_rows; ++r) {
        const float* q = sc.q.data() + (h * head_rows + r) * kD;
        vec16 t = load16(q) * kv[0];
        for (int c = 1; c < kNV; ++c) t += load16(q + 16 * c) * kv[c];
        p[(h * head_rows + r) * kKvTile + j] = hsum(t);
      }
    }
  }
  int64_t max_visible = 0;
  for (int64_t row = 0; row < rows; ++row) {
    const int64_t vis = visible[row % head_rows];
    max_visible = std::max(max_visible, vis);
    float* pr = p + row * kKvTile;
    float tile_max = kNegInf;
    for (int64_t j = 0; j < vis; ++j) tile_max = std::max(tile_max, pr[j]);
    const float m_old = sc.m[row], m_new = std::max(m_old, tile_max);
    const float alpha = m_old == kNegInf ? 0.f : fast_exp(m_old - m_new);
    float sum = 0.f;
    for (int64_t j = 0; j < kKvTile; ++j) {
      pr[j] = j < vis ? fast_exp(pr[j] - m_new) : 0.f;
      sum += pr[j];
    }
    if (vis <= 0) continue;  // nothing visible: the row's state stays as it is
    sc.l[row] = sc.l[row] * alpha + sum;
    sc.m[row] = m_new;
    float* acc = sc.acc.data() + row * kD;
    for (int c = 0; c < kNV; ++c) store16(acc + 16 * c, load16(acc + 16 * c) * alpha);
  }
  for (int64_t j = 0; j < max_visible; ++j) {
    for (int64_t h = 0; h < num_heads; ++h) {
      const float* v = float_row<kD>(v_tile + slot_offset[j] + h * kD, tmp);
      vec16 vv[kNV];
      for (int c = 0; c < kNV; ++c) vv[c] = load16(v + 16 * c);
      for (int64_t r = 0; r < head_rows; ++r) {
        const int64_t row = h * head_rows + r;
        const float pj = p[row * kKvTile + j];
        float* acc = sc.acc.data() + row * kD;
        for (int c = 0; c < kNV; ++c) store16(acc + 16 * c, load16(acc + 16 * c) + pj * vv[c]);
      }
    }
  }
}

// Scalar fallback for head dims that are not a multiple of 16.
inline void tile_update_scalar(int64_t D, const float* q, const float* k_t, const float* v,
                               int64_t visible, float* acc, float& m, float& l) {
  float s[kKvTile] = {};
  for (int64_t d = 0; d < D; ++d) {
    for (int j = 0; j < kKvTile; ++j) s[j] += q[d] * k_t[d * kKvTile + j];
  }
  float tile_max = kNegInf;
  for (int64_t j = 0; j < visible; ++j) tile_max = std::max(tile_max, s[j]);
  const float m_new = std::max(m, tile_max);
  const float alpha = m == kNegInf ? 0.f : fast_exp(m - m_new);
  float sum = 0.f;
  for (int64_t d = 0; d < D; ++d) acc[d] *= alpha;
  for (int64_t j = 0; j < visible; ++j) {
    const float pj = fast_exp(s[j] - m_new);
    sum += pj;
    for (int64_t d = 0; d < D; ++d) acc[d] += pj * v[j * D + d];
  }
  l = l * alpha + sum;
  m = m_new;
}

// kD > 0 (a multiple of 16) fixes head_dim at compile time for the vector path; 0 runs the
// scalar path with a.head_dim.
template <int kD, typename scalar_t>
void attend(const AttentionArgs<scalar_t>& a, const AttentionWork& w, AttentionScratch& sc,
            const Partials& part) {
  static_assert(kD % 16 == 0);
  const int64_t D = kD > 0 ? kD : a.head_dim;
  const int64_t G = a.num_q_heads / a.num_kv_heads, Hkv = a.num_kv_heads;
  const int64_t head_rows = (w.q_end - w.q_begin) * G, rows = w.num_rows(G);
  const int64_t q_len = a.cu_q_lens[w.request + 1] - a.cu_q_lens[w.request];
  const int64_t first_pos = a.context_lens[w.request] - q_len + w.q_begin;
  const int32_t* blocks = a.block_table + w.request * a.max_blocks;

  sc.q.resize(rows * D);
  sc.acc.assign(rows * D, 0.f);
  sc.k_t.assign(D * kKvTile, 0.f);
  sc.v.assign(kKvTile * D, 0.f);
  sc.m.assign(rows, kNegInf);
  sc.l.assign(rows, 0.f);
  float* qs = sc.q.data();
  for (int64_t row = 0; row < rows; ++row) {
    const RowPlace at = row_place(a, w, row);
    const scalar_t* src = a.q + at.token * a.q_stride_token + at.q_head * a.q_stride_head;
    for (int64_t d = 0; d < D; ++d) qs[row * D + d] = static_cast<float>(src[d]) * a.scale;
  }

  constexpr int kR = kD > 0 ? rows_per_block<kD>() : 1;
  // Few rows per head (decode): read K/V rows in place. Many (prefill): gather each tile once.
  const bool direct = kD > 0 && head_rows <= kMaxDirectRows;
  sc.p.resize(rows * kKvTile);
  int64_t slot_offset[kKvTile];
  const scalar_t* k_rows[kKvTile];
  const scalar_t* v_rows[kKvTile];
  for (int64_t t0 = w.kv_begin; t0 < w.kv_end; t0 += kKvTile) {
    const int64_t nt = std::min<int64_t>(kKvTile, w.kv_end - t0);
    for (int64_t j = 0; j < nt; ++j) {
      const int64_t pos = t0 + j;
      slot_offset[j] = (static_cast<int64_t>(blocks[pos / a.block_size]) * a.block_size +
                        pos % a.block_size) * Hkv * D;
    }
    // KV positions <= a query's own position are visible to it (causal).
    auto visible = [&](int64_t head_row) {
      return std::min<int64_t>(nt, first_pos + head_row / G - t0 + 1);
    };
    if constexpr (kD > 0) {
      if (direct) {
        int64_t vis[kMaxDirectRows];
        for (int64_t r = 0; r < head_rows; ++r) vis[r] = visible(r);
        direct_tile<kD>(a.k_cache + w.kv_head_begin * kD, a.v_cache + w.kv_head_begin * kD,
                        slot_offset, nt, w.kv_head_end - w.kv_head_begin, head_rows, vis, sc);
        continue;
      }
    }
    // Prefill-like items (one head each): gather the tile, then blocks of kR query rows.
    for (int64_t h = w.kv_head_begin; h < w.kv_head_end; ++h) {
      const int64_t row_base = (h - w.kv_head_begin) * head_rows;
      for (int64_t j = 0; j < nt; ++j) {
        k_rows[j] = a.k_cache + slot_offset[j] + h * D;
        v_rows[j] = a.v_cache + slot_offset[j] + h * D;
      }
      // K transposed to [D, tile] so scores vectorize over the tile, V as [tile, D] so the
      // weighted sum vectorizes over D.
      for (int64_t j = 0; j < nt; ++j) {
        float* vrow = sc.v.data() + j * D;
        for (int64_t d = 0; d < D; ++d) {
          sc.k_t[d * kKvTile + j] = static_cast<float>(k_rows[j][d]);
          vrow[d] = static_cast<float>(v_rows[j][d]);
        }
      }
      if constexpr (kD > 0) {
        for (int64_t r0 = 0; r0 < head_rows; r0 += kR) {
          // A short last block repeats its last row and discards the copies' results.
          const float* q_rows[kR];
          float* acc_rows[kR];
          float m[kR], l[kR];
          int64_t vis[kR];
          for (int r = 0; r < kR; ++r) {
            const int64_t row = row_base + std::min<int64_t>(r0 + r, head_rows - 1);
            q_rows[r] = qs + row * kD;
            acc_rows[r] = sc.acc.data() + row * kD;
            m[r] = sc.m[row];
            l[r] = sc.l[row];
            vis[r] = r0 + r < head_rows ? visible(r0 + r) : 0;
          }
          tile_update<kD, kR>(q_rows, sc.k_t.data(), sc.v.data(), vis, acc_rows, m, l);
          for (int r = 0; r < kR && r0 + r < head_rows; ++r) {
            sc.m[row_base + r0 + r] = m[r];
            sc.l[row_base + r0 + r] = l[r];
          }
        }
      } else {
        for (int64_t r = 0; r < head_rows; ++r) {
          const int64_t row = row_base + r;
          if (visible(r) <= 0) continue;
          tile_update_scalar(D, qs + row * D, sc.k_t.data(), sc.v.data(), visible(r),
                             sc.acc.data() + row * D, sc.m[row], sc.l[row]);
        }
      }
    }
  }

  for (int64_t row = 0; row < rows; ++row) {
    const float* acc = sc.acc.data() + row * D;
    if (w.partial_row < 0) {
      const RowPlace at = row_place(a, w, row);
      const float inv = 1.f / sc.l[row];
      scalar_t* dst = a.out + (at.token * a.num_q_heads + at.q_head) * D;
      for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<scalar_t>(acc[d] * inv);
    } else {
      const int64_t prow = w.partial_row + row;
      std::copy(acc, acc + D, part.o + prow * D);
      part.m[prow] = sc.m[row];
      part.l[prow] = sc.l[row];
    }
  }
}

// Combines num_splits consecutive partial blocks (split-major) of one work item's rows into
// its normalized output.
template <typename scalar_t>
void merge_partials(const AttentionArgs<scalar_t>& a, const AttentionWork& first,
                    int64_t num_splits, const Partials& part) {
  const int64_t D = a.head_dim;
  const int64_t rows = first.num_rows(a.num_q_heads / a.num_kv_heads);
  std::vector<float> out(D);
  for (int64_t row = 0; row < rows; ++row) {
    float m_max = kNegInf;
    for (int64_t s = 0; s < num_splits; ++s) {
      m_max = std::max(m_max, part.m[first.partial_row + s * rows + row]);
    }
    std::fill(out.begin(), out.end(), 0.f);
    float l_total = 0.f;
    for (int64_t s = 0; s < num_splits; ++s) {
      const int64_t prow = first.partial_row + s * rows + row;
      if (part.m[prow] == kNegInf) continue;  // no visible KV in this split
      const float weight = fast_exp(part.m[prow] - m_max);
      l_total += weight * part.l[prow];
      const float* o = part.o + prow * D;
      for (int64_t d = 0; d < D; ++d) out[d] += weight * o[d];
    }
    const RowPlace at = row_place(a, first, row);
    const float inv = 1.f / l_total;
    scalar_t* dst = a.out + (at.token * a.num_q_heads + at.q_head) * D;
    for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<scalar_t>(out[d] * inv);
  }
}

}  // namespace orca::cpu

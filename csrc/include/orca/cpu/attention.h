// Torch-free CPU kernel of ragged (split-and-merge) paged attention.
//
// The launcher cuts the batch into AttentionWork items: one request, one KV head (its whole
// query-head group shares each K/V load), a block of the request's queries and a range of KV
// positions. An item covering a request's whole causal range writes normalized output; a
// long range split into chunks writes (unnormalized o, running max m, sum l) partials that
// merge_partials combines by log-sum-exp. Softmax is online over KV tiles: no [T, context]
// score matrix is ever formed.
#pragma once

#include <algorithm>
#include <cstdint>
#include <limits>
#include <vector>

#include "orca/cpu/math.h"

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
  int32_t request, kv_head, q_begin, q_end, kv_begin, kv_end;
  int64_t partial_row;  // -1: write normalized output; else first row in the partial buffers
};

struct Partials {
  float* o;  // [rows, D]
  float* m;  // [rows]
  float* l;  // [rows]
};

constexpr int kKvTile = 32;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

struct AttentionScratch {
  std::vector<float> q, acc, k_t, v, m, l;
};

// kD > 0 fixes head_dim at compile time so the per-row D loops unroll; 0 reads a.head_dim.
template <int kD, typename scalar_t>
void attend(const AttentionArgs<scalar_t>& a, const AttentionWork& w, AttentionScratch& sc,
            const Partials& part) {
  const int64_t D = kD > 0 ? kD : a.head_dim;
  const int64_t G = a.num_q_heads / a.num_kv_heads;
  const int64_t nq = w.q_end - w.q_begin, rows = nq * G;
  const int64_t q_len = a.cu_q_lens[w.request + 1] - a.cu_q_lens[w.request];
  const int64_t first_pos = a.context_lens[w.request] - q_len + w.q_begin;
  const int64_t token0 = a.cu_q_lens[w.request] + w.q_begin;
  const int32_t* blocks = a.block_table + w.request * a.max_blocks;
  const int64_t h = w.kv_head, Hkv = a.num_kv_heads;

  sc.q.resize(rows * D);
  sc.acc.assign(rows * D, 0.f);
  sc.k_t.assign(D * kKvTile, 0.f);
  sc.v.resize(kKvTile * D);
  sc.m.assign(rows, kNegInf);
  sc.l.assign(rows, 0.f);
  float* qs = sc.q.data();
  for (int64_t row = 0; row < rows; ++row) {
    const scalar_t* src =
        a.q + (token0 + row / G) * a.q_stride_token + (h * G + row % G) * a.q_stride_head;
    for (int64_t d = 0; d < D; ++d) qs[row * D + d] = static_cast<float>(src[d]) * a.scale;
  }

  for (int64_t t0 = w.kv_begin; t0 < w.kv_end; t0 += kKvTile) {
    const int64_t nt = std::min<int64_t>(kKvTile, w.kv_end - t0);
    // Gather the tile from its blocks: K transposed to [D, tile] so scores vectorize over
    // the tile, V as [tile, D] so the weighted sum vectorizes over D.
    for (int64_t j = 0; j < nt; ++j) {
      const int64_t pos = t0 + j;
      const int64_t slot = static_cast<int64_t>(blocks[pos / a.block_size]) * a.block_size +
                           pos % a.block_size;
      const scalar_t* kp = a.k_cache + (slot * Hkv + h) * D;
      const scalar_t* vp = a.v_cache + (slot * Hkv + h) * D;
      float* vrow = sc.v.data() + j * D;
      for (int64_t d = 0; d < D; ++d) {
        sc.k_t[d * kKvTile + j] = static_cast<float>(kp[d]);
        vrow[d] = static_cast<float>(vp[d]);
      }
    }
    for (int64_t j = nt; j < kKvTile; ++j) {
      for (int64_t d = 0; d < D; ++d) sc.k_t[d * kKvTile + j] = 0.f;
    }
    for (int64_t row = 0; row < rows; ++row) {
      // KV positions <= the query's own position are visible (causal).
      const int64_t visible = std::min<int64_t>(nt, first_pos + row / G - t0 + 1);
      if (visible <= 0) continue;
      float s[kKvTile] = {};
      const float* qrow = qs + row * D;
      for (int64_t d = 0; d < D; ++d) {
        const float qd = qrow[d];
        const float* kcol = sc.k_t.data() + d * kKvTile;
        for (int j = 0; j < kKvTile; ++j) s[j] += qd * kcol[j];
      }
      float tile_max = kNegInf;
      for (int64_t j = 0; j < visible; ++j) tile_max = std::max(tile_max, s[j]);
      const float m_old = sc.m[row];
      const float m_new = std::max(m_old, tile_max);
      const float alpha = m_old == kNegInf ? 0.f : fast_exp(m_old - m_new);
      float p[kKvTile];
      for (int j = 0; j < kKvTile; ++j) p[j] = fast_exp(s[j] - m_new);
      float sum = 0.f;
      for (int64_t j = 0; j < visible; ++j) sum += p[j];
      sc.l[row] = sc.l[row] * alpha + sum;
      sc.m[row] = m_new;
      float* acc = sc.acc.data() + row * D;
      for (int64_t d = 0; d < D; ++d) acc[d] *= alpha;
      for (int64_t j = 0; j < visible; ++j) {
        const float pj = p[j];
        const float* vrow = sc.v.data() + j * D;
        for (int64_t d = 0; d < D; ++d) acc[d] += pj * vrow[d];
      }
    }
  }

  for (int64_t row = 0; row < rows; ++row) {
    const float* acc = sc.acc.data() + row * D;
    if (w.partial_row < 0) {
      const float inv = 1.f / sc.l[row];
      scalar_t* dst = a.out + ((token0 + row / G) * a.num_q_heads + h * G + row % G) * D;
      for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<scalar_t>(acc[d] * inv);
    } else {
      const int64_t prow = w.partial_row + row;
      std::copy(acc, acc + D, part.o + prow * D);
      part.m[prow] = sc.m[row];
      part.l[prow] = sc.l[row];
    }
  }
}

// Combines num_splits consecutive partial blocks of `rows` rows each (split-major) into the
// normalized output of one work group.
template <typename scalar_t>
void merge_partials(const AttentionArgs<scalar_t>& a, const AttentionWork& first,
                    int64_t num_splits, const Partials& part) {
  const int64_t D = a.head_dim, G = a.num_q_heads / a.num_kv_heads;
  const int64_t rows = (first.q_end - first.q_begin) * G;
  const int64_t token0 = a.cu_q_lens[first.request] + first.q_begin;
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
    const float inv = 1.f / l_total;
    scalar_t* dst =
        a.out + ((token0 + row / G) * a.num_q_heads + first.kv_head * G + row % G) * D;
    for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<scalar_t>(out[d] * inv);
  }
}

}  // namespace orca::cpu

// Torch-free CPU kernel of ragged (split-and-merge) paged attention.
//
// The launcher cuts the batch into AttentionWork items: one request, a range of KV heads
// (each head's whole query-head group shares its K/V loads), a block of the request's queries
// and a range of KV positions. An item covering a request's whole causal range (with a sliding
// window, from its first query's window start) writes normalized output; a long range split
// into chunks writes (unnormalized o, running max m, sum l) partials that merge_partials
// combines by log-sum-exp (a split that a row does not see leaves it m = -inf, l = 0, skipped
// there). Keys a query does not see (causal, window) are masked per tile. Softmax is online
// over KV tiles: no [T, context] score matrix is ever formed. Two tile kernels:
// - decode-like items (<= kMaxDirectRows query rows per KV head) read every head's K/V rows
//   in place, token by token, a tile's two halves side by side (memory-bound: one pass over
//   the KV);
// - prefill-like items (compute-bound) put the query rows in the vector lanes: Q^T is built
//   once per item, scores come out as [key][rows] vectors from K rows in cache layout, and the
//   online softmax is element-wise across rows. With bfloat16 on AVX512-BF16 CPUs, Q.K and P.V
//   run as bf16 pair dot products (vdpbf16ps), or on AMX CPUs as tile matrix products
//   (attend_lanes_amx: S^T = K . Q^T and O^T += V^T . P^T, the softmax in AVX-512 between).
//
// The parts: attention_common.h (arguments, work items, kernel paths, scratch),
// attention_direct.h (decode-like), attention_lanes.h (prefill-like, float and bf16 pairs),
// attention_lanes_amx.h (prefill-like on AMX), attention_merge.h (split partials); this file
// runs one item on the kernels its shape and path call for.
#pragma once

#include "orca/cpu/attention_common.h"
#include "orca/cpu/attention_direct.h"
#include "orca/cpu/attention_lanes.h"
#include "orca/cpu/attention_lanes_amx.h"
#include "orca/cpu/attention_merge.h"

namespace orca::cpu {

// Scalar fallback for head dims that are not a multiple of 16: the tile's keys [first, end).
inline void tile_update_scalar(int64_t D, const float* q, const float* k_t, const float* v,
                               int64_t first, int64_t end, float* acc, float& m, float& l) {
  float s[kKvTile] = {};
  for (int64_t d = 0; d < D; ++d) {
    for (int j = 0; j < kKvTile; ++j) s[j] += q[d] * k_t[d * kKvTile + j];
  }
  float tile_max = kNegInf;
  for (int64_t j = first; j < end; ++j) tile_max = std::max(tile_max, s[j]);
  const float m_new = std::max(m, tile_max);
  const float alpha = m == kNegInf ? 0.f : fast_exp(m - m_new);
  float sum = 0.f;
  for (int64_t d = 0; d < D; ++d) acc[d] *= alpha;
  for (int64_t j = first; j < end; ++j) {
    const float pj = fast_exp(s[j] - m_new);
    sum += pj;
    for (int64_t d = 0; d < D; ++d) acc[d] += pj * v[j * D + d];
  }
  l = l * alpha + sum;
  m = m_new;
}

// kD > 0 (a multiple of 16) fixes head_dim at compile time for the vector paths; 0 runs the
// scalar path with a.head_dim. kIsa: prefill-like items' kernels (bfloat16 only for the bf16
// pair and AMX ones; AMX for kD a multiple of 32, else the pair kernels). kInt8: the cache is
// int8 (a.k_int8, a.v_int8), read by the direct and float-lane kernels (kIsa portable).
template <int kD, AttentionIsa kIsa, bool kInt8 = false, typename scalar_t>
void attend(const AttentionArgs<scalar_t>& a, const AttentionWork& w, AttentionScratch& sc,
            const Partials& part) {
  static_assert(kD % 16 == 0);
  static_assert(kIsa == AttentionIsa::kPortable || sizeof(scalar_t) == 2);
  static_assert(!kInt8 || kIsa == AttentionIsa::kPortable);
  constexpr bool kBf16Dot = kIsa != AttentionIsa::kPortable;
  [[maybe_unused]] constexpr bool kAmx = kIsa == AttentionIsa::kAmx && kD > 0 && kD % 32 == 0;
  const int64_t D = kD > 0 ? kD : a.head_dim;
  const int64_t G = a.num_q_heads / a.num_kv_heads, Hkv = a.num_kv_heads;
  const int64_t head_rows = (w.q_end - w.q_begin) * G, rows = w.num_rows(G);
  const int64_t q_len = a.cu_q_lens[w.request + 1] - a.cu_q_lens[w.request];
  const int64_t first_pos = a.context_lens[w.request] - q_len + w.q_begin;
  const int32_t* blocks = a.block_table + w.request * a.max_blocks;

  sc.acc.assign(rows * D, 0.f);
  sc.m.assign(rows, kNegInf);
  sc.l.assign(rows, 0.f);
  // Few rows per head (decode): read K/V rows in place, all heads at once. Many (prefill):
  // rows as vector lanes, one head at a time.
  const bool direct = kD > 0 && head_rows <= kMaxDirectRows;
  if constexpr (kD > 0) {
    if (!direct) {
      for (int64_t h = w.kv_head_begin; h < w.kv_head_end; ++h) {
        const int64_t row_base = (h - w.kv_head_begin) * head_rows;
        const int64_t pass_rows = kAmx ? kMaxAmxRows : kMaxLaneRows;
        for (int64_t r0 = 0; r0 < head_rows; r0 += pass_rows) {
          const int64_t count = std::min(pass_rows, head_rows - r0);
          const auto lanes = [&]<int kRV>() {
#if defined(ORCA_ATTENTION_AMX)
            if constexpr (kAmx) {
              return attend_lanes_amx<kD, kRV>(a, w, h, row_base, r0, count, first_pos, sc);
            }
#endif
            if constexpr (kRV <= 4) {
              attend_lanes<kD, kRV, kBf16Dot, kInt8>(a, w, h, row_base, r0, count, first_pos,
                                                     sc);
            }
          };
          switch ((count + 15) / 16) {
            case 1: lanes.template operator()<1>(); break;
            case 2: lanes.template operator()<2>(); break;
            case 3: lanes.template operator()<3>(); break;
            case 4: lanes.template operator()<4>(); break;
#if defined(ORCA_ATTENTION_AMX)
            case 5: lanes.template operator()<5>(); break;
            case 6: lanes.template operator()<6>(); break;
            case 7: lanes.template operator()<7>(); break;
            default: lanes.template operator()<8>();
#endif
          }
        }
      }
      write_rows(a, w, rows, sc, part);
      return;
    }
  }

  sc.q.resize(rows * D);
  float* qs = sc.q.data();
  for (int64_t row = 0; row < rows; ++row) {
    const RowPlace at = row_place(a, w, row);
    const scalar_t* src = a.q + at.token * a.q_stride_token + at.q_head * a.q_stride_head;
    for (int64_t d = 0; d < D; ++d) qs[row * D + d] = static_cast<float>(src[d]) * a.scale;
    if constexpr (kInt8) rotate_query(qs + row * D, D);  // as the keys are stored
  }
  sc.p.resize(rows * kKvTile);
  // The cache's elements: the model's dtype, or int8 rows of D values and a scale.
  using cache_t = std::conditional_t<kInt8, int8_t, scalar_t>;
  const int64_t row_stride = kInt8 ? D + kInt8ScaleBytes : D;  // cache elements per row
  const cache_t* k_cache;
  const cache_t* v_cache;
  if constexpr (kInt8) {
    k_cache = a.k_int8;
    v_cache = a.v_int8;
  } else {
    k_cache = a.k_cache;
    v_cache = a.v_cache;
  }
  // KV slot offsets of tile positions.
  const auto slot_offsets = [&](int64_t t0, int64_t nt, int64_t* offset) {
    for (int64_t j = 0; j < nt; ++j) {
      const int64_t pos = t0 + j;
      offset[j] = (static_cast<int64_t>(blocks[pos / a.block_size]) * a.block_size +
                   pos % a.block_size) * Hkv * row_stride;
    }
  };
  // The tile's keys [first, end) a query sees: positions up to its own (causal), from its
  // window's start.
  const auto visible = [&](int64_t head_row, int64_t t0, int64_t nt, int64_t& first,
                           int64_t& end) {
    const int64_t pos = first_pos + head_row / G;
    first = std::max<int64_t>(0, window_start(pos, a.window) - t0);
    end = std::min<int64_t>(nt, pos - t0 + 1);
  };
  if constexpr (kD > 0) {
    // Per tile: the K pass (scores), the softmax, the V pass. Each pass prefetches the rows the
    // next one reads (the K pass the tile's V rows, the V pass the next tile's K rows; the
    // first tile's K rows are asked for up front), so the cache streams in without a gap
    // between passes, and visits the tile's two halves side by side, a key of each at a time
    // (keys 0 and h, 1 and h + 1, ...: two streams of the cache, two blocks at block size <=
    // 16). Each of these, and the vectorized softmax, made the kernel faster on cold caches;
    // four streams (tile quarters), four keys at a time, one head at a time across the tile
    // (strided reads) and pipelining tile i's K pass with tile i-1's V pass were slower.
    const cache_t* k_tile = k_cache + w.kv_head_begin * row_stride;
    const cache_t* v_tile = v_cache + w.kv_head_begin * row_stride;
    const int64_t num_heads = w.kv_head_end - w.kv_head_begin;
    const auto visit = [](int64_t i, int64_t n) { return i / 2 + (i % 2) * ((n + 1) / 2); };
    float* p = sc.p.data();
    int64_t offset[kKvTile], next_offset[kKvTile];
    const int64_t first_count = std::min<int64_t>(kKvTile, w.kv_end - w.kv_begin);
    slot_offsets(w.kv_begin, first_count, offset);
    for (int64_t i = 0; i < first_count; ++i) {
      prefetch_row<kD>(k_tile + offset[visit(i, first_count)], num_heads);
    }
    for (int64_t t0 = w.kv_begin; t0 < w.kv_end; t0 += kKvTile) {
      const int64_t nt = std::min<int64_t>(kKvTile, w.kv_end - t0);
      for (int64_t i = 0; i < nt; i += 2) {
        const int64_t ja = visit(i, nt), jb = i + 1 < nt ? visit(i + 1, nt) : -1;
        prefetch_row<kD>(v_tile + offset[ja], num_heads);
        if (jb >= 0) prefetch_row<kD>(v_tile + offset[jb], num_heads);
        if constexpr (kInt8) {
          direct_scores_int8<kD>(k_tile + offset[ja], ja, k_tile + offset[jb < 0 ? ja : jb], jb,
                                 num_heads, head_rows, qs, p);
        } else {
          direct_scores<kD>(k_tile + offset[ja], ja, k_tile + offset[jb < 0 ? ja : jb], jb,
                            num_heads, head_rows, qs, p);
        }
      }
      int64_t first[kMaxDirectRows], end[kMaxDirectRows];
      for (int64_t r = 0; r < head_rows; ++r) visible(r, t0, nt, first[r], end[r]);
      const int64_t count = direct_softmax<kD>(first, end, rows, head_rows, p, sc);
      const int64_t next_count = std::clamp<int64_t>(w.kv_end - (t0 + kKvTile), 0, kKvTile);
      slot_offsets(t0 + kKvTile, next_count, next_offset);
      // int8 rows: kPvKeys keys a pass (their widened rows fit the registers up to kD 64).
      constexpr int64_t kPvKeys = kInt8 && kD <= 64 ? 4 : 2;
      for (int64_t i = 0; i < count; i += kPvKeys) {
        for (int64_t n = i; n < std::min(i + kPvKeys, next_count); ++n) {
          prefetch_row<kD>(k_tile + next_offset[visit(n, next_count)], num_heads);
        }
        const int64_t ja = visit(i, count), jb = i + 1 < count ? visit(i + 1, count) : -1;
        if constexpr (kInt8) {
          int64_t j[kPvKeys];
          const int8_t* rows[kPvKeys];
          for (int64_t k = 0; k < kPvKeys; ++k) {
            j[k] = i + k < count ? visit(i + k, count) : -1;
            rows[k] = v_tile + offset[j[k] < 0 ? ja : j[k]];
          }
          direct_pv_int8<kD>(rows, j, num_heads, head_rows, p, sc.acc.data());
        } else {
          direct_pv<kD>(v_tile + offset[ja], ja, v_tile + offset[jb < 0 ? ja : jb], jb,
                        num_heads, head_rows, p, sc.acc.data());
        }
      }
      std::copy_n(next_offset, next_count, offset);
    }
  } else {
    // Head dims that are not a multiple of 16: gather each tile (K transposed to [D, tile] so
    // scores vectorize over the tile), then one query row at a time.
    sc.k_t.assign(D * kKvTile, 0.f);
    sc.v.assign(kKvTile * D, 0.f);
    int64_t slot_offset[kKvTile];
    for (int64_t t0 = w.kv_begin; t0 < w.kv_end; t0 += kKvTile) {
      const int64_t nt = std::min<int64_t>(kKvTile, w.kv_end - t0);
      slot_offsets(t0, nt, slot_offset);
      for (int64_t h = w.kv_head_begin; h < w.kv_head_end; ++h) {
        for (int64_t j = 0; j < nt; ++j) {
          widen_row(k_cache + slot_offset[j] + h * row_stride, D, sc.k_t.data() + j, kKvTile);
          widen_row(v_cache + slot_offset[j] + h * row_stride, D, sc.v.data() + j * D);
        }
        for (int64_t r = 0; r < head_rows; ++r) {
          const int64_t row = (h - w.kv_head_begin) * head_rows + r;
          int64_t first, end;
          visible(r, t0, nt, first, end);
          if (end <= first) continue;
          tile_update_scalar(D, qs + row * D, sc.k_t.data(), sc.v.data(), first, end,
                             sc.acc.data() + row * D, sc.m[row], sc.l[row]);
        }
      }
    }
  }
  write_rows(a, w, rows, sc, part);
}

}  // namespace orca::cpu

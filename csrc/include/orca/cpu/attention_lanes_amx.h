// attend_lanes on AMX tiles (orca/cpu/attention.h), where the build has them.
#pragma once

#include "orca/cpu/attention_lanes.h"

namespace orca::cpu {

#if defined(ORCA_ATTENTION_AMX)
constexpr int64_t kAmxKv = 64;  // keys per AMX KV tile
constexpr float kLazyLog2 = 8.f;  // how far past a row's m its scores may go (log2 units)

// attend_lanes (same contract) on AMX tiles: bfloat16 q and caches, kD a multiple of 32. Per
// KV tile of kAmxKv keys: S^T [key][W] = K . Q^T (K rows the A tiles, loaded in place where a
// block holds 16 of them in a row; Q^T as bf16 pairs the B tiles), the online softmax
// element-wise across the rows (P^T rounded to bf16 pairs: the B tiles of P.V), then
// O^T [D][W] = O^T * alpha + V^T . P^T (V^T transposed per tile: the A tiles). The tile unit
// and the vector units do not overlap on one core, so the steps run one after the other.
template <int kD, int kRV, typename scalar_t>
void attend_lanes_amx(const AttentionArgs<scalar_t>& a, const AttentionWork& w, int64_t h,
                      int64_t row_base, int64_t row_begin, int64_t count, int64_t first_pos,
                      AttentionScratch& sc) {
  static_assert(kD % 32 == 0 && sizeof(scalar_t) == 2);
  constexpr int W = kRV * 16, kRT = (kRV + 1) / 2, kDT = kD / 16, kQkSteps = kD / 32;
  constexpr int64_t kKv = kAmxKv;
  const int64_t G = a.num_q_heads / a.num_kv_heads, Hkv = a.num_kv_heads;
  const int32_t* blocks = a.block_table + w.request * a.max_blocks;
  const auto* k_cache = reinterpret_cast<const uint16_t*>(a.k_cache);
  const auto* v_cache = reinterpret_cast<const uint16_t*>(a.v_cache);

  // Q^T as pairs; padding lanes are zero, at position -1 (they see no key, never read).
  // 16 rows at a time: each row's kD / 2 words, transposed 16 x 16. Each row sees the keys
  // [start, pos].
  sc.q_pairs.resize(kD / 2 * W);
  alignas(64) int32_t pos[W], start[W];
  for (int r = 0; r < W; ++r) {
    pos[r] = r < count ? first_pos + (row_begin + r) / G : -1;
    start[r] = static_cast<int32_t>(window_start(std::max(pos[r], 0), a.window));
  }
  for (int rv = 0; rv < kRV; ++rv) {
    for (int c = 0; c < kD / 32; ++c) {
      __m512i words[16];
      for (int r = 0; r < 16; ++r) {
        const int64_t row = 16 * rv + r;
        if (row < count) {
          const RowPlace at = row_place(a, w, row_base + row_begin + row);
          const scalar_t* src = a.q + at.token * a.q_stride_token + at.q_head * a.q_stride_head;
          words[r] = _mm512_loadu_si512(src + 32 * c);
        } else {
          words[r] = _mm512_setzero_si512();
        }
      }
      amx::transpose16(words);
      for (int i = 0; i < 16; ++i) {
        _mm512_storeu_si512(sc.q_pairs.data() + (16 * c + i) * W + 16 * rv, words[i]);
      }
    }
  }
  __m512i row_pos[kRV], row_start[kRV];
  for (int rv = 0; rv < kRV; ++rv) {
    row_pos[rv] = _mm512_load_si512(pos + 16 * rv);
    row_start[rv] = _mm512_load_si512(start + 16 * rv);
  }

  // Per tile: S^T, gathered K rows, V^T, P^T pairs; the item's O^T.
  sc.s_t.resize(kKv * W);
  sc.k_rows.resize(kKv * kD);
  sc.v_t.resize(kD * kKv);
  sc.p_pairs.resize(kKv / 2 * W);
  sc.o_t.assign(kD * W, 0.f);
  sc.zero_row.assign(kD, 0.f);
  const auto* zero_row = reinterpret_cast<const uint16_t*>(sc.zero_row.data());
  alignas(64) float m[W], l[W];
  std::fill_n(m, W, kNegInf);
  std::fill_n(l, W, 0.f);
  // p = 2^((s - m) c): the scale and log2(e) in one multiplier.
  const float c_scalar = a.scale * 1.4426950408889634f;
  const __m512 c = _mm512_set1_ps(c_scalar);
  const __m512 neg_inf = _mm512_set1_ps(kNegInf), zero = _mm512_setzero_ps();
  // K tiles of 16 keys load in place when no tile straddles a block.
  const bool in_place = a.block_size % 16 == 0 && w.kv_begin % 16 == 0;
  const int64_t k_stride = in_place ? Hkv * kD * 2 : kD * 2;
  char* const o_t = reinterpret_cast<char*>(sc.o_t.data());
  const char* const q_t = reinterpret_cast<const char*>(sc.q_pairs.data());
  const char* const p_t = reinterpret_cast<const char*>(sc.p_pairs.data());

  struct Tile {
    int64_t t0, nt;
    int nkt, nks;  // key tiles of 16, key steps of 32
    bool short_tile;  // nt is not a multiple of 16
    int rt_begin;  // the row tiles before it (pairs) see none of its keys: skipped
    float* s;
    uint16_t* v_t;
    const char* k_tiles[kKv / 16];
    const uint16_t* v_rows[kKv];
  };
  // A tile's K and V row addresses (slot offsets walked block by block: no division per key),
  // K rows gathered where they cannot be loaded in place.
  const auto prepare = [&](Tile& tl, int64_t t0) {
    tl.t0 = t0;
    tl.nt = std::min<int64_t>(kKv, w.kv_end - t0);
    tl.nkt = static_cast<int>((tl.nt + 15) / 16);
    tl.nks = static_cast<int>((tl.nt + 31) / 32);
    tl.short_tile = tl.nt % 16 != 0;
    // Positions grow with the row, so the rows that see none of the keys come first.
    tl.rt_begin = 0;
    while (tl.rt_begin + 2 < kRV &&
           pos[std::min<int64_t>(16 * tl.rt_begin + 31, count - 1)] < t0) {
      tl.rt_begin += 2;
    }
    tl.s = sc.s_t.data();
    tl.v_t = sc.v_t.data();
    uint16_t* k_rows = sc.k_rows.data();
    int64_t block = t0 / a.block_size, slot = t0 % a.block_size;
    for (int64_t j = 0; j < tl.nt; ++j, ++slot) {
      if (slot == a.block_size) {
        ++block;
        slot = 0;
      }
      const int64_t offset =
          ((static_cast<int64_t>(blocks[block]) * a.block_size + slot) * Hkv + h) * kD;
      tl.v_rows[j] = v_cache + offset;
      if (in_place) {
        if (j % 16 == 0) tl.k_tiles[j / 16] = reinterpret_cast<const char*>(k_cache + offset);
      } else {
        std::memcpy(k_rows + j * kD, k_cache + offset, kD * 2);
      }
    }
    // Keys past nt: zero V rows (p = 0 there, and 0 * a stale NaN would not be 0).
    for (int64_t j = tl.nt; j < tl.nks * 32; ++j) tl.v_rows[j] = zero_row;
    if (!in_place) {
      std::fill(k_rows + tl.nt * kD, k_rows + tl.nkt * 16 * kD, 0);
      for (int kt = 0; kt < tl.nkt; ++kt) {
        tl.k_tiles[kt] = reinterpret_cast<const char*>(k_rows + kt * 16 * kD);
      }
    }
  };
  // Piece `chunk` (of kRT * nkt) of S^T = K . Q^T: key tile kt against 32 rows (two column
  // tiles) from row tile rt.
  const auto qk_chunk = [&](const Tile& tl, int chunk) {
    const int rt = 2 * (chunk / tl.nkt), kt = chunk % tl.nkt;
    char* c_tile = reinterpret_cast<char*>(tl.s) + (kt * 16 * W + rt * 16) * 4;
    const char* b = q_t + rt * 64;
    const auto run = [&]<int kNB>() {
      if constexpr (kQkSteps <= 2) {
        if (kt == 0) amx::load_b<kQkSteps, kNB>(b, W * 4, 16 * W * 4);
        amx::row_step<kQkSteps, kNB, false>(c_tile, W * 4, tl.k_tiles[kt], k_stride);
      } else {
        amx::tile_block<1, kNB, false>(c_tile, W * 4, 0, tl.k_tiles[kt], tl.k_tiles[kt],
                                       k_stride, 64, b, W * 4, 16 * W * 4, kQkSteps);
      }
    };
    if (rt + 1 < kRV) run.template operator()<2>(); else run.template operator()<1>();
  };
  // Piece `chunk` (of kRT * kDT) of O^T += V^T . P^T: dims tile dt against 32 rows from rt.
  const auto pv_chunk = [&](const Tile& tl, int chunk) {
    const int rt = 2 * (chunk / kDT), dt = chunk % kDT;
    const auto run = [&]<int kSteps, int kNB>() {
      if (dt == 0) amx::load_b<kSteps, kNB>(p_t + rt * 64, W * 4, 16 * W * 4);
      amx::row_step<kSteps, kNB, true>(o_t + (dt * 16 * W + rt * 16) * 4, W * 4,
                                       reinterpret_cast<const char*>(tl.v_t + dt * 16 * kKv),
                                       kKv * 2);
    };
    if (tl.nks == 2) {
      if (rt + 1 < kRV) run.template operator()<2, 2>(); else run.template operator()<2, 1>();
    } else {
      if (rt + 1 < kRV) run.template operator()<1, 2>(); else run.template operator()<1, 1>();
    }
  };
  // Piece `chunk` (of nks * kDT) of V^T: 16 dims of 32 keys.
  const auto vt_chunk = [&](const Tile& tl, int chunk) {
    const int ks = chunk / kDT;
    amx::transpose_v(tl.v_rows + 32 * ks, chunk % kDT, tl.v_t + 32 * ks, kKv);
  };
  // Softmax of one row vector (16 rows): scores of keys a row does not see become -inf (only
  // in masked tiles), the tile maximum, then p (as bf16 pairs), l, m, and O^T's columns of
  // these rows scaled by alpha (skipped where no maximum moved).
  const auto softmax = [&](const Tile& tl, int rv) {
    float* const s = tl.s + 16 * rv;
    // Masks only where the tile is short or crosses these rows' causal diagonal or the start
    // of one's window (positions grow with the row).
    const bool masked = tl.short_tile || tl.t0 + tl.nt - 1 > pos[16 * rv] ||
                        tl.t0 < start[std::min<int64_t>(16 * rv + 15, count - 1)];
    for (int64_t j = tl.nkt * 16; j < tl.nks * 32; ++j) _mm512_storeu_ps(s + j * W, neg_inf);
    __m512 tile_max = neg_inf;
    if (masked) {
      for (int64_t j = 0; j < tl.nkt * 16; ++j) {
        const __m512i key =
            _mm512_set1_epi32(j < tl.nt ? static_cast<int>(tl.t0 + j) : INT32_MAX);
        const __mmask16 visible = _mm512_cmpge_epi32_mask(row_pos[rv], key) &
                                  _mm512_cmple_epi32_mask(row_start[rv], key);
        const __m512 x = _mm512_mask_mov_ps(neg_inf, visible, _mm512_loadu_ps(s + j * W));
        _mm512_storeu_ps(s + j * W, x);
        tile_max = _mm512_max_ps(tile_max, x);
      }
    } else {
      for (int64_t j = 0; j < tl.nkt * 16; ++j) {
        tile_max = _mm512_max_ps(tile_max, _mm512_loadu_ps(s + j * W));
      }
    }
    // Lazy maximum: a row's m moves only when the tile's maximum passes it by more than
    // kLazyLog2 (in log2 units; p stays <= 2^kLazyLog2), so O^T is rarely rescaled.
    const __m512 m_old = _mm512_load_ps(m + 16 * rv);
    const __mmask16 moved = _mm512_cmp_ps_mask(
        tile_max, _mm512_add_ps(m_old, _mm512_set1_ps(kLazyLog2 / c_scalar)), _CMP_GT_OQ);
    const __m512 m_new = _mm512_mask_mov_ps(m_old, moved, tile_max);
    // A row that has seen no key yet (m = -inf) has o = l = 0: scale by 0, never by NaN.
    const __mmask16 seen = _mm512_cmp_ps_mask(m_old, neg_inf, _CMP_NEQ_OQ);
    const __m512 al = _mm512_mask_mov_ps(
        _mm512_set1_ps(1.f), moved,
        _mm512_maskz_mov_ps(seen, amx::exp2_small<true>(
                                      _mm512_mul_ps(_mm512_sub_ps(m_old, m_new), c))));
    const __mmask16 any = _mm512_cmp_ps_mask(m_new, neg_inf, _CMP_NEQ_OQ);
    const __m512 nb = _mm512_maskz_mov_ps(any, _mm512_mul_ps(m_new, _mm512_sub_ps(zero, c)));
    __m512 sum = zero;
    const auto exp_pass = [&]<bool kMaybeInf>() {
      for (int64_t i = 0; i < tl.nks * 16; ++i) {
        const __m512 e0 = amx::exp2_small<kMaybeInf>(
            _mm512_fmadd_ps(_mm512_loadu_ps(s + 2 * i * W), c, nb));
        const __m512 e1 = amx::exp2_small<kMaybeInf>(
            _mm512_fmadd_ps(_mm512_loadu_ps(s + (2 * i + 1) * W), c, nb));
        sum = _mm512_add_ps(sum, _mm512_add_ps(e0, e1));
        _mm512_storeu_si512(sc.p_pairs.data() + i * W + 16 * rv, amx::round_pairs(e0, e1));
      }
    };
    // -inf scores: masked tiles, and the padding of an odd number of key tiles.
    if (masked || tl.nkt % 2 == 1) {
      exp_pass.template operator()<true>();
    } else {
      exp_pass.template operator()<false>();
    }
    _mm512_store_ps(l + 16 * rv, _mm512_fmadd_ps(_mm512_load_ps(l + 16 * rv), al, sum));
    _mm512_store_ps(m + 16 * rv, m_new);
    if (moved != 0) {
      for (int d = 0; d < kD; ++d) {
        float* o = sc.o_t.data() + d * W + 16 * rv;
        _mm512_storeu_ps(o, _mm512_mul_ps(_mm512_loadu_ps(o), al));
      }
    }
  };

  // Flush-to-zero and denormals-are-zero while the item runs: the masked keys' 2^-200 and
  // tiny probabilities would otherwise take microcode assists.
  const unsigned int csr = _mm_getcsr();
  _mm_setcsr(csr | 0x8040);
  amx::configure_tiles();
  Tile tl;
  for (int64_t t0 = w.kv_begin; t0 < w.kv_end; t0 += kKv) {
    prepare(tl, t0);
    for (int i = tl.rt_begin / 2 * tl.nkt; i < kRT * tl.nkt; ++i) qk_chunk(tl, i);
    for (int i = 0; i < tl.nks * kDT; ++i) vt_chunk(tl, i);
    for (int rv = tl.rt_begin; rv < kRV; ++rv) softmax(tl, rv);
    for (int i = tl.rt_begin / 2 * kDT; i < kRT * kDT; ++i) pv_chunk(tl, i);
  }
  _tile_release();
  _mm_setcsr(csr);
  // m in the units of the other paths: the scaled scores'.
  const int64_t row0 = row_base + row_begin;
  for (int rv = 0; rv < kRV; ++rv) {
    for (int dt = 0; dt < kDT; ++dt) {
      __m512i x[16];
      for (int i = 0; i < 16; ++i) {
        x[i] = _mm512_loadu_si512(sc.o_t.data() + (16 * dt + i) * W + 16 * rv);
      }
      amx::transpose16(x);
      for (int r = 0; r < 16 && 16 * rv + r < count; ++r) {
        _mm512_storeu_si512(sc.acc.data() + (row0 + 16 * rv + r) * kD + 16 * dt, x[r]);
      }
    }
  }
  for (int64_t r = 0; r < count; ++r) {
    sc.m[row0 + r] = m[r] * a.scale;
    sc.l[row0 + r] = l[r];
  }
}
#endif  // ORCA_ATTENTION_AMX

}  // namespace orca::cpu

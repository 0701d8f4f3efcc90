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
#pragma once

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <utility>
#include <vector>

#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

#include "orca/cpu/attention_amx.h"
#include "orca/cpu/kv_int8.h"
#include "orca/cpu/lanes_linear.h"
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
  // Sliding window: the query at position p sees keys (p - window, p]; 0: every key up to p.
  int64_t window;
  // An int8 cache (then k_cache and v_cache are null): [num_blocks, block_size, Hkv, D + 4],
  // rows as kv_int8.h lays them out.
  const int8_t* k_int8 = nullptr;
  const int8_t* v_int8 = nullptr;
};

// A cache row of D values (an int8 row: dequantized) written to out[d * out_stride].
template <typename cache_t>
inline void widen_row(const cache_t* row, int64_t D, float* out, int64_t out_stride = 1) {
  if constexpr (std::is_same_v<cache_t, int8_t>) {
    const float scale = int8_row_scale(row, D);
    for (int64_t d = 0; d < D; ++d) out[d * out_stride] = static_cast<float>(row[d]) * scale;
  } else {
    for (int64_t d = 0; d < D; ++d) out[d * out_stride] = static_cast<float>(row[d]);
  }
}

// The first key position the query at `pos` sees under `window` (0: no window).
inline int64_t window_start(int64_t pos, int64_t window) {
  return window > 0 ? std::max<int64_t>(0, pos - window + 1) : 0;
}

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

// The prefill-like items' kernels, by the names ORCA_ATTENTION_ISA takes: float lanes
// (portable, and every float32 / float16 run), bf16 pair dot products, AMX tiles.
enum class AttentionIsa { kPortable, kAvx512Bf16, kAmx };
inline constexpr std::pair<const char*, AttentionIsa> kAttentionIsaNames[] = {
    {"portable", AttentionIsa::kPortable},
    {"avx512bf16", AttentionIsa::kAvx512Bf16},
    {"amx", AttentionIsa::kAmx}};

// Rows per pass of the AMX kernels: up to 128, where the plan gives long prefills items that
// wide (V^T and the K / V addressing shared by more rows).
constexpr int64_t kMaxAmxRows = 128;

// Whether the path runs head_dim on the AMX kernels for bfloat16 (and so takes wide items).
inline bool amx_head_dim(AttentionIsa isa, int64_t head_dim) {
  return isa == AttentionIsa::kAmx &&
         (head_dim == 32 || head_dim == 64 || head_dim == 96 || head_dim == 128 ||
          head_dim == 256);
}

// Whether this build and CPU run the path: the bf16 pair kernels are compiled in where the build
// targets AVX512-BF16 (-march=native on such a CPU), the AMX ones likewise and need the OS's
// grant of tile data.
inline bool attention_isa_supported(AttentionIsa isa) {
  switch (isa) {
    case AttentionIsa::kAmx: return amx::usable();
    case AttentionIsa::kAvx512Bf16:
#if defined(__AVX512BF16__)
      return true;
#else
      return false;
#endif
    default: return true;
  }
}

struct AttentionScratch {
  std::vector<float> q, acc, k_t, v, m, l, p;
  // Prefill-like rows as vector lanes: Q^T [D][W], the rows' running (acc, m, l), the tile's
  // rescale factors, K/V rows widened to float, and a zero row to pad the last key step.
  std::vector<float> qt, lane_acc, lane_m, lane_l, alpha, k_float, v_float, zero_row;
  std::vector<uint32_t> q_pairs, p_pairs, v_pairs;  // bfloat16 pairs (kBf16Dot)
  // AMX: a KV tile's scores S^T [key][W], its K rows gathered [key][D] (where not loadable in
  // place), V^T [D][key], and the rows' output accumulators O^T [D][W].
  std::vector<float> s_t, o_t;
  std::vector<uint16_t> k_rows, v_t;
};

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

// Asks for one key's K or V row (row: its first head) to be brought into L2 ahead of use:
// every other cache line, the hardware's adjacent-line prefetch fetching the rest.
template <int kD, typename cache_t>
inline void prefetch_row(const cache_t* row, int64_t num_heads) {
  const char* bytes = reinterpret_cast<const char*>(row);
  const int64_t size = std::is_same_v<cache_t, int8_t>
                           ? num_heads * (kD + kInt8ScaleBytes)
                           : num_heads * kD * static_cast<int64_t>(sizeof(cache_t));
  for (int64_t b = 0; b < size; b += 128) __builtin_prefetch(bytes + b, 0, 2);
}

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

// direct_pv over int8 rows: each key's probability times its V row's scale weighs the int8
// values widened in registers.
template <int kD>
inline void direct_pv_int8(const int8_t* va_row, int64_t ja, const int8_t* vb_row, int64_t jb,
                           int64_t num_heads, int64_t head_rows, const float* p, float* acc) {
  constexpr int kNV = kD / 16;
  constexpr int64_t kRow = kD + kInt8ScaleBytes;
  for (int64_t h = 0; h < num_heads; ++h) {
    const int8_t* a_h = va_row + h * kRow;
    const int8_t* b_h = vb_row + h * kRow;
    vec16 va[kNV], vb[kNV];
    for (int c = 0; c < kNV; ++c) {
      va[c] = load16_int8(a_h + 16 * c);
      vb[c] = load16_int8(b_h + 16 * c);
    }
    const float scale_a = int8_row_scale(a_h, kD);
    const float scale_b = jb < 0 ? 0.f : int8_row_scale(b_h, kD);
    for (int64_t r = 0; r < head_rows; ++r) {
      const int64_t row = h * head_rows + r;
      const float pa = p[row * kKvTile + ja] * scale_a;
      const float pb = jb < 0 ? 0.f : p[row * kKvTile + jb] * scale_b;
      float* o = acc + row * kD;
      for (int c = 0; c < kNV; ++c) {
        store16(o + 16 * c, load16(o + 16 * c) + pa * va[c] + pb * vb[c]);
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

// Writes a finished item's rows: normalized into out, or as (o, m, l) partials of a split.
template <typename scalar_t>
void write_rows(const AttentionArgs<scalar_t>& a, const AttentionWork& w, int64_t rows,
                const AttentionScratch& sc, const Partials& part) {
  const int64_t D = a.head_dim;
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
      for (int64_t i = 0; i < count; i += 2) {
        for (int64_t n = i; n < std::min(i + 2, next_count); ++n) {
          prefetch_row<kD>(k_tile + next_offset[visit(n, next_count)], num_heads);
        }
        const int64_t ja = visit(i, count), jb = i + 1 < count ? visit(i + 1, count) : -1;
        if constexpr (kInt8) {
          direct_pv_int8<kD>(v_tile + offset[ja], ja, v_tile + offset[jb < 0 ? ja : jb], jb,
                             num_heads, head_rows, p, sc.acc.data());
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

// The CPU attention kernels' shared pieces (orca/cpu/attention.h): the arguments, the work
// item and where its rows live, the partials of split items, the kernel paths, the per-thread
// scratch, K / V rows as floats and their prefetch, and the writing of a finished item's rows.
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

}  // namespace orca::cpu

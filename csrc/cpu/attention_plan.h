// The CPU ragged attention's work plan, shared by ragged_attention and the fused
// DecoderStack: the metadata's value checks, and the cut of the batch into AttentionWork
// items (request x KV heads x query block x KV split) with the merges of split ranges.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <utility>
#include <vector>

#include "bf16_dot.h"
#include "ceil_div.h"
#include "checks.h"
#include "isa_choice.h"
#include "orca/cpu/attention.h"

namespace orca {

using cpu::AttentionWork;

constexpr int64_t kMaxRowsPerItem = 64;  // query rows (queries x group heads) per item
// With wide items (the AMX kernels), requests of at least this many queries take items of up to
// cpu::kMaxAmxRows rows; shorter ones keep 64 (wide items were slower there).
constexpr int64_t kMinWideQueries = 1024;
// Never split KV ranges below this many positions. Low enough that a decode step over short
// contexts (batch 1-3, ~128 positions) still gives every thread a share of the KV to read,
// which beats whole requests per thread there because the merge is cheap.
constexpr int64_t kMinSplitKv = 64;
// Plan cost below which one thread does it all (~0.5 MB of float32 KV for a decode).
constexpr double kMinParallelCost = 8e3;
// Partial rows (of head_dim floats) below which the merges run on the calling thread.
constexpr double kMinParallelMergeRows = 256;

inline void check_metadata_values(const AttentionShape& s, const int32_t* cu, const int32_t* ctx,
                           const int32_t* table) {
  TORCH_CHECK(cu[0] == 0, "cu_q_lens[0] must be 0, got ", cu[0]);
  TORCH_CHECK(cu[s.batch] == s.num_tokens, "cu_q_lens[B] = ", cu[s.batch],
              " must equal the number of query tokens T = ", s.num_tokens);
  for (int64_t r = 0; r < s.batch; ++r) {
    const int64_t q_len = cu[r + 1] - cu[r];
    TORCH_CHECK(q_len >= 0, "cu_q_lens must be non-decreasing, but cu_q_lens[", r + 1, "] = ",
                cu[r + 1], " < cu_q_lens[", r, "] = ", cu[r]);
    TORCH_CHECK(ctx[r] >= q_len, "context_lens[", r, "] = ", ctx[r],
                " is smaller than request ", r, "'s query length ", q_len);
    const int64_t used = ceil_div(ctx[r], s.block_size);
    TORCH_CHECK(used <= s.max_blocks, "context_lens[", r, "] = ", ctx[r], " needs ", used,
                " blocks of ", s.block_size, " but block_table has ", s.max_blocks, " columns");
    for (int64_t b = 0; b < used; ++b) {
      const int32_t id = table[r * s.max_blocks + b];
      TORCH_CHECK(id >= 0 && id < s.num_blocks, "block_table[", r, ", ", b, "] = ", id,
                  " is out of range for a cache of ", s.num_blocks, " blocks");
    }
  }
}

// The splits of one item's KV range to combine: the first split and how many follow it.
struct Merge {
  AttentionWork first;
  int64_t num_splits;
};

struct Plan {
  std::vector<AttentionWork> items;  // in execution order (costliest first)
  std::vector<Merge> merges;
  int64_t partial_rows = 0;
  double merge_cost = 0;  // partial rows to combine, summed over the merges
  bool parallel = true;   // false: too little work to pay for a fork-join
};

// One (request, KV heads, query block) before KV splitting, with its estimated cost.
struct Group {
  AttentionWork work;
  double cost;
};

// The busiest thread's cost when each group is cut into splits[g] equal items and the items
// are handed out costliest first to whichever thread is least loaded (as run_dynamic does).
inline double longest_thread(const std::vector<Group>& groups, const std::vector<int64_t>& splits,
                      int64_t threads) {
  std::vector<double> costs;
  for (size_t g = 0; g < groups.size(); ++g) {
    costs.insert(costs.end(), splits[g], groups[g].cost / splits[g]);
  }
  std::sort(costs.begin(), costs.end(), std::greater<>());
  std::vector<double> load(threads, 0.0);
  for (const double c : costs) *std::min_element(load.begin(), load.end()) += c;
  return *std::max_element(load.begin(), load.end());
}

// wide_items: long requests' prefill items take up to cpu::kMaxAmxRows rows (the AMX kernels).
// window: the attention's sliding window (0: none); an item's KV range starts at the first key
// its first query sees, so a long context costs O(window) per query block, not O(context).
inline Plan make_plan(const AttentionShape& s, const int32_t* cu, const int32_t* ctx,
                      bool wide_items = false, int64_t window = 0) {
  const int64_t G = s.num_q_heads / s.num_kv_heads;
  std::vector<Group> groups;
  double total = 0;
  for (int64_t r = 0; r < s.batch; ++r) {
    const int64_t q_len = cu[r + 1] - cu[r], first_pos = ctx[r] - q_len;
    const int64_t item_rows =
        wide_items && q_len >= kMinWideQueries ? cpu::kMaxAmxRows : kMaxRowsPerItem;
    const int64_t q_block = std::max<int64_t>(1, item_rows / G);
    for (int64_t qb = 0; qb < q_len; qb += q_block) {
      const int64_t qe = std::min(q_len, qb + q_block);
      const int64_t kv_begin = cpu::window_start(first_pos + qb, window), kv_end = first_pos + qe;
      // Decode-like items take all KV heads (the cache is read front to back, and the work
      // is memory-bound); prefill blocks take one head each (compute-bound, more items).
      const int64_t heads = (qe - qb) * G <= cpu::kMaxDirectRows ? s.num_kv_heads : 1;
      // Gathering a KV tile costs about as much as a few query rows of math on it.
      const double cost = static_cast<double>(kv_end - kv_begin) * heads * ((qe - qb) * G + 8);
      for (int64_t h = 0; h < s.num_kv_heads; h += heads) {
        groups.push_back({{static_cast<int32_t>(r), static_cast<int32_t>(h),
                           static_cast<int32_t>(h + heads), static_cast<int32_t>(qb),
                           static_cast<int32_t>(qe), static_cast<int32_t>(kv_begin),
                           static_cast<int32_t>(kv_end), -1},
                          cost});
        total += cost;
      }
    }
  }
  // Split long KV ranges into equal chunks, as few as balance the threads: each split adds an
  // item's start-up and a merge. Finer splits (about 2, then 4 items per thread) only when the
  // coarser ones would leave a thread idle for over 10 % of the step (unequal requests).
  const double per_thread = total / at::get_num_threads();
  std::vector<int64_t> splits(groups.size(), 1);
  for (const double items_per_thread : {1.0, 2.0, 4.0}) {
    for (size_t g = 0; g < groups.size(); ++g) {
      splits[g] = std::clamp<int64_t>(
          static_cast<int64_t>(std::ceil(groups[g].cost * items_per_thread / per_thread)), 1,
          std::max<int64_t>(1, (groups[g].work.kv_end - groups[g].work.kv_begin) / kMinSplitKv));
    }
    if (longest_thread(groups, splits, at::get_num_threads()) <= 1.1 * per_thread) break;
  }
  std::vector<std::pair<double, AttentionWork>> items;
  Plan plan;
  plan.parallel = total >= kMinParallelCost;
  for (size_t g = 0; g < groups.size(); ++g) {
    const AttentionWork& work = groups[g].work;
    const double cost = groups[g].cost;
    if (splits[g] == 1) {
      items.emplace_back(cost, work);
      continue;
    }
    const int64_t kv_begin = work.kv_begin, kv_end = work.kv_end;
    const int64_t chunk = ceil_div(kv_end - kv_begin, splits[g]);
    const int64_t num_splits = ceil_div(kv_end - kv_begin, chunk);
    const int64_t rows = work.num_rows(G);
    AttentionWork first = work;
    first.partial_row = plan.partial_rows;
    plan.merges.push_back({first, num_splits});
    for (int64_t sp = 0; sp < num_splits; ++sp) {
      AttentionWork w = work;
      w.kv_begin = static_cast<int32_t>(kv_begin + sp * chunk);
      w.kv_end = static_cast<int32_t>(std::min(kv_end, kv_begin + (sp + 1) * chunk));
      w.partial_row = plan.partial_rows;
      plan.partial_rows += rows;
      items.emplace_back(cost / num_splits, w);
    }
    plan.merge_cost += static_cast<double>(rows) * num_splits;
  }
  std::stable_sort(items.begin(), items.end(),
                   [](const auto& x, const auto& y) { return x.first > y.first; });
  plan.items.reserve(items.size());
  for (const auto& it : items) plan.items.push_back(it.second);
  return plan;
}

// f.template operator()<kIsa>() for the path isa takes with scalar_t: the portable kernels for
// every dtype but bfloat16 (and for bfloat16 where the build has no pair kernels).
template <typename scalar_t, typename F>
void dispatch_attention_isa(cpu::AttentionIsa isa, const F& f) {
  using cpu::AttentionIsa;
  if constexpr (kBf16Dot<scalar_t>) {
#if defined(ORCA_ATTENTION_AMX)
    if (isa == AttentionIsa::kAmx) return f.template operator()<AttentionIsa::kAmx>();
#endif
    if (isa != AttentionIsa::kPortable) return f.template operator()<AttentionIsa::kAvx512Bf16>();
  }
  return f.template operator()<AttentionIsa::kPortable>();
}

// f.template operator()<kIsa, kInt8>() for the kernels of a cache: an int8 cache's on the
// portable path (its rows are widened to float), a float cache's as dispatch_attention_isa says.
template <typename scalar_t, typename F>
void dispatch_attention_kernels(cpu::AttentionIsa isa, bool int8_cache, const F& f) {
  if (int8_cache) return f.template operator()<cpu::AttentionIsa::kPortable, true>();
  dispatch_attention_isa<scalar_t>(
      isa, [&]<cpu::AttentionIsa kIsa>() { f.template operator()<kIsa, false>(); });
}

// f.template operator()<kD>() with the head dim as a compile-time constant where a vector
// kernel exists for it, else kD = 0 (the scalar path).
template <typename F>
void dispatch_head_dim(int64_t head_dim, const F& f) {
  switch (head_dim) {
    case 32: return f.template operator()<32>();
    case 64: return f.template operator()<64>();
    case 80: return f.template operator()<80>();
    case 96: return f.template operator()<96>();
    case 128: return f.template operator()<128>();
    case 256: return f.template operator()<256>();
    default: return f.template operator()<0>();
  }
}

}  // namespace orca

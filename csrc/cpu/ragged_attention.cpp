// ragged_attention on CPU: validates the metadata, plans work items (request x KV head x
// query block x KV split), runs them with dynamic load balancing across the intra-op
// threads, then merges split partials. Kernel math: csrc/include/orca/cpu/attention.h.
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <atomic>
#include <cmath>
#include <functional>
#include <numeric>

#include "bf16_dot.h"
#include "checks.h"
#include "orca/cpu/attention.h"

namespace orca {
namespace {

using cpu::AttentionWork;

constexpr int64_t kMaxRowsPerItem = 64;  // query rows (queries x group heads) per item
// Never split KV ranges below this many positions. Low enough that a decode step over short
// contexts (batch 1-3, ~128 positions) still gives every thread a share of the KV to read:
// measured ~1.3x faster there than whole requests per thread (the merge is cheap).
constexpr int64_t kMinSplitKv = 64;
// Plan cost below which one thread does it all (~0.5 MB of float32 KV for a decode).
constexpr double kMinParallelCost = 8e3;
// Partial rows (of head_dim floats) below which the merges run on the calling thread.
constexpr double kMinParallelMergeRows = 256;

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

void check_metadata_values(const AttentionShape& s, const int32_t* cu, const int32_t* ctx,
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

struct Plan {
  std::vector<AttentionWork> items;  // in execution order (costliest first)
  std::vector<std::pair<AttentionWork, int64_t>> merges;  // first split of a group, num splits
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
double longest_thread(const std::vector<Group>& groups, const std::vector<int64_t>& splits,
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

Plan make_plan(const AttentionShape& s, const int32_t* cu, const int32_t* ctx) {
  const int64_t G = s.num_q_heads / s.num_kv_heads;
  const int64_t q_block = std::max<int64_t>(1, kMaxRowsPerItem / G);
  std::vector<Group> groups;
  double total = 0;
  for (int64_t r = 0; r < s.batch; ++r) {
    const int64_t q_len = cu[r + 1] - cu[r], first_pos = ctx[r] - q_len;
    for (int64_t qb = 0; qb < q_len; qb += q_block) {
      const int64_t qe = std::min(q_len, qb + q_block);
      const int64_t kv_end = first_pos + qe;
      // Decode-like items take all KV heads (the cache is read front to back, and the work
      // is memory-bound); prefill blocks take one head each (compute-bound, more items).
      const int64_t heads = (qe - qb) * G <= cpu::kMaxDirectRows ? s.num_kv_heads : 1;
      // Gathering a KV tile costs about as much as a few query rows of math on it.
      const double cost = static_cast<double>(kv_end) * heads * ((qe - qb) * G + 8);
      for (int64_t h = 0; h < s.num_kv_heads; h += heads) {
        groups.push_back({{static_cast<int32_t>(r), static_cast<int32_t>(h),
                           static_cast<int32_t>(h + heads), static_cast<int32_t>(qb),
                           static_cast<int32_t>(qe), 0, static_cast<int32_t>(kv_end), -1},
                          cost});
        total += cost;
      }
    }
  }
  // Split long KV ranges into equal chunks, as few as balance the threads: each split adds an
  // item's start-up and a merge. Finer splits (about 2, then 4 items per thread) only when the
  // coarser ones would leave a thread idle for over 10 % of the step (unequal requests).
  // Against four tile-aligned items per thread and the merges always forked: decode attention
  // at batch 1 / 2 / 3 / 4 x 129 positions (orca-tiny, 2 threads, in the model, ad hoc)
  // 15 % / 3 % / 4 % / 7 % faster.
  const double per_thread = total / at::get_num_threads();
  std::vector<int64_t> splits(groups.size(), 1);
  for (const double items_per_thread : {1.0, 2.0, 4.0}) {
    for (size_t g = 0; g < groups.size(); ++g) {
      splits[g] = std::clamp<int64_t>(
          static_cast<int64_t>(std::ceil(groups[g].cost * items_per_thread / per_thread)), 1,
          std::max<int64_t>(1, groups[g].work.kv_end / kMinSplitKv));
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
    const int64_t kv_end = work.kv_end, chunk = ceil_div(kv_end, splits[g]);
    const int64_t num_splits = ceil_div(kv_end, chunk);
    const int64_t rows = work.num_rows(G);
    AttentionWork first = work;
    first.partial_row = plan.partial_rows;
    plan.merges.emplace_back(first, num_splits);
    for (int64_t sp = 0; sp < num_splits; ++sp) {
      AttentionWork w = work;
      w.kv_begin = static_cast<int32_t>(sp * chunk);
      w.kv_end = static_cast<int32_t>(std::min(kv_end, (sp + 1) * chunk));
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

// Runs fn(i) for i in [0, n) on the intra-op threads (or inline when `parallel` is false), each
// taking the next index when it is free (items have very unequal costs, so static chunks would
// leave a core idle).
template <typename F>
void run_dynamic(int64_t n, bool parallel, const F& fn) {
  std::atomic<int64_t> next{0};
  const int64_t workers = parallel ? std::min<int64_t>(n, at::get_num_threads()) : 1;
  at::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
    for (int64_t i = next++; i < n; i = next++) fn(i);
  });
}

template <typename scalar_t, int kD>
void run_attention(const cpu::AttentionArgs<scalar_t>& args, const Plan& plan,
                   const cpu::Partials& part) {
  run_dynamic(static_cast<int64_t>(plan.items.size()), plan.parallel, [&](int64_t i) {
    thread_local cpu::AttentionScratch scratch;
    cpu::attend<kD, kBf16Dot<scalar_t>>(args, plan.items[i], scratch, part);
  });
  // A few merges (decodes) run on this thread: cheaper than a second fork-join.
  const bool parallel_merges = plan.parallel && plan.merge_cost > kMinParallelMergeRows;
  run_dynamic(static_cast<int64_t>(plan.merges.size()), parallel_merges, [&](int64_t i) {
    cpu::merge_partials(args, plan.merges[i].first, plan.merges[i].second, part);
  });
}

at::Tensor ragged_attention_cpu(const at::Tensor& q_in, const at::Tensor& k_cache,
                                const at::Tensor& v_cache, const at::Tensor& cu_q_lens_in,
                                const at::Tensor& context_lens_in,
                                const at::Tensor& block_table_in, double scale) {
  const AttentionShape s = check_attention_inputs(q_in, k_cache, v_cache, cu_q_lens_in,
                                                  context_lens_in, block_table_in, scale);
  const at::Tensor q = q_in.stride(2) == 1 ? q_in : q_in.contiguous();
  const at::Tensor cu_q_lens = cu_q_lens_in.contiguous(), context_lens = context_lens_in.contiguous(),
                   block_table = block_table_in.contiguous();
  const int32_t* cu = cu_q_lens.data_ptr<int32_t>();
  const int32_t* ctx = context_lens.data_ptr<int32_t>();
  check_metadata_values(s, cu, ctx, block_table.data_ptr<int32_t>());
  at::Tensor out = at::empty({s.num_tokens, s.num_q_heads, s.head_dim}, q.options());
  if (s.num_tokens == 0) return out;

  const Plan plan = make_plan(s, cu, ctx);
  at::Tensor part_o = at::empty({plan.partial_rows, s.head_dim}, q.options().dtype(at::kFloat));
  at::Tensor part_ml = at::empty({2, plan.partial_rows}, q.options().dtype(at::kFloat));
  const cpu::Partials part{part_o.data_ptr<float>(), part_ml.data_ptr<float>(),
                           part_ml.data_ptr<float>() + plan.partial_rows};
  ORCA_DISPATCH_FLOAT_TYPES(q.scalar_type(), "ragged_attention", [&] {
    const cpu::AttentionArgs<scalar_t> args{
        q.data_ptr<scalar_t>(), q.stride(0), q.stride(1),
        k_cache.data_ptr<scalar_t>(), v_cache.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(),
        cu, ctx, block_table.data_ptr<int32_t>(), s.max_blocks, s.block_size,
        s.num_q_heads, s.num_kv_heads, s.head_dim, static_cast<float>(scale)};
    switch (s.head_dim) {
      case 32: run_attention<scalar_t, 32>(args, plan, part); break;
      case 64: run_attention<scalar_t, 64>(args, plan, part); break;
      case 80: run_attention<scalar_t, 80>(args, plan, part); break;
      case 96: run_attention<scalar_t, 96>(args, plan, part); break;
      case 128: run_attention<scalar_t, 128>(args, plan, part); break;
      default: run_attention<scalar_t, 0>(args, plan, part);
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(orca, CPU, m) { m.impl("ragged_attention", &ragged_attention_cpu); }

}  // namespace orca

// ragged_attention on CPU: validates the metadata, plans work items (request x KV head x
// query block x KV split), runs them with dynamic load balancing across the intra-op
// threads, then merges split partials. Kernel math: csrc/include/orca/cpu/attention.h.
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <atomic>
#include <string>
#include <vector>

#include "attention_plan.h"

namespace orca {
namespace {

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

template <typename scalar_t, int kD, cpu::AttentionIsa kIsa, bool kInt8>
void run_attention(const cpu::AttentionArgs<scalar_t>& args, const Plan& plan,
                   const cpu::Partials& part) {
  run_dynamic(static_cast<int64_t>(plan.items.size()), plan.parallel, [&](int64_t i) {
    thread_local cpu::AttentionScratch scratch;
    cpu::attend<kD, kIsa, kInt8>(args, plan.items[i], scratch, part);
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
                                const at::Tensor& block_table_in, double scale,
                                int64_t window) {
  const AttentionShape s = check_attention_inputs(q_in, k_cache, v_cache, cu_q_lens_in,
                                                  context_lens_in, block_table_in, scale, window);
  const at::Tensor q = q_in.stride(2) == 1 ? q_in : q_in.contiguous();
  const at::Tensor cu_q_lens = cu_q_lens_in.contiguous(), context_lens = context_lens_in.contiguous(),
                   block_table = block_table_in.contiguous();
  const int32_t* cu = cu_q_lens.data_ptr<int32_t>();
  const int32_t* ctx = context_lens.data_ptr<int32_t>();
  check_metadata_values(s, cu, ctx, block_table.data_ptr<int32_t>());
  at::Tensor out = at::empty({s.num_tokens, s.num_q_heads, s.head_dim}, q.options());
  if (s.num_tokens == 0) return out;

  const cpu::AttentionIsa isa = chosen_attention_isa();
  const bool int8_cache = is_int8_kv_cache(k_cache);
  const bool wide =
      !int8_cache && q.scalar_type() == at::kBFloat16 && cpu::amx_head_dim(isa, s.head_dim);
  const Plan plan = make_plan(s, cu, ctx, wide, window);
  at::Tensor part_o = at::empty({plan.partial_rows, s.head_dim}, q.options().dtype(at::kFloat));
  at::Tensor part_ml = at::empty({2, plan.partial_rows}, q.options().dtype(at::kFloat));
  const cpu::Partials part{part_o.data_ptr<float>(), part_ml.data_ptr<float>(),
                           part_ml.data_ptr<float>() + plan.partial_rows};
  ORCA_DISPATCH_FLOAT_TYPES(q.scalar_type(), "ragged_attention", [&] {
    cpu::AttentionArgs<scalar_t> args{
        q.data_ptr<scalar_t>(), q.stride(0), q.stride(1),
        int8_cache ? nullptr : k_cache.data_ptr<scalar_t>(),
        int8_cache ? nullptr : v_cache.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(),
        cu, ctx, block_table.data_ptr<int32_t>(), s.max_blocks, s.block_size,
        s.num_q_heads, s.num_kv_heads, s.head_dim, static_cast<float>(scale), window};
    if (int8_cache) {
      args.k_int8 = k_cache.data_ptr<int8_t>();
      args.v_int8 = v_cache.data_ptr<int8_t>();
    }
    dispatch_attention_kernels<scalar_t>(
        isa, int8_cache, [&]<cpu::AttentionIsa kIsa, bool kInt8>() {
          dispatch_head_dim(s.head_dim, [&]<int kD>() {
            run_attention<scalar_t, kD, kIsa, kInt8>(args, plan, part);
          });
        });
  });
  return out;
}

}  // namespace

std::vector<std::string> attention_isa_names() {
  std::vector<std::string> names;
  for (const auto& [name, isa] : cpu::kAttentionIsaNames) {
    if (cpu::attention_isa_supported(isa)) names.emplace_back(name);
  }
  return names;
}

TORCH_LIBRARY_IMPL(orca, CPU, m) { m.impl("ragged_attention", &ragged_attention_cpu); }

}  // namespace orca

// ragged_attention on CPU: validates the metadata, plans work items (request x KV head x
// query block x KV split), runs them with dynamic load balancing across the intra-op
// threads, then merges split partials. Kernel math: csrc/include/orca/cpu/attention.h.
// plan_attention does the checks and the plan once per step (FlashInfer's plan / run): every
// layer's call given that plan only confirms it was made for the metadata it receives.
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <atomic>
#include <cstring>
#include <vector>

#include "attention_plan.h"

namespace orca {
namespace {

// A step plan (plan_attention's uint8 tensor): this header, then its items, then its merges.
struct StepPlanHeader {
  int64_t magic;
  // What it was made for; a call with anything else is refused.
  int64_t batch, num_tokens, num_q_heads, num_kv_heads, head_dim, num_blocks, block_size,
      max_blocks, window, dtype, int8_cache;
  uint64_t metadata_hash;
  // How to run it.
  int64_t isa, parallel, parallel_merges, partial_rows, num_items, num_merges;
};
constexpr int64_t kStepPlanMagic = 0x316e616c7061726f;  // a step plan's first word
static_assert(sizeof(StepPlanHeader) % alignof(AttentionWork) == 0 &&
              sizeof(AttentionWork) % alignof(Merge) == 0);

// What run_attention reads: a Plan's or a step plan's items and merges, in place.
struct PlanView {
  const AttentionWork* items;
  int64_t num_items;
  const Merge* merges;
  int64_t num_merges;
  int64_t partial_rows;
  bool parallel, parallel_merges;
  cpu::AttentionIsa isa;
};

// A few merges (decodes) run on the calling thread: cheaper than a second fork-join.
bool parallel_merges(const Plan& plan) {
  return plan.parallel && plan.merge_cost > kMinParallelMergeRows;
}

// A hash of the metadata a plan covers: cu_q_lens, context_lens and each request's used block
// ids (as many as its context needs, clamped to the table, so unchecked values read in bounds).
uint64_t metadata_hash(const AttentionShape& s, const int32_t* cu, const int32_t* ctx,
                       const int32_t* table) {
  uint64_t h = 0xcbf29ce484222325ull;
  const auto mix = [&h](int32_t v) { h = (h ^ static_cast<uint32_t>(v)) * 0x100000001b3ull; };
  for (int64_t r = 0; r <= s.batch; ++r) mix(cu[r]);
  for (int64_t r = 0; r < s.batch; ++r) {
    mix(ctx[r]);
    const int64_t used =
        std::clamp<int64_t>(ceil_div(std::max<int64_t>(ctx[r], 0), s.block_size), 0,
                            s.max_blocks);
    for (int64_t b = 0; b < used; ++b) mix(table[r * s.max_blocks + b]);
  }
  return h ^ (h >> 32);
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

template <typename scalar_t, int kD, cpu::AttentionIsa kIsa, bool kInt8>
void run_attention(const cpu::AttentionArgs<scalar_t>& args, const PlanView& plan,
                   const cpu::Partials& part) {
  run_dynamic(plan.num_items, plan.parallel, [&](int64_t i) {
    thread_local cpu::AttentionScratch scratch;
    cpu::attend<kD, kIsa, kInt8>(args, plan.items[i], scratch, part);
  });
  run_dynamic(plan.num_merges, plan.parallel_merges, [&](int64_t i) {
    cpu::merge_partials(args, plan.merges[i].first, plan.merges[i].num_splits, part);
  });
}

// The checked, contiguous metadata of a call.
struct Metadata {
  at::Tensor cu_q_lens, context_lens, block_table;
  const int32_t* cu() const { return cu_q_lens.data_ptr<int32_t>(); }
  const int32_t* ctx() const { return context_lens.data_ptr<int32_t>(); }
  const int32_t* table() const { return block_table.data_ptr<int32_t>(); }
};

Metadata contiguous_metadata(const at::Tensor& cu_q_lens, const at::Tensor& context_lens,
                             const at::Tensor& block_table) {
  return {cu_q_lens.contiguous(), context_lens.contiguous(), block_table.contiguous()};
}

bool wide_items(const at::Tensor& q, const at::Tensor& k_cache, cpu::AttentionIsa isa,
                int64_t head_dim) {
  return !is_int8_kv_cache(k_cache) && q.scalar_type() == at::kBFloat16 &&
         cpu::amx_head_dim(isa, head_dim);
}

// dst's fields set to src's, field by field: dst's padding bytes (zeroed) stay zero, so a plan's
// bytes depend on its contents alone.
void copy_fields(const AttentionWork& src, AttentionWork& dst) {
  dst.request = src.request;
  dst.kv_head_begin = src.kv_head_begin;
  dst.kv_head_end = src.kv_head_end;
  dst.q_begin = src.q_begin;
  dst.q_end = src.q_end;
  dst.kv_begin = src.kv_begin;
  dst.kv_end = src.kv_end;
  dst.partial_row = src.partial_row;
}

at::Tensor plan_attention_cpu(const at::Tensor& q, const at::Tensor& k_cache,
                              const at::Tensor& cu_q_lens_in, const at::Tensor& context_lens_in,
                              const at::Tensor& block_table_in, int64_t window) {
  const AttentionShape s = check_attention_inputs(q, k_cache, k_cache, cu_q_lens_in,
                                                  context_lens_in, block_table_in, 1.0, window);
  const Metadata m = contiguous_metadata(cu_q_lens_in, context_lens_in, block_table_in);
  check_metadata_values(s, m.cu(), m.ctx(), m.table());
  const cpu::AttentionIsa isa = attention_isa_choice().get();
  const Plan plan = make_plan(s, m.cu(), m.ctx(), wide_items(q, k_cache, isa, s.head_dim),
                              window);
  const StepPlanHeader header{kStepPlanMagic,
                              s.batch,
                              s.num_tokens,
                              s.num_q_heads,
                              s.num_kv_heads,
                              s.head_dim,
                              s.num_blocks,
                              s.block_size,
                              s.max_blocks,
                              window,
                              static_cast<int64_t>(q.scalar_type()),
                              is_int8_kv_cache(k_cache),
                              metadata_hash(s, m.cu(), m.ctx(), m.table()),
                              static_cast<int64_t>(isa),
                              plan.parallel,
                              parallel_merges(plan),
                              plan.partial_rows,
                              static_cast<int64_t>(plan.items.size()),
                              static_cast<int64_t>(plan.merges.size())};
  const size_t items_bytes = plan.items.size() * sizeof(AttentionWork);
  const size_t merges_bytes = plan.merges.size() * sizeof(Merge);
  at::Tensor out = at::zeros({static_cast<int64_t>(sizeof(header) + items_bytes + merges_bytes)},
                             cu_q_lens_in.options().dtype(at::kByte));
  auto* bytes = out.data_ptr<uint8_t>();
  std::memcpy(bytes, &header, sizeof(header));
  auto* items = reinterpret_cast<AttentionWork*>(bytes + sizeof(header));
  for (size_t i = 0; i < plan.items.size(); ++i) copy_fields(plan.items[i], items[i]);
  auto* merges = reinterpret_cast<Merge*>(bytes + sizeof(header) + items_bytes);
  for (size_t i = 0; i < plan.merges.size(); ++i) {
    copy_fields(plan.merges[i].first, merges[i].first);
    merges[i].num_splits = plan.merges[i].num_splits;
  }
  return out;
}

// The view of `plan` after checking it was made by plan_attention for this call's shapes,
// dtype, window and metadata values.
PlanView read_step_plan(const at::Tensor& plan, const AttentionShape& s, const at::Tensor& q,
                        const at::Tensor& k_cache, int64_t window, const Metadata& m) {
  TORCH_CHECK(plan.dim() == 1 && plan.scalar_type() == at::kByte && plan.is_cpu() &&
                  plan.is_contiguous() && plan.numel() >= static_cast<int64_t>(
                                                             sizeof(StepPlanHeader)),
              "plan must be a step plan from plan_attention (a contiguous 1-D uint8 CPU "
              "tensor), got ", plan.scalar_type(), " of shape ", shape_str(plan), " on ",
              plan.device());
  StepPlanHeader h;
  std::memcpy(&h, plan.data_ptr<uint8_t>(), sizeof(h));
  TORCH_CHECK(h.magic == kStepPlanMagic &&
                  plan.numel() == static_cast<int64_t>(sizeof(h) + h.num_items *
                                                       sizeof(AttentionWork) +
                                                       h.num_merges * sizeof(Merge)),
              "plan is not a step plan from plan_attention");
  const std::pair<const char*, std::pair<int64_t, int64_t>> same[] = {
      {"batch size", {h.batch, s.batch}},
      {"number of query tokens", {h.num_tokens, s.num_tokens}},
      {"number of query heads", {h.num_q_heads, s.num_q_heads}},
      {"number of KV heads", {h.num_kv_heads, s.num_kv_heads}},
      {"head_dim", {h.head_dim, s.head_dim}},
      {"number of cache blocks", {h.num_blocks, s.num_blocks}},
      {"block_size", {h.block_size, s.block_size}},
      {"block_table width", {h.max_blocks, s.max_blocks}},
      {"window", {h.window, window}},
      {"q dtype (as a ScalarType number)", {h.dtype, static_cast<int64_t>(q.scalar_type())}},
      {"int8 cache (0 / 1)", {h.int8_cache, is_int8_kv_cache(k_cache)}}};
  for (const auto& [what, values] : same) {
    TORCH_CHECK(values.first == values.second, "plan was made for a ", what, " of ",
                values.first, " but this call has ", values.second);
  }
  TORCH_CHECK(h.metadata_hash == metadata_hash(s, m.cu(), m.ctx(), m.table()),
              "plan was made for other cu_q_lens / context_lens / block_table values than "
              "this call's: plan each step's metadata once, with plan_attention");
  const uint8_t* bytes = plan.data_ptr<uint8_t>() + sizeof(h);
  return {reinterpret_cast<const AttentionWork*>(bytes),
          h.num_items,
          reinterpret_cast<const Merge*>(bytes + h.num_items * sizeof(AttentionWork)),
          h.num_merges,
          h.partial_rows,
          h.parallel != 0,
          h.parallel_merges != 0,
          static_cast<cpu::AttentionIsa>(h.isa)};
}

at::Tensor ragged_attention_cpu(const at::Tensor& q_in, const at::Tensor& k_cache,
                                const at::Tensor& v_cache, const at::Tensor& cu_q_lens_in,
                                const at::Tensor& context_lens_in,
                                const at::Tensor& block_table_in, double scale,
                                int64_t window, const std::optional<at::Tensor>& step_plan) {
  const AttentionShape s = check_attention_inputs(q_in, k_cache, v_cache, cu_q_lens_in,
                                                  context_lens_in, block_table_in, scale, window);
  const at::Tensor q = q_in.stride(2) == 1 ? q_in : q_in.contiguous();
  const Metadata m = contiguous_metadata(cu_q_lens_in, context_lens_in, block_table_in);
  Plan own_plan;
  PlanView plan;
  if (step_plan.has_value()) {
    plan = read_step_plan(*step_plan, s, q, k_cache, window, m);
  } else {
    check_metadata_values(s, m.cu(), m.ctx(), m.table());
    const cpu::AttentionIsa isa = attention_isa_choice().get();
    own_plan = make_plan(s, m.cu(), m.ctx(), wide_items(q, k_cache, isa, s.head_dim), window);
    plan = {own_plan.items.data(),
            static_cast<int64_t>(own_plan.items.size()),
            own_plan.merges.data(),
            static_cast<int64_t>(own_plan.merges.size()),
            own_plan.partial_rows,
            own_plan.parallel,
            parallel_merges(own_plan),
            isa};
  }
  at::Tensor out = at::empty({s.num_tokens, s.num_q_heads, s.head_dim}, q.options());
  if (s.num_tokens == 0) return out;

  const bool int8_cache = is_int8_kv_cache(k_cache);
  at::Tensor part_o = at::empty({plan.partial_rows, s.head_dim}, q.options().dtype(at::kFloat));
  at::Tensor part_ml = at::empty({2, plan.partial_rows}, q.options().dtype(at::kFloat));
  const cpu::Partials part{part_o.data_ptr<float>(), part_ml.data_ptr<float>(),
                           part_ml.data_ptr<float>() + plan.partial_rows};
  ORCA_DISPATCH_FLOAT_TYPES(q.scalar_type(), "ragged_attention", [&] {
    cpu::AttentionArgs<scalar_t> args{
        q.data_ptr<scalar_t>(), q.stride(0), q.stride(1),
        int8_cache ? nullptr : k_cache.data_ptr<scalar_t>(),
        int8_cache ? nullptr : v_cache.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(),
        m.cu(), m.ctx(), m.table(), s.max_blocks, s.block_size,
        s.num_q_heads, s.num_kv_heads, s.head_dim, static_cast<float>(scale), window};
    if (int8_cache) {
      args.k_int8 = k_cache.data_ptr<int8_t>();
      args.v_int8 = v_cache.data_ptr<int8_t>();
    }
    dispatch_attention_kernels<scalar_t>(
        plan.isa, int8_cache, [&]<cpu::AttentionIsa kIsa, bool kInt8>() {
          dispatch_head_dim(s.head_dim, [&]<int kD>() {
            run_attention<scalar_t, kD, kIsa, kInt8>(args, plan, part);
          });
        });
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(orca, CPU, m) {
  m.impl("plan_attention", &plan_attention_cpu);
  m.impl("ragged_attention", &ragged_attention_cpu);
}

}  // namespace orca

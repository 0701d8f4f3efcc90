// CPU kernels through the dispatcher (torch.ops.orca.* from C++): packed_linear with a fused
// activation, and ragged_attention on 32 decode requests plus one 256-token prefill.
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <benchmark/benchmark.h>

static void BM_PackedLinearGelu(benchmark::State& state) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("orca::packed_linear", "")
                       .typed<at::Tensor(const at::Tensor&, const at::Tensor&,
                                         const std::optional<at::Tensor>&, c10::string_view)>();
  const auto x = at::randn({state.range(0), 768});
  const auto w = at::randn({3072, 768});
  const std::optional<at::Tensor> b = at::randn({3072});
  for (auto _ : state) benchmark::DoNotOptimize(op.call(x, w, b, "gelu_tanh"));
  state.SetLabel("T=" + std::to_string(state.range(0)) + " 768->3072 gelu_tanh");
}
BENCHMARK(BM_PackedLinearGelu)->Arg(32)->Arg(512)->Unit(benchmark::kMillisecond);

static void BM_RaggedAttention(benchmark::State& state) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("orca::ragged_attention", "")
                       .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                         const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                         double)>();
  const int64_t decodes = 32, prefill = 256, context = 384, bs = 16, H = 12, D = 64;
  const int64_t blocks_per_decode = context / bs, prefill_blocks = prefill / bs;
  const int64_t num_blocks = decodes * blocks_per_decode + prefill_blocks;
  const auto k_cache = at::randn({num_blocks, bs, H, D});
  const auto v_cache = at::randn({num_blocks, bs, H, D});
  const auto q = at::randn({decodes + prefill, H, D});
  std::vector<int32_t> cu{0, static_cast<int32_t>(prefill)}, ctx{static_cast<int32_t>(prefill)};
  const int64_t max_blocks = std::max(blocks_per_decode, prefill_blocks);
  auto table = at::zeros({decodes + 1, max_blocks}, at::kInt);
  auto t = table.accessor<int32_t, 2>();
  for (int64_t b = 0; b < prefill_blocks; ++b) t[0][b] = static_cast<int32_t>(b);
  for (int64_t r = 0; r < decodes; ++r) {
    cu.push_back(cu.back() + 1);
    ctx.push_back(static_cast<int32_t>(context));
    for (int64_t b = 0; b < blocks_per_decode; ++b) {
      t[r + 1][b] = static_cast<int32_t>(prefill_blocks + r * blocks_per_decode + b);
    }
  }
  const auto cu_t = at::tensor(cu, at::kInt), ctx_t = at::tensor(ctx, at::kInt);
  for (auto _ : state) {
    benchmark::DoNotOptimize(op.call(q, k_cache, v_cache, cu_t, ctx_t, table, 0.125));
  }
  state.SetLabel("32 decodes (context 384) + 1 prefill of 256, 12x64 heads");
}
BENCHMARK(BM_RaggedAttention)->Unit(benchmark::kMillisecond);

BENCHMARK_MAIN();

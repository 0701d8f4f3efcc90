// CPU kernels through the dispatcher (torch.ops.orca.* from C++): packed_linear with a fused
// activation, the skinny (decode) packed_linear streaming a model's weights against a plain
// read of the same bytes, ragged_attention on 32 decode requests plus one 256-token prefill, and
// decode attention over cold KV caches against a read of the same caches.
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <benchmark/benchmark.h>
#include <sys/mman.h>

#include <algorithm>
#include <cstdlib>
#include <string>
#include <vector>

using PackedLinear = at::Tensor(const at::Tensor&, const at::Tensor&,
                                const std::optional<at::Tensor>&, c10::string_view,
                                const std::optional<at::Tensor>&, c10::string_view,
                                const std::optional<at::Tensor>&,
                                const std::optional<at::Tensor>&, double);

static void BM_PackedLinearGelu(benchmark::State& state) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("orca::packed_linear", "")
                       .typed<PackedLinear>();
  const auto x = at::randn({state.range(0), 768});
  const auto w = at::randn({3072, 768});
  const std::optional<at::Tensor> b = at::randn({3072});
  for (auto _ : state) {
    benchmark::DoNotOptimize(
        op.call(x, w, b, "gelu_tanh", std::nullopt, "none", std::nullopt, std::nullopt, 0.0));
  }
  state.SetLabel("T=" + std::to_string(state.range(0)) + " 768->3072 gelu_tanh");
}
BENCHMARK(BM_PackedLinearGelu)->Arg(32)->Arg(512)->Unit(benchmark::kMillisecond);

// An uninitialized CPU tensor in 2 MB-aligned memory advised for huge pages, as the engine
// allocates weights and KV caches (orca_ext/model/arena.py).
at::Tensor huge_page_tensor(at::IntArrayRef sizes, at::ScalarType dtype) {
  const size_t huge = 2 << 20;
  const size_t bytes = (c10::multiply_integers(sizes) * at::elementSize(dtype) + huge - 1) /
                       huge * huge;
  void* memory = std::aligned_alloc(huge, bytes);
  madvise(memory, bytes, MADV_HUGEPAGE);
  return at::from_blob(memory, sizes, [](void* p) { std::free(p); }, dtype);
}

// orca-tiny's 8 layers of weights (qkv, out, fc, proj: ~101 MB in float32, far beyond the
// caches) in one huge-page buffer, in forward order, as orca_ext/model/arena.py lays them out.
struct ModelWeights {
  at::Tensor buffer;
  std::vector<at::Tensor> matrices;

  explicit ModelWeights(at::ScalarType dtype) {
    const int64_t shapes[4][2] = {{1536, 512}, {512, 512}, {2048, 512}, {512, 2048}};
    int64_t total = 0;
    for (const auto& s : shapes) total += 8 * s[0] * s[1];
    buffer = huge_page_tensor({total}, dtype);
    buffer.normal_(0, 0.02);
    int64_t offset = 0;
    for (int layer = 0; layer < 8; ++layer) {
      for (const auto& s : shapes) {
        matrices.push_back(buffer.narrow(0, offset, s[0] * s[1]).view({s[0], s[1]}));
        offset += s[0] * s[1];
      }
    }
  }
  // Arg 0: float32, 1: bfloat16.
  static ModelWeights& get(int64_t dtype_arg) {
    static ModelWeights f32(at::kFloat), bf16(at::kBFloat16);
    return dtype_arg ? bf16 : f32;
  }
};

std::string dtype_name(int64_t dtype_arg) { return dtype_arg ? "bfloat16" : "float32"; }

// A decode step's linears at T tokens; bytes/s is the weights' bytes over the time.
static void BM_SkinnyLinearModel(benchmark::State& state) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("orca::packed_linear", "")
                       .typed<PackedLinear>();
  const auto& w = ModelWeights::get(state.range(1));
  const int64_t T = state.range(0);
  const auto opts = at::TensorOptions().dtype(w.buffer.scalar_type());
  const auto x512 = at::randn({T, 512}, opts), x2048 = at::randn({T, 2048}, opts);
  for (auto _ : state) {
    for (const auto& m : w.matrices) {
      benchmark::DoNotOptimize(
          op.call(m.size(1) == 512 ? x512 : x2048, m, std::nullopt, "none", std::nullopt, "none",
                  std::nullopt, std::nullopt, 0.0));
    }
  }
  state.SetBytesProcessed(state.iterations() * w.buffer.nbytes());
  state.SetLabel("T=" + std::to_string(T) + ", orca-tiny's 32 linears, " +
                 dtype_name(state.range(1)));
}
BENCHMARK(BM_SkinnyLinearModel)->ArgsProduct({{1, 2, 4, 8}, {0, 1}})->UseRealTime()
    ->Unit(benchmark::kMillisecond);

// The baseline: a sum over the same bytes (a read-only pass at the machine's streaming rate).
static void BM_ReadModelWeights(benchmark::State& state) {
  const auto& w = ModelWeights::get(state.range(0));
  for (auto _ : state) benchmark::DoNotOptimize(w.buffer.sum());
  state.SetBytesProcessed(state.iterations() * w.buffer.nbytes());
  state.SetLabel("at::sum over the same weights, " + dtype_name(state.range(0)));
}
BENCHMARK(BM_ReadModelWeights)->Arg(0)->Arg(1)->UseRealTime()->Unit(benchmark::kMillisecond);

using RaggedAttention = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                   const at::Tensor&, const at::Tensor&, const at::Tensor&, double,
                                   int64_t, const std::optional<at::Tensor>&);

c10::TypedOperatorHandle<RaggedAttention> ragged_attention_op() {
  return c10::Dispatcher::singleton()
      .findSchemaOrThrow("orca::ragged_attention", "")
      .typed<RaggedAttention>();
}

static void BM_RaggedAttention(benchmark::State& state) {
  static auto op = ragged_attention_op();
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
    benchmark::DoNotOptimize(
        op.call(q, k_cache, v_cache, cu_t, ctx_t, table, 0.125, 0, std::nullopt));
  }
  state.SetLabel("32 decodes (context 384) + 1 prefill of 256, 12x64 heads");
}
BENCHMARK(BM_RaggedAttention)->Unit(benchmark::kMillisecond);

// Decode attention over cold caches: `batch` requests of `context` positions with orca-tiny's
// heads (8 x 64, float32, block 16, blocks shuffled as an allocator hands them out over time),
// through enough layers' caches (~200 MB, in huge pages) that every call reads from memory.
// BM_ReadColdKv is the baseline: a sum over the same caches.
struct ColdKv {
  std::vector<at::Tensor> k, v;  // per layer [blocks, 16, 8, 64]
  at::Tensor q, cu_q_lens, context_lens, block_table;
  int64_t bytes_per_layer = 0;

  ColdKv(int64_t batch, int64_t context) {
    constexpr int64_t kBlock = 16, kHeads = 8, kDim = 64;
    const int64_t per_request = (context + kBlock - 1) / kBlock, blocks = batch * per_request;
    const int64_t layer_bytes = 2 * blocks * kBlock * kHeads * kDim * 4;
    const int64_t layers = std::max<int64_t>(2, (200 << 20) / layer_bytes);
    const auto all = huge_page_tensor({layers, 2, blocks, kBlock, kHeads, kDim}, at::kFloat);
    all.normal_();
    for (int64_t l = 0; l < layers; ++l) {
      k.push_back(all[l][0]);
      v.push_back(all[l][1]);
    }
    q = at::randn({batch, kHeads, kDim});
    cu_q_lens = at::arange(batch + 1, at::kInt);
    context_lens = at::full({batch}, context, at::kInt);
    block_table = at::randperm(blocks, at::kInt).view({batch, per_request});
    bytes_per_layer = 2 * batch * context * kHeads * kDim * 4;
  }
  static ColdKv& get(int64_t batch) {
    static ColdKv small(4, 129), large(32, 300);
    return batch == 4 ? small : large;
  }
};

static void BM_DecodeAttentionCold(benchmark::State& state) {
  static auto op = ragged_attention_op();
  auto& kv = ColdKv::get(state.range(0));
  size_t layer = 0;
  for (auto _ : state) {
    benchmark::DoNotOptimize(op.call(kv.q, kv.k[layer], kv.v[layer], kv.cu_q_lens,
                                     kv.context_lens, kv.block_table, 0.125, 0, std::nullopt));
    layer = (layer + 1) % kv.k.size();
  }
  state.SetBytesProcessed(state.iterations() * kv.bytes_per_layer);
  state.SetLabel(std::to_string(state.range(0)) + " decodes, context " +
                 std::to_string(kv.context_lens[0].item<int>()) + ", float32, cold KV");
}
BENCHMARK(BM_DecodeAttentionCold)->Arg(4)->Arg(32)->UseRealTime()->Unit(benchmark::kMicrosecond);

static void BM_ReadColdKv(benchmark::State& state) {
  auto& kv = ColdKv::get(state.range(0));
  size_t layer = 0;
  for (auto _ : state) {
    benchmark::DoNotOptimize(kv.k[layer].sum());
    benchmark::DoNotOptimize(kv.v[layer].sum());
    layer = (layer + 1) % kv.k.size();
  }
  state.SetBytesProcessed(state.iterations() * 2 * kv.k[0].nbytes());
  state.SetLabel("at::sum over the same caches");
}
BENCHMARK(BM_ReadColdKv)->Arg(4)->Arg(32)->UseRealTime()->Unit(benchmark::kMicrosecond);

BENCHMARK_MAIN();

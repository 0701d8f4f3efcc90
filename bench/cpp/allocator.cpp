// SlotAllocator microbenchmarks: one request's allocate+free, with and without a cached
// prefix, hashing a prompt's blocks, and building an iteration's metadata (block_table +
// slot_mapping + positions) for 256 running requests.
#include <benchmark/benchmark.h>

#include <vector>

#include "kv/metadata.h"
#include "kv/slot_allocator.h"

using orca::kv::SlotAllocator;

static void BM_AllocateFree(benchmark::State& state) {
  const int64_t tokens = state.range(0);
  SlotAllocator alloc(65536, 16);
  alloc.allocate(-1, 1000 * 16);  // a partly used pool
  int64_t id = 0;
  for (auto _ : state) {
    alloc.allocate(id, tokens);
    alloc.free(id);
    ++id;
  }
  state.SetLabel(std::to_string(tokens) + " tokens");
}
BENCHMARK(BM_AllocateFree)->Arg(16)->Arg(640)->Arg(2048);

// A 2048-token request whose first range(0) tokens are a cached prefix (a shared system
// prompt): the lookup, taking the shared blocks out of the LRU and putting them back.
static void BM_AllocatePrefixFree(benchmark::State& state) {
  const int64_t prefix = state.range(0), tokens = 2048;
  SlotAllocator alloc(65536, 16);
  alloc.allocate(-1, 1000 * 16);  // a partly used pool
  std::vector<int64_t> prompt(prefix);
  for (int64_t i = 0; i < prefix; ++i) prompt[i] = (i * 7919) % 50000;
  const auto hashes = alloc.block_hashes(prompt);
  alloc.allocate(-2, tokens);
  alloc.cache_blocks(-2, hashes);
  alloc.free(-2);
  int64_t id = 0;
  for (auto _ : state) {
    benchmark::DoNotOptimize(alloc.allocate(id, tokens, hashes));
    alloc.free(id);
    ++id;
  }
  state.SetLabel(std::to_string(tokens) + " tokens, " + std::to_string(prefix) + " cached");
}
BENCHMARK(BM_AllocatePrefixFree)->Arg(640)->Arg(2032);

// Chained hashes of a prompt's full blocks, as the scheduler would compute them at arrival.
static void BM_BlockHashes(benchmark::State& state) {
  SlotAllocator alloc(16, 16);
  std::vector<int64_t> prompt(state.range(0));
  for (int64_t i = 0; i < state.range(0); ++i) prompt[i] = (i * 7919) % 50000;
  for (auto _ : state) benchmark::DoNotOptimize(alloc.block_hashes(prompt, 1));
  state.SetItemsProcessed(state.iterations() * state.range(0));
  state.SetLabel(std::to_string(state.range(0)) + " tokens");
}
BENCHMARK(BM_BlockHashes)->Arg(2048);

static void BM_BuildMetadata(benchmark::State& state) {
  const int64_t batch = state.range(0), context = 512, block_size = 16;
  SlotAllocator alloc(batch * context / block_size + 16, block_size);
  std::vector<std::vector<int32_t>> block_ids(batch);
  std::vector<int64_t> computed(batch, context - 1), fresh(batch, 1);
  for (int64_t r = 0; r < batch; ++r) {
    alloc.allocate(r, context);
    block_ids[r] = alloc.blocks(r);
  }
  const auto shape = orca::kv::metadata_shape(block_ids, computed.data(), fresh.data(),
                                              block_size);
  std::vector<int32_t> cu(batch + 1), ctx(batch), table(batch * shape.max_blocks);
  std::vector<int64_t> slots(shape.num_tokens), positions(shape.num_tokens);
  for (auto _ : state) {
    const auto s = orca::kv::metadata_shape(block_ids, computed.data(), fresh.data(), block_size);
    orca::kv::fill_metadata(block_ids, computed.data(), fresh.data(), block_size, s, cu.data(),
                            ctx.data(), table.data(), slots.data(), positions.data());
    benchmark::DoNotOptimize(slots.data());
  }
  state.SetLabel(std::to_string(batch) + " decode requests, context 512");
}
BENCHMARK(BM_BuildMetadata)->Arg(256);

BENCHMARK_MAIN();

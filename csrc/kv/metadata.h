// Torch-free: one iteration's attention metadata from each request's block ids (the runner's
// copy of its block table), its tokens already in the cache and its tokens this iteration.
#pragma once

#include <algorithm>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

namespace orca::kv {

// Shapes of one iteration's metadata; the caller allocates buffers of these sizes.
struct MetadataShape {
  int64_t batch = 0;
  int64_t num_tokens = 0;
  int64_t max_blocks = 1;
};

// Validates the rows and returns the buffer sizes fill_metadata needs.
inline MetadataShape metadata_shape(const std::vector<std::vector<int32_t>>& block_ids,
                                    const int64_t* num_computed, const int64_t* num_new,
                                    int64_t block_size) {
  if (block_size < 1) {
    throw std::invalid_argument("block_size must be >= 1, got " + std::to_string(block_size));
  }
  MetadataShape shape;
  shape.batch = static_cast<int64_t>(block_ids.size());
  for (int64_t r = 0; r < shape.batch; ++r) {
    const std::string row = "row " + std::to_string(r);
    if (num_computed[r] < 0 || num_new[r] < 0) {
      throw std::invalid_argument(row + ": num_computed (" + std::to_string(num_computed[r]) +
                                  ") and num_new (" + std::to_string(num_new[r]) +
                                  ") must be >= 0");
    }
    const int64_t context = num_computed[r] + num_new[r];
    const int64_t needed = (context + block_size - 1) / block_size;
    const auto held = static_cast<int64_t>(block_ids[r].size());
    if (needed > held) {
      throw std::invalid_argument(row + " needs " + std::to_string(context) + " KV slots but " +
                                  "its block ids hold " + std::to_string(held * block_size));
    }
    for (int64_t i = 0; i < needed; ++i) {
      if (block_ids[r][i] < 0) {
        throw std::invalid_argument(row + ": block id " + std::to_string(block_ids[r][i]) +
                                    " is negative");
      }
    }
    shape.num_tokens += num_new[r];
    shape.max_blocks = std::max(shape.max_blocks, needed);
  }
  return shape;
}

// Writes cu_q_lens[B+1], context_lens[B], block_table[B, max_blocks] (unused entries 0),
// slot_mapping[T] and positions[T] for rows already checked by metadata_shape.
inline void fill_metadata(const std::vector<std::vector<int32_t>>& block_ids,
                          const int64_t* num_computed, const int64_t* num_new,
                          int64_t block_size, const MetadataShape& shape, int32_t* cu_q_lens,
                          int32_t* context_lens, int32_t* block_table, int64_t* slot_mapping,
                          int64_t* positions) {
  std::fill(block_table, block_table + shape.batch * shape.max_blocks, 0);
  int64_t t = 0;
  cu_q_lens[0] = 0;
  for (int64_t r = 0; r < shape.batch; ++r) {
    const auto& blocks = block_ids[r];
    const int64_t context = num_computed[r] + num_new[r];
    const int64_t used = (context + block_size - 1) / block_size;
    std::copy(blocks.begin(), blocks.begin() + used, block_table + r * shape.max_blocks);
    for (int64_t pos = num_computed[r]; pos < context; ++pos, ++t) {
      slot_mapping[t] = static_cast<int64_t>(blocks[pos / block_size]) * block_size +
                        pos % block_size;
      positions[t] = pos;
    }
    cu_q_lens[r + 1] = static_cast<int32_t>(t);
    context_lens[r] = static_cast<int32_t>(context);
  }
}

}  // namespace orca::kv

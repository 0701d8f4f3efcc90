#include "kv/slot_allocator.h"

#include <algorithm>

namespace orca::kv {

namespace {
std::string id_str(int64_t request_id) { return "request " + std::to_string(request_id); }
}  // namespace

SlotAllocator::SlotAllocator(int64_t num_blocks, int64_t block_size)
    : num_blocks_(num_blocks), block_size_(block_size) {
  if (num_blocks < 1 || num_blocks > INT32_MAX) {
    throw std::invalid_argument("num_blocks must be in [1, 2^31), got " +
                                std::to_string(num_blocks));
  }
  if (block_size < 1) {
    throw std::invalid_argument("block_size must be >= 1, got " + std::to_string(block_size));
  }
  // Pop from the back: low block ids are handed out first.
  free_list_.resize(num_blocks);
  for (int64_t i = 0; i < num_blocks; ++i) free_list_[i] = static_cast<int32_t>(num_blocks - 1 - i);
}

int64_t SlotAllocator::blocks_needed(int64_t num_tokens) const {
  return (num_tokens + block_size_ - 1) / block_size_;
}

bool SlotAllocator::can_allocate(int64_t num_tokens) const {
  return num_tokens >= 0 && blocks_needed(num_tokens) <= num_free_blocks();
}

void SlotAllocator::take_blocks(std::vector<int32_t>& into, int64_t count, int64_t request_id) {
  if (count > num_free_blocks()) {
    throw KVCacheFullError("KV cache full: " + id_str(request_id) + " needs " +
                           std::to_string(count) + " more blocks of " +
                           std::to_string(block_size_) + " slots, " +
                           std::to_string(num_free_blocks()) + " of " +
                           std::to_string(num_blocks_) + " are free");
  }
  into.insert(into.end(), free_list_.rbegin(), free_list_.rbegin() + count);
  free_list_.resize(free_list_.size() - count);
}

void SlotAllocator::allocate(int64_t request_id, int64_t num_tokens) {
  if (num_tokens < 0) {
    throw std::invalid_argument("num_tokens must be >= 0, got " + std::to_string(num_tokens));
  }
  if (contains(request_id)) {
    throw std::invalid_argument(id_str(request_id) + " already holds KV blocks; free it first");
  }
  std::vector<int32_t> blocks;
  take_blocks(blocks, blocks_needed(num_tokens), request_id);
  blocks_.emplace(request_id, std::move(blocks));
}

void SlotAllocator::extend(int64_t request_id, int64_t total_tokens) {
  auto& blocks = owned(request_id);
  const int64_t more = blocks_needed(total_tokens) - static_cast<int64_t>(blocks.size());
  if (more > 0) take_blocks(blocks, more, request_id);
}

void SlotAllocator::free(int64_t request_id) {
  auto it = blocks_.find(request_id);
  if (it == blocks_.end()) throw UnknownRequestError(id_str(request_id) + " holds no KV blocks");
  free_list_.insert(free_list_.end(), it->second.rbegin(), it->second.rend());
  blocks_.erase(it);
}

std::vector<int32_t>& SlotAllocator::owned(int64_t request_id) {
  auto it = blocks_.find(request_id);
  if (it == blocks_.end()) throw UnknownRequestError(id_str(request_id) + " holds no KV blocks");
  return it->second;
}

const std::vector<int32_t>& SlotAllocator::blocks(int64_t request_id) const {
  return const_cast<SlotAllocator*>(this)->owned(request_id);
}

int64_t SlotAllocator::capacity(int64_t request_id) const {
  return static_cast<int64_t>(blocks(request_id).size()) * block_size_;
}

MetadataShape SlotAllocator::metadata_shape(const int64_t* request_ids,
                                            const int64_t* num_computed, const int64_t* num_new,
                                            int64_t batch) const {
  MetadataShape shape;
  shape.batch = batch;
  for (int64_t r = 0; r < batch; ++r) {
    if (num_computed[r] < 0 || num_new[r] < 0) {
      throw std::invalid_argument(id_str(request_ids[r]) + ": num_computed (" +
                                  std::to_string(num_computed[r]) + ") and num_new (" +
                                  std::to_string(num_new[r]) + ") must be >= 0");
    }
    const int64_t context = num_computed[r] + num_new[r];
    const int64_t cap = capacity(request_ids[r]);
    if (context > cap) {
      throw std::invalid_argument(id_str(request_ids[r]) + " needs " + std::to_string(context) +
                                  " KV slots but holds " + std::to_string(cap) +
                                  "; extend it first");
    }
    shape.num_tokens += num_new[r];
    shape.max_blocks = std::max(shape.max_blocks, blocks_needed(context));
  }
  return shape;
}

void SlotAllocator::fill_metadata(const int64_t* request_ids, const int64_t* num_computed,
                                  const int64_t* num_new, const MetadataShape& shape,
                                  int32_t* cu_q_lens, int32_t* context_lens, int32_t* block_table,
                                  int64_t* slot_mapping, int64_t* positions) const {
  std::fill(block_table, block_table + shape.batch * shape.max_blocks, 0);
  int64_t t = 0;
  cu_q_lens[0] = 0;
  for (int64_t r = 0; r < shape.batch; ++r) {
    const auto& blocks = this->blocks(request_ids[r]);
    const int64_t context = num_computed[r] + num_new[r];
    const int64_t used = blocks_needed(context);
    std::copy(blocks.begin(), blocks.begin() + used, block_table + r * shape.max_blocks);
    for (int64_t pos = num_computed[r]; pos < context; ++pos, ++t) {
      slot_mapping[t] = static_cast<int64_t>(blocks[pos / block_size_]) * block_size_ +
                        pos % block_size_;
      positions[t] = pos;
    }
    cu_q_lens[r + 1] = static_cast<int32_t>(t);
    context_lens[r] = static_cast<int32_t>(context);
  }
}

}  // namespace orca::kv

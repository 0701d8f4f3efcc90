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

}  // namespace orca::kv

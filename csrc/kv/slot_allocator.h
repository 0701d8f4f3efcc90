// Torch-free KV slot allocator: a fixed pool of num_blocks blocks of block_size slots.
// Blocks come from a free list (O(1) per block); each live request owns an ordered list of
// blocks. Orca's per-request reservation is one allocate() of prompt + max_new_tokens at
// admission; on-demand (paged) policies grow requests with extend().
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <vector>

namespace orca::kv {

// The pool has too few free blocks for the request.
struct KVCacheFullError : std::runtime_error {
  using std::runtime_error::runtime_error;
};
// The request id is not live in this allocator.
struct UnknownRequestError : std::out_of_range {
  using std::out_of_range::out_of_range;
};

class SlotAllocator {
 public:
  SlotAllocator(int64_t num_blocks, int64_t block_size);

  void allocate(int64_t request_id, int64_t num_tokens);
  void extend(int64_t request_id, int64_t total_tokens);
  void free(int64_t request_id);

  bool can_allocate(int64_t num_tokens) const;
  int64_t blocks_needed(int64_t num_tokens) const;
  bool contains(int64_t request_id) const { return blocks_.count(request_id) != 0; }
  int64_t capacity(int64_t request_id) const;
  const std::vector<int32_t>& blocks(int64_t request_id) const;

  int64_t num_blocks() const { return num_blocks_; }
  int64_t block_size() const { return block_size_; }
  int64_t num_free_blocks() const { return static_cast<int64_t>(free_list_.size()); }
  int64_t num_used_blocks() const { return num_blocks_ - num_free_blocks(); }
  int64_t num_requests() const { return static_cast<int64_t>(blocks_.size()); }

 private:
  std::vector<int32_t>& owned(int64_t request_id);
  void take_blocks(std::vector<int32_t>& into, int64_t count, int64_t request_id);

  int64_t num_blocks_;
  int64_t block_size_;
  std::vector<int32_t> free_list_;
  std::unordered_map<int64_t, std::vector<int32_t>> blocks_;
};

}  // namespace orca::kv

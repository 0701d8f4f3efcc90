// Torch-free KV slot allocator: a fixed pool of num_blocks blocks of block_size slots.
// Blocks come from a free list (O(1) per block); each live request owns an ordered list of
// blocks. Orca's per-request reservation is one allocate() of prompt + max_new_tokens at
// admission; on-demand (paged) policies grow requests with extend().
//
// Prefix caching: a full block whose KV is computed can be registered under a 64-bit hash
// chained over its parent block's hash, its token ids and an extra key (block_hashes,
// cache_blocks). Later requests whose prompt starts with the same blocks share them (reference
// counted) instead of recomputing them. A hashed block that no request holds is evictable: it
// stays findable in an LRU list until its space is needed. Every block is in exactly one of
// {free, evictable, held}; free and evictable blocks both count as free (num_free_blocks).
#pragma once

#include <cstdint>
#include <optional>
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

  // Gives a new request blocks for num_tokens slots: the cached blocks of the longest found
  // prefix of prefix_hashes first, new blocks for the rest; returns the cached tokens reused.
  int64_t allocate(int64_t request_id, int64_t num_tokens,
                   const std::vector<uint64_t>& prefix_hashes = {});
  void extend(int64_t request_id, int64_t total_tokens);
  // Drops the request's references; unheld hashed blocks become evictable (the request's last
  // block first in line), unheld unhashed blocks go back to the free list.
  void free(int64_t request_id);

  // Whether allocate(num_tokens, prefix_hashes) would succeed now.
  bool can_allocate(int64_t num_tokens, const std::vector<uint64_t>& prefix_hashes = {}) const;
  // How much num_free_blocks would drop on allocate(num_tokens, prefix_hashes): its new blocks
  // plus the evictable cached blocks it would take back.
  int64_t num_blocks_to_allocate(int64_t num_tokens,
                                 const std::vector<uint64_t>& prefix_hashes = {}) const;
  int64_t blocks_needed(int64_t num_tokens) const;
  bool contains(int64_t request_id) const { return blocks_.count(request_id) != 0; }
  int64_t capacity(int64_t request_id) const;
  const std::vector<int32_t>& blocks(int64_t request_id) const;

  int64_t num_blocks() const { return num_blocks_; }
  int64_t block_size() const { return block_size_; }
  // Blocks a new allocation can take: plain free plus evictable cached blocks.
  int64_t num_free_blocks() const {
    return static_cast<int64_t>(free_list_.size()) + num_evictable_;
  }
  // Blocks held by live requests.
  int64_t num_used_blocks() const { return num_blocks_ - num_free_blocks(); }
  int64_t num_requests() const { return static_cast<int64_t>(blocks_.size()); }

  // Chained hashes of the full blocks of token_ids (a partial last block gets none); the first
  // block chains on parent (a root constant when absent), every block mixes in extra_key.
  std::vector<uint64_t> block_hashes(const std::vector<int64_t>& token_ids, int64_t extra_key = 0,
                                     std::optional<uint64_t> parent = std::nullopt) const;
  // Length of the longest prefix of hashes whose blocks are cached; changes nothing.
  int64_t num_cached_prefix_blocks(const std::vector<uint64_t>& hashes) const;
  // Registers hashes[i] for the request's block i (its KV computed and final); a hash already
  // cached on another block keeps that block, and the request's copy stays unhashed. Returns
  // the number of blocks newly registered.
  int64_t cache_blocks(int64_t request_id, const std::vector<uint64_t>& hashes);
  // Leading hashed blocks of the request's list: full, KV final, maybe shared; never written.
  int64_t shared_prefix_blocks(int64_t request_id) const;
  // Makes every evictable block plain free (its hash forgotten); returns how many.
  int64_t reset_prefix_cache();

  int64_t ref_count(int64_t block) const;
  int64_t num_cached_blocks() const { return static_cast<int64_t>(cached_.size()); }
  int64_t num_evictable_blocks() const { return num_evictable_; }
  // Throws std::logic_error naming the first broken invariant of the pool's bookkeeping.
  void check_invariants() const;

  // Checks one iteration's (request, num_computed, num_new) rows against the requests' blocks,
  // before their metadata is built (kv/metadata.h): each fits its blocks, and no row's new
  // tokens land in a hashed block (final, possibly shared KV).
  void check_rows(const int64_t* request_ids, const int64_t* num_computed,
                  const int64_t* num_new, int64_t batch) const;

 private:
  std::vector<int32_t>& owned(int64_t request_id);
  void take_blocks(std::vector<int32_t>& into, int64_t count, int64_t request_id);
  // ValueError-style checks of num_tokens and prefix_hashes; who prefixes the message.
  void check_request(const std::string& who, int64_t num_tokens,
                     const std::vector<uint64_t>& prefix_hashes) const;
  [[noreturn]] void throw_full(int64_t request_id, int64_t count, int64_t available) const;
  // Length of the longest cached prefix of hashes; optionally how many of its blocks are
  // evictable, and the blocks themselves appended to blocks.
  int64_t match_prefix(const std::vector<uint64_t>& hashes, int64_t* num_evictable,
                       std::vector<int32_t>* blocks) const;
  void lru_push_back(int32_t block);
  void lru_remove(int32_t block);
  void forget_hash(int32_t block);

  int64_t num_blocks_;
  int64_t block_size_;
  std::vector<int32_t> free_list_;
  std::unordered_map<int64_t, std::vector<int32_t>> blocks_;
  // Per block: live requests listing it, and its hash while has_hash_ is set.
  std::vector<int32_t> ref_;
  std::vector<uint64_t> hash_;
  std::vector<uint8_t> has_hash_;
  // Intrusive circular LRU of evictable blocks through prev_/next_, sentinel index num_blocks_;
  // the head (next_[sentinel]) is evicted first.
  std::vector<int32_t> prev_;
  std::vector<int32_t> next_;
  int64_t num_evictable_ = 0;
  std::unordered_map<uint64_t, int32_t> cached_;
};

}  // namespace orca::kv

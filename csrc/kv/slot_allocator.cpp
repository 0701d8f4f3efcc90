#include "kv/slot_allocator.h"

#include <algorithm>

#include "hash.h"

namespace orca::kv {

namespace {
std::string id_str(int64_t request_id) { return "request " + std::to_string(request_id); }

// First block's parent when none is given, and a per-block seed ahead of extra_key.
constexpr uint64_t kRootHash = 0x6a09e667f3bcc908ULL;
constexpr uint64_t kBlockSeed = 0x9e3779b97f4a7c15ULL;
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
  ref_.assign(num_blocks, 0);
  hash_.assign(num_blocks, 0);
  has_hash_.assign(num_blocks, 0);
  prev_.assign(num_blocks + 1, static_cast<int32_t>(num_blocks));
  next_.assign(num_blocks + 1, static_cast<int32_t>(num_blocks));
}

int64_t SlotAllocator::blocks_needed(int64_t num_tokens) const {
  return (num_tokens + block_size_ - 1) / block_size_;
}

std::vector<uint64_t> SlotAllocator::block_hashes(const std::vector<int64_t>& token_ids,
                                                  int64_t extra_key,
                                                  std::optional<uint64_t> parent) const {
  const int64_t full = static_cast<int64_t>(token_ids.size()) / block_size_;
  std::vector<uint64_t> hashes(full);
  uint64_t h = parent.value_or(kRootHash);
  for (int64_t b = 0; b < full; ++b) {
    h = mix64(mix64(h ^ kBlockSeed) ^ static_cast<uint64_t>(extra_key));
    const int64_t* tokens = token_ids.data() + b * block_size_;
    for (int64_t i = 0; i < block_size_; ++i) h = mix64(h ^ static_cast<uint64_t>(tokens[i]));
    hashes[b] = h;
  }
  return hashes;
}

int64_t SlotAllocator::match_prefix(const std::vector<uint64_t>& hashes, int64_t* num_evictable,
                                    std::vector<int32_t>* blocks) const {
  int64_t found = 0, evictable = 0;
  for (const uint64_t h : hashes) {
    const auto it = cached_.find(h);
    if (it == cached_.end()) break;
    evictable += ref_[it->second] == 0;
    if (blocks != nullptr) blocks->push_back(it->second);
    ++found;
  }
  if (num_evictable != nullptr) *num_evictable = evictable;
  return found;
}

int64_t SlotAllocator::num_cached_prefix_blocks(const std::vector<uint64_t>& hashes) const {
  return match_prefix(hashes, nullptr, nullptr);
}

void SlotAllocator::check_request(const std::string& who, int64_t num_tokens,
                                  const std::vector<uint64_t>& prefix_hashes) const {
  if (num_tokens < 0) {
    throw std::invalid_argument("num_tokens must be >= 0, got " + std::to_string(num_tokens));
  }
  const auto offered = static_cast<int64_t>(prefix_hashes.size());
  if (offered * block_size_ > num_tokens) {
    throw std::invalid_argument(who + std::to_string(offered) + " prefix_hashes cover " +
                                std::to_string(offered * block_size_) +
                                " tokens, more than num_tokens (" + std::to_string(num_tokens) +
                                ")");
  }
}

int64_t SlotAllocator::num_blocks_to_allocate(int64_t num_tokens,
                                              const std::vector<uint64_t>& prefix_hashes) const {
  check_request("", num_tokens, prefix_hashes);
  int64_t evictable = 0;
  const int64_t found = match_prefix(prefix_hashes, &evictable, nullptr);
  return blocks_needed(num_tokens) - found + evictable;
}

bool SlotAllocator::can_allocate(int64_t num_tokens,
                                 const std::vector<uint64_t>& prefix_hashes) const {
  if (num_tokens < 0 || static_cast<int64_t>(prefix_hashes.size()) * block_size_ > num_tokens) {
    return false;
  }
  return num_blocks_to_allocate(num_tokens, prefix_hashes) <= num_free_blocks();
}

void SlotAllocator::throw_full(int64_t request_id, int64_t count, int64_t available) const {
  const int64_t prefix = num_free_blocks() - available;
  throw KVCacheFullError("KV cache full: " + id_str(request_id) + " needs " +
                         std::to_string(count) + " more blocks of " +
                         std::to_string(block_size_) + " slots, " + std::to_string(available) +
                         " of " + std::to_string(num_blocks_) + " are free" +
                         (prefix > 0 ? " besides the " + std::to_string(prefix) +
                                           " evictable blocks of its cached prefix"
                                     : ""));
}

void SlotAllocator::lru_push_back(int32_t block) {
  const auto sentinel = static_cast<int32_t>(num_blocks_);
  const int32_t last = prev_[sentinel];
  prev_[block] = last;
  next_[block] = sentinel;
  next_[last] = block;
  prev_[sentinel] = block;
  ++num_evictable_;
}

void SlotAllocator::lru_remove(int32_t block) {
  next_[prev_[block]] = next_[block];
  prev_[next_[block]] = prev_[block];
  prev_[block] = next_[block] = static_cast<int32_t>(num_blocks_);
  --num_evictable_;
}

void SlotAllocator::forget_hash(int32_t block) {
  cached_.erase(hash_[block]);
  has_hash_[block] = 0;
  hash_[block] = 0;
}

void SlotAllocator::take_blocks(std::vector<int32_t>& into, int64_t count, int64_t request_id) {
  if (count > num_free_blocks()) throw_full(request_id, count, num_free_blocks());
  const int64_t plain = std::min<int64_t>(count, static_cast<int64_t>(free_list_.size()));
  into.insert(into.end(), free_list_.rbegin(), free_list_.rbegin() + plain);
  free_list_.resize(free_list_.size() - plain);
  // Plain free blocks ran out: evict the least recently used cached blocks.
  for (int64_t i = plain; i < count; ++i) {
    const int32_t block = next_[num_blocks_];
    lru_remove(block);
    forget_hash(block);
    into.push_back(block);
  }
  for (auto it = into.end() - count; it != into.end(); ++it) ref_[*it] = 1;
}

int64_t SlotAllocator::allocate(int64_t request_id, int64_t num_tokens,
                                const std::vector<uint64_t>& prefix_hashes) {
  if (num_tokens < 0) {
    throw std::invalid_argument("num_tokens must be >= 0, got " + std::to_string(num_tokens));
  }
  if (contains(request_id)) {
    throw std::invalid_argument(id_str(request_id) + " already holds KV blocks; free it first");
  }
  check_request(id_str(request_id) + ": ", num_tokens, prefix_hashes);
  std::vector<int32_t> blocks;
  blocks.reserve(blocks_needed(num_tokens));
  int64_t evictable = 0;
  const int64_t found = match_prefix(prefix_hashes, &evictable, &blocks);
  const int64_t fresh = blocks_needed(num_tokens) - found;
  if (fresh > num_free_blocks() - evictable) {
    throw_full(request_id, fresh, num_free_blocks() - evictable);
  }
  for (const int32_t block : blocks) {
    if (ref_[block]++ == 0) lru_remove(block);
  }
  take_blocks(blocks, fresh, request_id);
  blocks_.emplace(request_id, std::move(blocks));
  return found * block_size_;
}

void SlotAllocator::extend(int64_t request_id, int64_t total_tokens) {
  auto& blocks = owned(request_id);
  const int64_t more = blocks_needed(total_tokens) - static_cast<int64_t>(blocks.size());
  if (more > 0) take_blocks(blocks, more, request_id);
}

void SlotAllocator::free(int64_t request_id) {
  auto it = blocks_.find(request_id);
  if (it == blocks_.end()) throw UnknownRequestError(id_str(request_id) + " holds no KV blocks");
  // Reversed, so a request's tail blocks (the least shareable) are evicted first.
  for (auto b = it->second.rbegin(); b != it->second.rend(); ++b) {
    if (--ref_[*b] > 0) continue;
    if (has_hash_[*b]) {
      lru_push_back(*b);
    } else {
      free_list_.push_back(*b);
    }
  }
  blocks_.erase(it);
}

int64_t SlotAllocator::cache_blocks(int64_t request_id, const std::vector<uint64_t>& hashes) {
  const auto& blocks = owned(request_id);
  const auto n = static_cast<int64_t>(hashes.size());
  if (n > static_cast<int64_t>(blocks.size())) {
    throw std::invalid_argument(id_str(request_id) + " holds " + std::to_string(blocks.size()) +
                                " KV blocks, got " + std::to_string(n) + " hashes");
  }
  for (int64_t i = 0; i < n; ++i) {
    const int32_t block = blocks[i];
    if (has_hash_[block] && hash_[block] != hashes[i]) {
      throw std::invalid_argument(id_str(request_id) + ": block " + std::to_string(i) +
                                  " is cached under hash " + std::to_string(hash_[block]) +
                                  ", got " + std::to_string(hashes[i]));
    }
  }
  int64_t registered = 0;
  for (int64_t i = 0; i < n; ++i) {
    const int32_t block = blocks[i];
    if (has_hash_[block] || !cached_.emplace(hashes[i], block).second) continue;
    has_hash_[block] = 1;
    hash_[block] = hashes[i];
    ++registered;
  }
  return registered;
}

int64_t SlotAllocator::shared_prefix_blocks(int64_t request_id) const {
  const auto& blocks = this->blocks(request_id);
  int64_t n = 0;
  while (n < static_cast<int64_t>(blocks.size()) && has_hash_[blocks[n]]) ++n;
  return n;
}

int64_t SlotAllocator::reset_prefix_cache() {
  const int64_t dropped = num_evictable_;
  while (num_evictable_ > 0) {
    const int32_t block = next_[num_blocks_];
    lru_remove(block);
    forget_hash(block);
    free_list_.push_back(block);
  }
  return dropped;
}

int64_t SlotAllocator::ref_count(int64_t block) const {
  if (block < 0 || block >= num_blocks_) {
    throw std::invalid_argument("block must be in [0, " + std::to_string(num_blocks_) +
                                "), got " + std::to_string(block));
  }
  return ref_[block];
}

void SlotAllocator::check_invariants() const {
  auto fail = [](const std::string& what) { throw std::logic_error("SlotAllocator: " + what); };
  // Whether each block was seen in the free list or the LRU.
  std::vector<uint8_t> seen(num_blocks_, 0);
  for (const int32_t b : free_list_) {
    if (b < 0 || b >= num_blocks_ || seen[b]) fail("free list has a bad or repeated block");
    if (ref_[b] != 0 || has_hash_[b]) {
      fail("free block " + std::to_string(b) + " is held or hashed");
    }
    seen[b] = 1;
  }
  int64_t evictable = 0;
  for (int32_t b = next_[num_blocks_]; b != num_blocks_; b = next_[b]) {
    if (b < 0 || b >= num_blocks_ || seen[b]) fail("LRU list has a bad or repeated block");
    if (next_[prev_[b]] != b) fail("LRU links broken at block " + std::to_string(b));
    if (ref_[b] != 0 || !has_hash_[b]) {
      fail("evictable block " + std::to_string(b) + " is held or unhashed");
    }
    seen[b] = 1;
    ++evictable;
  }
  if (evictable != num_evictable_) fail("num_evictable disagrees with the LRU list");
  std::vector<int32_t> listed(num_blocks_, 0);
  for (const auto& [id, blocks] : blocks_) {
    for (const int32_t b : blocks) {
      if (b < 0 || b >= num_blocks_) fail(id_str(id) + " lists bad block " + std::to_string(b));
      ++listed[b];
    }
  }
  int64_t hashed = 0;
  for (int64_t b = 0; b < num_blocks_; ++b) {
    const std::string name = "block " + std::to_string(b);
    if (listed[b] != ref_[b]) {
      fail(name + " has ref count " + std::to_string(ref_[b]) + " but " +
           std::to_string(listed[b]) + " listings");
    }
    if ((ref_[b] > 0) == (seen[b] != 0)) fail(name + " is not in exactly one of free/LRU/held");
    if (ref_[b] > 1 && !has_hash_[b]) fail(name + " is shared but unhashed");
    if (has_hash_[b]) {
      ++hashed;
      const auto it = cached_.find(hash_[b]);
      if (it == cached_.end() || it->second != b) fail(name + "'s hash is not mapped to it");
    }
  }
  if (hashed != static_cast<int64_t>(cached_.size())) fail("hash map has stale entries");
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

void SlotAllocator::check_rows(const int64_t* request_ids, const int64_t* num_computed,
                               const int64_t* num_new, int64_t batch) const {
  for (int64_t r = 0; r < batch; ++r) {
    if (num_computed[r] < 0 || num_new[r] < 0) {
      throw std::invalid_argument(id_str(request_ids[r]) + ": num_computed (" +
                                  std::to_string(num_computed[r]) + ") and num_new (" +
                                  std::to_string(num_new[r]) + ") must be >= 0");
    }
    const int64_t context = num_computed[r] + num_new[r];
    const auto& blocks = this->blocks(request_ids[r]);
    const int64_t cap = static_cast<int64_t>(blocks.size()) * block_size_;
    if (context > cap) {
      throw std::invalid_argument(id_str(request_ids[r]) + " needs " + std::to_string(context) +
                                  " KV slots but holds " + std::to_string(cap) +
                                  "; extend it first");
    }
    // Hashed blocks hold final, possibly shared KV: this row's new tokens must not land there.
    const int64_t used = blocks_needed(context);
    const int64_t first = num_new[r] > 0 && !cached_.empty() ? num_computed[r] / block_size_ : used;
    for (int64_t b = first; b < used; ++b) {
      if (has_hash_[blocks[b]]) {
        throw std::invalid_argument(
            id_str(request_ids[r]) + " would write position " +
            std::to_string(std::max(num_computed[r], b * block_size_)) + " into block " +
            std::to_string(blocks[b]) + ", which holds cached (read-only) KV");
      }
    }
  }
}

}  // namespace orca::kv

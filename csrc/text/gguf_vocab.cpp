#include "text/gguf_vocab.h"

#include <algorithm>
#include <cstring>
#include <string>

#include "hash.h"

namespace orca::text {

std::vector<StringBounds> gguf_string_bounds(const uint8_t* data, int64_t size, int64_t offset,
                                             int64_t count, bool swap) {
  const auto past_end = [&] {
    return std::out_of_range("the string array at byte " + std::to_string(offset) +
                             " runs past the end of the file (" + std::to_string(size) +
                             " bytes)");
  };
  // Each string takes at least its 8-byte count: a count beyond that cannot fit.
  if (offset < 0 || offset > size || count < 0 || count > (size - offset) / 8) throw past_end();
  std::vector<StringBounds> bounds(static_cast<size_t>(count));
  int64_t at = offset;
  for (auto& b : bounds) {
    if (size - at < 8) throw past_end();
    uint64_t length;
    std::memcpy(&length, data + at, 8);
    if (swap) length = __builtin_bswap64(length);
    at += 8;
    if (length > static_cast<uint64_t>(size - at)) throw past_end();
    b = {at, at + static_cast<int64_t>(length)};
    at = b.end;
  }
  return bounds;
}

namespace {

// 8 bytes at a time through SplitMix64's finalizer: every input bit reaches the low bits that
// pick a slot.
uint64_t hash_bytes(std::string_view s) {
  const char* p = s.data();
  size_t n = s.size();
  uint64_t h = n;
  for (; n >= 8; p += 8, n -= 8) {
    uint64_t v;
    std::memcpy(&v, p, 8);
    h = mix64(h ^ v);
  }
  uint64_t v = 0;
  std::memcpy(&v, p, n);
  return mix64(h ^ v);
}

bool starts_character(char byte) { return (static_cast<unsigned char>(byte) & 0xC0) != 0x80; }

// Token ids by spelling, open addressing: a spelled-twice token maps to its last copy.
// Lookups come in batches whose memory accesses are issued together (slot, then the candidate's
// offset, then its text): a large vocabulary's table and text (Gemma 3's: 4 + 3.4 MB) outgrow
// the caches, and one lookup at a time would wait on each miss in turn.
class Vocabulary {
 public:
  explicit Vocabulary(const std::vector<std::string_view>& tokens) {
    offsets_.reserve(tokens.size() + 1);
    offsets_.push_back(0);
    for (const std::string_view token : tokens) {
      text_.append(token);
      if (text_.size() > UINT32_MAX) {
        throw std::invalid_argument("sentencepiece_merges: the tokens' text exceeds 4 GiB");
      }
      offsets_.push_back(static_cast<uint32_t>(text_.size()));
    }
    size_t capacity = 16;
    while (capacity < 2 * tokens.size()) capacity *= 2;
    mask_ = capacity - 1;
    slots_.assign(capacity, {0, -1});
    uint64_t hashes[kGroup];
    for (size_t g = 0; g < tokens.size(); g += kGroup) {
      const size_t n = std::min(kGroup, tokens.size() - g);
      for (size_t k = 0; k < n; ++k) {
        hashes[k] = hash_bytes(tokens[g + k]);
        __builtin_prefetch(&slots_[hashes[k] & mask_]);
      }
      for (size_t k = 0; k < n; ++k) {  // in order: a later copy of a spelling replaces it
        size_t at = hashes[k] & mask_;
        while (slots_[at].id >= 0 && !matches(slots_[at], tokens[g + k], hashes[k])) {
          at = (at + 1) & mask_;
        }
        slots_[at] = {static_cast<uint32_t>(hashes[k] >> 32), static_cast<int32_t>(g + k)};
      }
    }
  }

  // ids[k] = the id of queries[k], or -1.
  void find(const std::vector<std::string_view>& queries, int32_t* ids) const {
    uint64_t hashes[kGroup];
    size_t at[kGroup];
    for (size_t g = 0; g < queries.size(); g += kGroup) {
      const size_t n = std::min(kGroup, queries.size() - g);
      for (size_t k = 0; k < n; ++k) {
        hashes[k] = hash_bytes(queries[g + k]);
        at[k] = hashes[k] & mask_;
        __builtin_prefetch(&slots_[at[k]]);
      }
      // The first slot that is empty or has the query's tag: its token's offsets, then text.
      for (size_t k = 0; k < n; ++k) {
        const auto tag = static_cast<uint32_t>(hashes[k] >> 32);
        while (slots_[at[k]].id >= 0 && slots_[at[k]].tag != tag) at[k] = (at[k] + 1) & mask_;
        if (slots_[at[k]].id >= 0) __builtin_prefetch(&offsets_[slots_[at[k]].id]);
      }
      for (size_t k = 0; k < n; ++k) {
        if (slots_[at[k]].id >= 0) __builtin_prefetch(text_.data() + offsets_[slots_[at[k]].id]);
      }
      for (size_t k = 0; k < n; ++k) {
        size_t i = at[k];
        while (slots_[i].id >= 0 && !matches(slots_[i], queries[g + k], hashes[k])) {
          i = (i + 1) & mask_;
        }
        ids[g + k] = slots_[i].id;
      }
    }
  }

 private:
  static constexpr size_t kGroup = 64;  // the accesses issued together

  struct Slot {
    uint32_t tag;  // the hash's top bits (its low bits pick the slot)
    int32_t id;    // -1: empty
  };

  bool matches(const Slot& slot, std::string_view s, uint64_t h) const {
    const uint32_t begin = offsets_[slot.id], end = offsets_[slot.id + 1];
    return slot.tag == static_cast<uint32_t>(h >> 32) &&
           std::string_view(text_).substr(begin, end - begin) == s;
  }

  std::string text_;
  std::vector<uint32_t> offsets_;
  std::vector<Slot> slots_;
  size_t mask_ = 0;
};

}  // namespace

std::vector<Merge> sentencepiece_merges(const std::vector<std::string_view>& tokens,
                                        const std::vector<double>& scores) {
  if (scores.size() != tokens.size()) {
    throw std::invalid_argument("sentencepiece_merges: " + std::to_string(scores.size()) +
                                " scores for " + std::to_string(tokens.size()) + " tokens");
  }
  const Vocabulary vocabulary(tokens);
  std::vector<int32_t> ids(tokens.size());
  vocabulary.find(tokens, ids.data());
  struct Found {
    double score;
    int32_t left_chars, right_chars, owner;
    Merge merge;
  };
  std::vector<Found> found;
  // A few thousand tokens at a time: every split of each (at a character boundary, of a token
  // that is its spelling's last copy), its two pieces looked up in one batch.
  constexpr size_t kTokensPerBatch = 4096;
  std::vector<std::string_view> pieces;
  std::vector<Found> splits;
  std::vector<int32_t> piece_ids;
  for (size_t first = 0; first < tokens.size(); first += kTokensPerBatch) {
    pieces.clear();
    splits.clear();
    for (size_t i = first; i < std::min(tokens.size(), first + kTokensPerBatch); ++i) {
      const std::string_view token = tokens[i];
      if (token.size() < 2 || ids[i] != static_cast<int32_t>(i)) continue;
      const auto chars =
          static_cast<int32_t>(std::count_if(token.begin(), token.end(), starts_character));
      int32_t left_chars = 0;
      for (size_t split = 1; split < token.size(); ++split) {
        if (!starts_character(token[split])) continue;
        ++left_chars;
        pieces.push_back(token.substr(0, split));
        pieces.push_back(token.substr(split));
        splits.push_back({scores[i], left_chars, chars - left_chars, static_cast<int32_t>(i),
                          {-1, -1}});
      }
    }
    piece_ids.resize(pieces.size());
    vocabulary.find(pieces, piece_ids.data());
    for (size_t k = 0; k < splits.size(); ++k) {
      if (piece_ids[2 * k] < 0 || piece_ids[2 * k + 1] < 0) continue;
      splits[k].merge = {piece_ids[2 * k], piece_ids[2 * k + 1]};
      found.push_back(splits[k]);
    }
  }
  std::sort(found.begin(), found.end(), [](const Found& a, const Found& b) {
    if (a.score != b.score) return a.score > b.score;
    if (a.left_chars != b.left_chars) return a.left_chars > b.left_chars;
    if (a.right_chars != b.right_chars) return a.right_chars > b.right_chars;
    return a.owner < b.owner;
  });
  std::vector<Merge> merges(found.size());
  std::transform(found.begin(), found.end(), merges.begin(),
                 [](const Found& f) { return f.merge; });
  return merges;
}

}  // namespace orca::text

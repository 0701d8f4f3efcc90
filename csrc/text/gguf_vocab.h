// Torch-free pieces of loading a GGUF file's vocabulary: its string arrays read in one pass, and
// the merges a SentencePiece BPE vocabulary implies (Gemma 3's 262,144 tokens have about 1.2
// million split points), where Python would loop over each string.
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string_view>
#include <vector>

namespace orca::text {

// Where one string of a GGUF string array lies: its UTF-8 bytes are data[begin, end).
struct StringBounds {
  int64_t begin, end;
};

// The strings of a GGUF array of `count` strings starting at data[offset] (each a uint64 byte
// count in the file's byte order, `swap` when it is not the machine's, then that many bytes).
// std::out_of_range naming the offset when the array runs past data[size).
std::vector<StringBounds> gguf_string_bounds(const uint8_t* data, int64_t size, int64_t offset,
                                             int64_t count, bool swap);

// One merge: the token ids of its left and right pieces.
struct Merge {
  int32_t left, right;
};

// SentencePiece BPE's merges implied by its vocabulary (tokens as UTF-8, one score each):
// every split of a token, at a character boundary, into two tokens, ordered as transformers
// orders them: best-scored merged token first, then the longer left piece (in characters),
// then the longer right one, then vocabulary order. A token spelled twice splits only as its
// last copy, and a piece names the last copy of its spelling. Scores must not be NaN.
std::vector<Merge> sentencepiece_merges(const std::vector<std::string_view>& tokens,
                                        const std::vector<double>& scores);

}  // namespace orca::text

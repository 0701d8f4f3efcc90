// Torch-free hashing shared by the KV slot allocator's prefix hashes and the GGUF vocabulary's
// lookup table.
#pragma once

#include <cstdint>

namespace orca {

// SplitMix64's finalizer: a bijection on 64 bits with full avalanche.
inline uint64_t mix64(uint64_t x) {
  x ^= x >> 30;
  x *= 0xbf58476d1ce4e5b9ULL;
  x ^= x >> 27;
  x *= 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

}  // namespace orca

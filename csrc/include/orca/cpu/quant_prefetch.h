// How the quantized linear's few-token kernels (quant_kernel.h, quant_vnni.h) prefetch their
// weights: a row group's bytes are asked into L2 (prefetcht1) this far ahead of where the group
// reads them. The hardware prefetcher alone, or a prefetch one row group ahead into L1, left a
// one-token head (Gemma 3's 262144 x 640 q8_0) at half the memory bandwidth; this distance
// covers the DRAM latency at both cores' full bandwidth without running far past a layer's end.
#pragma once

#include <cstdint>

namespace orca::cpu::quant {

constexpr int64_t kWeightPrefetchBytes = 16384;

// The weight line kWeightPrefetchBytes past `at` into L2.
inline void prefetch_weights_ahead(const uint8_t* at) {
  __builtin_prefetch(at + kWeightPrefetchBytes, 0, 2);
}

}  // namespace orca::cpu::quant

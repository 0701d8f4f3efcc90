// How the quantized linear's few-token kernels (quant_kernel.h, quant_vnni.h) prefetch their
// weights: a row group's bytes are asked into L2 (prefetcht1) this far ahead of where the group
// reads them: one row group ahead is too short to hide DRAM latency on a long weight stream (a
// one-token output head), and this distance is short enough not to run far past a layer's end.
#pragma once

#include <cstdint>

namespace orca::cpu::quant {

constexpr int64_t kWeightPrefetchBytes = 16384;

// The weight line kWeightPrefetchBytes past `at` into L2.
inline void prefetch_weights_ahead(const uint8_t* at) {
  __builtin_prefetch(at + kWeightPrefetchBytes, 0, 2);
}

}  // namespace orca::cpu::quant

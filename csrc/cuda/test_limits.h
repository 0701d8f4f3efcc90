// Test-only caps on the CUDA launchers' choices, all off by default: tests set them through
// orca_ext._C._set_cuda_test_limits (orca_ext.testing.cuda_test_limits) to force the paths a
// small problem on a large GPU never takes. Torch- and CUDA-free.
#pragma once

#include <atomic>
#include <cstdint>

namespace orca::cuda {

struct TestLimits {
  std::atomic<int64_t> attn_max_ctas{0};        // ragged_attention's tensor-core grid (0: none)
  std::atomic<int64_t> attn_max_splits{0};      // its KV splits per item (0: none)
  std::atomic<bool> linear_no_epilogue{false};  // packed_linear without cuBLASLt's epilogue
};

inline TestLimits& test_limits() {
  static TestLimits limits;
  return limits;
}

}  // namespace orca::cuda

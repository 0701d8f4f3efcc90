// Torch-free CUDA kernel of apply_token_bitmask: one thread per (mask row, token); a cleared bit
// writes -inf's bit pattern, so one kernel serves every float dtype. A row index outside the
// logits is skipped (the launcher cannot check device values without a sync).
#include <algorithm>

#include "orca/cuda/params.h"

namespace orca::cuda {
namespace {

template <typename Bits>
__global__ void apply_token_bitmask_kernel(const TokenBitmaskParams p) {
  const int64_t mask_row = blockIdx.y;
  const int64_t token = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (token >= p.vocab) return;
  const int32_t word = __ldg(p.bitmask + mask_row * p.words + (token >> 5));
  if ((word >> (token & 31)) & 1) return;
  const int64_t row = p.rows == nullptr ? mask_row : __ldg(p.rows + mask_row);
  if (row < 0 || row >= p.num_rows) return;
  static_cast<Bits*>(p.logits)[row * p.logits_row_stride + token] =
      static_cast<Bits>(p.neg_inf_bits);
}

}  // namespace

cudaError_t launch_apply_token_bitmask(const TokenBitmaskParams& p, cudaStream_t stream) {
  if (p.num_masks == 0 || p.vocab == 0) return cudaSuccess;
  if (p.num_masks > 65535) return cudaErrorInvalidValue;  // gridDim.y's limit
  constexpr int kThreads = 256;
  const dim3 grid(static_cast<unsigned>(div_up(p.vocab, kThreads)),
                  static_cast<unsigned>(p.num_masks));
  if (p.element_bytes == 4) apply_token_bitmask_kernel<uint32_t><<<grid, kThreads, 0, stream>>>(p);
  else apply_token_bitmask_kernel<uint16_t><<<grid, kThreads, 0, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace orca::cuda

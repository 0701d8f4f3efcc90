// Torch-free launch code of the ragged_attention kernels (csrc/include/orca/cuda/attention.cuh),
// instantiated once per dtype by attention_{bf16,fp16}.cu and kernels.cu.
#pragma once

#include <type_traits>

#include "orca/cuda/attention.cuh"

namespace orca::cuda::attn {

template <typename T, int D>
cudaError_t launch_tc(const AttentionParams& p, const AttentionPlan& plan, cudaStream_t stream) {
  auto kernel = plan.warps_m == 1 ? attention_tc_kernel<T, D, 1> : attention_tc_kernel<T, D, 4>;
  cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         static_cast<int>(plan.smem_bytes));
  if (err != cudaSuccess) return err;
  const dim3 grid(static_cast<unsigned>(plan.grid_x), static_cast<unsigned>(p.num_kv_heads));
  kernel<<<grid, kAttnThreads, plan.smem_bytes, stream>>>(p);
  err = cudaGetLastError();
  if (err != cudaSuccess || plan.max_splits <= 1) return err;
  const int64_t rows = static_cast<int64_t>(p.num_tokens) * p.num_q_heads;
  merge_kernel<T><<<static_cast<unsigned>(ceil_div(rows, 4)), 128, 0, stream>>>(p);
  return cudaGetLastError();
}

template <typename T>
cudaError_t launch_attention(const AttentionParams& p, const AttentionPlan& plan,
                             cudaStream_t stream) {
  if constexpr (!std::is_same_v<T, float>) {
    if (plan.tensor_cores) {
      switch (p.head_dim) {
        case 32: return launch_tc<T, 32>(p, plan, stream);
        case 64: return launch_tc<T, 64>(p, plan, stream);
        case 80: return launch_tc<T, 80>(p, plan, stream);
        case 96: return launch_tc<T, 96>(p, plan, stream);
        case 128: return launch_tc<T, 128>(p, plan, stream);
        default: break;
      }
    }
  }
  const int64_t rows = static_cast<int64_t>(p.num_tokens) * p.num_q_heads;
  attention_simple_kernel<T><<<static_cast<unsigned>(ceil_div(rows, 4)), 128, 0, stream>>>(p);
  return cudaGetLastError();
}

extern template cudaError_t launch_attention<__nv_bfloat16>(const AttentionParams&,
                                                            const AttentionPlan&, cudaStream_t);
extern template cudaError_t launch_attention<__half>(const AttentionParams&, const AttentionPlan&,
                                                     cudaStream_t);

}  // namespace orca::cuda::attn

// Torch-free launch code of the ragged_attention kernels (csrc/include/orca/cuda/attention.cuh),
// instantiated once per dtype by attention_{bf16,fp16}.cu and kernels.cu.
#pragma once

#include <algorithm>
#include <mutex>
#include <type_traits>

#include "orca/cuda/attention.cuh"

namespace orca::cuda::attn {

// Raises attention_tc_kernel<T, D, WM, KV>'s dynamic shared-memory limit once per device, to what
// the largest batch needs (capped at the device's opt-in limit, which the launcher checks each
// plan against). Setting it per launch to that launch's size would let two host threads
// interleave set(large), set(small), launch(large).
template <typename T, int D, int WM, typename KV>
cudaError_t allow_max_dynamic_smem() {
  constexpr int kMaxDevices = 64;
  static std::once_flag once[kMaxDevices];
  static cudaError_t result[kMaxDevices];
  int device = 0;
  const cudaError_t err = cudaGetDevice(&device);
  if (err != cudaSuccess) return err;
  if (device < 0 || device >= kMaxDevices) return cudaErrorInvalidDevice;
  std::call_once(once[device], [device] {
    int optin = 0;
    cudaError_t e =
        cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device);
    if (e == cudaSuccess) {
      const size_t most = std::min(attention_smem_bytes(WM, D, kAttnMaxBatchTC,
                                                        kv_format_of<T, KV>()),
                                   static_cast<size_t>(optin));
      e = cudaFuncSetAttribute(attention_tc_kernel<T, D, WM, KV>,
                               cudaFuncAttributeMaxDynamicSharedMemorySize,
                               static_cast<int>(most));
    }
    result[device] = e;
  });
  return result[device];
}

template <typename T, int D, typename KV>
cudaError_t launch_tc_kv(const AttentionParams& p, const AttentionPlan& plan,
                         cudaStream_t stream) {
  const bool decode = plan.warps_m == 1;
  cudaError_t err =
      decode ? allow_max_dynamic_smem<T, D, 1, KV>() : allow_max_dynamic_smem<T, D, 4, KV>();
  if (err != cudaSuccess) return err;
  const dim3 grid(static_cast<unsigned>(plan.grid_x), static_cast<unsigned>(p.num_kv_heads));
  if (decode) attention_tc_kernel<T, D, 1, KV><<<grid, kAttnThreads, plan.smem_bytes, stream>>>(p);
  else attention_tc_kernel<T, D, 4, KV><<<grid, kAttnThreads, plan.smem_bytes, stream>>>(p);
  err = cudaGetLastError();
  if (err != cudaSuccess || plan.max_splits <= 1) return err;
  const int64_t rows = static_cast<int64_t>(p.num_tokens) * p.num_q_heads;
  merge_kernel<T><<<static_cast<unsigned>(ceil_div(rows, 4)), 128, 0, stream>>>(p);
  return cudaGetLastError();
}

template <typename T, int D>
cudaError_t launch_tc(const AttentionParams& p, const AttentionPlan& plan, cudaStream_t stream) {
  return plan.kv_format == KvFormat::kFp8E4M3 ? launch_tc_kv<T, D, __nv_fp8_e4m3>(p, plan, stream)
                                              : launch_tc_kv<T, D, T>(p, plan, stream);
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
  const dim3 grid(static_cast<unsigned>(ceil_div(rows, 4)));
  if (plan.kv_format == KvFormat::kFp8E4M3) {
    attention_simple_kernel<T, __nv_fp8_e4m3><<<grid, 128, 0, stream>>>(p);
  } else {
    attention_simple_kernel<T><<<grid, 128, 0, stream>>>(p);
  }
  return cudaGetLastError();
}

extern template cudaError_t launch_attention<__nv_bfloat16>(const AttentionParams&,
                                                            const AttentionPlan&, cudaStream_t);
extern template cudaError_t launch_attention<__half>(const AttentionParams&, const AttentionPlan&,
                                                     cudaStream_t);

}  // namespace orca::cuda::attn

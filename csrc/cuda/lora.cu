// lora_linear's CUDA launch: the kernel of orca/cuda/lora.cuh per dtype.
#include "orca/cuda/lora.cuh"

namespace orca::cuda {
namespace {

template <typename T>
cudaError_t launch(const LoraParams& p, cudaStream_t stream) {
  const size_t smem = static_cast<size_t>(p.R) * sizeof(float);
  lora::lora_linear_kernel<T><<<static_cast<unsigned>(p.T), lora::kThreads, smem, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace

cudaError_t launch_lora_linear(const LoraParams& p, DType dtype, cudaStream_t stream) {
  if (p.T == 0 || p.N == 0 || p.R == 0 || p.S == 0) return cudaSuccess;
  if (p.T > 2147483647) return cudaErrorInvalidValue;  // gridDim.x's limit
  switch (dtype) {
    case DType::kBFloat16: return launch<__nv_bfloat16>(p, stream);
    case DType::kFloat16: return launch<__half>(p, stream);
    default: return launch<float>(p, stream);
  }
}

}  // namespace orca::cuda

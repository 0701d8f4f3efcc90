// Torch-free launch functions declared in orca/cuda/params.h: ragged_attention's dtype
// dispatch (+ its fp32 instantiation), store_kv and packed_linear's epilogue kernels.
#include <algorithm>

#include "attention_launch.cuh"
#include "orca/cuda/linear.cuh"
#include "orca/cuda/store_kv.cuh"

namespace orca::cuda {

cudaError_t launch_ragged_attention(const AttentionParams& p, const AttentionPlan& plan,
                                    DType dtype, cudaStream_t stream) {
  switch (dtype) {
    case DType::kBFloat16: return attn::launch_attention<__nv_bfloat16>(p, plan, stream);
    case DType::kFloat16: return attn::launch_attention<__half>(p, plan, stream);
    default: return attn::launch_attention<float>(p, plan, stream);
  }
}

namespace {

inline bool aligned(const void* ptr, int64_t bytes) {
  return reinterpret_cast<uintptr_t>(ptr) % bytes == 0;
}

template <int VB>
bool store_kv_fits(const StoreKvParams& p) {
  return p.row_bytes % VB == 0 && p.key_stride_token % VB == 0 && p.key_stride_head % VB == 0 &&
         p.value_stride_token % VB == 0 && p.value_stride_head % VB == 0 && aligned(p.key, VB) &&
         aligned(p.value, VB) && aligned(p.k_cache, VB) && aligned(p.v_cache, VB);
}

// Enough CTAs for a grid-stride elementwise kernel to fill the device a few times over.
inline unsigned elementwise_blocks(int64_t n) {
  return static_cast<unsigned>(std::max<int64_t>(1, std::min<int64_t>(ceil_div(n, 256), 65536)));
}

}  // namespace

cudaError_t launch_store_kv(const StoreKvParams& p, cudaStream_t stream) {
  if (p.num_tokens == 0) return cudaSuccess;
  const int64_t bytes = p.num_heads * p.row_bytes;
  const int threads = static_cast<int>(std::min<int64_t>(128, std::max<int64_t>(32, bytes / 16)));
  const dim3 grid(static_cast<unsigned>(p.num_tokens));
  if (store_kv_fits<16>(p)) kvstore::store_kv_kernel<16><<<grid, threads, 0, stream>>>(p);
  else if (store_kv_fits<8>(p)) kvstore::store_kv_kernel<8><<<grid, threads, 0, stream>>>(p);
  else if (store_kv_fits<4>(p)) kvstore::store_kv_kernel<4><<<grid, threads, 0, stream>>>(p);
  else kvstore::store_kv_kernel<2><<<grid, threads, 0, stream>>>(p);
  return cudaGetLastError();
}

cudaError_t launch_store_kv_fp8(const StoreKvParams& p, DType key_dtype, cudaStream_t stream) {
  if (p.num_tokens == 0) return cudaSuccess;
  const int threads = static_cast<int>(std::min<int64_t>(128, std::max<int64_t>(32,
                                                         p.num_heads * p.row_bytes)));
  const dim3 grid(static_cast<unsigned>(p.num_tokens));
  switch (key_dtype) {
    case DType::kBFloat16:
      kvstore::store_kv_fp8_kernel<__nv_bfloat16><<<grid, threads, 0, stream>>>(p);
      break;
    case DType::kFloat16: kvstore::store_kv_fp8_kernel<__half><<<grid, threads, 0, stream>>>(p); break;
    default: kvstore::store_kv_fp8_kernel<float><<<grid, threads, 0, stream>>>(p); break;
  }
  return cudaGetLastError();
}

namespace {

template <typename T>
cudaError_t skinny(const SkinnyLinearParams& p, cudaStream_t stream) {
  const int64_t cols = act_gated(p.act) ? linear::kSkinnyRows / 2 : linear::kSkinnyRows;
  const dim3 grid(static_cast<unsigned>(ceil_div(p.N, cols)));
  constexpr int kThreads = linear::kSkinnyThreads;
  if (p.T <= 1) linear::skinny_linear_kernel<T, 1><<<grid, kThreads, 0, stream>>>(p);
  else if (p.T <= 2) linear::skinny_linear_kernel<T, 2><<<grid, kThreads, 0, stream>>>(p);
  else if (p.T <= 4) linear::skinny_linear_kernel<T, 4><<<grid, kThreads, 0, stream>>>(p);
  else linear::skinny_linear_kernel<T, 8><<<grid, kThreads, 0, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace

cudaError_t launch_skinny_linear(const SkinnyLinearParams& p, DType dtype, cudaStream_t stream) {
  if (p.T == 0 || p.N == 0) return cudaSuccess;
  if (p.T > kSkinnyMaxT) return cudaErrorInvalidValue;
  switch (dtype) {
    case DType::kBFloat16: return skinny<__nv_bfloat16>(p, stream);
    case DType::kFloat16: return skinny<__half>(p, stream);
    default: return skinny<float>(p, stream);
  }
}

namespace {
template <typename T>
cudaError_t bias_act(void* y, const void* bias, int64_t T_, int64_t N, Act act,
                     cudaStream_t stream) {
  linear::bias_act_kernel<T><<<elementwise_blocks(T_ * N), 256, 0, stream>>>(
      static_cast<T*>(y), static_cast<const T*>(bias), T_, N, act);
  return cudaGetLastError();
}

template <typename T>
cudaError_t act_mul(const void* y, void* out, int64_t T_, int64_t I, Act act,
                    cudaStream_t stream) {
  constexpr int kVec = 16 / sizeof(T);
  if (I % kVec == 0 && aligned(y, 16) && aligned(out, 16)) {
    linear::act_and_mul_kernel<T, kVec><<<elementwise_blocks(T_ * I / kVec), 256, 0, stream>>>(
        static_cast<const T*>(y), static_cast<T*>(out), T_, I, act);
  } else {
    linear::act_and_mul_kernel<T, 1><<<elementwise_blocks(T_ * I), 256, 0, stream>>>(
        static_cast<const T*>(y), static_cast<T*>(out), T_, I, act);
  }
  return cudaGetLastError();
}
}  // namespace

cudaError_t launch_bias_act(void* y, const void* bias, int64_t T_, int64_t N, Act act,
                            DType dtype, cudaStream_t stream) {
  if (T_ * N == 0) return cudaSuccess;
  switch (dtype) {
    case DType::kBFloat16: return bias_act<__nv_bfloat16>(y, bias, T_, N, act, stream);
    case DType::kFloat16: return bias_act<__half>(y, bias, T_, N, act, stream);
    default: return bias_act<float>(y, bias, T_, N, act, stream);
  }
}

cudaError_t launch_act_and_mul(const void* y, void* out, int64_t T_, int64_t I, Act act,
                               DType dtype, cudaStream_t stream) {
  if (T_ * I == 0) return cudaSuccess;
  switch (dtype) {
    case DType::kBFloat16: return act_mul<__nv_bfloat16>(y, out, T_, I, act, stream);
    case DType::kFloat16: return act_mul<__half>(y, out, T_, I, act, stream);
    default: return act_mul<float>(y, out, T_, I, act, stream);
  }
}

}  // namespace orca::cuda

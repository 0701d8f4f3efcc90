// Torch-free CUDA kernels of store_kv: copy each new token's K and V rows into its cache slot.
// One CTA per token; its threads copy the token's [H, D] rows in VB-byte vectors. A negative
// slot means "do not store"; a slot past the cache is skipped too (the CUDA launcher cannot
// check slot values on the host without a sync).
#pragma once

#include "orca/cuda/common.cuh"
#include "orca/cuda/params.h"

namespace orca::cuda::kvstore {

template <int VB> struct VecType;
template <> struct VecType<16> { using type = uint4; };
template <> struct VecType<8> { using type = uint2; };
template <> struct VecType<4> { using type = uint32_t; };
template <> struct VecType<2> { using type = uint16_t; };

// VB: bytes per copy; divides row_bytes, every byte stride and every base address.
template <int VB>
__global__ void __launch_bounds__(128) store_kv_kernel(const StoreKvParams p) {
  using V = typename VecType<VB>::type;
  const int64_t t = blockIdx.x;
  const int64_t slot = __ldg(p.slot_mapping + t);
  if (slot < 0 || slot >= p.num_slots) return;
  const int64_t per_row = p.row_bytes / VB, n = p.num_heads * per_row;
  const char* key = static_cast<const char*>(p.key) + t * p.key_stride_token;
  const char* value = static_cast<const char*>(p.value) + t * p.value_stride_token;
  char* kdst = static_cast<char*>(p.k_cache) + slot * p.num_heads * p.row_bytes;
  char* vdst = static_cast<char*>(p.v_cache) + slot * p.num_heads * p.row_bytes;
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
    const int64_t h = i / per_row, off = (i % per_row) * VB;
    const V kv = *reinterpret_cast<const V*>(key + h * p.key_stride_head + off);
    const V vv = *reinterpret_cast<const V*>(value + h * p.value_stride_head + off);
    *reinterpret_cast<V*>(kdst + h * p.row_bytes + off) = kv;
    *reinterpret_cast<V*>(vdst + h * p.row_bytes + off) = vv;
  }
}

// The same for an fp8 cache (row_bytes = D): each key/value element of T rounded to fp8 e4m3.
template <typename T>
__global__ void __launch_bounds__(128) store_kv_fp8_kernel(const StoreKvParams p) {
  const int64_t t = blockIdx.x;
  const int64_t slot = __ldg(p.slot_mapping + t);
  if (slot < 0 || slot >= p.num_slots) return;
  const int64_t D = p.row_bytes, n = p.num_heads * D;
  const char* key = static_cast<const char*>(p.key) + t * p.key_stride_token;
  const char* value = static_cast<const char*>(p.value) + t * p.value_stride_token;
  auto* kdst = static_cast<__nv_fp8_storage_t*>(p.k_cache) + slot * n;
  auto* vdst = static_cast<__nv_fp8_storage_t*>(p.v_cache) + slot * n;
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
    const int64_t h = i / D, d = i % D;
    const T k = reinterpret_cast<const T*>(key + h * p.key_stride_head)[d];
    const T v = reinterpret_cast<const T*>(value + h * p.value_stride_head)[d];
    kdst[i] = float_to_fp8(to_float<T>(k));
    vdst[i] = float_to_fp8(to_float<T>(v));
  }
}

}  // namespace orca::cuda::kvstore

// store_kv on CUDA: one vectorized copy kernel on the current stream (an fp8 cache: one kernel
// rounding each value to fp8 e4m3). Slot values are not
// checked on the host (that would need a sync): a negative slot is skipped by contract, and a
// slot past the end of the cache is skipped rather than written out of bounds.
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "checks.h"
#include "cuda/common.h"

namespace orca {
namespace {

void store_kv_cuda(const at::Tensor& key, const at::Tensor& value, at::Tensor& k_cache,
                   at::Tensor& v_cache, const at::Tensor& slot_mapping) {
  check_store_kv_inputs(key, value, k_cache, v_cache, slot_mapping);
  cuda::check_cuda(key, "store_kv", "key");
  TORCH_CHECK(key.stride(2) == 1 && value.stride(2) == 1,
              "key and value must have a contiguous last (head_dim) dimension");
  const c10::cuda::CUDAGuard guard(key.device());
  const at::Tensor slots = slot_mapping.contiguous();
  const int64_t elem = key.element_size();
  const bool fp8_cache = is_fp8_kv_cache(k_cache);
  cuda::StoreKvParams p{};
  p.key = key.data_ptr();
  p.value = value.data_ptr();
  p.k_cache = k_cache.data_ptr();
  p.v_cache = v_cache.data_ptr();
  p.slot_mapping = slots.data_ptr<int64_t>();
  p.num_tokens = key.size(0);
  p.num_slots = k_cache.size(0) * k_cache.size(1);
  p.num_heads = key.size(1);
  p.row_bytes = key.size(2) * k_cache.element_size();
  p.key_stride_token = key.stride(0) * elem;
  p.key_stride_head = key.stride(1) * elem;
  p.value_stride_token = value.stride(0) * elem;
  p.value_stride_head = value.stride(1) * elem;
  if (p.num_tokens == 0 || p.num_heads == 0 || p.row_bytes == 0) return;
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(key.get_device());
  ORCA_CUDA_LAUNCH_CHECK(fp8_cache ? cuda::launch_store_kv_fp8(p, cuda::to_dtype(key.scalar_type()),
                                                               stream)
                                   : cuda::launch_store_kv(p, stream),
                         "store_kv");
}

}  // namespace

TORCH_LIBRARY_IMPL(orca, CUDA, m) { m.impl("store_kv", &store_kv_cuda); }

}  // namespace orca

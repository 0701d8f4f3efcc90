// store_kv on CPU: copy each new token's K/V rows into its slot of the paged cache, or
// quantize them into an int8 cache's rows (orca/cpu/kv_int8.h).
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>

#include "checks.h"
#include "orca/cpu/kv_int8.h"

namespace orca {
namespace {

void store_kv_cpu(const at::Tensor& key, const at::Tensor& value, at::Tensor& k_cache,
                  at::Tensor& v_cache, const at::Tensor& slot_mapping) {
  check_store_kv_inputs(key, value, k_cache, v_cache, slot_mapping);
  TORCH_CHECK(key.stride(2) == 1 && value.stride(2) == 1,
              "key and value must have a contiguous last (head_dim) dimension");
  const int64_t T = key.size(0), H = key.size(1), D = key.size(2);
  const int64_t num_slots = k_cache.size(0) * k_cache.size(1);
  const at::Tensor slots = slot_mapping.contiguous();
  const int64_t* slot = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t) {
    TORCH_CHECK(slot[t] < num_slots, "slot_mapping[", t, "] = ", slot[t],
                " is out of range for a cache of ", num_slots, " slots");
  }
  if (is_int8_kv_cache(k_cache)) {
    const int64_t row_bytes = D + cpu::kInt8ScaleBytes;
    ORCA_DISPATCH_FLOAT_TYPES(key.scalar_type(), "store_kv", [&] {
      auto quantize_rows = [&](const at::Tensor& src, at::Tensor& cache, bool keys) {
        const scalar_t* base = src.data_ptr<scalar_t>();
        auto* dst = cache.data_ptr<int8_t>();
        at::parallel_for(0, T, std::max<int64_t>(1, 16384 / (H * D)), [&](int64_t begin,
                                                                          int64_t end) {
          for (int64_t t = begin; t < end; ++t) {
            if (slot[t] < 0) continue;
            for (int64_t h = 0; h < H; ++h) {
              cpu::quantize_kv_row(base + t * src.stride(0) + h * src.stride(1), D,
                                   dst + (slot[t] * H + h) * row_bytes, keys);
            }
          }
        });
      };
      quantize_rows(key, k_cache, true);
      quantize_rows(value, v_cache, false);
    });
    return;
  }
  const int64_t row_bytes = D * key.element_size();
  auto copy_rows = [&](const at::Tensor& src, at::Tensor& cache) {
    const auto* base = static_cast<const char*>(src.data_ptr());
    auto* dst = static_cast<char*>(cache.data_ptr());
    const int64_t st = src.stride(0) * src.element_size(), sh = src.stride(1) * src.element_size();
    // One thread unless there is enough to copy to pay for a fork-join (~64K elements).
    at::parallel_for(0, T, std::max<int64_t>(1, 65536 / (H * D)), [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        if (slot[t] < 0) continue;
        for (int64_t h = 0; h < H; ++h) {
          std::memcpy(dst + (slot[t] * H + h) * row_bytes, base + t * st + h * sh, row_bytes);
        }
      }
    });
  };
  copy_rows(key, k_cache);
  copy_rows(value, v_cache);
}

}  // namespace

TORCH_LIBRARY_IMPL(orca, CPU, m) { m.impl("store_kv", &store_kv_cpu); }

}  // namespace orca

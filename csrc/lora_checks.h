// lora_linear's input validation, shared by its CPU and CUDA launchers.
#pragma once

#include "checks.h"

namespace orca {

// y [T, N] and x [T, K] of one float dtype; lora_a float32 [L, R, K]; lora_b float32 [L, R, N]
// (B transposed); scales float32 [L]; cu_seg_lens int32 [S + 1]; seg_slots int32 [S]. Values of
// the index tensors are checked by the CPU kernel only (the CUDA one would need a sync).
inline void check_lora_linear_inputs(const at::Tensor& y, const at::Tensor& x,
                                     const at::Tensor& lora_a, const at::Tensor& lora_b,
                                     const at::Tensor& scales, const at::Tensor& cu_seg_lens,
                                     const at::Tensor& seg_slots) {
  check_dim(y, "y", 2, "[T, N]");
  check_dim(x, "x", 2, "[T, K]");
  check_float_dtype(x, "x");
  check_same_dtype(y, "y", x, "x");
  check_dim(lora_a, "lora_a", 3, "[num_slots, rank, K]");
  check_dim(lora_b, "lora_b", 3, "[num_slots, rank, N] (B transposed)");
  check_dtype(lora_a, "lora_a", at::kFloat);
  check_dtype(lora_b, "lora_b", at::kFloat);
  check_dim(scales, "scales", 1, "[num_slots]");
  check_dtype(scales, "scales", at::kFloat);
  check_dim(cu_seg_lens, "cu_seg_lens", 1, "[S + 1]");
  check_dtype(cu_seg_lens, "cu_seg_lens", at::kInt);
  check_dim(seg_slots, "seg_slots", 1, "[S]");
  check_dtype(seg_slots, "seg_slots", at::kInt);
  const int64_t T = x.size(0), K = x.size(1), N = y.size(1), L = lora_a.size(0);
  TORCH_CHECK(y.size(0) == T, "y has ", y.size(0), " rows but x has ", T);
  TORCH_CHECK(lora_a.size(2) == K, "lora_a's last dim is ", lora_a.size(2),
              " but x has K = ", K, " columns");
  TORCH_CHECK(lora_b.size(0) == L && lora_b.size(1) == lora_a.size(1),
              "lora_b must be [num_slots, rank, N] = [", L, ", ", lora_a.size(1),
              ", N] as lora_a, got shape ", shape_str(lora_b));
  TORCH_CHECK(lora_b.size(2) == N, "lora_b's last dim is ", lora_b.size(2),
              " but y has N = ", N, " columns");
  TORCH_CHECK(scales.size(0) == L, "scales has ", scales.size(0), " entries but lora_a has ", L,
              " slots");
  TORCH_CHECK(cu_seg_lens.size(0) == seg_slots.size(0) + 1, "cu_seg_lens must have one more entry "
              "than seg_slots (", seg_slots.size(0), "), got ", cu_seg_lens.size(0));
  for (const auto& [t, name] : {std::pair{&x, "x"}, {&lora_a, "lora_a"}, {&lora_b, "lora_b"},
                                {&scales, "scales"}, {&cu_seg_lens, "cu_seg_lens"},
                                {&seg_slots, "seg_slots"}}) {
    check_same_device(*t, name, y, "y");
  }
  check_contiguous(y, "y");
}

}  // namespace orca

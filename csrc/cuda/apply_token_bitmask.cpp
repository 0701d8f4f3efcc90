// apply_token_bitmask on CUDA: one elementwise kernel (token_bitmask.cu) on the current stream.
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "checks.h"
#include "cuda/common.h"

namespace orca {
namespace {

void apply_token_bitmask_cuda(at::Tensor& logits, const at::Tensor& bitmask,
                              const std::optional<at::Tensor>& indices) {
  check_token_bitmask_inputs(logits, bitmask, indices);
  cuda::check_cuda(logits, "apply_token_bitmask", "logits");
  const c10::cuda::CUDAGuard guard(logits.device());
  const at::Tensor rows = indices ? indices->contiguous() : at::Tensor();
  cuda::TokenBitmaskParams p{};
  p.logits = logits.data_ptr();
  p.bitmask = bitmask.data_ptr<int32_t>();
  p.rows = rows.defined() ? rows.data_ptr<int64_t>() : nullptr;
  p.num_masks = bitmask.size(0);
  p.num_rows = logits.size(0);
  p.vocab = logits.size(1);
  p.words = bitmask.size(1);
  p.logits_row_stride = logits.stride(0);
  p.element_bytes = static_cast<int32_t>(logits.element_size());
  switch (logits.scalar_type()) {
    case at::kFloat: p.neg_inf_bits = 0xff800000u; break;
    case at::kBFloat16: p.neg_inf_bits = 0xff80u; break;
    default: p.neg_inf_bits = 0xfc00u; break;  // float16
  }
  ORCA_CUDA_LAUNCH_CHECK(
      cuda::launch_apply_token_bitmask(p, c10::cuda::getCurrentCUDAStream(logits.get_device())),
      "apply_token_bitmask");
}

}  // namespace

TORCH_LIBRARY_IMPL(orca, CUDA, m) { m.impl("apply_token_bitmask", &apply_token_bitmask_cuda); }

}  // namespace orca

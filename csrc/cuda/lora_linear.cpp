// lora_linear on CUDA: one kernel on the current stream. The index tensors' values are not
// checked on the host (that would need a sync): a slot outside [-1, num_slots) is skipped.
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "cuda/common.h"
#include "lora_checks.h"
#include "orca/cuda/lora_params.h"

namespace orca {
namespace {

void lora_linear_cuda(at::Tensor& y, const at::Tensor& x, const at::Tensor& lora_a_in,
                      const at::Tensor& lora_b_in, const at::Tensor& scales_in,
                      const at::Tensor& cu_seg_lens_in, const at::Tensor& seg_slots_in) {
  check_lora_linear_inputs(y, x, lora_a_in, lora_b_in, scales_in, cu_seg_lens_in, seg_slots_in);
  cuda::check_cuda(y, "lora_linear", "y");
  TORCH_CHECK(x.stride(1) == 1, "x must have a contiguous last dimension");
  const c10::cuda::CUDAGuard guard(y.device());
  const at::Tensor a = lora_a_in.contiguous(), b = lora_b_in.contiguous();
  const at::Tensor scales = scales_in.contiguous();
  const at::Tensor cu = cu_seg_lens_in.contiguous(), slots = seg_slots_in.contiguous();
  cuda::LoraParams p{};
  p.y = y.data_ptr();
  p.x = x.data_ptr();
  p.lora_a = a.data_ptr<float>();
  p.lora_b = b.data_ptr<float>();
  p.scales = scales.data_ptr<float>();
  p.cu_seg_lens = cu.data_ptr<int32_t>();
  p.seg_slots = slots.data_ptr<int32_t>();
  p.T = x.size(0);
  p.K = x.size(1);
  p.N = y.size(1);
  p.R = a.size(1);
  p.L = a.size(0);
  p.S = slots.size(0);
  p.x_row_stride = x.stride(0);
  ORCA_CUDA_LAUNCH_CHECK(cuda::launch_lora_linear(p, cuda::to_dtype(y.scalar_type()),
                                                  c10::cuda::getCurrentCUDAStream(y.get_device())),
                         "lora_linear");
}

}  // namespace

TORCH_LIBRARY_IMPL(orca, CUDA, m) { m.impl("lora_linear", &lora_linear_cuda); }

}  // namespace orca

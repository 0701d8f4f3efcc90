// rms_norm on CUDA: ATen ops (QK and post norms are a small share of a GPU step).
#include <torch/library.h>

#include "checks.h"

namespace orca {
namespace {

at::Tensor rms_norm_cuda(const at::Tensor& x, const at::Tensor& weight, double eps,
                         const std::optional<at::Tensor>& residual) {
  check_rms_norm_inputs(x, weight, eps, residual);
  const at::Tensor h = x.to(at::kFloat);
  const at::Tensor normalized = (h * at::rsqrt(h.square().mean(-1, true) + eps)).to(x.scalar_type());
  const at::Tensor y = weight * normalized;
  return residual ? *residual + y : y;
}

}  // namespace

TORCH_LIBRARY_IMPL(orca, CUDA, m) { m.impl("rms_norm", &rms_norm_cuda); }

}  // namespace orca

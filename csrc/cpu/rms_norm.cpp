// rms_norm on CPU: the row kernel the fused linears and the DecoderStack use (orca/cpu/norm.h),
// rows split across the intra-op threads; each row's result does not depend on the split, so a
// model's per-op QK and post norms equal the stack's bit for bit.
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "checks.h"
#include "orca/cpu/norm.h"

namespace orca {
namespace {

// Rows of a few KB each: enough of them to pay for a fork-join.
constexpr int64_t kRowsPerTask = 16;

at::Tensor rms_norm_cpu(const at::Tensor& x_in, const at::Tensor& weight_in, double eps,
                        const std::optional<at::Tensor>& residual_in) {
  check_rms_norm_inputs(x_in, weight_in, eps, residual_in);
  const at::Tensor x = x_in.contiguous(), weight = weight_in.contiguous();
  const at::Tensor residual = residual_in ? residual_in->contiguous() : at::Tensor();
  at::Tensor y = at::empty_like(x, at::MemoryFormat::Contiguous);
  const int64_t K = x.size(-1), rows = K == 0 ? 0 : x.numel() / K;
  ORCA_DISPATCH_FLOAT_TYPES(x.scalar_type(), "rms_norm", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    const scalar_t* rp = residual.defined() ? residual.data_ptr<scalar_t>() : nullptr;
    scalar_t* yp = y.data_ptr<scalar_t>();
    at::parallel_for(0, rows, kRowsPerTask, [&](int64_t begin, int64_t end) {
      cpu::rms_norm_rows(xp + begin * K, end - begin, K, weight.data_ptr<scalar_t>(),
                         static_cast<float>(eps), yp + begin * K, rp ? rp + begin * K : nullptr);
    });
  });
  return y;
}

}  // namespace

TORCH_LIBRARY_IMPL(orca, CPU, m) { m.impl("rms_norm", &rms_norm_cpu); }

}  // namespace orca

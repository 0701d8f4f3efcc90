// The fused input norm of packed_linear and quantized_linear: the rows of x normalized as
// their `norm` argument says.
#pragma once

#include <ATen/ATen.h>

#include "checks.h"
#include "orca/cpu/norm.h"
#include "skinny_blocks.h"

namespace orca {

// The most rows normalized on the calling thread with the DecoderStack's row kernels, so that a
// stack's results (up to this many tokens) equal the per-op path's bit for bit.
constexpr int64_t kRowNormMaxT = 64;

// The input rows normalized: up to kRowNormMaxT rows on this thread (orca/cpu/norm.h), more
// through ATen's ops.
inline at::Tensor normalized_input(const at::Tensor& x, const InputNorm& norm) {
  if (x.size(0) > kRowNormMaxT) return normalize_rows(x, norm);
  at::Tensor y = at::empty_like(x);
  const at::Tensor w = norm.weight->contiguous();
  const at::Tensor b = norm.bias ? norm.bias->contiguous() : at::Tensor();
  ORCA_DISPATCH_FLOAT_TYPES(x.scalar_type(), "normalized_input", [&] {
    const auto eps = static_cast<float>(norm.eps);
    if (norm.kind == NormKind::kLayerNorm) {
      cpu::layer_norm_rows(x.data_ptr<scalar_t>(), x.size(0), x.size(1), w.data_ptr<scalar_t>(),
                           b.defined() ? b.data_ptr<scalar_t>() : nullptr, eps,
                           y.data_ptr<scalar_t>());
    } else {
      cpu::rms_norm_rows(x.data_ptr<scalar_t>(), x.size(0), x.size(1), w.data_ptr<scalar_t>(),
                         eps, y.data_ptr<scalar_t>());
    }
  });
  return y;
}

}  // namespace orca

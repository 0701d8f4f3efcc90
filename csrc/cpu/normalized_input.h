// The fused input norm of packed_linear and quantized_linear: the rows of x normalized as
// their `norm` argument says.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include "checks.h"
#include "orca/cpu/norm.h"
#include "skinny_blocks.h"

namespace orca {

// Rows per task of the norm (at::parallel_for runs up to this many on the calling thread: a few
// KB, less work than a fork-join).
constexpr int64_t kRowNormMaxT = 64;

// The input rows normalized by the DecoderStack's row kernels (orca/cpu/norm.h), row by row, so
// that a stack's results equal the per-op path's bit for bit.
inline at::Tensor normalized_input(const at::Tensor& x, const InputNorm& norm) {
  at::Tensor y = at::empty_like(x);
  const at::Tensor w = norm.weight->contiguous();
  const at::Tensor b = norm.bias ? norm.bias->contiguous() : at::Tensor();
  const int64_t K = x.size(1);
  ORCA_DISPATCH_FLOAT_TYPES(x.scalar_type(), "normalized_input", [&] {
    const auto eps = static_cast<float>(norm.eps);
    const auto rows = [&](int64_t begin, int64_t end) {
      const scalar_t* in = x.data_ptr<scalar_t>() + begin * K;
      scalar_t* out = y.data_ptr<scalar_t>() + begin * K;
      if (norm.kind == NormKind::kLayerNorm) {
        cpu::layer_norm_rows(in, end - begin, K, w.data_ptr<scalar_t>(),
                             b.defined() ? b.data_ptr<scalar_t>() : nullptr, eps, out);
      } else {
        cpu::rms_norm_rows(in, end - begin, K, w.data_ptr<scalar_t>(), eps, out);
      }
    };
    at::parallel_for(0, x.size(0), kRowNormMaxT, rows);
  });
  return y;
}

}  // namespace orca
